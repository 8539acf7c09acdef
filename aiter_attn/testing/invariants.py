"""Deep invariant checks of planned metadata (tests and ``AITER_ATTN_DEBUG=1``).

These read device tensors back, so they never run on the hot path.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..metadata import AttnMetadata, RaggedKV

__all__ = ["InvariantError", "check_invariants", "check_indptr", "check_page_table",
           "check_ragged_kv"]


class InvariantError(AssertionError):
    """Planned metadata breaks an invariant; the message says which and where."""


def check_indptr(name: str, indptr: torch.Tensor, lengths: torch.Tensor) -> None:
    """``indptr`` starts at 0, is monotone, and its differences are ``lengths``."""
    ip = indptr.detach().cpu().long()
    if ip.numel() != lengths.numel() + 1:
        raise InvariantError(f"{name} has {ip.numel()} entries for {lengths.numel()} requests.")
    if ip.numel() and int(ip[0]) != 0:
        raise InvariantError(f"{name}[0] = {int(ip[0])}, expected 0.")
    diffs = ip[1:] - ip[:-1]
    if bool((diffs < 0).any()):
        raise InvariantError(f"{name} is not monotone: {ip.tolist()}.")
    if not torch.equal(diffs, lengths.cpu().long()):
        raise InvariantError(f"{name} differences {diffs.tolist()} != lengths {lengths.tolist()}.")


def check_page_table(block_table: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor,
                     req_to_token: torch.Tensor, page_size: int,
                     num_pages: Optional[int] = None) -> None:
    """Every used entry is the page holding that request's tokens (per ``req_to_token``), inside
    the pool and not the null page; unused entries are 0."""
    bt = block_table.detach().cpu().long()
    r2t = req_to_token.detach().cpu().long()
    for b, (row, n) in enumerate(zip(req_rows.cpu().tolist(), seq_lens.cpu().tolist())):
        used = -(-n // page_size)
        if used > bt.shape[1]:
            raise InvariantError(f"request {b}: {used} pages needed, table has {bt.shape[1]}.")
        want = r2t[row, : n : page_size][:used] // page_size
        if not torch.equal(bt[b, :used], want):
            raise InvariantError(f"request {b}: page table {bt[b, :used].tolist()} != "
                                 f"req_to_token pages {want.tolist()}.")
        if used and bool((bt[b, :used] <= 0).any()):
            raise InvariantError(f"request {b} uses the null page 0: {bt[b, :used].tolist()}.")
        if num_pages is not None and used and int(bt[b, :used].max()) >= num_pages:
            raise InvariantError(f"request {b} page {int(bt[b, :used].max())} ≥ pool size {num_pages}.")
        if bool((bt[b, used:] != 0).any()):
            raise InvariantError(f"request {b}: entries past its {used} pages are not the null page.")
        # each token's slot lies in the page the table names for it
        slots = r2t[row, :n]
        if n and not torch.equal(slots // page_size, bt[b, torch.arange(n) // page_size]):
            raise InvariantError(f"request {b}: a token's slot lies outside its listed page.")


def check_ragged_kv(ragged: RaggedKV, seq_lens: torch.Tensor, req_rows: torch.Tensor,
                    req_to_token: torch.Tensor) -> None:
    """Token-level indices: indptr consistent, each index the request's own slot."""
    check_indptr("kv_indptr", ragged.kv_indptr, seq_lens)
    ip = ragged.kv_indptr.cpu().long().tolist()
    idx = ragged.kv_indices.cpu().long()
    r2t = req_to_token.cpu().long()
    for b, (row, n) in enumerate(zip(req_rows.cpu().tolist(), seq_lens.cpu().tolist())):
        if not torch.equal(idx[ip[b]: ip[b] + n], r2t[row, :n]):
            raise InvariantError(f"request {b}: kv_indices differ from its req_to_token row.")


def check_invariants(md: AttnMetadata, batch: ForwardBatch, ctx) -> None:
    """Check the parts of ``md`` that are present against ``batch`` and the pools."""
    bs = batch.batch_size
    if md.mode != batch.forward_mode or md.batch_size != bs:
        raise InvariantError(f"metadata planned for {md.mode.name} bs={md.batch_size}, batch is "
                             f"{batch.forward_mode.name} bs={bs}.")
    if md.query.num_tokens != batch.num_tokens:
        raise InvariantError(f"query.num_tokens={md.query.num_tokens} != the batch's "
                             f"{batch.num_tokens} query tokens.")
    check_indptr("cu_seqlens_q", md.query.cu_seqlens_q[: bs + 1], batch.q_lens_cpu)
    seq = batch.seq_lens_cpu
    if not torch.equal(md.pages.seqused_k[:bs].cpu().long(), seq.long()):
        raise InvariantError("seqused_k differs from the batch's seq_lens.")
    if md.query.max_seqlen_q < (int(batch.q_lens_cpu.max()) if bs else 0):
        raise InvariantError("max_seqlen_q is below the longest query.")
    if md.pages.max_seqlen_k < (int(seq.max()) if bs else 0):
        raise InvariantError("max_seqlen_k is below the longest request.")
    num_pages = getattr(ctx.kv_pool, "num_pages", None)
    check_page_table(md.pages.block_table[:bs], seq, batch.req_pool_indices, ctx.req_to_token,
                     md.pages.page_size, num_pages)
