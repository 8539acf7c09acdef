"""Cascade (shared-prefix) attention against the float32 oracle: the ordinary paged attention
over the full page table.

The reference (torch) and the Triton path (interpreter on the CPU, compiled under ``gpu``)
run decode and extend/verify batches whose requests share leading pages, with sliding
windows that start inside the shared prefix, sinks, soft-cap, GQA 5:1, head dim 80, pages of
1/16/48, block-permuted tables with a null page 0 and padding rows. Bounds: relative error
1e-5 in float32, 2e-3 in float16 (the ordinary kernel's), LSE likewise.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.cascade import cascade_paged_attention
from aiter_attn.kernels.reference_cascade import (cascade_attention_reference,
                                                  cascade_groups_reference)
from aiter_attn.testing.compare import assert_close_rel

from ._cascade_case import SharedCase
from ._triton_util import DEVICE, requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}

# (id, layout, hq, hkv, d, page, pad_rows)
LAYOUTS = [
    pytest.param([(4, [(4, 3, 1), (4, 20, 1), (4, 1, 1)]), (0, [(0, 37, 1)]),
                  (3, [(3, 5, 1), (2, 9, 1)])],
                 8, 2, 64, 16, 0, id="decode-GQA4-page16"),
    pytest.param([(2, [(2, 30, 5), (2, 7, 7), (2, 40, 1)]), (1, [(1, 12, 3), (1, 3, 3)])],
                 10, 2, 80, 48, 0, id="extend-GQA5:1-D80-page48"),
    pytest.param([(40, [(40, 3, 2), (40, 5, 2), (25, 2, 2)]), (0, [(0, 9, 2)])],
                 8, 2, 64, 1, 0, id="verify-page1"),
    pytest.param([(5, [(5, 2, 1), (5, 9, 1), (5, 17, 1)])], 10, 2, 80, 16, 3,
                 id="decode-padding-rows"),
]


def _ref(case, **kw):
    out = torch.empty(case.q.shape[0], case.hq, case.d, dtype=case.dtype)
    lse = torch.empty(case.q.shape[0], case.hq, dtype=torch.float32)
    cascade_attention_reference(case.q, case.k_cache, case.v_cache, out, **case.args(),
                                lse=lse, **kw)
    return out, lse


def _check(case, got, got_lse, what, **feat):
    exp, exp_lse = case.oracle(lse=True, **feat)
    rtol = RTOL[case.dtype]
    assert_close_rel(got, exp, rtol, what)
    assert_close_rel(got_lse, exp_lse, rtol, what + " (lse)")


FEATURES = [
    pytest.param({}, id="plain"),
    pytest.param({"window_size": (23, 0)}, id="window-inside-shared"),
    pytest.param({"softcap": 3.0}, id="softcap"),
    pytest.param({"sinks": True, "window_size": (40, 0), "softcap": 5.0}, id="sinks+window+cap"),
]


def _features(feat, hq):
    feat = dict(feat)
    if feat.get("sinks"):
        feat["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 2
    return feat


@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("layout,hq,hkv,d,page,pad", LAYOUTS)
def test_reference_matches_oracle(layout, hq, hkv, d, page, pad, feat):
    case = SharedCase(layout, hq=hq, hkv=hkv, d=d, page=page, pad_rows=pad, seed=d + page)
    feat = _features(feat, hq)
    assert cascade_groups_reference(case.block_table, case.seqused_k, case.cu, page, 1)
    out, lse = _ref(case, min_shared_tokens=1, **feat)
    _check(case, out, lse, "reference cascade", **feat)


def test_reference_groups_by_hand():
    """Runs of consecutive requests, links counted over prefix pages only, min over links."""
    case = SharedCase([(4, [(4, 3, 1), (4, 20, 1), (2, 1, 1)]), (0, [(0, 37, 1)]),
                       (3, [(3, 5, 1), (3, 9, 1)])], page=16)
    groups = cascade_groups_reference(case.block_table, case.seqused_k, case.cu, 16, 1)
    assert groups == [(0, 2, 2), (4, 5, 3)]
    # a threshold of 3 pages splits off the request sharing only 2
    groups = cascade_groups_reference(case.block_table, case.seqused_k, case.cu, 16, 3)
    assert groups == [(0, 1, 4), (4, 5, 3)]
    assert cascade_groups_reference(case.block_table, case.seqused_k, case.cu, 16, 5) == []


def test_shared_pages_exclude_query_pages():
    """A page holding a query token is never shared (the prefix ends before the queries)."""
    # both requests' rows start with the same 2 pages, but request 1's queries begin inside
    # page 1: only page 0 lies before every query
    case = SharedCase([(2, [(2, 4, 1), (2, 0 + 4, 1)])], page=16)
    case.q_lens[1] = 20  # pretend 20 queries: positions 16..35
    case.cu = torch.tensor([0, 1, 21], dtype=torch.int32)
    case.q = torch.randn(21, case.hq, case.d)
    groups = cascade_groups_reference(case.block_table, case.seqused_k, case.cu, 16, 1)
    assert groups == [(0, 1, 1)]
    out, lse = _ref(case, min_shared_tokens=1)
    _check(case, out, lse, "query pages not shared")


@requires_triton
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("layout,hq,hkv,d,page,pad", LAYOUTS)
def test_triton_matches_oracle(layout, hq, hkv, d, page, pad, feat, dtype):
    case = SharedCase(layout, hq=hq, hkv=hkv, d=d, page=page, pad_rows=pad, seed=d + page,
                      dtype=dtype).to(DEVICE)
    feat = _features(feat, hq)
    if "sinks" in feat:
        feat["sinks"] = feat["sinks"].to(DEVICE)
    out, lse = cascade_paged_attention(
        case.q, case.k_cache, case.v_cache, **case.args(), min_shared_tokens=1,
        backend="triton", return_lse=True, max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.kv_lens), **feat)
    _check(case, out, lse, f"triton cascade {dtype}", **feat)


@requires_triton
@pytest.mark.parametrize("splits,chunk", [(1, 16), (3, 2), (2, 0)],
                         ids=["splits1", "splits3-chunk2", "splits2-per-tile-lookup"])
def test_triton_splits_and_threshold(monkeypatch, splits, chunk):
    """Key splits of the shared pass, the chunked and the per-tile page lookup, hints left
    out (static bounds), and a threshold above every run's sharing (no run: the own pass is
    the whole attention)."""
    from aiter_attn.kernels.triton import cascade as mod

    monkeypatch.setitem(mod.CASCADE_TUNING, "num_splits", splits)
    monkeypatch.setitem(mod.CASCADE_TUNING, "page_chunk", chunk)
    case = SharedCase([(6, [(6, 3, 1), (6, 20, 1), (4, 1, 1)]), (2, [(2, 5, 2), (2, 9, 1)])],
                      hq=10, hkv=2, d=80, page=16, seed=5).to(DEVICE)
    sinks = torch.randn(10, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for min_tokens in (1, 17, 10_000):
        out, lse = cascade_paged_attention(
            case.q, case.k_cache, case.v_cache, **case.args(), min_shared_tokens=min_tokens,
            backend="triton", return_lse=True, sinks=sinks, window_size=(50, 0))
        _check(case, out, lse, f"splits={splits} min={min_tokens}", sinks=sinks,
               window_size=(50, 0))


def test_bad_threshold_refused():
    case = SharedCase([(1, [(1, 2, 1), (1, 2, 1)])])
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="min_shared_tokens"):
            cascade_paged_attention(case.q, case.k_cache, case.v_cache, **case.args(),
                                    min_shared_tokens=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 1.2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("feat", FEATURES)
@pytest.mark.parametrize("layout,hq,hkv,d,page,pad", LAYOUTS)
def test_gpu_compiled_matches_oracle(layout, hq, hkv, d, page, pad, feat, dtype, rtol):
    """The CPU cases compiled on the GPU, in bf16 too (the GPU launch configuration: 64-row
    tiles, the chunked page lookup or, at page 48, the per-tile one)."""
    case = SharedCase(layout, hq=hq, hkv=hkv, d=d, page=page, pad_rows=pad, seed=d + page,
                      dtype=dtype).to("cuda")
    feat = _features(feat, hq)
    if "sinks" in feat:
        feat["sinks"] = feat["sinks"].to("cuda")
    out, lse = cascade_paged_attention(
        case.q, case.k_cache, case.v_cache, **case.args(), min_shared_tokens=1,
        backend="triton", return_lse=True, max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.kv_lens), **feat)
    exp, exp_lse = case.oracle(lse=True, **feat)
    assert_close_rel(out, exp, rtol, f"gpu cascade {dtype}")
    assert_close_rel(lse, exp_lse, 2e-3, f"gpu cascade {dtype} (lse)")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(torch.bfloat16, 1.2e-2), (torch.float16, 2e-3)])
def test_gpu_bench_shape(dtype, rtol):
    """The benchmark's shape, compiled: 64 requests sharing 4k tokens, 256 own each."""
    layout = [(256, [(256, 256, 1)] * 64)]
    case = SharedCase(layout, hq=32, hkv=8, d=128, page=16, dtype=dtype, seed=0).to("cuda")
    out = cascade_paged_attention(case.q, case.k_cache, case.v_cache, **case.args(),
                                  min_shared_tokens=1024, backend="triton",
                                  max_seqlen_q=1, max_seqlen_k=4096 + 256)
    assert_close_rel(out, case.oracle(), rtol, f"bench shape {dtype}")


@pytest.mark.gpu
def test_gpu_overlap_equals_one_stream_eager_and_replayed():
    """The own pass on the side stream (default under capture) gives the bits of both passes
    on one stream, replayed from a captured graph (a missing fork or join would race: the
    merge reading the own pass's output or LSE before it is written, or the capture losing
    it); eager calls run on one stream either way."""
    from aiter_attn.kernels.triton import cascade as tmod

    layout = [(256, [(256, 256, 1)] * 64)]
    case = SharedCase(layout, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16,
                      seed=3).to("cuda")
    kw = dict(**case.args(), min_shared_tokens=1024, backend="triton", max_seqlen_q=1,
              max_seqlen_k=4096 + 256)
    saved = dict(tmod.CASCADE_TUNING)
    try:
        tmod.CASCADE_TUNING["overlap"] = False
        one = cascade_paged_attention(case.q, case.k_cache, case.v_cache, **kw)
        tmod.CASCADE_TUNING["overlap"] = True
        eager = cascade_paged_attention(case.q, case.k_cache, case.v_cache, **kw)
        torch.cuda.synchronize()
        assert torch.equal(eager, one)
        out = torch.full_like(one, float("nan"))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up (compiles) off the capture
            cascade_paged_attention(case.q, case.k_cache, case.v_cache, out=out, **kw)
        torch.cuda.current_stream().wait_stream(s)
        out.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cascade_paged_attention(case.q, case.k_cache, case.v_cache, out=out, **kw)
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, one)
    finally:
        tmod.CASCADE_TUNING.clear()
        tmod.CASCADE_TUNING.update(saved)
