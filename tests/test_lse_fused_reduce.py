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


@pytest.mark.parametrize("splits", [3, 9])
def test_fused_reduce_in_the_static_workspace(monkeypatch, splits):
    """Graph plans take their counters from the kernel's static workspace (buffer_spec, zero
    filled): the same buffer for every batch size, left at zero after each launch, and the
    results equal the eager plan's bit for bit. 9 splits exercise a partial last chunk of
    the vectorised reduction."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.attention import TritonPagedAttention
    from aiter_attn.types import ForwardMode

    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "fused_reduce", True)
    monkeypatch.setitem(pa_mod.TUNING_OVERRIDES, "num_splits", splits)
    case = Case([1, 1, 1], [300, 41, 170], hq=10, hkv=2, d=80, page=48, seed=splits)
    req = TritonPagedAttention.request_for(case.q, case.k_cache, case.v_cache)
    kernel = TritonPagedAttention(req)
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=4, q_len=1, max_num_tokens=4,
                         max_seq_len=320)
    spec = kernel.buffer_spec(limits).buffers
    cnt_name = [n for n in spec if n.endswith(".cnt")]
    assert len(cnt_name) == 1 and spec[cnt_name[0]][1] == torch.int32
    static = kernel.buffer_spec(limits).allocate(case.device)
    params = LayerParams.create(scale=case.scale, device=case.device)
    q, k, v = case.q, case.k_cache, case.v_cache
    eo, el = _oracle(case)
    for bs in (3, 2):
        n = bs
        md = _adhoc_metadata(q[:n], k, case.cu[: bs + 1], case.seqused_k[:bs],
                             case.block_table[:bs], None, None, 1, 320, "paged_attention")
        graph_plan = kernel.plan(md, out=static)
        assert graph_plan.counters is not None
        assert graph_plan.counters.data_ptr() == static[cnt_name[0]].data_ptr()
        out = torch.full((n, case.hq, case.dv), float("nan"), dtype=q.dtype)
        lse = torch.full((n, case.hq), float("nan"))
        kernel.run(q[:n], (k, v), graph_plan, params, out, lse=lse)
        assert int(static[cnt_name[0]].abs().sum()) == 0
        assert_close_rel(out, eo[:n], 1e-5, f"fused static workspace bs={bs}")
        assert_lse(lse, el[:n], 1e-5, f"fused static workspace bs={bs}")
        eager = kernel.plan(md)
        out_e = torch.full_like(out, float("nan"))
        kernel.run(q[:n], (k, v), eager, params, out_e)
        assert torch.equal(out_e, out)
