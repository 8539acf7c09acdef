"""Absorbed-MLA decode (:mod:`.mla`) for few heads (up to 16) on sm_90, in Gluon: 32-key
tiles on ``mma.sync`` with q held in registers, so a three-slot ring fits twice per SM.

Both 16-head kernels before this one stop at about 80% of DRAM throughput at 64×4k
(docs/benchmarks.md, "Sixteenth session"): the Triton kernel spends ~670 instructions per
warp on each 32-key tile (per-thread copy addresses, q re-read from shared memory, three
block-wide barriers) and keeps q in shared memory, which leaves room for two tiles per
program; the narrow Gluon kernel (:mod:`.mla_narrow_gluon`) needs 64-key tiles (wgmma's M),
so only two fit beside q. Here one program (token ``t``, its ``H <= 16`` heads, one key
split), two programs per SM, runs in a single 4-warp partition::

    ring      _RING slots of 32 latent rows (36 KB), each as nine [32, 64] chunks in the
              128-byte swizzle (conflict-free ldmatrix for both dots), filled by TMA: nine
              boxes of gcd(page, 32) rows per page piece; tile j + _RING - 1 is issued as
              tile j starts (its slot was tile j - 1's)
    Sᵀ [32, HP] = c_nope · q_nopeᵀ + c_rope · q_ropeᵀ   (mma.sync m16n8k16, keys as M; qᵀ's
              nine 64-row chunks held in registers all along)
    Pᵀ = exp2(Sᵀ · qk2 - m)        (the maximum over keys: one cross-warp reduction)
    Oᵀ [512, HP] += c_nopeᵀ · Pᵀ   (the same chunks read transposed, ldmatrix.trans; eight
              [64, HP] accumulators)

The last tile of a split masks the keys past the token's last visible key and zeroes those
latent rows before ``P · V`` (NaN in unwritten slots cannot reach the output). The rows, or
the split partials of :mod:`.mla` (``o / l`` and the log2 LSE) for its merge kernel, are
stored from the accumulators.

An option of :class:`.mla.TritonMLA` (``tuning["ring"] = True``, ``mla_paged_attention(...,
ring=True)``); it serves what :func:`.mla_narrow_gluon.narrow_mla_reject_reason` allows.
"""

from __future__ import annotations

import math

from ._launch import Launcher, tensor_key
from .prefill_gluon import _LOG2E, HAS_GLUON, _smem_layout

__all__ = ["ring_mla_splits", "launch_ring_mla"]

_RANK, _ROPE, _BLOCK_N, _RING_SLOTS = 512, 64, 32, 3


def _box_rows(page_size: int) -> int:
    return math.gcd(int(page_size), _BLOCK_N)


def ring_mla_splits(tokens: int, max_k: int, sms: int) -> int:
    """Key splits: two programs per SM (each ring is 108 KB), each split at least four
    32-key tiles."""
    if tokens <= 0:
        return 1
    return max(1, min(2 * sms // tokens, -(-max_k // (4 * _BLOCK_N))))


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared,
                                                                  mbarrier, tma)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .decode_gluon import _pick, _tile_rows, _zero_rows
    from .mla_gluon import _token_split
    from .prefill_gluon import _to_output

    _RING = gl.constexpr(_RING_SLOTS)
    _BN = gl.constexpr(_BLOCK_N)

    @gluon.jit
    def _issue(kv_d, kv_s, bar, slot, cur, BOX: gl.constexpr, BOXES: gl.constexpr,
               lay: gl.constexpr):
        """TMA of one tile's latent rows (slot rows ``cur``) into ring slot ``slot``: nine
        ``[BOX, 64]`` boxes per page piece, one per 64-column chunk (``kv_s`` index
        ``slot · 9 + chunk``)."""
        offs = gl.arange(0, BOXES, layout=lay)
        mbarrier.expect(bar, _BN * 576 * kv_d.dtype.primitive_bitwidth // 8)
        for i in gl.static_range(BOXES):
            if BOXES == 1:  # one page piece: ``cur`` is its slot row already (a scalar)
                r = cur
            else:
                r = _pick(cur, offs, i)
            for c in gl.static_range(9):
                tma.async_copy_global_to_shared(kv_d, [r, c * 64], bar,
                                                kv_s.index(slot * 9 + c).slice(i * BOX, BOX,
                                                                               dim=0))

    @gluon.jit
    def _rows_of(bt_row, key0, last, PAGE: gl.constexpr, BOX: gl.constexpr,
                 BOXES: gl.constexpr, lay: gl.constexpr):
        """The slot rows of the tile from key ``key0``: a scalar when the tile lies in one
        page (no cross-warp pick), else :func:`.decode_gluon._tile_rows`'s vector."""
        if BOXES == 1:
            page = gl.load(bt_row + gl.minimum(key0 // PAGE, last))
            return page * PAGE + key0 % PAGE
        else:
            return _tile_rows(bt_row, key0, last, PAGE, BOX, BOXES, lay)

    @gluon.jit
    def _pv(kv_s, base, c: gl.constexpr, pt, acc, alpha, a_o: gl.constexpr):
        """``Oᵀ`` rows ``64c .. 64c + 63`` rescaled by ``alpha`` plus ``c_nope[:, chunk]ᵀ ·
        Pᵀ`` (ldmatrix.trans of the chunk's swizzled ``[32, 64]`` tile)."""
        vt = kv_s.index(base + c).permute((1, 0)).load(a_o)
        return mma_v2(vt, pt, acc * alpha[None, :])

    @gluon.jit
    def _store_rows(acc, c: gl.constexpr, inv, dst, ok, o_lay: gl.constexpr):
        """Latent dims ``64c .. 64c + 63`` of ``Oᵀ`` (``acc`` ``[64, HP]``) scaled by ``inv``
        (``[HP]``) to ``dst`` (``[1, HP]`` per-head row pointers, latent dims contiguous)."""
        d = c * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_lay))
        o = acc * inv[None, :]
        gl.store(dst + d[:, None], _to_output(o, dst.dtype.element_ty), mask=ok)

    @gluon.jit
    def _ring_mla_kernel(
        kv_d, q_ptr, out, part_o, part_l, lse_ptr, cu_q, seqused, bt,
        qk2, heads, batch, s_bt, s_qt, s_qh,
        s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh,
        HP: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr, CAUSAL: gl.constexpr,
        SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr, BLOCK_B: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        t = gl.program_id(0)
        split = gl.program_id(1)
        b, kv_len, lo, n64, valid64, _ = _token_split(cu_q, seqused, t, split, batch, SPLITS,
                                                      CAUSAL, BLOCK_B, num_warps)
        # 32-key tiles of the split's keys [lo, lo + 64 (n64 - 1) + valid64)
        n_keys = gl.maximum(n64 - 1, 0) * 64 + gl.where(n64 > 0, valid64, 0)
        n = gl.cdiv(n_keys, _BN)
        valid = n_keys - (n - 1) * _BN  # visible keys of the last tile
        dtype: gl.constexpr = kv_d.dtype

        s_lay: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[2, 2], instr_shape=[16, 8])
        o_lay: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        # two 16-bit elements along k per register (the mma's own packing): operands come
        # out of the swizzled ring by ldmatrix (k_width=8 read the scores' operands as
        # ld.shared.v4, 2-way bank-conflicted, and spilled)
        a_s: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_lay, k_width=2)
        b_s: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=s_lay, k_width=2)
        a_o: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_lay, k_width=2)
        b_o: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=o_lay, k_width=2)
        col_s: gl.constexpr = gl.SliceLayout(0, s_lay)
        row_s: gl.constexpr = gl.SliceLayout(1, s_lay)
        col_o: gl.constexpr = gl.SliceLayout(0, o_lay)

        # qᵀ [576, HP] in registers, nine 64-row chunks (heads past ``heads`` read zeros)
        hq = gl.arange(0, HP, layout=gl.SliceLayout(0, b_s))
        dq = gl.arange(0, 64, layout=gl.SliceLayout(1, b_s))
        q_row = (q_ptr + t.to(gl.int64) * s_qt + hq.to(gl.int64)[None, :] * s_qh
                 + dq[:, None])
        q_ok = (hq < heads)[None, :]
        q0 = gl.load(q_row, mask=q_ok, other=0.0)
        q1 = gl.load(q_row + 64, mask=q_ok, other=0.0)
        q2 = gl.load(q_row + 128, mask=q_ok, other=0.0)
        q3 = gl.load(q_row + 192, mask=q_ok, other=0.0)
        q4 = gl.load(q_row + 256, mask=q_ok, other=0.0)
        q5 = gl.load(q_row + 320, mask=q_ok, other=0.0)
        q6 = gl.load(q_row + 384, mask=q_ok, other=0.0)
        q7 = gl.load(q_row + 448, mask=q_ok, other=0.0)
        q8 = gl.load(q_row + 512, mask=q_ok, other=0.0)

        kv_s = gl.allocate_shared_memory(dtype, [_RING * 9, _BN, 64], kv_d.layout)
        ready = gl.allocate_shared_memory(gl.int64, [_RING, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(_RING):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()
        gl.thread_barrier()

        BOXES: gl.constexpr = _BN // BOX
        lay_b: gl.constexpr = gl.BlockedLayout([BOXES], [32], [num_warps], [0])
        bt_row = bt + b.to(gl.int64) * s_bt
        last = gl.maximum(gl.cdiv(kv_len, PAGE) - 1, 0)
        # the first _RING - 1 tiles, then the page rows of the next one to issue
        for i in gl.static_range(_RING - 1):
            if i < n:
                cur = _rows_of(bt_row, lo + i * _BN, last, PAGE, BOX, BOXES, lay_b)
                _issue(kv_d, kv_s, ready.index(i), i, cur, BOX, BOXES, lay_b)
        nxt = _rows_of(bt_row, lo + (_RING - 1) * _BN, last, PAGE, BOX, BOXES, lay_b)

        # Oᵀ [512, HP] as eight [64, HP] accumulators (one per latent chunk)
        acc0 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc1 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc2 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc3 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc4 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc5 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc6 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        acc7 = gl.zeros([64, HP], gl.float32, layout=o_lay)
        l_acc = gl.zeros([_BN, HP], gl.float32, layout=s_lay)
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=col_s)
        for j in range(n):
            # tile j + _RING - 1 into the slot tile j - 1 left (every warp is done with it)
            gl.thread_barrier()
            fence_async_shared()
            ahead = j + _RING - 1
            if ahead < n:
                _issue(kv_d, kv_s, ready.index(ahead % _RING), ahead % _RING, nxt, BOX, BOXES,
                       lay_b)
                nxt = _rows_of(bt_row, lo + (ahead + 1) * _BN, last, PAGE, BOX, BOXES, lay_b)
            slot = j % _RING
            base = slot * 9
            mbarrier.wait(ready.index(slot), (j // _RING) & 1)
            if j == n - 1:
                if valid < _BN:  # past the last visible key: zero latent rows
                    for c in gl.static_range(8):
                        _zero_rows(kv_s.index(base + c), valid, _BN, 64)
                    gl.thread_barrier()
            # Sᵀ, two accumulators (independent mma chains)
            sa = gl.zeros([_BN, HP], gl.float32, layout=s_lay)
            sb = gl.zeros([_BN, HP], gl.float32, layout=s_lay)
            sa = mma_v2(kv_s.index(base).load(a_s), q0, sa)
            sb = mma_v2(kv_s.index(base + 1).load(a_s), q1, sb)
            sa = mma_v2(kv_s.index(base + 2).load(a_s), q2, sa)
            sb = mma_v2(kv_s.index(base + 3).load(a_s), q3, sb)
            sa = mma_v2(kv_s.index(base + 4).load(a_s), q4, sa)
            sb = mma_v2(kv_s.index(base + 5).load(a_s), q5, sb)
            sa = mma_v2(kv_s.index(base + 6).load(a_s), q6, sa)
            sb = mma_v2(kv_s.index(base + 7).load(a_s), q7, sb)
            sa = mma_v2(kv_s.index(base + 8).load(a_s), q8, sa)
            s = sa + sb
            if j == n - 1:
                kpos = gl.arange(0, _BN, layout=row_s)
                s = gl.where(kpos[:, None] < valid, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, 0) * qk2)
            p = gl.exp2(s * qk2 - m_new[None, :])
            alpha = gl.exp2(m_i - m_new)
            l_acc = l_acc * alpha[None, :] + p
            m_i = m_new
            alpha_o = gl.convert_layout(alpha, col_o)
            pt = gl.convert_layout(p.to(dtype), b_o)
            acc0 = _pv(kv_s, base, 0, pt, acc0, alpha_o, a_o)
            acc1 = _pv(kv_s, base, 1, pt, acc1, alpha_o, a_o)
            acc2 = _pv(kv_s, base, 2, pt, acc2, alpha_o, a_o)
            acc3 = _pv(kv_s, base, 3, pt, acc3, alpha_o, a_o)
            acc4 = _pv(kv_s, base, 4, pt, acc4, alpha_o, a_o)
            acc5 = _pv(kv_s, base, 5, pt, acc5, alpha_o, a_o)
            acc6 = _pv(kv_s, base, 6, pt, acc6, alpha_o, a_o)
            acc7 = _pv(kv_s, base, 7, pt, acc7, alpha_o, a_o)
        l_i = gl.convert_layout(gl.sum(l_acc, 0), col_o)
        m_o = gl.convert_layout(m_i, col_o)

        # the rows (or the split partials: o / l and the log2 LSE)
        t64 = t.to(gl.int64)
        h = gl.arange(0, HP, layout=col_o)
        h_ok = h < heads
        h64 = h.to(gl.int64)
        has = l_i > 0.0
        l_safe = gl.where(has, l_i, 1.0)
        inv = 1.0 / l_safe
        ok = h_ok[None, :]
        if SPLITS == 1:
            dst = out + t64 * s_ot + h64[None, :] * s_oh
        else:
            dst = part_o + t64 * s_pt + h64[None, :] * s_ph + split.to(gl.int64) * s_ps
        _store_rows(acc0, 0, inv, dst, ok, o_lay)
        _store_rows(acc1, 1, inv, dst, ok, o_lay)
        _store_rows(acc2, 2, inv, dst, ok, o_lay)
        _store_rows(acc3, 3, inv, dst, ok, o_lay)
        _store_rows(acc4, 4, inv, dst, ok, o_lay)
        _store_rows(acc5, 5, inv, dst, ok, o_lay)
        _store_rows(acc6, 6, inv, dst, ok, o_lay)
        _store_rows(acc7, 7, inv, dst, ok, o_lay)
        lse2 = gl.where(has, m_o + gl.log2(l_safe), float("-inf"))
        if SPLITS == 1:
            if WRITE_LSE:
                gl.store(lse_ptr + t64 * s_et + h64 * s_eh, lse2 * 0.6931471805599453,
                         mask=h_ok)
        else:
            gl.store(part_l + t64 * s_lt + h64 * s_lh + split.to(gl.int64), lse2, mask=h_ok)


def _descriptors(kv_cache):
    p, ps, _, d = kv_cache.shape
    rows = kv_cache.as_strided((p * ps, d), (kv_cache.stride(1), 1))
    box = _box_rows(ps)
    return GluonDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [box, 64],
                           _smem_layout(box, 64, kv_cache.dtype))


def launch_ring_mla(q, kv_cache, out, cu_q, seqused_k, block_table, scale, *, splits: int,
                    batch: int, causal: bool, lse=None, part_o=None, part_lse=None):
    """One launch over ``(tokens, splits)`` programs; with ``splits > 1`` it writes
    ``part_o`` ``[T, H, S, R]`` / ``part_lse`` ``[T, H, S]`` (:mod:`.mla`'s partials) for
    its merge kernel. The caller checked
    :func:`.mla_narrow_gluon.narrow_mla_reject_reason`,
    :func:`.mla_narrow_gluon.narrow_mla_layout_reason` and unit last-dim strides of q and
    out."""
    t, h, _ = q.shape
    kv_d = _descriptors(kv_cache)
    po = part_o if part_o is not None else out
    pl = part_lse if part_lse is not None else out
    ps_o = part_o.stride()[:3] if part_o is not None else (0, 0, 0)
    ps_l = part_lse.stride()[:2] if part_lse is not None else (0, 0)
    ls = lse.stride() if lse is not None else (0, 0)
    args = (kv_d, q, out, po, pl, lse if lse is not None else out, cu_q, seqused_k,
            block_table, float(scale) * _LOG2E, h, batch, block_table.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *ps_o, *ps_l, *ls)
    kw = dict(HP=16, PAGE=kv_cache.shape[1], BOX=_box_rows(kv_cache.shape[1]),
              CAUSAL=bool(causal), SPLITS=int(splits), WRITE_LSE=lse is not None,
              BLOCK_B=max(2, 1 << max(0, (batch - 1).bit_length())), num_warps=4)
    key = (tuple(tensor_key(a) if hasattr(a, "data_ptr") else None for a in args[1:9]),
           args[10:], tuple(sorted(kw.items())), kv_cache.dtype, tuple(kv_d.block_shape))
    _RING_LAUNCH.launch((t, int(splits)), args, kw, key)
    return out


#: direct launches (:mod:`._launch`)
_RING_LAUNCH = Launcher(_ring_mla_kernel) if HAS_GLUON else None
