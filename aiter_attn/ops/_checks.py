"""Argument checks shared by the ops (host-side: shapes, dtypes, devices, flags; no device
sync). Each raises with the argument's name, its value, what is allowed and the fix."""

from __future__ import annotations

import numbers

import torch

from ..types import FP8_DTYPES
from ..validation import (ATTN_DTYPES, INDEX_DTYPES, check_own_elements, check_same_device,
                          check_tensor)


def _check_window(window_size):
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size={window_size!r}; expected a (left, right) pair of ints ≥ -1 "
            "(-1 = unbounded). HF sliding_window=w is (w - 1, 0)."
        )


def _check_flag(name, value) -> bool:
    """A boolean argument: ``bool`` (numpy's too) or the ints 0 / 1; anything else (a string
    such as ``"False"``, ``None``) is refused rather than read by its truth value."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy"
                                   and kind.__name__ in ("bool", "bool_")):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}={value!r} must be a bool (True or False).")


def _check_hint(name, value):
    """A host length hint (``max_seqlen_q`` / ``max_seqlen_k``): ``None`` or an int ≥ 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be None or an int ≥ 0 (a host bound of the "
                        "per-request lengths; pass int(...)).")
    if value < 0:
        raise ValueError(f"{name}={value!r} must be None or an int ≥ 0 (a host bound of the "
                         "per-request lengths).")
    return int(value)


def _check_cache_axes(name, cache, *, heads: bool = True):
    """A paged cache ``[pages, page_size, heads, dim]`` with at least one token per page and
    (``heads``) one head: the ops divide by both."""
    if cache.shape[1] < 1:
        raise ValueError(f"{name} has shape {tuple(cache.shape)}; its page_size (axis 1) must "
                         "be ≥ 1.")
    if heads and cache.shape[2] < 1:
        raise ValueError(f"{name} has shape {tuple(cache.shape)}; its num_kv_heads (axis 2) "
                         "must be ≥ 1.")


def _lse_buffer(return_lse, out_lse, q):
    """The float32 ``[T, H]`` LSE buffer of a ``return_lse`` call (``out_lse`` checked, or a new
    one), or ``None`` without ``return_lse``/``out_lse``."""
    if out_lse is None:
        if not return_lse:
            return None
        return torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    check_tensor("out_lse", out_lse, dtypes=(torch.float32,), ndim=2,
                 shape=(q.shape[0], q.shape[1]),
                 hint="out_lse is float32 [num_tokens, num_q_heads].")
    check_own_elements("out_lse", out_lse)
    check_same_device("q", q, out_lse=out_lse)
    return out_lse


def _check_mask(custom_mask, mask_indptr, cu_seqlens_q):
    """A tree-verify mask: both or neither, bool/uint8 flat mask, ``[batch + 1]`` indptr
    (devices are checked with the op's other tensors)."""
    if (custom_mask is None) != (mask_indptr is None):
        raise ValueError("custom_mask and mask_indptr go together; pass both or neither.")
    if custom_mask is not None:
        check_tensor("custom_mask", custom_mask, dtypes=(torch.bool, torch.uint8), ndim=1)
        check_tensor("mask_indptr", mask_indptr, dtypes=INDEX_DTYPES, ndim=1,
                     shape=(cu_seqlens_q.shape[0],))


def _check_batch_tensors(q, cu_seqlens_q, seqused_k, block_table, out, v_head_dim: int):
    """The per-request index tensors and ``out`` of a paged call (any cache layout):
    cu_seqlens_q ``[batch + 1]``, seqused_k ``[batch]``, block_table ``[batch, *]``, out
    ``[num_tokens, num_q_heads, v_head_dim]`` in q's dtype."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=INDEX_DTYPES, ndim=1,
                 hint="cu_seqlens_q is int32 [batch + 1].")
    if cu_seqlens_q.shape[0] == 0:
        raise ValueError("cu_seqlens_q has shape (0,); expected [batch + 1] offsets starting "
                         "at 0 (an empty batch is [0]).")
    bs = cu_seqlens_q.shape[0] - 1
    check_tensor("seqused_k", seqused_k, dtypes=INDEX_DTYPES, ndim=1, shape=(bs,),
                 hint="seqused_k is int32 [batch]: KV length per request.")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=2, shape=(bs, None),
                 hint="block_table is int32 [batch, max_pages_per_request].")
    if out is not None:
        check_tensor("out", out, dtypes=(q.dtype,), ndim=3,
                     shape=(q.shape[0], q.shape[1], v_head_dim),
                     hint="out is [num_tokens, num_q_heads, head_dim_v] in q's dtype.")
        check_own_elements("out", out)


def _check_sinks(sinks, num_q_heads: int) -> None:
    """Per-call sinks: ``None`` or floating ``[num_q_heads]`` logits."""
    if sinks is None:
        return
    check_tensor("sinks", sinks, ndim=1, shape=(num_q_heads,),
                 hint="sinks is float32 [num_q_heads].")
    if not sinks.is_floating_point():
        raise TypeError(f"sinks has dtype {sinks.dtype}; sinks are floating-point logits "
                        "(float32 [num_q_heads]). Convert them with .float().")


def _validate_paged(q, k_cache, v_cache, cu_seqlens_q, seqused_k, block_table, out,
                    **optional_tensors):
    check_tensor("q", q, dtypes=ATTN_DTYPES, ndim=3,
                 hint="q is [num_tokens, num_q_heads, head_dim].")
    kv_dtypes = ATTN_DTYPES + tuple(FP8_DTYPES)
    check_tensor("k_cache", k_cache, dtypes=kv_dtypes, ndim=4,
                 hint="k_cache is [num_pages, page_size, num_kv_heads, head_dim].")
    _check_cache_axes("k_cache", k_cache)
    check_tensor("v_cache", v_cache, dtypes=(k_cache.dtype,), ndim=4,
                 shape=(k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], None),
                 hint="v_cache is [num_pages, page_size, num_kv_heads, head_dim_v] like k_cache.")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(
            f"q head_dim={q.shape[2]} but k_cache head_dim={k_cache.shape[3]}; they must match."
        )
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"num_q_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}; "
            "GQA needs whole groups of query heads per KV head."
        )
    _check_batch_tensors(q, cu_seqlens_q, seqused_k, block_table, out, v_cache.shape[3])
    check_same_device("q", q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q,
                      seqused_k=seqused_k, block_table=block_table, out=out, **optional_tensors)
