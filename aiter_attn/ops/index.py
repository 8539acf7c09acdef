"""The index-builder ops, on the device without a host sync: page tables (and the SWA
pool's, in the same pass), multi-step draft-decode indices, tree-verify masks and token-level
ragged KV indices."""

from __future__ import annotations

import torch

from ..kernels.registry import KernelRequest
from ..validation import (INDEX_DTYPES, check_host_count, check_page_size_arg, check_pool_rows,
                          check_pool_values, check_same_device, check_tensor,
                          debug_checks_enabled)
from .selection import _registry

__all__ = ["build_page_table", "build_page_tables_swa", "build_draft_decode_indices",
           "build_tree_mask", "build_ragged_kv_indices"]


def build_page_table(req_to_token, req_pool_indices, seq_lens, page_size, out, *, backend=None):
    """Fill ``out`` (int32 ``[batch, max_pages]``) with each request's page ids (0 past its
    length). See :func:`aiter_attn.kernels.reference.build_page_table_reference`."""
    check_page_size_arg(page_size)
    check_pool_rows(req_to_token, req_pool_indices, seq_lens, "build_page_table")
    check_tensor("out", out, dtypes=INDEX_DTYPES, ndim=2, shape=(seq_lens.shape[0], None),
                 hint="out is the int32 [batch, max_pages] page table (one row per request).")
    check_same_device("out", out, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    if debug_checks_enabled():
        check_pool_values(req_to_token, req_pool_indices, seq_lens, "build_page_table")
    req = KernelRequest(op="build_page_table", device=out.device.type, page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, out
    )


def build_page_tables_swa(req_to_token, req_pool_indices, seq_lens, page_size, full_to_swa, out,
                          out_swa, *, backend=None):
    """:func:`build_page_table` into ``out`` and, in the same pass, the SWA pool's table into
    ``out_swa`` (same shape): ``full_to_swa[page · page_size] // page_size`` per entry (0 past
    each request's pages). ``full_to_swa``: the hybrid pool's int64 ``[full_slots]`` mapping.
    See :func:`aiter_attn.kernels.reference.build_page_tables_swa_reference`."""
    check_same_device("out", out, full_to_swa=full_to_swa, out_swa=out_swa)
    req = KernelRequest(op="build_page_tables_swa", device=out.device.type, page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, full_to_swa, out, out_swa
    )


def build_draft_decode_indices(req_to_token, req_pool_indices, seq_lens, page_size, topk,
                               num_steps, cu_seqlens_q, draft_req_pool_indices, seqused_k,
                               positions, out_cache_loc, block_table, *, backend=None):
    """The indices of every multi-step draft-decode pass in one device pass (no host sync):
    per-row query offsets and request rows, and per step the KV lengths, positions, the slots
    of this step's draft tokens and each branch's page table. See
    :func:`aiter_attn.kernels.reference_extra.build_draft_decode_indices_reference`."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; must be a positive int.")
    rows = seq_lens.shape[0] * topk
    steps = block_table.shape[0]
    for name, t, shape in (("cu_seqlens_q", cu_seqlens_q, (rows + 1,)),
                           ("draft_req_pool_indices", draft_req_pool_indices, (rows,)),
                           ("seqused_k", seqused_k, (steps, rows)),
                           ("positions", positions, (steps, rows)),
                           ("out_cache_loc", out_cache_loc, (steps, rows))):
        check_tensor(name, t, dtypes=INDEX_DTYPES, shape=shape,
                     hint="views of MultiStepDraftBackend's buffers sized for this batch.")
    check_tensor("block_table", block_table, dtypes=INDEX_DTYPES, ndim=3,
                 shape=(steps, rows, None))
    check_same_device("block_table", block_table, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens)
    req = KernelRequest(op="build_draft_decode_indices", device=block_table.device.type,
                        page_size=page_size)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, page_size, topk, num_steps, cu_seqlens_q,
        draft_req_pool_indices, seqused_k, positions, out_cache_loc, block_table)


def build_tree_mask(seq_lens, tree, q_len, mask_indptr, out, total, *, backend=None):
    """Expand a tree-verify mask's draft part to SGLang's full layout on the device (no host
    sync): for request ``b`` with ``L = seq_lens[b]`` keys and prefix ``P = L - q_len``,
    ``out[mask_indptr[b] + i·L + j] = j < P  or  tree[b, i, j - P]``. Arguments as
    :func:`aiter_attn.kernels.reference_extra.build_tree_mask_reference`."""
    check_tensor("seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1,
                 hint="seq_lens is int32 [batch]: KV length per request, draft tokens included.")
    bs = seq_lens.shape[0]
    check_tensor("tree", tree, dtypes=(torch.bool, torch.uint8),
                 hint="tree is the bool [batch, q_len, q_len] draft-tree visibility.")
    q_len = check_host_count("q_len", q_len, "the draft tokens per request")
    check_tensor("mask_indptr", mask_indptr, dtypes=INDEX_DTYPES, ndim=1, shape=(bs + 1,),
                 hint="mask_indptr is int64 [batch + 1]: each request's offset into out.")
    check_tensor("out", out, dtypes=(torch.bool, torch.uint8), ndim=1,
                 hint="out is the flat bool mask buffer [≥ total].")
    total = check_host_count("total", total, "q_len · sum(seq_lens), from the CPU mirror")
    if total > out.shape[0]:
        raise ValueError(f"total={total} mask elements but out holds {out.shape[0]}; size out "
                         "from q_len · sum(seq_lens) (or the graph manager's bound).")
    check_same_device("out", out, seq_lens=seq_lens, tree=tree, mask_indptr=mask_indptr)
    req = KernelRequest(op="build_tree_mask", device=out.device.type)
    return _registry().select(req, backend=backend).fn(seq_lens, tree, q_len, mask_indptr, out,
                                                        total)


def build_ragged_kv_indices(req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
                            total: int, *, backend=None):
    """Token-level ``kv_indptr``/``kv_indices``; ``total`` = host-known ``sum(seq_lens)``.

    req_to_token int ``[R, C]``; req_pool_indices, seq_lens int ``[B]``; kv_indptr
    int32/int64 ``[≥ B + 1]``; kv_indices int32/int64 ``[≥ total]``. See
    :func:`aiter_attn.kernels.reference.build_ragged_kv_indices_reference`."""
    check_pool_rows(req_to_token, req_pool_indices, seq_lens, "build_ragged_kv_indices")
    bs = seq_lens.shape[0]
    check_tensor("kv_indptr", kv_indptr, dtypes=INDEX_DTYPES, ndim=1,
                 hint="kv_indptr is int32 [≥ batch + 1].")
    if kv_indptr.shape[0] < bs + 1:
        raise ValueError(f"kv_indptr has shape {tuple(kv_indptr.shape)}; needs ≥ batch + 1 = "
                         f"{bs + 1} entries. Size it from the batch (or the graph bound).")
    check_tensor("kv_indices", kv_indices, dtypes=INDEX_DTYPES, ndim=1,
                 hint="kv_indices is int32 [≥ total].")
    total = check_host_count("total", total, "sum(seq_lens), from the batch's CPU mirror")
    if total > kv_indices.shape[0]:
        raise ValueError(f"total={total} tokens but kv_indices holds {kv_indices.shape[0]}; "
                         "size it from the batch's seq_lens_sum (or the graph manager's bound).")
    check_same_device("kv_indices", kv_indices, req_to_token=req_to_token,
                      req_pool_indices=req_pool_indices, seq_lens=seq_lens, kv_indptr=kv_indptr)
    if debug_checks_enabled():
        check_pool_values(req_to_token, req_pool_indices, seq_lens, "build_ragged_kv_indices",
                           total=total)
    req = KernelRequest(op="build_ragged_kv_indices", device=kv_indices.device.type)
    return _registry().select(req, backend=backend).fn(
        req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices, total
    )
