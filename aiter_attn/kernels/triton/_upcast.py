"""Device helper: 8-bit value tiles widened for ``tl.dot`` without byte-wise operand reads."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["upcast_rows"]


@triton.jit
def upcast_rows(x, dtype: tl.constexpr):
    """``x.to(dtype)`` for an 8-bit ``[N, C]`` value tile feeding ``tl.dot`` as its B operand
    (reduction axis N, strided in shared memory), done on the tile as loaded.

    A plain cast is moved by Triton after the shared-memory read, into the MMA operand
    layout, and an 8-bit operand that needs transposing has no ``ldmatrix`` form: sm_90 PTX
    then reads it byte by byte (384 ``ld.shared.b8`` in the fp8 decode kernel). Splitting the
    tile into column pairs and joining them back (same element order) stops that move: the
    tile is read with 16-byte loads, converted, staged as 16-bit and read with
    ``ldmatrix.trans`` (``scripts/inspect_sm90.py``: no byte loads, 255 -> 212 registers,
    216 -> 0 spilled bytes at 64x16k e4m3).
    """
    pairs = tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2])
    lo, hi = tl.split(pairs)
    return tl.reshape(tl.join(lo.to(dtype), hi.to(dtype)), x.shape)
