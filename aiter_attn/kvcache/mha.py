"""MHA/GQA/MQA KV pool: per layer, K ``[num_pages, page_size, kv_heads, head_dim]`` and V
``[num_pages, page_size, kv_heads, v_head_dim]`` (NHD pages)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ._layers import check_layer_id, zeros_per_layer

__all__ = ["MHAKVPool"]


@attrs.define(eq=False)
class MHAKVPool:
    """Paged K/V buffers for ``num_layers`` layers; slot = ``page * page_size + offset``.

    fp8 caches store quantised values; the layer's ``k_scale``/``v_scale`` dequantise them.
    """

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    v_head_dim: Optional[int] = None
    k_buffers: list = attrs.field(init=False)
    v_buffers: list = attrs.field(init=False)

    def __attrs_post_init__(self):
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        shape = (self.num_pages, self.page_size, self.num_kv_heads)
        self.k_buffers = zeros_per_layer(self.num_layers, shape + (self.head_dim,), self.dtype,
                                         self.device)
        self.v_buffers = zeros_per_layer(self.num_layers, shape + (self.v_head_dim,), self.dtype,
                                         self.device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of one layer, paged NHD."""
        check_layer_id(layer_id, self.num_layers)
        return self.k_buffers[layer_id], self.v_buffers[layer_id]
