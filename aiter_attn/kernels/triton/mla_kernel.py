"""The Triton absorbed-MLA kernel (:func:`_mla_fwd_kernel`), planned and launched by
:mod:`.mla`.

Math (per query token ``t`` of request ``b``, head ``h``; ``R = kv_lora_rank``)::

    L      = seqused_k[b];   n = q_len(b);   p = L − n + i   (absolute position of query i)
    keys   j ∈ [0, L) with j ≤ p when causal, and mask[b][i, j] with a custom mask
    s_j    = softmax_scale · kv_scale · (q[t, h, :R] · c_j[:R] + q[t, h, R:] · c_j[R:])
    out    = kv_scale · Σ_j softmax(s)_j · c_j[:R]

where ``c_j`` is the latent vector of key ``j`` (``kv_cache[page, slot, 0, :]``). Every head
reads the same single latent head, so one program loads a ``[BLOCK_N, R + rope]`` tile once
and uses it for all ``BLOCK_H`` heads of its block, for the scores (whole vector) and the
values (first ``R`` dims) alike.

Split-KV (flash-decoding): with few (token × head-block) programs the keys of each request
are cut into ``num_splits`` chunks (sized per request on the device); a second kernel merges
the partial outputs by their log-sum-exp, or (``fused_merge``) the last split program of each
token's head block merges them in the same launch. The split count depends only on host integers
(shapes, ``max_seqlen_k`` or the block-table width), so the launch is CUDA-graph safe.

One program per (token × head block, split); ``FUSED_MERGE``: 1, the last split of a token's
head block to finish merges (:func:`.mla_merge.merge_head_block`); 2, a cooperative launch
whose splits all wait for each other and each merge ``MERGE_SLICE`` columns; ``ONE_QUERY``:
every request has one query, so token ``t`` is request ``t``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .mla_merge import merge_head_block
from ._paging import fp8_pair_ptrs, load_chunk_pages, split_fp8_pairs, tile_pages_of
from ._pdl import wait_then_release
from ._softmax import to_output

__all__ = ["_mla_fwd_kernel"]

_LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _mla_tile(acc, acc_odd, m_i, l_i, q_nope, q_rope, qk_scale, kv_ptr, row, offs_n, hi,
              mask_row, offs_dv, offs_dr, mask_dv, mask_dr,
              KV_LORA: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
              EVEN_D: tl.constexpr, SPLIT_V_LOAD: tl.constexpr, V_PAIRS: tl.constexpr,
              kn_desc=None, kr_desc=None, slot0=0, KV_DESC: tl.constexpr = False,
              LAZY_RESCALE: tl.constexpr = False, q_nope_b=None, QK_SPLIT: tl.constexpr = 1,
              acc_c=None, acc_d=None, q_nope_c=None, q_nope_d=None):
    """One latent tile: rows ``row`` (int64 offsets, ``[BLOCK_N]``) of keys ``offs_n``; keys
    at or past ``hi`` are masked. Updates the online softmax ``(acc [H, R], m_i, l_i)``
    (``l_i`` ``[H]``, or with ``LAZY_RESCALE`` ``[H, BLOCK_N]``: row sums kept per element,
    so that a tile has one cross-warp reduction, the maximum);
    ``V_PAIRS`` (fp8 latents): ``acc``/``acc_odd`` ``[H, R/2]`` hold the even/odd value
    columns, read as 16-bit pairs (see the paged kernel's ``_tile_step``). ``KV_DESC``: the
    tile is the cache rows ``[slot0, slot0 + BLOCK_N)`` read through the tensor descriptors
    ``kn_desc`` (``[BLOCK_N, R]``) and ``kr_desc`` (``[BLOCK_N, rope]``) (TMA on sm_90),
    every key of it below ``hi`` (the caller takes a split's partial last tile through the
    masked pointer loads, so rows past the end never reach the value product).
    ``QK_SPLIT == 2`` / ``4``: the latent columns in halves / quarters (``offs_dv`` spans
    one part; ``q_nope``, ``q_nope_b`` (, ``q_nope_c``, ``q_nope_d``) and ``acc``,
    ``acc_odd`` (, ``acc_c``, ``acc_d``) ``[H, R/QK_SPLIT]`` are the parts in column order;
    ``kn_desc`` blocks are ``[BLOCK_N, R/QK_SPLIT]``): q·Kᵀ sums ``QK_SPLIT`` independent
    chains of mma (R/QK_SPLIT deep, the rope a chain of its own) instead of one R + rope
    deep, and p·V updates every part."""
    mask_n = offs_n < hi
    c_nope_b = None
    c_nope_c = None
    c_nope_d = None
    PART = KV_LORA // QK_SPLIT
    if KV_DESC:
        c_nope = kn_desc.load([slot0, 0])
        if QK_SPLIT >= 2:
            c_nope_b = kn_desc.load([slot0, PART])
        if QK_SPLIT == 4:
            c_nope_c = kn_desc.load([slot0, 2 * PART])
            c_nope_d = kn_desc.load([slot0, 3 * PART])
        c_rope = kr_desc.load([slot0, KV_LORA])
    elif EVEN_D:  # row-only masks keep the 16-byte vector loads along the latent dim
        c_nope = tl.load(kv_ptr + row[:, None] + offs_dv[None, :], mask=mask_n[:, None],
                         other=0.0).to(q_nope.dtype)
        if QK_SPLIT >= 2:
            c_nope_b = tl.load(kv_ptr + row[:, None] + PART + offs_dv[None, :],
                               mask=mask_n[:, None], other=0.0).to(q_nope.dtype)
        if QK_SPLIT == 4:
            c_nope_c = tl.load(kv_ptr + row[:, None] + 2 * PART + offs_dv[None, :],
                               mask=mask_n[:, None], other=0.0).to(q_nope.dtype)
            c_nope_d = tl.load(kv_ptr + row[:, None] + 3 * PART + offs_dv[None, :],
                               mask=mask_n[:, None], other=0.0).to(q_nope.dtype)
        c_rope = tl.load(kv_ptr + row[:, None] + KV_LORA + offs_dr[None, :],
                         mask=mask_n[:, None], other=0.0).to(q_nope.dtype)
    else:
        c_nope = tl.load(kv_ptr + row[:, None] + offs_dv[None, :],
                         mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(q_nope.dtype)
        c_rope = tl.load(kv_ptr + row[:, None] + KV_LORA + offs_dr[None, :],
                         mask=mask_n[:, None] & mask_dr[None, :], other=0.0).to(q_nope.dtype)
    if QK_SPLIT == 4:
        # four independent mma chains and the rope's (scaled before the sum, as below)
        s = ((_dot(q_nope, tl.trans(c_nope), IEEE) * qk_scale
              + _dot(q_nope_b, tl.trans(c_nope_b), IEEE) * qk_scale)
             + (_dot(q_nope_c, tl.trans(c_nope_c), IEEE) * qk_scale
                + _dot(q_nope_d, tl.trans(c_nope_d), IEEE) * qk_scale)
             + _dot(q_rope, tl.trans(c_rope), IEEE) * qk_scale)
    elif QK_SPLIT == 2:
        # two independent mma chains; each is scaled before the sum, so that Triton does not
        # fold the add into the second dot's accumulator (which would chain them again)
        s = (_dot(q_nope, tl.trans(c_nope), IEEE) * qk_scale
             + _dot(q_nope_b, tl.trans(c_nope_b), IEEE) * qk_scale
             + _dot(q_rope, tl.trans(c_rope), IEEE) * qk_scale)
    else:
        s = _dot(q_nope, tl.trans(c_nope), IEEE) + _dot(q_rope, tl.trans(c_rope), IEEE)
        s = s * qk_scale
    visible = mask_n
    if HAS_MASK:
        bits = tl.load(mask_row + offs_n, mask=mask_n, other=0)
        visible = visible & (bits != 0)
    s = tl.where(visible[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # LAZY_RESCALE: the running maximum moves (and acc is rescaled) only when some head's
    # maximum grew past it by more than 2^8: most tiles skip the [H, R] rescale; p ≤ 256
    if not LAZY_RESCALE or tl.max(m_new - m_i, axis=0) > 8.0:
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        if V_PAIRS or QK_SPLIT >= 2:
            acc_odd = acc_odd * alpha[:, None]
        if QK_SPLIT == 4:
            acc_c = acc_c * alpha[:, None]
            acc_d = acc_d * alpha[:, None]
        if LAZY_RESCALE:
            l_i = l_i * alpha[:, None]
        else:
            l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s - m_i[:, None])
    if LAZY_RESCALE:
        l_i = l_i + p  # row sums per element: summed once, after the last tile
    else:
        l_i = l_i + tl.sum(p, axis=1)
    if QK_SPLIT >= 2:  # the column parts of the values
        p16 = p.to(q_nope.dtype)
        acc = acc + _dot(p16, c_nope, IEEE)
        acc_odd = acc_odd + _dot(p16, c_nope_b, IEEE)
        if QK_SPLIT == 4:
            acc_c = acc_c + _dot(p16, c_nope_c, IEEE)
            acc_d = acc_d + _dot(p16, c_nope_d, IEEE)
    elif V_PAIRS:
        # fp8 values as column pairs, two half-width dots (the launch takes this path only
        # when every row offset is a multiple of 16 bytes)
        pairs = tl.load(fp8_pair_ptrs(kv_ptr, row, offs_dv.shape[0]), mask=mask_n[:, None],
                        other=0)
        c_val, c_odd = split_fp8_pairs(pairs, kv_ptr.dtype.element_ty)
        p16 = p.to(q_nope.dtype)
        acc = acc + _dot(p16, c_val.to(q_nope.dtype), IEEE)
        acc_odd = acc_odd + _dot(p16, c_odd.to(q_nope.dtype), IEEE)
    else:
        if SPLIT_V_LOAD:
            # a converted (fp8 -> fp16) tile used by two dots is not software-pipelined by
            # Triton (sm_90 PTX: plain ld.global for it, cp.async only for the rope part); a
            # second load of the same rows (an L2 hit) for the values gives each load a single
            # use, and both are pipelined through shared memory
            # (the 2-D mask keeps this load distinct from the key load above: with identical
            # operands the compiler merges the two back into one, and pipelines neither)
            c_val = tl.load(kv_ptr + row[:, None] + offs_dv[None, :],
                            mask=mask_n[:, None] & mask_dv[None, :],
                            other=0.0).to(q_nope.dtype)
        else:
            c_val = c_nope
        acc = acc + _dot(p.to(q_nope.dtype), c_val, IEEE)
    return acc, acc_odd, acc_c, acc_d, m_i, l_i


@triton.jit
def _mla_fwd_kernel(
    q_ptr, kv_ptr, kn_desc, kr_desc, out_ptr, part_o_ptr, part_lse_ptr, lse_ptr,
    cu_q_ptr, seqused_ptr, bt_ptr, mask_ptr, mask_indptr_ptr, scale_ptr, count_ptr,
    qk_scale_log2, kv_scale_val,
    num_heads, batch, num_head_blocks,
    stride_qt, stride_qh,
    stride_kvp, stride_kvs,
    stride_ot, stride_oh,
    stride_bt,
    stride_pt, stride_ph, stride_ps,
    stride_lt, stride_lh,
    stride_ot_lse, stride_oh_lse,
    PAGE_SIZE: tl.constexpr,
    KV_LORA: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr,
    IEEE: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
    EVEN_D: tl.constexpr,
    PAGE_CHUNK: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    SPLIT_V_LOAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    FIXED_CHUNK: tl.constexpr,
    PDL: tl.constexpr = False,
    V_PAIRS: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = 0,
    ONE_QUERY: tl.constexpr = False,
    MERGE_SLICE: tl.constexpr = 16,
    KV_DESC: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
    QK_SPLIT: tl.constexpr = 1,
):
    if PDL:  # programmatic dependent launch: the previous kernel's writes first
        wait_then_release()
    pid = tl.program_id(0)
    split = tl.program_id(1)
    t = pid // num_head_blocks  # head blocks of one token are neighbours: they share KV in L2
    hb = pid % num_head_blocks

    if ONE_QUERY:
        # every request has exactly one query (tokens == requests, at most one each): token t
        # is request t, and its key count is the program's first read
        b = t
        n_q = 1
        q_start = t
    else:
        # Request of token t: the number of requests that end at or before t.
        offs_b = tl.arange(0, BLOCK_B)
        ends = tl.load(cu_q_ptr + 1 + offs_b, mask=offs_b < batch, other=2147483647)
        b = tl.minimum(tl.sum((ends <= t).to(tl.int32), axis=0), batch - 1)
        q_start = tl.load(cu_q_ptr + b)
        n_q = tl.load(cu_q_ptr + b + 1) - q_start
    kv_len = tl.load(seqused_ptr + b)
    qi = t - q_start
    end = kv_len
    if CAUSAL:
        end = tl.minimum(kv_len, kv_len - n_q + qi + 1)
    if FIXED_CHUNK > 0:
        # batch-invariant: split s owns keys [s·FIXED_CHUNK, (s+1)·FIXED_CHUNK) (the last
        # launched split also whatever lies past it), whatever the batch launched
        lo = split * FIXED_CHUNK
        hi = tl.minimum(lo + FIXED_CHUNK, end)
        if split == NUM_SPLITS - 1:
            hi = end
    else:
        chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, end)

    kv_scale = kv_scale_val
    if SCALE_FROM_PTR:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    qk_scale = qk_scale_log2 * kv_scale

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < KV_LORA
    # the latent columns one tile step reads at once: all, or one half / quarter (QK_SPLIT:
    # the plan takes it only with BLOCK_DV == KV_LORA)
    offs_dt = tl.arange(0, BLOCK_DV // QK_SPLIT)
    mask_dt = offs_dt < KV_LORA
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < ROPE

    q_row = q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
    q_nope = tl.load(q_row + offs_dt[None, :], mask=mask_h[:, None] & mask_dt[None, :], other=0.0)
    q_nope_b = q_nope
    q_nope_c = q_nope
    q_nope_d = q_nope
    PART = KV_LORA // QK_SPLIT
    if QK_SPLIT >= 2:  # the other column parts of q (see _mla_tile)
        q_nope_b = tl.load(q_row + PART + offs_dt[None, :], mask=mask_h[:, None], other=0.0)
    if QK_SPLIT == 4:
        q_nope_c = tl.load(q_row + 2 * PART + offs_dt[None, :], mask=mask_h[:, None], other=0.0)
        q_nope_d = tl.load(q_row + 3 * PART + offs_dt[None, :], mask=mask_h[:, None], other=0.0)
    q_rope = tl.load(q_row + KV_LORA + offs_dr[None, :], mask=mask_h[:, None] & mask_dr[None, :],
                     other=0.0)
    if FP16_DOTS:
        # bf16 queries on an fp8 cache: both dots run in fp16, where e4m3/e5m2 -> f16 is one
        # cvt per pair of elements (-> bf16 needs another per element); q saturates at ±65504
        q_nope = tl.minimum(tl.maximum(q_nope.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        q_rope = tl.minimum(tl.maximum(q_rope.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    if LAZY_RESCALE:  # row sums per element (see _mla_tile)
        l_i = tl.zeros([BLOCK_H, BLOCK_N], dtype=tl.float32)
    else:
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if QK_SPLIT == 4:  # column quarters (see _mla_tile)
        acc = tl.zeros([BLOCK_H, BLOCK_DV // 4], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_H, BLOCK_DV // 4], dtype=tl.float32)
        acc_c = tl.zeros([BLOCK_H, BLOCK_DV // 4], dtype=tl.float32)
        acc_d = tl.zeros([BLOCK_H, BLOCK_DV // 4], dtype=tl.float32)
    elif V_PAIRS or QK_SPLIT == 2:  # even / odd value columns, or halves (see _mla_tile)
        acc = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_H, BLOCK_DV // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        acc_odd = tl.zeros([BLOCK_H, 16], dtype=tl.float32)  # unused
    if QK_SPLIT != 4:
        acc_c = tl.zeros([BLOCK_H, 16], dtype=tl.float32)  # unused
        acc_d = tl.zeros([BLOCK_H, 16], dtype=tl.float32)  # unused
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    mask_row = mask_ptr
    if HAS_MASK:
        mask_row = mask_ptr + tl.load(mask_indptr_ptr + b).to(tl.int64) + qi.to(tl.int64) * kv_len

    offs_t = tl.arange(0, BLOCK_N)
    if KV_DESC:
        # tiles inside pages (TILE_IN_PAGE) read through the descriptors: the full tiles in
        # the loop (pipelined TMA copies), then the split's last, partial tile if any
        full_hi = lo + (tl.maximum(hi - lo, 0) // BLOCK_N) * BLOCK_N
        page_next = tl.load(bt_row + lo // PAGE_SIZE, mask=lo < full_hi, other=0)
        for start in range(lo, full_hi, BLOCK_N):
            page = page_next  # page ids a tile ahead
            page_next = tl.load(bt_row + (start + BLOCK_N) // PAGE_SIZE,
                                mask=start + BLOCK_N < full_hi, other=0)
            acc, acc_odd, acc_c, acc_d, m_i, l_i = _mla_tile(
                acc, acc_odd, m_i, l_i, q_nope, q_rope, qk_scale, kv_ptr, offs_t, start + offs_t,
                hi, mask_row, offs_dt, offs_dr, mask_dt, mask_dr, KV_LORA, HAS_MASK, IEEE,
                EVEN_D, SPLIT_V_LOAD, V_PAIRS, kn_desc, kr_desc,
                page * PAGE_SIZE + start % PAGE_SIZE, True, LAZY_RESCALE=LAZY_RESCALE,
                q_nope_b=q_nope_b, QK_SPLIT=QK_SPLIT, acc_c=acc_c, acc_d=acc_d,
                q_nope_c=q_nope_c, q_nope_d=q_nope_d)
        # the partial tile (none or one): the pointer loop below, its masked loads reading
        # rows past ``hi`` as zeros (a loop, so that its copies go through shared memory)
        lo = full_hi
    if PAGE_CHUNK > 0:  # (never with KV_DESC: the plan turns the chunked lookup off)
        # the chunked block-table lookup (see ._paging): latent copies pipeline num_stages - 1
        # tiles ahead
        t_hi = tl.cdiv(hi, BLOCK_N)
        for c0 in range(lo // BLOCK_N, t_hi, PAGE_CHUNK):
            n_in = tl.minimum(t_hi - c0, PAGE_CHUNK)
            chunk_pages = load_chunk_pages(bt_row, c0, n_in, hi, BLOCK_N, PAGE_SIZE, PAGE_CHUNK,
                                           TILE_IN_PAGE)
            for j in range(0, n_in):
                page, in_page = tile_pages_of(chunk_pages, j, c0 + j, BLOCK_N, PAGE_SIZE,
                                              PAGE_CHUNK, TILE_IN_PAGE)
                acc, acc_odd, acc_c, acc_d, m_i, l_i = _mla_tile(
                    acc, acc_odd, m_i, l_i, q_nope, q_rope, qk_scale, kv_ptr,
                    page * stride_kvp + in_page * stride_kvs, (c0 + j) * BLOCK_N + offs_t, hi,
                    mask_row, offs_dt, offs_dr, mask_dt, mask_dr,
                    KV_LORA, HAS_MASK, IEEE, EVEN_D, SPLIT_V_LOAD, V_PAIRS,
                    LAZY_RESCALE=LAZY_RESCALE, q_nope_b=q_nope_b, QK_SPLIT=QK_SPLIT,
                    acc_c=acc_c, acc_d=acc_d, q_nope_c=q_nope_c, q_nope_d=q_nope_d)
    else:
        # any page size: page ids are fetched one tile ahead (the loop carries them)
        if TILE_IN_PAGE:  # page_size % BLOCK_N == 0 and tiles start at multiples of BLOCK_N
            page_next = tl.load(bt_row + lo // PAGE_SIZE, mask=lo < hi, other=0)
        else:
            page_next = tl.load(bt_row + (lo + offs_t) // PAGE_SIZE, mask=lo + offs_t < hi,
                                other=0)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + offs_t
            nxt = start + BLOCK_N
            if TILE_IN_PAGE:
                page = page_next.to(tl.int64)
                page_next = tl.load(bt_row + nxt // PAGE_SIZE, mask=nxt < hi, other=0)
                row = (page * stride_kvp + (start % PAGE_SIZE) * stride_kvs
                       + offs_t.to(tl.int64) * stride_kvs)
            else:
                page = page_next.to(tl.int64)
                page_next = tl.load(bt_row + (nxt + offs_t) // PAGE_SIZE,
                                    mask=nxt + offs_t < hi, other=0)
                row = page * stride_kvp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kvs
            acc, acc_odd, acc_c, acc_d, m_i, l_i = _mla_tile(
                acc, acc_odd, m_i, l_i, q_nope, q_rope, qk_scale, kv_ptr, row, offs_n, hi,
                mask_row, offs_dt, offs_dr, mask_dt, mask_dr, KV_LORA, HAS_MASK, IEEE, EVEN_D,
                SPLIT_V_LOAD, V_PAIRS, LAZY_RESCALE=LAZY_RESCALE, q_nope_b=q_nope_b,
                QK_SPLIT=QK_SPLIT, acc_c=acc_c, acc_d=acc_d, q_nope_c=q_nope_c,
                q_nope_d=q_nope_d)
    if V_PAIRS:  # interleave the columns back: [H, R/2, 2] -> [H, R]
        acc = tl.reshape(tl.join(acc, acc_odd), [BLOCK_H, BLOCK_DV])
    if QK_SPLIT == 2:  # the halves side by side: [H, R/2, 2] -> [H, 2, R/2] -> [H, R]
        acc = tl.reshape(tl.permute(tl.join(acc, acc_odd), [0, 2, 1]), [BLOCK_H, BLOCK_DV])
    if QK_SPLIT == 4:
        # the quarters side by side: [H, R/4, u, v] (quarter u + 2v) -> [H, v, u, R/4] -> [H, R]
        acc = tl.reshape(tl.permute(tl.join(tl.join(acc, acc_odd), tl.join(acc_c, acc_d)),
                                    [0, 3, 2, 1]), [BLOCK_H, BLOCK_DV])

    if LAZY_RESCALE:
        l_i = tl.sum(l_i, axis=1)
    has = l_i > 0
    inv = tl.where(has, kv_scale / tl.where(has, l_i, 1.0), 0.0)
    o = acc * inv[:, None]
    o_mask = mask_h[:, None] & mask_dv[None, :]
    if NUM_SPLITS == 1 and FIXED_CHUNK == 0:
        o_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
        tl.store(o_ptrs + offs_dv[None, :], to_output(o, out_ptr), mask=o_mask)
        if WRITE_LSE:  # natural log; -inf with nothing visible
            lse_out = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) / 1.4426950408889634,
                               float("-inf"))
            tl.store(lse_ptr + t.to(tl.int64) * stride_ot_lse + offs_h * stride_oh_lse, lse_out,
                     mask=mask_h)
    else:
        p_ptrs = (part_o_ptr + t.to(tl.int64) * stride_pt + offs_h[:, None] * stride_ph
                  + split * stride_ps)
        # float32, or q's 16-bit dtype (``half_partials``)
        tl.store(p_ptrs + offs_dv[None, :], o.to(part_o_ptr.dtype.element_ty), mask=o_mask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + t.to(tl.int64) * stride_lt + offs_h * stride_lh + split, lse,
                 mask=mask_h)
        if FUSED_MERGE == 2:
            # one cooperative launch (every program resident): each split, once all the
            # splits of its (token, head block) have written their partials, merges its own
            # slice of the columns. The counter counts arrivals (release / acquire, after a
            # barrier), then departures: the last to leave, when no split still waits on the
            # count, sets it back to zero for the next launch
            tl.debug_barrier()
            tl.atomic_add(count_ptr + pid, 1, sem="release")
            seen = tl.atomic_add(count_ptr + pid, 0, sem="acquire")
            while seen < NUM_SPLITS:
                seen = tl.atomic_add(count_ptr + pid, 0, sem="acquire")
            offs_c = split * MERGE_SLICE + tl.arange(0, MERGE_SLICE)
            merge_head_block(out_ptr, part_o_ptr, part_lse_ptr, lse_ptr, t.to(tl.int64),
                             offs_h, mask_h, offs_c, offs_c < KV_LORA, stride_ot, stride_oh,
                             stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                             stride_ot_lse, stride_oh_lse, BLOCK_H, MERGE_SLICE, NUM_SPLITS,
                             WRITE_LSE, lse_owner=split == 0)
            left = tl.atomic_add(count_ptr + pid, 1, sem="relaxed")
            if left == 2 * NUM_SPLITS - 1:
                tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed")
        elif FUSED_MERGE == 1:
            # one launch: the last split of this (token, head block) to finish merges it. Its
            # counter (zero before the launch, zero again after it) counts finished splits;
            # the barrier and the acq_rel atomic order every thread's partial stores before
            # the count, and the last program's reads after it
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            if done == NUM_SPLITS - 1:
                merge_head_block(out_ptr, part_o_ptr, part_lse_ptr, lse_ptr, t.to(tl.int64),
                                 offs_h, mask_h, offs_dv, mask_dv, stride_ot, stride_oh,
                                 stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                                 stride_ot_lse, stride_oh_lse, BLOCK_H, BLOCK_DV, NUM_SPLITS,
                                 WRITE_LSE)
                tl.atomic_xchg(count_ptr + pid, 0, sem="relaxed")
