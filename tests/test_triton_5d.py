"""Triton ``paged_attention_5d``: the paged-attention kernel over the vectorised 5-D layout
(K ``[pages, H, D/x, page, x]``; V shuffled ``[pages, H, page/x, Dv, x]`` or hd_page
``[pages, H, Dv, page]``), against the float64 dense oracle on block-permuted pools with a
null page 0, in both V layouts, and through the registry.

Relative-error bounds as in ``test_triton_paged_attention`` (float32 1e-5, float16 2e-3).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
from aiter_attn.kernels.reference_5d import vec_width
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import DEVICE, requires_triton
from .test_triton_paged_attention import RTOL, Case

pytestmark = requires_triton


def _run_5d(case: Case, *, v_shuffled: bool, kernel=None, **kw):
    from aiter_attn.kernels.triton.paged_attention import paged_attention_5d_triton

    x = vec_width(case.k_cache.dtype)
    k5, v5 = kv_5d_from_nhd(case.k_cache, case.v_cache, x, v_shuffled=v_shuffled)
    dev = case.device
    out = torch.full((case.q.shape[0], case.hq, case.dv), float("nan"), dtype=case.dtype,
                     device=dev)
    (kernel or paged_attention_5d_triton)(
        case.q.to(dev), k5.to(dev), v5.to(dev), out, cu_seqlens_q=case.cu.to(dev),
        seqused_k=case.seqused_k.to(dev), block_table=case.block_table.to(dev),
        softmax_scale=case.scale, max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(case.kv_lens), **kw)
    return out


CASES = [
    # q_lens, kv_lens, hq, hkv, d, dv, page
    pytest.param([1, 1, 1], [37, 130, 16], 8, 2, 64, 64, 16, id="decode-GQA4-page16"),
    pytest.param([9, 20, 3], [9, 20, 70], 10, 2, 80, 80, 16, id="prefill-extend-GQA5:1-D80"),
    pytest.param([4, 1], [60, 33], 4, 4, 32, 48, 32, id="verify-MHA-dv48-page32"),
]


@pytest.mark.parametrize("v_shuffled", [True, False], ids=["v-shuffled", "v-hd_page"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,dv,page", CASES)
def test_5d_matches_oracle(q_lens, kv_lens, hq, hkv, d, dv, page, dtype, v_shuffled):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, dv=dv, page=page, dtype=dtype,
                seed=d + page)
    out = _run_5d(case, v_shuffled=v_shuffled)
    assert_close_rel(out, case.expected(), RTOL[dtype], "5-D layout vs oracle")


def test_5d_split_kv_window_sinks_and_chunked_lookup(monkeypatch):
    """Split-KV partials, a sliding window, sinks, and the chunked page lookup over 5-D."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", 3)
    monkeypatch.setitem(mod.TUNING_OVERRIDES, "page_chunk", 2)
    case = Case([1, 2, 1], [300, 77, 9], hq=8, hkv=2, d=32, page=16, seed=5)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3))
    for shuffled in (True, False):
        out = _run_5d(case, v_shuffled=shuffled, sinks=sinks.to(case.device),
                      window_size=(50, 0))
        assert_close_rel(out, case.expected(sinks=sinks, window_size=(50, 0)),
                         RTOL[torch.float32], f"5-D split/window/sinks shuffled={shuffled}")


def test_5d_fp8_cache_with_scales():
    case = Case([1, 6], [90, 40], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.25, seed=11)
    scales = dict(k_scale=torch.tensor([0.05], device=case.device),
                  v_scale=torch.tensor([0.25], device=case.device))
    out = _run_5d(case, v_shuffled=True, **scales)  # x = 16 for 1-byte elements
    assert_close_rel(out, case.expected(), RTOL[torch.float16], "5-D fp8 e4m3fn")


def test_5d_through_op_selects_triton():
    """``paged_attention_5d(backend="triton")`` dispatches here; on a GPU Triton is the
    default over the reference."""
    from aiter_attn.strategies.vec5d import paged_attention_5d

    case = Case([2, 1], [20, 45], hq=4, hkv=2, d=32, page=16, seed=2)
    out = _run_5d(case, v_shuffled=True,
                  kernel=lambda q, k, v, o, **kw: o.copy_(paged_attention_5d(
                      q, k, v, backend="triton", **kw)))
    assert_close_rel(out, case.expected(), RTOL[torch.float32], "op backend=triton")
    if DEVICE == "cuda":
        from aiter_attn.plugins import kernel_registry
        from aiter_attn.strategies.vec5d import paged_attention_5d_request

        x = vec_width(case.k_cache.dtype)
        k5, v5 = kv_5d_from_nhd(case.k_cache, case.v_cache, x)
        req = paged_attention_5d_request(case.q.cuda(), k5.cuda(), v5.cuda())
        assert kernel_registry().select(req).impl.name == "triton"
