"""Online-softmax pieces shared by the Triton attention kernels (paged, cascade shared pass,
dense prefill): a portable tanh for the soft-cap, one key tile's update of the running
``(acc, m, l)`` in the base-2 domain (logits already scaled by ``log2 e``) and the cast of a
finished row to the output's dtype (:func:`to_output`)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tanh", "online_softmax_tile", "online_softmax_tile_pairs", "to_output"]

#: fp16's largest finite value: the bound of an fp16 output row (:func:`to_output`)
_FP16_MAX = tl.constexpr(65504.0)  # jit functions read only constexpr globals


@triton.jit
def tanh(x):
    """Portable tanh (the interpreter and every backend): ``1 - 2 / (e^{2x} + 1)``."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile_weights(m_i, l_i, s):
    """The online softmax's step for base-2 logits ``s`` ``[M, N]``: ``(p, alpha, m_new,
    l_new)``, ``p`` the tile's unnormalised weights and ``alpha`` the rescale of what came
    before; a row that has seen nothing keeps ``m = -inf``, ``l = 0`` (``alpha`` 1, no NaN)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def online_softmax_tile(acc, m_i, l_i, s, v, COMPUTE_DTYPE: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running state. ``s`` float32 ``[M, N]`` base-2 logits
    (masked keys ``-inf``), ``v`` ``[N, Dv]``, ``acc`` float32 ``[M, Dv]``, ``m_i``/``l_i``
    float32 ``[M]`` (running max / exp-sum). A row that has seen nothing keeps ``m = -inf``,
    ``l = 0``, ``acc = 0`` (no NaN). Returns ``(acc, m_new, l_i)``."""
    p, alpha, m_new, l_i = _tile_weights(m_i, l_i, s)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(COMPUTE_DTYPE), v.to(COMPUTE_DTYPE), acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def online_softmax_tile_pairs(acc, acc_odd, m_i, l_i, s, v, v_odd, COMPUTE_DTYPE: tl.constexpr,
                              DOT_PRECISION: tl.constexpr):
    """:func:`online_softmax_tile` with the value columns split by parity: ``v``/``v_odd``
    ``[N, Dv/2]`` hold the even/odd head-dim columns, ``acc``/``acc_odd`` float32
    ``[M, Dv/2]`` their accumulators (two dots of half width, the same arithmetic per
    column). Returns ``(acc, acc_odd, m_new, l_i)``."""
    p, alpha, m_new, l_i = _tile_weights(m_i, l_i, s)
    p = p.to(COMPUTE_DTYPE)
    acc = tl.dot(p, v.to(COMPUTE_DTYPE), acc * alpha[:, None], input_precision=DOT_PRECISION)
    acc_odd = tl.dot(p, v_odd.to(COMPUTE_DTYPE), acc_odd * alpha[:, None],
                     input_precision=DOT_PRECISION)
    return acc, acc_odd, m_new, l_i


@triton.jit
def to_output(o, out_ptr):
    """Finished float32 rows ``o`` cast to ``out_ptr``'s element type; an fp16 output is
    clamped to ±65504 first. A row is ``Σ p16·v / Σ p`` (p rounded to 16 bits in the p·V dot,
    float32 in the row sum), up to 2^-11 past the convex combination of cache values it
    stands for, so values at fp16's largest finite could round to inf in the store. NaN stays
    NaN; bf16/fp32 outputs take the plain cast (a compile-time branch)."""
    if out_ptr.dtype.element_ty == tl.float16:
        o = tl.clamp(o, -_FP16_MAX, _FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    return o.to(out_ptr.dtype.element_ty)
