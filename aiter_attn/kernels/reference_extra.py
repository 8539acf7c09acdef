"""Readable torch references for the KV-write variants of the SWA and 5-D pools.

``write_kv_swa``: slots translated full→SWA through an int table before writing.
``write_kv_5d``: AMD's vectorised layout, K ``[pages, kv_heads, head_dim // X, page_size, X]``
(``X = 16 bytes / element size``) and V either shuffled ``[pages, kv_heads, page_size // X,
head_dim_v, X]`` (5-D) or ``[pages, kv_heads, head_dim_v, page_size]`` (4-D); the layouts are
spelled out in :mod:`aiter_attn.kernels.triton.kv_write`.
Both quantise like :func:`~aiter_attn.kernels.reference.quantize_to_cache` (fp8: divide by the
scale, saturate) and leave every slot they do not write byte-identical.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..hookspecs import hookimpl
from ..types import CGSupport
from .reference import quantize_to_cache
from .registry import Capabilities

__all__ = [
    "build_tree_mask_reference",
    "write_kv_translated_reference",
    "write_kv_5d_reference",
    "kv_5d_from_nhd",
    "kv_nhd_from_5d",
]


def write_kv_translated_reference(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    *,
    full_to_swa: torch.Tensor,
    k_scale=None,
    v_scale=None,
) -> None:
    """``cache.flat[full_to_swa[slots[t]]] = quantise(x[t])``; tokens whose slot or translated
    slot is negative are skipped.

    Caches (SWA pool) ``[pages, page_size, H, D]``; slots int ``[T]`` (full-pool slots);
    full_to_swa int ``[full_slots]``; k/v ``[T, H, D]``.
    """
    slots = slots.long()
    live = slots >= 0
    swa = torch.full_like(slots, -1)
    swa[live] = full_to_swa.long()[slots[live]]
    keep = swa >= 0
    dst = swa[keep]
    kf = k_cache.view(-1, *k_cache.shape[2:])
    kf[dst] = quantize_to_cache(k[keep], k_cache.dtype, k_scale)
    if v_cache is not None and v is not None:
        vf = v_cache.view(-1, *v_cache.shape[2:])
        vf[dst] = quantize_to_cache(v[keep], v_cache.dtype, v_scale)


def kv_nhd_from_5d(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """NHD copies of a 5-D pool: K ``[P, S, H, D]``, V ``[P, S, H, Dv]`` (V 5-D or 4-D)."""
    pages, heads, dhi, page_size, x = k_cache.shape
    k = k_cache.permute(0, 3, 1, 2, 4).reshape(pages, page_size, heads, dhi * x)
    if v_cache.dim() == 5:  # [P, H, S // X, Dv, X] -> [P, S // X, X, H, Dv]
        v = v_cache.permute(0, 2, 4, 1, 3).reshape(pages, page_size, heads, v_cache.shape[3])
    else:  # [P, H, Dv, S]
        v = v_cache.permute(0, 3, 1, 2)
    return k.contiguous(), v.contiguous()


def kv_5d_from_nhd(k: torch.Tensor, v: torch.Tensor, x: int, *, v_shuffled: bool = True):
    """5-D pool (copies) from NHD pages: K ``[P, H, D // x, S, x]``; V ``[P, H, S // x, Dv, x]``
    (``v_shuffled``) or ``[P, H, Dv, S]``."""
    pages, page_size, heads, dim = k.shape
    if dim % x or (v_shuffled and page_size % x):
        raise ValueError(
            f"head_dim={dim} (and, for the shuffled V, page_size={page_size}) must be multiples "
            f"of the vector width x={x}."
        )
    k5 = k.reshape(pages, page_size, heads, dim // x, x).permute(0, 2, 3, 1, 4)
    if v_shuffled:
        vv = v.reshape(pages, page_size // x, x, heads, v.shape[3]).permute(0, 3, 1, 4, 2)
    else:
        vv = v.permute(0, 2, 3, 1)
    return k5.contiguous(), vv.contiguous()


def write_kv_5d_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_scale=None,
    v_scale=None,
) -> None:
    """Element ``(h, d)`` of the token in slot ``s`` (page ``p = s // S``, offset
    ``o = s % S``) goes to ``k_cache[p, h, d // X, o, d % X]`` and to
    ``v_cache[p, h, o // X, d, o % X]`` (5-D V) or ``v_cache[p, h, d, o]`` (4-D V); negative
    slots are skipped.

    k_cache ``[P, H, D // X, S, X]``; v_cache ``[P, H, S // X, Dv, X]`` or ``[P, H, Dv, S]``;
    slots int ``[T]``; k ``[T, H, D]``; v ``[T, H, Dv]``.
    """
    pages, heads, dhi, page_size, x = k_cache.shape
    slots = slots.long()
    keep = slots >= 0
    s = slots[keep]
    p, o = s // page_size, s % page_size
    kq = quantize_to_cache(k[keep], k_cache.dtype, k_scale)  # [n, H, D]
    vq = quantize_to_cache(v[keep], v_cache.dtype, v_scale)  # [n, H, Dv]
    # Advanced indices (p, o) are separated by slices, so the indexed dims come first:
    # k_cache[p, :, :, o, :] is [n, H, D // X, X] and v_cache[p, :, :, o] is [n, H, Dv].
    k_cache[p, :, :, o, :] = kq.reshape(kq.shape[0], heads, dhi, x)
    if v_cache.dim() == 5:
        xv = v_cache.shape[4]
        v_cache[p, :, o // xv, :, o % xv] = vq  # [n, H, Dv]
    else:
        v_cache[p, :, :, o] = vq


def build_tree_mask_reference(seq_lens: torch.Tensor, tree: torch.Tensor, q_len: int,
                    mask_indptr: torch.Tensor, out: torch.Tensor, total: int) -> torch.Tensor:
    """Expand the tree part to SGLang's full layout with torch ops (device, no host sync).

    For request ``b`` with ``L = seq_lens[b]`` keys and prefix ``P = L - q_len``:
    ``out[mask_indptr[b] + i·L + j] = j < P  or  tree[b, i, j - P]``.

    Args:
        seq_lens: int32 ``[batch]`` KV lengths (draft tokens included).
        tree: bool/uint8 with ``batch · q_len²`` elements (``[batch, q_len, q_len]``).
        mask_indptr: int64 ``[batch + 1]``, already filled (see :func:`_fill_mask_indptr`).
        out: bool ``[≥ total]``.
        total: host int ``q_len · Σ seq_lens`` (from the CPU mirror).
    """
    if total == 0:
        return out
    dev = seq_lens.device
    bs = seq_lens.shape[0]
    lens = seq_lens.long()
    req = torch.repeat_interleave(torch.arange(bs, device=dev), lens * q_len, output_size=total)
    local = torch.arange(total, device=dev) - mask_indptr[req]
    kv_len = lens[req]
    i = torch.div(local, kv_len, rounding_mode="floor")
    j_tree = local - i * kv_len - (kv_len - q_len)
    flat = tree.reshape(-1)
    # Padding rows (graph replay) may point past a shorter tree tensor: clamp, never fault.
    idx = ((req * q_len + i) * q_len + j_tree.clamp(min=0)).clamp(max=max(flat.numel() - 1, 0))
    torch.logical_or(j_tree < 0, flat[idx].bool(), out=out[:total])
    return out


@hookimpl
def aiter_attn_register_kernels(register):
    """Register the SWA-translated and 5-D KV-write references (priority 0, any device).

    They skip negative slots with boolean masks, which synchronise on CUDA, so they do not
    claim graph capture; the Triton writes (priority 100 on CUDA) do."""
    caps = Capabilities(cg_support=CGSupport.NEVER, features={"fp8"})
    register("write_kv_swa", "reference", write_kv_translated_reference, caps, priority=0)
    register("write_kv_5d", "reference", write_kv_5d_reference, caps, priority=0)
    # device ops with host-int sizes only: capture-safe
    register("build_tree_mask", "reference", build_tree_mask_reference,
             Capabilities(cg_support=CGSupport.ALWAYS), priority=0)
