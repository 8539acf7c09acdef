"""The Gluon dense causal prefill (:mod:`.prefill_gluon`) warp-specialised for sm_90: one
loader warp and two consumer warpgroups that share every K/V tile.

One program covers ``2 · BLOCK_M`` query rows of one head (``BLOCK_M = 64`` per consumer)::

    loader (1 warp, 24 registers)     Q halves, then K_j / V_j by TMA into rings of
                                      ``STAGES`` slots, each slot reused once both
                                      consumers released it (``*_empty``, count 2)
    consumer 0 (default partition)    rows [min_i, min_i + 64): the key loop of
    consumer 1 (worker, 4 warps)      rows [min_i + 64, min_i + 128): :mod:`.prefill_gluon`
                                      (softmax(S_j) overlaps P_{j-1} V_{j-1})

Against :mod:`.prefill_gluon`'s two independent 64-row programs per SM, every K/V tile is
read from L2 once per 128 query rows instead of once per 64 (Nsight Compute at 8×2k: L2
throughput 70% against cuDNN's 45%; cuDNN runs this producer / two-consumer shape), and
the loads are issued by a warp that waits on nothing else. The consumers drift freely (no
barrier between them), so one's softmax runs under the other's tensor-core work.

A consumer whose rows need fewer key tiles than its partner (the causal diagonal, a left
window's edge, or no rows at all at a request's end) still releases the slots it skips,
after they landed, so the ring's phases stay in step. Left windows (flash-attn
``(left, right)`` with causal; ``right`` is then moot): the loader starts at the lower
half's first visible tile, tiles left of a row's window edge are masked. Same inputs,
outputs and epilogue as :mod:`.prefill_gluon`; :func:`.prefill_gluon.gluon_reject_reason`
decides which launches it may serve (soft-cap and non-causal layers: the Triton kernel).
"""

from __future__ import annotations

from ._launch import Launcher, launch_key
from .prefill_gluon import HAS_GLUON, gluon_launch_args

__all__ = ["launch_gluon_ws_prefill", "WS_MAXNREG", "CONSUMER_REGS"]

#: registers per thread the launch is compiled for: 12 warps (two consumer warpgroups and
#: the loader's, rounded up to a warpgroup) of 168 fill the SM's 64K registers; the
#: partitions then re-balance them (``setmaxnreg``): loader 24, consumers 240 each.
WS_MAXNREG = 168
CONSUMER_REGS = 240
LOADER_REGS = 24

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

    from .prefill_gluon import _epilogue, _program_block, _softmax_tile

    @gluon.jit
    def _half_tiles(min_r, nq, nk, delta, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Key tiles the rows ``[min_r, min_r + BLOCK_M) ∩ [0, nq)`` see (0: no rows)."""
        max_i = gl.minimum(min_r + BLOCK_M, nq) - 1
        hi = gl.maximum(gl.minimum(nk, max_i + delta + 1), 0)
        return gl.where(min_r < nq, gl.cdiv(hi, BLOCK_N), 0)

    @gluon.jit
    def _half_first(min_r, delta, left, BLOCK_N: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """The first key tile the rows from ``min_r`` see (a left window's edge, else 0)."""
        first = min_r * 0
        if HAS_WINDOW:
            first = gl.maximum(min_r + delta - left, 0) // BLOCK_N
        return first

    @gluon.jit
    def _window_mask(s, start_n, pos_q, left, f_lo, BLOCK_N: gl.constexpr,
                     HAS_WINDOW: gl.constexpr, s_layout: gl.constexpr):
        """Keys left of a row's window (``kpos < pos - left``) masked, on tiles that start
        before ``f_lo`` (the first key every row of the half sees)."""
        if HAS_WINDOW:
            if start_n < f_lo:
                kpos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
                s = gl.where(kpos[None, :] >= pos_q[:, None] - left, s, float("-inf"))
        return s

    @gluon.jit
    def _release(k_ready, v_ready, k_empty, v_empty, seq_lo, seq_hi, STAGES: gl.constexpr):
        """Release ring positions ``[seq_lo, seq_hi)`` this consumer does not use, each
        once it landed (its slot's previous phase is then complete, so the arrival counts
        towards the right one)."""
        for seq in range(seq_lo, seq_hi):
            slot = seq % STAGES
            phase = (seq // STAGES) & 1
            mbarrier.wait(k_ready.index(slot), phase)
            mbarrier.arrive(k_empty.index(slot), count=1)
            mbarrier.wait(v_ready.index(slot), phase)
            mbarrier.arrive(v_empty.index(slot), count=1)

    @gluon.jit
    def _shared_tiles(acc, m_i, l_i, q_smem, k_smem, v_smem, k_ready, v_ready, k_empty,
                      v_empty, t_first, seq0, n_tiles, f_hi, f_lo, left, pos_q, nk, qk2,
                      s_zero, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_WINDOW: gl.constexpr,
                      dtype: gl.constexpr, s_layout: gl.constexpr, row_o: gl.constexpr,
                      p_layout: gl.constexpr):
        """One consumer's key loop over the shared rings: key tiles ``t_first ..
        t_first + n_tiles - 1`` (``n_tiles >= 1``) at ring positions ``seq0 ..``; as
        :func:`.prefill_gluon._tiles_pv_overlap`, releasing each slot to the loader once
        its wgmma read it. Returns ``(acc, m_i, l_i)``."""
        slot0 = seq0 % STAGES
        mbarrier.wait(k_ready.index(slot0), (seq0 // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot0).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(k_empty.index(slot0), count=1)
        start_n = t_first * BLOCK_N
        s = _window_mask(s, start_n, pos_q, left, f_lo, BLOCK_N, HAS_WINDOW, s_layout)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk2, start_n, pos_q, nk,
                                           start_n + BLOCK_N > f_hi, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_tiles):
            seq = seq0 + i
            slot = seq % STAGES
            prev = (seq - 1) % STAGES
            mbarrier.wait(k_ready.index(slot), (seq // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_ready.index(prev), ((seq - 1) // STAGES) & 1)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            mbarrier.arrive(k_empty.index(slot), count=1)
            start_n = (t_first + i) * BLOCK_N
            s = _window_mask(s, start_n, pos_q, left, f_lo, BLOCK_N, HAS_WINDOW, s_layout)
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk2, start_n, pos_q, nk,
                                               start_n + BLOCK_N > f_hi, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            mbarrier.arrive(v_empty.index(prev), count=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (seq0 + n_tiles - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((seq0 + n_tiles - 1) // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
        mbarrier.arrive(v_empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _consume(ops, smem, bars, rows, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, D: gl.constexpr, DV: gl.constexpr,
                 STAGES: gl.constexpr, HAS_SINKS: gl.constexpr, HAS_PREFIX: gl.constexpr,
                 WRITE_LSE: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """Consumer ``HALF``: the key loop and epilogue of its 64 rows, then the release
        of the slots its rows do not need."""
        q_desc, k_desc, v_desc, O, LSE, OP, LSEP, Sinks = ops[0]
        qk2, s_ot, s_oh, s_lt, s_lh, s_pt, s_ph, s_plt, s_plh = ops[1]
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty = bars
        q0, nq, nk, min_i, h, delta, n_load, k0, kvh, t_start, left = rows
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        min_r = min_i + HALF * BLOCK_M
        n_tiles = _half_tiles(min_r, nq, nk, delta, BLOCK_M, BLOCK_N)  # end tile (0: no rows)
        first = gl.minimum(gl.maximum(_half_first(min_r, delta, left, BLOCK_N, HAS_WINDOW),
                                      t_start), n_tiles)
        first = gl.where(n_tiles > 0, first, t_start)
        n_tiles = gl.maximum(n_tiles, first)
        f_hi = gl.minimum(nk, min_r + delta + 1)  # keys every row of the half sees
        max_r = gl.minimum(min_r + BLOCK_M, nq) - 1
        f_lo = gl.maximum(max_r + delta - left, 0)  # ... from here (a left window)
        pos_q = min_r + gl.arange(0, BLOCK_M, layout=row_s) + delta
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, DV], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        q_h = q_smem.index(HALF)
        mbarrier.wait(q_bars.index(HALF), 0)
        # ring positions count the loader's tiles from t_start
        _release(k_ready, v_ready, k_empty, v_empty, 0, first - t_start, STAGES)
        if n_tiles > first:
            acc, m_i, l_i = _shared_tiles(
                acc, m_i, l_i, q_h, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                first, first - t_start, n_tiles - first, f_hi, f_lo, left, pos_q, nk, qk2,
                s_zero, BLOCK_N, STAGES, HAS_WINDOW, dtype, s_layout, row_o, p_layout)
        _epilogue(acc, m_i, l_i, O, LSE, OP, LSEP, Sinks, q0, nq, min_r, h, s_ot, s_oh, s_lt,
                  s_lh, s_pt, s_ph, s_plt, s_plh, BLOCK_M, DV, HAS_SINKS, HAS_PREFIX,
                  WRITE_LSE, row_o, col_o)
        # the partner's extra tiles
        _release(k_ready, v_ready, k_empty, v_empty, n_tiles - t_start, n_load - t_start,
                 STAGES)

    @gluon.jit
    def _consume_hi(ops, smem, bars, rows, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                    HAS_SINKS: gl.constexpr, HAS_PREFIX: gl.constexpr,
                    WRITE_LSE: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """Worker partition: consumer 1 (the program's upper 64 rows)."""
        _consume(ops, smem, bars, rows, 1, BLOCK_M, BLOCK_N, D, DV, STAGES, HAS_SINKS,
                 HAS_PREFIX, WRITE_LSE, HAS_WINDOW)

    @gluon.jit
    def _load(ops, smem, bars, rows, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
              HAS_SINKS: gl.constexpr, HAS_PREFIX: gl.constexpr, WRITE_LSE: gl.constexpr,
              HAS_WINDOW: gl.constexpr):
        """Worker partition (1 warp): both Q halves, then every K/V tile either consumer
        needs (tiles ``t_start .. n_load - 1``), each into a slot both consumers released."""
        q_desc, k_desc, v_desc = ops[0][0], ops[0][1], ops[0][2]
        q_smem, k_smem, v_smem = smem
        q_bars, k_ready, v_ready, k_empty, v_empty = bars
        q0, nq, nk, min_i, h, delta, n_load, k0, kvh, t_start, left = rows
        for half in gl.static_range(2):
            mbarrier.expect(q_bars.index(half), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q0 + min_i + half * BLOCK_M, h * D],
                                            q_bars.index(half), q_smem.index(half))
        for j in range(t_start, n_load):
            slot = (j - t_start) % STAGES
            phase = ((j - t_start) // STAGES) & 1
            mbarrier.wait(k_empty.index(slot), phase ^ 1)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [k0 + j * BLOCK_N, kvh * D],
                                            k_ready.index(slot), k_smem.index(slot))
            mbarrier.wait(v_empty.index(slot), phase ^ 1)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [k0 + j * BLOCK_N, kvh * DV],
                                            v_ready.index(slot), v_smem.index(slot))

    @gluon.jit
    def _consume_lo(ops, smem, bars, rows, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                    D: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
                    HAS_SINKS: gl.constexpr, HAS_PREFIX: gl.constexpr,
                    WRITE_LSE: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """Default partition: consumer 0 (the program's lower 64 rows)."""
        _consume(ops, smem, bars, rows, 0, BLOCK_M, BLOCK_N, D, DV, STAGES, HAS_SINKS,
                 HAS_PREFIX, WRITE_LSE, HAS_WINDOW)

    @gluon.jit
    def _gluon_ws_prefill_kernel(
        q_desc, k_desc, v_desc, O, LSE, OP, LSEP, Sinks, CuQ, CuK,
        qk2, s_ot, s_oh, s_lt, s_lh, s_pt, s_ph, s_plt, s_plh, left,
        GROUP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_SINKS: gl.constexpr,
        HAS_PREFIX: gl.constexpr, WRITE_LSE: gl.constexpr, M_SLOW: gl.constexpr,
        HAS_WINDOW: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        h, b, start_m, q0, nq, k0, nk = _program_block(CuQ, CuK, M_SLOW)
        min_i = start_m * (2 * BLOCK_M)
        if min_i >= nq:
            return
        delta = nk - nq
        n_load = gl.maximum(_half_tiles(min_i, nq, nk, delta, BLOCK_M, BLOCK_N),
                            _half_tiles(min_i + BLOCK_M, nq, nk, delta, BLOCK_M, BLOCK_N))
        # the lower half's window starts first; no tile at all if even that is past n_load
        t_start = gl.minimum(_half_first(min_i, delta, left, BLOCK_N, HAS_WINDOW), n_load)
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)
            mbarrier.init(v_empty.index(i), count=2)

        ops = ((q_desc, k_desc, v_desc, O, LSE, OP, LSEP, Sinks),
               (qk2, s_ot, s_oh, s_lt, s_lh, s_pt, s_ph, s_plt, s_plh))
        smem = (q_smem, k_smem, v_smem)
        bars = (q_bars, k_ready, v_ready, k_empty, v_empty)
        rows = (q0, nq, nk, min_i, h, delta, n_load, k0, h // GROUP, t_start, left)
        # the argument tuples are written out: a tuple bound to a name loses its constexprs
        gl.warp_specialize([
            (_consume_lo, (ops, smem, bars, rows, BLOCK_M, BLOCK_N, D, DV, STAGES, HAS_SINKS,
                           HAS_PREFIX, WRITE_LSE, HAS_WINDOW)),
            (_consume_hi, (ops, smem, bars, rows, BLOCK_M, BLOCK_N, D, DV, STAGES, HAS_SINKS,
                           HAS_PREFIX, WRITE_LSE, HAS_WINDOW)),
            (_load, (ops, smem, bars, rows, BLOCK_M, BLOCK_N, D, DV, STAGES, HAS_SINKS,
                     HAS_PREFIX, WRITE_LSE, HAS_WINDOW)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def launch_gluon_ws_prefill(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix, config, grid,
                            window=(-1, -1)):
    """Launch the warp-specialised kernel on ``grid`` (:meth:`.prefill.PrefillConfig.grid`
    with ``config.block_m == 128``: two 64-row consumers per program) after
    :func:`.prefill_gluon.gluon_reject_reason` returned ``None``. ``window``: flash-attn
    ``(left, right)`` of the causal layer (``left >= 0``: a left window). O(1) host work."""
    args, kw = gluon_launch_args(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix, config,
                                 config.block_m // 2)
    args += (int(window[0]) if window[0] >= 0 else 0,)
    kw.update(HAS_WINDOW=window[0] >= 0, CONSUMER_REGS=CONSUMER_REGS, LOADER_REGS=LOADER_REGS,
              num_warps=4, maxnreg=WS_MAXNREG)
    _GLUON_WS.launch(grid, args, kw, launch_key(args, kw))
    return out


#: direct launches of the warp-specialised kernel (:mod:`._launch`)
_GLUON_WS = Launcher(_gluon_ws_prefill_kernel) if HAS_GLUON else None
