"""MHA/GQA/MQA KV pool: per layer, K ``[num_pages, page_size, kv_heads, head_dim]`` and V
``[num_pages, page_size, kv_heads, v_head_dim]`` (NHD pages)."""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..kv_scales import PER_LAYER, PER_TOKEN_HEAD, check_granularity
from ._layers import check_geometry, check_layer_id, check_page_size, zeros_per_layer

__all__ = ["MHAKVPool"]


@attrs.define(eq=False)
class MHAKVPool:
    """Paged K/V buffers for ``num_layers`` layers; slot = ``page * page_size + offset``.

    fp8 caches store quantised values; the layer's ``k_scale``/``v_scale`` dequantise them.
    With ``kv_scale_granularity="per_token_head"`` (fp8 only) the pool also keeps float32
    ``k_scale_buffers``/``v_scale_buffers``, per layer ``[num_pages, page_size, kv_heads]``:
    one dequantisation scale per slot and KV head, written with the K/V and read by the
    attention kernels (:mod:`aiter_attn.kv_scales`). They start at 0 (an unwritten slot reads
    as zeros).
    """

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    v_head_dim: Optional[int] = None
    kv_scale_granularity: str = PER_LAYER
    k_buffers: list = attrs.field(init=False)
    v_buffers: list = attrs.field(init=False)
    k_scale_buffers: list = attrs.field(init=False)
    v_scale_buffers: list = attrs.field(init=False)

    def __attrs_post_init__(self):
        check_granularity(self.kv_scale_granularity, kv_dtype=self.dtype, where="MHAKVPool")
        check_page_size(self.page_size, "MHAKVPool")
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        check_geometry("MHAKVPool", self.dtype, num_pages=self.num_pages,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                       v_head_dim=self.v_head_dim, num_layers=self.num_layers)
        shape = (self.num_pages, self.page_size, self.num_kv_heads)
        self.k_buffers = zeros_per_layer(self.num_layers, shape + (self.head_dim,), self.dtype,
                                         self.device)
        self.v_buffers = zeros_per_layer(self.num_layers, shape + (self.v_head_dim,), self.dtype,
                                         self.device)
        n = self.num_layers if self.kv_scale_granularity == PER_TOKEN_HEAD else 0
        self.k_scale_buffers = zeros_per_layer(n, shape, torch.float32, self.device)
        self.v_scale_buffers = zeros_per_layer(n, shape, torch.float32, self.device)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of one layer, paged NHD."""
        check_layer_id(layer_id, self.num_layers)
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def scale_buffers(self, layer_id: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(k_scales, v_scales)`` float32 ``[num_pages, page_size, kv_heads]`` of one layer
        with per-(token, head) scales, else ``None`` (one scale per layer)."""
        check_layer_id(layer_id, self.num_layers)
        if self.kv_scale_granularity != PER_TOKEN_HEAD:
            return None
        return self.k_scale_buffers[layer_id], self.v_scale_buffers[layer_id]
