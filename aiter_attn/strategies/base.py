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

__all__ = ["BufferSpec", "StrategyContext", "MetadataStrategy", "ExecutionStrategy",
           "kv_geometry"]


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


@attrs.define(eq=False, slots=True)
class KernelGroup:
    """One layer group of an execution strategy: its kernel, chosen once, and how a step's
    metadata is viewed for it (which page table; a window folded into a tree mask).

    Attributes:
        key: the group key (everything the kernel choice and its plan depend on).
        kernel: the bound :class:`~aiter_attn.kernels.base.AttentionKernel`.
        pages_key: ``md.extras`` name of the page table it reads (``None``: ``md.pages``).
        window: HF sliding window to fold into a planned tree mask (``None``: none).
    """

    key: Any
    kernel: Any
    pages_key: Optional[str] = None
    window: Optional[int] = None


@attrs.define(eq=False, slots=True)
class LayerBinding:
    """A layer bound to its group: the group key, the kernel, the frozen LayerParams, and
    the output's ``[T, out_heads, out_dim]`` shape (``out_width = out_heads · out_dim``, the
    row width the layer call returns). ``sinks``: the per-call sinks tensor its params were
    made with (held, so a new tensor is told apart by identity; ``None``: the layer's own)."""

    layer: Any
    group: Any
    kernel: Any
    params: Any
    out_heads: int = 0
    out_dim: int = 0
    out_width: int = 0
    sinks: Any = None


def kv_geometry(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[tuple]:
    """``(num_kv_heads, head_dim, v_head_dim)`` held by one layer's paged caches: NHD pages
    (K ``[pages, page_size, H, D]``, V ``[..., H, Dv]``) or the 5-D vectorized layout (K
    ``[pages, H, D // x, page_size, x]``; V ``[pages, H, page_size // x, Dv, x]`` or
    ``[pages, H, Dv, page_size]``); ``None`` for another layout (nothing to check)."""
    if k_cache.dim() == 5:
        return (k_cache.shape[1], k_cache.shape[2] * k_cache.shape[4],
                v_cache.shape[3] if v_cache.dim() == 5 else v_cache.shape[2])
    if k_cache.dim() == 4 and v_cache.dim() == 4:
        return k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    return None


class ExecutionStrategy(abc.ABC):
    """Writes new K/V into the pool and launches one kernel op per layer call.

    Attention kernels are bound once per layer group (:meth:`bind_layer`), planned once per
    step for every bound group (:meth:`plan_kernels`, called by the backend and the graph
    manager right after the metadata plan) and only launched per layer.
    """

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx
        self._kernels: dict = {}
        self.groups: dict = {}  # group key -> KernelGroup
        self._layers: dict = {}  # (id(layer), mask?, sinks given?, tag) -> LayerBinding
        self._fits: dict = {}  # id(layer) -> layer: checked against its KV buffers

    def check_layer(self, layer: LayerSpec, k_cache, v_cache) -> None:
        """Raise if ``layer``'s ``num_kv_heads`` / ``head_dim`` / ``v_head_dim`` do not match
        its KV buffers (:func:`kv_geometry`); once per layer (a dict lookup after)."""
        if self._fits.get(id(layer)) is layer:
            return
        have = kv_geometry(k_cache, v_cache)
        if have is not None:
            for name, pool_value in zip(("num_kv_heads", "head_dim", "v_head_dim"), have):
                value = getattr(layer, name)
                if value != pool_value:
                    raise ValueError(
                        f"layer {layer.layer_id} has {name}={value} but the KV pool's buffers "
                        f"of the layer hold {pool_value} (k_cache {tuple(k_cache.shape)}, "
                        f"v_cache {tuple(v_cache.shape)}). Build the LayerSpec with the pool's "
                        f"{name}={pool_value} (or the pool with the model's geometry).")
        self._fits[id(layer)] = layer

    # -- plan/run kernels ------------------------------------------------------------------
    def bind_layer(self, layer: LayerSpec, md: AttnMetadata, request_fn, q, k_cache, v_cache,
                   sinks=None, pages_key: Optional[str] = None,
                   kv_scales=None) -> LayerBinding:
        """The layer's binding (cached: a dict lookup after the first call of the layer).

        ``request_fn(q, k_cache, v_cache, window_size=, softcap=, sinks=, causal=,
        custom_mask=)`` builds the kernel request of the layer's group on first use.
        ``kv_scales``: the pool's per-(token, head) ``(k_scales, v_scales)`` of the layer (the
        group's request then needs the ``kv_scale_per_token_head`` feature), or ``None``.
        """
        has_mask = md.mask is not None
        # keyed by whether per-call sinks are given, not by their id: a caller handing a new
        # sinks tensor each step (``module.sinks.float()``) would add a binding per call, and
        # a freed tensor's id, reused by the next one, returned params with the old values
        key = (id(layer), has_mask, sinks is not None, pages_key)
        b = self._layers.get(key)
        if b is not None and b.layer is layer:
            if b.sinks is not sinks:  # new per-call sinks: same group, params re-pointed
                b.params, b.sinks = b.params.with_sinks(sinks), sinks
            return b
        self.check_layer(layer, k_cache, v_cache)
        from ..kernels.base import LayerParams
        from ..types import FP8_DTYPES

        fold = has_mask and layer.sliding_window is not None
        window = (-1, -1) if fold else layer.window_size()
        causal = layer.is_causal and not has_mask
        sinks_t = sinks if sinks is not None else layer.sinks
        gkey = (request_fn, q.dtype, q.device, q.shape[1], q.shape[2], k_cache.dtype,
                tuple(k_cache.shape[1:]), tuple(v_cache.shape[1:]), window, layer.logit_cap > 0,
                sinks_t is not None, causal, has_mask, pages_key,
                layer.sliding_window if fold else None, kv_scales is not None)
        group = self.groups.get(gkey)
        if group is None:
            req = request_fn(q, k_cache, v_cache, window_size=window, softcap=layer.logit_cap,
                             sinks=sinks_t, causal=causal,
                             custom_mask=md.mask.custom_mask if has_mask else None)
            if kv_scales is not None:
                from ..kv_scales import TOKEN_SCALE_FEATURE

                req = attrs.evolve(req, features=req.features | {TOKEN_SCALE_FEATURE})
            kernel = self.ctx.kernels.select(req, backend=self.ctx.config.kernel_backend) \
                .bind(req)
            group = self.groups[gkey] = KernelGroup(
                key=gkey, kernel=kernel, pages_key=pages_key,
                window=layer.sliding_window if fold else None)
        params = LayerParams.from_spec(layer, q.device, fp8=k_cache.dtype in FP8_DTYPES,
                                       sinks=sinks_t, window=window, causal=causal,
                                       kv_scales=kv_scales)
        b = self._layers[key] = LayerBinding(
            layer=layer, group=gkey, kernel=group.kernel, params=params,
            out_heads=layer.num_q_heads, out_dim=layer.v_head_dim,
            out_width=layer.num_q_heads * layer.v_head_dim, sinks=sinks)
        return b

    def plan_group(self, group: "KernelGroup", md: AttnMetadata, batch=None):
        """Plan ``group``'s kernel for this step's ``md`` (once per step and group)."""
        plans = md.kernel_plans
        view = md
        if group.pages_key is not None:
            view = attrs.evolve(view, pages=md.extras[group.pages_key])
        if group.window is not None and md.mask is not None:
            from .common import window_tree_mask

            batch = plans.batch if plans.batch is not None else batch
            mask = window_tree_mask(md.mask, batch, md.query, group.window)
            if plans.out is not None:  # graphs: the folded mask lives in a static buffer
                name = f"window_mask.{group.window}"
                buf = plans.out.get(name)
                if buf is None or buf.shape != mask.custom_mask.shape:
                    buf = plans.out[name] = torch.empty_like(mask.custom_mask)
                buf.copy_(mask.custom_mask)
                mask = attrs.evolve(mask, custom_mask=buf)
            view = attrs.evolve(view, mask=mask)
        kp = group.kernel.plan(view, out=plans.out)
        plans[group.key] = kp
        return kp

    def plan_kernels(self, md: AttnMetadata, batch: ForwardBatch,
                     out: Optional[dict] = None) -> None:
        """Plan every bound group's kernel for this step (called once per step, right after
        the metadata plan; ``out``: the static buffers under CUDA graphs)."""
        plans = md.kernel_plans
        plans.out, plans.batch = out, batch
        for group in self.groups.values():
            if self.plans_group(group, md):
                self.plan_group(group, md, batch)

    def plans_group(self, group: "KernelGroup", md: AttnMetadata) -> bool:
        """Whether :meth:`plan_kernels` plans ``group`` for this step (all of them here;
        a strategy whose layers pick a kernel per step skips the ones the step will not
        launch, and plans them on first use if it does)."""
        return True

    def kernel_buffer_spec(self, limits) -> BufferSpec:
        """The bound kernels' static buffers for ``limits`` (merged by the graph manager)."""
        spec = BufferSpec({})
        for group in self.groups.values():
            spec = spec.merge(group.kernel.buffer_spec(limits))
        return spec

    def kernel_cg_support(self) -> Optional[CGSupport]:
        """The weakest CUDA-graph support of the bound kernels (``None``: none bound)."""
        sup = [g.kernel.cg_support for g in self.groups.values()]
        return min(sup) if sup else None

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
