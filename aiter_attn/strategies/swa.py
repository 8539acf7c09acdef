"""SWA (hybrid sliding-window models: Gemma-2/3, gpt-oss, Mistral-style) strategies for every
mode: EXTEND, DRAFT_EXTEND, DECODE/IDLE, TARGET_VERIFY (chain and tree), DRAFT_EXTEND_V2.

The backend's ``kv_pool`` is an :class:`~aiter_attn.kvcache.SWAKVPool`. Planning builds the
usual query layout and full-pool page table, then translates the table for the SWA pool
through ``full_to_swa_index_mapping``: ``metadata.extras["swa_pages"]``
(``full_to_swa[page · P] // P``, 0 where the page was freed), one device gather per step.
Execution picks per layer: a layer held by the SWA pool writes through op ``write_kv_swa``
(``out_cache_loc`` translated full→SWA inside the write) and reads through the SWA page table;
a full-attention layer uses the full pool, ``write_kv`` and the full table.

Window convention, everywhere: HF ``sliding_window = w`` ⇒ ``window_size = (w - 1, 0)``; a
query sees the ``w`` most recent keys including itself. For tree verify the window is folded
into the tree mask at the tokens' true positions (``batch.positions``), so a branch sees the
``w`` most recent tokens of *its own path*; chain verify and every other mode use the kernel's
window directly (there, index order is position order).

The mode-generic part (:class:`ModePagedMetadata` and its per-mode subclasses, the tree-mask
helpers) is shared with :mod:`aiter_attn.strategies.vec5d`.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..hookspecs import hookimpl
from ..kernels.registry import KernelRequest
from ..metadata import AttnMetadata, CustomMask, PageTable, QueryLayout
from ..ops import paged_attention_request
from ..registry import StrategyPair
from ..types import FP8_DTYPES, AttnArch, CGSupport, ForwardMode, LayerSpec
from .base import BufferSpec, ExecutionStrategy
from .mha import PagedMetadata, plan_page_table, plan_query_layout

__all__ = [
    "ModePagedMetadata",
    "DecodeModeMetadata",
    "ExtendModeMetadata",
    "VerifyModeMetadata",
    "DraftExtendV2ModeMetadata",
    "SWATablesMixin",
    "SWADecodeMetadata",
    "SWAExtendMetadata",
    "SWAVerifyMetadata",
    "SWADraftExtendV2Metadata",
    "SWAExecution",
    "plan_swa_tables",
    "window_tree_mask",
    "draft_token_count",
    "attend",
    "effective_window",
]


# --------------------------------------------------------------------------------------------
# Mode-generic planning (shared with vec5d)
# --------------------------------------------------------------------------------------------

def draft_token_count(batch: ForwardBatch) -> int:
    """Query tokens per request of a TARGET_VERIFY / DRAFT_EXTEND_V2 batch (host int)."""
    spec = batch.spec_info
    if spec is None:
        raise ValueError(
            f"{batch.forward_mode.name} needs batch.spec_info (a SpecInfo with num_draft_tokens"
            "); build the batch with ForwardBatch.from_lengths(..., spec_info=SpecInfo(...))."
        )
    n = int(spec.num_draft_tokens)
    if n < 1:
        raise ValueError(f"spec_info.num_draft_tokens={n}; must be ≥ 1.")
    return n


class ModePagedMetadata(PagedMetadata):
    """Query layout for the strategy's mode + page table (+ tree mask for verify).

    Subclasses set ``cg_support`` and :meth:`uniform_q_len`, and may add ``extras`` through
    :meth:`plan_extras` and buffers through :meth:`extra_buffers`.
    """

    def check_batch(self, batch: ForwardBatch) -> None:
        """Mode-specific structural checks (host data only)."""

    def extra_buffers(self, max_bs: int, max_tokens: int, max_seq_len: int) -> dict:
        return {}

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        base = super().buffer_spec(max_bs, max_tokens, max_seq_len)
        return base.merge(BufferSpec(self.extra_buffers(max_bs, max_tokens, max_seq_len)))

    def plan_mask(self, batch: ForwardBatch, out: dict, query: QueryLayout) -> Optional[CustomMask]:
        return None

    def plan_extras(self, batch: ForwardBatch, out: dict, pages: PageTable, static: bool) -> dict:
        return {}

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        self.check_batch(batch)
        static = out is not None
        if out is None:
            out = self.eager_buffers(batch)
        bs = batch.batch_size
        query = plan_query_layout(batch, out["cu_seqlens_q"][: bs + 1], self.uniform_q_len(batch))
        pages = plan_page_table(self.ctx, batch, out["block_table"][:bs], out["seqused_k"][:bs],
                                static)
        return AttnMetadata(
            mode=batch.forward_mode, batch_size=bs, query=query, pages=pages,
            mask=self.plan_mask(batch, out, query),
            extras=self.plan_extras(batch, out, pages, static),
        )


class DecodeModeMetadata(ModePagedMetadata):
    """DECODE/IDLE: one query token per request; no device→host sync."""

    cg_support = CGSupport.ALWAYS

    def uniform_q_len(self, batch):
        return 1


class ExtendModeMetadata(ModePagedMetadata):
    """EXTEND / DRAFT_EXTEND: ragged query lengths from ``extend_seq_lens``."""

    cg_support = CGSupport.NEVER


class VerifyModeMetadata(ModePagedMetadata):
    """TARGET_VERIFY: ``num_draft_tokens`` queries per request; chain (``topk == 1``) is causal
    over the page table, a tree (``topk > 1``) adds ``spec_info.custom_mask``. No sync."""

    cg_support = CGSupport.UNIFORM_BATCH

    def uniform_q_len(self, batch):
        return draft_token_count(batch)

    def check_batch(self, batch):
        n = draft_token_count(batch)
        spec = batch.spec_info
        if spec.topk > 1:
            cm = spec.custom_mask
            if cm is None:
                raise ValueError(
                    f"TARGET_VERIFY with topk={spec.topk} (a tree) needs spec_info.custom_mask "
                    "(bool, per request a row-major [num_draft_tokens, seq_len] block); pass it, "
                    "or topk=1 for a chain."
                )
            if not isinstance(cm, torch.Tensor) or cm.dtype not in (torch.bool, torch.uint8) \
                    or cm.dim() != 1:
                raise TypeError("spec_info.custom_mask must be a flat bool (or uint8) tensor.")
            need = n * int(batch.seq_lens_cpu.sum())
            if spec.mask_indptr is None and cm.numel() < need:
                raise ValueError(
                    f"spec_info.custom_mask has {cm.numel()} entries; the batch needs "
                    f"num_draft_tokens × sum(seq_lens) = {need}."
                )

    def extra_buffers(self, max_bs, max_tokens, max_seq_len):
        return {"mask_indptr": ((max_bs + 1,), torch.int64)}

    def plan_mask(self, batch, out, query):
        spec = batch.spec_info
        if spec.topk <= 1:
            return None
        bs = batch.batch_size
        indptr = spec.mask_indptr
        if indptr is None:
            indptr = out["mask_indptr"][: bs + 1]
            indptr[:1].zero_()
            torch.cumsum(batch.seq_lens.to(torch.int64) * query.max_seqlen_q, dim=0,
                         out=indptr[1:])
        return CustomMask(custom_mask=spec.custom_mask, mask_indptr=indptr)


class DraftExtendV2ModeMetadata(ModePagedMetadata):
    """DRAFT_EXTEND_V2: the same ``num_draft_tokens`` per request, causal; no sync."""

    cg_support = CGSupport.UNIFORM_BATCH

    def uniform_q_len(self, batch):
        return draft_token_count(batch)

    def check_batch(self, batch):
        n = draft_token_count(batch)
        lens = batch.extend_seq_lens_cpu
        if lens is not None and lens.numel() and bool((lens != n).any()):
            raise ValueError(
                f"DRAFT_EXTEND_V2 takes the same number of tokens per request "
                f"(spec_info.num_draft_tokens={n}); got extend_seq_lens_cpu={lens.tolist()}. "
                "Use DRAFT_EXTEND for ragged lengths."
            )


def window_tree_mask(mask: CustomMask, batch: ForwardBatch, query: QueryLayout, window: int,
                     total: int) -> CustomMask:
    """Fold HF ``sliding_window = window`` into a tree mask at the tokens' true positions.

    For request ``b`` with ``L`` keys and ``n`` queries, key ``j < L - n`` (cached prefix) is at
    position ``j``; key ``j ≥ L - n`` is draft token ``j - (L - n)`` at
    ``batch.positions[cu_q[b] + j - (L - n)]`` (prefix + depth in the tree); query ``i`` is at
    ``positions[cu_q[b] + i]``. The result keeps ``mask[i, j]`` where
    ``pos(j) ≥ pos(i) - window + 1``. Without ``batch.positions`` index order is used.
    Device only; ``total`` = ``n · sum(seq_lens)`` from the CPU mirror. Returns a new flat mask
    with the same ``mask_indptr``.
    """
    dev = mask.custom_mask.device
    bs = batch.batch_size
    n = query.max_seqlen_q
    seq = batch.seq_lens.to(torch.int64)
    blk = torch.zeros(bs + 1, dtype=torch.int64, device=dev)
    torch.cumsum(seq * n, dim=0, out=blk[1:])
    e = torch.arange(total, dtype=torch.int64, device=dev)
    b = torch.searchsorted(blk[1:], e, right=True)
    local = e - blk[b]
    L = seq[b]
    i, j = local // L, local % L
    prefix = L - n
    cu = query.cu_seqlens_q.to(torch.int64)
    if batch.positions is not None:
        pos = batch.positions.to(torch.int64)
        q_pos = pos[cu[b] + i]
        is_draft = j >= prefix
        draft_idx = torch.where(is_draft, cu[b] + (j - prefix), torch.zeros_like(j))
        k_pos = torch.where(is_draft, pos[draft_idx], j)
    else:
        q_pos, k_pos = prefix + i, j
    flat = mask.mask_indptr.to(torch.int64)[b] + local
    keep = mask.custom_mask.bool()[flat] & (k_pos >= q_pos - (window - 1))
    out = torch.zeros(mask.custom_mask.shape, dtype=torch.bool, device=dev)
    out[flat] = keep
    return CustomMask(custom_mask=out, mask_indptr=mask.mask_indptr)


# --------------------------------------------------------------------------------------------
# SWA planning and execution
# --------------------------------------------------------------------------------------------

def _require_swa_pool(ctx):
    from ..kvcache.swa import SWAKVPool

    if not isinstance(ctx.kv_pool, SWAKVPool):
        raise TypeError(
            f"arch=SWA needs an aiter_attn.kvcache.SWAKVPool as kv_pool, got "
            f"{type(ctx.kv_pool).__name__}; build it with SWAKVPool.create(layer_is_swa=...)."
        )
    if ctx.kv_pool.page_size != ctx.config.page_size:
        raise ValueError(
            f"SWAKVPool page_size={ctx.kv_pool.page_size} != BackendConfig.page_size="
            f"{ctx.config.page_size}; build both with the same page size."
        )
    return ctx.kv_pool


def plan_swa_tables(pool, pages: PageTable, swa_block_table: torch.Tensor) -> PageTable:
    """Translate the full page table into the SWA pool (device, no sync).

    ``swa_block_table`` int32 ``[bs, W]`` view ← ``full_to_swa[block_table · P] // P``: page 0
    (the null page) maps to 0, as does a page whose SWA copy was freed. Returns the SWA
    :class:`PageTable` (same ``seqused_k`` and ``max_seqlen_k`` as the full one).
    """
    ps = pages.page_size
    mapping = pool.full_to_swa_index_mapping
    first_slot = pages.block_table.to(torch.int64) * ps
    swa_block_table.copy_(torch.div(mapping[first_slot], ps, rounding_mode="floor"))
    return PageTable(block_table=swa_block_table, seqused_k=pages.seqused_k,
                     max_seqlen_k=pages.max_seqlen_k, page_size=ps)


class SWATablesMixin:
    """Adds the SWA page table (``extras["swa_pages"]``) to a :class:`ModePagedMetadata`."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pool = _require_swa_pool(ctx)

    def extra_buffers(self, max_bs, max_tokens, max_seq_len):
        pages = max(-(-max_seq_len // self.ctx.config.page_size), 1)
        bufs = dict(super().extra_buffers(max_bs, max_tokens, max_seq_len))
        bufs["swa_block_table"] = ((max_bs, pages), torch.int32)
        return bufs

    def plan_extras(self, batch, out, pages, static):
        extras = dict(super().plan_extras(batch, out, pages, static))
        bs, width = batch.batch_size, pages.block_table.shape[1]
        extras["swa_pages"] = plan_swa_tables(self.pool, pages, out["swa_block_table"][:bs, :width])
        return extras


class SWADecodeMetadata(SWATablesMixin, DecodeModeMetadata):
    """DECODE/IDLE on the hybrid pool."""


class SWAExtendMetadata(SWATablesMixin, ExtendModeMetadata):
    """EXTEND / DRAFT_EXTEND on the hybrid pool."""


class SWAVerifyMetadata(SWATablesMixin, VerifyModeMetadata):
    """TARGET_VERIFY (chain and tree) on the hybrid pool."""


class SWADraftExtendV2Metadata(SWATablesMixin, DraftExtendV2ModeMetadata):
    """DRAFT_EXTEND_V2 on the hybrid pool."""


def attend(executor: ExecutionStrategy, op_request: KernelRequest, q, k_cache, v_cache,
           layer: LayerSpec, batch: ForwardBatch, md: AttnMetadata, pages: PageTable, sinks):
    """One attention call of ``layer`` through the kernel chosen for ``op_request``'s op
    (``paged_attention`` semantics; the caches are in whatever layout that op takes).

    Applies the layer's window (``(w - 1, 0)``), soft-cap, sinks and fp8 scales; with a tree
    mask and a window, folds the window into the mask at the tokens' true positions.
    """
    num_tokens = q.shape[0]
    window = layer.window_size()
    mask = md.mask
    if mask is not None and layer.sliding_window is not None:
        total = md.query.max_seqlen_q * batch.seq_lens_sum
        mask = window_tree_mask(mask, batch, md.query, layer.sliding_window, total)
        window = (-1, -1)
    sel = executor.kernel_for(op_request, op_request)
    out = torch.empty(num_tokens, layer.num_q_heads, layer.v_head_dim, dtype=q.dtype,
                      device=q.device)
    sel.fn(
        q, k_cache, v_cache, out,
        cu_seqlens_q=md.query.cu_seqlens_q, seqused_k=pages.seqused_k,
        block_table=pages.block_table, softmax_scale=layer.scaling,
        causal=not layer.is_cross_attention, window_size=window, softcap=layer.logit_cap,
        sinks=sinks, k_scale=layer.k_scale, v_scale=layer.v_scale,
        custom_mask=None if mask is None else mask.custom_mask,
        mask_indptr=None if mask is None else mask.mask_indptr,
        max_seqlen_q=md.query.max_seqlen_q, max_seqlen_k=pages.max_seqlen_k,
    )
    return out.view(num_tokens, layer.num_q_heads * layer.v_head_dim)


def effective_window(layer: LayerSpec, md: AttnMetadata) -> tuple[int, int]:
    """The ``window_size`` the kernel sees (``(-1, -1)`` when folded into a tree mask)."""
    if md.mask is not None and layer.sliding_window is not None:
        return (-1, -1)
    return layer.window_size()


class SWAExecution(ExecutionStrategy):
    """Per layer: write K/V into the pool that holds it (SWA layers through op
    ``write_kv_swa``, which translates ``out_cache_loc`` full→SWA in the write), then one
    ``paged_attention`` over that pool's page table."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pool = _require_swa_pool(ctx)

    def run(self, q, k, v, layer: LayerSpec, batch: ForwardBatch, metadata: AttnMetadata, *,
            save_kv_cache: bool = True, sinks=None):
        on_swa = self.pool.is_swa_layer(layer.layer_id)
        if on_swa and layer.sliding_window is None:
            raise ValueError(
                f"layer {layer.layer_id} lives in the SWA pool but its LayerSpec has no "
                "sliding_window; its old pages may have been freed. Give the layer its window or "
                "mark it full in SWAKVPool.create(layer_is_swa=...)."
            )
        k_cache, v_cache = self.pool.kv_buffers(layer.layer_id)
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_q_heads, layer.head_dim)
        pages = metadata.extras["swa_pages"] if on_swa else metadata.pages
        if save_kv_cache and k is not None:
            op = "write_kv_swa" if on_swa else "write_kv"
            request = KernelRequest(
                op=op, device=k_cache.device.type, dtype=k.dtype, kv_dtype=k_cache.dtype,
                head_dim=k_cache.shape[3], page_size=k_cache.shape[1],
                features={"fp8"} if k_cache.dtype in FP8_DTYPES else (),
            )
            kw = {"full_to_swa": self.pool.full_to_swa_index_mapping} if on_swa else {}
            self.kernel_for(request, request).fn(
                k_cache, v_cache, batch.out_cache_loc,
                k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                v.view(num_tokens, layer.num_kv_heads, layer.v_head_dim),
                k_scale=layer.k_scale, v_scale=layer.v_scale, **kw)
        sinks = sinks if sinks is not None else layer.sinks
        request = paged_attention_request(
            q, k_cache, v_cache, window_size=effective_window(layer, metadata),
            softcap=layer.logit_cap, sinks=sinks, causal=not layer.is_cross_attention,
            custom_mask=None if metadata.mask is None else metadata.mask.custom_mask)
        return attend(self, request, q, k_cache, v_cache, layer, batch, metadata, pages, sinks)


_SWA_MODES = (
    ("swa.decode", {ForwardMode.DECODE, ForwardMode.IDLE}, SWADecodeMetadata, CGSupport.ALWAYS,
     "one token per request; full + translated SWA page tables"),
    ("swa.extend", {ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND}, SWAExtendMetadata,
     CGSupport.NEVER, "ragged extend/draft-extend; SWA layers on their own pool"),
    ("swa.verify", {ForwardMode.TARGET_VERIFY}, SWAVerifyMetadata, CGSupport.UNIFORM_BATCH,
     "EAGLE verify: chain causal, tree mask with the window at path positions"),
    ("swa.draft_extend_v2", {ForwardMode.DRAFT_EXTEND_V2}, SWADraftExtendV2Metadata,
     CGSupport.UNIFORM_BATCH, "fixed draft tokens per request; SWA tables"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    for name, modes, planner, cg, desc in _SWA_MODES:
        register(StrategyPair(name=name, arch=AttnArch.SWA, modes=modes, metadata=planner,
                              execution=SWAExecution, priority=10, cg_support=cg,
                              description=desc))
