"""Triton index-building kernels: page tables and ragged token indices from ``req_to_token``.

Both run entirely on the device: request lengths are read by the kernels, never by the host,
so planning a decode step makes no device→host synchronisation and can be graph-captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...validation import INDEX_DTYPES, require_unit_stride, unit_stride
from ._kvutil import next_pow2

__all__ = ["build_page_table", "build_page_tables_swa", "build_ragged_kv_indices",
           "build_draft_decode_indices"]


@triton.jit
def _page_table_kernel(
    r2t_ptr, rpi_ptr, seq_ptr, out_ptr, f2s_ptr, swa_ptr,
    stride_r2t, stride_out, stride_swa, width, r2t_cols,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    TRANSLATE: tl.constexpr,
):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    row = tl.load(rpi_ptr + b).to(tl.int64)
    seq = tl.load(seq_ptr + b)
    n_pages = (seq + PAGE_SIZE - 1) // PAGE_SIZE
    live = in_row & (cols < n_pages) & (cols * PAGE_SIZE < r2t_cols)
    tok = tl.load(r2t_ptr + row * stride_r2t + cols.to(tl.int64) * PAGE_SIZE, mask=live, other=0)
    page = tl.where(live, tok // PAGE_SIZE, 0)
    tl.store(out_ptr + b.to(tl.int64) * stride_out + cols, page.to(out_ptr.dtype.element_ty),
             mask=in_row)
    if TRANSLATE:
        # the same pass writes the SWA pool's table: the SWA slot of each page's first slot
        swa_slot = tl.load(f2s_ptr + page.to(tl.int64) * PAGE_SIZE, mask=live, other=0)
        swa_page = tl.where(live, swa_slot // PAGE_SIZE, 0)
        tl.store(swa_ptr + b.to(tl.int64) * stride_swa + cols,
                 swa_page.to(swa_ptr.dtype.element_ty), mask=in_row)


def _check_table_args(req_to_token, req_pool_indices, seq_lens, page_size, out):
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r}; must be a positive int.")
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens), ("out", out)):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; allowed: int32, int64.")
    if out.dim() != 2 or out.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"out has shape {tuple(out.shape)}; expected [batch={seq_lens.shape[0]}, max_pages]."
        )
    require_unit_stride("out", out)


def _launch_tables(req_to_token, req_pool_indices, seq_lens, page_size, out, full_to_swa=None,
                   out_swa=None):
    batch, width = out.shape
    if batch == 0 or width == 0:
        return out
    block = min(1024, max(16, next_pow2(width)))
    grid = (batch, triton.cdiv(width, block))
    translate = full_to_swa is not None
    _page_table_kernel[grid](
        req_to_token, req_pool_indices, seq_lens, out,
        full_to_swa if translate else out, out_swa if translate else out,
        req_to_token.stride(0), out.stride(0), out_swa.stride(0) if translate else 0, width,
        req_to_token.shape[1],
        PAGE_SIZE=page_size, BLOCK=block, TRANSLATE=translate, num_warps=4,
    )
    return out


def build_page_table(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
) -> torch.Tensor:
    """``out[b, i] = req_to_token[req_pool_indices[b], i·page_size] // page_size`` for
    ``i < ceil(seq_lens[b] / page_size)``, 0 (the null page) elsewhere.

    req_to_token int32/int64 ``[R, C]``; req_pool_indices int ``[B]``; seq_lens int ``[B]``;
    out int32/int64 ``[B, W]`` (written whole, returned). Same result as
    :func:`aiter_attn.kernels.reference.build_page_table_reference`.
    """
    _check_table_args(req_to_token, req_pool_indices, seq_lens, page_size, out)
    req_to_token, req_pool_indices, seq_lens = map(
        unit_stride, (req_to_token, req_pool_indices, seq_lens))
    return _launch_tables(req_to_token, req_pool_indices, seq_lens, page_size, out)


def build_page_tables_swa(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    full_to_swa: torch.Tensor,
    out: torch.Tensor,
    out_swa: torch.Tensor,
) -> torch.Tensor:
    """The full page table (as :func:`build_page_table`) and, in the same pass, the SWA pool's
    ``out_swa[b, i] = full_to_swa[out[b, i] · page_size] // page_size`` (0 past each request's
    pages). full_to_swa int64 ``[full_slots]``; out_swa int32/int64 shaped like out. Same
    result as :func:`aiter_attn.kernels.reference.build_page_tables_swa_reference`."""
    _check_table_args(req_to_token, req_pool_indices, seq_lens, page_size, out)
    if out_swa.shape != out.shape or out_swa.dtype not in INDEX_DTYPES or (
            out_swa.shape[1] > 1 and out_swa.stride(1) != 1):
        raise ValueError(
            f"out_swa has shape {tuple(out_swa.shape)} and dtype {out_swa.dtype}; expected "
            f"{tuple(out.shape)}, int32/int64, contiguous along its last dim (like out).")
    if full_to_swa.dim() != 1 or full_to_swa.dtype not in INDEX_DTYPES:
        raise ValueError(
            f"full_to_swa has shape {tuple(full_to_swa.shape)} and dtype {full_to_swa.dtype}; "
            "expected the pool's int64 [full_slots] full_to_swa_index_mapping.")
    req_to_token, req_pool_indices, seq_lens, full_to_swa = map(
        unit_stride, (req_to_token, req_pool_indices, seq_lens, full_to_swa))
    return _launch_tables(req_to_token, req_pool_indices, seq_lens, page_size, out,
                          full_to_swa, out_swa)


@triton.jit
def _ragged_kernel(
    r2t_ptr, rpi_ptr, seq_ptr, indptr_ptr, idx_ptr,
    stride_r2t, batch,
    BLOCK_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    # This request's start = sum of the earlier requests' lengths (fused exclusive scan).
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seq_ptr + offs_b, mask=offs_b < b, other=0).to(tl.int64)
    start = tl.sum(lens, axis=0)
    seq = tl.load(seq_ptr + b).to(tl.int64)
    tl.store(indptr_ptr + b + 1, (start + seq).to(indptr_ptr.dtype.element_ty))
    if b == 0:
        tl.store(indptr_ptr, start.to(indptr_ptr.dtype.element_ty))  # start is 0 here
    row = tl.load(rpi_ptr + b).to(tl.int64)
    for j0 in range(0, seq, BLOCK):
        offs = j0 + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < seq
        tok = tl.load(r2t_ptr + row * stride_r2t + offs, mask=m, other=0)
        tl.store(idx_ptr + start + offs, tok.to(idx_ptr.dtype.element_ty), mask=m)


def build_ragged_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    total: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level ragged indices in one launch: ``kv_indptr = [0, cumsum(seq_lens)]`` and
    ``kv_indices[kv_indptr[b] + j] = req_to_token[req_pool_indices[b], j]`` for
    ``j < seq_lens[b]``. Entries of ``kv_indices`` past the total are left untouched.

    req_to_token int ``[R, C]``; req_pool_indices int ``[B]``; seq_lens int ``[B]``;
    kv_indptr int32/int64 ``[≥ B + 1]``; kv_indices int32/int64 ``[≥ total]``; ``total`` is
    the host-known ``sum(seq_lens)`` (from the batch's CPU mirror), used only to check that
    ``kv_indices`` is large enough. Same result as
    :func:`aiter_attn.kernels.reference.build_ragged_kv_indices_reference`.
    """
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices)):
        if t.dtype not in INDEX_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; allowed: int32, int64.")
    batch = seq_lens.shape[0]
    if kv_indptr.shape[0] < batch + 1:
        raise ValueError(
            f"kv_indptr has {kv_indptr.shape[0]} entries; needs ≥ batch + 1 = {batch + 1}."
        )
    if int(total) > kv_indices.shape[0]:
        raise ValueError(
            f"total={total} tokens but kv_indices holds {kv_indices.shape[0]}; size it from "
            "the batch's seq_lens_sum (or the graph manager's bound)."
        )
    require_unit_stride("kv_indptr", kv_indptr)
    require_unit_stride("kv_indices", kv_indices)
    req_to_token, req_pool_indices, seq_lens = map(
        unit_stride, (req_to_token, req_pool_indices, seq_lens))
    if batch == 0:
        kv_indptr[:1].zero_()
        return kv_indptr, kv_indices
    _ragged_kernel[(batch,)](
        req_to_token, req_pool_indices, seq_lens, kv_indptr, kv_indices,
        req_to_token.stride(0), batch,
        BLOCK_B=max(16, next_pow2(batch)), BLOCK=1024, num_warps=4,
    )
    return kv_indptr, kv_indices


@triton.jit
def _draft_decode_kernel(
    r2t_ptr, rpi_ptr, seq_ptr, cu_ptr, drpi_ptr, seqk_ptr, pos_ptr, loc_ptr, bt_ptr,
    stride_r2t, r2t_cols, rows, width, topk, num_steps,
    stride_sk, stride_pos, stride_loc, stride_bt_s, stride_bt_r,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    s = tl.program_id(1)
    b = r // topk
    branch = (r % topk).to(tl.int64)
    req = tl.load(rpi_ptr + b).to(tl.int64)
    prefix = tl.load(seq_ptr + b).to(tl.int64)
    base = prefix - prefix % PAGE_SIZE
    # branch k's columns at or past base are shifted by k whole branch-page runs
    shift = branch * ((prefix % PAGE_SIZE + num_steps + PAGE_SIZE - 1) // PAGE_SIZE) * PAGE_SIZE
    kv_len = prefix + s + 1
    if s == 0:
        tl.store(cu_ptr + r, r.to(cu_ptr.dtype.element_ty))
        tl.store(drpi_ptr + r, req.to(drpi_ptr.dtype.element_ty))
        if r == rows - 1:  # (r + 1, not rows: an argument equal to 1 arrives as a constant)
            tl.store(cu_ptr + r + 1, (r + 1).to(cu_ptr.dtype.element_ty))
    tl.store(seqk_ptr + s * stride_sk + r, kv_len.to(seqk_ptr.dtype.element_ty))
    tl.store(pos_ptr + s * stride_pos + r, (kv_len - 1).to(pos_ptr.dtype.element_ty))
    row = r2t_ptr + req * stride_r2t
    tok_col = tl.minimum(kv_len - 1 + shift, r2t_cols - 1)
    tl.store(loc_ptr + s * stride_loc + r, tl.load(row + tok_col).to(loc_ptr.dtype.element_ty))
    n_pages = (kv_len + PAGE_SIZE - 1) // PAGE_SIZE
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt_s + r.to(tl.int64) * stride_bt_r
    for w0 in range(0, width, BLOCK):
        w = w0 + tl.arange(0, BLOCK).to(tl.int64)
        in_row = w < width
        first = w * PAGE_SIZE
        col = tl.minimum(tl.where(first < base, first, first + shift), r2t_cols - 1)
        used = in_row & (w < n_pages)
        page = tl.load(row + col, mask=used, other=0) // PAGE_SIZE
        tl.store(bt_row + w, tl.where(used, page, 0).to(bt_ptr.dtype.element_ty), mask=in_row)


def build_draft_decode_indices(req_to_token, req_pool_indices, seq_lens, page_size, topk,
                               num_steps, cu_seqlens_q, draft_req_pool_indices, seqused_k,
                               positions, out_cache_loc, block_table) -> None:
    """All multi-step draft-decode indices in one kernel (one program per row and step).
    Same result as
    :func:`aiter_attn.kernels.reference_extra.build_draft_decode_indices_reference`."""
    rows = seq_lens.shape[0] * topk
    steps, width = block_table.shape[0], block_table.shape[2]
    if rows == 0 or steps == 0:
        return None
    for name, t in (("cu_seqlens_q", cu_seqlens_q),
                    ("draft_req_pool_indices", draft_req_pool_indices),
                    ("seqused_k", seqused_k), ("positions", positions),
                    ("out_cache_loc", out_cache_loc), ("block_table", block_table)):
        require_unit_stride(name, t)  # outputs
    req_to_token, req_pool_indices, seq_lens = map(
        unit_stride, (req_to_token, req_pool_indices, seq_lens))
    block = min(1024, max(16, next_pow2(width)))
    _draft_decode_kernel[(rows, steps)](
        req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, draft_req_pool_indices,
        seqused_k, positions, out_cache_loc, block_table,
        req_to_token.stride(0), req_to_token.shape[1], rows, width, topk, num_steps,
        seqused_k.stride(0), positions.stride(0), out_cache_loc.stride(0),
        block_table.stride(0), block_table.stride(1),
        PAGE_SIZE=page_size, BLOCK=block, num_warps=4,
    )
    return None
