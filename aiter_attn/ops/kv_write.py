"""The cache-write op, :func:`write_kv`: this step's K/V into the paged cache (fp8 caches
quantised with the scales)."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.registry import KernelRequest
from ..types import FP8_DTYPES
from ..validation import ATTN_DTYPES, INDEX_DTYPES, check_same_device, check_scale, check_tensor
from ._checks import _check_cache_axes
from .selection import _registry

__all__ = ["write_kv"]


def write_kv(
    k_cache: torch.Tensor,
    v_cache: Optional[torch.Tensor],
    slots: torch.Tensor,
    k: torch.Tensor,
    v: Optional[torch.Tensor],
    *,
    k_scale=None,
    v_scale=None,
    backend: Optional[str] = None,
) -> None:
    """Write this step's K/V into the paged cache at ``slots`` (int64 ``[num_tokens]``),
    quantising to fp8 with the scales when the cache is fp8. Touches only those slots.

    Caches ``[num_pages, page_size, heads, dim]``; k/v ``[num_tokens, heads, dim]``.
    """
    check_tensor("k_cache", k_cache, dtypes=ATTN_DTYPES + tuple(FP8_DTYPES), ndim=4,
                 hint="k_cache is [num_pages, page_size, num_kv_heads, head_dim].")
    _check_cache_axes("k_cache", k_cache)
    if (v_cache is None) != (v is None):
        raise ValueError("v_cache and v go together; pass both or neither (v_cache=None, "
                         "v=None: a single latent cache).")
    check_tensor("slots", slots, dtypes=INDEX_DTYPES, ndim=1,
                 hint="slots (out_cache_loc) is int64 [num_tokens].")
    check_tensor("k", k, dtypes=ATTN_DTYPES, ndim=3,
                 shape=(slots.shape[0], k_cache.shape[2], k_cache.shape[3]),
                 hint="k is [num_tokens, num_kv_heads, head_dim] matching the cache.")
    if v is not None:
        # v_cache's slots are k_cache's (a smaller v_cache would be written past its end)
        check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4,
                     shape=(k_cache.shape[0], k_cache.shape[1], None, None),
                     hint="v_cache is [num_pages, page_size, num_kv_heads, head_dim_v] with "
                          "k_cache's pages and dtype.")
        check_tensor("v", v, dtypes=ATTN_DTYPES, ndim=3,
                     shape=(slots.shape[0], v_cache.shape[2], v_cache.shape[3]),
                     hint="v is [num_tokens, num_kv_heads, head_dim_v] matching the cache.")
    check_same_device("k_cache", k_cache, v_cache=v_cache, slots=slots, k=k, v=v,
                      k_scale=k_scale, v_scale=v_scale)
    check_scale("k_scale", k_scale)
    check_scale("v_scale", v_scale)
    req = KernelRequest(
        op="write_kv", device=k_cache.device.type, dtype=k.dtype, kv_dtype=k_cache.dtype,
        head_dim=k_cache.shape[3], page_size=k_cache.shape[1],
        features={"fp8"} if k_cache.dtype in FP8_DTYPES else (),
    )
    _registry().select(req, backend=backend).fn(
        k_cache, v_cache, slots, k, v, k_scale=k_scale, v_scale=v_scale
    )
