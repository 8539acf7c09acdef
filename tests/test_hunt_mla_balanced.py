"""Defect hunt for the balanced MLA decode launch (:mod:`aiter_attn.kernels.triton.mla_balanced`)
and its integration in :class:`aiter_attn.kernels.triton.mla.TritonMLA`: edge lengths, page /
tile sizes, head counts, index dtypes, strided tensors, stale workspaces, reused plans, declines
and option checks, every row against the float64 oracle (relative error), never against zeros.
"""

from __future__ import annotations

import math

import pytest
import torch

from ._triton_util import INTERPRET, requires_triton
from .test_triton_mla import LSE_RTOL, RTOL, MLACase

pytestmark = requires_triton

LOG2E = math.log2(math.e)


def _ws(programs, heads, rank, part_dtype, dev):
    from aiter_attn.kernels.triton.mla_balanced import balanced_workspace_shapes

    po, pl = balanced_workspace_shapes(programs, heads, rank)
    return (torch.full(po, float("nan"), dtype=part_dtype, device=dev),
            torch.full(pl, float("nan"), device=dev))


def _launch(case, programs, *, part_dtype=torch.float32, block_n=16, with_lse=True,
            bt_dtype=torch.int32, seq_dtype=torch.int32, ws=None, seqused=None,
            q=None, out=None, lse=None):
    from aiter_attn.kernels.triton.mla_balanced import launch_balanced_mla

    dev = case.device
    q = case.q.to(dev) if q is None else q
    n = q.shape[0]
    if out is None:
        out = torch.full((n, case.heads, case.rank), float("nan"), dtype=case.dtype, device=dev)
    if lse is None and with_lse:
        lse = torch.full((n, case.heads), float("nan"), device=dev)
    part_o, part_lse = ws if ws is not None else _ws(programs, case.heads, case.rank,
                                                     part_dtype, dev)
    seq = case.seqused if seqused is None else seqused
    launch_balanced_mla(q, case.kv_cache.to(dev), out, seq.to(dev, seq_dtype),
                        case.block_table.to(dev, bt_dtype), rank=case.rank,
                        qk_scale_log2=case.softmax_scale * LOG2E, lse=lse, part_o=part_o,
                        part_lse=part_lse, programs=programs, block_n=block_n,
                        num_stages=1 if INTERPRET else 3, ieee=case.dtype == torch.float32)
    return out, lse


def _check(case, out, lse, label, rtol=None):
    from aiter_attn.testing.compare import assert_close_rel

    out = out.cpu()
    assert torch.isfinite(out).all(), label + ": non-finite rows"
    exp = case.expected()
    exp_lse = case.expected_lse()
    dead = torch.isinf(exp_lse)  # [T, H]: requests with no keys
    live = ~dead
    if live.any():
        assert_close_rel(out[live].float(), exp[live], rtol or RTOL[case.dtype], label)
    assert (out[dead] == 0).all(), label + ": empty requests give zero rows"
    if lse is not None:
        lse = lse.cpu()
        assert torch.equal(torch.isneginf(lse), dead), label + ": LSE -inf exactly where empty"
        assert not torch.isnan(lse).any(), label + ": LSE NaN"
        if live.any():
            assert_close_rel(lse[live], exp_lse[live], LSE_RTOL[case.dtype], label + " LSE")


# --------------------------------------------------------------------- direct launches

EDGE_LENGTHS = {
    "batch1-one-key": [1],
    "batch1-empty": [0],
    "all-empty": [0, 0, 0],
    "batch1-exact-tile": [16],
    "batch1-long": [203],
    "page-boundaries": [48, 96, 47, 49, 64],
    "single-keys": [1, 1, 1, 1, 1, 1, 1],
    "tail-empty": [33, 0],
    "head-empty": [0, 0, 31],
    "odd-batch17": [5, 0, 19, 1, 64, 7, 33, 2, 16, 0, 100, 3, 48, 1, 17, 9, 70],
}


@pytest.mark.parametrize("programs", [1, 2, 5, 64])
@pytest.mark.parametrize("name", list(EDGE_LENGTHS))
def test_edge_lengths_match_oracle(name, programs):
    """Edge batches (one request, all empty, one key, tile / page boundaries, a 17-request
    batch with BLOCK_B 32) over 1, 2, 5 and 64 programs (more programs than tiles)."""
    lens = EDGE_LENGTHS[name]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=5)
    out, lse = _launch(case, programs)
    _check(case, out, lse, f"{name} P={programs}")


@pytest.mark.parametrize("page,block_n", [(1, 16), (1, 32), (16, 16), (16, 32), (48, 16),
                                          (48, 32), (64, 16), (64, 32)])
def test_page_and_tile_sizes(page, block_n):
    """Pages 1, 16, 48, 64 under 16- and 32-key tiles (per-key page lookups where the page
    is not a multiple of the tile; one lookup a tile otherwise), lengths at and around page
    and tile boundaries, 6 programs."""
    lens = [page * 2, block_n * 3 + 1, 1, 97, page + block_n - 1, 0]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=page, seed=page)
    out, lse = _launch(case, 6, block_n=block_n)
    _check(case, out, lse, f"page {page} bn {block_n}")


@pytest.mark.parametrize("heads", [1, 5, 16])
@pytest.mark.parametrize("dtype,part", [(torch.float32, torch.float32),
                                        (torch.float16, torch.float32),
                                        (torch.float16, torch.float16)],
                         ids=["fp32", "fp16-f32parts", "fp16-f16parts"])
def test_heads_and_dtypes(heads, dtype, part):
    """1, 5 and 16 heads (masked head blocks); fp32 and fp16 with float32 / 16-bit partials."""
    lens = [77, 3, 0, 130, 16]
    case = MLACase([1] * len(lens), lens, heads=heads, rank=64, rope=16, page=16,
                   dtype=dtype, seed=heads)
    out, lse = _launch(case, 7, part_dtype=part, block_n=32)
    _check(case, out, lse, f"H={heads} {dtype} parts {part}")


@pytest.mark.parametrize("bt,sq", [(torch.int64, torch.int32), (torch.int32, torch.int64),
                                   (torch.int64, torch.int64)])
def test_index_dtypes(bt, sq):
    """int64 block tables and / or int64 ``seqused_k``."""
    lens = [100, 0, 37, 1, 64]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=4)
    out, lse = _launch(case, 6, bt_dtype=bt, seq_dtype=sq)
    _check(case, out, lse, f"bt {bt} seqused {sq}")


def test_request_across_many_programs():
    """One request over 13 programs (the merge's 4-wide unrolled loop runs several rounds,
    its last one partly past the request's last program) next to short ones."""
    lens = [3, 1000, 5]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=6)
    out, lse = _launch(case, 13)
    _check(case, out, lse, "long request")


def test_stale_workspace_reused_across_calls():
    """One NaN-filled workspace reused by two launches of different lengths (and the second
    launch's slots partly written by the first, partly still NaN): the second call's rows
    only see the partials it wrote."""
    a = MLACase([1] * 4, [200, 3, 90, 7], heads=16, rank=64, rope=16, page=16, seed=1)
    b = MLACase([1] * 4, [1, 150, 0, 60], heads=16, rank=64, rope=16, page=16, seed=2)
    for part in (torch.float32, torch.float16):
        ws = _ws(9, 16, 64, part, a.device)
        out, lse = _launch(a, 9, ws=ws)
        _check(a, out, lse, f"first call {part}", rtol=3e-3 if part == torch.float16 else None)
        out, lse = _launch(b, 9, ws=ws)
        _check(b, out, lse, f"second call {part}", rtol=3e-3 if part == torch.float16 else None)


def test_strided_q_out_and_lse():
    """q, out and lse as strided views (head and token strides not the dense ones)."""
    lens = [70, 0, 33, 5]
    case = MLACase([1] * len(lens), lens, heads=5, rank=64, rope=16, page=16, seed=12)
    n, h, d = case.q.shape
    # q: [H, T, D + 8] buffer, transposed and sliced
    qbuf = torch.randn(h, n, d + 8)
    qbuf[:, :, :d] = case.q.transpose(0, 1)
    q = qbuf.transpose(0, 1)[:, :, :d]
    assert q.stride(-1) == 1 and not q.is_contiguous()
    obuf = torch.full((h, n, case.rank + 4), float("nan"))
    out = obuf.transpose(0, 1)[:, :, :case.rank]
    lbuf = torch.full((h, n * 2), float("nan"))
    lse = lbuf.t()[::2]
    _launch(case, 4, q=q, out=out, lse=lse)
    _check(case, out, lse, "strided")
    assert torch.isnan(obuf[:, :, case.rank:]).all(), "wrote past the rows' width"
    assert torch.isnan(lbuf.t()[1::2]).all(), "wrote between lse rows"


# ----------------------------------------------------------- through the kernel object

def _kernel_obj(case, tuning, *, lse=True, masked=False):
    from aiter_attn.kernels.base import mla_request
    from aiter_attn.kernels.triton.mla import TritonMLA

    return TritonMLA(mla_request(case.q, case.kv_cache, case.rank, custom_mask=masked,
                                 lse=lse), tuning)


def _md(case, seqused=None, block_table=None, max_q=1, max_k=None):
    from aiter_attn.kernels.base import _adhoc_metadata

    kw = case.kwargs()
    return _adhoc_metadata(case.q, case.kv_cache, kw["cu_seqlens_q"],
                           kw["seqused_k"] if seqused is None else seqused,
                           kw["block_table"] if block_table is None else block_table,
                           kw["custom_mask"], kw["mask_indptr"], max_q,
                           max(case.kv_lens) if max_k is None else max_k, "test")


def _params(case):
    from aiter_attn.kernels.base import mla_layer_params

    return mla_layer_params(scale=case.softmax_scale, device=case.q.device,
                            kv_lora_rank=case.rank, num_q_heads=case.heads,
                            head_dim=case.q.shape[2], kv_scale=None, fp8=False, causal=True)


@pytest.fixture
def spy(monkeypatch):
    from aiter_attn.kernels.triton import mla as triton_mla

    calls = []
    real = triton_mla.launch_balanced_mla

    def wrapper(*a, **k):
        calls.append(k.get("programs"))
        return real(*a, **k)

    monkeypatch.setattr(triton_mla, "launch_balanced_mla", wrapper)
    return calls


@pytest.mark.parametrize("option", [True, 1, 3, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_functional_balanced_runs_and_matches(option, dtype, spy):
    """``mla_paged_attention(balanced=..., max_seqlen_q=1)``: the balanced launch runs (spied)
    and rows / LSE match the oracle, with empty requests."""
    case = MLACase([1] * 6, [0, 150, 3, 64, 31, 0], heads=16, rank=64, rope=16, page=16,
                   dtype=dtype, seed=21)
    case.assert_rows_and_lse(f"balanced={option}", balanced=option, max_seqlen_q=1)
    assert spy == [8 if option is True else option]


def test_functional_without_q_hint_keeps_split_launch(spy):
    """Without ``max_seqlen_q`` a functional call cannot know it is decode (host read): the
    split launch serves it (still correct)."""
    case = MLACase([1] * 3, [40, 3, 17], heads=16, rank=64, rope=16, page=16, seed=3)
    case.assert_rows_and_lse("no hint", balanced=True)
    assert spy == []


def test_functional_int64_indices_and_all_empty(spy):
    """int64 ``seqused_k`` and block table through the functional call; an all-empty batch
    (zero rows, LSE -inf)."""
    for lens in ([90, 1, 0, 48], [0, 0]):
        case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=13)
        case.seqused = case.seqused.long()
        case.block_table = case.block_table.long()
        case.assert_rows_and_lse(f"int64 {lens}", balanced=4, max_seqlen_q=1)
    assert spy == [4, 4]


@pytest.mark.parametrize("heads", [17, 20])
def test_more_than_16_heads_declined(heads, spy):
    case = MLACase([1] * 3, [40, 0, 70], heads=heads, rank=64, rope=16, page=16, seed=9)
    case.assert_rows_and_lse(f"H={heads}", balanced=True, max_seqlen_q=1)
    assert spy == []


def test_verify_and_masked_declined(spy):
    """Two queries a request, and a custom mask (decode shape), keep the split launch and
    stay correct."""
    case = MLACase([2, 1, 3], [40, 9, 70], heads=16, rank=64, rope=16, page=16, seed=9)
    case.assert_rows_and_lse("verify", balanced=True, max_seqlen_q=3)
    case = MLACase([1, 1, 1], [40, 9, 70], heads=16, rank=64, rope=16, page=16, seed=9,
                   mask_p=0.6)
    case.assert_rows_and_lse("masked", balanced=True, max_seqlen_q=1)
    assert spy == []


@pytest.mark.parametrize("bad", [0, -1, 2.0, "yes", [4]])
def test_option_values_checked(bad):
    case = MLACase([1, 1], [40, 9], heads=16, rank=64, rope=16, page=16, seed=2)
    with pytest.raises(ValueError, match="balanced="):
        case.run(balanced=bad, max_seqlen_q=1)


def test_option_false_and_programs():
    case = MLACase([1, 1], [40, 9], heads=16, rank=64, rope=16, page=16, seed=2)
    dev = torch.device("cpu")
    assert _kernel_obj(case, {"balanced": False})._balanced_programs(dev) is None
    assert _kernel_obj(case, {})._balanced_programs(dev) is None
    assert _kernel_obj(case, {"balanced": 7})._balanced_programs(dev) == 7
    assert _kernel_obj(case, {"balanced": True})._balanced_programs(dev) == 8


def test_plan_reused_as_lengths_change(spy):
    """One plan, three runs: ``seqused_k`` rewritten in place between runs (as a CUDA graph
    replay does), including an all-empty step and longer requests; the partition follows the
    device lengths of each run. The workspace is the plan's (stale between runs)."""
    steps = [[120, 5, 60, 1], [1, 200, 0, 33], [0, 0, 0, 0], [64, 64, 64, 64]]
    cases = [MLACase([1] * 4, s, heads=16, rank=64, rope=16, page=16, seed=30 + i)
             for i, s in enumerate(steps)]
    # one block table / cache wide enough: run each step on its own case's cache and table
    # but through one plan whose seqused tensor is rewritten in place
    width = max(c.block_table.shape[1] for c in cases)
    seq = cases[0].seqused.clone()
    bt = torch.zeros(4, width, dtype=torch.int32)
    first = cases[0]
    kernel = _kernel_obj(first, {"balanced": 5})
    plan = kernel.plan(_md(first, seqused=seq, block_table=bt, max_k=width * 16))
    assert plan.balanced is not None
    params = _params(first)
    for i, case in enumerate(cases):
        seq.copy_(case.seqused)
        bt.zero_()
        bt[:, :case.block_table.shape[1]] = case.block_table
        out = torch.full((4, 16, 64), float("nan"))
        lse = torch.full((4, 16), float("nan"))
        kernel.run(case.q, (case.kv_cache,), plan, params, out, lse=lse)
        _check(case, out, lse, f"step {i} {steps[i]}")
    assert spy == [5] * len(cases)


def test_kernel_object_rejects_strided_last_dim():
    case = MLACase([1, 1], [40, 9], heads=16, rank=64, rope=16, page=16, seed=2)
    kernel = _kernel_obj(case, {"balanced": 3})
    plan = kernel.plan(_md(case))
    q = torch.cat([case.q, case.q], dim=-1)[:, :, ::2]
    assert q.stride(-1) != 1
    with pytest.raises(ValueError, match="contiguous"):
        kernel.run(q, (case.kv_cache,), plan, _params(case), torch.empty(2, 16, 64))


def test_functional_strided_q_and_out(spy):
    """Functional call with a last-dim-strided q (copied) and a head-strided out view."""
    lens = [50, 0, 17]
    case = MLACase([1] * 3, lens, heads=16, rank=64, rope=16, page=16, seed=40)
    from aiter_attn.kernels.triton.mla import mla_paged_attention

    q = torch.stack([case.q, torch.zeros_like(case.q)], dim=-1).flatten(-2)[..., ::2]
    assert torch.equal(q, case.q) and q.stride(-1) == 2
    obuf = torch.full((16, 3, 64), float("nan"))
    out = obuf.transpose(0, 1)
    lse = torch.full((3, 16), float("nan"))
    mla_paged_attention(q, case.kv_cache, out, **case.kwargs(), lse=lse, balanced=3,
                        max_seqlen_q=1)
    _check(case, out, lse, "functional strided")
    assert spy == [3]


def test_workspace_rows_cover_balanced_partials():
    """The static workspace (graph buffers) holds the balanced launch's two slots a program
    for decode limits, and nothing is asked of it for verify limits."""
    case = MLACase([1, 1], [40, 9], heads=16, rank=64, rope=16, page=16, seed=2)
    k = _kernel_obj(case, {"balanced": 300, "num_kv_splits": 1})
    assert k._workspace_rows(4, 1, 256, torch.device("cpu")) >= 600
    assert k._workspace_rows(4, 2, 256, torch.device("cpu")) < 600


# ------------------------------------------------- narrow latents, GPU dot-shape rules

@pytest.fixture
def nvidia_dot_rule(monkeypatch):
    """The interpreter with NVIDIA's lower bound on ``tl.dot`` shapes (K >= 16 for 16/32-bit
    operands, ``triton/backends/nvidia/compiler.py: min_dot_size``) instead of its own
    (1, 1, 1): a launch that would not compile on the GPU fails here too."""
    from triton.runtime import interpreter

    fns = interpreter.interpreter_builder.codegen_fns
    monkeypatch.setitem(fns, "min_dot_size", lambda lhs, rhs: (
        1, 1, 32 if lhs.scalar.primitive_bitwidth == 8 else 16))


@pytest.mark.skipif(not INTERPRET, reason="emulates the GPU's dot rule in the interpreter")
@pytest.mark.parametrize("rank,rope", [(64, 8), (8, 8), (64, 0), (48, 16)],
                         ids=["rope8", "rank8", "rope0", "rank48"])
def test_narrow_latents_under_gpu_dot_rules(rank, rope, nvidia_dot_rule, spy):
    """Latents narrower than 16 (rope 8: the graph test rig's default, rope 0, rank 8) or
    not a power of two: the split launch pads its blocks to 16 columns and compiles; the
    balanced launch must too (it used ``next_pow2(rope)`` = 8 as q·Kᵀ's K: an assertion
    'K >= 16' under NVIDIA's rule, a compile error on the GPU)."""
    case = MLACase([1] * 3, [40, 0, 70], heads=16, rank=rank, rope=rope, page=16, seed=1)
    case.assert_rows_and_lse("split", max_seqlen_q=1)
    case.assert_rows_and_lse(f"balanced rank {rank} rope {rope}", balanced=3, max_seqlen_q=1)
    assert spy == [3]


# ---------------------------------------------------- more layouts and declines

def test_strided_cache_and_row_sliced_int64_table():
    """A latent cache that is a column slice of a wider pool (page / slot strides not the
    dense ones) and an int64 block table that is a row/column slice of a wider buffer."""
    lens = [90, 0, 17, 48]
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=14)
    p, ps, _, d = case.kv_cache.shape
    pool = torch.randn(p, ps, 1, d + 24)
    pool[..., :d] = case.kv_cache
    case.kv_cache = pool[..., :d]
    w = case.block_table.shape[1]
    tb = torch.full((7, w + 5), 10 ** 6, dtype=torch.int64)
    tb[:4, :w] = case.block_table
    case.block_table = tb[:4, :w]
    out, lse = _launch(case, 5, bt_dtype=torch.int64)
    _check(case, out, lse, "strided cache, sliced table")


def test_batch_invariant_and_fp8_declined(spy):
    case = MLACase([1] * 3, [40, 0, 70], heads=16, rank=64, rope=16, page=16, seed=9)
    case.assert_rows_and_lse("batch-invariant", balanced=True, max_seqlen_q=1,
                             batch_invariant=True)
    case = MLACase([1, 1], [33, 18], heads=16, rank=64, rope=16, page=16, seed=9,
                   kv_scale=0.37, kv_dtype=torch.float8_e4m3fn)
    case.assert_rows_and_lse("fp8", balanced=True, max_seqlen_q=1)
    assert spy == []


def test_batch_over_the_limit_declined():
    from aiter_attn.kernels.triton.mla_balanced import (BALANCED_MAX_BATCH,
                                                        balanced_reject_reason)

    kw = dict(heads=16, q_dtype=torch.float16, kv_dtype=torch.float16, one_query=True,
              masked=False, batch_invariant=False)
    assert balanced_reject_reason(batch=BALANCED_MAX_BATCH, **kw) is None
    assert balanced_reject_reason(batch=BALANCED_MAX_BATCH + 1, **kw) is not None
    n = BALANCED_MAX_BATCH + 1
    case = MLACase([1, 1], [4, 4], heads=16, rank=64, rope=16, page=16, seed=2)
    case.q = torch.zeros(n, 16, 80)
    case.seqused = torch.ones(n, dtype=torch.int32)
    case.cu = torch.arange(n + 1, dtype=torch.int32)
    case.block_table = torch.ones(n, 1, dtype=torch.int32)
    case.kv_lens = [1] * n
    plan = _kernel_obj(case, {"balanced": 4}).plan(_md(case))
    assert plan.balanced is None


@pytest.mark.parametrize("extra", [dict(causal=False), dict(half_partials=True),
                                   dict(half_partials=False), dict(block_n=64),
                                   dict(block_n=16, num_warps=2)],
                         ids=["noncausal", "half", "f32parts", "bn64", "bn16"])
def test_functional_options_with_balanced(extra, spy):
    """Other tuning next to ``balanced``: non-causal (one query: the same rows), 16-bit or
    float32 partials on fp16, 64- and 16-key tiles over page 48 (per-key page lookups)."""
    lens = [150, 1, 0, 96, 49]
    case = MLACase([1] * len(lens), lens, heads=5, rank=64, rope=16, page=48,
                   dtype=torch.float16, seed=17)
    case.assert_rows_and_lse(f"{extra}", balanced=4, max_seqlen_q=1, **extra)
    assert spy == [4]


@pytest.mark.parametrize("part", [torch.float32, torch.float16])
def test_one_tile_per_program(part):
    """More programs than a request has tiles over a few requests: one tile a program, a
    63-tile request across 63 programs (16 rounds of the merge's unrolled loop)."""
    case = MLACase([1, 1, 1], [1000, 5, 0], heads=16, rank=64, rope=16, page=16,
                   dtype=torch.float16 if part == torch.float16 else torch.float32, seed=19)
    out, lse = _launch(case, 64, part_dtype=part)
    _check(case, out, lse, f"tw=1 {part}")


@pytest.mark.parametrize("lens,programs", [([256] * 6 + [0, 250, 3], 9), ([32] * 10, 3),
                                           ([512], 7), ([17] * 5 + [0] * 3, 11)])
def test_program_tile_rounding(lens, programs):
    """The power-of-two rounding of a program's tiles (within 10 %) and not (beyond it),
    with empty requests at the end and a single request."""
    case = MLACase([1] * len(lens), lens, heads=16, rank=64, rope=16, page=16, seed=23)
    out, lse = _launch(case, programs)
    _check(case, out, lse, f"{lens} P={programs}")


def test_graph_manager_fp16_half_partials_and_empty_steps(monkeypatch):
    """The balanced launch as the default through the graph manager in fp16 (16-bit
    partials: a half-typed view of the float32 static workspace), the batch shrinking to one
    request and growing again: replays close to eager steps."""
    from aiter_attn.kernels.triton import mla as triton_mla
    from aiter_attn.testing.compare import assert_close_rel

    from ._graph_helpers import Rig
    from ._triton_util import DEVICE

    if DEVICE != "cpu":
        pytest.skip("CPU variant")
    monkeypatch.setenv("AITER_ATTN_BACKEND", "triton")
    monkeypatch.setattr(triton_mla, "MLA_BALANCED", True)
    monkeypatch.setattr(triton_mla, "MLA_HALF_PARTIALS", True)
    rig = Rig.make("mla", page_size=16, hq=5, head_dim=32, seed=4, max_context_len=512,
                   dtype=torch.float16)
    mgr = rig.manager()
    mgr.capture(rig.step_fn())
    for want in (4, 1, 3):
        while len(rig.rows) < want:
            rig.join(int(torch.randint(1, 300, (1,), generator=rig.gen)))
        while len(rig.rows) > want:
            rig.leave(rig.rows[0])
        batch = rig.batch("decode")
        inputs = rig.random_inputs(batch)
        out = mgr.replay(batch, **inputs)
        out = [o.clone() for o in out]
        monkeypatch.setattr(triton_mla, "MLA_BALANCED", False)  # eager: the split launch
        eager = rig.eager(batch, inputs, save_kv_cache=False)
        monkeypatch.setattr(triton_mla, "MLA_BALANCED", True)
        for i, (g, e) in enumerate(zip(out, eager)):
            assert torch.isfinite(g).all()
            assert_close_rel(g.float(), e.float(), 3e-3, f"fp16 decode bs={want} layer {i}")
    batch = rig.batch("decode")  # a last replay: its plan is the backend's current one
    mgr.replay(batch, **rig.random_inputs(batch))
    (plan,) = rig.backend.forward_metadata.kernel_plans.plans.values()
    assert plan.balanced is not None and plan.balanced[1].dtype == torch.float16
