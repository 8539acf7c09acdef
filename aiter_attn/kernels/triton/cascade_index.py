"""The cascade grouping (:func:`aiter_attn.kernels.cascade_plan.plan_cascade_index`) in three
Triton launches instead of ~90 small torch ops: the plan's host cost on the GPU.

1. ``_links_kernel`` (one program per request): ``links[b]``, the leading non-null page ids
   rows ``b`` and ``b − 1`` share within both requests' prefix pages (first mismatch).
2. ``_runs_kernel`` (one program): run starts, the runs' shared pages (a segmented min scan
   of the links), leaders and last members (scans), the per-run tile counts and the tile
   table ``[num_tiles, 4]`` (each tile's run found by counting cumulative tile ends).
3. ``_own_kernel`` (one program per request): the row shifted by its run's shared pages, the
   own ``seqused_k``, and its tokens' positions and shared lengths.

Same outputs as the torch planner (``tests/test_cascade_plan.py`` checks them against each
other and the host oracle); no host reads, so CUDA-graph safe.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...validation import unit_stride
from ..cascade_plan import CascadeIndex, num_tiles_bound
from ._kvutil import next_pow2

__all__ = ["plan_cascade_index_triton"]

_BIG = tl.constexpr(1 << 30)


@triton.jit
def _segmin(f1, v1, f2, v2):
    # segmented min: a set flag starts a new segment
    return f1 | f2, tl.where(f2 != 0, v2, tl.minimum(v1, v2))


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _links_kernel(BT, SeqK, CuQ, Links, stride_bt, width,
                  PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    if b == 0:
        tl.store(Links, 0)
        return
    l1 = tl.load(SeqK + b).to(tl.int32)
    l0 = tl.load(SeqK + b - 1).to(tl.int32)
    c0 = tl.load(CuQ + b - 1).to(tl.int32)
    c1 = tl.load(CuQ + b).to(tl.int32)
    c2 = tl.load(CuQ + b + 1).to(tl.int32)
    p1 = tl.maximum(l1 - (c2 - c1), 0) // PAGE_SIZE
    p0 = tl.maximum(l0 - (c1 - c0), 0) // PAGE_SIZE
    limit = tl.minimum(tl.minimum(p0, p1), width)
    row1 = BT + b.to(tl.int64) * stride_bt
    row0 = row1 - stride_bt
    first_bad = limit
    for w0 in range(0, limit, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        m = cols < limit
        x = tl.load(row1 + cols, mask=m, other=0)
        y = tl.load(row0 + cols, mask=m, other=0)
        bad = m & ((x != y) | (x == 0))
        first_bad = tl.minimum(first_bad, tl.min(tl.where(bad, cols, limit), 0))
    tl.store(Links + b, first_bad)


@triton.jit
def _runs_kernel(Links, CuQ, SharedPages, Scratch, Tiles, bs, num_tiles, need,
                 PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr,
                 BLOCK_TILE: tl.constexpr):
    offs = tl.arange(0, BLOCK_B)
    valid = offs < bs
    links = tl.load(Links + offs, mask=valid, other=0)
    linked = valid & (offs > 0) & (links >= need)
    start = valid & (linked == 0)
    links_next = tl.load(Links + offs + 1, mask=offs + 1 < bs, other=0)
    is_end = valid & ((offs + 1 >= bs) | (links_next < need))
    # a run's shared pages: min of its links (a singleton's is _BIG: none)
    _, seg = tl.associative_scan((start.to(tl.int32), tl.where(linked, links, _BIG)), 0,
                                 _segmin)
    last = tl.associative_scan(tl.where(is_end, offs, _BIG), 0, _min2, reverse=True)
    leader = tl.associative_scan(tl.where(start, offs, 0), 0, _max2)
    last = tl.minimum(last, bs - 1)
    tl.store(Scratch + 3 * bs + offs, seg, mask=valid)
    tl.debug_barrier()
    run_pages = tl.load(Scratch + 3 * bs + last, mask=valid, other=_BIG)
    sp = tl.where(valid & (run_pages < _BIG), run_pages, 0)
    tl.store(SharedPages + offs, sp, mask=valid)
    tok0 = tl.load(CuQ + leader, mask=valid, other=0).to(tl.int32)
    tok1 = tl.load(CuQ + last + 1, mask=valid, other=0).to(tl.int32)
    ntile = tl.where(start & (sp > 0), (tok1 - tok0 + BLOCK_T - 1) // BLOCK_T, 0)
    tile_end = tl.cumsum(ntile, 0)
    tl.store(Scratch + offs, tile_end, mask=valid)
    tl.store(Scratch + bs + offs, ntile, mask=valid)
    tl.store(Scratch + 2 * bs + offs, tok1, mask=valid)
    tl.debug_barrier()
    for i0 in range(0, num_tiles, BLOCK_TILE):
        ti = i0 + tl.arange(0, BLOCK_TILE)
        live = ti < num_tiles
        owner = tl.sum(((tile_end[None, :] <= ti[:, None]) & valid[None, :]).to(tl.int32), 1)
        ok = live & (owner < bs)
        g = tl.minimum(owner, bs - 1)
        te = tl.load(Scratch + g, mask=ok, other=0)
        nt = tl.load(Scratch + bs + g, mask=ok, other=0)
        t1 = tl.load(Scratch + 2 * bs + g, mask=ok, other=0)
        s_g = tl.load(SharedPages + g, mask=ok, other=0)
        t0 = tl.load(CuQ + g, mask=ok, other=0).to(tl.int32) + (ti - (te - nt)) * BLOCK_T
        row = Tiles + ti.to(tl.int64) * 4
        tl.store(row, tl.where(ok, t0, 0), mask=live)
        tl.store(row + 1, tl.where(ok, t1, 0), mask=live)
        tl.store(row + 2, tl.where(ok, g, 0), mask=live)
        tl.store(row + 3, tl.where(ok, s_g * PAGE_SIZE, 0), mask=live)


@triton.jit
def _own_kernel(BT, SeqK, CuQ, SharedPages, OwnBT, OwnLen, QPos, TokShared, stride_bt,
                stride_obt, width, PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    sp = tl.load(SharedPages + b)
    kv = tl.load(SeqK + b).to(tl.int32)
    row = BT + b.to(tl.int64) * stride_bt
    orow = OwnBT + b.to(tl.int64) * stride_obt
    for w0 in range(0, width, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        src = cols + sp
        v = tl.load(row + src, mask=(cols < width) & (src < width), other=0)
        tl.store(orow + cols, v, mask=cols < width)
    tl.store(OwnLen + b, kv - sp * PAGE_SIZE)
    t0 = tl.load(CuQ + b).to(tl.int32)
    t1 = tl.load(CuQ + b + 1).to(tl.int32)
    for c0 in range(t0, t1, BLOCK_W):
        t = c0 + tl.arange(0, BLOCK_W)
        m = t < t1
        tl.store(QPos + t, kv - (t1 - t), mask=m)
        tl.store(TokShared + t, tl.zeros([BLOCK_W], tl.int32) + sp * PAGE_SIZE, mask=m)


def plan_cascade_index_triton(block_table, seqused_k, cu_seqlens_q, *, page_size: int,
                              min_shared_pages: int, num_tokens: int, block_t: int,
                              out: dict) -> CascadeIndex:
    """:func:`~aiter_attn.kernels.cascade_plan.plan_cascade_index` in three launches.
    ``out``: buffers from :func:`~aiter_attn.kernels.cascade_plan.cascade_index_buffers`
    (with its ``links`` and ``scratch``)."""
    bs, width = block_table.shape
    n_tiles = num_tiles_bound(num_tokens, bs, block_t)
    own_bt = out["own_block_table"][:bs, :width]
    own_len = out["own_seqused_k"][:bs]
    tiles = out["tiles"][:n_tiles]
    q_pos = out["q_pos"][:num_tokens]
    tok_shared = out["tok_shared"][:num_tokens]
    shared = out["shared_pages"][:bs]
    index = CascadeIndex(own_block_table=own_bt, own_seqused_k=own_len, tiles=tiles,
                         q_pos=q_pos, tok_shared=tok_shared, shared_pages=shared,
                         block_t=block_t)
    if bs == 0:
        tiles.zero_()
        return index
    bt = unit_stride(block_table)
    seqused_k, cu = unit_stride(seqused_k), unit_stride(cu_seqlens_q)
    links = out["links"]
    scratch = out["scratch"]
    block_w = 128 if width > 64 else max(16, next_pow2(width))
    _links_kernel[(bs,)](bt, seqused_k, cu, links, bt.stride(0), width,
                         PAGE_SIZE=page_size, BLOCK_W=block_w, num_warps=4)
    block_b = max(16, next_pow2(bs))
    _runs_kernel[(1,)](links, cu, shared, scratch, tiles, bs, n_tiles,
                       max(int(min_shared_pages), 1), PAGE_SIZE=page_size, BLOCK_T=block_t,
                       BLOCK_B=block_b, BLOCK_TILE=max(8, min(64, 8192 // block_b)),
                       num_warps=4)
    _own_kernel[(bs,)](bt, seqused_k, cu, shared, own_bt, own_len, q_pos, tok_shared,
                       bt.stride(0), own_bt.stride(0), width, PAGE_SIZE=page_size,
                       BLOCK_W=block_w, num_warps=4)
    return index
