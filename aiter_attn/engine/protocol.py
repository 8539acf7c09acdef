"""The runner ↔ model boundary: what any engine model provides, whichever class implements it.

A model is anything with a :class:`KVLayout` (so the runner can size the paged KV pool) and a
``forward(input_ids, positions, batch, backend, logits_indices=None) -> logits`` whose
attention layers call ``backend.forward(q, k, v, layer_spec, batch)``. The runner never looks
inside: :class:`~aiter_attn.engine.model.LlamaFamilyModel` is one implementation; a wrapper
that routes an arbitrary ``transformers`` model's attention through the backend can be another.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import attrs
import torch

from ..backend import AttentionBackend
from ..batch import ForwardBatch
from ..types import LayerSpec

__all__ = ["KVLayout", "EngineModel"]


@attrs.frozen(kw_only=True)
class KVLayout:
    """What the paged KV pool must hold for a model.

    Attributes:
        num_layers: attention layers (one K and one V buffer each).
        num_kv_heads: KV heads per layer.
        head_dim / v_head_dim: key and value head dims.
        dtype: activation dtype (the pool stores K/V in it).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype


@runtime_checkable
class EngineModel(Protocol):
    """A causal LM the runner can drive.

    Attributes:
        kv_layout: sizes of the KV pool.
        layer_specs: one :class:`LayerSpec` per attention layer, in pool order.
        vocab_size: logits width.
        device / dtype: where and in which dtype activations live.

    Optional: ``max_positions`` (int), the most positions the model can embed (e.g. its RoPE
    table); the engine then refuses an ``EngineConfig.max_context_len`` above it.
    """

    kv_layout: KVLayout
    layer_specs: list[LayerSpec]
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                backend: AttentionBackend,
                logits_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits float32 ``[len(logits_indices) or num_tokens, vocab_size]``.

        ``input_ids`` int64 ``[num_tokens]`` and ``positions`` int64 ``[num_tokens]`` are the
        step's new tokens in ``batch`` order; ``logits_indices`` int64 picks the rows whose
        logits are needed (usually each request's last token).
        """
