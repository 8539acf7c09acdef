"""SGLang batches padded for DP attention, padded by the real 0.5.23 wheel's
``ForwardBatch._pad_inputs_to_size`` (``tests/_sglang_wheel.py``), planned and run as SGLang
plans and runs them.

Under ``--enable-dp-attention`` ``prepare_mlp_sync_batch`` pads every batch to the token count
the DP ranks agreed on: ``out_cache_loc`` / ``positions`` get zero slots and positions, q/k/v
get zero rows, and

* EXTEND (prefill, MIXED) keeps its requests: ``extend_seq_lens`` and the CPU mirrors are not
  padded, so ``out_cache_loc`` is longer than the requests' new tokens;
* a DECODE batch under MAX_LEN padding becomes a 1-token EXTEND per request, padded the same
  way; an idle rank gets one fabricated request in row 0 covering every padded token;
* TARGET_VERIFY / DRAFT_EXTEND_V2 get whole padding rows (row 0, ``seq_lens`` the fill value).
  DRAFT_EXTEND_V2's eager plan is made *before* the padding (``eagle_worker_common``: "Planned
  pre-pad; do NOT opt into post-pad re-plan") and then run on the padded batch.

In each case the requests' rows must match the oracle, the padding rows must be zeros (never
NaN, never a live request's result), and K/V may land only in the batch's own slots (and
SGLang's padding slot 0, which the wheel's own padding names as the target of padded writes).
"""

from __future__ import annotations

import types

import pytest
import torch

from aiter_attn import SpecDecodeConfig

from . import _sglang_wheel as W
from . import test_sglang_adapter as A
from .test_sglang_adapter import HQ, D, sgl, wheel  # noqa: F401  (fixtures)
from .test_sglang_serving_paths import _extend_case


@pytest.fixture
def pad(wheel):
    return W.batch_padding(wheel)


def _runner(w):
    return types.SimpleNamespace(attn_backend=w.backend)


def _snapshot(w):
    return [(k.clone(), v.clone()) for k, v in zip(w.pool.k_buffer, w.pool.v_buffer)]


def _assert_only_slots_written(w, before, allowed):
    """K/V of every layer unchanged outside ``allowed`` slots."""
    keep = torch.ones(w.pool.k_buffer[0].shape[0], dtype=torch.bool)
    keep[torch.as_tensor(allowed, dtype=torch.int64)] = False
    for i, (k0, v0) in enumerate(before):
        assert torch.equal(w.pool.k_buffer[i][keep], k0[keep]), f"layer {i}: K written elsewhere"
        assert torch.equal(w.pool.v_buffer[i][keep], v0[keep]), f"layer {i}: V written elsewhere"


def _check_rows(w, outs, q, rows, totals, q_lens):
    for layer, out in zip(w.layers, outs):
        assert out.shape == (q.shape[0], HQ * D)
        start = 0
        for row, total, m in zip(rows, totals, q_lens):
            want = w.oracle(layer, row, q[start: start + m], total)
            A._assert_close(out[start: start + m], want, f"layer {layer.layer_id} row {row}")
            start += m
        assert torch.equal(out[start:], torch.zeros_like(out[start:])), \
            f"layer {layer.layer_id}: padding rows are not zeros"


def test_the_wheel_pads_slots_but_not_extend_lengths(sgl, wheel, pad):
    """The fact the adapter relies on, read from the wheel: EXTEND keeps its requests
    (``bs`` unchanged) while ``out_cache_loc`` grows to the agreed token count."""
    w = A.World(sgl)
    fb, rows, totals, ext = _extend(sgl, w)
    n = sum(ext)
    pad(fb, _runner(w), n + 4, fb.batch_size)
    assert fb.out_cache_loc.shape[0] == n + 4 and fb.positions.shape[0] == n + 4
    assert fb.out_cache_loc[n:].eq(0).all()
    assert fb.extend_seq_lens.tolist() == ext and list(fb.extend_seq_lens_cpu) == ext


def _extend(sgl, w):
    fb, rows, totals, ext = _extend_case(sgl, w)
    fb.input_ids = torch.arange(sum(ext))
    return fb, rows, totals, ext


@pytest.mark.parametrize("extra", [1, 7])
def test_padded_extend(sgl, pad, extra):
    w = A.World(sgl)
    fb, rows, totals, ext = _extend(sgl, w)
    n = sum(ext)
    pad(fb, _runner(w), n + extra, fb.batch_size)
    q, k, v = w.qkv(n + extra)
    before = _snapshot(w)
    w.backend.init_forward_metadata(fb)
    outs = w.run(fb, q, k, v)
    real = fb.out_cache_loc[:n]
    for layer in w.layers:
        torch.testing.assert_close(w.pool.k_buffer[layer.layer_id][real], k[:n])
        torch.testing.assert_close(w.pool.v_buffer[layer.layer_id][real], v[:n])
    _assert_only_slots_written(w, before, real)
    _check_rows(w, outs, q, rows, totals, ext)


def test_decode_relabelled_as_extend_under_max_len_padding(sgl, pad):
    """``prepare_mlp_sync_batch`` under MAX_LEN (``materializes_dummy_extend``): the decode
    rows become 1-token extends, then the tokens are padded."""
    w = A.World(sgl)
    rows, totals = [2, 5, 8], [4, 13, 30]
    for r, t in zip(rows, totals):
        w.grow(r, t - 1)
    fb = A._decode_batch(sgl, w, rows, totals)
    fb.input_ids = torch.arange(len(rows))
    # the relabel, as the wheel writes it (before padding, on the unpadded rows)
    fb.forward_mode = sgl.FM.EXTEND
    fb.extend_num_tokens = len(rows)
    fb.extend_seq_lens = torch.full_like(fb.seq_lens, 1)
    fb.extend_prefix_lens = fb.seq_lens - 1
    fb.extend_prefix_lens_cpu = fb.extend_prefix_lens.tolist()
    fb.extend_seq_lens_cpu = fb.extend_seq_lens.tolist()
    pad(fb, _runner(w), 8, len(rows))
    q, k, v = w.qkv(8)
    before = _snapshot(w)
    w.backend.init_forward_metadata(fb)
    outs = w.run(fb, q, k, v)
    _assert_only_slots_written(w, before, fb.out_cache_loc[:3])
    _check_rows(w, outs, q, rows, totals, [1, 1, 1])


def test_idle_rank_with_a_fabricated_request(sgl, pad):
    """An idle rank under MAX_LEN prefill padding: one request, row 0 of ``req_to_token``
    (never a live request's: SGLang's free rows start at 1), covering every padded token,
    all written to slot 0. Nothing live is read or written; the output is finite."""
    w = A.World(sgl)
    w.grow(3, 9)  # a live request elsewhere
    n = 6
    fb = sgl.FB(forward_mode=sgl.FM.EXTEND, batch_size=1,
                req_pool_indices=torch.zeros(0, dtype=torch.int64),
                seq_lens=torch.tensor([n], dtype=torch.int64), seq_lens_sum=n,
                seq_lens_cpu=torch.tensor([n], dtype=torch.int64),
                out_cache_loc=torch.zeros(0, dtype=torch.int64),
                positions=torch.zeros(0, dtype=torch.int64), input_ids=torch.zeros(0),
                extend_num_tokens=n, extend_seq_lens=torch.tensor([n], dtype=torch.int32),
                extend_prefix_lens=torch.zeros(1, dtype=torch.int64),
                extend_prefix_lens_cpu=[0], extend_seq_lens_cpu=[n])
    pad(fb, _runner(w), n, 1)
    assert fb.req_pool_indices.tolist() == [0] and fb.out_cache_loc.tolist() == [0] * n
    q, k, v = w.qkv(n)
    before = _snapshot(w)
    w.backend.init_forward_metadata(fb)
    outs = w.run(fb, q, k, v)
    _assert_only_slots_written(w, before, [0])
    for out in outs:
        assert out.shape == (n, HQ * D) and torch.isfinite(out).all()


def test_target_verify_with_padding_rows(sgl, pad):
    """Eager verify is planned after the padding (``eagle_utils``: "defer init to
    forward_extend, which runs after prepare_mlp_sync_batch pads the batch")."""
    draft = 3
    w = A.World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=draft))
    rows, prefix = [1, 6], [5, 17]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    fb = A._verify_batch(sgl, w, rows, prefix, draft, topk=1)
    fb.spec_info.num_tokens_per_req = draft
    fb.spec_info.is_draft_input = lambda: False
    fb.input_ids = torch.arange(len(rows) * draft)
    own = fb.out_cache_loc.clone()
    bs = fb.batch_size = 4  # prepare_mlp_sync_batch: num_tokens // num_tokens_per_req
    pad(fb, _runner(w), bs * draft, bs)
    q, k, v = w.qkv(bs * draft)
    before = _snapshot(w)
    w.backend.init_forward_metadata(fb)
    outs = w.run(fb, q, k, v)
    _assert_only_slots_written(w, before, torch.cat([own, torch.zeros(1, dtype=torch.int64)]))
    for layer, out in zip(w.layers, outs):
        assert torch.isfinite(out).all()
        for i, (r, p) in enumerate(zip(rows, prefix)):
            want = w.oracle(layer, r, q[i * draft: (i + 1) * draft], p + draft)
            A._assert_close(out[i * draft: (i + 1) * draft], want, f"row {r}")


def test_draft_extend_v2_planned_before_the_padding(sgl, pad):
    """``eagle_worker_common.prepare_for_extend_to_fill_draft_kvcache`` plans the unpadded
    batch and marks it ready; ``prepare_mlp_sync_batch`` then pads that same batch object and
    the layers run on it."""
    n = 3
    w = A.World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=n))
    rows, totals = [4, 5, 7], [4, 12, 30]
    for r, t in zip(rows, totals):
        w.grow(r, t)
    fb = A._draft_extend_batch(sgl, w, rows, totals, n)
    info = fb.spec_info
    info.num_tokens_per_req, info.hidden_states = n, None
    info.is_draft_input = lambda: True
    info.pad_batch = lambda pad_fn, bs: None
    fb.input_ids = torch.arange(len(rows) * n)
    own = fb.out_cache_loc.clone()
    w.backend.init_forward_metadata(fb)  # pre-pad plan
    bs = fb.batch_size = 5  # prepare_mlp_sync_batch: num_tokens // num_tokens_per_req
    pad(fb, _runner(w), bs * n, bs)
    q, k, v = w.qkv(bs * n)
    before = _snapshot(w)
    outs = w.run(fb, q, k, v)
    _assert_only_slots_written(w, before, own)
    _check_rows(w, outs, q, rows, totals, [n] * 3)
