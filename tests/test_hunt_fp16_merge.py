"""fp16 outputs at the edge of fp16's range: the merges' final stores (``merge_attention_states``,
the cascade merge, the MLA split merge in both its launches).

A merge stores a float32 weighted mean of its parts. Parts held in float32 (split partials,
a cascade's shared pass) or bf16 can sit above 65504: a partial row is ``Σ p16·v / Σ p``
(``p`` rounded to fp16 in the p·V dot), up to 2^-11 past the convex combination of cache
values it stands for, so values at 65504 give about 65526, and an fp16 store rounds anything
from 65520 on to ``inf``. The merges clamp an fp16 output to ±65504 at the store
(``_softmax.to_output``; NaN stays NaN), as the attention kernels do
(``tests/test_hunt_fp16_range.py``, whose edge keys these tests reuse). With fp16 parts
(at most 65504) the float32 merge stays within a few float32 ulps of 65504 and never rounded
to inf, so ``merge_attention_states`` is checked with float32 and bf16 parts into an fp16
``out`` (its kernel takes any float dtypes).

Each expected result is the float32 torch reference clamped to ±65504; rows of random data
beside the edge rows are compared by relative error. Run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.reference import merge_attention_states_reference
from aiter_attn.testing.compare import assert_close_rel

from ._cascade_case import SharedCase
from ._triton_util import requires_triton
from .test_hunt_fp16_range import _edge_keys
from .test_triton_mla import RTOL as MLA_RTOL
from .test_triton_mla import MLACase

pytestmark = requires_triton

FP16_MAX = 65504.0
RTOL16 = 2e-3  # the fp16 bound of tests/test_merge.py and tests/test_cascade.py


def _clamped(x: torch.Tensor) -> torch.Tensor:
    """The float32 reference as an fp16 output holds it: clamped to ±65504, NaN kept."""
    return x.float().clamp(-FP16_MAX, FP16_MAX)


# ---------------------------------------------------------------- merge_attention_states

def _merge_parts(part_dtype: torch.dtype):
    """``(o_a, lse_a, o_b, lse_b)``, ``[6, 4, 32]`` parts in ``part_dtype``: tokens 0 and 1
    hold rows past +65504 / below -65504 on both sides (65520..65530 in float32, 65536 in
    bf16: a merged row of them rounds to ±inf in fp16), token 2 one side's first column NaN
    (with weight > 0), tokens 3..5 random data."""
    g = torch.Generator().manual_seed(5)
    t, h, d = 6, 4, 32
    o_a = torch.randn(t, h, d, generator=g) * 3
    o_b = torch.randn(t, h, d, generator=g) * 3
    lse_a = torch.randn(t, h, generator=g) * 2
    lse_b = torch.randn(t, h, generator=g) * 2
    hi_a, hi_b = (65530.0, 65520.0) if part_dtype == torch.float32 else (65536.0, 65536.0)
    o_a[0], o_b[0] = hi_a, hi_b
    o_a[1], o_b[1] = -hi_a, -hi_b
    o_a[2, :, 0] = float("nan")
    return o_a.to(part_dtype), lse_a, o_b.to(part_dtype), lse_b


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_merge_attention_states_fp16_out_at_edge(part_dtype):
    """Parts past ±65504 merged into an fp16 ``out``: ±65504 (before: ±inf); the NaN column
    stays NaN; random rows match the float32 reference."""
    from aiter_attn.kernels.triton.merge import merge_attention_states

    o_a, lse_a, o_b, lse_b = _merge_parts(part_dtype)
    out = torch.full(o_a.shape, float("nan"), dtype=torch.float16)
    out_lse = torch.empty(lse_a.shape)
    merge_attention_states(o_a, lse_a, o_b, lse_b, out, out_lse)
    ref, ref_lse = torch.empty(o_a.shape), torch.empty(lse_a.shape)
    merge_attention_states_reference(o_a, lse_a, o_b, lse_b, ref, ref_lse)
    assert (out[0].float() == FP16_MAX).all() and (out[1].float() == -FP16_MAX).all(), \
        out[:2, 0, :4].tolist()
    assert out[2, :, 0].isnan().all()
    keep = torch.ones(o_a.shape[-1], dtype=torch.bool)
    keep[0] = False  # the NaN column (every token's, so the rows keep one shape)
    assert_close_rel(out[..., keep], _clamped(ref)[..., keep], RTOL16, "merge fp16 out")
    assert_close_rel(out_lse, ref_lse, 1e-6, "merge lse")


# ---------------------------------------------------------------- cascade merge

def _cascade_edge(sign: float) -> SharedCase:
    """Two requests sharing four pages (64 keys: two blocks of the edge keys, each a key of
    score 0 and 31 at ``p ≈ 0.5``, values ``sign · 65504``), each with one own key (the
    query's, score -30: its pass weighs ~1e-13) also at ``sign · 65504``; beside them a run
    of random data (two requests sharing two pages, an extend row). Scale 1, q ``[1, 1/64]``."""
    case = SharedCase([(4, [(4, 1, 1), (4, 1, 1)]), (2, [(2, 5, 2), (2, 9, 1)])], hq=2, hkv=1,
                      d=16, page=16, dtype=torch.float16, seed=3)
    case.scale = 1.0
    c1, c2 = _edge_keys()
    for b in (0, 1):
        pages = case.block_table[b]
        for j in range(65):
            k = torch.zeros(16)
            if j == 64:  # the request's own key
                k[0] = -30.0
            elif j % 32:
                k[0], k[1] = c1, c2
            case.k_cache[pages[j // 16], j % 16, 0] = k.half()
            case.v_cache[pages[j // 16], j % 16, 0] = sign * FP16_MAX
        q = torch.zeros(2, 16)
        q[:, 0], q[:, 1] = 1.0, 1.0 / 64
        case.q[b] = q.half()  # one query token per edge request (tokens 0, 1)
    return case


@pytest.mark.parametrize("splits", [1, 2], ids=["one-split", "two-splits"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_cascade_merge_fp16_at_edge(monkeypatch, splits, sign):
    """Cascade attention whose shared prefix holds the edge keys: the shared partials are
    about ``sign · 65526`` in float32 and the merge's fp16 store gave ±inf; now
    ``sign · 65504``, the random run beside it as the oracle has it."""
    from aiter_attn.kernels.cascade import cascade_paged_attention
    from aiter_attn.kernels.triton import cascade as mod

    monkeypatch.setitem(mod.CASCADE_TUNING, "num_splits", splits)
    case = _cascade_edge(sign)
    out = cascade_paged_attention(case.q, case.k_cache, case.v_cache, **case.args(),
                                  min_shared_tokens=1, backend="triton")
    assert (out[:2].float() == sign * FP16_MAX).all(), out[:2, :, :4].tolist()
    assert_close_rel(out, _clamped(case.oracle()), RTOL16, f"cascade {splits} split(s)")


# ---------------------------------------------------------------- MLA split merge

def _mla_edge64(sign: float) -> MLACase:
    """One decode row over 64 keys, two blocks of the edge keys (each key of score 0 and 31
    at ``p ≈ 0.5``), latents ``[:rank]`` at ``sign · 65504``: with two splits of 32 keys
    each float32 partial is about ``sign · 65526``."""
    rank, rope, n = 64, 16, 64
    case = MLACase([1], [n], page=16, heads=16, rank=rank, rope=rope, dtype=torch.float16,
                   seed=1)
    case.softmax_scale = 1.0
    c1, c2 = _edge_keys()
    lat = torch.zeros(n, rank + rope)
    lat[:, :rank] = sign * FP16_MAX
    edge = torch.arange(n) % 32 != 0
    lat[edge, rank], lat[edge, rank + 1] = c1, c2
    q = torch.zeros_like(case.q)
    q[..., rank], q[..., rank + 1] = 1.0, 1.0 / 64
    case.q = q
    bt = case.block_table[0]
    for j in range(n):
        case.kv_cache[bt[j // 16], j % 16, 0] = lat[j].half()
    case.dense[0] = lat.half().float()[:, None]
    return case


MLA_MERGES = [
    pytest.param(dict(num_kv_splits=2, half_partials=False, fused_merge=False),
                 id="merge-launch-fp32-partials"),
    pytest.param(dict(num_kv_splits=2, half_partials=False, fused_merge=True),
                 id="fused-merge-fp32-partials"),
    pytest.param(dict(num_kv_splits=2, batch_invariant=True), id="batch-invariant"),
]


@pytest.mark.parametrize("extra", MLA_MERGES)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_mla_split_merge_fp16_at_edge(extra, sign):
    """The MLA split merge of float32 partials (``mla_merge``: the merge launch, its
    fixed-order batch-invariant form, and ``merge_head_block`` run inside the attention
    launch) into an fp16 output: ``sign · 65504`` (before: ±inf)."""
    case = _mla_edge64(sign)
    out = case.run(block_n=16, **extra)
    assert (out.float() == sign * FP16_MAX).all(), out.flatten()[:4].tolist()
    assert_close_rel(out, _clamped(case.expected()), MLA_RTOL[torch.float16], f"MLA {extra}")
