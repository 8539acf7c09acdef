"""MHA/GQA/MQA strategies: EXTEND (with/without cached prefix, chunked) and DECODE/IDLE.

Both modes plan the same metadata shape: a query layout and a page table over the full pool.
Decode's query layout is ``arange`` (one token per request); extend's is the cumulative sum
of ``extend_seq_lens``. Everything is built on the device by index ops; host sizes come from
the batch's CPU mirrors (eager) or static bounds (graph buffers).
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from .. import ops
from ..batch import ForwardBatch
from ..hookspecs import hookimpl
from ..metadata import AttnMetadata, PageTable, QueryLayout
from ..kernels.registry import KernelRequest
from ..registry import Cell, register_cells
from ..types import AttnArch, CGSupport, ForwardMode, LayerSpec
from .base import (BufferSpec, ExecutionStrategy, KernelGroup, LayerBinding,
                   MetadataStrategy)
from .cascade import CascadeExecutionMixin
from .common import attend_layer, kv_pair_error, write_kwargs
from .common import write_kv_request as common_write_request

__all__ = ["PagedMetadata", "DecodeMetadata", "ExtendMetadata", "PagedExecution",
           "plan_query_layout", "plan_page_table", "check_static_pages"]


def plan_query_layout(batch: ForwardBatch, cu_seqlens_q: torch.Tensor, uniform_q_len: Optional[int]):
    """Fill ``cu_seqlens_q`` (int32 ``[bs + 1]`` view) on the device; return a QueryLayout.

    ``uniform_q_len`` set ⇒ ``b · q_len`` (decode, verify, draft v2); else cumsum of
    ``batch.extend_seq_lens``.
    """
    bs = batch.batch_size
    if uniform_q_len is not None:
        torch.arange(0, (bs + 1) * uniform_q_len, uniform_q_len, out=cu_seqlens_q,
                     dtype=cu_seqlens_q.dtype)
        return QueryLayout(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=uniform_q_len,
                           num_tokens=bs * uniform_q_len)
    cu_seqlens_q[:1].zero_()
    torch.cumsum(batch.extend_seq_lens, dim=0, out=cu_seqlens_q[1:])
    q_lens = batch.extend_seq_lens_cpu
    return QueryLayout(cu_seqlens_q=cu_seqlens_q,
                       max_seqlen_q=int(q_lens.max()) if bs else 0,
                       num_tokens=int(q_lens.sum()))


def check_static_pages(batch: ForwardBatch, page_size: int, block_table: torch.Tensor,
                       name: str = "block_table") -> None:
    """Raise unless the static page table ``block_table`` (a ``[:bs]`` view of the ``out=``
    buffer) has a row per request and a page per ``page_size`` tokens of the longest one.
    Host ints only (the buffer's shape, ``seq_lens_cpu``): no device→host sync."""
    rows, width = block_table.shape
    bs, longest = batch.batch_size, batch.max_seq_len
    need = -(-longest // page_size)
    if rows < bs or width < need:
        raise ValueError(
            f"{bs} requests of up to {longest} tokens do not fit the static {name} buffer: it "
            f"has {rows} rows of {width} pages; the batch needs {bs} rows of {need} pages "
            f"({page_size} tokens a page). Allocate the static buffers with buffer_spec(max_bs, "
            f"max_tokens, max_seq_len) for the largest batch and the longest request "
            f"(max_seq_len >= {longest}), or plan eagerly (out=None).")


def plan_page_table(ctx, batch: ForwardBatch, block_table: torch.Tensor, seqused_k: torch.Tensor,
                    static: bool, *, full_to_swa: Optional[torch.Tensor] = None,
                    swa_block_table: Optional[torch.Tensor] = None) -> PageTable:
    """Fill ``block_table`` (int32 ``[bs, W]`` view) and ``seqused_k`` from ``req_to_token``;
    with ``full_to_swa`` also ``swa_block_table`` (same shape), in the same kernel pass.
    ``static`` buffers too small for the batch raise first (:func:`check_static_pages`)."""
    page_size = ctx.config.page_size
    if static:
        check_static_pages(batch, page_size, block_table)
        if swa_block_table is not None and swa_block_table.shape != block_table.shape:
            check_static_pages(batch, page_size, swa_block_table, "swa_block_table")
    if full_to_swa is not None:
        ops.build_page_tables_swa(ctx.req_to_token, batch.req_pool_indices, batch.seq_lens,
                                  page_size, full_to_swa, block_table, swa_block_table)
    else:
        ops.build_page_table(ctx.req_to_token, batch.req_pool_indices, batch.seq_lens,
                             page_size, block_table)
    seqused_k.copy_(batch.seq_lens)
    max_k = block_table.shape[1] * page_size if static else batch.max_seq_len
    return PageTable(block_table=block_table, seqused_k=seqused_k, max_seqlen_k=max_k,
                     page_size=page_size)


class PagedMetadata(MetadataStrategy):
    """Query layout + full-pool page table. Subclasses set ``uniform_q_len``."""

    def uniform_q_len(self, batch: Optional[ForwardBatch]) -> Optional[int]:
        return None

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        pages = -(-max_seq_len // self.ctx.config.page_size)
        return BufferSpec({
            "cu_seqlens_q": ((max_bs + 1,), torch.int32),
            "block_table": ((max_bs, max(pages, 1)), torch.int32),
            "seqused_k": ((max_bs,), torch.int32),
        })

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        static = out is not None
        if out is None:
            out = self.eager_buffers(batch)
        bs = batch.batch_size
        q_len = self.uniform_q_len(batch)
        pages = self.plan_pages(batch, out, static)  # first: raises if static buffers are small
        query = plan_query_layout(batch, out["cu_seqlens_q"][: bs + 1], q_len)
        return AttnMetadata(mode=batch.forward_mode, batch_size=bs, query=query, pages=pages)

    def plan_pages(self, batch: ForwardBatch, out: dict, static: bool) -> PageTable:
        """This step's page table, planned into ``out``'s ``block_table``/``seqused_k``
        buffers (static or eager). Mixins that need more tables from the same pass (the SWA
        pool's) override this."""
        bs = batch.batch_size
        return plan_page_table(self.ctx, batch, out["block_table"][:bs], out["seqused_k"][:bs],
                               static)


class DecodeMetadata(PagedMetadata):
    """DECODE/IDLE: one query token per request; no device→host sync."""

    cg_support = CGSupport.ALWAYS

    def uniform_q_len(self, batch):
        return 1


class ExtendMetadata(PagedMetadata):
    """EXTEND: ragged query lengths (prefill, prefix-cached extend, chunked prefill).

    ``md.extras["max_prefix_len"]``: the longest cached prefix of the batch (a host int:
    ``seq_lens_cpu - extend_seq_lens_cpu``, the mirrors the batch is validated by, never the
    unchecked ``extend_prefix_lens_cpu``: a stale one would skip the prefix of a step that has
    one): ``extend_attention`` skips its prefix pass on a step without one.
    ``md.extras["min_q_len"]``: the fewest new tokens of a request (host int from
    ``extend_seq_lens_cpu``): ``BackendConfig.dense_extend``'s auto rule reads it."""

    cg_support = CGSupport.NEVER

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        md = super().plan(batch, out)
        q_lens = batch.extend_seq_lens_cpu
        if q_lens is not None:
            bs = batch.batch_size
            md.extras["min_q_len"] = int(q_lens.min()) if bs else 0
            md.extras["max_prefix_len"] = int((batch.seq_lens_cpu - q_lens).max()) if bs else 0
        return md


def write_kv_request(k_cache: torch.Tensor, k: torch.Tensor,
                     token_scales: bool = False) -> KernelRequest:
    """The kernel-registry key of a ``write_kv`` into NHD ``k_cache`` from ``k``
    (``token_scales``: per-(token, head) quantisation, :mod:`aiter_attn.kv_scales`)."""
    return common_write_request("write_kv", k_cache, k, token_scales)


class PagedExecution(CascadeExecutionMixin, ExecutionStrategy):
    """Write K/V into the NHD pool, then one ``paged_attention`` call (cascade attention
    over shared prefix pages when ``BackendConfig.cascade_min_shared_tokens`` is set:
    :mod:`aiter_attn.strategies.cascade`).

    A planned custom mask (tree verify) is applied literally: the kernel runs non-causal and
    the mask alone says which keys each query sees (the same convention as MLA and the seed);
    a sliding window is folded into it at the tokens' path positions, derived from the mask
    (:func:`~aiter_attn.strategies.common.window_tree_mask`). With per-(token, head) scales
    (``BackendConfig.kv_scale_granularity``) the write stores each vector's scale in the pool
    and the attention kernel reads it (:mod:`aiter_attn.kv_scales`).
    """

    def __init__(self, ctx):
        super().__init__(ctx)
        self.token_scales = ctx.config.per_token_head_scales
        cfg = ctx.config
        # the two-pass extend kernel (dense new tokens + paged prefix), not with the modes
        # that wrap or check the paged kernel (cascade, batch-invariant, debug). None (auto):
        # on steps whose every request brings dense_extend_min_tokens new tokens or more
        # (the plan's host "min_q_len"); True: every EXTEND step; False: never
        self.dense_extend = bool(cfg.dense_extend is not False and not cfg.batch_invariant
                                 and not cfg.debug_checks and not cfg.cascade_min_shared_tokens)
        self.dense_min_q = 0 if cfg.dense_extend is True else cfg.dense_extend_min_tokens
        #: id(layer) → (layer, binding or None, reason): the extend_attention bindings
        self._extend: dict = {}

    def run(self, q, k, v, layer: LayerSpec, batch: ForwardBatch, metadata: AttnMetadata, *,
            save_kv_cache: bool = True, sinks=None):
        pool = self.ctx.kv_pool
        k_cache, v_cache = pool.kv_buffers(layer.layer_id)
        if self._fits.get(id(layer)) is not layer:  # first call: layer vs pool, before writes
            self.check_layer(layer, k_cache, v_cache)
        # per-(token, head) scale buffers of the layer (None: one scale per layer)
        kv_scales = pool.scale_buffers(layer.layer_id) if self.token_scales else None
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_q_heads, layer.head_dim)
        if save_kv_cache and (k is None) != (v is None):
            raise kv_pair_error(layer, k, v)
        if save_kv_cache and k is not None:
            # the write kernel is chosen once per (cache, input) dtype pair: no request is
            # built and nothing is validated on later calls; a backend with no KV write of
            # its own (an attention-only plugin) falls back to the best registered one
            wkey = ("write_kv", k_cache.dtype, k.dtype)
            write = self._kernels.get(wkey)
            if write is None:
                write = self.kernel_for(
                    wkey, lambda: write_kv_request(k_cache, k, self.token_scales),
                    fallback=True)
            write.fn(
                k_cache, v_cache, batch.out_cache_loc,
                k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                v.view(num_tokens, layer.num_kv_heads, layer.v_head_dim),
                **write_kwargs(layer, kv_scales),
            )
        if k is not None and v is not None and self._dense_step(metadata):
            b = self._extend_binding(layer, q, k_cache, v_cache, sinks, kv_scales)
            if b is not None:
                kp = metadata.kernel_plans.get(b.group)
                if kp is None:
                    kp = self.plan_group(self.groups[b.group], metadata, batch)
                out = torch.empty(num_tokens, layer.num_q_heads, layer.v_head_dim,
                                  dtype=q.dtype, device=q.device)
                b.kernel.run(q, (k_cache, v_cache), kp, b.params, out,
                             k=k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                             v=v.view(num_tokens, layer.num_kv_heads, layer.v_head_dim))
                return out.view(num_tokens, layer.num_q_heads * layer.v_head_dim)
        return attend_layer(self, ops.paged_attention_request, q, k_cache, v_cache, layer,
                            batch, metadata, sinks, kv_scales=kv_scales)

    def _dense_step(self, md: AttnMetadata) -> bool:
        """Whether this step's layers take the two-pass extend (where a kernel serves the
        layer): an EXTEND step without a tree mask whose every request brings at least
        ``dense_min_q`` new tokens (host ints of the plan: no sync)."""
        return (self.dense_extend and md.mask is None and md.mode is ForwardMode.EXTEND
                and md.extras.get("min_q_len", 0) >= self.dense_min_q)

    def plans_group(self, group, md: AttnMetadata) -> bool:
        """``extend_attention`` groups are planned only for the steps that launch them (a
        short chunk after a long prefill keeps the paged kernel and plans nothing more)."""
        return group.key[0] != "extend_attention" or self._dense_step(md)

    def _extend_binding(self, layer: LayerSpec, q, k_cache, v_cache, sinks, kv_scales):
        """The layer's ``extend_attention`` binding, or ``None`` when no kernel serves its
        features (the reason is kept in ``self._extend``; the paged kernel runs). Selected
        through the registry once per layer (a dict lookup after that)."""
        hit = self._extend.get(id(layer))
        if hit is not None and hit[0] is layer and hit[3] is sinks:
            return hit[1]
        from ..kernels.base import LayerParams
        from ..kernels.registry import KernelSelectionError
        from ..kv_scales import TOKEN_SCALE_FEATURE
        from ..types import FP8_DTYPES

        sinks_t = sinks if sinks is not None else layer.sinks
        req = attrs.evolve(ops.paged_attention_request(
            q, k_cache, v_cache, window_size=layer.window_size(), softcap=layer.logit_cap,
            sinks=sinks_t, causal=layer.is_causal), op="extend_attention")
        if kv_scales is not None:
            req = attrs.evolve(req, features=req.features | {TOKEN_SCALE_FEATURE})
        gkey = ("extend_attention", req)
        binding, reason = None, ""
        group = self.groups.get(gkey)
        if group is None:
            try:
                kernel = self.ctx.kernels.select(
                    req, backend=self.ctx.config.kernel_backend).bind(req)
            except KernelSelectionError as exc:
                reason = str(exc)
            else:
                group = self.groups[gkey] = KernelGroup(key=gkey, kernel=kernel)
        if group is not None:
            params = LayerParams.from_spec(layer, q.device, fp8=k_cache.dtype in FP8_DTYPES,
                                           sinks=sinks_t, kv_scales=kv_scales)
            binding = LayerBinding(layer=layer, group=gkey, kernel=group.kernel, params=params)
        self._extend[id(layer)] = (layer, binding, reason, sinks)
        return binding


#: The MHA family's cells (speculative ones are in :mod:`.spec`).
CELLS = (
    Cell(name="mha.decode", modes={ForwardMode.DECODE, ForwardMode.IDLE},
         metadata=DecodeMetadata, cg_support=CGSupport.ALWAYS,
         description="one token per request; page table over the pool"),
    Cell(name="mha.extend", modes={ForwardMode.EXTEND}, metadata=ExtendMetadata,
         cg_support=CGSupport.NEVER,
         description="ragged prefill/extend with cached prefix; page table over the pool"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    register_cells(register, arch=AttnArch.MHA, execution=PagedExecution, cells=CELLS)
