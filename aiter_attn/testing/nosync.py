"""Prove a plan makes no device→host sync: run it with every device tensor on the ``meta``
device. Meta tensors have shapes but no data, so ``.item()``, ``.tolist()``, ``bool(t)``,
``int(t)`` or a data-dependent size raise at once, while the batch's CPU mirrors (the host's
legitimate source of integers) stay real. Printing or formatting a meta tensor reads no data
and passes here (on a GPU it copies to the host): run the plan inside
:func:`aiter_attn.testing.spec_cases.forbid_device_reads` as well, which refuses those too."""

from __future__ import annotations

import attrs
import torch

from ..batch import ForwardBatch, SpecInfo

__all__ = ["to_meta_batch", "meta_context"]


def _meta(t):
    return None if t is None else torch.empty_like(t, device="meta")


def to_meta_batch(batch: ForwardBatch) -> ForwardBatch:
    """A copy of ``batch`` whose device tensors live on ``meta``; ``*_cpu`` mirrors are kept."""
    spec = batch.spec_info
    if spec is not None:
        # every tensor SpecInfo carries; a multi-step draft step's caller-planned qo_indptr /
        # block_table left real would let a planner read them back unnoticed
        spec = attrs.evolve(spec, custom_mask=_meta(spec.custom_mask),
                            mask_indptr=_meta(spec.mask_indptr), qo_indptr=_meta(spec.qo_indptr),
                            block_table=_meta(spec.block_table))
    return attrs.evolve(
        batch,
        req_pool_indices=_meta(batch.req_pool_indices), seq_lens=_meta(batch.seq_lens),
        out_cache_loc=_meta(batch.out_cache_loc), positions=_meta(batch.positions),
        extend_seq_lens=_meta(batch.extend_seq_lens), encoder_lens=_meta(batch.encoder_lens),
        spec_info=spec,
    )


def meta_context(ctx):
    """A copy of a StrategyContext whose ``req_to_token`` lives on ``meta``."""
    return attrs.evolve(ctx, req_to_token=_meta(ctx.req_to_token))
