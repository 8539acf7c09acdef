"""Speculative-decoding strategies for MHA: TARGET_VERIFY (chain and tree), DRAFT_EXTEND,
DRAFT_EXTEND_V2 and one step of multi-step draft decode.

All of them reuse the MHA pieces (:func:`~aiter_attn.strategies.mha.plan_query_layout`,
:func:`~aiter_attn.strategies.mha.plan_page_table`): a query layout plus a page table over the
full pool, where ``seq_lens`` counts this step's tokens (the draft tokens of a verify step are
the last ``q_len`` keys of their request).

* **TARGET_VERIFY, chain** (EAGLE ``topk == 1``): ``q_len = num_draft_tokens`` for every
  request, causal attention over the page table. A ``custom_mask`` the engine sends anyway is a
  chain's causal mask and is not read.
* **TARGET_VERIFY, tree** (``topk > 1``): the same plus a custom mask. The engine's mask uses
  SGLang's layout (see :class:`~aiter_attn.batch.SpecInfo`): per request a row-major
  ``[q_len, seq_len_b]`` block, blocks concatenated. The tree part alone
  (``[batch, q_len, q_len]``, the prefix implicitly visible) is accepted too and expanded on
  the device. Which one was sent is read from the mask's *size* (a host integer): exactly
  ``q_len · Σ seq_len`` elements (or more: a static buffer read from its start) is the full
  layout, exactly ``batch · q_len²`` the tree part; when every prefix is empty the two
  layouts coincide. ``mask_indptr[b] = q_len · Σ_{c<b} seq_len_c`` is rebuilt on the device.
  The mask is applied literally (the kernel runs non-causal when a mask is planned), as for
  MLA and in the seed; a well-formed EAGLE tree is causal anyway.
* **DRAFT_EXTEND**: ragged accepted tokens per request, causal (like EXTEND).
* **DRAFT_EXTEND_V2**: a fixed ``num_draft_tokens`` per request (uniform, graph-capturable);
  ragged lengths raise a clear error (checked on the CPU mirror, never on the device).
* **mha.draft_decode_step**: one draft-decode step whose page table was planned by
  :class:`aiter_attn.multistep.MultiStepDraftBackend` for all steps at once; it only wraps
  those views (never auto-selected: priority below ``mha.decode``).

Verify, draft-extend-v2 and draft-decode planning make no device→host synchronisation: host
integers come from ``SpecInfo``/``BackendConfig.spec``, the batch's ``*_cpu`` mirrors and
tensor *shapes*; ``tests/test_spec_modes.py`` runs them on ``meta`` tensors to prove it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..contract import CHAIN_VERIFY, TREE_VERIFY
from ..hookspecs import hookimpl
from ..metadata import AttnMetadata, CustomMask, PageTable, QueryLayout
from ..ops import build_tree_mask
from ..registry import Cell, register_cells
from ..types import AttnArch, BackendConfig, CGSupport, ForwardMode
from ..validation import check_tensor
from .base import BufferSpec, MetadataStrategy
from .mha import ExtendMetadata, PagedExecution, PagedMetadata, plan_query_layout

__all__ = [
    "resolve_num_draft_tokens",
    "config_topk",
    "check_batch_topk",
    "tree_mask_layout",
    "mask_layout_of_size",
    "build_tree_mask",
    "fill_mask_indptr",
    "VerifyChainMetadata",
    "VerifyTreeMetadata",
    "DraftExtendV2Metadata",
    "DraftDecodeStepMetadata",
    "DRAFT_DECODE_STEP",
]

#: Name of the strategy pair multi-step draft decode (MHA) runs every step through.
DRAFT_DECODE_STEP = "mha.draft_decode_step"

_MASK_DTYPES = (torch.bool, torch.uint8)


def resolve_num_draft_tokens(batch: ForwardBatch, config: BackendConfig) -> int:
    """Query tokens per request of a TARGET_VERIFY / DRAFT_EXTEND_V2 batch (host int, no sync).

    Taken from ``batch.spec_info.num_draft_tokens``; it may not exceed
    ``config.spec.num_draft_tokens`` (which sizes static buffers). Every entry of
    ``extend_seq_lens_cpu`` (when present) must equal it: a fixed count per request.
    """
    mode = batch.forward_mode.name
    spec = batch.spec_info
    if spec is None:
        raise ValueError(
            f"forward_mode={mode} needs batch.spec_info (a SpecInfo with num_draft_tokens); "
            "build the batch with ForwardBatch.from_lengths(..., spec_info=SpecInfo(...)).")
    n = spec.num_draft_tokens
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"spec_info.num_draft_tokens={n!r}; must be an int ≥ 1 (query tokens "
                         f"per request in {mode}).")
    if config.spec is not None and n > config.spec.num_draft_tokens:
        raise ValueError(
            f"spec_info.num_draft_tokens={n} > BackendConfig.spec.num_draft_tokens="
            f"{config.spec.num_draft_tokens}, which sizes the static buffers; raise "
            "SpecDecodeConfig.num_draft_tokens.")
    ext = batch.extend_seq_lens_cpu
    if ext is not None and ext.numel() and bool((ext != n).any()):  # CPU mirror: no sync
        raise ValueError(
            f"{mode} expects a fixed {n} tokens per request (spec_info.num_draft_tokens) but "
            f"extend_seq_lens_cpu={ext.tolist()}; pad every request to {n} tokens, or use "
            "DRAFT_EXTEND for ragged accepted tokens.")
    return n


def config_topk(config: BackendConfig) -> int:
    """Draft branching a backend verifies: ``BackendConfig.spec.topk`` (1 without spec).

    The one rule for chain vs tree on every architecture: the *config* chooses (it sizes the
    static buffers and picks the strategy once); a batch whose ``spec_info.topk`` differs is
    refused by :func:`check_batch_topk`.
    """
    return config.spec.topk if config.spec is not None else 1


def check_batch_topk(batch: ForwardBatch, config: BackendConfig) -> int:
    """``config_topk(config)``, after checking ``batch.spec_info.topk`` equals it (host ints)."""
    want = config_topk(config)
    spec = batch.spec_info
    if spec is not None and spec.topk != want:
        kind = "a tree draft" if spec.topk > 1 else "a chain"
        plans = "tree verify (custom mask)" if want > 1 else "chain verify (causal)"
        raise ValueError(
            f"spec_info.topk={spec.topk} is {kind} but this backend plans {plans} "
            f"(BackendConfig.spec.topk={want}); chain vs tree is chosen by the config on every "
            f"architecture. Build the backend with BackendConfig(spec=SpecDecodeConfig("
            f"topk={spec.topk}, ...)) or send spec_info.topk={want}.")
    return want


def tree_mask_layout(custom_mask: torch.Tensor, batch: ForwardBatch, q_len: int) -> str:
    """``"full"`` or ``"tree"``: which layout ``custom_mask`` uses, from its size (host int).

    full: ``≥ q_len · Σ seq_len`` elements (per request ``[q_len, seq_len_b]``, row-major);
    tree: exactly ``batch · q_len²`` elements (per request ``[q_len, q_len]``). Raises naming
    both sizes otherwise.
    """
    check_tensor("spec_info.custom_mask", custom_mask, dtypes=_MASK_DTYPES,
                 hint="custom_mask is a flat bool mask (True = may attend).")
    return mask_layout_of_size(custom_mask.numel(), batch, q_len)


def check_tree_mask(batch: ForwardBatch, q_len: int) -> str:
    """The tree draft's ``spec_info.custom_mask`` as planning reads it (eager and graph replay
    alike): present, on the batch's device, bool/uint8 and of a size :func:`tree_mask_layout`
    accepts. Returns its layout; raises naming what to send otherwise."""
    spec = batch.spec_info
    mask = None if spec is None else spec.custom_mask
    if mask is None:
        raise ValueError(
            f"{batch.forward_mode.name} of a tree draft (topk > 1) needs "
            "spec_info.custom_mask; send SGLang's per-request [q_len, seq_len] blocks or the "
            "[batch, q_len, q_len] tree part.")
    if mask.device != batch.device:
        raise ValueError(f"spec_info.custom_mask is on {mask.device}; the batch is on "
                         f"{batch.device}. Build the mask on the batch's device.")
    return tree_mask_layout(mask, batch, q_len)


def mask_layout_of_size(numel: int, batch: ForwardBatch, q_len: int) -> str:
    """:func:`tree_mask_layout` from the mask's element count alone (no dtype check); shared
    with graph replay padding. Raises ValueError naming both accepted sizes."""
    full = q_len * batch.seq_lens_sum
    tree = batch.batch_size * q_len * q_len
    if numel == full or (numel > full and numel != tree):
        return "full"
    if numel == tree:
        return "tree"
    raise ValueError(
        f"spec_info.custom_mask has {numel} elements; expected q_len·Σseq_lens = {q_len}·"
        f"{batch.seq_lens_sum} = {full} (SGLang's per-request [q_len, seq_len] blocks) or "
        f"batch·q_len² = {tree} (the tree part only). Send one of those layouts.")


def fill_mask_indptr(seq_lens: torch.Tensor, q_len: int, mask_indptr: torch.Tensor) -> None:
    """``mask_indptr`` (int64 ``[B + 1]``) ← offsets of each request's ``[q_len, L]`` mask block."""
    mask_indptr[:1].zero_()
    torch.cumsum(seq_lens.to(mask_indptr.dtype) * q_len, dim=0, out=mask_indptr[1:])


class _UniformPagedMetadata(PagedMetadata):
    """Uniform ``q_len = num_draft_tokens`` (verify, draft-extend v2): graph-capturable."""

    cg_support = CGSupport.UNIFORM_BATCH

    def uniform_q_len(self, batch: Optional[ForwardBatch]) -> int:
        return resolve_num_draft_tokens(batch, self.ctx.config)


class VerifyChainMetadata(_UniformPagedMetadata):
    """TARGET_VERIFY for a chain (``topk == 1``): causal over the page table."""

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        check_batch_topk(batch, self.ctx.config)
        return super().plan(batch, out)


class VerifyTreeMetadata(_UniformPagedMetadata):
    """TARGET_VERIFY for a tree draft (``topk > 1``): page table + custom mask + mask_indptr.

    Buffers (static): ``custom_mask`` bool ``[max_tokens · max_seq_len]`` (``max_tokens =
    max_bs · num_draft_tokens``; ``max_seq_len`` counts the draft slack) and ``mask_indptr``
    int64 ``[max_bs + 1]``. Under ``out=`` the engine's mask is always copied (or expanded)
    into the static ``custom_mask`` so a captured graph reads one fixed address.
    """

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        return super().buffer_spec(max_bs, max_tokens, max_seq_len).merge(BufferSpec({
            "custom_mask": ((max(max_tokens, 1) * max(max_seq_len, 1),), torch.bool),
            "mask_indptr": ((max_bs + 1,), torch.int64),
        }))

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        n = self.uniform_q_len(batch)
        check_batch_topk(batch, self.ctx.config)
        spec = batch.spec_info
        layout = check_tree_mask(batch, n)
        bs = batch.batch_size
        total = n * batch.seq_lens_sum
        static = out is not None
        if static:
            cap = out["custom_mask"].numel()
            if total > cap:
                raise ValueError(
                    f"the tree mask needs {total} elements > the static custom_mask buffer of "
                    f"{cap}; raise BackendConfig.max_context_len / spec.num_draft_tokens bounds "
                    "of the CUDA-graph buffers, or run this step eagerly.")
        else:
            out = self.eager_buffers(batch, mask_numel=total if layout == "tree" else 0)
        query = plan_query_layout(batch, out["cu_seqlens_q"][: bs + 1], n)
        pages = self.plan_pages(batch, out, static)
        mask_indptr = out["mask_indptr"][: bs + 1]
        fill_mask_indptr(batch.seq_lens, n, mask_indptr)
        if layout == "tree":
            mask = build_tree_mask(batch.seq_lens, spec.custom_mask, n, mask_indptr,
                                   out["custom_mask"], total)
        elif static:
            mask = out["custom_mask"]
            mask[:total].copy_(spec.custom_mask.reshape(-1)[:total])
        else:
            mask = spec.custom_mask.reshape(-1)
        return AttnMetadata(mode=batch.forward_mode, batch_size=bs, query=query, pages=pages,
                            mask=CustomMask(custom_mask=mask, mask_indptr=mask_indptr))

    def eager_buffers(self, batch: ForwardBatch, mask_numel: int = 0) -> dict:
        """Buffers sized for ``batch``; the mask only when a tree part must be expanded."""
        spec = self.buffer_spec(max(batch.batch_size, 1), max(batch.num_tokens, 1),
                                max(batch.max_seq_len, 1))
        sized = {**spec.buffers, "custom_mask": ((mask_numel,), torch.bool)}
        return BufferSpec(sized).allocate(batch.device)


class DraftExtendV2Metadata(_UniformPagedMetadata):
    """DRAFT_EXTEND_V2: a fixed ``num_draft_tokens`` per request, causal over the page table."""


class DraftDecodeStepMetadata(MetadataStrategy):
    """One draft-decode step whose page table the multi-step backend planned (shared buffers).

    Reads ``batch.spec_info.qo_indptr`` (int32 ``[bs + 1]``) and ``block_table`` (int32
    ``[bs, W]``); ``seqused_k`` is ``batch.seq_lens``. Owns no buffers: they are views of
    :class:`aiter_attn.multistep.MultiStepDraftBackend`'s, so ``out`` is not used.
    """

    cg_support = CGSupport.ALWAYS

    def buffer_spec(self, max_bs: int, max_tokens: int, max_seq_len: int) -> BufferSpec:
        return BufferSpec()

    def plan(self, batch: ForwardBatch, out: Optional[dict] = None) -> AttnMetadata:
        spec = batch.spec_info
        if spec is None or spec.block_table is None or spec.qo_indptr is None:
            raise ValueError(
                f"strategy {DRAFT_DECODE_STEP!r} plans nothing itself: it needs "
                "spec_info.block_table and spec_info.qo_indptr from "
                "MultiStepDraftBackend.init_forward_metadata; use that backend's step batches.")
        bs = batch.batch_size
        bt = spec.block_table
        if bt.dim() != 2 or bt.shape[0] != bs or spec.qo_indptr.shape[0] != bs + 1:
            raise ValueError(
                f"spec_info.block_table {tuple(bt.shape)} / qo_indptr "
                f"{tuple(spec.qo_indptr.shape)} do not fit a batch of {bs}; expected "
                f"[{bs}, W] and [{bs + 1}].")
        ps = self.ctx.config.page_size
        return AttnMetadata(
            mode=batch.forward_mode, batch_size=bs,
            query=QueryLayout(cu_seqlens_q=spec.qo_indptr, max_seqlen_q=1, num_tokens=bs),
            pages=PageTable(block_table=bt, seqused_k=batch.seq_lens,
                            max_seqlen_k=bt.shape[1] * ps, page_size=ps),
        )


def _needs_chain(config: BackendConfig):
    if config.spec is not None and config.spec.topk > 1:
        return f"BackendConfig.spec.topk={config.spec.topk} is a tree draft (custom mask)"
    return None


def _needs_tree(config: BackendConfig):
    if config.spec is None or config.spec.topk <= 1:
        return "chain verify (BackendConfig.spec.topk = 1) needs no custom mask"
    return None


#: The MHA family's speculative cells.
CELLS = (
    Cell(name="mha.verify.chain", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: CHAIN_VERIFY},
         metadata=VerifyChainMetadata, cg_support=CGSupport.UNIFORM_BATCH, supports=_needs_chain,
         description="EAGLE chain (topk=1): num_draft_tokens per request, causal, page table"),
    Cell(name="mha.verify.tree", modes={ForwardMode.TARGET_VERIFY},
         contracts={ForwardMode.TARGET_VERIFY: TREE_VERIFY},
         metadata=VerifyTreeMetadata, cg_support=CGSupport.UNIFORM_BATCH, supports=_needs_tree,
         description="EAGLE tree (topk>1): page table + custom mask with mask_indptr"),
    Cell(name="mha.draft_extend", modes={ForwardMode.DRAFT_EXTEND}, metadata=ExtendMetadata,
         cg_support=CGSupport.NEVER,
         description="draft model over ragged accepted tokens; causal, page table"),
    Cell(name="mha.draft_extend_v2", modes={ForwardMode.DRAFT_EXTEND_V2},
         metadata=DraftExtendV2Metadata, cg_support=CGSupport.UNIFORM_BATCH,
         description="draft extend, fixed num_draft_tokens per request; causal, page table"),
    Cell(name=DRAFT_DECODE_STEP, modes={ForwardMode.DECODE}, metadata=DraftDecodeStepMetadata,
         cg_support=CGSupport.ALWAYS, priority=-10,
         description="one multi-step draft-decode step over tables planned for all steps"),
)


@hookimpl
def aiter_attn_register_strategies(register):
    register_cells(register, arch=AttnArch.MHA, execution=PagedExecution, cells=CELLS)
