"""The split merge of the MLA kernels (:mod:`.mla`, :mod:`.mla_gluon`,
:mod:`.mla_narrow_gluon`): partial outputs ``o / l`` ``[T, H, S, R]`` (float32, or the
queries' 16-bit dtype: read into float32, an fp16 ±inf as ±65504) and their float32 log2
LSEs ``[T, H, S]``
combined into the rows (and the natural-log LSE): :func:`merge_splits` (a second launch over
``(tokens, heads)``) and :func:`merge_head_block` (the one-launch form: run by the last split
program of a (token, head block) to finish, inside the attention kernel). An fp16 output
is clamped to ±65504 at the store (float32 partials past it would round to inf;
:func:`._softmax.to_output`)."""

from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl

from ._kvutil import next_pow2
from ._launch import Launcher, intern_spec, launch_key, tensor_key
from ._pdl import gdc_launch_dependents, gdc_wait, wait_then_release
from ._softmax import _FP16_MAX  # what an fp16 partial of ±inf is read as (_partial_f32)
from ._softmax import to_output  # the rows' store: an fp16 output clamped to ±65504

__all__ = ["merge_splits", "merge_plan_spec", "merge_head_block"]



@triton.jit
def _partial_f32(o, part_o_ptr):
    """Partial rows ``o`` as loaded from ``part_o_ptr``, in float32. An fp16 partial of ±inf
    is read as ±65504: a partial row is ``Σ p16·v / Σ p`` (p rounded to 16 bits in the p·V
    dot, float32 in the row sum), up to 2^-11 past the convex combination of cache values
    it stands for, so values at fp16's largest finite can round to inf in a 16-bit store
    (the merge then gave inf, or NaN where that split weighs 0); NaN stays NaN."""
    o = o.to(tl.float32)
    if part_o_ptr.dtype.element_ty == tl.float16:
        o = tl.clamp(o, -_FP16_MAX, _FP16_MAX, propagate_nan=tl.PropagateNan.ALL)
    return o


@triton.jit
def _mla_merge_kernel(
    out_ptr, part_o_ptr, part_lse_ptr, lse_ptr,
    stride_ot, stride_oh,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot_lse, stride_oh_lse,
    KV_LORA: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    FIXED_ORDER: tl.constexpr,
    PDL: tl.constexpr = False,
    RELEASE_FIRST: tl.constexpr = False,
):
    if RELEASE_FIRST:  # the next launch may start before this one waits (``_pdl``'s
        # ``"early"``: it reads only what no kernel of this step writes before its own wait,
        # which returns after this merge, so after the attention kernel too)
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:  # launched while the attention kernel runs: its partials first
        wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < KV_LORA
    lse_base = part_lse_ptr + t * stride_lt + h * stride_lh
    o_base = part_o_ptr + t * stride_pt + h * stride_ph + offs_dv
    if FIXED_ORDER:
        # batch-invariant: split by split in index order (trailing empty splits add exact
        # zeros, so the number launched does not change the bits)
        m = tl.load(lse_base)
        for s in tl.static_range(1, NUM_SPLITS):
            m = tl.maximum(m, tl.load(lse_base + s))
        m = tl.where(m == float("-inf"), 0.0, m)
        den = tl.zeros([1], tl.float32).sum(0)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for s in tl.static_range(0, NUM_SPLITS):
            w_s = tl.exp2(tl.load(lse_base + s) - m)
            den += w_s
            acc += _partial_f32(tl.load(o_base + s * stride_ps, mask=mask_dv, other=0.0),
                                part_o_ptr) * w_s
        res = acc / tl.where(den > 0, den, 1.0)
    else:
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < NUM_SPLITS
        lse = tl.load(lse_base + offs_s, mask=mask_s, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
        o = _partial_f32(tl.load(o_base[None, :] + offs_s[:, None] * stride_ps,
                                 mask=mask_s[:, None] & mask_dv[None, :], other=0.0), part_o_ptr)
        den = tl.sum(w, axis=0)
        res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_dv,
             to_output(res, out_ptr), mask=mask_dv)
    if WRITE_LSE:  # splits' log2 LSEs merged, in index order; natural log out
        lse_out = tl.where(den > 0, (m + tl.log2(tl.where(den > 0, den, 1.0))) / 1.4426950408889634,
                           float("-inf"))
        tl.store(lse_ptr + t * stride_ot_lse + h * stride_oh_lse, lse_out)


@triton.jit
def merge_head_block(out_ptr, part_o_ptr, part_lse_ptr, lse_ptr, t, offs_h, mask_h, offs_dv,
                     mask_dv, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt,
                     stride_lh, stride_ot_lse, stride_oh_lse, BLOCK_H: tl.constexpr,
                     BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr, WRITE_LSE: tl.constexpr,
                     lse_owner=True):
    """The merge of one token's head block (``offs_h`` ``[BLOCK_H]``, ``t`` int64) from its
    ``NUM_SPLITS`` partials, in split order (the same bits whichever split runs it), over
    the columns ``offs_dv`` (``[BLOCK_DV]``: all of them, or one program's slice). The
    partials were written by other programs of this launch: they are read through L2
    (``.cg``), after the caller's acquiring count. ``lse_owner``: this program writes the
    merged LSE (one of the programs sharing a head block's slices)."""
    lse_base = part_lse_ptr + t * stride_lt + offs_h * stride_lh
    o_base = part_o_ptr + t * stride_pt + offs_h[:, None] * stride_ph + offs_dv[None, :]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(lse_base + s, mask=mask_h, other=float("-inf"),
                                  cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    o_mask = mask_h[:, None] & mask_dv[None, :]
    for s in tl.static_range(NUM_SPLITS):
        w = tl.exp2(tl.load(lse_base + s, mask=mask_h, other=float("-inf"),
                            cache_modifier=".cg") - m)  # empty splits weigh 0
        den += w
        acc += _partial_f32(tl.load(o_base + s * stride_ps, mask=o_mask, other=0.0,
                                    cache_modifier=".cg"), part_o_ptr) * w[:, None]
    has = den > 0
    res = acc / tl.where(has, den, 1.0)[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_dv[None, :],
             to_output(res, out_ptr), mask=o_mask)
    if WRITE_LSE:  # natural log
        lse_out = tl.where(has, (m + tl.log2(tl.where(has, den, 1.0))) / 1.4426950408889634,
                           float("-inf"))
        tl.store(lse_ptr + t * stride_ot_lse + offs_h * stride_oh_lse, lse_out,
                 mask=mask_h & lse_owner)


def merge_plan_spec(part_o, part_lse, rank: int, block_dv: int, *, fixed_order: bool = False,
                    **pdl) -> int:
    """The interned id (:func:`._launch.intern_spec`) of what a plan fixes of
    :func:`merge_splits`' specialisation (the partials, their strides, the sizes, the order
    and the PDL keywords): made once per plan, passed as ``planned=``."""
    return intern_spec(("mla-merge", tensor_key(part_o), part_o.stride()[:3],
                        tensor_key(part_lse), part_lse.stride()[:2], tuple(part_lse.shape),
                        int(rank), int(block_dv), bool(fixed_order),
                        tuple(sorted(pdl.items()))))


def merge_splits(out, part_o, part_lse, lse, rank: int, block_dv: int, *,
                 fixed_order: bool = False, planned: Optional[int] = None, **pdl) -> None:
    """Launch the merge over ``(tokens, heads)`` programs: ``out`` ``[T, H, R]`` from
    ``part_o`` / ``part_lse`` (``lse``: optional float32 ``[T, H]`` output);
    ``fixed_order``: batch-invariant (split by split, in index order); ``pdl``: the
    launch's programmatic-dependent-launch keywords (``_pdl.pdl_kwargs``); ``planned``:
    :func:`merge_plan_spec` of the same partials, sizes, order and keywords, so that the
    launch key is the output's few values and a launched key skips the constexprs.

    16-bit partials always merge split by split: their ``[splits, R]`` tile puts the splits
    across warps, so the tiled form's sum over splits goes through shared memory (H100,
    16 heads 64x4k, 4 splits: 6.5 µs against 2.0 split by split; float32 partials 2.5 either
    way; ``benchmarks/mla_time_split.py --merge-fixed``, docs/benchmarks.md)."""
    t, h, splits = part_lse.shape
    os_, po, pl = out.stride(), part_o.stride(), part_lse.stride()
    ls = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    args = (out, part_o, part_lse, lse if lse is not None else part_lse, os_[0], os_[1],
            po[0], po[1], po[2], pl[0], pl[1], *ls)
    key = None
    if planned is not None:
        key = (planned, tensor_key(out), os_[0], os_[1],
               None if lse is None else (tensor_key(lse), *ls))
        if _MERGE.launch_cached((t, h), args, key):
            return
    fixed_order = fixed_order or part_o.element_size() < 4
    kw = dict(KV_LORA=rank, BLOCK_DV=block_dv, NUM_SPLITS=splits,
              BLOCK_S=max(2, next_pow2(splits)), WRITE_LSE=lse is not None,
              FIXED_ORDER=fixed_order, num_warps=4, **pdl)
    _MERGE.launch((t, h), args, kw, key if key is not None else launch_key(args, kw))


#: the merge's launches (direct once compiled, ``launch_pdl`` included: it is part of the
#: compiled kernel's metadata; :mod:`._launch`)
_MERGE = Launcher(_mla_merge_kernel)
