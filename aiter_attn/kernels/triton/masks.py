"""Triton tree-mask expansion: the draft tree part of a verify mask to SGLang's full layout.

EAGLE's tree verify sends, per request, only the ``[q_len, q_len]`` visibility among the draft
tokens; kernels read the full per-request ``[q_len, L]`` rows (the committed prefix always
visible). One program per (request, query row) writes its row in one pass; sizes come from
device tensors (``seq_lens``, ``mask_indptr``), so it is CUDA-graph safe and never syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...validation import require_unit_stride, unit_stride

__all__ = ["build_tree_mask"]


@triton.jit
def _tree_mask_kernel(seq_ptr, tree_ptr, indptr_ptr, out_ptr, q_len, tree_numel,
                      BLOCK: tl.constexpr):
    b = tl.program_id(0)
    i = tl.program_id(1)
    kv_len = tl.load(seq_ptr + b).to(tl.int64)
    prefix = kv_len - q_len
    row = tl.load(indptr_ptr + b).to(tl.int64) + i * kv_len
    tree_row = (b.to(tl.int64) * q_len + i) * q_len
    for j0 in range(0, kv_len, BLOCK):
        j = j0 + tl.arange(0, BLOCK).to(tl.int64)
        live = j < kv_len
        jt = j - prefix
        # padding rows (graph replay) may point past a shorter tree tensor: never read there
        in_tree = live & (jt >= 0) & (tree_row + jt < tree_numel)
        bit = tl.load(tree_ptr + tree_row + jt, mask=in_tree, other=0)
        vis = (jt < 0) | (bit != 0)
        tl.store(out_ptr + row + j, vis.to(out_ptr.dtype.element_ty), mask=live)


def build_tree_mask(seq_lens: torch.Tensor, tree: torch.Tensor, q_len: int,
                    mask_indptr: torch.Tensor, out: torch.Tensor, total: int) -> torch.Tensor:
    """``out[mask_indptr[b] + i·L + j] = j < L - q_len  or  tree[b, i, j - (L - q_len)]`` for
    ``L = seq_lens[b]``. seq_lens int ``[B]``; tree bool/uint8 with ``B · q_len²`` elements;
    mask_indptr int64 ``[B + 1]`` (filled); out bool/uint8 ``[≥ total]``; ``total`` (host int,
    ``q_len · Σ L``) is checked against out's size (each row's extent is read on the device).
    Same result as :func:`aiter_attn.kernels.reference_extra.build_tree_mask_reference`."""
    if out.dtype not in (torch.bool, torch.uint8) or out.dim() != 1:
        raise ValueError(f"out has dtype {out.dtype} and shape {tuple(out.shape)}; expected a "
                         "flat bool/uint8 mask buffer.")
    if out.numel() < total:
        raise ValueError(f"out holds {out.numel()} elements but the mask needs total={total}.")
    bs = seq_lens.shape[0]
    if total == 0 or bs == 0 or q_len == 0:
        return out
    require_unit_stride("out", out)
    seq_lens, mask_indptr = unit_stride(seq_lens), unit_stride(mask_indptr)
    flat = unit_stride(tree.reshape(-1))  # a strided tree may reshape to a strided view
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    dst = out.view(torch.uint8) if out.dtype == torch.bool else out
    _tree_mask_kernel[(bs, q_len)](seq_lens, flat, mask_indptr, dst, q_len, flat.numel(),
                                   BLOCK=256, num_warps=4)
    return out
