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
from ..kv_scales import TOKEN_SCALE_FEATURE, check_token_scale_caches
from ..types import CGSupport
from .reference import quantize_to_cache
from .registry import Capabilities

__all__ = [
    "build_tree_mask_reference",
    "build_draft_decode_indices_reference",
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
    k_scale_cache: Optional[torch.Tensor] = None,
    v_scale_cache: Optional[torch.Tensor] = None,
) -> None:
    """``cache.flat[full_to_swa[slots[t]]] = quantise(x[t])``; tokens whose slot or translated
    slot is negative are skipped.

    Caches (SWA pool) ``[pages, page_size, H, D]``; slots int ``[T]`` (full-pool slots);
    full_to_swa int ``[full_slots]``; k/v ``[T, H, D]``. ``k_scale_cache``/``v_scale_cache``:
    per-(token, head) scales as in :func:`~aiter_attn.kernels.reference.write_kv_reference`
    (written at the translated slots).
    """
    slots = slots.long()
    live = slots >= 0
    swa = torch.full_like(slots, -1)
    swa[live] = full_to_swa.long()[slots[live]]
    keep = swa >= 0
    dst = swa[keep]
    if check_token_scale_caches(k_cache, v_cache if v is not None else None, k_scale_cache,
                                v_scale_cache if v is not None else None):
        from .reference import quantize_per_token_head

        pairs = [(k_cache, k_scale_cache, k, k_scale)]
        if v_cache is not None and v is not None:
            pairs.append((v_cache, v_scale_cache, v, v_scale))
        for cache, scales, x, layer in pairs:
            q, s = quantize_per_token_head(x[keep], cache.dtype, layer)
            cache.view(-1, *cache.shape[2:])[dst] = q
            scales.view(-1, scales.shape[2])[dst] = s
        return
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
        mask_indptr: int64 ``[batch + 1]``, already filled (see :func:`aiter_attn.strategies.spec.fill_mask_indptr`).
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


def build_draft_decode_indices_reference(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    topk: int,
    num_steps: int,
    cu_seqlens_q: torch.Tensor,
    draft_req_pool_indices: torch.Tensor,
    seqused_k: torch.Tensor,
    positions: torch.Tensor,
    out_cache_loc: torch.Tensor,
    block_table: torch.Tensor,
) -> None:
    """Every multi-step draft-decode pass's indices at once, with torch ops (device, no sync).

    Rows ``r = b · topk + k`` (branch ``k`` of request ``b``, ``P = seq_lens[b]`` committed
    tokens), steps ``s < S``: ``cu_seqlens_q = arange(rows + 1)``; ``draft_req_pool_indices[r]
    = req_pool_indices[b]``; ``seqused_k[s, r] = P + s + 1``; ``positions = seqused_k - 1``;
    ``out_cache_loc[s, r]`` = the slot of branch ``k``'s token ``s``; ``block_table[s, r]``
    branch ``k``'s pages (its own copy of the last partial prefix page), 0 past
    ``ceil((P + s + 1) / page_size)``. Branch ``k``'s logical column ``c ≥ base = P − P % ps``
    lives at ``c + k · nnp · ps`` with ``nnp = ceil((P % ps + num_steps) / ps)``
    (:mod:`aiter_attn.multistep` has the layout). Shapes: ``[rows + 1]``, ``[rows]``,
    ``[S, rows]`` ×3 (int32/int64), ``[S, rows, W]`` int32.
    """
    bs = seq_lens.shape[0]
    rows = bs * topk
    steps, width = block_table.shape[0], block_table.shape[2]
    dev = block_table.device
    ps = page_size
    r2t = req_to_token
    torch.arange(rows + 1, out=cu_seqlens_q, dtype=cu_seqlens_q.dtype)
    # expand (not repeat_interleave): fixed sizes, certainly no device→host sync
    rpi = draft_req_pool_indices
    rpi.copy_(req_pool_indices.long().unsqueeze(1).expand(bs, topk).reshape(rows))
    rpi_l = rpi.long()
    prefix = seq_lens.long().unsqueeze(1).expand(bs, topk).reshape(rows)
    branch = torch.arange(rows, device=dev) % topk
    base = prefix - prefix % ps
    shift = branch * ((prefix % ps + num_steps + ps - 1) // ps) * ps  # [rows]

    step = torch.arange(steps, device=dev).unsqueeze(1)  # [S, 1]
    kv_len = prefix.unsqueeze(0) + step + 1  # [S, rows]
    seqused_k.copy_(kv_len)
    positions.copy_(kv_len - 1)
    # the step's token sits at column P + s ≥ base: always in the branch's own pages
    tok_col = (kv_len - 1 + shift).clamp(max=r2t.shape[1] - 1)
    out_cache_loc.copy_(r2t[rpi_l.unsqueeze(0), tok_col])

    first_col = torch.arange(width, device=dev) * ps  # [W]
    col = torch.where(first_col < base.unsqueeze(1), first_col, first_col + shift.unsqueeze(1))
    pages = r2t[rpi_l.unsqueeze(1), col.clamp(max=r2t.shape[1] - 1)] // ps  # [rows, W]
    n_pages = (kv_len + ps - 1) // ps  # [S, rows]
    used = torch.arange(width, device=dev) < n_pages.unsqueeze(2)  # [S, rows, W]
    block_table.copy_(torch.where(used, pages.unsqueeze(0), 0))


@hookimpl
def aiter_attn_register_kernels(register):
    """Register the SWA-translated and 5-D KV-write references (priority 0, any device).

    They skip negative slots with boolean masks, which synchronise on CUDA, so they do not
    claim graph capture; the Triton writes (priority 100 on CUDA) do."""
    caps = Capabilities(cg_support=CGSupport.NEVER, features={"fp8"})
    register("write_kv_swa", "reference", write_kv_translated_reference,
             Capabilities(cg_support=CGSupport.NEVER, features={"fp8", TOKEN_SCALE_FEATURE}),
             priority=0)
    register("write_kv_5d", "reference", write_kv_5d_reference, caps, priority=0)
    # device ops with host-int sizes only: capture-safe
    register("build_tree_mask", "reference", build_tree_mask_reference,
             Capabilities(cg_support=CGSupport.ALWAYS), priority=0)
    register("build_draft_decode_indices", "reference", build_draft_decode_indices_reference,
             Capabilities(cg_support=CGSupport.ALWAYS), priority=0)
