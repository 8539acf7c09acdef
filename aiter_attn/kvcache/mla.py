"""MLA (DeepSeek-V2/V3 latent attention) KV pool: per layer one latent cache
``[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]``.

Each token stores its compressed latent ``c_kv`` (the first ``kv_lora_rank`` dims) followed by
its rotary key part ``k_pe`` (the last ``qk_rope_head_dim`` dims), shared by every head. In the
absorbed form the whole vector is the single KV head's key and its first ``kv_lora_rank`` dims
are the value (see :func:`aiter_attn.ops.mla_paged_attention`).
"""

from __future__ import annotations

import attrs
import torch

from ._layers import check_geometry, check_int, check_layer_id, zeros_per_layer

__all__ = ["MLAKVPool"]


def _positive(instance, attribute, value):
    """attrs validator: a positive integer (a bool is not one)."""
    check_int(value, f"MLAKVPool.{attribute.name}", 1)


@attrs.define(eq=False)
class MLAKVPool:
    """Paged latent buffers for ``num_layers`` layers; slot = ``page * page_size + offset``.

    Page 0 is the null page (never handed to a live request by
    :class:`~aiter_attn.kvcache.PageAllocator`). fp8 caches store ``latent / kv_scale``; the
    layer's ``k_scale`` is the latent's dequantisation scale.

    Attributes:
        num_pages / page_size: pool geometry (``num_slots = num_pages * page_size``).
        kv_lora_rank: latent dim (DeepSeek-V2/V3: 512).
        qk_rope_head_dim: rotary key dim (DeepSeek-V2/V3: 64).
        num_layers: layers with a latent cache.
        dtype: storage dtype (fp16/bf16/fp32 or fp8).
        latent_buffers: per layer ``[num_pages, page_size, 1, latent_dim]``.
    """

    num_pages: int = attrs.field(validator=_positive)
    page_size: int = attrs.field(validator=_positive)
    kv_lora_rank: int = attrs.field(validator=_positive)
    qk_rope_head_dim: int = attrs.field(validator=_positive)
    num_layers: int = attrs.field(validator=_positive)
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    latent_buffers: list = attrs.field(init=False)

    def __attrs_post_init__(self):
        check_geometry("MLAKVPool", self.dtype)
        shape = (self.num_pages, self.page_size, 1, self.latent_dim)
        self.latent_buffers = zeros_per_layer(self.num_layers, shape, self.dtype, self.device)

    @property
    def latent_dim(self) -> int:
        """``kv_lora_rank + qk_rope_head_dim``: the absorbed head dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def _check_layer(self, layer_id: int) -> None:
        check_layer_id(layer_id, self.num_layers)

    def kv_buffer(self, layer_id: int) -> torch.Tensor:
        """The latent cache of one layer: ``[num_pages, page_size, 1, latent_dim]``."""
        self._check_layer(layer_id)
        return self.latent_buffers[layer_id]

    def kv_buffers(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` views in MHA terms: keys are the whole latent+rope
        vector, values its first ``kv_lora_rank`` dims (a strided view, no copy)."""
        kv = self.kv_buffer(layer_id)
        return kv, kv[..., : self.kv_lora_rank]

    def write_latent(self, layer_id: int, slots: torch.Tensor, latent: torch.Tensor, *,
                     kv_scale=None, backend=None) -> None:
        """Store this step's latent+rope vectors at ``slots`` (quantising to fp8 with
        ``kv_scale`` when the cache is fp8). Touches only those slots.

        Args:
            slots: int64 ``[num_tokens]`` (the batch's ``out_cache_loc``).
            latent: ``[num_tokens, latent_dim]`` or ``[num_tokens, 1, latent_dim]``: ``c_kv``
                then ``k_pe`` (rotary already applied).
        """
        from .. import ops  # late: ops → kernels registry; the pool itself needs only torch

        kv = self.kv_buffer(layer_id)
        if latent.dim() == 2:
            latent = latent.unsqueeze(1)
        ops.write_kv(kv, None, slots, latent, None, k_scale=kv_scale, backend=backend)
