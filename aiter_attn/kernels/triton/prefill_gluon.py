"""The dense causal prefill of :mod:`.prefill` written in Gluon (Triton's explicit-layout
dialect) for sm_90, so that one warpgroup overlaps its softmax with the tensor cores.

Same math, inputs and epilogue as :func:`.prefill.dense_prefill` (LSE out, sinks counted
once, the prefix merge), restricted to the fast path: causal, no window, no soft-cap,
fp16/bf16, ``D == DV`` in {64, 128}, TMA-able (head-contiguous, 16-byte aligned) inputs and
a plain grid (no ragged search). :func:`gluon_reject_reason` says why a launch falls back to
the Triton kernel.

Schedule of one program (one warpgroup, ``BLOCK_M`` query rows of one head, key tiles of
``BLOCK_N``; K and V each in a ring of ``STAGES`` shared-memory slots filled by TMA)::

    S_0 = Q K_0^T ; P_0 = softmax(S_0)
    for j in 1 .. n-1:
        issue  S_j = Q K_j^T            (async wgmma)
        issue  O  = alpha_{j-1} O + P_{j-1} V_{j-1}   (async wgmma)
        wait   S_j; refill K_j's slot
        P_j = softmax(S_j)               <- runs while the tensor cores finish P_{j-1} V_{j-1}
        wait   O; refill V_{j-1}'s slot
    O = alpha_{n-1} O + P_{n-1} V_{n-1}

Triton's own pipeliner waits for each ``q · k^T`` right after issuing it (checked in the
sm_90 TTGIR: ``warp_group_dot_wait {pendings = 0}``), so there the softmax and the tensor
cores of one program never overlap; here they do. Also measured on the H200 and dropped
(docs/benchmarks.md, tenth session): keeping ``S_{j+1}`` in flight too (170 registers, no
faster) and a persistent form carrying the rings across blocks (slower).

Tiles crossing the causal diagonal or the request's last key are masked (one uniform
branch per tile); others run no mask arithmetic. A row that sees no key has ``m = -inf``
handled as in the Triton kernel (output 0, LSE -inf, unless a sink or prefix weighs in).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

try:  # Triton >= 3.5 with Gluon's Hopper dialect
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    HAS_GLUON = True
except ImportError:  # pragma: no cover - older Triton
    HAS_GLUON = False

from ._launch import Launcher, launch_key

__all__ = ["HAS_GLUON", "sm90_gluon_reason", "gluon_reject_reason", "gluon_launch_args", "launch_gluon_prefill"]

_LOG2E = 1.4426950408889634
_GL_DTYPES = {}


def sm90_gluon_reason(device, dtype=None, kv_dtype=None) -> Optional[str]:
    """The part every Gluon kernel's reject reason shares (``None``: fine): this Triton has
    the Gluon Hopper dialect, ``device`` is an NVIDIA sm_90 GPU and, when ``dtype`` is given,
    q (``dtype``) and the cache (``kv_dtype``) are both fp16 or both bf16. Host checks only."""
    from .prefill import _capability

    if not HAS_GLUON:
        return "this Triton has no Gluon Hopper dialect"
    if device.type != "cuda" or torch.version.hip is not None or _capability(device)[0] != 9:
        return "needs an NVIDIA sm_90 GPU"
    if dtype is not None and (dtype not in (torch.float16, torch.bfloat16)
                              or kv_dtype != dtype):
        return f"q {dtype} / cache {kv_dtype} (fp16/bf16, the same for both)"
    return None


def gluon_reject_reason(q, k, v, *, causal, window, softcap, search, config) -> Optional[str]:
    """Why the Gluon kernel cannot serve this launch (``None``: it can). Host checks only."""
    from .prefill import tma_ok

    why = sm90_gluon_reason(q.device)
    if why is not None:
        return why
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype:
        return f"dtype {q.dtype} (fp16/bf16 only)"
    d, dv = q.shape[2], v.shape[2]
    if d != dv or d not in (64, 128):
        return f"head dims {d}/{dv} (equal, 64 or 128)"
    if not causal or softcap > 0:
        return "soft-cap and non-causal layers stay on the Triton kernel"
    if tuple(window) != (-1, -1) and not config.warp_specialize:
        return "window: the warp-specialised form only (PrefillConfig.warp_specialize)"
    if search:
        return "ragged grids (request search) stay on the Triton kernel"
    if config.warp_specialize:
        if config.block_m != 128 or config.num_warps != 4:
            return ("warp-specialised: two consumers of 64 rows (block_m 128, num_warps 4, "
                    "the default partition's)")
    elif config.num_warps not in (4, 8) or config.block_m != 16 * config.num_warps:
        return "one or two warpgroups of 64 rows (block_m 64 with 4 warps, 128 with 8)"
    if not (tma_ok(q, d) and tma_ok(k, d) and tma_ok(v, dv)):
        return "inputs not TMA-able (head-contiguous, 16-byte aligned)"
    return None


if HAS_GLUON:
    _GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}

    @gluon.jit
    def _to_output(o, dtype: gl.constexpr):
        """Finished float32 rows ``o`` cast to ``dtype`` (the Gluon kernels' output stores;
        :func:`._softmax.to_output` of the Triton kernels): an fp16 output is clamped to
        ±65504 first, since a row ``Σ p16·v / Σ p`` runs up to 2^-11 past the values it
        averages and would round to inf. The comparisons are false for NaN, so NaN stays
        NaN; bf16 takes the plain cast (a compile-time branch)."""
        if dtype == gl.float16:
            o = gl.where(o > 65504.0, 65504.0, gl.where(o < -65504.0, -65504.0, o))
        return o.to(dtype)

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, qk2, start_n, pos_q, nk, masked,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Online-softmax step of raw logits ``s`` ``[BLOCK_M, BLOCK_N]`` (log2 domain):
        ``(p, m_new, l_new, alpha)``; ``masked``: apply the length and causal mask."""
        if masked:
            kpos = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            vis = (kpos[None, :] < nk) & (kpos[None, :] <= pos_q[:, None])
            s = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s * qk2 - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _tiles_pv_overlap(acc, m_i, l_i, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc,
                          k0, kvh, n_tiles, f_hi, pos_q, nk, qk2, s_zero, D: gl.constexpr,
                          DV: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                          dtype: gl.constexpr, s_layout: gl.constexpr, row_o: gl.constexpr,
                          p_layout: gl.constexpr):
        """The key loop (see the module docstring): ``P_j = softmax(S_j)`` overlaps
        ``P_{j-1} V_{j-1}`` (``S_j`` is waited for first). ``n_tiles >= 1``. Returns
        ``(acc, m_i, l_i)``."""
        mbarrier.wait(k_bars.index(0), 0)
        s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        nxt = STAGES < n_tiles
        mbarrier.expect(k_bars.index(0), k_desc.block_type.nbytes, pred=nxt)
        tma.async_copy_global_to_shared(k_desc, [k0 + STAGES * BLOCK_N, kvh * D],
                                        k_bars.index(0), k_smem.index(0), pred=nxt)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk2, 0, pos_q, nk,
                                           BLOCK_N > f_hi, BLOCK_N, s_layout)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for j in range(1, n_tiles):
            slot = j % STAGES
            phase = (j // STAGES) & 1
            prev = (j - 1) % STAGES
            prev_phase = ((j - 1) // STAGES) & 1
            mbarrier.wait(k_bars.index(slot), phase)
            s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_bars.index(prev), prev_phase)
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            refill = j + STAGES < n_tiles
            mbarrier.expect(k_bars.index(slot), k_desc.block_type.nbytes, pred=refill)
            tma.async_copy_global_to_shared(k_desc, [k0 + (j + STAGES) * BLOCK_N, kvh * D],
                                            k_bars.index(slot), k_smem.index(slot),
                                            pred=refill)
            start_n = j * BLOCK_N
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk2, start_n, pos_q, nk,
                                               start_n + BLOCK_N > f_hi, BLOCK_N, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            refill_v = j - 1 + STAGES < n_tiles
            mbarrier.expect(v_bars.index(prev), v_desc.block_type.nbytes, pred=refill_v)
            tma.async_copy_global_to_shared(v_desc,
                                            [k0 + (j - 1 + STAGES) * BLOCK_N, kvh * DV],
                                            v_bars.index(prev), v_smem.index(prev),
                                            pred=refill_v)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = (n_tiles - 1) % STAGES
        mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc_tok = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
        return acc, m_i, l_i

    @gluon.jit
    def _epilogue(acc, m_i, l_i, O, LSE, OP, LSEP, Sinks, q0, nq, min_i, h, s_ot, s_oh, s_lt,
                  s_lh, s_pt, s_ph, s_plt, s_plh, BLOCK_M: gl.constexpr, DV: gl.constexpr,
                  HAS_SINKS: gl.constexpr, HAS_PREFIX: gl.constexpr, WRITE_LSE: gl.constexpr,
                  row_o: gl.constexpr, col_o: gl.constexpr):
        """The Triton kernel's epilogue: the sink once, the prefix merge, normalise, store
        the rows ``< nq`` of the block at ``min_i`` (and their natural-log LSE)."""
        m_o = gl.convert_layout(m_i, row_o)
        l_o = gl.convert_layout(l_i, row_o)
        offs_m = min_i + gl.arange(0, BLOCK_M, layout=row_o)
        offs_dv = gl.arange(0, DV, layout=col_o)
        row_ok = offs_m < nq
        q_rows = (q0 + offs_m).to(gl.int64)
        if HAS_SINKS:
            sink = gl.load(Sinks + h).to(gl.float32) * 1.4426950408889634
            m_new = gl.maximum(m_o, sink)
            a_s = gl.exp2(m_o - m_new)
            l_o = l_o * a_s + gl.exp2(sink - m_new)
            acc = acc * a_s[:, None]
            m_o = m_new
        if HAS_PREFIX:
            lp = gl.load(LSEP + q_rows * s_plt + h * s_plh, mask=row_ok,
                         other=float("-inf")) * 1.4426950408889634
            op = gl.load(OP + q_rows[:, None] * s_pt + h * s_ph + offs_dv[None, :],
                         mask=row_ok[:, None], other=0.0).to(gl.float32)
            m_new = gl.maximum(m_o, lp)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            a_o = gl.exp2(m_o - m_safe)
            w_p = gl.exp2(lp - m_safe)
            acc = acc * a_o[:, None] + gl.where(w_p[:, None] > 0.0, w_p[:, None] * op, 0.0)
            l_o = l_o * a_o + w_p
            m_o = m_new
        l_safe = gl.where(l_o > 0.0, l_o, 1.0)
        o = acc / l_safe[:, None]
        gl.store(O + q_rows[:, None] * s_ot + h * s_oh + offs_dv[None, :],
                 _to_output(o, O.dtype.element_ty), mask=row_ok[:, None])
        if WRITE_LSE:
            lse = gl.where(l_o > 0.0, (m_o + gl.log2(l_safe)) * 0.6931471805599453,
                           float("-inf"))
            gl.store(LSE + q_rows * s_lt + h * s_lh, lse, mask=row_ok)


    @gluon.jit
    def _program_block(CuQ, CuK, M_SLOW: gl.constexpr):
        """``(h, b, start_m, q0, nq, k0, nk)`` of this program: its head, request and query
        block (the grid of :meth:`.prefill.PrefillConfig.grid`, longest blocks first) and
        the request's query/key offsets and lengths."""
        if M_SLOW:
            h = gl.program_id(0)
            b = gl.program_id(1)
            start_m = gl.num_programs(2) - 1 - gl.program_id(2)
        else:
            start_m = gl.num_programs(0) - 1 - gl.program_id(0)
            h = gl.program_id(1)
            b = gl.program_id(2)
        q0 = gl.load(CuQ + b)
        nq = gl.load(CuQ + b + 1) - q0
        k0 = gl.load(CuK + b)
        nk = gl.load(CuK + b + 1) - k0
        return h, b, start_m, q0, nq, k0, nk

    @gluon.jit
    def _gluon_prefill_kernel(
        q_desc, k_desc, v_desc, O, LSE, OP, LSEP, Sinks, CuQ, CuK,
        qk2, s_ot, s_oh, s_lt, s_lh, s_pt, s_ph, s_plt, s_plh,
        GROUP: gl.constexpr, D: gl.constexpr, DV: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_SINKS: gl.constexpr,
        HAS_PREFIX: gl.constexpr, WRITE_LSE: gl.constexpr, M_SLOW: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        h, b, start_m, q0, nq, k0, nk = _program_block(CuQ, CuK, M_SLOW)
        min_i = start_m * BLOCK_M
        if min_i >= nq:
            return
        kvh = h // GROUP
        delta = nk - nq
        max_i = gl.minimum(min_i + BLOCK_M, nq) - 1
        hi = gl.maximum(gl.minimum(nk, max_i + delta + 1), 0)  # keys any row may see
        f_hi = gl.minimum(nk, min_i + delta + 1)  # keys every row sees
        n_tiles = gl.cdiv(hi, BLOCK_N)

        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0 + min_i, h * D], q_bar, q_smem)
        for i in gl.static_range(STAGES):
            live = i < n_tiles
            mbarrier.expect(k_bars.index(i), k_desc.block_type.nbytes, pred=live)
            tma.async_copy_global_to_shared(k_desc, [k0 + i * BLOCK_N, kvh * D],
                                            k_bars.index(i), k_smem.index(i), pred=live)
            mbarrier.expect(v_bars.index(i), v_desc.block_type.nbytes, pred=live)
            tma.async_copy_global_to_shared(v_desc, [k0 + i * BLOCK_N, kvh * DV],
                                            v_bars.index(i), v_smem.index(i), pred=live)

        pos_q = min_i + gl.arange(0, BLOCK_M, layout=row_s) + delta
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, DV], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(q_bar, 0)
        if n_tiles > 0:
            acc, m_i, l_i = _tiles_pv_overlap(
                acc, m_i, l_i, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, k0, kvh,
                n_tiles, f_hi, pos_q, nk, qk2, s_zero, D, DV, BLOCK_N, STAGES, dtype, s_layout,
                row_o, p_layout)
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        _epilogue(acc, m_i, l_i, O, LSE, OP, LSEP, Sinks, q0, nq, min_i, h, s_ot, s_oh, s_lt,
                  s_lh, s_pt, s_ph, s_plt, s_plh, BLOCK_M, DV, HAS_SINKS, HAS_PREFIX,
                  WRITE_LSE, row_o, col_o)


def gluon_launch_args(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix, config,
                      q_rows: int) -> tuple:
    """``(args, kw)`` both Gluon dense kernels start from: the TMA descriptors (``q_rows``
    query rows per descriptor block), the epilogue operands and the shared constexprs
    (``BLOCK_M = q_rows``). O(1) host work."""
    from .prefill import epilogue_operands

    num_tokens, hq, d = q.shape
    tk, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    bn = config.block_n
    q_l = _smem_layout(q_rows, d, q.dtype)
    kv_l = _smem_layout(bn, d, q.dtype)
    qd = GluonDescriptor(q, [num_tokens, hq * d], [q.stride(0), 1], [q_rows, d], q_l)
    kd = GluonDescriptor(k, [tk, hkv * d], [k.stride(0), 1], [bn, d], kv_l)
    vd = GluonDescriptor(v, [tk, hkv * dv], [v.stride(0), 1], [bn, dv], kv_l)
    lse_t, ls, op, lp, ps, pls = epilogue_operands(out, lse, prefix)
    os_ = out.stride()
    args = (qd, kd, vd, out, lse_t, op, lp, sinks if sinks is not None else cu_q, cu_q, cu_k,
            float(scale) * _LOG2E, os_[0], os_[1], ls[0], ls[1], ps[0], ps[1], pls[0], pls[1])
    kw = dict(GROUP=hq // hkv, D=d, DV=dv, BLOCK_M=q_rows, BLOCK_N=bn,
              STAGES=max(2, config.num_stages), HAS_SINKS=sinks is not None,
              HAS_PREFIX=prefix is not None, WRITE_LSE=lse is not None, M_SLOW=config.m_slow)
    return args, kw


def launch_gluon_prefill(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix, config, grid):
    """Launch the Gluon kernel on ``grid`` (:meth:`.prefill.PrefillConfig.grid`, non-search)
    after :func:`gluon_reject_reason` returned ``None``. O(1) host work."""
    args, kw = gluon_launch_args(q, k, v, out, cu_q, cu_k, scale, sinks, lse, prefix, config,
                                 config.block_m)
    kw["num_warps"] = config.num_warps
    _GLUON.launch(grid, args, kw, launch_key(args, kw))
    return out


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    """The TMA/wgmma shared layout of a ``[rows, cols]`` tile (cached: a host-side object
    built per launch otherwise)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], _GL_DTYPES[dtype])


#: direct launches of the Gluon kernel (:mod:`._launch`)
_GLUON = Launcher(_gluon_prefill_kernel) if HAS_GLUON else None
