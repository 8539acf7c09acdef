"""The SGLang adapter driven as SGLang drives it, on the CPU, against the float64 oracle.

Everything SGLang-side comes from the real 0.5.23 wheel (``tests/_sglang_wheel.py``): the
backend class is built on the wheel's ``AttentionBackend`` (so its ``forward`` dispatch runs),
batches are dataclasses with exactly the wheel's ``ForwardBatch`` / ``EagleVerifyInput`` field
names and its dtypes (``seq_lens`` int64, ``extend_seq_lens`` int32, CPU mirrors as lists or
tensors), modes are the wheel's ``ForwardMode``. The pool is shaped like SGLang's
``MHATokenToKVPool`` (per layer ``[size + page_size, H_kv, D]``, slot-indexed), pages are
block-permuted with page 0 null, page size 3, head dim 80, GQA 5:1.

Every mode (EXTEND, MIXED, DECODE, IDLE, TARGET_VERIFY chain and tree, DRAFT_EXTEND_V2) runs
eagerly; DECODE, TARGET_VERIFY and DRAFT_EXTEND_V2 also through the CUDA-graph hooks, 0.5.23's
``init_forward_metadata_out_graph`` and the older capture/replay names, with padded rows.
Outputs are compared with :func:`aiter_attn.testing.oracle.dense_attention` over the K/V in the
pool, and the new K/V must land in SGLang's buffers at ``out_cache_loc``.
"""

from __future__ import annotations

import types

import pytest
import torch

import aiter_attn.integrations.sglang as plugin
from aiter_attn import SpecDecodeConfig
from aiter_attn.testing.oracle import dense_attention

from . import _sglang_wheel as W

PS, HQ, HKV, D, LAYERS = 3, 10, 2, 80, 2
ROWS, WIDTH = 9, 72
TOKENS_PER_PAGE_POOL = 70  # pages, page 0 null


@pytest.fixture(scope="module")
def wheel():
    return W.load_wheel()


@pytest.fixture
def sgl(wheel, monkeypatch):
    """The wheel's classes, and our backend class registered on the wheel's base class."""
    W.install_sglang(wheel, monkeypatch)
    monkeypatch.setattr(plugin, "_backend_class", None)
    assert plugin.register()
    return types.SimpleNamespace(
        cls=plugin._backend_class, FM=W.forward_mode_enum(wheel),
        FB=W.dataclass_from(wheel, W.BATCH_INFO, "ForwardBatch"),
        Verify=W.dataclass_from(wheel, W.EAGLE_INFO, "EagleVerifyInput"),
        Draft=W.dataclass_from(wheel, W.EAGLE_INFO, "EagleDraftInput"),
        AttentionType=W.attention_type_enum(wheel))


class FakeMHATokenToKVPool:
    """SGLang's MHA pool layout: per layer K/V ``[size + page_size, head_num, head_dim]``."""

    def __init__(self, size, page_size, head_num, head_dim, layer_num, g):
        self.size, self.page_size, self.layer_num, self.start_layer = size, page_size, \
            layer_num, 0
        self.k_buffer = [torch.randn(size + page_size, head_num, head_dim, generator=g)
                         for _ in range(layer_num)]
        self.v_buffer = [torch.randn(size + page_size, head_num, head_dim, generator=g)
                         for _ in range(layer_num)]

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id - self.start_layer]


class World:
    """A runner, its pools and requests; lengths are assigned pages on demand."""

    def __init__(self, sgl, seed=0, spec=None):
        self.g = torch.Generator().manual_seed(seed)
        self.sgl = sgl
        pages = TOKENS_PER_PAGE_POOL
        self.pool = FakeMHATokenToKVPool((pages - 1) * PS, PS, HKV, D, LAYERS, self.g)
        self.r2t = torch.zeros(ROWS, WIDTH, dtype=torch.int32)
        self.free = (torch.randperm(pages - 1, generator=self.g) + 1).tolist()  # no page 0
        self.runner = types.SimpleNamespace(
            req_to_token_pool=types.SimpleNamespace(req_to_token=self.r2t, size=ROWS - 1),
            token_to_kv_pool=self.pool, page_size=PS, dtype=torch.float32,
            kv_cache_dtype=torch.float32, device=torch.device("cpu"), use_mla_backend=False,
            is_hybrid_swa=False)
        self.backend = sgl.cls(self.runner, spec=spec)
        self.lens = {}
        self.layers = [self._layer(0, sws=-1, cap=0.0), self._layer(1, sws=5, cap=4.0)]
        self.sinks = torch.randn(HQ, generator=self.g).to(torch.float16)  # SGLang: model dtype

    def _layer(self, i, sws, cap):
        return types.SimpleNamespace(
            layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, tp_v_head_num=HKV, head_dim=D,
            qk_head_dim=D, v_head_dim=D, scaling=D ** -0.5, logit_cap=cap,
            logit_capping_method="tanh", sliding_window_size=sws, is_cross_attention=False,
            attn_type=self.sgl.AttentionType.DECODER, k_scale=None, v_scale=None,
            k_scale_float=None, v_scale_float=None)

    def grow(self, row, total):
        """Give request ``row`` slots for positions up to ``total``; returns the new slots."""
        have = self.lens.get(row, 0)
        for pos in range(have, total):
            if pos % PS == 0:
                self.r2t[row, pos: pos + PS] = torch.arange(PS, dtype=torch.int32) + \
                    self.free.pop() * PS
        self.lens[row] = max(have, total)
        return self.r2t[row, have:total].to(torch.int64)

    def slots(self, row, start, end):
        return self.r2t[row, start:end].to(torch.int64)

    def qkv(self, n):
        g = self.g
        return (torch.randn(n, HQ * D, generator=g), torch.randn(n, HKV, D, generator=g),
                torch.randn(n, HKV, D, generator=g))

    def oracle(self, layer, row, q, total, mask=None):
        """float64 attention of ``q`` (``[n, HQ*D]``, the last n of ``total`` positions)."""
        slots = self.slots(row, 0, total)
        k = self.pool.k_buffer[layer.layer_id][slots]
        v = self.pool.v_buffer[layer.layer_id][slots]
        sws = layer.sliding_window_size  # SGLang's: the flash-attn left window
        assert mask is None or sws < 0, "tree cases here use full-attention layers"
        window = (sws, 0) if sws >= 0 else (-1, -1)
        sinks = self.sinks.float() if layer.layer_id == 1 else None
        return dense_attention(q.view(-1, HQ, D), k, v, scale=layer.scaling,
                               causal=mask is None, window=window, softcap=layer.logit_cap,
                               sinks=sinks, mask=mask)

    def run(self, fb, q, k, v):
        """SGLang's own ``forward`` (the wheel's base class) over both layers."""
        outs = []
        for layer in self.layers:
            sinks = self.sinks if layer.layer_id == 1 else None
            outs.append(self.backend.forward(q, k, v, layer, fb, True, sinks=sinks))
        return outs


def _assert_close(got, want, what):
    got = got.double().view_as(want)
    err = (got - want).norm() / want.norm().clamp_min(1e-12)
    assert err < 2e-5, f"{what}: relative error {err:.2e}"


def _check(world, fb, q, k, v, rows, totals, q_lens, masks=None):
    """Run, then compare each request with the oracle and the written K/V with k/v."""
    outs = world.run(fb, q, k, v)
    loc = fb.out_cache_loc
    for layer, out in zip(world.layers, outs):
        assert out.shape == (q.shape[0], HQ * D)
        torch.testing.assert_close(world.pool.k_buffer[layer.layer_id][loc[: k.shape[0]]], k)
        torch.testing.assert_close(world.pool.v_buffer[layer.layer_id][loc[: v.shape[0]]], v)
        start = 0
        for i, (row, total, n) in enumerate(zip(rows, totals, q_lens)):
            want = world.oracle(layer, row, q[start: start + n], total,
                                None if masks is None else masks[i])
            _assert_close(out[start: start + n], want, f"layer {layer.layer_id} request {i}")
            start += n


def _mirror(values, as_list):
    t = torch.tensor(values, dtype=torch.int64)
    return list(values) if as_list else t


# --------------------------------------------------------------------------------------------
# eager modes


@pytest.mark.parametrize("mode,mirrors_as_lists", [
    pytest.param("EXTEND", True, id="extend-lists"),
    pytest.param("EXTEND", False, id="extend-tensors"),
    pytest.param("MIXED", True, id="mixed"),
])
def test_extend(sgl, mode, mirrors_as_lists):
    w = World(sgl)
    rows, prefix, ext = [1, 4, 7], [0, 7, 13], [9, 4, 1]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    loc = torch.cat([w.grow(r, p + e) for r, p, e in zip(rows, prefix, ext)])
    totals = [p + e for p, e in zip(prefix, ext)]
    q, k, v = w.qkv(sum(ext))
    fb = sgl.FB(
        forward_mode=sgl.FM[mode], batch_size=3,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(totals, dtype=torch.int64), seq_lens_sum=sum(totals),
        seq_lens_cpu=torch.tensor(totals, dtype=torch.int64), out_cache_loc=loc,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
        extend_seq_lens_cpu=_mirror(ext, mirrors_as_lists),
        extend_prefix_lens_cpu=_mirror(prefix, mirrors_as_lists),
        extend_num_tokens=sum(ext),
        positions=torch.cat([torch.arange(p, t) for p, t in zip(prefix, totals)]))
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, totals, ext)


def test_encoder_only_layers_attend_both_ways(sgl):
    """SGLang's encoder-only layers (``AttentionType.ENCODER_ONLY``: BERT-style embedding
    models, run as EXTEND over fresh requests): every token attends over all of its
    request's tokens (K/V written to SGLang's pool first), a window reaching ``sws`` keys to
    either side; the first token sees the later ones (a causal run gives other rows)."""
    w = World(sgl)
    enc = sgl.AttentionType.ENCODER_ONLY
    w.layers = [types.SimpleNamespace(**{**vars(w._layer(0, sws=-1, cap=0.0)), "attn_type": enc}),
                types.SimpleNamespace(**{**vars(w._layer(1, sws=3, cap=4.0)), "attn_type": enc})]
    rows, ext = [2, 5, 6], [9, 1, 14]
    loc = torch.cat([w.grow(r, e) for r, e in zip(rows, ext)])
    q, k, v = w.qkv(sum(ext))
    fb = sgl.FB(
        forward_mode=sgl.FM["EXTEND"], batch_size=3,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(ext, dtype=torch.int64), seq_lens_sum=sum(ext),
        seq_lens_cpu=torch.tensor(ext, dtype=torch.int64), out_cache_loc=loc,
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_prefix_lens=torch.zeros(3, dtype=torch.int32),
        extend_seq_lens_cpu=list(ext), extend_prefix_lens_cpu=[0, 0, 0],
        extend_num_tokens=sum(ext),
        positions=torch.cat([torch.arange(e) for e in ext]))
    w.backend.init_forward_metadata(fb)
    outs = w.run(fb, q, k, v)
    for layer, out in zip(w.layers, outs):
        torch.testing.assert_close(w.pool.k_buffer[layer.layer_id][loc], k)
        sws = layer.sliding_window_size
        window = (sws, sws) if sws >= 0 else (-1, -1)
        sinks = w.sinks.float() if layer.layer_id == 1 else None
        start = 0
        for i, (row, n) in enumerate(zip(rows, ext)):
            slots = w.slots(row, 0, n)
            kr, vr = w.pool.k_buffer[layer.layer_id][slots], w.pool.v_buffer[layer.layer_id][slots]
            qr = q[start: start + n].view(-1, HQ, D)
            want = dense_attention(qr, kr, vr, scale=layer.scaling, causal=False, window=window,
                                   softcap=layer.logit_cap, sinks=sinks)
            _assert_close(out[start: start + n], want, f"layer {layer.layer_id} request {i}")
            if n > 1 and layer.layer_id == 0:
                causal = dense_attention(qr, kr, vr, scale=layer.scaling, causal=True)
                assert (causal[0].double() - want[0]).norm() > 1e-3 * want[0].norm()
            start += n


def test_bidirectional_decoder_layers_are_refused(sgl):
    """``DECODER_BIDIRECTIONAL`` (bidirectional only under some server settings and the
    diffusion modes) is refused with the fix; an encoder-only layer maps to causal=False."""
    w = World(sgl)
    layer = types.SimpleNamespace(**{**vars(w._layer(0, sws=-1, cap=0.0)),
                                     "attn_type": sgl.AttentionType.DECODER_BIDIRECTIONAL})
    from aiter_attn.integrations.sglang.translate import layer_spec

    with pytest.raises(ValueError, match="encoder-only layers; serve this model with another"):
        layer_spec(layer)
    assert layer_spec(w.layers[0]).causal
    enc = types.SimpleNamespace(**{**vars(w._layer(0, sws=-1, cap=0.0)),
                                   "attn_type": sgl.AttentionType.ENCODER_ONLY})
    assert not layer_spec(enc).causal and not layer_spec(enc).is_causal


def _decode_batch(sgl, w, rows, totals, as_list=False):
    loc = torch.cat([w.grow(r, t) for r, t in zip(rows, totals)])
    return sgl.FB(forward_mode=sgl.FM.DECODE, batch_size=len(rows),
                  req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                  seq_lens=torch.tensor(totals, dtype=torch.int64), seq_lens_sum=sum(totals),
                  seq_lens_cpu=_mirror(totals, as_list), out_cache_loc=loc,
                  positions=torch.tensor(totals, dtype=torch.int64) - 1)


@pytest.mark.parametrize("as_list", [False, True], ids=["mirror-tensor", "mirror-list"])
def test_decode(sgl, as_list):
    w = World(sgl)
    rows, totals = [2, 3, 5, 8], [1, 8, 23, 40]
    for r, t in zip(rows, totals):
        w.grow(r, t - 1)
    fb = _decode_batch(sgl, w, rows, totals, as_list)
    q, k, v = w.qkv(4)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, totals, [1] * 4)


def test_idle(sgl):
    w = World(sgl)
    fb = sgl.FB(forward_mode=sgl.FM.IDLE, batch_size=0,
                req_pool_indices=torch.zeros(0, dtype=torch.int64),
                seq_lens=torch.zeros(0, dtype=torch.int64), seq_lens_sum=0,
                seq_lens_cpu=torch.zeros(0, dtype=torch.int64),
                out_cache_loc=torch.zeros(0, dtype=torch.int64))
    w.backend.init_forward_metadata(fb)
    q, k, v = w.qkv(0)
    outs = w.run(fb, q, k, v)
    assert all(o.shape == (0, HQ * D) for o in outs)


def _verify_batch(sgl, w, rows, prefix, draft, topk, custom_mask=None):
    loc = torch.cat([w.grow(r, p + draft) for r, p in zip(rows, prefix)])
    info = sgl.Verify(draft_token_num=draft, topk=topk, custom_mask=custom_mask,
                      num_tokens_per_req=-1, spec_steps=draft - 1)
    return sgl.FB(forward_mode=sgl.FM.TARGET_VERIFY, batch_size=len(rows),
                  req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                  # SGLang's verify seq_lens exclude the draft tokens
                  seq_lens=torch.tensor(prefix, dtype=torch.int64), seq_lens_sum=sum(prefix),
                  seq_lens_cpu=torch.tensor(prefix, dtype=torch.int64), out_cache_loc=loc,
                  spec_info=info,
                  positions=torch.cat([torch.arange(p, p + draft) for p in prefix]))


def test_target_verify_chain(sgl):
    draft = 3
    w = World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=draft))
    rows, prefix = [1, 6], [5, 17]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    fb = _verify_batch(sgl, w, rows, prefix, draft, topk=1)
    q, k, v = w.qkv(len(rows) * draft)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, [p + draft for p in prefix], [draft] * 2)


def _tree_masks(prefix, draft):
    """SGLang's flat custom mask (per request ``[draft, prefix + draft]`` row-major) for the
    tree 0 → {1, 2}, 1 → 3, and the same blocks as bool for the oracle."""
    parent = [-1, 0, 0, 1][:draft]
    blocks = []
    for p in prefix:
        m = torch.zeros(draft, p + draft, dtype=torch.bool)
        m[:, :p] = True
        for i in range(draft):
            j = i
            while j >= 0:
                m[i, p + j] = True
                j = parent[j]
        blocks.append(m)
    return torch.cat([b.flatten() for b in blocks]), blocks


def test_target_verify_tree(sgl):
    draft = 4
    w = World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=2, num_draft_tokens=draft))
    w.layers = w.layers[:1]  # full attention: the tree mask alone decides visibility
    rows, prefix = [2, 3], [6, 11]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    flat, blocks = _tree_masks(prefix, draft)
    fb = _verify_batch(sgl, w, rows, prefix, draft, topk=2, custom_mask=flat)
    q, k, v = w.qkv(len(rows) * draft)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, [p + draft for p in prefix], [draft] * 2, masks=blocks)


def _draft_extend_batch(sgl, w, rows, totals, n):
    loc = torch.cat([w.slots(r, t - n, t) for r, t in zip(rows, totals)])
    return sgl.FB(forward_mode=sgl.FM.DRAFT_EXTEND_V2, batch_size=len(rows),
                  req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                  # SGLang's draft-extend seq_lens already count the n written tokens
                  seq_lens=torch.tensor(totals, dtype=torch.int64), seq_lens_sum=sum(totals),
                  seq_lens_cpu=torch.tensor(totals, dtype=torch.int64), out_cache_loc=loc,
                  extend_seq_lens_cpu=[n] * len(rows), spec_info=sgl.Draft(),
                  positions=torch.cat([torch.arange(t - n, t) for t in totals]))


def test_draft_extend_v2(sgl):
    n = 3
    w = World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=n))
    rows, totals = [4, 5, 7], [4, 12, 30]
    for r, t in zip(rows, totals):
        w.grow(r, t)
    fb = _draft_extend_batch(sgl, w, rows, totals, n)
    q, k, v = w.qkv(len(rows) * n)
    w.backend.init_forward_metadata(fb)
    _check(w, fb, q, k, v, rows, totals, [n] * 3)


def test_forward_needs_the_planned_batch(sgl):
    w = World(sgl)
    rows, totals = [1], [4]
    w.grow(1, 3)
    fb = _decode_batch(sgl, w, rows, totals)
    q, k, v = w.qkv(1)
    w.backend.init_forward_metadata(fb)
    other = _decode_batch(sgl, w, rows, totals)
    with pytest.raises(RuntimeError, match="not planned"):
        w.run(other, q, k, v)
    with pytest.raises(TypeError, match="k_rope"):
        w.backend.forward(q, k, v, w.layers[0], fb, True, k_rope=q)


def test_decode_like_batch_without_cpu_mirror_is_refused(sgl):
    w = World(sgl)
    w.grow(1, 3)
    fb = _decode_batch(sgl, w, [1], [4])
    fb.seq_lens_cpu = None
    with pytest.raises(ValueError, match="needs_cpu_seq_lens"):
        w.backend.init_forward_metadata(fb)
    assert w.backend.needs_cpu_seq_lens is True


def test_unsupported_models_are_refused_with_the_fix(sgl):
    w = World(sgl)
    mla = types.SimpleNamespace(**{**vars(w.runner), "use_mla_backend": True})
    with pytest.raises(ValueError, match="MLA"):
        sgl.cls(mla)
    swa = types.SimpleNamespace(**{**vars(w.runner), "is_hybrid_swa": True})
    with pytest.raises(ValueError, match="disable-hybrid-swa-memory"):
        sgl.cls(swa)


# --------------------------------------------------------------------------------------------
# CUDA-graph hooks: capture with all-padding rows, replay real rows padded to the size


def _graph_case(sgl, mode):
    """``(world, q_per_request, make(rows, lens) -> (real fb, expected totals))``."""
    if mode == "DECODE":
        w = World(sgl)

        def make(rows, lens):
            for r, t in zip(rows, lens):
                w.grow(r, t - 1)
            return _decode_batch(sgl, w, rows, lens), lens
        return w, 1, make
    if mode == "TARGET_VERIFY":
        draft = 3
        w = World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=draft))

        def make(rows, lens):
            for r, p in zip(rows, lens):
                w.grow(r, p)
            return _verify_batch(sgl, w, rows, lens, draft, 1), [p + draft for p in lens]
        return w, draft, make
    n = 3
    w = World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=1, num_draft_tokens=n))

    def make(rows, lens):
        for r, t in zip(rows, lens):
            w.grow(r, t)
        return _draft_extend_batch(sgl, w, rows, lens, n), lens
    return w, n, make


def _static_batch(sgl, mode, bs, q, fill):
    """SGLang's capture batch: its static buffers, all rows padding (fill value, row 0)."""
    FM = sgl.FM
    spec = None
    if mode == "TARGET_VERIFY":
        spec = sgl.Verify(draft_token_num=q, topk=1, num_tokens_per_req=-1)
    elif mode == "DRAFT_EXTEND_V2":
        spec = sgl.Draft()
    return sgl.FB(forward_mode=FM[mode], batch_size=bs,
                  req_pool_indices=torch.zeros(bs, dtype=torch.int64),
                  seq_lens=torch.full((bs,), fill, dtype=torch.int64), seq_lens_sum=bs * fill,
                  seq_lens_cpu=torch.full((bs,), fill, dtype=torch.int64),
                  out_cache_loc=torch.zeros(bs * q, dtype=torch.int64),
                  positions=torch.zeros(bs * q, dtype=torch.int64), spec_info=spec)


def _load_static(static, real, bs, q, fill):
    """What SGLang's graph runner does before replay: copy the real rows into its static
    buffers and pad the rest (fill value, request row 0, slot 0)."""
    raw = real.batch_size
    static.seq_lens.fill_(fill)
    static.seq_lens[:raw] = real.seq_lens
    static.seq_lens_cpu.fill_(fill)
    static.seq_lens_cpu[:raw] = torch.as_tensor(real.seq_lens_cpu)
    static.req_pool_indices.zero_()
    static.req_pool_indices[:raw] = real.req_pool_indices
    static.out_cache_loc.zero_()
    static.out_cache_loc[: raw * q] = real.out_cache_loc


def _replay_view(real, static, bs, fill):
    """``build_replay_fb_view`` of the wheel: padded buffers + the real batch's fields."""
    raw = real.batch_size
    return types.SimpleNamespace(
        batch_size=bs, forward_mode=static.forward_mode, actual_forward_mode=real.forward_mode,
        positions=static.positions, req_pool_indices=static.req_pool_indices[:bs],
        seq_lens=static.seq_lens[:bs], seq_lens_sum=real.seq_lens_sum + (bs - raw) * fill,
        seq_lens_cpu=static.seq_lens_cpu[:bs], max_seq_len_host=None, num_padding=bs - raw,
        encoder_lens=None, out_cache_loc=real.out_cache_loc, spec_info=real.spec_info)


@pytest.mark.parametrize("hooks", ["out_graph", "legacy"])
@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"])
def test_graph_capture_then_replay(sgl, mode, hooks):
    w, q, make = _graph_case(sgl, mode)
    bs = 4
    be = w.backend
    be.init_cuda_graph_state(bs, bs * q)
    fill = be.get_cuda_graph_seq_len_fill_value()
    assert fill == 1
    static = _static_batch(sgl, mode, bs, q, fill)
    qs, ks, vs = (torch.zeros(bs * q, HQ * D), torch.zeros(bs * q, HKV, D),
                  torch.zeros(bs * q, HKV, D))
    # capture: plan outside the graph, record in-graph prep (none), run the captured forward
    if hooks == "out_graph":
        be.init_forward_metadata_out_graph(static, in_capture=True)
        be.init_forward_metadata_in_graph(static)
    else:
        be.init_forward_metadata_capture_cuda_graph(
            bs, bs * q, static.req_pool_indices, static.seq_lens, None, static.forward_mode,
            static.spec_info)
    w.run(static, qs, ks, vs)
    for step, (rows, lens) in enumerate([([1, 3, 6], [5, 9, 20]), ([2, 4, 5, 8], [3, 4, 7, 26])]):
        real, totals = make(rows, lens)
        raw = len(rows)
        q_real, k_real, v_real = w.qkv(raw * q)
        _load_static(static, real, bs, q, fill)
        for buf, val in ((qs, q_real), (ks, k_real), (vs, v_real)):
            buf.zero_()
            buf[: raw * q] = val
        if hooks == "out_graph":
            be.init_forward_metadata_out_graph(_replay_view(real, static, bs, fill))
        else:  # older SGLang's replay call: positional, no out_cache_loc
            be.init_forward_metadata_replay_cuda_graph(
                bs, static.req_pool_indices[:bs], static.seq_lens[:bs],
                int(static.seq_lens_sum or 0), None, static.forward_mode, real.spec_info,
                seq_lens_cpu=static.seq_lens_cpu[:bs])
        # "graph.replay()": the captured forward runs again on the captured batch object
        outs = w.run(static, qs, ks, vs)
        for layer, out in zip(w.layers, outs):
            torch.testing.assert_close(
                w.pool.k_buffer[layer.layer_id][real.out_cache_loc], k_real)
            start = 0
            for r, t in zip(rows, totals):
                want = w.oracle(layer, r, q_real[start: start + q], t)
                _assert_close(out[start: start + q], want, f"{mode} step {step} row {r}")
                start += q


def test_out_graph_without_graph_state_plans_eagerly(sgl):
    w = World(sgl)
    w.grow(1, 6)
    fb = _decode_batch(sgl, w, [1], [7])
    w.backend.init_forward_metadata_out_graph(fb)
    w.backend.init_forward_metadata_in_graph(fb)
    q, k, v = w.qkv(1)
    _check(w, fb, q, k, v, [1], [7], [1])


@pytest.mark.parametrize("mode", ["DECODE", "TARGET_VERIFY", "DRAFT_EXTEND_V2"])
def test_translation_makes_no_device_sync(sgl, mode):
    """Decode-like batches translate with every device tensor on ``meta`` (any read-back
    would raise): host integers come from the CPU mirrors only."""
    from aiter_attn.integrations.sglang.translate import to_forward_batch

    w, q, make = _graph_case(sgl, mode)
    real, totals = make([1, 3], [5, 9])
    meta = lambda t: None if t is None else torch.empty_like(t, device="meta")  # noqa: E731
    for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
        setattr(real, name, meta(getattr(real, name)))
    batch = to_forward_batch(real)
    assert batch.seq_lens.device.type == "meta" and batch.seq_lens.dtype == torch.int32
    assert batch.seq_lens_cpu.tolist() == totals
