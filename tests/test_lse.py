"""``return_lse=True``: the log-sum-exp per (token, head) from ``ops.paged_attention``,
``ops.mla_paged_attention`` and ``paged_attention_5d`` on the reference and the Triton kernels
(split-KV path and its reduction included), against the float64 dense oracle.

Convention (flash-attn): ``lse = ln Σ exp(s)`` over the visible scaled, soft-capped logits and
the sink; a fully masked row has ``lse = -inf`` and output 0.

Bounds: outputs as in ``test_triton_paged_attention`` (relative error); the LSE by the
relative error of its finite entries (float32 1e-5; fp16 queries 2e-3), and ``-inf`` exactly
where the oracle has it.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.registry import Capabilities, KernelRegistry, KernelRequest
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention
from aiter_attn.types import CGSupport

from ._triton_util import DEVICE, requires_triton
from .test_triton_mla import MLACase
from .test_triton_paged_attention import Case

pytestmark = requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}
BACKENDS = ["reference", "triton"]


def assert_lse(actual, expected, rtol, what):
    a, e = actual.double().cpu(), expected.double().cpu()
    assert a.shape == e.shape, (a.shape, e.shape)
    inf_e = torch.isneginf(e)
    assert torch.equal(torch.isneginf(a), inf_e), f"{what}: -inf rows differ"
    assert not torch.isnan(a).any(), f"{what}: NaN in lse"
    assert_close_rel(a[~inf_e], e[~inf_e], rtol, what + " (lse)")


def _oracle(case: Case, *, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None,
            masks=None):
    outs, lses, t = [], [], 0
    for b, n in enumerate(case.q_lens):
        o, l = dense_attention(
            case.q[t:t + n], case.dense_k[b], case.dense_v[b], scale=case.scale, causal=causal,
            window=window_size, softcap=softcap, sinks=sinks,
            mask=None if masks is None else masks[b], return_lse=True)
        outs.append(o)
        lses.append(l)
        t += n
    return torch.cat(outs), torch.cat(lses)


def _run(case: Case, backend, *, masks=None, **kw):
    dev = case.device
    extra = {}
    if masks is not None:
        extra["custom_mask"] = torch.cat([m.reshape(-1) for m in masks]).to(dev)
        extra["mask_indptr"] = torch.tensor(
            [0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist()).to(dev)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(dev)
    return ops.paged_attention(
        case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev),
        cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
        block_table=case.block_table.to(dev), softmax_scale=case.scale,
        k_scale=case._scale(case.k_scale), v_scale=case._scale(case.v_scale),
        max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.kv_lens),
        backend=backend, return_lse=True, **extra, **kw)


def _check(case, backend, what, masks=None, **kw):
    out, lse = _run(case, backend, masks=masks, **kw)
    assert lse.dtype == torch.float32 and lse.shape == (case.q.shape[0], case.hq)
    eo, el = _oracle(case, masks=masks, **kw)
    rtol = RTOL[case.dtype]
    assert_close_rel(out, eo, rtol, f"{backend} {what}")
    assert_lse(lse, el, rtol, f"{backend} {what}")
    return out, lse


SHAPES = [
    pytest.param([1, 1, 1, 1], [37, 1, 130, 16], 8, 2, 64, 16, id="decode-GQA4-page16"),
    pytest.param([9, 20], [9, 20], 10, 2, 80, 48, id="prefill-GQA5:1-D80-page48"),
    pytest.param([5, 3, 17], [40, 3, 150], 8, 2, 64, 1, id="extend-page1"),
    pytest.param([1, 7, 1, 30], [50, 7, 130, 95], 10, 2, 80, 16, id="mixed-GQA5:1-D80"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", SHAPES)
def test_lse_matches_oracle(q_lens, kv_lens, hq, hkv, d, page, dtype, backend):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=d + page)
    out, _ = _check(case, backend, "plain")
    # the output with return_lse is the output without it
    plain = ops.paged_attention(
        case.q, case.k_cache, case.v_cache, cu_seqlens_q=case.cu, seqused_k=case.seqused_k,
        block_table=case.block_table, softmax_scale=case.scale, max_seqlen_q=max(q_lens),
        max_seqlen_k=max(kv_lens), backend=backend)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_features(backend):
    """Windows, sinks, soft-cap (LSE of the capped logits), both together, non-causal."""
    case = Case([1, 6, 1, 9], [70, 6, 3, 41], hq=10, hkv=2, d=80, page=48, seed=3)
    sinks = torch.randn(10, generator=torch.Generator().manual_seed(2)) * 3
    _check(case, backend, "sinks", sinks=sinks)
    _check(case, backend, "softcap", softcap=4.0)
    _check(case, backend, "window", window_size=(9, 0))
    _check(case, backend, "sinks+softcap+window", sinks=sinks, softcap=4.0, window_size=(9, 0))
    _check(case, backend, "non-causal window", causal=False, window_size=(7, 3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_fp8_cache(backend):
    case = Case([1, 4, 1], [40, 20, 77], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                kv_dtype=torch.float8_e4m3fn, k_scale=0.5, v_scale=0.25, seed=4)
    _check(case, backend, "fp8 e4m3 with scales")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_rows(backend):
    """Rows with nothing visible: lse = -inf, out = 0 (no NaN); with a sink the sink alone."""
    case = Case([3, 1, 2], [20, 33, 9], hq=4, hkv=2, d=32, page=16, seed=6)
    g = torch.Generator().manual_seed(6)
    masks = [torch.rand(n, L, generator=g) < 0.5 for n, L in zip(case.q_lens, case.kv_lens)]
    masks[0][1] = False  # one query row of request 0 sees nothing
    masks[1][:] = False  # the decode request sees nothing
    out, lse = _check(case, backend, "masked rows", masks=masks, causal=False)
    assert torch.isneginf(lse[1]).all() and torch.isneginf(lse[3]).all()
    assert (out[1] == 0).all() and (out[3] == 0).all()
    sinks = torch.randn(4, generator=g)
    out, lse = _check(case, backend, "masked rows + sinks", masks=masks, causal=False,
                      sinks=sinks)
    assert torch.allclose(lse[3], sinks.to(lse.device))  # ln e^{sink}


@pytest.mark.parametrize("splits", [2, 5])
def test_triton_split_kv_lse(monkeypatch, splits):
    """The flash-decoding path: per-split partials, the reduction writes the LSE (sinks,
    windows that leave whole splits empty, tree masks with fully masked rows)."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", splits)
    case = Case([1, 1, 3], [200, 9, 77], hq=8, hkv=2, d=64, page=16, seed=splits)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    _check(case, "triton", "split")
    _check(case, "triton", "split + sinks + softcap", sinks=sinks, softcap=3.0)
    _check(case, "triton", "split + window", window_size=(40, 0))
    g = torch.Generator().manual_seed(splits)
    masks = [torch.rand(n, L, generator=g) < 0.7 for n, L in zip(case.q_lens, case.kv_lens)]
    masks[0][:] = False
    _check(case, "triton", "split + tree mask, a fully masked row", masks=masks, causal=False)


def test_out_lse_buffer_and_validation():
    case = Case([2, 1], [10, 20], hq=4, hkv=2, d=32, page=16, seed=8)
    buf = torch.full((3, 4), float("nan"))
    out, lse = ops.paged_attention(
        case.q, case.k_cache, case.v_cache, cu_seqlens_q=case.cu, seqused_k=case.seqused_k,
        block_table=case.block_table, softmax_scale=case.scale, out_lse=buf)
    assert lse is buf and torch.isfinite(buf).all()
    for bad, match in ((torch.zeros(3, 4, dtype=torch.float16), "out_lse"),
                       (torch.zeros(3, 5), "out_lse"), (torch.zeros(3, 4, 1), "out_lse")):
        with pytest.raises((TypeError, ValueError), match=match):
            ops.paged_attention(
                case.q, case.k_cache, case.v_cache, cu_seqlens_q=case.cu,
                seqused_k=case.seqused_k, block_table=case.block_table,
                softmax_scale=case.scale, out_lse=bad)


def test_selection_requires_lse_feature():
    """A kernel that does not declare ``lse`` is passed over for return_lse requests."""
    reg = KernelRegistry()
    never = CGSupport.NEVER
    reg.register("paged_attention", "fast", lambda *a, **k: None,
                 Capabilities(cg_support=never), priority=10)
    reg.register("paged_attention", "with_lse", lambda *a, **k: None,
                 Capabilities(features={"lse"}, cg_support=never), priority=0)
    assert reg.select(KernelRequest(op="paged_attention")).impl.name == "fast"
    sel = reg.select(KernelRequest(op="paged_attention", features={"lse"}))
    assert sel.impl.name == "with_lse"
    assert "missing features ['lse']" in dict(sel.rejected)["fast"]


def _mla_oracle(case: MLACase):
    outs, lses, t = [], [], 0
    for b, n in enumerate(case.q_lens):
        c = case.dense[b]
        o, l = dense_attention(case.q[t:t + n].float(), c, c[..., :case.rank],
                               scale=case.softmax_scale,
                               mask=None if case.masks is None else case.masks[b],
                               return_lse=True)
        outs.append(o)
        lses.append(l)
        t += n
    return torch.cat(outs), torch.cat(lses)


MLA_CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[5, 17, 33], page=16), {}, id="decode"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[9, 40], page=1), {"num_kv_splits": 3},
                 id="decode-p1-split3"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48, heads=20), {"num_kv_splits": 2},
                 id="verify-p48-H20-split2"),
    pytest.param(dict(q_lens=[4, 1, 2], kv_lens=[30, 3, 64], page=7, mask_p=0.5),
                 {"num_kv_splits": 2}, id="tree-mask-split2"),
    pytest.param(dict(q_lens=[2, 1], kv_lens=[33, 18], kv_scale=0.37, dtype=torch.float16,
                      kv_dtype=torch.float8_e4m3fn), {}, id="fp8-kv-scale"),
]


@pytest.mark.parametrize("case_kw,launch", MLA_CASES)
def test_mla_lse(case_kw, launch):
    case = MLACase(**case_kw, seed=7)
    if case.masks is not None:  # a fully masked row
        case.masks[0][0] = False
        case.custom_mask = torch.cat([m.reshape(-1) for m in case.masks])
    eo, el = _mla_oracle(case)
    rtol = RTOL[case.dtype]
    for backend in BACKENDS:
        out, lse = ops.mla_paged_attention(case.q, case.kv_cache, **case.kwargs(),
                                           backend=backend, return_lse=True)
        assert_close_rel(out, eo, rtol, f"mla {backend}")
        assert_lse(lse, el, rtol, f"mla {backend}")
    if launch:  # the split path of the Triton kernel and its merge
        lse = torch.full((case.q.shape[0], case.heads), float("nan"))
        out = case.run(lse=lse, **launch)
        assert_close_rel(out, eo, rtol, "mla triton split")
        assert_lse(lse, el, rtol, "mla triton split")


@pytest.mark.parametrize("backend", BACKENDS)
def test_5d_lse(backend):
    from aiter_attn.kernels.reference_5d import vec_width
    from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
    from aiter_attn.strategies.vec5d import paged_attention_5d

    case = Case([1, 5, 1], [40, 5, 100], hq=8, hkv=2, d=64, page=16, seed=9)
    k5, v5 = kv_5d_from_nhd(case.k_cache, case.v_cache, vec_width(case.k_cache.dtype))
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3))
    out, lse = paged_attention_5d(
        case.q, k5, v5, cu_seqlens_q=case.cu, seqused_k=case.seqused_k,
        block_table=case.block_table, softmax_scale=case.scale, sinks=sinks,
        window_size=(30, 0), backend=backend, return_lse=True)
    eo, el = _oracle(case, sinks=sinks, window_size=(30, 0))
    assert_close_rel(out, eo, 1e-5, f"5d {backend}")
    assert_lse(lse, el, 1e-5, f"5d {backend}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_lse_gpu_heuristic_splits(dtype):
    """Compiled, with the launch heuristics' own split counts (few long requests: split-KV
    decode; a prefill chunk: one split), bf16/fp16, against the oracle."""
    if DEVICE != "cuda":
        pytest.skip("needs CUDA")
    case = Case([1, 1, 64], [4000, 1500, 3000], hq=32, hkv=8, d=128, page=16, dtype=dtype,
                seed=12)
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(5))
    rtol = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}[dtype]
    for kw in ({}, {"sinks": sinks, "window_size": (1000, 0)}):
        out, lse = _run(case, "triton", **kw)
        eo, el = _oracle(case, **kw)
        assert_close_rel(out, eo, rtol, f"gpu {kw.keys()}")
        assert_lse(lse, el, 1e-4, f"gpu {kw.keys()}")
        o2, l2 = ops.merge_attention_states(out, lse, out, lse)
        assert_close_rel(o2, eo, rtol, "self-merge")
        assert_lse(l2, el + torch.log(torch.tensor(2.0, dtype=torch.float64)), 1e-4,
                   "self-merge lse = lse + ln 2")
