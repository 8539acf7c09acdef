"""Triton ``merge_attention_states``: combine two partial attention results by their LSE.

Math (per token ``t`` and head ``h``; LSEs in natural log, the flash-attn convention)::

    M   = max(lse_a, lse_b)            (0 when both are -inf)
    w_x = exp(lse_x - M)               (0 for a side with lse_x = -inf)
    out = (w_a · o_a + w_b · o_b) / (w_a + w_b)        (0 when w_a + w_b = 0)
    lse = M + ln(w_a + w_b)                             (-inf when w_a + w_b = 0)

A side of weight 0 is selected away, not multiplied by 0, so whatever its ``o`` holds (NaN from
an unwritten buffer included) never reaches the result. An fp16 ``out`` is clamped to ±65504
at the store (float32 or bf16 parts past it would round to inf; :func:`._softmax.to_output`);
NaN stays NaN. One program per (token, block of
heads); no atomics, fixed order: bitwise reproducible. No host reads: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kvutil import next_pow2
from ._softmax import to_output

__all__ = ["merge_attention_states"]

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _merge_kernel(
    OA, LA, OB, LB, O, LO, num_heads,
    s_oat, s_oah, s_obt, s_obh, s_ot, s_oh,
    s_lat, s_lah, s_lbt, s_lbh, s_lot, s_loh,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    h64 = offs_h.to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    m2 = h_mask[:, None] & d_mask[None, :]
    la = tl.load(LA + t * s_lat + h64 * s_lah, mask=h_mask, other=float("-inf")).to(tl.float32)
    lb = tl.load(LB + t * s_lbt + h64 * s_lbh, mask=h_mask, other=float("-inf")).to(tl.float32)
    m = tl.maximum(la, lb)
    m = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp2((la - m) * _LOG2E)
    wb = tl.exp2((lb - m) * _LOG2E)
    oa = tl.load(OA + t * s_oat + h64[:, None] * s_oah + offs_d[None, :], mask=m2,
                 other=0.0).to(tl.float32)
    ob = tl.load(OB + t * s_obt + h64[:, None] * s_obh + offs_d[None, :], mask=m2,
                 other=0.0).to(tl.float32)
    ta = tl.where(wa[:, None] > 0.0, wa[:, None] * oa, 0.0)
    tb = tl.where(wb[:, None] > 0.0, wb[:, None] * ob, 0.0)
    den = wa + wb
    safe = tl.where(den > 0.0, den, 1.0)
    o = (ta + tb) / safe[:, None]
    tl.store(O + t * s_ot + h64[:, None] * s_oh + offs_d[None, :], to_output(o, O), mask=m2)
    lse = tl.where(den > 0.0, m + tl.log2(safe) / _LOG2E, float("-inf"))
    tl.store(LO + t * s_lot + h64 * s_loh, lse, mask=h_mask)


def merge_attention_states(
    o_a: torch.Tensor,
    lse_a: torch.Tensor,
    o_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial results (see the module docstring) into ``out`` / ``out_lse``.

    Shapes: o_a, o_b, out ``[T, H, D]`` (any float dtype; last axis contiguous); lse_a, lse_b,
    out_lse float32 ``[T, H]`` (any strides). ``out`` may alias ``o_a`` or ``o_b`` (each
    program reads its elements before writing them). Returns ``(out, out_lse)``.
    """
    num_tokens, num_heads, d = out.shape
    if num_tokens == 0 or num_heads == 0:
        return out, out_lse
    for name, t in (("o_a", o_a), ("o_b", o_b), ("out", out)):
        if t.stride(2) != 1:
            raise ValueError(
                f"merge_attention_states needs the last axis of {name} to be contiguous "
                f"(stride {t.stride(2)}); pass a .contiguous() tensor."
            )
    d_pad = max(16, next_pow2(d))
    block_h = max(1, min(next_pow2(num_heads), max(1, 4096 // d_pad)))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _merge_kernel[grid](
        o_a, lse_a, o_b, lse_b, out, out_lse, num_heads,
        o_a.stride(0), o_a.stride(1), o_b.stride(0), o_b.stride(1), out.stride(0), out.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        out_lse.stride(0), out_lse.stride(1),
        D=d, D_PAD=d_pad, BLOCK_H=block_h, num_warps=4,
    )
    return out, out_lse
