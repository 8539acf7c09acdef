"""Triton kernels of cascade (shared-prefix) attention: the shared pass and the merge.

**Shared pass** (``_cascade_shared_kernel``): one program per (query tile of a run, KV head,
key split). A tile holds ``BLOCK_T`` consecutive query tokens of one run (the run's requests
are consecutive, so are their tokens) times the ``GROUP`` query heads of the KV head (padded
to ``HEADS``) in the M dimension, and loops over its split of the run's shared keys
``[0, S)``, read through the run leader's page-table row: each shared K/V tile is loaded once
for all of the run's queries of that tile. Per row (token ``t`` at absolute position
``p_t``, query head ``h``)::

    s_j = scale · q·k_j    (soft-capped: c·tanh(s/c))         j in this split of [0, S)
    visible iff  j ≥ p_t − left                                (S ≤ p_t: causal holds)
    partial  m = max_j s_j · log2 e,  l = Σ_j 2^{s_j log2 e − m},  acc = Σ_j 2^{…} v_j

written unnormalised to ``[split, t, h]`` workspaces (``m = −inf, l = 0, acc = 0`` when the
split sees nothing). Tiles past the planned runs exit at once (``tok0 == tok1``).

**Merge** (``_cascade_merge_kernel``): per (token, block of heads), the own pass's result
``(o, lse)`` (the ordinary kernel over the request's own pages, sinks included) and the
token's shared splits (none when its run shares nothing) combine exactly::

    M   = max(lse·log2 e, m_1, …, m_s)
    out = (2^{lse·log2 e − M} · o + Σ 2^{m_i − M} acc_i) / (2^{lse·log2 e − M} + Σ 2^{m_i − M} l_i)
    lse = (M + log2 den) / log2 e

with weight 0 (never a NaN) for parts that see nothing; an fp16 ``out`` is clamped to
±65504 at the store (a shared partial is ``Σ p16·v / Σ p``, up to 2^-11 past its values:
:func:`._softmax.to_output`). ``out`` may be the own pass's output
buffer (each program reads its elements before writing them). No atomics, no host reads:
CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._kvutil import next_pow2
from ._paging import load_chunk_pages, tile_pages_of
from ._softmax import online_softmax_tile, tanh, to_output

__all__ = ["cascade_shared_triton", "cascade_merge_triton", "CASCADE_TUNING",
           "shared_config"]

_LOG2E = tl.constexpr(1.4426950408889634)
_UNBOUNDED = tl.constexpr(1 << 30)  # jit functions read only constexpr globals

#: Launch overrides (tests and tuning): ``block_m``, ``block_n``, ``num_warps``,
#: ``num_stages``, ``split_keys`` (shared keys per split), ``max_splits``, ``num_splits``,
#: ``page_chunk`` (key tiles per block-table load; 0 = a lookup per tile), ``overlap`` (on a
#: GPU the own pass runs on a side stream beside the shared pass; default on).
CASCADE_TUNING: dict = {}


@triton.jit
def _shared_tile(acc, m_i, l_i, q, qk_scale, softcap, k_base, v_base, page, in_page, kpos,
                 shared, pos, row_valid, left, stride_kp, stride_kt, stride_vp, stride_vt,
                 offs_d, offs_dv, d_mask, dv_mask, HAS_SOFTCAP: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """One key tile of the shared pass (keys ``kpos`` at ``page``/``in_page``: a scalar or
    int64 ``[BLOCK_N]`` page, int64 ``[BLOCK_N]`` offsets): the online-softmax update."""
    kin = kpos < shared
    k = tl.load(k_base + (page * stride_kp + in_page * stride_kt)[None, :] + offs_d[:, None],
                mask=d_mask[:, None] & kin[None, :], other=0.0)
    v = tl.load(v_base + (page * stride_vp + in_page * stride_vt)[:, None] + offs_dv[None, :],
                mask=kin[:, None] & dv_mask[None, :], other=0.0)
    s = tl.dot(q, k.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
    if HAS_SOFTCAP:
        s = softcap * tanh(s * qk_scale / softcap) * _LOG2E
    else:
        s = s * (qk_scale * _LOG2E)
    vis = kin[None, :] & row_valid[:, None]
    if HAS_WINDOW:
        vis = vis & (kpos[None, :] >= pos[:, None] - left)
    s = tl.where(vis, s, float("-inf"))
    return online_softmax_tile(acc, m_i, l_i, s, v, COMPUTE_DTYPE, DOT_PRECISION)


@triton.jit
def _cascade_shared_kernel(
    Q, K, V, PartAcc, PartML, Tiles, QPos, BlockTable, KScale, VScale,
    sm_scale, softcap, left, num_splits,
    stride_qt, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
    stride_bt, stride_ps, stride_pt, stride_mls, stride_mlt,
    GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SCALES: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, PAGE_CHUNK: tl.constexpr,
    TILE_IN_PAGE: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    tok0 = tl.load(Tiles + tile * 4)
    tok1 = tl.load(Tiles + tile * 4 + 1)
    if tok0 >= tok1:
        return
    leader = tl.load(Tiles + tile * 4 + 2)
    shared = tl.load(Tiles + tile * 4 + 3)

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // HEADS
    hg = rows % HEADS
    row_valid = (rows < BLOCK_T * HEADS) & (tok < tok1) & (hg < GROUP)
    qh = kvh * GROUP + hg
    tok64 = tok.to(tl.int64)
    qh64 = qh.to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    q = tl.load(Q + tok64[:, None] * stride_qt + qh64[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & d_mask[None, :], other=0.0).to(COMPUTE_DTYPE)
    pos = tl.load(QPos + tok, mask=row_valid, other=0)

    qk_scale = sm_scale
    if HAS_SCALES:
        qk_scale = qk_scale * tl.load(KScale).to(tl.float32)

    # this split's key tiles of [0, shared); a window skips tiles left of every row's window
    n_tiles = tl.cdiv(shared, BLOCK_N)
    per_split = tl.cdiv(n_tiles, num_splits)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    if HAS_WINDOW:
        min_pos = tl.min(tl.where(row_valid, pos, _UNBOUNDED), 0)
        t_lo = tl.maximum(t_lo, tl.maximum(min_pos - left, 0) // BLOCK_N)

    bt_row = BlockTable + leader.to(tl.int64) * stride_bt
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_CHUNK > 0:
        # the page ids of PAGE_CHUNK tiles in one load outside the pipelined loop: no load
        # feeds a K/V address inside it, so the copies run NUM_STAGES - 1 tiles ahead
        for c0 in range(t_lo, t_hi, PAGE_CHUNK):
            n_in = tl.minimum(t_hi - c0, PAGE_CHUNK)
            chunk_pages = load_chunk_pages(bt_row, c0, n_in, shared, BLOCK_N, PAGE_SIZE,
                                           PAGE_CHUNK, TILE_IN_PAGE)
            for j in tl.range(0, n_in, num_stages=NUM_STAGES):
                t = c0 + j
                page, in_page = tile_pages_of(chunk_pages, j, t, BLOCK_N, PAGE_SIZE,
                                              PAGE_CHUNK, TILE_IN_PAGE)
                acc, m_i, l_i = _shared_tile(
                    acc, m_i, l_i, q, qk_scale, softcap, k_base, v_base, page, in_page,
                    t * BLOCK_N + offs_n, shared, pos, row_valid, left, stride_kp, stride_kt,
                    stride_vp, stride_vt, offs_d, offs_dv, d_mask, dv_mask, HAS_SOFTCAP,
                    HAS_WINDOW, COMPUTE_DTYPE, DOT_PRECISION)
    else:  # page sizes that neither divide nor are multiples of BLOCK_N: per-tile lookup
        for t in tl.range(t_lo, t_hi, num_stages=NUM_STAGES):
            kpos = t * BLOCK_N + offs_n
            page = tl.load(bt_row + kpos // PAGE_SIZE, mask=kpos < shared, other=0)
            acc, m_i, l_i = _shared_tile(
                acc, m_i, l_i, q, qk_scale, softcap, k_base, v_base, page.to(tl.int64),
                (kpos % PAGE_SIZE).to(tl.int64), kpos, shared, pos, row_valid, left,
                stride_kp, stride_kt, stride_vp, stride_vt, offs_d, offs_dv, d_mask, dv_mask,
                HAS_SOFTCAP, HAS_WINDOW, COMPUTE_DTYPE, DOT_PRECISION)
    if HAS_SCALES:
        acc = acc * tl.load(VScale).to(tl.float32)
    part = split.to(tl.int64) * stride_ps + tok64 * stride_pt + qh64 * DV_PAD
    tl.store(PartAcc + part[:, None] + offs_dv[None, :], acc,
             mask=row_valid[:, None] & dv_mask[None, :])
    ml = split.to(tl.int64) * stride_mls + tok64 * stride_mlt + qh64 * 2
    tl.store(PartML + ml, m_i, mask=row_valid)
    tl.store(PartML + ml + 1, l_i, mask=row_valid)


@triton.jit
def _cascade_merge_kernel(
    O, OwnLse, PartAcc, PartML, TokShared, Lse, num_heads, num_splits,
    stride_ot, stride_oh, stride_olt, stride_olh, stride_ps, stride_pt, stride_mls, stride_mlt,
    stride_lt, stride_lh,
    DV: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_H: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    h64 = offs_h.to(tl.int64)
    offs_dv = tl.arange(0, DV_PAD)
    dv_mask = offs_dv < DV
    m2 = h_mask[:, None] & dv_mask[None, :]
    m_own = tl.load(OwnLse + t * stride_olt + h64 * stride_olh, mask=h_mask,
                    other=float("-inf")) * _LOG2E
    o_ptrs = O + t * stride_ot + h64[:, None] * stride_oh + offs_dv[None, :]
    o_own = tl.load(o_ptrs, mask=m2, other=0.0).to(tl.float32)
    has_own = m_own > float("-inf")
    m = m_own
    den = tl.where(has_own, 1.0, 0.0)
    acc = tl.where(has_own[:, None], o_own, 0.0)
    n = tl.where(tl.load(TokShared + t) > 0, num_splits, 0)
    ml_ptrs = PartML + t * stride_mlt + h64 * 2
    acc_ptrs = PartAcc + t * stride_pt + h64[:, None] * DV_PAD + offs_dv[None, :]
    for _ in range(0, n):  # pointers advance: no int32 split·stride products
        m_s = tl.load(ml_ptrs, mask=h_mask, other=float("-inf"))
        l_s = tl.load(ml_ptrs + 1, mask=h_mask, other=0.0)
        a_s = tl.load(acc_ptrs, mask=m2, other=0.0)
        ml_ptrs += stride_mls
        acc_ptrs += stride_ps
        m_new = tl.maximum(m, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        beta = tl.exp2(m_s - m_safe)
        den = den * alpha + l_s * beta
        acc = acc * alpha[:, None] + tl.where(beta[:, None] > 0.0, a_s * beta[:, None], 0.0)
        m = m_new
    safe = tl.where(den > 0.0, den, 1.0)
    tl.store(o_ptrs, to_output(acc / safe[:, None], O), mask=m2)
    if WRITE_LSE:
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        lse = tl.where(den > 0.0, (m_safe + tl.log2(safe)) / _LOG2E, float("-inf"))
        tl.store(Lse + t * stride_lt + h64 * stride_lh, lse, mask=h_mask)


# ----------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------

#: merge programs to aim for (4 waves of 132 SMs); host ints only, no device query
_MERGE_PROGRAMS = 528

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def shared_config(*, group: int, head_dim_pad: int, fp32: bool, on_gpu: bool,
                  num_tokens: int, max_k: int, num_kv_heads: int, sms: int) -> dict:
    """Launch parameters of the shared pass from host integers only: rows per tile (``heads``
    padded to a power of two × ``block_t`` tokens), key tile, warps and the split count.

    Splits share a run's keys among programs when the query tiles alone leave SMs idle
    (decode: one tile per KV head); the count never grows with ``num_tokens``, so a
    workspace sized for the fewest tokens serves every batch of a CUDA-graph ladder.
    """
    heads = next_pow2(group)
    if on_gpu:
        small = head_dim_pad > 128 or fp32
        block_m = 32 if small else 64
        block_n = 32 if small else 64
        num_warps, num_stages = 4, (2 if small else 3)
        if fp32:  # ieee fp32 dots: 4 warps spill 848 B at 255 registers, 8 warps use 109
            num_warps = 8  # and spill nothing (scripts/inspect_sm90.py, cubin, sm_90)
    else:  # the interpreter: small tiles run fastest
        block_m, block_n, num_warps, num_stages = 16, 16, 4, 1
    block_m = CASCADE_TUNING.get("block_m", block_m)
    block_m = max(block_m, heads)
    block_n = CASCADE_TUNING.get("block_n", block_n)
    block_t = max(1, block_m // heads)
    # 1024 shared keys per split: the H200 sweep of 2026-12-03 10:05 UTC (64 × (4096 + 256),
    # GQA 32/8, d128, bf16) replayed 0.0696 ms against 0.0765 ms with 512 and 0.0764 with 256
    # (docs/benchmarks.md, "Fourth session")
    split_keys = CASCADE_TUNING.get("split_keys", 1024)
    max_splits = CASCADE_TUNING.get("max_splits", 16)
    q_tiles = -(-max(num_tokens, 1) // block_t) * num_kv_heads
    splits = 1
    if q_tiles < 2 * sms:
        splits = max(1, min(max_splits, -(-max_k // split_keys), -(-2 * sms // q_tiles)))
    splits = CASCADE_TUNING.get("num_splits", splits)
    page_chunk = int(CASCADE_TUNING.get("page_chunk", 16))
    return dict(heads=heads, block_m=block_m, block_n=block_n, block_t=block_t,
                overlap=bool(CASCADE_TUNING.get("overlap", True)),
                page_chunk=next_pow2(page_chunk) if page_chunk else 0,
                num_warps=CASCADE_TUNING.get("num_warps", num_warps),
                num_stages=CASCADE_TUNING.get("num_stages", num_stages), num_splits=splits)


def cascade_shared_triton(q, k_cache, v_cache, part_acc, part_ml, tiles, q_pos, block_table, *,
                          softmax_scale, window_left, softcap, k_scale_t, v_scale_t, cfg):
    """Launch the shared pass. q ``[T, Hq, D]``; caches NHD ``[pages, page, Hkv, D|Dv]``;
    part_acc float32 ``[splits, T, Hq, DV_PAD]``; part_ml float32 ``[splits, T, Hq, 2]``;
    tiles int32 ``[num_tiles, 4]``; q_pos int32 ``[T]``; block_table int32 ``[B, W]`` (the
    full table: the shared pages are the leader's; unit stride along its last axis);
    ``window_left`` ``-1`` = unbounded; ``k_scale_t``/``v_scale_t`` float32 1-element
    tensors or ``None``; ``cfg`` from :func:`shared_config`."""
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        # the kernel steps through a leader's row with stride 1: another stride would read
        # the wrong page ids (CascadeKernel.plan materialises such views)
        raise ValueError(
            f"block_table has strides {tuple(block_table.stride())}; the shared pass reads "
            "its rows with unit stride along the last axis. Pass block_table.contiguous().")
    hq, d = q.shape[1], q.shape[2]
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    group = hq // hkv
    splits = part_acc.shape[0]
    ks, vs = k_cache.stride(), v_cache.stride()
    has_scales = k_scale_t is not None
    dummy = tiles
    page = k_cache.shape[1]
    block_n = cfg["block_n"]
    tile_in_page = page % block_n == 0
    chunk = cfg["page_chunk"] if tile_in_page or block_n % page == 0 else 0
    _cascade_shared_kernel[(tiles.shape[0], hkv, splits)](
        q, k_cache, v_cache, part_acc, part_ml, tiles, q_pos, block_table,
        k_scale_t if has_scales else dummy, v_scale_t if has_scales else dummy,
        float(softmax_scale), float(softcap), int(window_left) if window_left >= 0 else 0,
        splits, q.stride(0), q.stride(1), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        block_table.stride(0), part_acc.stride(0), part_acc.stride(1), part_ml.stride(0),
        part_ml.stride(1),
        GROUP=group, HEADS=cfg["heads"], BLOCK_T=cfg["block_t"], BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"], D=d, D_PAD=max(16, next_pow2(d)), DV=dv,
        DV_PAD=part_acc.shape[3], PAGE_SIZE=k_cache.shape[1], HAS_SOFTCAP=softcap > 0,
        HAS_WINDOW=window_left >= 0, HAS_SCALES=has_scales, COMPUTE_DTYPE=_TL[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=cfg["num_stages"], PAGE_CHUNK=chunk, TILE_IN_PAGE=tile_in_page,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def cascade_merge_triton(out, own_lse, part_acc, part_ml, tok_shared, lse=None):
    """Merge the own pass (``out`` ``[T, Hq, Dv]`` in place, ``own_lse`` float32 ``[T, Hq]``)
    with the shared splits of each token whose run shares keys; ``lse`` optional float32
    ``[T, Hq]`` receives the merged LSE."""
    num_tokens, hq, dv = out.shape
    if num_tokens == 0:
        return out
    dv_pad = part_acc.shape[3]
    block_h = max(1, min(next_pow2(hq), max(1, 4096 // dv_pad)))
    # enough programs to cover the SMs a few times: each program's split loop is a chain of
    # dependent loads (H200, 64 decode tokens × 32 heads, 5 splits: one 32-head program per
    # token took 12.2 µs of the cascade's 69 µs; profile_kernels.py, 2026-12-03 23:51 UTC)
    while block_h > 1 and num_tokens * -(-hq // block_h) < _MERGE_PROGRAMS:
        block_h //= 2
    warps = max(1, min(4, block_h * dv_pad // 256))
    ls = lse.stride() if lse is not None else (0, 0)
    _cascade_merge_kernel[(num_tokens, triton.cdiv(hq, block_h))](
        out, own_lse, part_acc, part_ml, tok_shared, lse if lse is not None else own_lse, hq,
        part_acc.shape[0], out.stride(0), out.stride(1), own_lse.stride(0), own_lse.stride(1),
        part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1),
        ls[0], ls[1], DV=dv, DV_PAD=dv_pad, BLOCK_H=block_h, WRITE_LSE=lse is not None,
        num_warps=warps)
    return out
