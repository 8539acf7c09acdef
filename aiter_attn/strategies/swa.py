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
into the tree mask at the tokens' path positions (prefix + depth in the tree, derived from the
mask itself; ``batch.positions`` is not read), so a branch sees the ``w`` most recent tokens
of *its own path*; chain verify and every other mode use the kernel's
window directly (there, index order is position order).

Planning reuses the MHA and speculative planners (:mod:`aiter_attn.strategies.mha`,
:mod:`aiter_attn.strategies.spec`: query layouts, page tables, draft-token checks, tree masks
and their static buffers) and adds the SWA table on top (:class:`SWATablesMixin`). Chain and
tree verify are separate pairs chosen by ``BackendConfig.spec.topk``, as for MHA. The
execution helpers (:func:`~aiter_attn.strategies.common.attend_layer`,
:func:`window_tree_mask`) are shared with :mod:`aiter_attn.strategies.vec5d`.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

from ..batch import ForwardBatch
from ..contract import CHAIN_VERIFY, TREE_VERIFY
from ..hookspecs import hookimpl
from ..metadata import AttnMetadata, PageTable
from ..ops import paged_attention_request
from ..registry import Cell, register_cells
from ..types import AttnArch, CGSupport, ForwardMode, LayerSpec
from .base import BufferSpec, ExecutionStrategy
from .cascade import CascadeExecutionMixin
from .common import (attend_layer, effective_causal, effective_window, kv_pair_error,
                     require_pool, window_tree_mask, write_kv_request, write_kwargs)
from .mha import DecodeMetadata, ExtendMetadata, plan_page_table
from .spec import (
    DraftDecodeStepMetadata,
    DraftExtendV2Metadata,
    VerifyChainMetadata,
    VerifyTreeMetadata,
)

__all__ = [
    "SWATablesMixin",
    "SWADecodeMetadata",
    "SWAExtendMetadata",
    "SWAVerifyChainMetadata",
    "SWAVerifyTreeMetadata",
    "SWADraftExtendV2Metadata",
    "SWADraftDecodeStepMetadata",
    "SWAExecution",
    "plan_swa_tables",
    "window_tree_mask",
    "effective_window",
    "effective_causal",
    "chain_verify_only",
    "tree_verify_only",
]


# --------------------------------------------------------------------------------------------
# SWA planning and execution
# --------------------------------------------------------------------------------------------

def _require_swa_pool(ctx):
    from ..kvcache.swa import SWAKVPool

    return require_pool(ctx, SWAKVPool, "SWA",
                        "; build it with SWAKVPool.create(layer_is_swa=...)")


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
    """Adds the SWA page table (``extras["swa_pages"]``) to any page-table planner: the base
    planner runs unchanged, then its full table is translated (one gather, no sync) into the
    static ``swa_block_table`` buffer (or a fresh one when eager). A planner keeps no table
    of its own between calls: eager batches never touch the buffers a captured graph reads.
    """

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pool = _require_swa_pool(ctx)

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        pages = max(-(-max_seq_len // self.ctx.config.page_size), 1)
        return super().buffer_spec(max_bs, max_tokens, max_seq_len).merge(
            BufferSpec({"swa_block_table": ((max_bs, pages), torch.int32)}))

    def plan_pages(self, batch: ForwardBatch, out: dict, static: bool) -> PageTable:
        """Both tables in one pass (op ``build_page_tables_swa``): the full table into
        ``out["block_table"]``, its SWA translation into ``out["swa_block_table"]``."""
        bs = batch.batch_size
        full_bt = out["block_table"][:bs]
        swa_bt = out["swa_block_table"][:bs, : full_bt.shape[1]]
        pages = plan_page_table(self.ctx, batch, full_bt, out["seqused_k"][:bs], static,
                                full_to_swa=self.pool.full_to_swa_index_mapping,
                                swa_block_table=swa_bt)
        self._fused_swa_pages = attrs.evolve(pages, block_table=swa_bt)
        return pages

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        self._fused_swa_pages = None
        md = super().plan(batch, out)
        swa_pages, self._fused_swa_pages = self._fused_swa_pages, None
        if swa_pages is None:
            # a planner whose full table comes from elsewhere (a multi-step draft step's view):
            # translate it (one gather, no sync)
            full = md.pages.block_table
            if out is not None:
                swa_bt = out["swa_block_table"][: full.shape[0], : full.shape[1]]
            else:
                swa_bt = torch.zeros_like(full)
            swa_pages = plan_swa_tables(self.pool, md.pages, swa_bt)
        return attrs.evolve(md, extras={**md.extras, "swa_pages": swa_pages})


class SWADecodeMetadata(SWATablesMixin, DecodeMetadata):
    """DECODE/IDLE on the hybrid pool (no sync)."""


class SWAExtendMetadata(SWATablesMixin, ExtendMetadata):
    """EXTEND / DRAFT_EXTEND on the hybrid pool."""


class SWAVerifyChainMetadata(SWATablesMixin, VerifyChainMetadata):
    """TARGET_VERIFY, chain (``topk == 1``), on the hybrid pool (no sync)."""


class SWAVerifyTreeMetadata(SWATablesMixin, VerifyTreeMetadata):
    """TARGET_VERIFY, tree (``topk > 1``, custom mask), on the hybrid pool (no sync)."""


class SWADraftExtendV2Metadata(SWATablesMixin, DraftExtendV2Metadata):
    """DRAFT_EXTEND_V2 on the hybrid pool (no sync)."""


class SWADraftDecodeStepMetadata(SWATablesMixin, DraftDecodeStepMetadata):
    """One step of multi-step draft decode (:class:`aiter_attn.multistep.MultiStepDraftBackend`)
    on the hybrid pool: the step's full table is the multi-step backend's view; its SWA
    translation goes into this step's ``swa_block_table`` among the multi-step backend's
    static buffers (``step{i}.swa_block_table``) under CUDA graphs, a fresh table when eager."""


class SWAExecution(CascadeExecutionMixin, ExecutionStrategy):
    """Per layer: write K/V into the pool that holds it (SWA layers through op
    ``write_kv_swa``, which translates ``out_cache_loc`` full→SWA in the write), then one
    ``paged_attention`` over that pool's page table (cascade attention over shared prefix
    pages when ``BackendConfig.cascade_min_shared_tokens`` is set; an SWA layer groups from
    its own table, so a run ends at a shared page whose SWA copy was freed)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pool = _require_swa_pool(ctx)
        self.token_scales = ctx.config.per_token_head_scales

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
        if self._fits.get(id(layer)) is not layer:  # first call: layer vs pool, before writes
            self.check_layer(layer, k_cache, v_cache)
        # per-(token, head) scale buffers of the pool holding the layer (None: per layer)
        kv_scales = self.pool.scale_buffers(layer.layer_id) if self.token_scales else None
        num_tokens = q.shape[0]
        q = q.view(num_tokens, layer.num_q_heads, layer.head_dim)
        if save_kv_cache and (k is None) != (v is None):
            raise kv_pair_error(layer, k, v)
        if save_kv_cache and k is not None:
            op = "write_kv_swa" if on_swa else "write_kv"
            kw = {"full_to_swa": self.pool.full_to_swa_index_mapping} if on_swa else {}
            # selected once per (op, layer, dtype): no request is built on later calls; a
            # backend with no KV write of its own (an attention-only plugin) falls back
            self.kernel_for(
                (op, layer, k.dtype),
                lambda: write_kv_request(op, k_cache, k, self.token_scales), fallback=True).fn(
                k_cache, v_cache, batch.out_cache_loc,
                k.view(num_tokens, layer.num_kv_heads, layer.head_dim),
                v.view(num_tokens, layer.num_kv_heads, layer.v_head_dim),
                **write_kwargs(layer, kv_scales), **kw)
        return attend_layer(self, paged_attention_request, q, k_cache, v_cache, layer, batch,
                            metadata, sinks, pages_key="swa_pages" if on_swa else None,
                            kv_scales=kv_scales)


def chain_verify_only(config):
    """``supports`` check of a chain-verify pair: rejects configs with tree drafts."""
    if config.spec is not None and config.spec.topk > 1:
        return f"BackendConfig.spec.topk={config.spec.topk} is a tree draft (custom mask)"
    return None


def tree_verify_only(config):
    """``supports`` check of a tree-verify pair: needs ``BackendConfig.spec.topk > 1``."""
    if config.spec is None or config.spec.topk <= 1:
        return "chain verify (BackendConfig.spec.topk = 1) needs no custom mask"
    return None


#: The SWA family's cells.
CELLS = (
    Cell(name="swa.decode", modes={ForwardMode.DECODE, ForwardMode.IDLE},
         metadata=SWADecodeMetadata, cg_support=CGSupport.ALWAYS,
         description="one token per request; full + translated SWA page tables"),
    Cell(name="swa.extend", modes={ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND},
         metadata=SWAExtendMetadata, cg_support=CGSupport.NEVER,
         description="ragged extend/draft-extend; SWA layers on their own pool"),
    Cell(name="swa.verify.chain", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: CHAIN_VERIFY},
         metadata=SWAVerifyChainMetadata, cg_support=CGSupport.UNIFORM_BATCH,
         supports=chain_verify_only, description="EAGLE chain: causal, SWA tables"),
    Cell(name="swa.verify.tree", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: TREE_VERIFY},
         metadata=SWAVerifyTreeMetadata, cg_support=CGSupport.UNIFORM_BATCH,
         supports=tree_verify_only,
         description="EAGLE tree: custom mask, window at path positions, SWA tables"),
    Cell(name="swa.draft_extend_v2", modes={ForwardMode.DRAFT_EXTEND_V2},
         metadata=SWADraftExtendV2Metadata, cg_support=CGSupport.UNIFORM_BATCH,
         description="fixed draft tokens per request; SWA tables"),
    # Forced by MultiStepDraftBackend ("<arch>.draft_decode_step"), never auto-selected.
    Cell(name="swa.draft_decode_step", modes={ForwardMode.DECODE},
         metadata=SWADraftDecodeStepMetadata, cg_support=CGSupport.ALWAYS, priority=-10,
         description="one multi-step draft-decode step; its SWA table translated per step"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    register_cells(register, arch=AttnArch.SWA, execution=SWAExecution, cells=CELLS)
