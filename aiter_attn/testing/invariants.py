"""Deep invariant checks of planned metadata (tests and ``AITER_ATTN_DEBUG=1``).

These read device tensors back, so they never run on the hot path.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..batch import ForwardBatch
from ..metadata import AttnMetadata, CustomMask, RaggedKV

__all__ = ["InvariantError", "check_invariants", "check_indptr", "check_page_table",
           "check_ragged_kv", "check_custom_mask", "check_caller_page_table"]


_INDEX_DTYPES = (torch.int32, torch.int64)


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


def _check_used_pages(b: int, row_table: torch.Tensor, used: int, num_pages: Optional[int],
                      padding: bool) -> None:
    """Request ``b``'s first ``used`` entries are pool pages (the null page only for a padding
    row), every later entry is the null page."""
    if used and not padding and bool((row_table[:used] <= 0).any()):
        raise InvariantError(f"request {b} uses the null page 0: {row_table[:used].tolist()}.")
    if num_pages is not None and used and int(row_table[:used].max()) >= num_pages:
        raise InvariantError(f"request {b} page {int(row_table[:used].max())} ≥ pool size "
                             f"{num_pages}.")
    if bool((row_table[used:] != 0).any()):
        raise InvariantError(f"request {b}: entries past its {used} pages are not the null page.")


def check_page_table(block_table: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor,
                     req_to_token: torch.Tensor, page_size: int,
                     num_pages: Optional[int] = None) -> None:
    """Every used entry is the page holding that request's tokens (per ``req_to_token``), inside
    the pool and not the null page; unused entries are 0. A padding row (``req_to_token`` row 0,
    reserved: every token maps to the null slot 0) reads the null page, as planned."""
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
        _check_used_pages(b, bt[b], used, num_pages, padding=row == 0)
        # each token's slot lies in the page the table names for it
        slots = r2t[row, :n]
        if n and not torch.equal(slots // page_size, bt[b, torch.arange(n) // page_size]):
            raise InvariantError(f"request {b}: a token's slot lies outside its listed page.")


def check_caller_page_table(block_table: torch.Tensor, caller_table: torch.Tensor,
                            seq_lens: torch.Tensor, req_rows: torch.Tensor, page_size: int,
                            num_pages: Optional[int] = None) -> None:
    """A page table the caller planned (``spec_info.block_table`` of a multi-step draft step,
    whose branch tokens do not sit in ``req_to_token`` order): the metadata uses it as given,
    its used entries are pool pages and the rest null pages (the token-level layout is the
    planner's: :func:`aiter_attn.testing.spec_cases.check_draft_step` checks it)."""
    bt = block_table.detach().cpu().long()
    if not torch.equal(bt, caller_table[: bt.shape[0]].detach().cpu().long()):
        raise InvariantError("pages.block_table differs from the batch's spec_info.block_table "
                             "(the caller-planned table the step must use as given).")
    for b, (row, n) in enumerate(zip(req_rows.cpu().tolist(), seq_lens.cpu().tolist())):
        used = -(-n // page_size)
        if used > bt.shape[1]:
            raise InvariantError(f"request {b}: {used} pages needed, table has {bt.shape[1]}.")
        _check_used_pages(b, bt[b], used, num_pages, padding=row == 0)


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


def check_custom_mask(mask: CustomMask, q_lens: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """SGLang's layout: request ``b``'s row-major ``[q_len_b, seq_len_b]`` block starts at
    ``mask_indptr[b]`` (so the differences are ``q_len_b · seq_len_b``), inside a bool/uint8
    ``custom_mask`` holding at least ``mask_indptr[batch]`` elements."""
    bs = seq_lens.numel()
    if mask.custom_mask.dtype not in (torch.bool, torch.uint8):
        raise InvariantError(f"custom_mask has dtype {mask.custom_mask.dtype}; bool or uint8.")
    check_indptr("mask_indptr", mask.mask_indptr[: bs + 1], q_lens.long() * seq_lens.long())
    need = int(mask.mask_indptr[bs].detach().cpu()) if bs else 0
    if mask.custom_mask.numel() < need:
        raise InvariantError(f"custom_mask has {mask.custom_mask.numel()} elements; "
                             f"mask_indptr[{bs}] = {need} needs that many.")


def check_invariants(md: AttnMetadata, batch: ForwardBatch, ctx) -> None:
    """Check the parts of ``md`` that are present against ``batch`` and the pools."""
    bs = batch.batch_size
    if md.mode != batch.forward_mode or md.batch_size != bs:
        raise InvariantError(f"metadata planned for {md.mode.name} bs={md.batch_size}, batch is "
                             f"{batch.forward_mode.name} bs={bs}.")
    if md.query.num_tokens != batch.num_tokens:
        raise InvariantError(f"query.num_tokens={md.query.num_tokens} != the batch's "
                             f"{batch.num_tokens} query tokens.")
    page_size = getattr(getattr(ctx, "config", None), "page_size", None)
    if page_size is not None and md.pages.page_size != page_size:
        # the table would be checked against its own page size: a plan that counted pages of
        # another size (page ids = slot // that size) passed while every kernel, reading the
        # pool's pages, attended to other tokens
        raise InvariantError(f"pages.page_size={md.pages.page_size} but the pool's pages hold "
                             f"{page_size} tokens (BackendConfig.page_size).")
    for name, t in (("query.cu_seqlens_q", md.query.cu_seqlens_q),
                    ("pages.seqused_k", md.pages.seqused_k),
                    ("pages.block_table", md.pages.block_table)):
        if t.dtype not in _INDEX_DTYPES:
            raise InvariantError(f"{name} has dtype {t.dtype}; index tensors are int32 "
                                 "(int64 accepted).")
    check_indptr("cu_seqlens_q", md.query.cu_seqlens_q[: bs + 1], batch.q_lens_cpu)
    seq = batch.seq_lens_cpu
    if md.mask is not None:
        check_custom_mask(md.mask, batch.q_lens_cpu, seq)
    if not torch.equal(md.pages.seqused_k[:bs].cpu().long(), seq.long()):
        raise InvariantError("seqused_k differs from the batch's seq_lens.")
    if md.query.max_seqlen_q < (int(batch.q_lens_cpu.max()) if bs else 0):
        raise InvariantError("max_seqlen_q is below the longest query.")
    if md.pages.max_seqlen_k < (int(seq.max()) if bs else 0):
        raise InvariantError("max_seqlen_k is below the longest request.")
    num_pages = getattr(ctx.kv_pool, "num_pages", None)
    spec = batch.spec_info
    caller_table = getattr(spec, "block_table", None) if spec is not None else None
    if caller_table is not None:  # a multi-step draft step: the table is the planner's
        check_caller_page_table(md.pages.block_table[:bs], caller_table, seq,
                                batch.req_pool_indices, md.pages.page_size, num_pages)
    else:
        check_page_table(md.pages.block_table[:bs], seq, batch.req_pool_indices,
                         ctx.req_to_token, md.pages.page_size, num_pages)
