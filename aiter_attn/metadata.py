"""Metadata value types a MetadataStrategy plans and an ExecutionStrategy consumes.

Small, composable, frozen. Tensors are views into either freshly allocated (eager) or static
(CUDA-graph) buffers; host integers are static bounds or come from the batch's CPU mirrors.
Hot-path types skip validators: ``aiter_attn.testing.check_invariants`` checks them in tests
and under ``AITER_ATTN_DEBUG=1``.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import attrs
import torch

from .types import ForwardMode

__all__ = ["QueryLayout", "PageTable", "RaggedKV", "CustomMask", "AttnMetadata"]

_T = dict(eq=False, repr=False)


def _step_plans():
    from .kernels.base import StepPlans

    return StepPlans()


@attrs.frozen(kw_only=True)
class QueryLayout:
    """Where each request's query tokens sit in the flat token dimension.

    Attributes:
        cu_seqlens_q: int32 ``[batch + 1]``, monotone, ``cu_seqlens_q[-1] == num_tokens``
            (alias ``qo_indptr``).
        max_seqlen_q: host int ≥ every request's query length.
        num_tokens: host int, query tokens in the step.
    """

    cu_seqlens_q: torch.Tensor = attrs.field(**_T)
    max_seqlen_q: int
    num_tokens: int

    @property
    def qo_indptr(self) -> torch.Tensor:
        return self.cu_seqlens_q


@attrs.frozen(kw_only=True)
class PageTable:
    """Page-granular view of each request's KV.

    Attributes:
        block_table: int32 ``[batch, max_pages]``: page ids; entries past a request's length
            are 0 (the null page).
        seqused_k: int32 ``[batch]``: KV tokens per request, this step's included.
        max_seqlen_k: host int ≥ every ``seqused_k``.
        page_size: tokens per page.
    """

    block_table: torch.Tensor = attrs.field(**_T)
    seqused_k: torch.Tensor = attrs.field(**_T)
    max_seqlen_k: int
    page_size: int


@attrs.frozen(kw_only=True)
class RaggedKV:
    """Token-granular ragged KV indices (FlashInfer/aiter ``kv_indptr``/``kv_indices``).

    Attributes:
        kv_indptr: int32 ``[batch + 1]``: offsets into ``kv_indices``.
        kv_indices: int32 ``[≥ kv_indptr[-1]]``: KV slots (page ids when ``page_size > 1``).
        kv_last_page_len: int32 ``[batch]``: tokens used in each request's last page.
    """

    kv_indptr: torch.Tensor = attrs.field(**_T)
    kv_indices: torch.Tensor = attrs.field(**_T)
    kv_last_page_len: Optional[torch.Tensor] = attrs.field(default=None, **_T)


@attrs.frozen(kw_only=True)
class CustomMask:
    """Tree-verify mask: bool flat ``custom_mask`` with per-request row-major
    ``[q_len, kv_len]`` blocks starting at ``mask_indptr[b]`` (int64 ``[batch + 1]``)."""

    custom_mask: torch.Tensor = attrs.field(**_T)
    mask_indptr: torch.Tensor = attrs.field(**_T)


@attrs.frozen(kw_only=True)
class AttnMetadata:
    """Everything one step's execution needs, shared by every layer of the step.

    Attributes:
        mode: the forward mode it was planned for.
        batch_size: requests (padded size under CUDA-graph replay).
        query: query layout.
        pages: page table of the (full) KV pool.
        mask: optional custom mask (tree verify).
        extras: strategy-specific parts (SWA page table, MLA work metadata, …) by name.
        kernel_plans: this step's kernel plans by layer group
            (:class:`~aiter_attn.kernels.base.StepPlans`), filled once per step by the
            execution strategy that binds the kernels; the graph signature walks its
            plans (their device tensors are compared by address).
    """

    mode: ForwardMode
    batch_size: int
    query: QueryLayout
    pages: PageTable
    mask: Optional[CustomMask] = None
    extras: Mapping[str, Any] = attrs.field(factory=dict, eq=False, repr=False)
    kernel_plans: Any = attrs.field(factory=_step_plans, eq=False, repr=False)
