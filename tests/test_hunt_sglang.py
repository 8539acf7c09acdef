"""Defects found hunting the SGLang adapter (``aiter_attn/integrations/sglang``): each test
failed before its fix.

The cases drive the backend built on the real 0.5.23 wheel's base class, with the
SGLang-shaped runner, pool (block-permuted pages, null page 0) and batches of
``tests/test_sglang_adapter.py``, and compare with the float64 oracle.
"""

from __future__ import annotations

import ast
import types

import pytest
import torch

from aiter_attn import SpecDecodeConfig

from . import _sglang_wheel as W
from . import test_sglang_adapter as A
from .test_sglang_adapter import HKV, HQ, D, sgl, wheel  # noqa: F401  (fixtures)

DRAFT = 4


def _tree_world(sgl):
    w = A.World(sgl, spec=SpecDecodeConfig(num_steps=2, topk=2, num_draft_tokens=DRAFT))
    w.layers = w.layers[:1]  # full attention: the tree mask alone decides visibility
    return w


def _check_tree_rows(w, out, q, rows, prefix, blocks):
    for i, (r, p) in enumerate(zip(rows, prefix)):
        sl = slice(i * DRAFT, (i + 1) * DRAFT)
        want = w.oracle(w.layers[0], r, q[sl], p + DRAFT, blocks[i])
        A._assert_close(out[sl], want, f"request {i} (row {r}, prefix {p})")


# --------------------------------------------------------------------------------------------
# Tree verify with padding rows: SGLang's mask covers the real requests only


def _capture_tree_graph(sgl, w, bs):
    """Capture as SGLang's decode graph runner does for TARGET_VERIFY: every row padding,
    ``spec_info.custom_mask`` its static all-True buffer (``base_runner``:
    ``(max_bs * fill + max_num_token) * num_tokens_per_req`` elements)."""
    be = w.backend
    be.init_cuda_graph_state(bs, bs * DRAFT)
    fill = be.get_cuda_graph_seq_len_fill_value()
    static = A._static_batch(sgl, "TARGET_VERIFY", bs, DRAFT, fill)
    static.spec_info = sgl.Verify(
        draft_token_num=DRAFT, topk=2, num_tokens_per_req=-1,
        custom_mask=torch.ones((bs * fill + bs * DRAFT) * DRAFT, dtype=torch.bool))
    bufs = tuple(torch.zeros(bs * DRAFT, *shape) for shape in ((HQ * D,), (HKV, D), (HKV, D)))
    be.init_forward_metadata_out_graph(static, in_capture=True)
    be.init_forward_metadata_in_graph(static)
    w.run(static, *bufs)
    return static, bufs, fill


@pytest.mark.parametrize("hooks,prefix", [
    pytest.param("out_graph", [5, 9, 20], id="out_graph-3-of-4-rows"),
    pytest.param("legacy", [5, 9, 20], id="legacy-3-of-4-rows"),
    # one request of 12 + 4 tokens: its [4, 16] block has exactly batch·q² = 4·4² elements,
    # the size of the tree-only layout of the padded batch of 4 (0.5.23's replay view names
    # the padding rows, which settles it)
    pytest.param("out_graph", [12], id="out_graph-1-of-4-rows-size-of-tree-layout"),
])
def test_tree_verify_graph_replay_with_padding_rows(sgl, hooks, prefix):
    """EAGLE tree verify replayed in a CUDA graph of 4 rows with fewer requests. SGLang's
    ``spec_info.custom_mask`` holds the real requests' ``[q, seq_len + q]`` blocks only
    (``build_tree_kernel_efficient`` sizes it from the unpadded batch; SGLang's own backends
    pad it with True, e.g. ``NgramVerifyInput.generate_attn_arg_prefill``: "Pad custom_mask
    when CUDA graph pads batch size"). The adapter planned the padded batch against the
    unpadded mask: a ValueError on replay ("custom_mask has 184 elements; expected …"), or,
    when the real blocks happened to have batch·q² elements, the mask read as the tree-only
    layout and wrong attention (relative error 0.38)."""
    w = _tree_world(sgl)
    bs = 4
    static, (qs, ks, vs), fill = _capture_tree_graph(sgl, w, bs)
    rows = [1, 3, 6][: len(prefix)]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    flat, blocks = A._tree_masks(prefix, DRAFT)
    real = A._verify_batch(sgl, w, rows, prefix, DRAFT, topk=2, custom_mask=flat)
    raw = len(rows)
    q, k, v = w.qkv(raw * DRAFT)
    A._load_static(static, real, bs, DRAFT, fill)
    for buf, val in ((qs, q), (ks, k), (vs, v)):
        buf.zero_()
        buf[: raw * DRAFT] = val
    if hooks == "out_graph":
        w.backend.init_forward_metadata_out_graph(A._replay_view(real, static, bs, fill))
    else:
        w.backend.init_forward_metadata_replay_cuda_graph(
            bs, static.req_pool_indices[:bs], static.seq_lens[:bs],
            int(static.seq_lens_sum or 0), None, static.forward_mode, real.spec_info,
            seq_lens_cpu=static.seq_lens_cpu[:bs])
    (out,) = w.run(static, qs, ks, vs)
    _check_tree_rows(w, out, q, rows, prefix, blocks)


def test_tree_verify_eager_with_dp_padding_rows(sgl, wheel):
    """The same under DP attention, eagerly: ``prepare_mlp_sync_batch`` pads a verify batch
    with whole rows (``bs = num_tokens // num_tokens_per_req``, padded by the wheel's own
    ``_pad_inputs_to_size``) and leaves ``spec_info.custom_mask`` as built for the real
    requests; the adapter refused the batch (ValueError on the mask size)."""
    pad = W.batch_padding(wheel)
    w = _tree_world(sgl)
    rows, prefix = [2, 5], [6, 11]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    flat, blocks = A._tree_masks(prefix, DRAFT)
    fb = A._verify_batch(sgl, w, rows, prefix, DRAFT, topk=2, custom_mask=flat)
    fb.spec_info.num_tokens_per_req = DRAFT
    fb.spec_info.is_draft_input = lambda: False
    fb.input_ids = torch.arange(len(rows) * DRAFT)
    bs = fb.batch_size = 4
    pad(fb, types.SimpleNamespace(attn_backend=w.backend), bs * DRAFT, bs)
    assert fb.spec_info.custom_mask.numel() == flat.numel()  # the wheel leaves it unpadded
    q, k, v = w.qkv(bs * DRAFT)
    w.backend.init_forward_metadata(fb)
    (out,) = w.run(fb, q, k, v)
    assert torch.isfinite(out).all()
    _check_tree_rows(w, out, q, rows, prefix, blocks)


def test_replay_view_names_its_padding_rows(wheel):
    """What the fix above reads: 0.5.23's ``build_replay_fb_view`` carries
    ``num_padding=bs - raw_bs`` (the older replay hooks do not: the adapter then finds the
    real rows from the mask's size)."""
    src = wheel.read("sglang/srt/model_executor/runner/decode_cuda_graph_runner.py")
    assert "num_padding=bs - raw_bs" in src


# --------------------------------------------------------------------------------------------
# NGRAM speculative decoding: a verify input without ``topk``

NGRAM_INFO = "sglang/srt/speculative/ngram_info.py"


def _ngram_verify_input(wheel, **values):
    """An object with exactly the attributes ``NgramVerifyInput.__init__`` sets (read from
    the wheel: no ``topk``; its tree is irregular, ``tree_topk`` -1)."""
    cls = W.find_class(wheel.tree(NGRAM_INFO), "NgramVerifyInput")
    init = W.methods(cls)["__init__"]
    names = {t.attr for node in ast.walk(init) if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Attribute)}
    assert "topk" not in names and {"custom_mask", "draft_token_num"} <= names
    obj = types.SimpleNamespace(**{n: None for n in names})
    for k, v in values.items():
        assert k in names, k
        setattr(obj, k, v)
    obj.tree_topk = -1
    return obj


def test_ngram_tree_verify(sgl, wheel):
    """``--speculative-algorithm NGRAM`` verifies a trie of corpus matches with SGLang's
    FULL_MASK tree mask; its ``NgramVerifyInput`` has no ``topk`` (the server sets
    ``speculative_eagle_topk`` to ``--speculative-ngram-max-bfs-breadth``, 10 by default, which
    the plugin's config reads). The adapter read the missing ``topk`` as 1 (a chain) and every
    verify step was refused ("spec_info.topk=1 is a chain but this backend plans tree
    verify"); the tree must be served with its mask."""
    w = A.World(sgl, spec=SpecDecodeConfig(num_steps=1, topk=10, num_draft_tokens=DRAFT))
    w.layers = w.layers[:1]
    rows, prefix = [2, 5], [6, 11]
    for r, p in zip(rows, prefix):
        w.grow(r, p)
    flat, blocks = A._tree_masks(prefix, DRAFT)
    fb = A._verify_batch(sgl, w, rows, prefix, DRAFT, topk=2, custom_mask=flat)
    fb.spec_info = _ngram_verify_input(wheel, custom_mask=flat, draft_token_num=DRAFT,
                                       num_tokens_per_req=DRAFT)
    q, k, v = w.qkv(len(rows) * DRAFT)
    w.backend.init_forward_metadata(fb)
    (out,) = w.run(fb, q, k, v)
    _check_tree_rows(w, out, q, rows, prefix, blocks)
