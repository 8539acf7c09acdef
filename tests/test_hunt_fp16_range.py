"""fp16 outputs at the edge of fp16's range: every Triton attention kernel's final store.

An output row is ``(Σ_j p16_j · v_j) / Σ_j p_j``: the numerator takes ``p`` rounded to fp16
(the p·V dot), the denominator the float32 ``p``. Where every visible value is 65504 (fp16's
largest finite) the row computes up to 2^-11 above it, and an fp16 store rounds anything
from 65520 on to ``inf``, while the exact row (a convex combination of cache values) is
65504. The kernels clamp an fp16 output to ±65504 at the store (bf16/fp32 outputs keep the
plain cast); NaN stays NaN.

The inputs (:func:`_edge_keys`): 32 keys, one scoring 0 (``p = 1``) and 31 scoring ``ln p``
with ``p`` just past an fp16 rounding midpoint above 0.5 (``p16 - p ≈ 3.7e-4·p``), so the
row computes to about 65526. Checked in Triton's interpreter (fp16) against the float64
oracle: MLA decode with one split, paged decode unsplit / split (reduction launch and
fused reduction), dense prefill and its prefix-merging epilogue (the extend path).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_mla import MLACase
from .test_triton_mla import RTOL as MLA_RTOL
from .test_triton_paged_attention import Case
from .test_triton_paged_attention import RTOL as PAGED_RTOL

pytestmark = requires_triton

FP16_MAX = 65504.0
_LOG2E = torch.tensor(1.4426950408889634, dtype=torch.float32)
L = 32  # keys


def _edge_keys() -> tuple[torch.Tensor, torch.Tensor]:
    """``(c1, c2)``: key 0 scores 0, keys 1.. score ``c1 + c2 / 64`` (exact in fp16 inputs
    with ``q = [1, 1/64]``, float32 accumulation) where ``p = e^score`` sits just past the
    fp16 rounding midpoint ``0.5 + 2^-12`` (so ``p16`` rounds up by ~2^-12)."""
    c1 = torch.tensor(-0.693359375)
    c2s = torch.arange(-1.0, 1.0, 2 ** -11).half().unique().float()
    p = torch.exp2((c1 + c2s / 64) * _LOG2E)
    return c1, c2s[(p - (0.5 + 2 ** -12 + 2 ** -14)).abs().argmin()]


def _dense_edge(sign: float, d: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [1, 1, d]``, ``k [L, 1, d]``, ``v [L, 1, d]`` fp16: the edge scores, every value
    ``sign · 65504``."""
    c1, c2 = _edge_keys()
    q = torch.zeros(1, 1, d)
    q[0, 0, 0], q[0, 0, 1] = 1.0, 1.0 / 64
    k = torch.zeros(L, 1, d)
    k[1:, 0, 0], k[1:, 0, 1] = c1, c2
    v = torch.full((L, 1, d), sign * FP16_MAX)
    return q.half(), k.half(), v.half()


def _oracle(q, k, v) -> torch.Tensor:
    """float64 softmax(q·kᵀ)·v per head ``[Tq, H, Dv]`` (scale 1, nothing masked)."""
    s = torch.einsum("thd,khd->thk", q.double(), k.double())
    return torch.einsum("thk,khd->thd", torch.softmax(s, -1), v.double())


def _check(out: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    assert torch.isfinite(out).all(), f"{what}: {out.flatten()[:4].tolist()}"
    assert_close_rel(out, want, rtol, what)


# ---------------------------------------------------------------- MLA, one split

def _mla_edge(sign: float) -> MLACase:
    """One decode row over the 32 edge keys, values (latents ``[:rank]``) at ``sign·65504``."""
    rank, rope = 64, 16
    case = MLACase([1], [L], page=16, heads=16, rank=rank, rope=rope, dtype=torch.float16,
                   seed=1)
    case.softmax_scale = 1.0
    c1, c2 = _edge_keys()
    lat = torch.zeros(L, rank + rope)
    lat[:, :rank] = sign * FP16_MAX
    lat[1:, rank], lat[1:, rank + 1] = c1, c2
    q = torch.zeros_like(case.q)
    q[..., rank], q[..., rank + 1] = 1.0, 1.0 / 64
    case.q = q
    bt = case.block_table[0]
    for j in range(L):
        case.kv_cache[bt[j // 16], j % 16, 0] = lat[j].half()
    case.dense[0] = lat.half().float()[:, None]
    return case


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_mla_one_split_at_fp16_max_is_finite(sign):
    """MLA decode, one split (the row stored straight to ``out``): ±65504 values give
    ±65504 rows, as the oracle does (before: ±inf)."""
    case = _mla_edge(sign)
    out = case.run(num_kv_splits=1, block_n=16)
    _check(out, case.expected(), MLA_RTOL[torch.float16], "MLA one split")
    assert (out.float() == sign * FP16_MAX).all()


# ---------------------------------------------------------------- paged decode

def _paged_edge(sign: float) -> Case:
    case = Case([1], [L], hq=2, hkv=1, d=16, page=16, dtype=torch.float16, seed=2)
    q, k, v = _dense_edge(sign)
    case.q = q.expand(1, 2, 16).contiguous()
    case.scale = 1.0
    bt = case.block_table[0]
    for j in range(L):
        case.k_cache[bt[j // 16], j % 16] = k[j]
        case.v_cache[bt[j // 16], j % 16] = v[j]
    case.dense_k, case.dense_v = [k.float()], [v.float()]
    return case


PAGED_PATHS = [
    pytest.param({"num_splits": 1}, id="unsplit"),
    pytest.param({"num_splits": 2, "fused_reduce": False}, id="split-reduce-launch"),
    pytest.param({"num_splits": 2, "fused_reduce": True}, id="split-fused-reduce"),
]


@pytest.mark.parametrize("overrides", PAGED_PATHS)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_paged_decode_at_fp16_max_is_finite(monkeypatch, overrides, sign):
    """Paged decode over the edge keys, unsplit and through both split reductions."""
    from aiter_attn.kernels.triton import paged_attention as mod

    for key, val in overrides.items():
        monkeypatch.setitem(mod.TUNING_OVERRIDES, key, val)
    case = _paged_edge(sign)
    out = case.run()
    _check(out, case.expected(), PAGED_RTOL[torch.float16], f"paged {overrides}")
    assert (out.float() == sign * FP16_MAX).all()


def test_paged_decode_fp32_output_keeps_its_value():
    """A float32 run of the same inputs stores the computed row unclamped: only fp16
    outputs take the clamp (a float32 row may exceed 65504)."""
    case = _paged_edge(1.0)
    case.q = case.q.float()
    case.k_cache, case.v_cache = case.k_cache.float(), case.v_cache.float()
    case.dtype = torch.float32
    case.v_cache[case.block_table[0, 0], 0] = 2 * FP16_MAX  # key 0 (p = 1) at 131008
    case.dense_v[0][0] = 2 * FP16_MAX
    out = case.run()
    assert (out > FP16_MAX).all()
    assert_close_rel(out, case.expected(), PAGED_RTOL[torch.float32], "paged fp32")


# ---------------------------------------------------------------- dense prefill / extend

def _prefill(q, k, v, prefix=None):
    from aiter_attn.kernels.triton.prefill import dense_prefill

    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype)
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    return dense_prefill(q, k, v, out, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                         max_seqlen_q=q.shape[0], max_seqlen_k=k.shape[0], softmax_scale=1.0,
                         causal=False, prefix=prefix)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["plus", "minus"])
def test_dense_prefill_at_fp16_max_is_finite(sign):
    """Dense prefill (also the extend path's new-token pass) over the edge keys."""
    q, k, v = _dense_edge(sign)
    out = _prefill(q, k, v)
    _check(out, _oracle(q, k, v), PAGED_RTOL[torch.float16], "dense prefill")
    assert (out.float() == sign * FP16_MAX).all()


def test_dense_prefill_prefix_merge_at_fp16_max_is_finite():
    """The extend epilogue merging a cached prefix's ``(o_p, lse_p)``: a prefix row of 65504
    beside the edge keys stays 65504."""
    q, k, v = _dense_edge(1.0)
    o_p = torch.full((1, 1, 16), FP16_MAX).half()
    lse_p = torch.zeros(1, 1)  # the prefix weighs as one key of score 0
    out = _prefill(q, k, v, prefix=(o_p, lse_p))
    _check(out, torch.full((1, 1, 16), FP16_MAX), PAGED_RTOL[torch.float16], "prefix merge")


def test_nan_values_stay_nan():
    """The clamp keeps NaN: a NaN value column gives a NaN row (not ±65504)."""
    q, k, v = _dense_edge(1.0)
    v[:, 0, 0] = float("nan")
    out = _prefill(q, k, v)
    assert out[0, 0, 0].isnan() and (out[0, 0, 1:].float() == FP16_MAX).all()
