"""Readable float32 torch references for the vectorised ("SHUFFLE") 5-D KV layout.

The layout is the one AMD's paged-attention kernels read; ``x = 16 // element_size`` elements
make one 16-byte vector (x = 4 for fp32, 8 for fp16/bf16, 16 for fp8):

* K: ``[num_pages, num_kv_heads, head_dim // x, page_size, x]``: element ``(t, h, d)`` of a
  token at ``slot = page * page_size + off`` lives at ``k[page, h, d // x, off, d % x]``.
* V, ``"shuffled"`` (the default; what SGLang's ``vectorized_5d`` pool allocates and what
  ``pa_decode_gluon`` calls ``VALUE_TRANSPOSED``): ``[num_pages, num_kv_heads,
  page_size // x, head_dim_v, x]``: element ``(t, h, d)`` at ``v[page, h, off // x, d, off % x]``.
* V, ``"hd_page"`` (aiter's older 4-D value layout, any page size incl. 1):
  ``[num_pages, num_kv_heads, head_dim_v, page_size]``: element ``(t, h, d)`` at
  ``v[page, h, d, off]``.

Where these come from (read, not copied):

* ``ROCm/aiter`` ``aiter/ops/triton/gluon/pa_decode_gluon.py``, function ``pa_decode_gluon``:
  its docstring gives ``key_cache [num_blocks, num_kv_heads, head_size // x, kv_block_size, x]``
  and ``value_cache [num_blocks, num_kv_heads, head_size, kv_block_size]`` or, transposed,
  ``[num_blocks, num_kv_heads, kv_block_size // x, head_size, x]`` with ``x = 16 // itemsize``
  (read at commit ``e4048607``; the function is not in the ``amd-aiter`` 0.1.7.post2 wheel).
* ``amd-aiter`` wheel, ``aiter_meta/csrc/kernels/cache_kernels.cu``, ``reshape_and_cache_kernel``
  (``asmLayout`` branch) and ``aiter/ops/cache.py`` ``reshape_and_cache(..., asm_layout=True)``:
  the writer's index arithmetic for both value layouts.
* ``amd-aiter`` wheel, ``aiter/paged_attn.py``, ``PagedAttention.split_kv_cache``: the K view
  ``(num_blocks, num_kv_heads, head_size // x, -1, x)`` and the 4-D V view.
* SGLang's ``aiter_utils.forward_decode_vectorized_5d`` (the seed's 5-D decode) names the pool
  ``K: [nb, nkv, hd//x, page, x], V: [nb, nkv, page//x, hd, x]``.

The attention reference gathers the pages a batch uses, turns them into NHD pages
(:func:`~aiter_attn.kernels.reference_extra.kv_nhd_from_5d`) and runs
:func:`~aiter_attn.kernels.reference.paged_attention_reference` on them, so the math is the
one reference every other path is tested against. The KV write into this layout is op
``write_kv_5d`` (:func:`~aiter_attn.kernels.reference_extra.write_kv_5d_reference`, and a
Triton kernel).
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import paged_attention_reference
from .reference_extra import kv_nhd_from_5d

__all__ = ["V_LAYOUTS", "vec_width", "v_layout_of", "paged_attention_5d_reference"]

#: Value layouts of the 5-D pool (see the module docstring).
V_LAYOUTS = ("shuffled", "hd_page")


def vec_width(dtype: torch.dtype) -> int:
    """``x``: elements of ``dtype`` in one 16-byte vector (16 // element size)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def v_layout_of(v_cache: torch.Tensor) -> str:
    """``"shuffled"`` for a 5-D value cache, ``"hd_page"`` for a 4-D one."""
    return "shuffled" if v_cache.dim() == 5 else "hd_page"


def paged_attention_5d_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale=None,
    v_scale=None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``paged_attention`` semantics over the 5-D layout, in float32.

    Gathers the ``batch × max_pages`` pages named by ``block_table``, converts them to NHD
    pages (``[B·W, P, H, D]``), renumbers the table to ``arange(B·W)`` and calls the NHD
    reference with every other argument unchanged (``lse`` too). q ``[T, Hq, D]``; out
    ``[T, Hq, Dv]``.
    """
    bs, width = block_table.shape
    pages = block_table.reshape(-1).long()
    k_nhd, v_nhd = kv_nhd_from_5d(k_cache[pages], v_cache[pages])
    local = torch.arange(bs * width, dtype=torch.int32, device=block_table.device).view(bs, width)
    return paged_attention_reference(
        q, k_nhd, v_nhd, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        block_table=local, softmax_scale=softmax_scale, causal=causal, window_size=window_size,
        softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
        custom_mask=custom_mask, mask_indptr=mask_indptr, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, lse=lse,
    )
