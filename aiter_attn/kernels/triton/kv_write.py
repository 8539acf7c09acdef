"""Triton KV writes (reshape-and-cache): NHD pages, full→SWA translated slots, and AMD's 5-D
vectorised layout; fp8 caches are quantised in the kernel (``x / scale``, saturated to the
fp8 range, round-to-nearest-even).

Slot convention: slot ``s`` is token ``s % page_size`` of page ``s // page_size``. Exactly
the batch's slots are written; every other byte of the caches is left as it was. So, where
the device has programmatic dependent launch (sm_90), a write lets the next launch start at
once: our attention launches wait for it before they read the cache, except what
``pdl="early"`` reads first (index tensors and keys older than the step's new ones, which
the write never touches: :mod:`._pdl`). A negative
slot (a padding row, or a full slot with no SWA slot) is skipped. With per-(token, head)
scales (NHD only, :mod:`aiter_attn.kv_scales`) each (token, head) vector is quantised with
its own scale ``amax / (fp8_max · scale)``, stored at ``[page, offset, head]`` of the float32
scale caches.

Layouts (``P`` pages, ``S`` page size, ``H`` KV heads, ``D`` head dim, element ``(h, d)`` of
the token in slot ``s`` with ``p = s // S``, ``o = s % S``):

* NHD (default pool): K ``[P, S, H, D]`` at ``k[p, o, h, d]``; V ``[P, S, H, Dv]`` likewise.
* 5-D (``write_kv_5d``; the layout of vLLM's / AMD aiter's paged-attention kernels):
  K ``[P, H, D // X, S, X]`` with ``X = 16 bytes / element size`` (8 for fp16/bf16, 16 for
  fp8), element at ``k[p, h, d // X, o, d % X]``, so one 16-byte vector holds ``X``
  consecutive dims of one token. V in one of two layouts, told apart by its rank:
  5-D "shuffled" ``[P, H, S // X, Dv, X]`` at ``v[p, h, o // X, d, o % X]`` (what SGLang's
  ``vectorized_5d`` pool allocates and ``pa_decode_gluon`` reads as its transposed value
  cache: ``X`` consecutive tokens of one dim per vector), or 4-D ``[P, H, Dv, S]`` at
  ``v[p, h, d, o]`` (aiter's older value layout; any page size). ``X`` is read from
  ``k_cache.shape[4]`` (and ``v_cache.shape[4]``). Sources: aiter's ``pa_decode_gluon``
  docstring and ``reshape_and_cache`` (``asm_layout``) kernel; see also
  :mod:`aiter_attn.kernels.reference_5d`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...kv_scales import check_token_scale_caches
from ...types import FP8_DTYPES
from ...validation import INDEX_DTYPES, unit_stride
from ._kvutil import fp8_max, next_pow2, scale_args
from ._pdl import gdc_launch_dependents, pdl_supported

__all__ = ["write_kv", "write_kv_translated", "write_kv_5d", "LAYOUT_NHD", "LAYOUT_5D"]

LAYOUT_NHD = 0  #: [P, S, H, D]
_LAYOUT_K5D = 1  #: [P, H, D // X, S, X]
_LAYOUT_V4D = 2  #: [P, H, D, S]
_LAYOUT_V5D = 3  #: [P, H, S // X, D, X]
LAYOUT_5D = (_LAYOUT_K5D, _LAYOUT_V5D, _LAYOUT_V4D)


@triton.jit
def _dst_offsets(page, off, h, d, s0, s1, s2, s3, s4, LAYOUT: tl.constexpr, X: tl.constexpr):
    """Element offsets of ``(h, d)`` [BLOCK_H, BLOCK_D] of the token at (page, off)."""
    if LAYOUT == 0:
        return page * s0 + off * s1 + h * s2 + d * s3
    elif LAYOUT == 1:
        return page * s0 + h * s1 + (d // X) * s2 + off * s3 + (d % X) * s4
    elif LAYOUT == 2:
        return page * s0 + h * s1 + d * s2 + off * s3
    else:
        return page * s0 + h * s1 + (off // X) * s2 + d * s3 + (off % X) * s4


@triton.jit
def _saturate(y, FMAX: tl.constexpr, dst_ptr):
    """float32 ``y`` saturated to ±FMAX, NaN kept as NaN (torch's clamp: tl.minimum/maximum
    lower to PTX min/max, which return the other operand, so a NaN was stored as -FMAX),
    cast to ``dst_ptr``'s fp8 type."""
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    return y.to(dst_ptr.dtype.element_ty)


@triton.jit
def _quantise(x, scale, FMAX: tl.constexpr, FP8: tl.constexpr, dst_ptr):
    if FP8:
        # IEEE division, as torch's (see below)
        return _saturate(tl.math.div_rn(x.to(tl.float32), scale), FMAX, dst_ptr)
    else:
        return x.to(dst_ptr.dtype.element_ty)


@triton.jit
def _write_one(src_ptr, dst_ptr, sc_ptr, t, page, off, ok, scale, num_heads,
               s_t, s_h, d0, d1, d2, d3, d4, c0, c1, c2,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               LAYOUT: tl.constexpr, X: tl.constexpr, FP8: tl.constexpr, FMAX: tl.constexpr,
               TOKEN_SCALES: tl.constexpr):
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = ok & (offs_h < num_heads)
    m = h_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    x = tl.load(src_ptr + t * s_t + offs_h[:, None] * s_h + offs_d[None, :], mask=m, other=0.0)
    if TOKEN_SCALES:
        # one scale per (token, head): s = amax / (FMAX · scale), 1 for an all-zero vector;
        # stored = saturate(x / (s · scale)) (the reference's operations, in its order).
        # Divisions are div_rn: Triton's fp32 ``/`` is the approximate div.full.f32 on NVIDIA
        # (up to 2 ulp), so the stored scales differed from torch's in the last bits on the
        # H200 (test_gpu_token_head_write_bytes_equal_reference, 10:05 UTC run).
        # A vector holding a NaN: torch's amax is NaN there, so the reference's scale is 1
        # (NaN > 0 is false); PTX max skips NaN, so the flag is taken apart.
        xf = x.to(tl.float32)
        nan_row = tl.max((xf != xf).to(tl.int32), axis=1) > 0
        s = tl.math.div_rn(tl.max(tl.abs(xf), axis=1), FMAX * scale)
        s = tl.where((s > 0.0) & (~nan_row), s, 1.0)
        y = _saturate(tl.math.div_rn(xf, (s * scale)[:, None]), FMAX, dst_ptr)
        tl.store(sc_ptr + page * c0 + off * c1 + offs_h.to(tl.int64) * c2, s, mask=h_ok)
    else:
        y = _quantise(x, scale, FMAX, FP8, dst_ptr)
    dst = _dst_offsets(page, off, offs_h[:, None].to(tl.int64), offs_d[None, :].to(tl.int64),
                       d0, d1, d2, d3, d4, LAYOUT, X)
    tl.store(dst_ptr + dst, y, mask=m)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, table_ptr, k_scale_ptr, v_scale_ptr,
    ksc_ptr, vsc_ptr,
    k_scale_val, v_scale_val, num_heads, num_v_heads,
    s_kt, s_kh, s_vt, s_vh,
    k0, k1, k2, k3, k4,
    v0, v1, v2, v3, v4,
    c0, c1, c2,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    K_LAYOUT: tl.constexpr, V_LAYOUT: tl.constexpr, X: tl.constexpr, XV: tl.constexpr,
    HAS_V: tl.constexpr, TRANSLATE: tl.constexpr,
    FP8: tl.constexpr, FMAX: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
    TOKEN_SCALES: tl.constexpr, SIGNAL: tl.constexpr = False,
):
    if SIGNAL:  # the next launch may start now (PDL): it waits before reading what this
        # writes, and reads before that wait only what no write touches (``_pdl``)
        gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if TRANSLATE:
        slot = tl.load(table_ptr + tl.maximum(slot, 0), mask=slot >= 0, other=-1).to(tl.int64)
    ok = slot >= 0
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    k_scale = k_scale_val
    v_scale = v_scale_val
    if SCALE_FROM_PTR:
        k_scale = tl.load(k_scale_ptr).to(tl.float32)
        v_scale = tl.load(v_scale_ptr).to(tl.float32)
    _write_one(k_ptr, kc_ptr, ksc_ptr, t, page, off, ok, k_scale, num_heads, s_kt, s_kh,
               k0, k1, k2, k3, k4, c0, c1, c2, HEAD_DIM, BLOCK_H, BLOCK_D, K_LAYOUT, X, FP8,
               FMAX, TOKEN_SCALES)
    if HAS_V:
        _write_one(v_ptr, vc_ptr, vsc_ptr, t, page, off, ok, v_scale, num_v_heads, s_vt, s_vh,
                   v0, v1, v2, v3, v4, c0, c1, c2, V_HEAD_DIM, BLOCK_H, BLOCK_DV, V_LAYOUT, XV,
                   FP8, FMAX, TOKEN_SCALES)


def _strides5(t: torch.Tensor):
    s = list(t.stride())
    return s + [0] * (5 - len(s))


def _check_rows(name, x, num_tokens, heads, dim):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}.")
    if x.dim() != 3 or tuple(x.shape) != (num_tokens, heads, dim):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)}; expected [num_tokens={num_tokens}, "
            f"heads={heads}, dim={dim}] matching the cache."
        )


def _launch(k_cache, v_cache, slots, k, v, *, k_layout, v_layout, page_size, heads, head_dim,
            v_heads, v_head_dim, x, k_scale, v_scale, table=None, xv=1, k_scale_cache=None,
            v_scale_cache=None):
    if slots.dtype not in INDEX_DTYPES or slots.dim() != 1:
        raise TypeError(
            f"slots has dtype {slots.dtype} and shape {tuple(slots.shape)}; expected int32/int64 "
            "[num_tokens] (out_cache_loc)."
        )
    if (v_cache is None) != (v is None):
        raise ValueError("v_cache and v go together; pass both or neither.")
    num_tokens = slots.shape[0]
    _check_rows("k", k, num_tokens, heads, head_dim)
    if v is not None:
        _check_rows("v", v, num_tokens, v_heads, v_head_dim)
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache dtype {v_cache.dtype} differs from k_cache {k_cache.dtype}.")
    token_scales = check_token_scale_caches(k_cache, v_cache if v is not None else None,
                                            k_scale_cache, v_scale_cache if v is not None
                                            else None)
    if token_scales and k_layout != LAYOUT_NHD:
        raise ValueError("per-(token, head) scales are served on NHD pages only.")
    if num_tokens == 0:
        return
    slots, table = unit_stride(slots), unit_stride(table)  # read with unit stride
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v is not None and v.stride(-1) != 1:
        v = v.contiguous()
    fp8 = k_cache.dtype in FP8_DTYPES
    device = k_cache.device
    ks_t, ks_v, from_ptr = scale_args(k_scale, device)
    vs_t, vs_v, v_from_ptr = scale_args(v_scale if v is not None else k_scale, device)
    if from_ptr != v_from_ptr:  # one constexpr for both: make both tensors
        if not from_ptr:
            ks_t = torch.full((1,), ks_v, dtype=torch.float32, device=device)
        else:
            vs_t = torch.full((1,), vs_v, dtype=torch.float32, device=device)
        from_ptr = True
    block_d = max(16, next_pow2(head_dim))
    block_dv = max(16, next_pow2(v_head_dim)) if v is not None else 16
    block_h = max(1, min(next_pow2(heads), 4096 // max(block_d, block_dv)))
    vc = v_cache if v_cache is not None else k_cache
    vv = v if v is not None else k
    kstr, vstr = _strides5(k_cache), _strides5(vc)
    if token_scales:
        ksc = k_scale_cache
        vsc = v_scale_cache if v is not None else ksc
        cstr = ksc.stride()
    else:
        ksc = vsc = ks_t
        cstr = (0, 0, 0)
    grid = (num_tokens, triton.cdiv(max(heads, v_heads if v is not None else 0), block_h))
    _write_kv_kernel[grid](
        k, vv, k_cache, vc, slots, table if table is not None else slots, ks_t, vs_t,
        ksc, vsc, ks_v, vs_v, heads, v_heads if v is not None else 0,
        k.stride(0), k.stride(1), vv.stride(0), vv.stride(1),
        *kstr, *vstr, *cstr,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_DV=block_dv,
        K_LAYOUT=k_layout, V_LAYOUT=v_layout, X=x, XV=xv, HAS_V=v is not None,
        TRANSLATE=table is not None, FP8=fp8, FMAX=fp8_max(k_cache.dtype),
        SCALE_FROM_PTR=from_ptr, TOKEN_SCALES=token_scales, SIGNAL=pdl_supported(device),
        num_warps=4,
    )


def _launch_nhd(k_cache, v_cache, slots, k, v, *, k_scale, v_scale, table=None,
                k_scale_cache=None, v_scale_cache=None) -> None:
    """Check that ``k_cache`` is NHD ``[pages, page_size, heads, dim]`` and launch the write
    (through the slot translation ``table`` when given)."""
    if k_cache.dim() != 4:
        raise ValueError(
            f"k_cache has shape {tuple(k_cache.shape)}; expected [pages, page_size, heads, dim]."
        )
    _launch(k_cache, v_cache, slots, k, v, k_layout=LAYOUT_NHD, v_layout=LAYOUT_NHD,
            page_size=k_cache.shape[1], heads=k_cache.shape[2], head_dim=k_cache.shape[3],
            v_heads=v_cache.shape[2] if v_cache is not None else 0,
            v_head_dim=v_cache.shape[3] if v_cache is not None else 0, x=1,
            k_scale=k_scale, v_scale=v_scale, table=table, k_scale_cache=k_scale_cache,
            v_scale_cache=v_scale_cache)


def write_kv(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], slots: torch.Tensor,
             k: torch.Tensor, v: Optional[torch.Tensor], *, k_scale=None, v_scale=None,
             k_scale_cache=None, v_scale_cache=None) -> None:
    """Reshape-and-cache into NHD pages: ``cache[s // S, s % S] = quantise(x[t])`` for
    ``s = slots[t]`` (negative slots skipped). Same result as
    :func:`aiter_attn.kernels.reference.write_kv_reference`.

    Args:
        k_cache, v_cache: ``[pages, page_size, kv_heads, head_dim(_v)]``; ``v_cache`` may be
            ``None`` (MLA's single latent cache), then ``v`` must be ``None`` too.
        slots: int64/int32 ``[T]`` (``out_cache_loc``).
        k, v: ``[T, kv_heads, head_dim(_v)]``.
        k_scale, v_scale: fp8 quantisation scales (tensor read on the device, or a number).
        k_scale_cache, v_scale_cache: per-(token, head) scales, float32
            ``[pages, page_size, kv_heads]`` (fp8 caches): each (token, head) vector is
            quantised with its own scale, stored at its slot (:mod:`aiter_attn.kv_scales`).
    """
    _launch_nhd(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale,
                k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)


def write_kv_translated(k_cache: torch.Tensor, v_cache: Optional[torch.Tensor],
                        slots: torch.Tensor, k: torch.Tensor, v: Optional[torch.Tensor], *,
                        full_to_swa: torch.Tensor, k_scale=None, v_scale=None,
                        k_scale_cache=None, v_scale_cache=None) -> None:
    """KV write into a sliding-window pool through a slot translation table (op
    ``write_kv_swa``): token ``t`` goes to SWA slot ``full_to_swa[slots[t]]`` of the NHD caches;
    a negative slot or a negative table entry is skipped. The translation is fused into the
    write (no intermediate tensor). Same result as
    :func:`aiter_attn.kernels.reference_extra.write_kv_translated_reference`.

    Args:
        k_cache, v_cache: SWA pool ``[swa_pages, page_size, kv_heads, head_dim(_v)]``.
        slots: int ``[T]``: full-pool slots (``out_cache_loc``).
        full_to_swa: int32/int64 ``[full_slots]``: SWA slot of every full slot.
        k, v, k_scale, v_scale, k_scale_cache, v_scale_cache: as in :func:`write_kv` (the
            scale caches are the SWA pool's).
    """
    if not isinstance(full_to_swa, torch.Tensor) or full_to_swa.dtype not in INDEX_DTYPES \
            or full_to_swa.dim() != 1:
        raise TypeError(
            "full_to_swa must be an int32/int64 1-D tensor (SWA slot per full slot), got "
            f"{getattr(full_to_swa, 'dtype', type(full_to_swa).__name__)}."
        )
    _launch_nhd(k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale,
                table=full_to_swa, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)


def write_kv_5d(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, *, k_scale=None, v_scale=None) -> None:
    """KV write into the 5-D vectorised layout (op ``write_kv_5d``; see the module docstring).
    Same result as :func:`aiter_attn.kernels.reference_extra.write_kv_5d_reference`.

    Args:
        k_cache: ``[pages, kv_heads, head_dim // X, page_size, X]``.
        v_cache: ``[pages, kv_heads, page_size // X, head_dim_v, X]`` (shuffled) or
            ``[pages, kv_heads, head_dim_v, page_size]``.
        slots: int ``[T]``; k ``[T, kv_heads, head_dim]``; v ``[T, kv_heads, head_dim_v]``.
        k_scale, v_scale: as in :func:`write_kv`.
    """
    if k_cache.dim() != 5 or v_cache is None or v_cache.dim() not in (4, 5):
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)} / v_cache "
            f"{None if v_cache is None else tuple(v_cache.shape)}; expected K "
            "[pages, kv_heads, head_dim // X, page_size, X] and V [pages, kv_heads, "
            "page_size // X, head_dim_v, X] or [pages, kv_heads, head_dim_v, page_size]."
        )
    pages, heads, dhi, page_size, x = k_cache.shape
    if v_cache.dim() == 5:
        xv = v_cache.shape[4]
        ok = (tuple(v_cache.shape[:2]) == (pages, heads)
              and v_cache.shape[2] * xv == page_size)
        v_layout, v_head_dim = _LAYOUT_V5D, v_cache.shape[3]
    else:
        xv = 1
        ok = tuple(v_cache.shape[:2]) == (pages, heads) and v_cache.shape[3] == page_size
        v_layout, v_head_dim = _LAYOUT_V4D, v_cache.shape[2]
    if not ok:
        raise ValueError(
            f"v_cache has shape {tuple(v_cache.shape)}, which does not match k_cache "
            f"{tuple(k_cache.shape)} (pages={pages}, kv_heads={heads}, page_size={page_size})."
        )
    _launch(k_cache, v_cache, slots, k, v, k_layout=_LAYOUT_K5D, v_layout=v_layout,
            page_size=page_size, heads=heads, head_dim=dhi * x, v_heads=heads,
            v_head_dim=v_head_dim, x=x, xv=xv, k_scale=k_scale, v_scale=v_scale)
