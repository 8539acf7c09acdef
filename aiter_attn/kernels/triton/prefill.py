"""Dense-tile causal attention over a step's own contiguous K/V (prefill, and the new-token
part of an extend step), with the log-sum-exp out and an optional LSE merge with a prefix
pass.

Math (per request ``b`` with ``nq`` queries and ``nk`` new keys, ragged through
``cu_seqlens_q``/``cu_seqlens_k``; query ``i`` at relative position ``p = i + nk - nq``, the
bottom-right alignment of flash-attn)::

    s_j   = softmax_scale · (q_i · k_j)                    (natural units)
    s_j  ← c · tanh(s_j / c)                               (soft-cap, c > 0)
    vis_j = j < nk ∧ (¬causal ∨ j ≤ p) ∧ p - left ≤ j ≤ p + right
    o_i   = Σ_j softmax([s_vis, sink])_j · v_j             (no value for the sink)
    lse_i = ln(Σ_vis exp(s_j) + exp(sink))                 (-inf when nothing is visible)

With a prefix result ``(o_p, lse_p)`` (``prefix=``: the paged pass over the cached prefix,
run without sinks) the epilogue merges both exactly (``merge_attention_states`` math), so a
sink is counted once. A row with nothing visible, no sink and no prefix outputs zeros.

Work layout: one program per (block of ``BLOCK_M`` query rows of one request, query head);
query head ``h`` reads KV head ``h // group`` (GQA). Keys are visited in ``BLOCK_N`` tiles in
two stages: the tiles every row of the block sees (no mask arithmetic; the exp2 argument is
one fused multiply-add with the scale folded into log2(e)), then the tiles the causal
diagonal, the window or the sequence end cut (masked). Programs are ordered longest-first.
On sm_90 with 16-byte-aligned, head-contiguous inputs and a power-of-two head dim, Q/K/V
tiles come through host tensor descriptors (TMA); otherwise plain pointers with head-dim
masks (any head dim ≤ 256, e.g. 80 padded to 128). Offsets are int64. There is no
warp-specialised form: with Triton 3.6 its Hopper key loop (``tl.range(...,
warp_specialize=True)``) did not finish on an H200 (two test launches stopped at 120 s;
docs/benchmarks.md, eighth session).

Host work: the launch configuration is chosen by :func:`choose_prefill_config` from host
integers only (``max_seqlen_q``, ``max_seqlen_k``, head dim, dtype, device); nothing reads a
tensor value, so launches are CUDA-graph safe.
"""

from __future__ import annotations

import functools
from typing import Optional

import attrs
import torch
import triton
import triton.language as tl

from ._kvutil import interpreting, max_shared_mem, next_pow2, num_sms
from ._softmax import tanh, to_output
from ._launch import Launcher, launch_key
from .prefill_gluon import HAS_GLUON

__all__ = ["PrefillConfig", "choose_prefill_config", "dense_prefill", "launch_dense",
           "PREFILL_OVERRIDES",
           "MAX_HEAD_DIM", "tma_ok"]

MAX_HEAD_DIM = 256
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_UNBOUNDED = 1 << 30
_BIG = tl.constexpr(1 << 30)  # the same bound inside kernels

#: Tuning hook for benchmark sweeps: keys of :class:`PrefillConfig` forced onto the chosen
#: configuration (empty in library use).
PREFILL_OVERRIDES: dict = {}

try:  # Triton ≥ 3.3: host tensor descriptors (TMA on sm_90)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


@triton.jit
def _load_k(K, Kd, k_row0, k_col, k_head_off, s_kt, start_n, kpos, nk, offs_d, d_mask,
            CHECK_LEN: tl.constexpr, USE_TMA: tl.constexpr):
    """K tile: ``[BLOCK_N, D]`` through the descriptor (TMA), else ``[D_PAD, BLOCK_N]``."""
    if USE_TMA:
        k = Kd.load([k_row0 + start_n, k_col])
    else:
        rows = (k_row0 + kpos).to(tl.int64)
        k_ptrs = K + k_head_off + rows[None, :] * s_kt + offs_d[:, None]
        if CHECK_LEN:
            k = tl.load(k_ptrs, mask=d_mask[:, None] & (kpos < nk)[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
    return k


@triton.jit
def _load_v(V, Vd, k_row0, v_col, v_head_off, s_vt, start_n, kpos, nk, offs_dv, dv_mask,
            CHECK_LEN: tl.constexpr, USE_TMA: tl.constexpr):
    if USE_TMA:
        v = Vd.load([k_row0 + start_n, v_col])
    else:
        rows = (k_row0 + kpos).to(tl.int64)
        v_ptrs = V + v_head_off + rows[:, None] * s_vt + offs_dv[None, :]
        if CHECK_LEN:
            v = tl.load(v_ptrs, mask=(kpos < nk)[:, None] & dv_mask[None, :], other=0.0)
        else:
            v = tl.load(v_ptrs, mask=dv_mask[None, :], other=0.0)
    return v


@triton.jit
def _visible(s, kpos, pos_q, nk, left, right, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
             cut):
    """``s`` with -inf where key ``kpos`` is invisible to the row at ``pos_q`` (``cut``
    False: the causal bound is lifted; ``nk``/``left``/``right`` come lifted by the caller)."""
    vis = (kpos < nk)[None, :]
    if CAUSAL:
        vis = vis & (kpos[None, :] <= tl.where(cut, pos_q, _BIG)[:, None])
    if HAS_WINDOW:
        vis = vis & (kpos[None, :] >= pos_q[:, None] - left)
        vis = vis & (kpos[None, :] <= pos_q[:, None] + right)
    return tl.where(vis, s, float("-inf"))


@triton.jit
def _dense_tiles(
    acc, m_i, l_i, q, qk2, softcap,
    K, V, Kd, Vd, k_row0, k_col, v_col, k_head_off, v_head_off, s_kt, s_vt,
    lo, hi, f_lo, f_hi, pos_q, nk, left, right,
    offs_d, offs_dv, d_mask, dv_mask,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, USE_TMA: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Online-softmax update of ``(acc, m_i, l_i)`` (log2 domain) over keys ``[lo, hi)`` in
    ``BLOCK_N`` tiles. ``MASKED``: 0 every tile is visible to every row (no mask
    arithmetic); 1 every tile is masked (length/causal/window); 2 one loop over all tiles
    that masks those outside ``[f_lo, f_hi)``."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        kpos = start_n + offs_n
        k = _load_k(K, Kd, k_row0, k_col, k_head_off, s_kt, start_n, kpos, nk, offs_d, d_mask,
                    MASKED != 0, USE_TMA)
        if USE_TMA:
            s = tl.dot(q, k.T, input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        if HAS_SOFTCAP:
            s = softcap * tanh(s * (qk2 / _LOG2E) / softcap) * _LOG2E
        if MASKED == 0:
            if HAS_SOFTCAP:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                p = tl.exp2(s - m_new[:, None])
            else:
                # the scale rides on the exp2 argument: one FMA per logit
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk2)
                p = tl.exp2(s * qk2 - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        else:
            if not HAS_SOFTCAP:
                s = s * qk2
            if MASKED == 1:
                s = _visible(s, kpos, pos_q, nk, left, right, CAUSAL, HAS_WINDOW, True)
            else:
                # branch-free: fully visible tiles compare against bounds every key passes
                cut = (start_n < f_lo) | (start_n >= f_hi)
                s = _visible(s, kpos, pos_q, tl.where(cut, nk, _BIG),
                             tl.where(cut, left, _BIG), tl.where(cut, right, _BIG),
                             CAUSAL, HAS_WINDOW, cut)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_v(V, Vd, k_row0, v_col, v_head_off, s_vt, start_n, kpos, nk, offs_dv, dv_mask,
                    MASKED != 0, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _dense_prefill_kernel(
    Q, K, V, O, LSE, OP, LSEP, Sinks, Qd, Kd, Vd, CuQ, CuK,
    qk2, softcap, left, right, num_seqs,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_ot, s_oh, s_lt, s_lh, s_pt, s_ph, s_plt, s_plh,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_PREFIX: tl.constexpr, WRITE_LSE: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    ONE_LOOP: tl.constexpr, M_SLOW: tl.constexpr,
    SEARCH: tl.constexpr,
):
    # longest blocks first (causal: the last query blocks see the most keys): within each
    # (head, request) with the block index fastest, or across the whole grid (M_SLOW)
    if SEARCH:
        # ragged batches (e.g. many 1-token rows beside one long prompt): one program per
        # query block actually present; block starts are cu_seqlens_q[b] // BLOCK_M + b (an
        # upper bound on the blocks before b): the last b whose start is ≤ the program's
        pid = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)
        lo_b = 0
        hi_b = num_seqs
        while lo_b < hi_b:
            mid = (lo_b + hi_b) // 2
            if tl.load(CuQ + mid) // BLOCK_M + mid <= pid:
                lo_b = mid + 1
            else:
                hi_b = mid
        b = lo_b - 1
        start_m = pid - (tl.load(CuQ + b) // BLOCK_M + b)
    elif M_SLOW:
        h = tl.program_id(0)
        b = tl.program_id(1)
        start_m = tl.num_programs(2) - 1 - tl.program_id(2)
    else:
        start_m = tl.num_programs(0) - 1 - tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)
    q0 = tl.load(CuQ + b)
    nq = tl.load(CuQ + b + 1) - q0
    k0 = tl.load(CuK + b)
    nk = tl.load(CuK + b + 1) - k0
    min_i = start_m * BLOCK_M
    # a block past this request's queries runs no key tile and stores nothing (the
    # one-loop form runs an empty key range instead of returning)
    live = min_i < nq
    if not ONE_LOOP:
        if not live:
            return
    kvh = h // GROUP
    delta = nk - nq
    max_i = tl.minimum(min_i + BLOCK_M, nq) - 1
    offs_m = min_i + tl.arange(0, BLOCK_M)
    pos_q = offs_m + delta
    row_ok = offs_m < nq
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D
    dv_mask = offs_dv < DV
    q_rows = (q0 + offs_m).to(tl.int64)
    if USE_TMA:
        q = Qd.load([q0 + min_i, h * D])
    else:
        q = tl.load(Q + h.to(tl.int64) * s_qh + q_rows[:, None] * s_qt + offs_d[None, :],
                    mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    # key ranges: [lo, hi) is everything some row of the block may see; [f_lo, f_hi) the
    # BLOCK_N tiles every row sees (no mask)
    hi = nk
    f_hi = nk
    if CAUSAL:
        hi = tl.minimum(hi, max_i + delta + 1)
        f_hi = tl.minimum(f_hi, min_i + delta + 1)
    lo = 0
    f_lo = 0
    if HAS_WINDOW:
        hi = tl.minimum(hi, max_i + delta + right + 1)
        f_hi = tl.minimum(f_hi, min_i + delta + right + 1)
        lo = tl.maximum(min_i + delta - left, 0) // BLOCK_N * BLOCK_N
        f_lo = tl.cdiv(tl.maximum(max_i + delta - left, 0), BLOCK_N) * BLOCK_N
    hi = tl.where(live, tl.maximum(hi, 0), 0)
    lo = tl.minimum(lo, hi)
    f_lo = tl.minimum(tl.maximum(f_lo, lo), hi)
    f_hi = tl.maximum(tl.maximum(f_hi, 0) // BLOCK_N * BLOCK_N, f_lo)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    k_head_off = kvh.to(tl.int64) * s_kh
    v_head_off = kvh.to(tl.int64) * s_vh
    if ONE_LOOP:
        # every tile in one loop; the mask only where it cuts
        acc, m_i, l_i = _dense_tiles(
            acc, m_i, l_i, q, qk2, softcap, K, V, Kd, Vd, k0, kvh * D, kvh * DV, k_head_off,
            v_head_off, s_kt, s_vt, lo, hi, f_lo, f_hi, pos_q, nk, left, right, offs_d,
            offs_dv, d_mask, dv_mask, BLOCK_N, 2, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA,
            DOT_PRECISION, NUM_STAGES)
    else:
        # stage 1: fully visible tiles (no mask arithmetic)
        acc, m_i, l_i = _dense_tiles(
            acc, m_i, l_i, q, qk2, softcap, K, V, Kd, Vd, k0, kvh * D, kvh * DV, k_head_off,
            v_head_off, s_kt, s_vt, f_lo, f_hi, f_lo, f_hi, pos_q, nk, left, right, offs_d,
            offs_dv, d_mask, dv_mask, BLOCK_N, 0, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA,
            DOT_PRECISION, NUM_STAGES)
        # stage 2: the diagonal / sequence-end tiles (masked)
        acc, m_i, l_i = _dense_tiles(
            acc, m_i, l_i, q, qk2, softcap, K, V, Kd, Vd, k0, kvh * D, kvh * DV, k_head_off,
            v_head_off, s_kt, s_vt, f_hi, hi, f_lo, f_hi, pos_q, nk, left, right, offs_d,
            offs_dv, d_mask, dv_mask, BLOCK_N, 1, CAUSAL, HAS_WINDOW, HAS_SOFTCAP, USE_TMA,
            DOT_PRECISION, NUM_STAGES)
        if HAS_WINDOW:  # the window's left edge (masked)
            acc, m_i, l_i = _dense_tiles(
                acc, m_i, l_i, q, qk2, softcap, K, V, Kd, Vd, k0, kvh * D, kvh * DV,
                k_head_off, v_head_off, s_kt, s_vt, lo, f_lo, f_lo, f_hi, pos_q, nk, left,
                right, offs_d, offs_dv, d_mask, dv_mask, BLOCK_N, 1, CAUSAL, HAS_WINDOW,
                HAS_SOFTCAP, USE_TMA, DOT_PRECISION, NUM_STAGES)

    # epilogue: sink (once, here), prefix merge, normalise
    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32) * _LOG2E
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
        m_i = m_new
    if HAS_PREFIX:
        lp = tl.load(LSEP + q_rows * s_plt + h * s_plh, mask=row_ok,
                     other=float("-inf")) * _LOG2E
        op = tl.load(OP + q_rows[:, None] * s_pt + h * s_ph + offs_dv[None, :],
                     mask=row_ok[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, lp)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w_p = tl.exp2(lp - m_safe)
        # a side of weight 0 is selected away (its o may hold anything)
        acc = acc * alpha[:, None] + tl.where(w_p[:, None] > 0.0, w_p[:, None] * op, 0.0)
        l_i = l_i * alpha + w_p
        m_i = m_new
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(O + q_rows[:, None] * s_ot + h * s_oh + offs_dv[None, :], to_output(o, O),
             mask=row_ok[:, None] & dv_mask[None, :])
    if WRITE_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * _LN2, float("-inf"))
        tl.store(LSE + q_rows * s_lt + h * s_lh, lse, mask=row_ok)


#: direct launches of the dense kernel (Triton's per-call binding skipped after a key's first
#: launch; :mod:`._launch`)
_DENSE = Launcher(_dense_prefill_kernel)


@attrs.frozen
class PrefillConfig:
    """A launch of the dense kernel: tile shapes, warps, software-pipeline depth, TMA
    (tensor-descriptor) loads when the inputs allow, one key loop (``one_loop``: the mask
    only where it cuts) instead of unmasked then masked tiles, grid order (``m_slow``), the
    Gluon kernel of :mod:`.prefill_gluon` where it can serve the launch (``gluon``), in its
    warp-specialised form (``warp_specialize``, :mod:`.prefill_gluon_ws`: ``block_m`` 128
    rows per program, two 64-row consumer warpgroups and a loader warp; ``num_warps`` 4 is
    the default partition's)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = True
    one_loop: bool = False
    m_slow: bool = False
    gluon: bool = False
    warp_specialize: bool = False

    def grid(self, max_q: int, num_tokens: int, num_q_heads: int, batch: int) -> tuple:
        """``(grid, search)``: query blocks × heads × requests (``m_slow``: heads × requests
        × query blocks, so every request's longest blocks start first); ``search`` when
        ``batch · blocks(max_q)`` would exceed the blocks actually present (ragged batches):
        then one program per present block (at most ``blocks(num_tokens) + batch``), its
        request found by binary search."""
        m = triton.cdiv(max(max_q, 1), self.block_m)
        present = triton.cdiv(max(num_tokens, 1), self.block_m) + batch
        if batch * m > present:
            return (present, num_q_heads, 1), True
        return ((num_q_heads, batch, m) if self.m_slow else (m, num_q_heads, batch)), False

    def triton_fallback(self, grid, search: bool, num_tokens: int, batch: int) -> tuple:
        """``(config, grid, search)`` of the Triton kernel standing in for a launch the
        Gluon kernel declined: the same tiles, except that a warp-specialised launch's
        128-row programs become two 64-row ones of 4 warps (a covering grid: query blocks
        doubled, or one search program per present 64-row block)."""
        if not self.warp_specialize:
            return attrs.evolve(self, gluon=False), grid, search
        cfg = attrs.evolve(self, block_m=self.block_m // 2, gluon=False, warp_specialize=False)
        if search:
            return cfg, (triton.cdiv(max(num_tokens, 1), cfg.block_m) + batch, grid[1], 1), True
        if self.m_slow:
            return cfg, (grid[0], grid[1], 2 * grid[2]), False
        return cfg, (2 * grid[0], grid[1], grid[2]), False


def _smem_need(bm, bn, d_pad, dv_pad, stages, elem):
    return (bm * d_pad + stages * bn * (d_pad + dv_pad)) * elem


def few_waves(num_tokens: int, q_heads: int, sms: int) -> bool:
    """Four waves or fewer of 128-row programs on ``sms`` SMs (``False`` when a count is
    unknown, 0): then every head's longest blocks go first (``m_slow``)."""
    programs = q_heads * -(-int(num_tokens) // 128)
    return bool(programs and sms) and programs <= 4 * sms


@functools.lru_cache(maxsize=256)
def _choose_cached(d_pad, dv_pad, elem, sm90, smem, interp, ov, sized=False, few=False,
                   hopper=None):
    """``sized``: the device's SM count is known; ``few``: :func:`few_waves`; ``hopper``: an
    NVIDIA sm_90 device (the Gluon kernel's; default ``sm90``). Nothing per-step (lengths,
    token counts) enters the key, so an engine's steps hit the cache."""
    hopper = sm90 if hopper is None else hopper
    if interp:  # small tiles: short test sequences still cross every stage boundary
        cfg = PrefillConfig(16, 16, 4, 1, tma=True)
    elif elem == 4:
        cfg = PrefillConfig(64, 32, 4, 2, tma=False)
    elif max(d_pad, dv_pad) > 128:
        cfg = PrefillConfig(64, 64, 4, 2, tma=sm90)
    elif not sized:  # a device of unknown size: two warpgroups of 64 rows, 128-key tiles
        cfg = PrefillConfig(128, 128, 8, 2, tma=sm90)
    else:
        # 64-row tiles of one warpgroup, two programs per SM (their softmax and tensor-core
        # phases interleave). H200, CUDA-graph replay against 128x128 / 8 warps / 2 stages:
        # 1x8k 440 -> 458 TFLOP/s, 8x2k 371 -> 415, 1x16k 468 -> 468-484; with four waves
        # or fewer of 128-row programs (1x2k, 32 heads: 512) every head's longest blocks
        # first (m_slow): 1x2k 306 -> 415 (docs/benchmarks.md, eighth session)
        cfg = PrefillConfig(64, 64, 4, 3, tma=sm90, m_slow=few)
        if hopper and elem == 2 and d_pad == dv_pad and d_pad in (64, 128) and HAS_GLUON:
            # the warp-specialised Gluon kernel (a loader warp, two 64-row consumers sharing
            # each K/V tile, softmax overlapped with the previous tile's p·v). H200, eager /
            # replayed TFLOP/s against the one-warpgroup Gluon kernel (64x64, 2 stages):
            # 128-key tiles, 2 stages: 1x8k 466/460 -> 559/559, 1x16k 505/498 -> 601/603,
            # 8x2k 412/389 -> 451/443; with few waves, 64-key tiles, 3 stages, longest
            # blocks first: 1x2k 362/372 -> 409/427 (the Triton m-slow launch: ~405/408)
            # (eleventh session). Launches it cannot serve (soft-cap, ragged search) fall
            # back to the Triton kernel with 64-row tiles (PrefillConfig.triton_fallback)
            cfg = (PrefillConfig(128, 64, 4, 3, tma=True, m_slow=True, gluon=True,
                                 warp_specialize=True) if few else
                   PrefillConfig(128, 128, 4, 2, tma=True, gluon=True, warp_specialize=True))
    if ov:
        cfg = attrs.evolve(cfg, **dict(ov))
    if smem is not None and not interp:  # fit the device: fewer stages, then narrower tiles
        bn, st = cfg.block_n, cfg.num_stages
        while _smem_need(cfg.block_m, bn, d_pad, dv_pad, st, elem) > smem and st > 1:
            st -= 1
        while _smem_need(cfg.block_m, bn, d_pad, dv_pad, st, elem) > smem and bn > 16:
            bn //= 2
        cfg = attrs.evolve(cfg, block_n=bn, num_stages=st)
    return cfg


def choose_prefill_config(*, max_q: int, max_k: int, head_dim: int, v_head_dim: int,
                          dtype: torch.dtype, device: torch.device, num_tokens: int = 0,
                          q_heads: int = 0) -> PrefillConfig:
    """The launch configuration for a dense pass (host integers only; cached).
    ``num_tokens``/``q_heads`` (0: unknown) count the 128-row programs against the device's
    SMs (:func:`few_waves`); ``max_q``/``max_k`` (the step's bounds) steer no rule today.
    :data:`PREFILL_OVERRIDES` replaces fields (benchmark sweeps)."""
    d_pad = max(16, next_pow2(head_dim))
    dv_pad = max(16, next_pow2(v_head_dim))
    sm90 = (device.type == "cuda" and TensorDescriptor is not None
            and _capability(device) >= (9, 0))
    interp = interpreting()
    sms = num_sms(device) if device.type == "cuda" and not interp else 0
    hopper = sm90 and torch.version.hip is None and _capability(device)[0] == 9
    return _choose_cached(d_pad, dv_pad, torch.empty((), dtype=dtype).element_size(), sm90,
                          max_shared_mem(device), interp,
                          tuple(sorted(PREFILL_OVERRIDES.items())), sms > 0,
                          few_waves(num_tokens, q_heads, sms), hopper)


@functools.lru_cache(maxsize=None)
def _capability_of(index: int):
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device):
    return _capability_of(device.index if device.index is not None
                          else torch.cuda.current_device())


def tma_ok(t: torch.Tensor, head_dim: int) -> bool:
    """``t`` ``[T, H, head_dim]`` can be read through a 2-D tensor descriptor
    ``[T, H·head_dim]``: power-of-two head dim ≥ 16, heads contiguous after each other,
    16-byte-aligned base and row stride."""
    if TensorDescriptor is None or head_dim != next_pow2(head_dim) or head_dim < 16:
        return False
    st = t.stride()
    e = t.element_size()
    return (st[2] == 1 and st[1] == head_dim and (st[0] * e) % 16 == 0
            and t.data_ptr() % 16 == 0 and t.shape[0] > 0)


_DOT_PRECISION = {torch.float32: "ieee", torch.float16: "tf32", torch.bfloat16: "tf32"}
_CUDA_TL = {torch.float16, torch.bfloat16, torch.float32}


def _descriptor(t, rows, cols, block):
    return TensorDescriptor(t, [rows, cols], [t.stride(0), 1], block)


def dense_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool = True,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    lse: Optional[torch.Tensor] = None,
    prefix: Optional[tuple] = None,
    config: Optional[PrefillConfig] = None,
) -> torch.Tensor:
    """Dense attention of each request's queries over its own contiguous keys (see the
    module docstring). Launch only: no host synchronisation.

    Args:
        q: ``[Tq, Hq, D]`` fp16/bf16/fp32 (last axis contiguous).
        k, v: ``[Tk, Hkv, D]`` / ``[Tk, Hkv, Dv]``, q's dtype; ``Hq % Hkv == 0``.
        out: ``[Tq, Hq, Dv]`` (written).
        cu_seqlens_q / cu_seqlens_k: int32 ``[B + 1]`` request offsets into q and k/v (int64
            too: then plain-pointer loads, tensor descriptors take 32-bit offsets).
        max_seqlen_q / max_seqlen_k: host bounds of the per-request lengths (the grid).
        window_size: flash-attn ``(left, right)``, ``-1`` unbounded, on the relative positions.
        sinks: float32 ``[Hq]`` attention-sink logits (counted once), or ``None``.
        lse: float32 ``[Tq, Hq]`` written with the natural-log LSE, or ``None``.
        prefix: ``(o_p [Tq, Hq, Dv], lse_p float32 [Tq, Hq])`` merged in the epilogue, or
            ``None``.
        config: a :class:`PrefillConfig` (default :func:`choose_prefill_config`).
    Returns ``out``.
    """
    num_tokens, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    if num_tokens == 0 or batch <= 0 or max_seqlen_q <= 0:
        return out
    if config is None:
        config = choose_prefill_config(max_q=max_seqlen_q, max_k=max_seqlen_k, head_dim=d,
                                       v_head_dim=dv, dtype=q.dtype, device=q.device,
                                       num_tokens=num_tokens, q_heads=hq)
    grid, search = config.grid(max_seqlen_q, num_tokens, hq, batch)
    return launch_dense(q, k, v, out, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
                        window_size, softcap, sinks, lse, prefix, config, grid, search)


def launch_dense(q, k, v, out, cu_q, cu_k, scale, causal, window, softcap, sinks, lse, prefix,
                 config: PrefillConfig, grid, search: bool):
    """One dense launch on ``grid`` (:meth:`PrefillConfig.grid`): the Gluon kernel when
    ``config.gluon`` and :func:`.prefill_gluon.gluon_reject_reason` finds nothing against
    it, else the Triton kernel. Returns ``out``."""
    check_dense_operands(q, k, v, out, cu_q, cu_k)
    # tensor-descriptor loads take 32-bit offsets: int64 request offsets (an allowed index
    # dtype) run the Triton kernel with plain pointers
    offsets32 = cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    if config.gluon and not offsets32:
        config, grid, search = config.triton_fallback(grid, search, q.shape[0],
                                                      cu_q.shape[0] - 1)
    if config.gluon:
        from .prefill_gluon import gluon_reject_reason, launch_gluon_prefill

        if gluon_reject_reason(q, k, v, causal=causal, window=window, softcap=softcap,
                               search=search, config=config) is None:
            if config.warp_specialize:
                from .prefill_gluon_ws import launch_gluon_ws_prefill

                return launch_gluon_ws_prefill(q, k, v, out, cu_q, cu_k, scale, sinks, lse,
                                               prefix, config, grid, window=window)
            return launch_gluon_prefill(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix,
                                        config, grid)
        config, grid, search = config.triton_fallback(grid, search, q.shape[0],
                                                      cu_q.shape[0] - 1)
    args, kw = prefill_launch_args(q, k, v, out, cu_q, cu_k, scale, causal, window, softcap,
                                   sinks, lse, prefix, config)
    if search:
        kw["SEARCH"] = True
    _DENSE.launch(grid, args, kw, launch_key(args, kw))
    return out


def check_dense_operands(q, k, v, out, cu_q, cu_k) -> None:
    """O(1) host checks of one dense launch, before anything is launched: k/v/out in q's
    dtype, k ``[Tk, Hkv, D]`` with q's head dim, v ``[Tk, Hkv, Dv]`` with k's tokens and heads,
    out ``[Tq, Hq, Dv]``, integer request offsets. Raises ValueError naming the argument."""
    num_tokens, hq, d = q.shape
    for name, t in (("k", k), ("v", v), ("out", out)):
        if t.dtype != q.dtype or t.dim() != 3:
            raise ValueError(
                f"dense prefill: {name} is {t.dtype} with {t.dim()} dims but q is {q.dtype} "
                f"[num_tokens, heads, head_dim]; pass {name} as a 3-D {q.dtype} tensor.")
    if k.shape[2] != d:
        raise ValueError(
            f"dense prefill: k has head dim {k.shape[2]} but q has {d}; they must match.")
    if tuple(v.shape[:2]) != tuple(k.shape[:2]):
        raise ValueError(
            f"dense prefill: v is {list(v.shape)} but k is {list(k.shape)}; v needs k's token "
            "and head counts ([num_keys, num_kv_heads, head_dim_v]).")
    if tuple(out.shape) != (num_tokens, hq, v.shape[2]):
        raise ValueError(
            f"dense prefill: out is {list(out.shape)}; expected [{num_tokens}, {hq}, "
            f"{v.shape[2]}] (q's tokens and heads, v's head dim).")
    for name, t in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"dense prefill: {name} is {t.dtype}; pass int32 (or int64) "
                             "request offsets [batch + 1].")


def epilogue_operands(out, lse, prefix) -> tuple:
    """``(lse, lse strides, o_p, lse_p, o_p strides, lse_p strides)`` of a dense launch's
    epilogue: absent ones stand in as ``out`` with zero strides (their branch is compiled
    out)."""
    lse_t, ls = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    if prefix is not None:
        op, lp = prefix
        return lse_t, ls, op, lp, op.stride(), lp.stride()
    return lse_t, ls, out, out, (0, 0), (0, 0)


def prefill_launch_args(q, k, v, out, cu_q, cu_k, scale, causal, window, softcap, sinks, lse,
                        prefix, config: PrefillConfig):
    """``(args, kwargs)`` of one launch (O(1) host work: strides, descriptors). Raises
    ValueError when a head-dim axis is strided or the head counts do not divide."""
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"dense prefill: the last (head-dim) axis of {name} must be contiguous "
                f"(stride {t.stride(-1)}); pass a .contiguous() tensor.")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(
            f"dense prefill: q has {q.shape[1]} heads, k {k.shape[1]}, v {v.shape[1]}; k and "
            "v need the same head count, dividing q's.")
    num_tokens, hq, d = q.shape
    tk, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    d_pad, dv_pad = max(16, next_pow2(d)), max(16, next_pow2(dv))
    bm, bn = config.block_m, config.block_n
    use_tma = bool(config.tma and (q.device.type == "cuda" or interpreting())
                   and d == d_pad and dv == dv_pad
                   and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
                   and tma_ok(q, d) and tma_ok(k, d) and tma_ok(v, dv))
    if use_tma:
        qd = _descriptor(q, num_tokens, hq * d, [bm, d])
        kd = _descriptor(k, tk, hkv * d, [bn, d])
        vd = _descriptor(v, tk, hkv * dv, [bn, dv])
    else:
        qd = kd = vd = cu_q
    left, right = int(window[0]), int(window[1])
    has_window = left >= 0 or right >= 0
    left = left if left >= 0 else _UNBOUNDED
    right = right if right >= 0 else _UNBOUNDED
    lse_t, ls, op, lp, ps, pls = epilogue_operands(out, lse, prefix)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    args = (q, k, v, out, lse_t, op, lp, sinks if sinks is not None else cu_q, qd, kd, vd,
            cu_q, cu_k, float(scale) * 1.4426950408889634, float(softcap), left, right,
            cu_q.shape[0] - 1,
            qs[0], qs[1], ks[0], ks[1], vs[0], vs[1], os_[0], os_[1], ls[0], ls[1], ps[0], ps[1],
            pls[0], pls[1])
    kw = dict(GROUP=hq // hkv, D=d, D_PAD=d_pad, DV=dv, DV_PAD=dv_pad, BLOCK_M=bm, BLOCK_N=bn,
              CAUSAL=bool(causal), HAS_WINDOW=has_window, HAS_SOFTCAP=softcap > 0,
              HAS_SINKS=sinks is not None, HAS_PREFIX=prefix is not None,
              WRITE_LSE=lse is not None, USE_TMA=use_tma,
              DOT_PRECISION=_DOT_PRECISION[q.dtype], NUM_STAGES=config.num_stages,
              ONE_LOOP=config.one_loop, M_SLOW=config.m_slow,
              SEARCH=False, num_warps=config.num_warps)
    return args, kw
