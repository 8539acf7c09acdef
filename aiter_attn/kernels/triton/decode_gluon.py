"""Decode (one query token per request) over NHD pages on sm_90, in Gluon: TMA page loads
and ``wgmma`` with the key tile as the M operand.

The Triton kernel (:mod:`.paged_attention`) packs a KV head's ``G`` query heads into the
rows of ``mma.sync`` tiles of 16 and loads every K/V row with per-thread ``cp.async`` and
its own address arithmetic: at 16×4k it issues as fast as cuDNN's kernel and still trails
it, because a key tile takes more instructions (docs/benchmarks.md, "Issue 14"). Here one
program (request ``b``, KV head ``h``, key split ``s``) runs::

    loader (1 warp)          page ids of a tile (one vector load, a tile ahead), then one
                             TMA box of ``BOX = gcd(page_size, BLOCK_N)`` rows per page
                             piece for K and for V into a ring of ``STAGES`` slots
                             (without splits the program issues the first tile itself,
                             before the request's key count arrives)
    consumer c (4 warps,     tiles j ≡ c (mod NC), each with its own running state:
    NC of them)                S^T [BLOCK_N, GP] = K_j · Q^T           (wgmma, A = K tile)
                               P^T = exp2(S^T · qk2 - m)               (max over keys:
                                                                       one column reduction)
                               O^T [D, GP] += V_j^T · P^T              (wgmma, A = V tile
                                                                       read transposed)

``GP`` is the group padded to the wgmma N of 8 or 16 (its extra columns read zeros); the
keys fill the 64-row M side, so no row of a tensor-core tile is padding. The row sums are
kept per element (``l_acc``, summed once at the end), so a tile pays one cross-warp
reduction (the maximum). With two consumers, consumer 1 hands its ``(m, l, O)`` to
consumer 0 through shared memory at the end, which writes the output (or the split
partial of :mod:`.paged_attention`, merged by its reduction kernel).

The last tile of a split masks keys past the request's end to ``-inf`` and zeroes those
value rows in shared memory before ``P · V``: an unwritten slot may hold NaN bits, and a
piece of a tile past the request's pages reads the request's last page again (or, in a
split's first tile, whatever page its block-table entry names: never written, only masked).

Serves (:func:`gluon_decode_reject_reason`): NVIDIA sm_90, fp16/bf16 q and cache of the
same dtype, ``D == DV`` in {64, 128, 256}, up to 16 query heads per KV head, page sizes with
``gcd(page_size, BLOCK_N) >= 16`` (with 64-key tiles: multiples of 16), NHD pages whose
rows are TMA-able, no sinks / soft-cap / window / scales / custom mask, not
batch-invariant. Everything else runs the Triton kernel.
"""

from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

from ._kvutil import next_pow2
from ._launch import Launcher, launch_key, tensor_key
from .paged_attention import _reduce_splits_kernel
from .prefill_gluon import _LOG2E, HAS_GLUON, _smem_layout, sm90_gluon_reason

__all__ = ["gluon_decode_reject_reason", "gluon_decode_layout_reason", "launch_gluon_decode",
           "gluon_decode", "cache_descriptors", "choose_splits", "plan_part",
           "run_planned",
           "GluonDecodeConfig"]

@attrs.frozen
class GluonDecodeConfig:
    """Tile shape of a launch (benchmarks and tests; the library launches
    :data:`DEFAULT_CONFIG`).

    Attributes:
        block_n: keys per tile (64 or 128: wgmma's M side).
        stages: ring slots of K and V tiles.
        consumers: consumer warpgroups (1 or 2) taking alternate tiles.
        maxnreg: the launch's register cap, also the worker consumer's share. On the H200
            two consumers ran at 128 only: caps of 80 and 168 faulted at launch
            (docs/benchmarks.md, "Fifteenth session").
    """

    block_n: int = attrs.field(default=64, converter=int)
    stages: int = attrs.field(default=4, converter=int)
    consumers: int = attrs.field(default=2, converter=int)
    maxnreg: int = attrs.field(default=128, converter=int)


#: the launch configuration of the library's decode (H200, fortysixth to fiftysecond calls:
#: docs/benchmarks.md "Fifteenth session")
DEFAULT_CONFIG = GluonDecodeConfig()


def choose_splits(programs: int, max_k: int, sms: int, block_n: int = 64) -> int:
    """Key splits of a decode launch of ``programs`` (request, KV head) programs: enough
    for one program per SM (the ring takes one SM's shared memory), each split at least
    four tiles of the longest request."""
    if programs <= 0:
        return 1
    return max(1, min(sms // programs, -(-max_k // (4 * block_n))))


def _box_rows(page_size: int, block_n: int) -> int:
    return math.gcd(int(page_size), int(block_n))


def gluon_decode_reject_reason(*, q_heads: int, kv_heads: int, head_dim: int,
                               v_head_dim: int, dtype, kv_dtype, page_size: int, device,
                               block_n: int = 64) -> Optional[str]:
    """Why the Gluon decode kernel cannot serve a layer group (``None``: it can). Host
    integers only; :func:`gluon_decode_layout_reason` checks the tensors."""
    why = sm90_gluon_reason(device, dtype, kv_dtype)
    if why is not None:
        return why
    if head_dim != v_head_dim or head_dim not in (64, 128, 256):
        return f"head dims {head_dim}/{v_head_dim} (equal, 64, 128 or 256)"
    if q_heads % kv_heads or q_heads // kv_heads > 16:
        return f"{q_heads} query heads over {kv_heads} KV heads (at most 16 per KV head)"
    if _box_rows(page_size, block_n) < 16:
        return f"page size {page_size} (gcd with the {block_n}-key tile must be >= 16)"
    return None


def gluon_decode_layout_reason(q, k_cache, v_cache, out) -> Optional[str]:
    """The launch-time half of the check (``None``: fine): NHD pages whose token rows are
    16-byte aligned and ``page_size`` rows apart (TMA over ``[slots, Hkv · D]``), slot
    indices within int32, unit head-dim strides of q and out."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        p, ps, hkv, d = c.shape
        s = c.stride()
        if s[3] != 1 or s[2] != d or s[0] != ps * s[1] or s[1] < hkv * d:
            return f"{name} is not NHD pages with contiguous heads"
        if (s[1] * c.element_size()) % 16 or c.data_ptr() % 16:
            return f"{name} token rows not 16-byte aligned"
        if p * ps >= 2 ** 31:
            return f"{name} has more than 2^31 slots"
    if q.stride(2) != 1 or out.stride(2) != 1:
        return "q / out head-dim axis not contiguous"
    return None


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from .prefill_gluon import _to_output

    @gluon.jit
    def _tile_rows(bt_row, key0, last, PAGE: gl.constexpr, BOX: gl.constexpr,
                   BOXES: gl.constexpr, lay: gl.constexpr):
        """Slot row of each ``BOX``-row piece of the tile starting at key ``key0``
        (``[BOXES]`` int32), page indices clamped to ``last``. A piece past the request's
        pages reads whatever its block-table entry holds (an in-range page: any values,
        masked by the consumer; out of range: TMA fills zeros)."""
        offs = gl.arange(0, BOXES, layout=lay)
        keys = key0 + offs * BOX
        page = gl.load(bt_row + gl.minimum(keys // PAGE, last))
        return page * PAGE + keys % PAGE

    @gluon.jit
    def _pick(v, offs, i):
        """Element ``i`` of a small per-thread vector as a scalar."""
        return gl.sum(gl.where(offs == i, v, 0), axis=0)

    @gluon.jit
    def _issue_tile(k_d, v_d, k_s, v_s, bar, slot, cur, offs, col, BOX: gl.constexpr,
                    BOXES: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """TMA of one tile's K and V pieces (slot rows ``cur``) into ring slot ``slot``."""
        mbarrier.expect(bar, 2 * BLOCK_N * D * k_d.dtype.primitive_bitwidth // 8)
        for i in gl.static_range(BOXES):
            r = _pick(cur, offs, i)
            tma.async_copy_global_to_shared(k_d, [r, col], bar,
                                            k_s.index(slot).slice(i * BOX, BOX, dim=0))
            tma.async_copy_global_to_shared(v_d, [r, col], bar,
                                            v_s.index(slot).slice(i * BOX, BOX, dim=0))

    @gluon.jit
    def _load(ops, smem, bars, rows, G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NC: gl.constexpr,
              PAGE: gl.constexpr, BOX: gl.constexpr, SPLITS: gl.constexpr,
              WRITE_LSE: gl.constexpr):
        """Loader (1 warp): every tile of the split (without splits, every tile after the
        first, which the program issued before its key count arrived), its page ids read a
        tile ahead."""
        k_d, v_d = ops[0][0], ops[0][1]
        k_s, v_s = smem[1], smem[2]
        ready, empty = bars[0], bars[1]
        bt_row, lo, n, last, h = rows[2], rows[3], rows[4], rows[6], rows[7]
        BOXES: gl.constexpr = BLOCK_N // BOX
        START: gl.constexpr = 1 if SPLITS == 1 else 0
        lay: gl.constexpr = gl.BlockedLayout([BOXES], [32], [1], [0])
        offs = gl.arange(0, BOXES, layout=lay)
        col = h * D
        nxt = _tile_rows(bt_row, lo + START * BLOCK_N, last, PAGE, BOX, BOXES, lay)
        for j in range(START, n):
            cur = nxt
            nxt = _tile_rows(bt_row, lo + (j + 1) * BLOCK_N, last, PAGE, BOX, BOXES, lay)
            slot = j % STAGES
            mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
            _issue_tile(k_d, v_d, k_s, v_s, ready.index(slot), slot, cur, offs, col, BOX,
                        BOXES, BLOCK_N, D)
        if START == 1:
            if n == 0:  # nobody consumes the early tile: let it land before the exit
                mbarrier.wait(ready.index(0), 0)

    @gluon.jit
    def _zero_rows(buf, valid, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """Rows ``>= valid`` of a ``[BLOCK_N, D]`` tile set to 0, 64 columns at a time."""
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
        keep = (r < valid)[:, None]
        for c in gl.static_range(D // 64):
            part = buf.slice(c * 64, 64, dim=1)
            x = part.load(lay)
            part.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _mask_tail(s, vbuf, valid, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   row: gl.constexpr):
        """A split's last tile: keys ``>= valid`` get no logit (``s`` ``[BLOCK_N, N]``,
        keys on rows) and a zero value row in ``vbuf`` (``[BLOCK_N, D]`` in shared memory,
        visible to the next wgmma). Returns ``s``."""
        kpos = gl.arange(0, BLOCK_N, layout=row)
        s = gl.where(kpos[:, None] < valid, s, float("-inf"))
        _zero_rows(vbuf, valid, BLOCK_N, D)
        fence_async_shared()
        gl.thread_barrier()
        return s

    @gluon.jit
    def _keys_softmax(s, m_i, l_acc, acc, qk2):
        """Online softmax of one tile whose keys are the rows of ``s`` ``[BLOCK_N, N]``
        (raw logits; ``qk2`` = scale · log2 e): ``(p, m, l_acc, acc)`` with the running
        maximum ``m`` ``[N]``, the per-element row sums ``l_acc`` and the accumulator
        ``acc`` ``[D, N]`` rescaled to the new maximum."""
        m_new = gl.maximum(m_i, gl.max(s, 0) * qk2)
        p = gl.exp2(s * qk2 - m_new[None, :])
        alpha = gl.exp2(m_i - m_new)
        return p, m_new, l_acc * alpha[None, :] + p, acc * alpha[None, :]

    @gluon.jit
    def _hand_over(C: gl.constexpr, m_i, l_i, acc, m_x, l_x, o_x, done, col: gl.constexpr,
                   lay: gl.constexpr, phase=0):
        """Two consumers' states merged: consumer 1 stores ``(m, l, O)`` in ``m_x`` /
        ``l_x`` / ``o_x`` and signals ``done``; consumer 0 waits (``done``'s ``phase``: the
        hand-over's count, mod 2, for a kernel that hands over more than once) and returns
        the merged ``(m, l, O)`` (consumer 1 returns its own, unused)."""
        if C == 1:
            m_x.store(m_i)
            l_x.store(l_i)
            o_x.store(acc)
            gl.thread_barrier()
            mbarrier.arrive(done, count=1)
        else:
            mbarrier.wait(done, phase)
            m_1 = m_x.load(col)
            l_1 = l_x.load(col)
            o_1 = o_x.load(lay)
            m_n = gl.maximum(m_i, m_1)
            m_safe = gl.where(m_n == float("-inf"), 0.0, m_n)
            a_0 = gl.exp2(m_i - m_safe)
            a_1 = gl.exp2(m_1 - m_safe)
            acc = acc * a_0[None, :] + o_1 * a_1[None, :]
            l_i = l_i * a_0 + l_1 * a_1
            m_i = m_n
        return m_i, l_i, acc

    @gluon.jit
    def _consume(ops, smem, bars, rows, C: gl.constexpr, G: gl.constexpr,
                 GP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, NC: gl.constexpr, SPLITS: gl.constexpr,
                 WRITE_LSE: gl.constexpr):
        """Consumer ``C``: tiles ``j ≡ C (mod NC)``; consumer 0 ends with the merge and the
        stores."""
        q_ptr, out, part_acc, part_ml, lse_ptr, qk2 = ops[1]
        s_qt, s_qh, s_ot, s_oh, s_ps, s_pt, s_ms, s_mt, s_lt, s_lh = ops[2]
        q_s, k_s, v_s, p_s, m_x, l_x, o_x = smem
        ready, empty, done = bars
        tok, split, bt_row, lo, n, valid, last, h, bt_last = rows
        dtype: gl.constexpr = q_ptr.dtype.element_ty
        lay: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GP, 16])
        col: gl.constexpr = gl.SliceLayout(0, lay)
        row: gl.constexpr = gl.SliceLayout(1, lay)

        # this consumer's copy of q [GP, D] (heads past the group read zeros)
        lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        g_q = gl.arange(0, GP, layout=gl.SliceLayout(1, lq))
        d_q = gl.arange(0, D, layout=gl.SliceLayout(0, lq))
        tok64 = tok.to(gl.int64)
        heads = h * G + g_q
        qv = gl.load(q_ptr + tok64 * s_qt + heads.to(gl.int64)[:, None] * s_qh + d_q[None, :],
                     mask=(g_q < G)[:, None], other=0.0)
        q_c = q_s.index(C)
        q_c.store(qv)
        fence_async_shared()
        gl.thread_barrier()
        q_t = q_c.permute((1, 0))  # [D, GP]: wgmma's B, K-major
        p_t = p_s.index(C).permute((1, 0))  # [BLOCK_N, GP]: P^T as B, K-major

        acc = gl.zeros([D, GP], gl.float32, layout=lay)
        l_acc = gl.zeros([BLOCK_N, GP], gl.float32, layout=lay)
        m_i = gl.full([GP], float("-inf"), gl.float32, layout=col)
        s_zero = gl.zeros([BLOCK_N, GP], gl.float32, layout=lay)
        for j in range(C, n, NC):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            k = k_s.index(slot)
            v = v_s.index(slot)
            s_tok = warpgroup_mma(k, q_t, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
            if j == n - 1:
                if valid < BLOCK_N:  # past the request's end: no logit, a zero value row
                    s = _mask_tail(s, v, valid, BLOCK_N, D, row)
            p, m_i, l_acc, acc = _keys_softmax(s, m_i, l_acc, acc, qk2)
            p_t.store(p.to(dtype))
            fence_async_shared()
            o_tok = warpgroup_mma(v.permute((1, 0)), p_t, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
            mbarrier.arrive(empty.index(slot), count=1)
        l_i = gl.sum(l_acc, 0)

        if NC == 2:
            m_i, l_i, acc = _hand_over(C, m_i, l_i, acc, m_x, l_x, o_x, done, col, lay)
        if C == 0:
            g_o = gl.arange(0, GP, layout=col)
            d_o = gl.arange(0, D, layout=row)
            g_ok = g_o < G
            head = (h * G + g_o).to(gl.int64)
            if SPLITS == 1:
                has = l_i > 0.0
                l_safe = gl.where(has, l_i, 1.0)
                o = acc / l_safe[None, :]
                gl.store(out + tok64 * s_ot + head[None, :] * s_oh + d_o[:, None],
                         _to_output(o, out.dtype.element_ty), mask=g_ok[None, :])
                if WRITE_LSE:
                    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453,
                                   float("-inf"))
                    gl.store(lse_ptr + tok64 * s_lt + head * s_lh, lse, mask=g_ok)
            else:
                sp = split.to(gl.int64)
                gl.store(part_acc + sp * s_ps + tok64 * s_pt + head[None, :] * D
                         + d_o[:, None], acc, mask=g_ok[None, :])
                ml = part_ml + sp * s_ms + tok64 * s_mt + head * 2
                gl.store(ml, m_i, mask=g_ok)
                gl.store(ml + 1, l_i, mask=g_ok)

    @gluon.jit
    def _consume_0(ops, smem, bars, rows, G: gl.constexpr, GP: gl.constexpr,
                   D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   NC: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
                   SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr):
        _consume(ops, smem, bars, rows, 0, G, GP, D, BLOCK_N, STAGES, NC, SPLITS, WRITE_LSE)

    @gluon.jit
    def _consume_1(ops, smem, bars, rows, G: gl.constexpr, GP: gl.constexpr,
                   D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   NC: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
                   SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr):
        _consume(ops, smem, bars, rows, 1, G, GP, D, BLOCK_N, STAGES, NC, SPLITS, WRITE_LSE)

    @gluon.jit
    def _gluon_decode_kernel(
        k_d, v_d, q_ptr, out, part_acc, part_ml, lse_ptr, cu_q, seqused, bt,
        qk2, kv_heads, bt_width, s_bt, s_qt, s_qh, s_ot, s_oh, s_ps, s_pt, s_ms, s_mt, s_lt, s_lh,
        G: gl.constexpr, GP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, NC: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr,
        SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        split = gl.program_id(1)
        b = pid // kv_heads
        h = pid % kv_heads
        bt_row = bt + b.to(gl.int64) * s_bt
        BOXES: gl.constexpr = BLOCK_N // BOX
        lay0: gl.constexpr = gl.BlockedLayout([BOXES], [32], [num_warps], [0])
        offs0 = gl.arange(0, BOXES, layout=lay0)
        if SPLITS == 1:  # the first tile's page ids need no key count (clamped to the
            # block table's width: past the request's pages only masked values are read)
            first = _tile_rows(bt_row, 0, bt_width - 1, PAGE, BOX, BOXES, lay0)
        tok = gl.load(cu_q + b)
        kv_len = gl.load(seqused + b)
        chunk = gl.cdiv(gl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = gl.minimum(lo + chunk, kv_len)
        n = gl.maximum(gl.cdiv(hi - lo, BLOCK_N), 0)
        valid = hi - lo - (n - 1) * BLOCK_N  # visible keys of the last tile

        dtype: gl.constexpr = k_d.dtype
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GP, D], dtype)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GP, BLOCK_N], dtype)
        q_s = gl.allocate_shared_memory(dtype, [NC, GP, D], q_layout)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_d.layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_d.layout)
        p_s = gl.allocate_shared_memory(dtype, [NC, GP, BLOCK_N], p_layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        m_x = gl.allocate_shared_memory(gl.float32, [GP], flat)
        l_x = gl.allocate_shared_memory(gl.float32, [GP], flat)
        o_x = gl.allocate_shared_memory(gl.float32, [D, GP], flat2)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(done, count=1)
        fence_async_shared()
        if SPLITS == 1:  # issued now, while the key count is on its way
            _issue_tile(k_d, v_d, k_s, v_s, ready.index(0), 0, first, offs0, h * D, BOX,
                        BOXES, BLOCK_N, D)

        ops = ((k_d, v_d), (q_ptr, out, part_acc, part_ml, lse_ptr, qk2),
               (s_qt, s_qh, s_ot, s_oh, s_ps, s_pt, s_ms, s_mt, s_lt, s_lh))
        smem = (q_s, k_s, v_s, p_s, m_x, l_x, o_x)
        bars = (ready, empty, done)
        # the last block-table column a tile reads: the request's last page
        last = gl.maximum(gl.cdiv(kv_len, PAGE) - 1, 0)
        rows = (tok, split, bt_row, lo, n, valid, last, h, bt_width - 1)
        # argument tuples written out: a tuple bound to a name loses its constexprs
        if NC == 2:
            gl.warp_specialize([
                (_consume_0, (ops, smem, bars, rows, G, GP, D, BLOCK_N, STAGES, NC, PAGE, BOX,
                              SPLITS, WRITE_LSE)),
                (_consume_1, (ops, smem, bars, rows, G, GP, D, BLOCK_N, STAGES, NC, PAGE, BOX,
                              SPLITS, WRITE_LSE)),
                (_load, (ops, smem, bars, rows, G, GP, D, BLOCK_N, STAGES, NC, PAGE, BOX,
                         SPLITS, WRITE_LSE)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consume_0, (ops, smem, bars, rows, G, GP, D, BLOCK_N, STAGES, NC, PAGE, BOX,
                              SPLITS, WRITE_LSE)),
                (_load, (ops, smem, bars, rows, G, GP, D, BLOCK_N, STAGES, NC, PAGE, BOX,
                         SPLITS, WRITE_LSE)),
            ], [1], [LOADER_REGS])


def cache_descriptors(k_cache, v_cache, config: Optional[GluonDecodeConfig] = None) -> tuple:
    """The TMA descriptors ``(k_d, v_d)`` of a cache pair (rows ``[slots, Hkv · D]``, boxes
    of ``gcd(page_size, block_n)`` rows): what :func:`launch_gluon_decode` takes as
    ``descs`` (engines keep them per cache tensor)."""
    cfg = config or DEFAULT_CONFIG
    box = _box_rows(k_cache.shape[1], cfg.block_n)
    return _descriptor(k_cache, cfg.block_n, box), _descriptor(v_cache, cfg.block_n, box)


def _descriptor(cache, block_n: int, box: int):
    p, ps, hkv, d = cache.shape
    rows = cache.as_strided((p * ps, hkv * d), (cache.stride(1), 1))
    return GluonDescriptor(rows, [p * ps, hkv * d], [cache.stride(1), 1], [box, d],
                           _smem_layout(box, d, cache.dtype))


def decode_group_pad(group: int) -> int:
    """The wgmma N a KV head's query heads are padded to (8 or 16)."""
    return 8 if group <= 8 else 16


def _kernel_args(k_d, v_d, q, out, pa, pm, lse, cu_q, seqused_k, block_table, scale: float,
                 kv_heads: int, ps: tuple) -> tuple:
    """The kernel's positional arguments (``pa``/``pm``/``lse``: ``None`` when absent;
    ``ps`` the partials' four strides)."""
    qs, os_ = q.stride(), out.stride()
    ls = lse.stride() if lse is not None else (0, 0)
    return (k_d, v_d, q, out, pa if pa is not None else out, pm if pm is not None else out,
            lse if lse is not None else out, cu_q, seqused_k, block_table,
            float(scale) * _LOG2E, kv_heads, block_table.shape[1], block_table.stride(0),
            qs[0], qs[1], os_[0], os_[1], *ps, *ls)


def _kernel_kw(group: int, d: int, page: int, cfg: GluonDecodeConfig, splits: int,
               write_lse: bool) -> dict:
    """The kernel's constexprs and launch options."""
    return dict(G=group, GP=decode_group_pad(group), D=d, BLOCK_N=cfg.block_n,
                STAGES=cfg.stages, NC=cfg.consumers, PAGE=page,
                BOX=_box_rows(page, cfg.block_n), SPLITS=int(splits), WRITE_LSE=write_lse,
                CONSUMER_REGS=cfg.maxnreg, LOADER_REGS=_LOADER_REGS, num_warps=4,
                maxnreg=cfg.maxnreg)


def _partial_strides(part_acc, part_ml) -> tuple:
    return ((part_acc.stride(0), part_acc.stride(1), part_ml.stride(0), part_ml.stride(1))
            if part_acc is not None else (0, 0, 0, 0))


def launch_gluon_decode(q, k_cache, v_cache, out, cu_q, seqused_k, block_table, scale, *,
                        batch: int, splits: int = 1, config: Optional[GluonDecodeConfig] = None,
                        lse=None, part_acc=None, part_ml=None, descs=None):
    """One launch over ``(batch · Hkv, splits)`` programs (the caller checked
    :func:`gluon_decode_reject_reason` and :func:`gluon_decode_layout_reason`). With
    ``splits > 1`` it writes ``part_acc`` ``[S, T, Hq, D]`` / ``part_ml`` ``[S, T, Hq, 2]``
    (the unnormalised partials of :mod:`.paged_attention`, log2-domain maxima) for its
    reduction kernel; else ``out`` (and ``lse``, natural log). O(1) host work."""
    cfg = config or DEFAULT_CONFIG
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    k_d, v_d = descs if descs is not None else cache_descriptors(k_cache, v_cache, cfg)
    args = _kernel_args(k_d, v_d, q, out, part_acc, part_ml, lse, cu_q, seqused_k,
                        block_table, scale, hkv, _partial_strides(part_acc, part_ml))
    kw = _kernel_kw(hq // hkv, d, k_cache.shape[1], cfg, splits, lse is not None)
    _GLUON_DECODE.launch((batch * hkv, int(splits)), args, kw, launch_key(args, kw))
    return out


def gluon_decode(q, k_cache, v_cache, out, cu_q, seqused_k, block_table, scale, *,
                 splits: int = 1, config: Optional[GluonDecodeConfig] = None, lse=None,
                 part_acc=None, part_ml=None, descs=None):
    """The whole decode step: :func:`launch_gluon_decode`, and with ``splits > 1`` the
    split reduction of :mod:`.paged_attention` (partials allocated here unless given:
    ``[S, T, Hq, D]`` / ``[S, T, Hq, 2]`` float32)."""
    t, hq, d = q.shape
    batch = cu_q.shape[0] - 1
    if splits == 1:
        return launch_gluon_decode(q, k_cache, v_cache, out, cu_q, seqused_k, block_table,
                                   scale, batch=batch, config=config, lse=lse, descs=descs)
    if part_acc is None:
        part_acc = torch.empty(splits, t, hq, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(splits, t, hq, 2, dtype=torch.float32, device=q.device)
    launch_gluon_decode(q, k_cache, v_cache, out, cu_q, seqused_k, block_table, scale,
                        batch=batch, splits=splits, config=config, part_acc=part_acc,
                        part_ml=part_ml, descs=descs)
    grid, rargs, rkw = _reduce_launch(out, part_acc, part_ml, lse)
    _REDUCE.launch(grid, rargs, rkw, launch_key(rargs, rkw))
    return out


def plan_part(splits: int, part_acc, part_ml, cu_q, seqused_k, block_table, batch: int,
              kv_heads: int) -> tuple:
    """The step's fixed share of a layer's launch (made once per plan): ``(spec, grid,
    index tensors, splits, partials, KV heads)``. ``spec`` is hashable: it holds
    everything of the plan's arguments Triton specialises on."""
    ps = _partial_strides(part_acc, part_ml)
    tensors = (cu_q, seqused_k, block_table) + ((part_acc, part_ml) if part_acc is not None
                                                else ())
    spec = ("gluon-decode", splits, kv_heads, block_table.shape[1], block_table.stride(0),
            ps, tuple(tensor_key(t) for t in tensors))
    return (spec, (batch * kv_heads, splits), (cu_q, seqused_k, block_table), ps, splits,
            part_acc, part_ml, kv_heads)


def run_planned(part: tuple, sid, descs: tuple, q, out, scale: float, lse=None) -> None:
    """One layer's launch (and split reduction) from :func:`plan_part` ``part`` (interned
    as ``sid`` by the caller) and the cache's ``descs`` = ``(dsid, k_d, v_d, page)``: the
    arguments assembled, a small key, the direct launch of :mod:`._launch` from the second
    call of a key on. O(1); allocates nothing."""
    _, grid, (cu, seq, bt), ps, splits, pa, pm, hkv = part
    dsid, k_d, v_d, page = descs
    split = splits > 1
    lse_k = lse if not split else None  # with splits the reduction writes the LSE
    args = _kernel_args(k_d, v_d, q, out, pa, pm, lse_k, cu, seq, bt, scale, hkv, ps)
    key = (sid, dsid, tensor_key(q), tensor_key(out), q.stride(), out.stride(),
           None if lse_k is None else (tensor_key(lse_k), lse_k.stride()))
    if not _GLUON_DECODE.launch_cached(grid, args, key):
        kw = _kernel_kw(q.shape[1] // hkv, q.shape[2], page, DEFAULT_CONFIG, splits,
                        lse_k is not None)
        _GLUON_DECODE.launch(grid, args, kw, key)
    if split:
        rkey = ("gluon-reduce", sid, tensor_key(out), out.stride(),
                None if lse is None else (tensor_key(lse), lse.stride()))
        rgrid, rargs, _ = _reduce_launch(out, pa, pm, lse, ps, kw=False)
        if not _REDUCE.launch_cached(rgrid, rargs, rkey):
            _REDUCE.launch(rgrid, rargs, _reduce_launch(out, pa, pm, lse, ps)[2], rkey)


def _reduce_launch(out, part_acc, part_ml, lse, ps: Optional[tuple] = None,
                   kw: bool = True) -> tuple:
    """``(grid, args, constexprs)`` of the split reduction of :mod:`.paged_attention` over
    this kernel's partials (``part_acc`` ``[S, T, Hq, D]``, ``part_ml`` ``[S, T, Hq, 2]``,
    their strides ``ps`` if known) into ``out`` (and ``lse``); ``kw=False`` leaves the
    constexprs out (``None``)."""
    splits, t, hq, d = part_acc.shape
    os_ = out.stride()
    ls = lse.stride() if lse is not None else (0, 0)
    args = (out, part_acc, part_ml, part_ml, lse if lse is not None else out, splits,
            os_[0], os_[1], *(ps or _partial_strides(part_acc, part_ml)), ls[0], ls[1])
    rkw = dict(DV=d, DV_PAD=d, SPLITS_PAD=next_pow2(splits), HAS_SINKS=False,
               WRITE_LSE=lse is not None, FIXED_ORDER=False, num_warps=4) if kw else None
    return (t, hq, 1), args, rkw


#: registers of the loader partition (its page-id vectors; 32 spilled at 128-key tiles)
_LOADER_REGS = 48

#: direct launches (:mod:`._launch`): the kernel and its split reduction (the Triton
#: kernel's, launched with this module's keys)
_GLUON_DECODE = Launcher(_gluon_decode_kernel) if HAS_GLUON else None
_REDUCE = Launcher(_reduce_splits_kernel)
