"""Padding a real batch into the static inputs of a captured batch size.

Rows ``[0, bs)`` get the real batch; padding rows ``[bs, padded_bs)`` get:

* ``req_pool_indices`` → :data:`NULL_REQ_ROW` (row 0 of ``req_to_token``, all zeros: every
  token of a padding row maps to the null slot 0, never to a live request's slot);
* ``seq_lens`` → ``fill`` (≥ the mode's query tokens per request and ≥ 1, so no row is empty
  and no query sits before position 0);
* ``out_cache_loc`` → :data:`DUMMY_SLOT` (slot 0 of the null page) for each padding token;
* ``positions`` → 0; a tree mask → all-visible blocks of ``q_len × fill`` (a mask sent as
  the tree part alone, ``[batch, q_len, q_len]``, is first expanded to the full layout).

Everything is written in place with device→device copies and fills, plus host writes of the
CPU mirrors: no device→host synchronisation.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import torch

from ..batch import ForwardBatch
from .buffers import DUMMY_SLOT, NULL_REQ_ROW, StaticInputs

__all__ = ["GraphLimitError", "next_capture_size", "load_padded", "check_mask_fits", "mask_layout"]


class GraphLimitError(ValueError):
    """A batch does not fit the captured graphs or their static buffers; the message names the
    limit and the setting to change."""


def next_capture_size(sizes: Sequence[int], bs: int) -> int:
    """Smallest captured size ≥ ``bs`` (``sizes`` sorted ascending); raise past the largest."""
    i = bisect.bisect_left(sizes, bs)
    if i == len(sizes):
        raise GraphLimitError(
            f"batch of {bs} requests > the largest captured CUDA-graph batch size {sizes[-1]}; "
            "raise BackendConfig.max_batch_size (or the capture_sizes / max_bs given to "
            "init_cuda_graph_state), or run this step eagerly."
        )
    return sizes[i]


def load_padded(static: StaticInputs, batch: ForwardBatch, padded_bs: int, q_len: int,
                fill: int, *, tree_mask: bool = False) -> None:
    """Copy ``batch`` (``bs`` requests, ``bs · q_len`` tokens) into ``static`` rows ``[0, bs)``
    and write padding rows ``[bs, padded_bs)``. Shapes/limits are checked by the caller
    (:func:`check_mask_fits` for the mask).

    ``tree_mask``: the mode plans a tree mask (the static batch reads ``static.custom_mask``):
    the batch's mask is copied (or expanded) and padding blocks are made all-visible. Without
    it a mask the batch carries is not read (a chain's causal mask), as in eager planning."""
    bs, n = batch.batch_size, batch.num_tokens
    pad_tokens = (padded_bs - bs) * q_len
    static.req_pool_indices[:bs].copy_(batch.req_pool_indices)
    static.seq_lens[:bs].copy_(batch.seq_lens)
    static.seq_lens_cpu[:bs].copy_(batch.seq_lens_cpu)
    static.out_cache_loc[:n].copy_(batch.out_cache_loc)
    if batch.positions is not None:
        static.positions[:n].copy_(batch.positions)
    else:
        static.positions[:n].zero_()
    if padded_bs > bs:
        static.req_pool_indices[bs:padded_bs].fill_(NULL_REQ_ROW)
        static.seq_lens[bs:padded_bs].fill_(fill)
        static.seq_lens_cpu[bs:padded_bs].fill_(fill)
        static.out_cache_loc[n:n + pad_tokens].fill_(DUMMY_SLOT)
        static.positions[n:n + pad_tokens].zero_()
    # Modes sharing these buffers use different q_len; only this function writes them, so
    # they are rewritten when (q_len, padded_bs) changes.
    if static.extend_state != (q_len, padded_bs):
        static.extend_seq_lens[:padded_bs].fill_(q_len)
        static.extend_seq_lens_cpu[:padded_bs].fill_(q_len)
        static.extend_state = (q_len, padded_bs)
    torch.sub(static.seq_lens_cpu[:padded_bs], q_len, out=static.extend_prefix_lens_cpu[:padded_bs])
    if not tree_mask:
        return
    spec = batch.spec_info
    m = 0  # an all-padding batch (capture) has no mask of its own
    if spec is not None and spec.custom_mask is not None:
        m = q_len * batch.seq_lens_sum  # host int from the CPU mirror
        if mask_layout(spec.custom_mask, batch, q_len) == "tree":
            from ..ops import build_tree_mask  # the planners' expansion, shared
            from ..strategies.spec import fill_mask_indptr

            indptr = static.mask_indptr[: bs + 1]
            fill_mask_indptr(batch.seq_lens, q_len, indptr)
            build_tree_mask(batch.seq_lens, spec.custom_mask, q_len, indptr, static.custom_mask, m)
        else:
            static.custom_mask[:m].copy_(spec.custom_mask.reshape(-1)[:m])
    static.custom_mask[m:m + pad_tokens * fill].fill_(True)


def mask_layout(custom_mask: torch.Tensor, batch: ForwardBatch, q_len: int) -> str:
    """``"full"`` (SGLang's per-request ``[q_len, seq_len]`` blocks, ≥ ``q_len · Σ seq_len``
    elements) or ``"tree"`` (exactly ``batch · q_len²``: the draft part only, prefix visible),
    decided from sizes (host ints); see :class:`aiter_attn.SpecInfo`."""
    from ..strategies.spec import mask_layout_of_size  # one rule for planning and padding

    return mask_layout_of_size(custom_mask.numel(), batch, q_len)


def check_mask_fits(static: StaticInputs, batch: ForwardBatch, padded_bs: int, q_len: int,
                    fill: int, max_seq_len: int, *, tree_mask: bool) -> None:
    """Check the batch's tree mask before anything is written, as eager planning would.

    ``tree_mask``: the mode plans a tree mask. Then the batch must carry one (else the static
    mask of an earlier batch would be read), bool/uint8 on the batch's device (it is copied
    into the bool static buffer: another dtype would be converted silently, e.g. an additive
    0/-inf mask inverted), of a size :func:`mask_layout` accepts, and the real blocks plus
    the padding blocks must fit the static buffer. Without ``tree_mask`` a mask the batch
    carries is not read (a chain's causal mask, as in eager planning): nothing to check.
    """
    if not tree_mask:
        return
    from ..strategies.spec import check_tree_mask  # the planners' rule, shared

    check_tree_mask(batch, q_len)
    need = q_len * batch.seq_lens_sum + (padded_bs - batch.batch_size) * q_len * fill
    have = int(static.custom_mask.shape[0])
    if need > have:
        raise GraphLimitError(
            f"the tree mask needs {need} elements > the static custom_mask buffer of {have} "
            f"(max tokens × max_seq_len={max_seq_len}); raise BackendConfig.max_context_len or "
            "spec.num_draft_tokens bounds, or run this step eagerly."
        )
