"""Vectorised ("SHUFFLE") 5-D KV pool, the layout AMD's paged-attention kernels read.

Per layer, with ``x = 16 // element_size`` (4 for fp32, 8 for fp16/bf16, 16 for fp8):

* K ``[num_pages, num_kv_heads, head_dim // x, page_size, x]``;
* V ``"shuffled"`` ``[num_pages, num_kv_heads, page_size // x, head_dim_v, x]`` (default; the
  seed's ``vectorized_5d`` pool, ``pa_decode_gluon``'s transposed value layout) or
  ``"hd_page"`` ``[num_pages, num_kv_heads, head_dim_v, page_size]`` (aiter's 4-D value layout;
  the only one that takes ``page_size`` not a multiple of ``x``, e.g. 1).

A slot is ``page * page_size + offset`` as in the NHD pool, so ``req_to_token``, page
allocation and page tables are unchanged; only the placement inside a page differs. The exact
element placement and its sources are documented in :mod:`aiter_attn.kernels.reference_5d`.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..kernels.reference_5d import V_LAYOUTS, vec_width
from ..kernels.reference_extra import kv_nhd_from_5d
from ._layers import check_geometry, check_layer_id, check_page_size, zeros_per_layer

__all__ = ["Vec5DKVPool"]


@attrs.define(eq=False)
class Vec5DKVPool:
    """Paged K/V buffers in the 5-D layout for ``num_layers`` layers.

    Args:
        num_pages: pages per layer, the null page 0 included.
        page_size: tokens per page; a multiple of ``x`` for ``v_layout="shuffled"``.
        num_kv_heads / head_dim / v_head_dim: per-layer KV geometry; ``head_dim`` and
            ``v_head_dim`` must be multiples of ``x``.
        dtype: storage dtype (fp8 stores quantised values; the layer's scales dequantise).
        v_layout: ``"shuffled"`` or ``"hd_page"``.
    """

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    v_head_dim: Optional[int] = None
    v_layout: str = "shuffled"
    k_buffers: list = attrs.field(init=False)
    v_buffers: list = attrs.field(init=False)

    def __attrs_post_init__(self):
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        check_page_size(self.page_size, "Vec5DKVPool")
        check_geometry("Vec5DKVPool", self.dtype, num_pages=self.num_pages,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       v_head_dim=self.v_head_dim, num_layers=self.num_layers)
        x = self.x
        if self.v_layout not in V_LAYOUTS:
            raise ValueError(f"v_layout={self.v_layout!r}; allowed: {V_LAYOUTS}.")
        for name in ("head_dim", "v_head_dim"):
            dim = getattr(self, name)
            if dim % x:
                raise ValueError(
                    f"{name}={dim} is not a multiple of x={x} (16 bytes of {self.dtype}); the 5-D "
                    "layout packs whole 16-byte vectors. Use the NHD MHAKVPool for this head dim."
                )
        if self.v_layout == "shuffled" and self.page_size % x:
            raise ValueError(
                f"page_size={self.page_size} is not a multiple of x={x} ({self.dtype}); the "
                "shuffled value layout splits pages into 16-byte vectors. Use a page size that is "
                "a multiple of x, or v_layout='hd_page'."
            )
        if self.num_pages < 2:
            raise ValueError(f"num_pages={self.num_pages}: need ≥ 2 (page 0 is the null page).")
        n, h, p = self.num_pages, self.num_kv_heads, self.page_size
        k_shape = (n, h, self.head_dim // x, p, x)
        if self.v_layout == "shuffled":
            v_shape = (n, h, p // x, self.v_head_dim, x)
        else:
            v_shape = (n, h, self.v_head_dim, p)
        self.k_buffers = zeros_per_layer(self.num_layers, k_shape, self.dtype, self.device)
        self.v_buffers = zeros_per_layer(self.num_layers, v_shape, self.dtype, self.device)

    @property
    def x(self) -> int:
        """Elements per 16-byte vector of the storage dtype."""
        return vec_width(self.dtype)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of one layer in the 5-D layout."""
        check_layer_id(layer_id, self.num_layers)
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def nhd_view(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K/V as NHD pages ``[num_pages, page_size, H, D]`` (tests)."""
        return kv_nhd_from_5d(*self.kv_buffers(layer_id))
