"""Strategy contracts: :class:`MetadataStrategy` (plan) and :class:`ExecutionStrategy` (run).

``plan(batch, out=None)`` is the one planning path: eager calls allocate buffers sized to the
batch from :meth:`MetadataStrategy.buffer_spec`; CUDA-graph capture/replay pass static buffers
(sized for the largest batch) and get views into them. Both run the same code.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Optional

import attrs
import torch

from ..batch import ForwardBatch
from ..metadata import AttnMetadata
from ..types import BackendConfig, CGSupport, LayerSpec

__all__ = ["BufferSpec", "StrategyContext", "MetadataStrategy", "ExecutionStrategy"]


@attrs.frozen
class BufferSpec:
    """Static buffers a strategy needs: ``name → (shape, dtype)``.

    Sizes are upper bounds (largest batch, longest context, every slack the mode needs).
    """

    buffers: Mapping[str, tuple] = attrs.field(factory=dict)

    def merge(self, other: "BufferSpec") -> "BufferSpec":
        merged = dict(self.buffers)
        for name, (shape, dtype) in other.buffers.items():
            if name in merged and merged[name][1] != dtype:
                raise ValueError(f"buffer {name!r} declared with dtypes {merged[name][1]} and {dtype}.")
            if name in merged:
                old = merged[name][0]
                shape = tuple(max(a, b) for a, b in zip(old, shape))
            merged[name] = (tuple(shape), dtype)
        return BufferSpec(merged)

    def allocate(self, device) -> dict[str, torch.Tensor]:
        """Fresh zero-filled tensors (zero = null page / slot 0, always safe to read)."""
        return {
            name: torch.zeros(shape, dtype=dtype, device=device)
            for name, (shape, dtype) in self.buffers.items()
        }


@attrs.define(eq=False)
class StrategyContext:
    """What strategies share within one backend: config, pools and the kernel registry.

    Attributes:
        config: static backend settings.
        req_to_token: int32 ``[R, max_context_len]`` request→slot table.
        kv_pool: the architecture's KV pool (``MHAKVPool``, an MLA/SWA/5-D pool, …).
        kernels: the kernel registry used for selection.
        extra: architecture-specific objects (SWA pool and translation table, MLA projections).
    """

    config: BackendConfig
    req_to_token: torch.Tensor
    kv_pool: Any
    kernels: Any
    extra: dict = attrs.field(factory=dict)

    @property
    def device(self) -> torch.device:
        return self.req_to_token.device


class MetadataStrategy(abc.ABC):
    """Builds per-step :class:`AttnMetadata` on the device."""

    cg_support: CGSupport = CGSupport.NEVER

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx

    @abc.abstractmethod
    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        """Buffers for up to ``max_bs`` requests, ``max_tokens`` query tokens and KV length
        ``max_seq_len`` per request."""

    @abc.abstractmethod
    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        """Metadata for ``batch``; with ``out`` (static buffers) write in place and return views."""

    def eager_buffers(self, batch: ForwardBatch) -> dict[str, torch.Tensor]:
        """Buffers sized exactly for ``batch`` (host sizes from the CPU mirrors: no sync)."""
        spec = self.buffer_spec(max(batch.batch_size, 1), max(batch.num_tokens, 1),
                                max(batch.max_seq_len, 1))
        return spec.allocate(batch.device)


class ExecutionStrategy(abc.ABC):
    """Writes new K/V into the pool and launches one kernel op per layer call."""

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self._kernels: dict = {}

    @abc.abstractmethod
    def run(
        self,
        q: torch.Tensor,
        k: Optional[torch.Tensor],
        v: Optional[torch.Tensor],
        layer: LayerSpec,
        batch: ForwardBatch,
        metadata: AttnMetadata,
        *,
        save_kv_cache: bool = True,
        sinks: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Attention output ``[num_tokens, num_q_heads * v_head_dim]`` in ``q``'s dtype."""

    def kernel_for(self, key, request, *, fallback: bool = False):
        """Select a kernel once per ``key`` (usually the layer spec) and cache it.

        ``request`` is a :class:`~aiter_attn.kernels.registry.KernelRequest` or a zero-argument
        callable building one (so a cache hit builds nothing: the per-call host cost of a
        layer stays a dict lookup). ``fallback=True`` (KV writes): when the configured
        ``kernel_backend`` cannot serve the op, use the best registered implementation.
        """
        sel = self._kernels.get(key)
        if sel is None:
            req = request() if callable(request) else request
            sel = self.ctx.kernels.select(req, backend=self.ctx.config.kernel_backend,
                                          fallback=fallback)
            self._kernels[key] = sel
        return sel
