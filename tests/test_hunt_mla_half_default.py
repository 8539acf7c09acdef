"""The Triton MLA kernel's default 16-bit split partials (``MLA_HALF_PARTIALS = True``): what
the default plans, how its partials merge, and where the 16-bit rows can leave fp16's range.

A partial row is ``(Σ_j p16_j · v_j) / Σ_j p_j``: the numerator takes ``p`` rounded to q's
dtype (the p·V dot), the denominator the float32 ``p``. A split whose value column is 65504
(fp16's largest finite) therefore comes out up to 2^-11 above it, and a 16-bit store rounds
anything from 65520 on to ``inf``: the merge then gives ``inf`` (or ``NaN``, where that split
weighs 0) where float32 partials give the finite rows. The merges read such an fp16 partial
as ±65504 (the exact partial, a convex combination of cache values, is within fp16's range).

Checked against the float64 oracle on CPU in Triton's interpreter (fp16 / fp32): the plain
kernel call, the static-workspace plans (a 16-bit and a float32 kernel sharing one float32
workspace, a plan larger than it) and the MLA strategy under the graph manager.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import RTOL, MLACase, spy_mla_launches

pytestmark = requires_triton

_LOG2E = torch.tensor(1.4426950408889634, dtype=torch.float32)


def _plan(case, tuning=None, static=None, **req):
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    kw = case.kwargs()
    kernel = TritonMLA(mla_request(q, kv, case.rank, **req), tuning)
    md = _adhoc_metadata(q, kv, kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"], None,
                         None, None, None, "test")
    return kernel, kernel.plan(md, static)


def _run_plan(case, kernel, plan):
    from aiter_attn.kernels.base import mla_layer_params

    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    params = mla_layer_params(scale=case.softmax_scale, device=q.device, kv_lora_rank=case.rank,
                              num_q_heads=case.heads, head_dim=q.shape[2], kv_scale=None,
                              fp8=False, causal=True)
    out = torch.full((q.shape[0], case.heads, case.rank), float("nan"), dtype=case.dtype,
                     device=case.device)
    return kernel.run(q, (kv,), plan, params, out)


# ---------------------------------------------------------------- what the default plans

def test_default_partials_follow_the_query_dtype():
    """With no ``half_partials`` key: 16-bit queries in head blocks of up to 16 get partials
    of their dtype; float32 queries, batch-invariant kernels and 32-head blocks keep
    float32."""
    def part_dtype(dtype=torch.float16, heads=16, **req):
        case = MLACase([1, 1], [40, 70], page=16, heads=heads, dtype=dtype)
        return _plan(case, {"num_kv_splits": 2}, **req)[1].part_o.dtype

    assert part_dtype() == torch.float16
    assert part_dtype(dtype=torch.float32) == torch.float32
    assert part_dtype(batch_invariant=True) == torch.float32
    assert part_dtype(heads=32) == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_default_merge_form_by_partial_width(dtype, monkeypatch):
    """The merge launch takes the split-by-split form (``FIXED_ORDER``) for 16-bit partials
    and the tiled form for float32 ones; both give the oracle's rows and LSE."""
    from aiter_attn.kernels.triton import mla_merge

    forms, kernel = [], mla_merge._mla_merge_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                forms.append(kw["FIXED_ORDER"])
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(mla_merge._MERGE, "fn", Spy())  # the regular path: the spy sees it
    monkeypatch.setattr(mla_merge._MERGE, "direct", False)
    parts = spy_mla_launches(monkeypatch, lambda args, kw: args[5].dtype)
    case = MLACase([1, 2, 1], [150, 77, 3], page=16, dtype=dtype, seed=11)
    case.assert_rows_and_lse("default partials", num_kv_splits=4)
    assert parts == [dtype] and forms == [dtype != torch.float32], (parts, forms)


# ---------------------------------------------------------------- fp16 range

def _value_at_fp16_max(dead_split: bool, sign: float = 1.0) -> MLACase:
    """One decode row over 64 keys in two splits of 32 (``block_n=16``): split 0's values
    are all 65504, split 1's all 1. In each split one key scores 0 (p = 1) and 31 score
    ``ln p`` with ``p`` just past an fp16 rounding midpoint above 0.5 (p16 - p ≈ 3.7e-4·p),
    so split 0's partial computes to about 65527 and a 16-bit store makes it ``inf``.
    ``dead_split``: a key of split 1 scores 120, so split 0 weighs exactly 0 in the merge;
    ``sign``: -1 puts split 0's values at -65504."""
    rank, rope, L = 64, 16, 64
    case = MLACase([1], [L], page=16, heads=16, rank=rank, rope=rope, dtype=torch.float16,
                   seed=1)
    case.softmax_scale = 1.0
    c1 = torch.tensor(-0.693359375)  # fp16; scores c1 + c2 / 64 with an fp16 c2
    c2s = torch.arange(-1.0, 1.0, 2 ** -11).half().unique().float()
    p = torch.exp2((c1 + c2s / 64) * _LOG2E)
    c2 = c2s[(p - (0.5 + 2 ** -12 + 2 ** -14)).abs().argmin()]
    lat = torch.zeros(L, rank + rope)
    lat[:32, :rank], lat[32:, :rank] = sign * 65504.0, 1.0
    lat[:, rank], lat[:, rank + 1] = c1, c2
    lat[[0, 32], rank:rank + 2] = 0.0
    if dead_split:
        lat[32, rank + 2] = 120.0
    q = torch.zeros_like(case.q)
    q[..., rank], q[..., rank + 1], q[..., rank + 2] = 1.0, 1.0 / 64, 1.0
    case.q = q
    bt = case.block_table[0]
    for j in range(L):
        case.kv_cache[bt[j // 16], j % 16, 0] = lat[j].half()
    case.dense[0] = lat.half().float()[:, None]
    return case


@pytest.mark.parametrize("fused", [False, True], ids=["merge-launch", "fused-merge"])
@pytest.mark.parametrize("dead_split", [False, True], ids=["both-splits-weigh", "split0-weighs-0"])
def test_fp16_partial_rounded_past_65504_is_not_inf(dead_split, fused):
    """Values at fp16's largest finite (the default, 16-bit partials): finite rows within the
    fp16 tolerance of the oracle, as float32 partials give (before: ``inf``, or ``NaN``
    where the overflowed split weighs 0)."""
    case = _value_at_fp16_max(dead_split)
    want = case.expected()
    ref = case.run(num_kv_splits=2, block_n=16, fused_merge=fused, half_partials=False)
    assert_close_rel(ref, want, RTOL[torch.float16], "float32 partials")
    out = case.run(num_kv_splits=2, block_n=16, fused_merge=fused)
    assert torch.isfinite(out).all(), f"16-bit partials: {out[0, 0, :4].tolist()}"
    assert_close_rel(out, want, RTOL[torch.float16], "16-bit partials at 65504")


def test_fp16_partial_rounded_past_minus_65504_is_not_inf():
    """The same at -65504: the merges read an fp16 partial of -inf as -65504."""
    case = _value_at_fp16_max(False, sign=-1.0)
    out = case.run(num_kv_splits=2, block_n=16)
    assert torch.isfinite(out).all(), f"16-bit partials: {out[0, 0, :4].tolist()}"
    assert_close_rel(out, case.expected(), RTOL[torch.float16], "16-bit partials at -65504")


@pytest.mark.parametrize("fixed_order", [True, False], ids=["split-by-split", "tiled"])
def test_merge_reads_fp16_inf_as_65504_and_keeps_nan(fixed_order):
    """Both merge forms on hand-made fp16 partials of two equal-weight splits: +inf / -inf
    merge as ±65504 beside a split of 1, a NaN partial stays NaN; float32 partials' inf
    merges to inf, which the fp16 output store clamps to 65504 as every Triton kernel's
    fp16 store does (``_softmax.to_output``; tests/test_hunt_fp16_merge.py)."""
    from aiter_attn.kernels.triton.mla_merge import _mla_merge_kernel

    def merge(part_o):
        out = torch.empty(1, 4, 16, dtype=torch.float16)
        part_lse = torch.zeros(1, 4, 2)
        po, pl = part_o.stride(), part_lse.stride()
        _mla_merge_kernel[(1, 4)](out, part_o, part_lse, part_lse, out.stride(0), out.stride(1),
                                  po[0], po[1], po[2], pl[0], pl[1], 0, 0, KV_LORA=16,
                                  BLOCK_DV=16, NUM_SPLITS=2, BLOCK_S=2, WRITE_LSE=False,
                                  FIXED_ORDER=fixed_order)
        return out.float()

    part = torch.ones(1, 4, 2, 16)
    part[0, 0, 0], part[0, 1, 0], part[0, 2, 0] = float("inf"), float("-inf"), float("nan")
    got = merge(part.half())
    want = torch.tensor([(65504 + 1) / 2, (1 - 65504) / 2]).half().float()
    assert (got[0, 0] == want[0]).all() and (got[0, 1] == want[1]).all()
    assert got[0, 2].isnan().all() and (got[0, 3] == 1).all()
    assert (merge(part)[0, 0] == 65504).all()


# ---------------------------------------------------------------- static workspace

def test_fp16_and_fp32_kernels_share_one_float32_workspace():
    """Two kernels of the same heads and rank (hence one workspace name): the fp16 one's
    partials are a 16-bit view of the float32 buffer the fp32 one uses whole; runs
    interleaved on their plans give each its oracle rows."""
    static: dict = {}
    half_case = MLACase([1, 1, 2], [40, 90, 33], page=16, dtype=torch.float16, seed=4)
    full_case = MLACase([1, 2, 1], [70, 20, 99], page=16, dtype=torch.float32, seed=5)
    k16, p16 = _plan(half_case, {"num_kv_splits": 3}, static)
    k32, p32 = _plan(full_case, {"num_kv_splits": 3}, static)
    assert k16._ws == k32._ws and p16.part_o.dtype == torch.float16
    buf = static[k16._ws + ".o"]
    assert p16.part_o.data_ptr() == p32.part_o.data_ptr() == buf.data_ptr()
    for _ in range(2):
        assert_close_rel(_run_plan(half_case, k16, p16), half_case.expected(),
                         RTOL[torch.float16], "fp16 kernel on the shared workspace")
        assert_close_rel(_run_plan(full_case, k32, p32), full_case.expected(),
                         RTOL[torch.float32], "fp32 kernel on the shared workspace")


def test_plan_larger_than_the_static_workspace_raises():
    """A 16-bit plan whose split rows exceed the workspace (and its float32 LSE rows) is
    refused, naming the fix; one that fits views the buffer from its start."""
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    case = MLACase([1, 1, 1], [40, 90, 33], page=16, dtype=torch.float16, seed=4)
    q, kv = case.q.to(case.device), case.kv_cache.to(case.device)
    ws = TritonMLA(mla_request(q, kv, case.rank), {})._ws
    rows = 3 * 3  # 3 tokens, 3 splits
    static = {ws + ".o": torch.zeros(rows * 16 * case.rank),
              ws + ".lse": torch.zeros(rows * 16)}
    _, plan = _plan(case, {"num_kv_splits": 3}, static)
    assert plan.part_o.dtype == torch.float16
    assert plan.part_o.data_ptr() == static[ws + ".o"].data_ptr()
    with pytest.raises(RuntimeError, match="buffer_spec"):
        _plan(case, {"num_kv_splits": 4}, static)


# ---------------------------------------------------------------- the MLA strategy

@pytest.mark.parametrize("mode", ["decode", "target_verify"])
def test_strategy_graph_replay_with_default_partials(mode, monkeypatch):
    """The absorbed MLA strategy through the graph manager (no CUDA graph on CPU) on the
    Triton kernel: the replayed plan's partials are fp16 views of the manager's float32
    workspace, and the rows match the eager run and the reference backend."""
    from aiter_attn import AttentionBackend, SpecDecodeConfig
    from aiter_attn.kernels.triton import mla as mla_mod

    from ._graph_helpers import Rig

    seen, merge = [], mla_mod.merge_splits

    def spy(out, part_o, *args, **kw):
        seen.append((part_o.dtype, part_o.data_ptr()))
        return merge(out, part_o, *args, **kw)

    monkeypatch.setattr(mla_mod, "merge_splits", spy)
    rig = Rig.make("mla", page_size=16, hq=16, head_dim=32, rope=16, num_layers=1,
                   max_context_len=512, max_bs=2, dtype=torch.float16, seed=3,
                   spec=SpecDecodeConfig(topk=1, num_draft_tokens=3))
    reference = rig.backend
    rig.backend = AttentionBackend(attrs.evolve(rig.config, kernel_backend="triton"),
                                   rig.req_pool, rig.kv_pool)
    mgr = rig.manager(capture_sizes=[1, 2])
    mgr.capture(rig.step_fn())
    for n in (300, 45)[:2 if mode == "decode" else 1]:  # programs few enough to split
        rig.join(n)
    batch = rig.batch(mode)
    inputs = rig.random_inputs(batch)
    seen.clear()
    replayed = [o.clone() for o in mgr.replay(batch, **inputs)]
    ws = [v for k, v in mgr.strategy_buffers(mode).items() if k.endswith(".o")]
    assert seen and len(ws) == 1 and ws[0].dtype == torch.float32
    assert all(d == torch.float16 and p == ws[0].data_ptr() for d, p in seen), seen
    eager = rig.eager(batch, inputs, save_kv_cache=False)
    rig.backend = reference
    want = rig.eager(batch, inputs, save_kv_cache=False)
    for g, e, w in zip(replayed, eager, want):
        assert torch.isfinite(g).all()
        assert_close_rel(g, w.double(), RTOL[torch.float16], f"{mode} replay vs reference")
        assert_close_rel(e, w.double(), RTOL[torch.float16], f"{mode} eager vs reference")
