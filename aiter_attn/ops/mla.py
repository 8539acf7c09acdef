"""The absorbed-MLA op, :func:`mla_paged_attention`: attention over a latent paged cache."""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..kernels.base import mla_request
from ..types import FP8_DTYPES
from ..validation import ATTN_DTYPES, check_attention_scalars, check_tensor
from ._checks import (_check_cache_axes, _check_flag, _check_hint, _check_mask, _lse_buffer,
                      _validate_paged)
from .selection import _registry, call_extras

__all__ = ["mla_paged_attention"]


def mla_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    kv_lora_rank: int,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    kv_scale=None,
    out: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
    return_lse: bool = False,
    out_lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
):
    """Absorbed MLA over a latent paged cache.

    Args:
        q: ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` (q_nope absorbed + q_rope).
        kv_cache: ``[num_pages, page_size, 1, kv_lora_rank + rope_dim]``; values are its first
            ``kv_lora_rank`` dims.
        Others as in :func:`paged_attention` (``return_lse``/``out_lse`` included).

    Returns:
        ``[num_tokens, num_heads, kv_lora_rank]`` in q's dtype; with ``return_lse`` the pair
        ``(out, lse)``, lse float32 ``[num_tokens, num_heads]``.
    """
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3,
                 hint="q is [num_tokens, num_heads, kv_lora_rank + rope_dim].")
    check_tensor("kv_cache", kv_cache, dtypes=ATTN_DTYPES + tuple(FP8_DTYPES), ndim=4,
                 shape=(None, None, 1, q.shape[2]),
                 hint="kv_cache is [num_pages, page_size, 1, kv_lora_rank + rope_dim].")
    _check_cache_axes("kv_cache", kv_cache, heads=False)
    causal = _check_flag("causal", causal)
    return_lse = _check_flag("return_lse", return_lse)
    batch_invariant = _check_flag("batch_invariant", batch_invariant)
    max_seqlen_q = _check_hint("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_hint("max_seqlen_k", max_seqlen_k)
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, numbers.Integral):
        raise TypeError(f"kv_lora_rank={kv_lora_rank!r} must be a Python int (the latent "
                        "width, e.g. 512); pass int(...).")
    kv_lora_rank = int(kv_lora_rank)
    if not 0 < kv_lora_rank <= q.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank}; must be in 1..{q.shape[2]} (q's last dim).")
    _validate_paged(q, kv_cache, kv_cache[..., :kv_lora_rank], cu_seqlens_q, seqused_k,
                    block_table, out, custom_mask=custom_mask, mask_indptr=mask_indptr,
                    kv_scale=kv_scale)
    softmax_scale, _ = check_attention_scalars(softmax_scale, kv_scale=kv_scale)
    _check_mask(custom_mask, mask_indptr, cu_seqlens_q)
    lse = _lse_buffer(return_lse, out_lse, q)
    # non_causal: kernels that serve causal attention only are not selected
    req = mla_request(q, kv_cache, kv_lora_rank, custom_mask=custom_mask is not None,
                      lse=lse is not None, batch_invariant=batch_invariant, causal=causal)
    sel = _registry().select(req, backend=backend)
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], kv_lora_rank, dtype=q.dtype, device=q.device)
    extra = call_extras(lse, batch_invariant)
    out = sel.fn(
        q, kv_cache, out, kv_lora_rank=kv_lora_rank, cu_seqlens_q=cu_seqlens_q,
        seqused_k=seqused_k, block_table=block_table, softmax_scale=float(softmax_scale),
        causal=causal, kv_scale=kv_scale, custom_mask=custom_mask, mask_indptr=mask_indptr,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra,
    )
    return out if lse is None else (out, lse)
