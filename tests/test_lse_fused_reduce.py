"""The fused split reduction (``TUNING_OVERRIDES["fused_reduce"]``, off by default): the split
path in one launch, the last split program of each tile reducing it through a per-tile atomic
counter. Against the float64 oracle (output and LSE; sinks, windows, soft-cap, tree masks with
fully masked rows, GQA 5:1, head dim 80, page 48), the counters left at zero so a plan can be
run again, and never used in batch-invariant mode.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
from aiter_attn.kernels.triton import paged_attention as pa_mod
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_lse import _check, _oracle, assert_lse
from .test_triton_paged_attention import Case

pytestmark = requires_triton


@pytest.mark.parametrize("splits", [2, 5])
def test_fused_reduce_matches_oracle(monkeypatch, splits):
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "fused_reduce", True)
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "num_splits", splits)
    case = Case([1, 1, 3], [200, 9, 77], hq=8, hkv=2, d=64, page=16, seed=splits)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    _check(case, "triton", "fused")
    _check(case, "triton", "fused + sinks + softcap + window", sinks=sinks, softcap=3.0,
           window_size=(40, 0))
    g = torch.Generator().manual_seed(splits)
    masks = [torch.rand(n, L, generator=g) < 0.7 for n, L in zip(case.q_lens, case.kv_lens)]
    masks[0][:] = False
    _check(case, "triton", "fused + tree mask, a fully masked row", masks=masks, causal=False)
    odd = Case([1, 4, 1], [150, 60, 97], hq=10, hkv=2, d=80, page=48, seed=7)
    _check(odd, "triton", "fused GQA5:1 D80 page48", sinks=sinks[:1].repeat(10))


def _plan_and_run(case, kernel, lse=True):
    dev = case.device
    q = case.q.to(dev)
    k, v = case.k_cache.to(dev), case.v_cache.to(dev)
    md = _adhoc_metadata(q, k, case.cu.to(dev), case.seqused_k.to(dev),
                         case.block_table.to(dev), None, None, max(case.q_lens),
                         max(case.kv_lens), "paged_attention")
    plan = kernel.plan(md)
    params = LayerParams.create(scale=case.scale, device=dev)
    out = torch.full((q.shape[0], case.hq, case.dv), float("nan"), dtype=q.dtype, device=dev)
    lse_t = torch.full((q.shape[0], case.hq), float("nan"), device=dev) if lse else None
    kernel.run(q, (k, v), plan, params, out, lse=lse_t)
    return plan, q, (k, v), params, out, lse_t


def test_counters_return_to_zero_and_plan_reruns(monkeypatch):
    from aiter_attn.kernels.triton.attention import TritonPagedAttention, invariant_request

    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "fused_reduce", True)
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "num_splits", 3)
    case = Case([1, 1], [130, 40], hq=4, hkv=2, d=32, page=16, seed=3)
    req = TritonPagedAttention.request_for(case.q, case.k_cache, case.v_cache)
    kernel = TritonPagedAttention(req)
    plan, q, cache, params, out, lse = _plan_and_run(case, kernel)
    assert plan.counters is not None and plan.split
    assert int(plan.counters.abs().sum()) == 0  # reset by the reducing program
    eo, el = _oracle(case)
    assert_close_rel(out, eo, 1e-5, "fused run 1")
    assert_lse(lse, el, 1e-5, "fused run 1")
    out2 = torch.full_like(out, float("nan"))
    kernel.run(q, cache, plan, params, out2)  # the same plan (and counters) again
    assert torch.equal(out2, out)

    # batch-invariant kernels keep the two launches (no atomics)
    bi = TritonPagedAttention(invariant_request(req, True))
    plan_bi, *_ = _plan_and_run(case, bi)
    assert plan_bi.counters is None and plan_bi.fixed_order
    # and the default (no override) has no fused reduction
    monkeypatch.delitem(pa_mod.TUNING_OVERRIDES, "fused_reduce")
    plan_d, *_ = _plan_and_run(case, TritonPagedAttention(req))
    assert plan_d.counters is None
