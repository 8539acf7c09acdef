"""Balanced key splits for 16-head MLA decode (:mod:`aiter_attn.kernels.triton.mla_balanced`)
against the float64 oracle: every program gets the same number of key tiles, requests that
cross program boundaries are merged by LSE, requests inside one program finish there, empty
requests come out as zero rows with LSE -inf.

On the CPU the kernels run in the interpreter on small latents (rank 64 + rope 16); the
``gpu`` tests add DeepSeek shapes (512 + 64) in bf16/fp16 with 16-bit and float32 partials.
"""

from __future__ import annotations

import math

import pytest
import torch

from ._triton_util import DEVICE, HAS_CUDA, INTERPRET, requires_triton
from .test_triton_mla import RTOL, LSE_RTOL, MLACase

pytestmark = requires_triton


def _launch(case: MLACase, programs: int, *, part_dtype=torch.float32, block_n=16,
            with_lse=True, device=None):
    from aiter_attn.kernels.triton.mla_balanced import (balanced_workspace_shapes,
                                                        launch_balanced_mla)

    dev = device or case.device
    q, kv = case.q.to(dev), case.kv_cache.to(dev)
    n = q.shape[0]
    out = torch.full((n, case.heads, case.rank), float("nan"), dtype=case.dtype, device=dev)
    lse = torch.full((n, case.heads), float("nan"), device=dev) if with_lse else None
    po_shape, pl_shape = balanced_workspace_shapes(programs, case.heads, case.rank)
    # stale workspace: NaN everywhere (every slot the merge reads must be written first)
    part_o = torch.full(po_shape, float("nan"), dtype=part_dtype, device=dev)
    part_lse = torch.full(pl_shape, float("nan"), device=dev)
    launch_balanced_mla(q, kv, out, case.seqused.to(dev), case.block_table.to(dev),
                        rank=case.rank, qk_scale_log2=case.softmax_scale * math.log2(math.e),
                        lse=lse, part_o=part_o, part_lse=part_lse, programs=programs,
                        block_n=block_n, num_stages=1 if INTERPRET else 3)
    return out, lse


def _check(case: MLACase, out, lse, label):
    assert torch.isfinite(out).all(), label
    exp = case.expected()
    assert_rows = (exp.abs().sum(dim=(1, 2)) > 0)
    from aiter_attn.testing.compare import assert_close_rel

    if assert_rows.any():
        assert_close_rel(out.cpu()[assert_rows], exp[assert_rows], RTOL[case.dtype], label)
    assert (out.cpu()[~assert_rows] == 0).all(), label + ": empty requests give zero rows"
    if lse is not None:
        exp_lse, lse = case.expected_lse(), lse.cpu()
        dead = torch.isinf(exp_lse)
        assert torch.equal(torch.isneginf(lse), dead), label + ": LSE -inf exactly where empty"
        assert_close_rel(lse[~dead], exp_lse[~dead], LSE_RTOL[case.dtype], label + " LSE")


LENGTHS = {
    "uniform": [64, 64, 64, 64],
    "skewed": [300, 3, 17, 1, 40],            # one long request and short ones
    "empty": [0, 45, 0, 16, 0],               # empty requests between and at the ends
    "tiles": [16, 32, 15, 33],                # exactly a tile, a tile and one
}


@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("programs", [1, 3, 7, 40])
def test_balanced_rows_and_lse_match_the_oracle(lengths, programs):
    """Every split of the keys: one program (nothing crosses), a few (requests cross one or
    more boundaries, programs hold several requests), more programs than tiles (empty
    programs); page 16 over a block-permuted pool with a noisy null page 0."""
    lens = LENGTHS[lengths]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=3)
    out, lse = _launch(case, programs)
    _check(case, out, lse, f"{lengths} programs={programs}")


@pytest.mark.parametrize("lengths,programs", [([256] * 8, 9), ([256] * 6 + [250, 3], 9)],
                         ids=["aligned", "nearly"])
def test_balanced_power_of_two_program_tiles(lengths, programs):
    """128 tiles over 9 programs: ⌈128 / 9⌉ = 15 tiles rounds up to 16 (within 10 %), one
    request a program and the ninth program empty; with ragged lengths the same rounding
    puts requests across programs."""
    case = MLACase([1] * len(lengths), lengths, heads=16, rank=64, rope=16, page=16, seed=8)
    out, lse = _launch(case, programs)
    _check(case, out, lse, f"programs={programs}")


@pytest.mark.parametrize("page", [1, 48])
def test_balanced_pages_not_a_multiple_of_the_tile(page):
    """Page 1 and 48 (tiles spanning pages: the per-key page lookup), 5 heads (a masked
    head block), float16 with 16-bit partials, no LSE output."""
    case = MLACase([1] * 4, [130, 7, 61, 200], heads=5, rank=64, rope=16, page=page,
                   dtype=torch.float16, seed=11)
    out, _ = _launch(case, 6, part_dtype=torch.float16, block_n=32, with_lse=False)
    _check(case, out, None, f"page {page}")


def test_balanced_programs_see_the_same_total_work():
    """The schedule itself (host mirror of the device formula): with 64 requests of 4096 keys
    and 264 programs each program owns at most ⌈total / P⌉ tiles, where the split launch's
    4 splits per request leave programs of 32 tiles for 256 of the 264 slots."""
    tiles = [4096 // 32] * 64
    total, programs = sum(tiles), 264
    tw = -(-total // programs)
    assert tw == 32 and total / programs < 31.1  # balanced: 31.03 tiles of work a program
    # a skewed batch: one 32k request among 63 of 1k (the split launch: splits of 8k keys)
    tiles = [32768 // 32] + [1024 // 32] * 63
    tw = -(-sum(tiles) // programs)
    assert tw == 12  # 384 keys a program, against 8192 for the split launch's longest


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("part_dtype", ["half", "f32"])
@pytest.mark.parametrize("programs", [132, 264])
def test_gpu_balanced_deepseek_shapes(dtype, part_dtype, programs):
    """DeepSeek latents (512 + 64), 16 heads, page 64: a long, a 1000-key, one tile, 5 and
    129 keys, half a context, an empty request; 16-bit or float32 partials."""
    lens = [4096, 1000, 64, 5, 129, 2049, 0]
    case = MLACase([1] * len(lens), lens, rank=512, rope=64, page=64, heads=16, dtype=dtype,
                   device="cuda", seed=7)
    out, lse = _launch(case, programs, part_dtype=dtype if part_dtype == "half" else torch.float32,
                       block_n=32, device="cuda")
    _check(case, out, lse, f"{dtype} {part_dtype} P={programs}")


# ------------------------------------------------------------- through the kernel object

@pytest.mark.parametrize("option", [True, 5])
def test_functional_call_with_balanced_tuning(option):
    """``mla_paged_attention(..., balanced=...)``: decode rows and LSE match the oracle,
    with an empty request and a long one; the balanced launch ran (without the
    ``max_seqlen_q`` hint the plan cannot tell a decode step and keeps the split launch)."""
    case = MLACase([1] * 5, [0, 150, 3, 64, 31], heads=16, rank=64, rope=16, page=16,
                   seed=21)
    from aiter_attn.kernels.triton import mla as triton_mla

    launched = []
    real = triton_mla.launch_balanced_mla

    def spy(*args, **kwargs):
        launched.append(kwargs["programs"])
        return real(*args, **kwargs)

    triton_mla.launch_balanced_mla = spy
    try:  # max_seqlen_q=1: the host hint that makes the call a decode step (one query each)
        case.assert_rows_and_lse(f"balanced={option}", balanced=option, max_seqlen_q=1)
    finally:
        triton_mla.launch_balanced_mla = real
    assert launched, "the balanced launch did not run"


def test_plan_takes_the_balanced_launch_only_where_it_serves():
    """Decode: the plan carries the balanced launch (and no split partials); a verify step
    (two queries a request) and a masked one keep the split launch."""
    from aiter_attn.kernels.triton.mla import TritonMLA
    from aiter_attn.kernels.base import _adhoc_metadata, mla_request

    def plan_of(q_lens, kv_lens, tuning, masked=False):
        case = MLACase(q_lens, kv_lens, heads=16, rank=64, rope=16, page=16, seed=2,
                       mask_p=0.7 if masked else None)
        kw = case.kwargs()
        k = TritonMLA(mla_request(case.q, case.kv_cache, 64, custom_mask=masked), tuning)
        md = _adhoc_metadata(case.q, case.kv_cache, kw["cu_seqlens_q"], kw["seqused_k"],
                             kw["block_table"], kw["custom_mask"], kw["mask_indptr"],
                             max(q_lens), max(kv_lens), "test")
        return k.plan(md)

    p = plan_of([1, 1, 1], [40, 90, 7], {"balanced": 4})
    assert p.balanced is not None and p.balanced[0] == 4 and not p.use_parts
    assert tuple(p.balanced[1].shape) == (4, 16, 2, 64)
    assert plan_of([2, 1], [40, 90], {"balanced": 4}).balanced is None
    assert plan_of([1, 1], [40, 90], {"balanced": 4}, masked=True).balanced is None
    assert plan_of([1, 1], [40, 90], {"balanced": False}).balanced is None


@pytest.mark.parametrize("bad", [0, -2, 1.5, "yes"])
def test_balanced_option_values_are_checked(bad):
    case = MLACase([1, 1], [40, 9], heads=16, rank=64, rope=16, page=16, seed=2)
    with pytest.raises(ValueError, match="balanced="):
        case.run(balanced=bad)


def test_balanced_through_the_graph_manager(monkeypatch):
    """MLA decode with the balanced launch as the default (``MLA_BALANCED``) through the graph
    manager on the CPU: batches padded to the captured sizes replay close to eager steps (the
    padding rows' one key each joins the partition, so a padded replay may round differently
    in the last bits: the relative bound, not bit equality), no foreign KV writes, and the
    balanced workspace is a view of the static buffers."""
    from aiter_attn import ForwardMode
    from aiter_attn.kernels.triton import mla as triton_mla
    from aiter_attn.testing.compare import assert_close_rel

    from ._graph_helpers import Rig

    if DEVICE != "cpu":
        pytest.skip("CPU variant")
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    monkeypatch.setattr(triton_mla, "MLA_BALANCED", True)
    rig = Rig.make("mla", page_size=16, hq=16, head_dim=32, seed=11, max_context_len=1024)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    for want in (3, 5, 1):
        while len(rig.rows) < want:
            rig.join(int(torch.randint(0, 200, (1,), generator=rig.gen)))
        while len(rig.rows) > want:
            rig.leave(rig.rows[0])
        batch = rig.batch("decode")
        inputs = rig.random_inputs(batch)
        before = rig.snapshot()
        out = mgr.replay(batch, **inputs)
        assert rig.foreign_writes(before, batch) == [], "graph step wrote a slot it does not own"
        eager = rig.eager(batch, inputs, save_kv_cache=False)
        for i, (g, e) in enumerate(zip(out, eager)):
            assert g.shape == e.shape and torch.isfinite(g).all()
            assert_close_rel(g, e, 1e-5, f"decode bs={batch.batch_size} layer {i}")
    batch = rig.batch("decode")  # a last replay: its plan is the backend's current one
    mgr.replay(batch, **rig.random_inputs(batch))
    (plan,) = rig.backend.forward_metadata.kernel_plans.plans.values()
    assert plan.balanced is not None  # the balanced launch ran
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in mgr._modes[ForwardMode.DECODE].buffers.values()]
    for t in plan.balanced[1:3]:
        assert any(lo <= t.data_ptr() < hi for lo, hi in spans)


@pytest.mark.parametrize("tuning,per_sm", [
    ({}, 2), ({"num_warps": 8}, 1), ({"num_stages": 6}, 1), ({"num_warps": 4}, 2)])
def test_balanced_program_count_follows_the_launch_overrides(tuning, per_sm, monkeypatch):
    """``balanced=True`` counts the programs the SMs hold with the launch's own warps and
    stages: an 8-warp override or a ring too deep to fit twice gives one program per SM
    (the count ignored both overrides before)."""
    from aiter_attn.kernels.base import mla_request
    from aiter_attn.kernels.triton import mla

    monkeypatch.setattr(mla, "_smem_budget", lambda device: 227 * 1024)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)
    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(8, 64, 1, 576, dtype=torch.bfloat16)
    k = mla.TritonMLA(mla_request(q, kv, 512), {"balanced": True, **tuning})
    assert k._balanced_programs("cpu") == per_sm * 132
