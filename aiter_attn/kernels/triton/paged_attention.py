"""Triton paged attention: decode (split-KV / flash-decoding), prefill, extend with a cached
prefix, verify (chain and tree mask), mixed batches — one kernel plus a split reduction.

Math (per request ``b`` with ``L = seqused_k[b]`` keys and ``n`` queries; query ``i`` sits at
absolute position ``p = L - n + i``)::

    s_j   = softmax_scale · k_scale · ks_j · (q · k_j)  (fp8 caches dequantise by the scales)
    s_j  ← c · tanh(s_j / c)                             (soft-cap, c > 0)
    vis_j = j < L ∧ (¬causal ∨ j ≤ p) ∧ p - left ≤ j ≤ p + right ∧ mask[b][i, j]
    o     = v_scale · Σ_j softmax([s_vis, sink])_j · vs_j · v_j  (no value for the sink)

``ks_j``/``vs_j`` are the per-(token, head) scales of key ``j`` (``k_scale_cache`` /
``v_scale_cache``, :mod:`aiter_attn.kv_scales`), 1 without them.

A row with nothing visible and no sink outputs zeros.

Layout of the work: each program owns one KV head, a block of ``BLOCK_Q`` query tokens of one
request and ``HEADS`` query heads of that KV head's group (GQA packing: the
``BLOCK_M = BLOCK_Q·HEADS`` rows share every K/V tile, so K/V are read once per KV head), and
one split of the key range. Keys are visited in tiles of ``BLOCK_N`` tokens; each token's page
comes from ``block_table[pos // page_size]``, so any page size works (a tile inside one page
takes a single page lookup). Tiles wholly visible to every row skip the mask arithmetic; tiles
outside the causal/window range are never visited. With ``num_splits > 1`` each split writes an
unnormalised partial (acc, running max, sum) and ``_reduce_splits_kernel`` merges them (and the
sink). Offsets are int64.

Page lookup: per tile (the default where splits are long), chunked (``PAGE_CHUNK``: a chunk
of tiles' page ids in one load, so the K/V copies pipeline), or carried a tile ahead
(``PAGE_AHEAD``); ``PREFETCH_PAGES`` reads a short split's chunk in the program's first
round trip. ``V_PAIRS`` reads fp8 values as 16-bit column pairs. The options and their
defaults: :mod:`._launch_config`.

The host wrapper reads no tensor values: the grid comes from shapes and the caller's
``max_seqlen_q``/``max_seqlen_k`` hints (static bounds otherwise), so it is CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...types import FP8_DTYPES
from ._kvutil import next_pow2
from ._paging import (fp8_pair_ptrs, load_chunk_pages, prefetch_chunk_pages, split_fp8_pairs,
                      tile_pages_of)
from ._softmax import online_softmax_tile, online_softmax_tile_pairs, tanh, to_output
from ._launch_config import TUNING_OVERRIDES, _cdiv, choose_config
from ._pdl import wait_then_release

__all__ = ["paged_attention_triton", "paged_attention_5d_triton", "reject_reason", "MAX_HEAD_DIM",
           "MAX_GROUP", "TUNING_OVERRIDES"]

MAX_HEAD_DIM = 256
MAX_GROUP = 128
_LOG2E = tl.constexpr(1.4426950408889634)  # logits run in the log2 domain (exp2)
_UNBOUNDED = 1 << 30  # window side "-1": far beyond any context length, no int32 overflow


@triton.jit
def _kv_rows(page, in_page, stride_kp, stride_kt, stride_vp, stride_vt, VX: tl.constexpr,
             FLAT_SLOTS: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1):
    """Element offsets of tokens (``page``, ``in_page``; int64 ``[BLOCK_N]``) in K and V,
    head and head-dim terms excluded. ``VX > 1``: the 5-D shuffled V layout, where token
    ``o`` of a page sits at ``(o // VX) · stride_vt + o % VX``. ``FLAT_SLOTS``: pages are
    ``PAGE_SIZE`` token rows apart (``stride_kp = PAGE_SIZE · stride_kt``, the same for V)
    and every slot index ``page · PAGE_SIZE + in_page`` fits in int32: one widening
    multiply per row instead of two 64-bit ones (the sm_90 build's address arithmetic)."""
    if FLAT_SLOTS:
        slot = (page.to(tl.int32) * PAGE_SIZE + in_page.to(tl.int32)).to(tl.int64)
        return slot * stride_kt, slot * stride_vt
    k_rows = page * stride_kp + in_page * stride_kt
    if VX > 1:
        v_rows = page * stride_vp + (in_page // VX) * stride_vt + in_page % VX
    else:
        v_rows = page * stride_vp + in_page * stride_vt
    return k_rows, v_rows


@triton.jit
def _tile_step(
    acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, k_rows, v_rows, kv_head_off_k, kv_head_off_v,
    Mask, mask_row_off, kv_len, pos, row_valid, left, right, kpos,
    offs_d, offs_dv, d_mask, dv_mask, KSc, VSc, s_rows, v_mul,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CUSTOM_MASK: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TOKEN_SCALES: tl.constexpr, CLAMP_V: tl.constexpr, V_PAIRS: tl.constexpr,
):
    """One key tile: load K ``[D, BLOCK_N]`` / V ``[BLOCK_N, DV]`` at the int64 row offsets
    ``k_rows``/``v_rows`` (token ``kpos``), update the online softmax ``(acc, m_i, l_i)``.

    Logits are kept in the log2 domain (``qk_scale`` includes log2(e)). ``MASKED`` tiles apply
    the length, causal, window and custom masks; unmasked tiles are known to be fully visible.
    ``TOKEN_SCALES``: per-(token, head) scales at ``KSc``/``VSc`` + ``s_rows`` (this KV head's
    offsets) multiply each key's logits (in float32, after the dot) and each value row (in
    float32 with the layer's ``v_mul``, before the dot: the fp16 operand then holds the true
    value, never ``x / layer_scale``; ``CLAMP_V`` saturates it to fp16's range).
    """
    k_ptrs = K + kv_head_off_k + k_rows[None, :] + offs_d[:, None]
    if V_PAIRS:
        # fp8 values as column pairs ([BLOCK_N, DV/2] even and odd halves, two dots; the
        # launch takes this path only when every row offset is a multiple of 16 bytes). The
        # pointers here, the split after the scales: elsewhere the sm_90 build spills more
        v_ptrs = fp8_pair_ptrs(V, kv_head_off_v + v_rows, offs_dv.shape[0])
    else:
        v_ptrs = V + kv_head_off_v + v_rows[:, None] + offs_dv[None, :]
    if MASKED:
        kin = kpos < kv_len
        k = tl.load(k_ptrs, mask=d_mask[:, None] & kin[None, :], other=0.0)
        if V_PAIRS:
            v = tl.load(v_ptrs, mask=kin[:, None], other=0)
        else:
            v = tl.load(v_ptrs, mask=kin[:, None] & dv_mask[None, :], other=0.0)
        if TOKEN_SCALES:
            ks = tl.load(KSc + s_rows, mask=kin, other=0.0)
            vs = tl.load(VSc + s_rows, mask=kin, other=0.0)
    else:
        k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
        if V_PAIRS:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
        if TOKEN_SCALES:
            ks = tl.load(KSc + s_rows)
            vs = tl.load(VSc + s_rows)
    if V_PAIRS:
        v, v_odd = split_fp8_pairs(v, V.dtype.element_ty)
    else:
        v_odd = v
    s = tl.dot(q, k.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
    if TOKEN_SCALES:
        s = s * ks[None, :]
        v = v.to(tl.float32) * (vs * v_mul)[:, None]
        if CLAMP_V:
            v = tl.minimum(tl.maximum(v, -65504.0), 65504.0)
        if V_PAIRS:
            v_odd = v_odd.to(tl.float32) * (vs * v_mul)[:, None]
            if CLAMP_V:
                v_odd = tl.minimum(tl.maximum(v_odd, -65504.0), 65504.0)
    if HAS_SOFTCAP:
        # softcap·tanh(x/softcap) on natural-unit logits, then to the log2 domain
        s = softcap * tanh(s * qk_scale / softcap) * _LOG2E
    else:
        s = s * (qk_scale * _LOG2E)
    if MASKED:
        vis = (kpos[None, :] < kv_len) & row_valid[:, None]
        if CAUSAL:
            vis = vis & (kpos[None, :] <= pos[:, None])
        vis = vis & (kpos[None, :] >= pos[:, None] - left)
        vis = vis & (kpos[None, :] <= pos[:, None] + right)
        if HAS_CUSTOM_MASK:
            mk = tl.load(Mask + mask_row_off[:, None] + kpos[None, :].to(tl.int64),
                         mask=vis, other=0)
            vis = vis & (mk != 0)
        s = tl.where(vis, s, float("-inf"))
    if V_PAIRS:
        return online_softmax_tile_pairs(acc, acc_odd, m_i, l_i, s, v, v_odd, COMPUTE_DTYPE,
                                         DOT_PRECISION)
    acc, m_i, l_i = online_softmax_tile(acc, m_i, l_i, s, v, COMPUTE_DTYPE, DOT_PRECISION)
    return acc, acc_odd, m_i, l_i


@triton.jit
def _tile_page_ids(bt_row, t, t_end, kv_len, offs_n, BLOCK_N: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """Page ids of key tile ``t`` as the block table stores them (int32; the caller widens
    them where it uses them: carried as int64 across the loop, the ids made Triton 3.6 give up
    pipelining it, sm_90 TTGIR): a scalar when the tile lies in one page (``TILE_IN_PAGE``),
    else one per key ``[BLOCK_N]``; 0 for a tile at or past ``t_end`` and for keys at or past
    ``kv_len`` (never a read past the request's pages)."""
    if TILE_IN_PAGE:
        page = tl.load(bt_row + (t * BLOCK_N) // PAGE_SIZE, mask=t < t_end, other=0)
    else:
        kpos = t * BLOCK_N + offs_n
        page = tl.load(bt_row + kpos // PAGE_SIZE, mask=(kpos < kv_len) & (t < t_end),
                       other=0)
    return page


@triton.jit
def _attn_tiles(
    acc, acc_odd, m_i, l_i, q, qk_scale, softcap,
    K, V, bt_row, stride_kp, stride_kt, stride_vp, stride_vt, kv_head_off_k, kv_head_off_v,
    Mask, mask_row_off, kv_len, pos, row_valid, left, right,
    t_start, t_end,
    offs_d, offs_dv, d_mask, dv_mask,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_CUSTOM_MASK: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr, PAGE_CHUNK: tl.constexpr,
    VX: tl.constexpr, KSc, VSc, stride_sp, stride_st, s_head, v_mul,
    TOKEN_SCALES: tl.constexpr, CLAMP_V: tl.constexpr, V_PAIRS: tl.constexpr,
    pre_pages, pre_c0, PREFETCH: tl.constexpr, PAGE_AHEAD: tl.constexpr = False,
    FLAT_SLOTS: tl.constexpr = False,
):
    """Online-softmax update of ``(acc, m_i, l_i)`` over key tiles ``[t_start, t_end)``.

    Page lookup, two ways:

    * ``PAGE_CHUNK == 0``: each tile loads its tokens' pages from the block table. Simple, any
      page size, but the K/V addresses then depend on a load in the same iteration, and
      Triton's software pipeliner issues that tile's K/V copies only one iteration ahead,
      at the end of the previous one (sm_90 TTGIR: ``async_wait {num = 0}`` at the loop top):
      the copy latency is exposed in every iteration.
    * ``PAGE_CHUNK = C > 0`` (page size divides ``BLOCK_N`` or is a multiple of it; unmasked
      tiles): the chunked lookup of :mod:`._paging`, so no load feeds a K/V address inside
      the pipelined loop and the copies run ``NUM_STAGES - 1`` tiles ahead
      (``async_wait {num = 2}`` with 3 stages), as for a dense cache. ``PREFETCH``: the
      chunk starting at tile ``pre_c0`` takes ``pre_pages`` (read at the program's start,
      :func:`._paging.prefetch_chunk_pages`) instead of a load of its own.
    * ``PAGE_AHEAD`` (with ``PAGE_CHUNK == 0``): the per-tile lookup, each tile's page ids
      read during the tile before and carried by the loop (as the MLA kernel does), so the
      pipeliner can issue the K/V copies ahead without a chunk's select-and-sum per tile.
    """
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_CHUNK > 0:
        for c0 in range(t_start, t_end, PAGE_CHUNK):
            n_in = tl.minimum(t_end - c0, PAGE_CHUNK)
            if PREFETCH:
                if c0 == pre_c0:
                    chunk_pages = pre_pages
                else:
                    chunk_pages = load_chunk_pages(bt_row, c0, n_in, kv_len, BLOCK_N,
                                                   PAGE_SIZE, PAGE_CHUNK, TILE_IN_PAGE)
            else:
                chunk_pages = load_chunk_pages(bt_row, c0, n_in, kv_len, BLOCK_N, PAGE_SIZE,
                                               PAGE_CHUNK, TILE_IN_PAGE)
            for j in tl.range(0, n_in, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
                t = c0 + j
                page, in_page = tile_pages_of(chunk_pages, j, t, BLOCK_N, PAGE_SIZE,
                                              PAGE_CHUNK, TILE_IN_PAGE)
                k_rows, v_rows = _kv_rows(page, in_page, stride_kp, stride_kt, stride_vp,
                                          stride_vt, VX, FLAT_SLOTS, PAGE_SIZE)
                s_rows = s_head + page * stride_sp + in_page * stride_st
                acc, acc_odd, m_i, l_i = _tile_step(
                    acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, k_rows, v_rows, kv_head_off_k,
                    kv_head_off_v, Mask, mask_row_off, kv_len, pos, row_valid, left, right,
                    t * BLOCK_N + offs_n, offs_d, offs_dv, d_mask, dv_mask, KSc, VSc, s_rows,
                    v_mul, MASKED, CAUSAL, HAS_SOFTCAP, HAS_CUSTOM_MASK, COMPUTE_DTYPE,
                    DOT_PRECISION, TOKEN_SCALES, CLAMP_V, V_PAIRS)
    else:
        # the per-tile lookup; PAGE_AHEAD: each tile's page ids read during the tile before
        # and carried by the loop, so no load in an iteration feeds its K/V addresses
        page_nxt = 0
        if PAGE_AHEAD:
            page_nxt = _tile_page_ids(bt_row, t_start, t_end, kv_len, offs_n, BLOCK_N,
                                      PAGE_SIZE, TILE_IN_PAGE)
        for t in tl.range(t_start, t_end, num_stages=NUM_STAGES, warp_specialize=WARP_SPEC):
            kpos = t * BLOCK_N + offs_n
            if PAGE_AHEAD:
                page = page_nxt.to(tl.int64)
                page_nxt = _tile_page_ids(bt_row, t + 1, t_end, kv_len, offs_n, BLOCK_N,
                                          PAGE_SIZE, TILE_IN_PAGE)
            elif TILE_IN_PAGE:
                page = tl.load(bt_row + (t * BLOCK_N) // PAGE_SIZE).to(tl.int64)
            elif MASKED:
                page = tl.load(bt_row + kpos // PAGE_SIZE, mask=kpos < kv_len,
                               other=0).to(tl.int64)
            else:
                page = tl.load(bt_row + kpos // PAGE_SIZE).to(tl.int64)
            if TILE_IN_PAGE:
                in_page = ((t * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
            else:
                in_page = (kpos % PAGE_SIZE).to(tl.int64)
            k_rows, v_rows = _kv_rows(page, in_page, stride_kp, stride_kt, stride_vp, stride_vt,
                                      VX, FLAT_SLOTS, PAGE_SIZE)
            s_rows = s_head + page * stride_sp + in_page * stride_st
            acc, acc_odd, m_i, l_i = _tile_step(
                acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, k_rows, v_rows, kv_head_off_k,
                kv_head_off_v, Mask, mask_row_off, kv_len, pos, row_valid, left, right, kpos,
                offs_d, offs_dv, d_mask, dv_mask, KSc, VSc, s_rows, v_mul, MASKED, CAUSAL,
                HAS_SOFTCAP, HAS_CUSTOM_MASK, COMPUTE_DTYPE, DOT_PRECISION, TOKEN_SCALES,
                CLAMP_V, V_PAIRS)
    return acc, acc_odd, m_i, l_i


@triton.jit
def _reduce_rows(O, Lse, PartAcc, PartML, Sinks, row_tok, qh, row_valid, offs_dv, dv_mask,
                 num_splits, stride_ot, stride_oh, stride_ps, stride_pt, stride_mls, stride_mlt,
                 stride_lt, stride_lh, DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 SPLIT_CHUNK: tl.constexpr):
    """The split reduction of ``_reduce_splits_kernel`` for the ``BLOCK_M`` rows
    ``(row_tok, qh)`` of one program (the fused path: run by the last split to finish).

    Partials are read through L2 (``.cg``: other SMs wrote them), many at a time so the
    reduction pays few L2 round trips, not one per split: every split's (max, sum) as one
    ``[SPLITS_PAD, BLOCK_M]`` load, the accumulators ``SPLIT_CHUNK`` splits per
    ``[SPLIT_CHUNK, BLOCK_M, DV_PAD]`` load. Chunks add in index order (deterministic)."""
    ml0 = PartML + row_tok * stride_mlt + qh.to(tl.int64) * 2  # [BLOCK_M]
    offs_s = tl.arange(0, SPLITS_PAD)
    ml_all = ml0[None, :] + offs_s.to(tl.int64)[:, None] * stride_mls
    ml_mask = (offs_s < num_splits)[:, None] & row_valid[None, :]
    m_all = tl.load(ml_all, mask=ml_mask, other=float("-inf"), cache_modifier=".cg")
    l_all = tl.load(ml_all + 1, mask=ml_mask, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_all, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + qh, mask=row_valid, other=float("-inf")).to(tl.float32) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(l_all * tl.exp2(m_all - m_safe[None, :]), 0)
    # [SPLIT_CHUNK, BLOCK_M, DV_PAD] addressing of the accumulators of splits c .. c+CHUNK-1
    offs_c = tl.arange(0, SPLIT_CHUNK)
    acc0 = PartAcc + (row_tok * stride_pt + qh.to(tl.int64) * DV_PAD)[None, :, None] \
        + offs_dv[None, None, :] + offs_c.to(tl.int64)[:, None, None] * stride_ps
    ml_c0 = ml0[None, :] + offs_c.to(tl.int64)[:, None] * stride_mls
    o = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    row_dv = row_valid[:, None] & dv_mask[None, :]
    for c in range(0, num_splits, SPLIT_CHUNK):  # pointers advance: no int32 c·stride
        live = (offs_c + c) < num_splits
        m_c = tl.load(ml_c0, mask=live[:, None] & row_valid[None, :], other=float("-inf"),
                      cache_modifier=".cg")
        a_c = tl.load(acc0, mask=live[:, None, None] & row_dv[None, :, :], other=0.0,
                      cache_modifier=".cg")
        ml_c0 += SPLIT_CHUNK * stride_mls
        acc0 += SPLIT_CHUNK * stride_ps
        w_c = tl.exp2(m_c - m_safe[None, :])
        o += tl.sum(a_c * w_c[:, :, None], 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    safe = tl.where(denom > 0.0, denom, 1.0)
    o = o / safe[:, None]
    o_rows = row_tok * stride_ot + qh.to(tl.int64) * stride_oh
    tl.store(O + o_rows[:, None] + offs_dv[None, :], to_output(o, O), mask=row_dv)
    if WRITE_LSE:
        lse = tl.where(denom > 0.0, (m_safe + tl.log2(safe)) / _LOG2E, float("-inf"))
        tl.store(Lse + row_tok * stride_lt + qh.to(tl.int64) * stride_lh, lse, mask=row_valid)


# num_seqs unspecialised: Triton would make a batch of 1 a constant, and the 1x32k split
# decode build then took 178 registers instead of 168 (two programs per SM, not three)
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attn_kernel(
    Q, K, V, O, PartAcc, PartML, Lse, Counters,
    CuQ, SeqK, BlockTable, Sinks, KScale, VScale, KSc, VSc, Mask, MaskIndptr,
    sm_scale, softcap, left, right, num_seqs, q_blocks_per_seq, num_splits, split_tiles,
    stride_qt, stride_qh,
    stride_kp, stride_kt, stride_kh, stride_kd,
    stride_vp, stride_vt, stride_vh, stride_vd,
    stride_sp, stride_st, stride_sh,
    stride_ot, stride_oh,
    stride_bt,
    stride_ps, stride_pt, stride_mls, stride_mlt, stride_lt, stride_lh,
    # last: placed among the ints above, the same PTX went through ptxas as 178 registers
    # instead of 168 at 8x64k / 16x4k decode (two programs per SM instead of three; H200
    # 4.28 -> 2.97 TB/s). tests/test_triton_pipelining.py guards the count.
    bt_width,
    GROUP: tl.constexpr, HEADS: tl.constexpr, NUM_HCHUNKS: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, TILE_IN_PAGE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_CUSTOM_MASK: tl.constexpr,
    SEARCH_SEQ: tl.constexpr, SPLIT: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, CLAMP_Q: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPEC: tl.constexpr, PAGE_CHUNK: tl.constexpr,
    KX: tl.constexpr, VX: tl.constexpr, WRITE_LSE: tl.constexpr, FIXED_SPLITS: tl.constexpr,
    FUSED_REDUCE: tl.constexpr, TOKEN_SCALES: tl.constexpr, PDL: tl.constexpr = False,
    SPLITS_PAD: tl.constexpr = 1, SPLIT_CHUNK: tl.constexpr = 1, V_PAIRS: tl.constexpr = False,
    PREFETCH_PAGES: tl.constexpr = False, PAGE_AHEAD: tl.constexpr = False,
    FLAT_SLOTS: tl.constexpr = False,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes first
        wait_then_release()
    # longest causal q-blocks (latest positions) first: better tail balance in prefill
    pid_q = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_h = tl.program_id(1)
    split = tl.program_id(2)
    kvh = pid_h // NUM_HCHUNKS
    hchunk = pid_h % NUM_HCHUNKS

    # --- which request and query block --------------------------------------------------
    if SEARCH_SEQ:
        # q-block starts are cu_seqlens_q[b] // BLOCK_Q + b (an upper bound on the blocks
        # before b); binary-search the last b whose start is ≤ pid_q.
        lo = 0
        hi = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            start = tl.load(CuQ + mid) // BLOCK_Q + mid
            if start <= pid_q:
                lo = mid + 1
            else:
                hi = mid
        b = lo - 1
        qb = pid_q - (tl.load(CuQ + b) // BLOCK_Q + b)
    else:
        b = pid_q // q_blocks_per_seq
        qb = pid_q % q_blocks_per_seq
    q_start = tl.load(CuQ + b)
    q_end = tl.load(CuQ + b + 1)
    # before the early exit, so that its load goes out with cu_seqlens_q's (one global round
    # trip before the block-table reads, not two: the sm_90 PTX keeps loads after a branch)
    kv_len = tl.load(SeqK + b)
    if PREFETCH_PAGES:
        # split decode: the page ids of this split's first chunk if the request is as long
        # as the plan's longest (split_tiles = that request's tiles per split), read in the
        # same round trip; used only where the guess holds (see _attn_tiles)
        pre_c0 = split * split_tiles
        pre_pages = prefetch_chunk_pages(
            BlockTable + b.to(tl.int64) * stride_bt, pre_c0,
            tl.minimum(split_tiles, PAGE_CHUNK), bt_width, BLOCK_N, PAGE_SIZE, PAGE_CHUNK,
            TILE_IN_PAGE)
    else:
        pre_c0 = -1
        pre_pages = 0
    q_len = q_end - q_start
    if qb * BLOCK_Q >= q_len:
        return

    # --- rows: (query token, query head of this KV head's group) --------------------------
    rows = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + rows // HEADS
    hg = hchunk * HEADS + rows % HEADS
    row_valid = (rows < BLOCK_Q * HEADS) & (tok < q_len) & (hg < GROUP)
    qh = kvh * GROUP + hg
    pos = kv_len - q_len + tok
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    # head-dim offsets in the cache: NHD (KX = 1, stride_kd = 1) or the 5-D K layout, where
    # dim d sits at (d // KX) · stride_kd + d % KX; V: d · stride_vd (1, or the 5-D strides)
    if KX > 1:
        k_doff = (offs_d // KX) * stride_kd + offs_d % KX
    else:
        k_doff = offs_d
    v_doff = offs_dv * stride_vd
    q_rows = (q_start + tok).to(tl.int64) * stride_qt + qh.to(tl.int64) * stride_qh
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if CLAMP_Q:
        # bf16 queries on an fp8 cache compute in fp16 (e4m3/e5m2 -> f16 is one cvt per pair,
        # -> bf16 needs another per element): saturate instead of overflowing to inf
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0)
    q = q.to(COMPUTE_DTYPE)

    qk_scale = sm_scale
    v_mul = 1.0
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(KScale).to(tl.float32)
        if TOKEN_SCALES:  # the layer's v scale rides on each value row's own scale
            v_mul = tl.load(VScale).to(tl.float32)

    # --- key range: what any row sees, and what every row sees ---------------------------
    q_last = tl.minimum(qb * BLOCK_Q + BLOCK_Q, q_len) - 1
    p_lo = kv_len - q_len + qb * BLOCK_Q
    p_hi = kv_len - q_len + q_last
    lo = tl.maximum(p_lo - left, 0)
    hi = tl.minimum(kv_len, p_hi + right + 1)
    full_lo = tl.maximum(p_hi - left, 0)
    full_hi = tl.minimum(kv_len, p_lo + right + 1)
    if CAUSAL:
        hi = tl.minimum(hi, p_hi + 1)
        full_hi = tl.minimum(full_hi, p_lo + 1)
    t_lo = lo // BLOCK_N
    t_hi = tl.maximum(tl.cdiv(hi, BLOCK_N), t_lo)
    if HAS_CUSTOM_MASK:
        tf_lo = t_lo
        tf_hi = t_lo
    else:
        tf_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK_N), t_lo), t_hi)
        tf_hi = tl.maximum(tl.minimum(full_hi // BLOCK_N, t_hi), tf_lo)
    if FIXED_SPLITS:
        # batch-invariant: split s owns the absolute tiles [s·split_tiles, (s+1)·split_tiles)
        # (the last launched split also whatever lies past it); a request's boundaries are
        # its own, whatever the batch launched
        s_lo = tl.maximum(split * split_tiles, t_lo)
        s_hi = tl.minimum(split * split_tiles + split_tiles, t_hi)
        if split == num_splits - 1:
            s_hi = t_hi
    elif SPLIT:
        per_split = tl.cdiv(t_hi - t_lo, num_splits)
        s_lo = t_lo + split * per_split
        s_hi = tl.minimum(s_lo + per_split, t_hi)
    else:
        s_lo = t_lo
        s_hi = t_hi

    bt_row = BlockTable + b.to(tl.int64) * stride_bt
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    s_head = kvh.to(tl.int64) * stride_sh
    if HAS_CUSTOM_MASK:
        mask_row_off = tl.load(MaskIndptr + b).to(tl.int64) + tok.to(tl.int64) * kv_len
    else:
        mask_row_off = tok.to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS and not SPLIT:
        # the sink is one more logit with no value: start the running max/sum with it
        m_i = tl.load(Sinks + qh, mask=row_valid, other=float("-inf")).to(tl.float32) * _LOG2E
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    if V_PAIRS:  # even / odd value columns (see _tile_step)
        acc = tl.zeros([BLOCK_M, DV_PAD // 2], tl.float32)
        acc_odd = tl.zeros([BLOCK_M, DV_PAD // 2], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
        acc_odd = tl.zeros([BLOCK_M, 16], tl.float32)  # unused

    # masked head, unmasked middle, masked tail — each clipped to this split's tiles
    acc, acc_odd, m_i, l_i = _attn_tiles(
        acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, bt_row, stride_kp, stride_kt, stride_vp,
        stride_vt, k_head, v_head, Mask, mask_row_off, kv_len, pos, row_valid, left, right,
        s_lo, tl.minimum(tf_lo, s_hi), k_doff, v_doff, d_mask, dv_mask,
        PAGE_SIZE, BLOCK_N, TILE_IN_PAGE, True, CAUSAL, HAS_SOFTCAP, HAS_CUSTOM_MASK,
        COMPUTE_DTYPE, DOT_PRECISION, NUM_STAGES, False, 0, VX, KSc, VSc, stride_sp, stride_st,
        s_head, v_mul, TOKEN_SCALES, CLAMP_Q, V_PAIRS, 0, -1, False, False, FLAT_SLOTS)
    acc, acc_odd, m_i, l_i = _attn_tiles(
        acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, bt_row, stride_kp, stride_kt, stride_vp,
        stride_vt, k_head, v_head, Mask, mask_row_off, kv_len, pos, row_valid, left, right,
        tl.maximum(tf_lo, s_lo), tl.minimum(tf_hi, s_hi), k_doff, v_doff, d_mask, dv_mask,
        PAGE_SIZE, BLOCK_N, TILE_IN_PAGE, False, CAUSAL, HAS_SOFTCAP, HAS_CUSTOM_MASK,
        COMPUTE_DTYPE, DOT_PRECISION, NUM_STAGES, WARP_SPEC, PAGE_CHUNK, VX, KSc, VSc, stride_sp,
        stride_st, s_head, v_mul, TOKEN_SCALES, CLAMP_Q, V_PAIRS, pre_pages, pre_c0,
        PREFETCH_PAGES, PAGE_AHEAD, FLAT_SLOTS)
    acc, acc_odd, m_i, l_i = _attn_tiles(
        acc, acc_odd, m_i, l_i, q, qk_scale, softcap, K, V, bt_row, stride_kp, stride_kt, stride_vp,
        stride_vt, k_head, v_head, Mask, mask_row_off, kv_len, pos, row_valid, left, right,
        tl.maximum(tf_hi, s_lo), s_hi, k_doff, v_doff, d_mask, dv_mask,
        PAGE_SIZE, BLOCK_N, TILE_IN_PAGE, True, CAUSAL, HAS_SOFTCAP, HAS_CUSTOM_MASK,
        COMPUTE_DTYPE, DOT_PRECISION, NUM_STAGES, False, 0, VX, KSc, VSc, stride_sp, stride_st,
        s_head, v_mul, TOKEN_SCALES, CLAMP_Q, V_PAIRS, 0, -1, False, False, FLAT_SLOTS)
    if V_PAIRS:  # interleave the columns back: [BLOCK_M, DV/2, 2] -> [BLOCK_M, DV]
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_M, DV_PAD])

    if HAS_SCALES:
        if not TOKEN_SCALES:
            acc = acc * tl.load(VScale).to(tl.float32)
    out_mask = row_valid[:, None] & dv_mask[None, :]
    if SPLIT:
        part_rows = split.to(tl.int64) * stride_ps + (q_start + tok).to(tl.int64) * stride_pt \
            + qh.to(tl.int64) * DV_PAD
        tl.store(PartAcc + part_rows[:, None] + offs_dv[None, :], acc, mask=out_mask)
        ml_rows = split.to(tl.int64) * stride_mls + (q_start + tok).to(tl.int64) * stride_mlt \
            + qh.to(tl.int64) * 2
        tl.store(PartML + ml_rows, m_i, mask=row_valid)
        tl.store(PartML + ml_rows + 1, l_i, mask=row_valid)
        if FUSED_REDUCE:
            # one launch: the last split of this (q-block, head-chunk) tile to finish reduces
            # it. A per-tile counter (zero before the launch, zero again after it) counts the
            # finished splits; the barrier and the acq_rel atomic order every thread's partial
            # stores before the count, and the last program's reads after it.
            tl.debug_barrier()
            cidx = tl.program_id(0) * tl.num_programs(1) + pid_h
            done = tl.atomic_add(Counters + cidx, 1, sem="acq_rel")
            if done == num_splits - 1:
                _reduce_rows(O, Lse, PartAcc, PartML, Sinks, (q_start + tok).to(tl.int64), qh,
                             row_valid, offs_dv, dv_mask, num_splits, stride_ot, stride_oh,
                             stride_ps, stride_pt, stride_mls, stride_mlt, stride_lt,
                             stride_lh, DV_PAD, BLOCK_M, HAS_SINKS, WRITE_LSE, SPLITS_PAD,
                             SPLIT_CHUNK)
                tl.atomic_xchg(Counters + cidx, 0, sem="relaxed")
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_ot + qh.to(tl.int64) * stride_oh
        tl.store(O + o_rows[:, None] + offs_dv[None, :], to_output(o, O), mask=out_mask)
        if WRITE_LSE:
            # natural-log LSE of the visible logits (and the sink); -inf with nothing visible
            lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) / _LOG2E, float("-inf"))
            lse_rows = (q_start + tok).to(tl.int64) * stride_lt + qh.to(tl.int64) * stride_lh
            tl.store(Lse + lse_rows, lse, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    O, PartAcc, PartML, Sinks, Lse, num_splits,
    stride_ot, stride_oh, stride_ps, stride_pt, stride_mls, stride_mlt, stride_lt, stride_lh,
    DV: tl.constexpr, DV_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
    WRITE_LSE: tl.constexpr, FIXED_ORDER: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge split partials of one (token, head): ``o = Σ_s 2^{m_s - M} acc_s / Σ_s 2^{m_s - M} l_s``
    with the sink as one more term of the denominator (no atomics); ``WRITE_LSE``:
    ``lse = ln 2 · (M + log2 denom)``, ``-inf`` when empty. ``FIXED_ORDER``
    (batch-invariant): the sums run split by split in index order, so splits past a request's
    keys (exact zeros) leave its bits unchanged whatever number of splits was launched.
    ``PDL``: launched while the attention kernel runs; waits for its partials first."""
    if PDL:
        wait_then_release()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_dv = tl.arange(0, DV_PAD)
    dv_mask = offs_dv < DV
    ml_base = PartML + t * stride_mlt + h * 2
    acc_base = PartAcc + t * stride_pt + h * DV_PAD + offs_dv
    if FIXED_ORDER:
        m_max = tl.load(ml_base)
        ml_ptr = ml_base
        for _ in range(1, num_splits):
            ml_ptr += stride_mls
            m_max = tl.maximum(m_max, tl.load(ml_ptr))
    else:
        offs_s = tl.arange(0, SPLITS_PAD)
        s_mask = offs_s < num_splits
        ml_ptrs = ml_base + offs_s.to(tl.int64) * stride_mls
        m = tl.load(ml_ptrs, mask=s_mask, other=float("-inf"))
        l = tl.load(ml_ptrs + 1, mask=s_mask, other=0.0)
        # the accumulators too, before the max's cross-warp reduction (a CTA barrier, which
        # later loads cannot cross): every read in one round trip
        acc_ptrs = acc_base[None, :] + offs_s.to(tl.int64)[:, None] * stride_ps
        acc = tl.load(acc_ptrs, mask=s_mask[:, None] & dv_mask[None, :], other=0.0)
        m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    if FIXED_ORDER:
        denom = tl.zeros([1], tl.float32).sum(0)
        o = tl.zeros([DV_PAD], tl.float32)
        ml_ptr = ml_base
        acc_ptr = acc_base
        for _ in range(0, num_splits):  # pointers advance: no int32 split·stride products
            w_s = tl.exp2(tl.load(ml_ptr) - m_safe)
            denom += tl.load(ml_ptr + 1) * w_s
            o += tl.load(acc_ptr, mask=dv_mask, other=0.0) * w_s
            ml_ptr += stride_mls
            acc_ptr += stride_ps
    else:
        w = tl.exp2(m - m_safe)
        denom = tl.sum(l * w, 0)
        o = tl.sum(acc * w[:, None], 0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m_safe)
    o = o / tl.where(denom > 0.0, denom, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + offs_dv, to_output(o, O), mask=dv_mask)
    if WRITE_LSE:
        lse = tl.where(denom > 0.0, (m_safe + tl.log2(tl.where(denom > 0.0, denom, 1.0))) / _LOG2E,
                       float("-inf"))
        tl.store(Lse + t * stride_lt + h * stride_lh, lse)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _supported_kv_dtypes() -> set:
    kv = {torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2}
    if torch.version.hip is not None:  # the fnuz fp8 formats exist in Triton only on AMD
        kv |= {torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}
    return kv


def reject_reason(request) -> Optional[str]:
    """Registry predicate: why the Triton kernel cannot serve ``request`` (or ``None``)."""
    extra = dict(request.extra)
    hq, hkv = extra.get("q_heads"), extra.get("kv_heads")
    if hq and hkv and hq // hkv > MAX_GROUP:
        return f"GQA group {hq // hkv} > {MAX_GROUP} query heads per KV head"
    if request.kv_dtype is not None and request.kv_dtype not in _supported_kv_dtypes():
        return f"kv dtype {request.kv_dtype} is not supported by Triton on this platform"
    return None


def check_call_tensors(q, num_kv_heads: int, out, *, sinks=None, lse=None) -> None:
    """The per-call tensors of a functional call (``ops.paged_attention`` checks the same):
    query heads in whole groups of the KV heads, ``out`` ``[T, Hq, Dv]``, ``sinks`` ``[Hq]``
    and ``lse`` float32 ``[T, Hq]``. The launch reads and writes them by these shapes without a
    bound (a short ``sinks`` was read past its end, a small ``lse`` written past its end)."""
    t, hq, hkv = q.shape[0], q.shape[1], num_kv_heads
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hkv}; GQA "
                         "needs whole groups of query heads per KV head.")
    if out.dim() != 3 or tuple(out.shape[:2]) != (t, hq):
        raise ValueError(f"out has shape {tuple(out.shape)}; expected [{t}, {hq}, head_dim_v] "
                         "(num_tokens, num_q_heads, head_dim_v).")
    if sinks is not None and (sinks.dim() != 1 or sinks.shape[0] != hq):
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}; expected ({hq},), one logit "
                         "per query head.")
    if lse is not None and (lse.dtype != torch.float32 or tuple(lse.shape) != (t, hq)):
        raise ValueError(f"lse is {lse.dtype} {tuple(lse.shape)}; expected float32 "
                         f"[{t}, {hq}] (num_tokens, num_q_heads).")


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale=None,
    v_scale=None,
    custom_mask: Optional[torch.Tensor] = None,
    mask_indptr: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    lse: Optional[torch.Tensor] = None,
    batch_invariant: bool = False,
    k_scale_cache: Optional[torch.Tensor] = None,
    v_scale_cache: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Paged attention with the contract of ``ops.paged_attention`` (see the module docstring).

    Shapes: q ``[T, Hq, D]``; caches ``[pages, page_size, Hkv, D|Dv]`` (last dim contiguous);
    cu_seqlens_q int32 ``[B+1]``; seqused_k int32 ``[B]``; block_table int32 ``[B, W]``;
    out ``[T, Hq, Dv]``. ``k_scale``/``v_scale``: float or scalar tensor (device tensors are
    read in the kernel; pass them on the device for graph capture). ``max_seqlen_q`` must be
    an upper bound of every request's query count (it sizes the grid; under CUDA-graph replay
    the captured value must still bound the replayed batch); ``max_seqlen_k`` only steers the
    split count. Without them static bounds are used (``T`` and ``W · page_size``). No host
    synchronisation; no allocation other than the split partials. ``lse``: optional float32
    ``[T, Hq]`` that also receives the natural-log LSE per (token, head), sinks included
    (``-inf`` for a fully masked row). ``batch_invariant``: each row's bits independent of the
    rest of the batch and of the hints (fixed tiles, fixed-size splits, fixed-order reduction;
    see :mod:`._launch_config`). ``k_scale_cache``/``v_scale_cache``: float32
    ``[pages, page_size, Hkv]`` per-(token, head) scales of an fp8 cache, on top of the layer
    scales (:mod:`aiter_attn.kv_scales`).
    """
    from .attention import TritonPagedAttention, invariant_request

    check_call_tensors(q, k_cache.shape[2], out, sinks=sinks, lse=lse)  # NHD pages
    kernel = TritonPagedAttention(invariant_request(
        TritonPagedAttention.request_for(q, k_cache, v_cache), batch_invariant))
    kernel.name = "triton"
    return kernel(q, k_cache, v_cache, out, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                  block_table=block_table, softmax_scale=softmax_scale, causal=causal,
                  window_size=window_size, softcap=softcap, sinks=sinks, k_scale=k_scale,
                  v_scale=v_scale, custom_mask=custom_mask, mask_indptr=mask_indptr,
                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, lse=lse,
                  k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)


def paged_attention_5d_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    **kwargs,
) -> torch.Tensor:
    """``paged_attention_5d`` (the vectorised 5-D layout, see
    :mod:`aiter_attn.kernels.reference_5d`) with the same kernel: only the cache addressing
    differs. k_cache ``[pages, Hkv, D // x, page_size, x]``; v_cache shuffled
    ``[pages, Hkv, page_size // x, Dv, x]`` or hd_page ``[pages, Hkv, Dv, page_size]``.
    Keyword arguments as :func:`paged_attention_triton`.
    """
    from .attention import TritonPagedAttention5D, invariant_request

    # k_cache [pages, Hkv, D // x, page_size, x]
    check_call_tensors(q, k_cache.shape[1], out, sinks=kwargs.get("sinks"),
                       lse=kwargs.get("lse"))
    kernel = TritonPagedAttention5D(invariant_request(
        TritonPagedAttention5D.request_for(q, k_cache, v_cache),
        kwargs.pop("batch_invariant", False)))
    kernel.name = "triton"
    return kernel(q, k_cache, v_cache, out, **kwargs)
