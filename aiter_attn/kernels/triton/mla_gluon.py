"""Absorbed-MLA decode (:mod:`.mla`) for many heads on sm_90, in Gluon with warp
specialisation: two consumer warpgroups split the 512-wide value accumulator, a loader warp
streams the latent tiles.

The Triton kernel holds a 64-head block's whole ``[64, 512]`` float32 accumulator in one
warpgroup (255 registers, spilled; 259 TFLOP/s at 128 heads 64×4k on the H200). Here one
program (token ``t``, 64 heads, one key split) runs three partitions::

    loader (1 warp)        q_nope [64, 512] and q_rope [64, 64] once, then every 64-key
                           latent tile (c_nope [64, 512], c_rope [64, 64]) by TMA into a
                           ring of ``STAGES`` slots, each reused once both consumers
                           released it
    consumer 0 / 1         value columns [256·c, 256·c + 256): acc [64, 256] float32
    (default / worker)

The scores of a tile are computed once, by its owner (consumer ``j % 2`` for tile ``j``):
``S = q_nope · c_nopeᵀ + q_rope · c_ropeᵀ``, then the online softmax against the running
maximum the other consumer published for tile ``j − 1``. The owner publishes ``P`` (bf16,
shared memory), the rescale factor, the new maximum and the row sums (``p_ready``, one
phase per tile); both consumers then add ``P · c_nope[:, their 256 columns]``. While one
consumer runs a tile's softmax, the other's wgmmas (its scores of the next tile, its
``P · V`` of the previous one) keep the tensor cores busy. A single ``P`` buffer suffices:
its only reader for tile ``j`` is tile ``j + 1``'s owner, which finishes that read before
writing ``P_{j+1}``.

A tile past the last visible key (a request's end, the causal bound of a verify token) has
its rows zeroed in shared memory before use, so unwritten cache slots (any bits, NaN
included) never reach the output. Outputs: the normalised rows (one split), or the split
partials of :mod:`.mla` (``acc / l`` and the log2 LSE) that its merge kernel reduces.

Serves: fp16/bf16 q and cache of the same dtype, ``kv_lora_rank`` 512, rope 64, head
counts that are multiples of 64, page sizes that are multiples of 64, no custom mask, not
batch-invariant, NVIDIA sm_90, TMA-able (row-contiguous) q and cache
(:func:`gluon_mla_reject_reason`). Everything else runs the Triton kernel.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._launch import Launcher, launch_key
from .prefill_gluon import _LOG2E, HAS_GLUON, _smem_layout, sm90_gluon_reason

__all__ = ["gluon_mla_reject_reason", "launch_gluon_mla", "GLUON_MLA_BLOCK_H"]

#: heads per program (one wgmma M block, shared by both consumers)
GLUON_MLA_BLOCK_H = 64
_BLOCK_N = 64
_RANK, _ROPE = 512, 64
_MAXNREG = 168  # 12 warps x 168 = the SM's 64K registers; consumers 240, loader 24
_CONSUMER_REGS, _LOADER_REGS = 240, 24


def gluon_mla_reject_reason(*, heads: int, rank: int, rope: int, dtype, kv_dtype,
                            page_size: int, device, masked: bool,
                            batch_invariant: bool) -> Optional[str]:
    """Why the Gluon MLA kernel cannot serve a plan (``None``: it can). Host integers only;
    :func:`gluon_mla_tensors_reason` checks the tensors at launch."""
    why = sm90_gluon_reason(device, dtype, kv_dtype)
    if why is not None:
        return why
    if rank != _RANK or rope != _ROPE:
        return f"kv_lora_rank {rank} + rope {rope} (512 + 64 only)"
    if heads % GLUON_MLA_BLOCK_H:
        return f"{heads} heads (a multiple of {GLUON_MLA_BLOCK_H})"
    if page_size % _BLOCK_N:
        return f"page size {page_size} (a multiple of {_BLOCK_N})"
    if masked:
        return "custom masks stay on the Triton kernel"
    if batch_invariant:
        return "batch-invariant launches stay on the Triton kernel"
    return None


def gluon_mla_tensors_reason(q, kv_cache, out) -> Optional[str]:
    """The launch-time half of the check: TMA needs row-contiguous, 16-byte aligned q and
    cache rows (``None``: fine)."""
    t, h, d = q.shape
    if out.dtype != q.dtype or kv_cache.dtype != q.dtype:
        return f"out {out.dtype} / cache {kv_cache.dtype} differ from q {q.dtype}"
    if q.stride(2) != 1 or q.stride(1) != d or q.stride(0) != h * d:
        return "q is not contiguous"
    p, ps, _, d2 = kv_cache.shape
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != d2 or kv_cache.stride(0) != ps * d2:
        return "kv_cache rows are not contiguous"
    if out.stride(2) != 1 or out.stride(1) != out.shape[2] or \
            out.stride(0) != out.shape[1] * out.shape[2]:
        return "out is not contiguous"
    if q.data_ptr() % 16 or kv_cache.data_ptr() % 16 or out.data_ptr() % 16:
        return "q, kv_cache or out not 16-byte aligned"
    return None


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    from .prefill_gluon import _to_output

    @gluon.jit
    def _token_split(cu_q, seqused, t, split, batch, SPLITS: gl.constexpr,
                     CAUSAL: gl.constexpr, BLOCK_B: gl.constexpr, num_warps: gl.constexpr,
                     ONE_QUERY: gl.constexpr = False):
        """Token ``t``'s request ``b`` (searched in ``cu_q`` over ``BLOCK_B`` requests;
        ``ONE_QUERY``: every request has one query, so ``b = t``), its key count, and split
        ``split``'s tiles of 64 keys: ``(b, kv_len, lo, n, valid, n_q)`` with ``valid`` the
        visible keys of the last tile (causal: up to the token's own position) and ``n_q``
        the request's query count (its last ``n_q`` keys are the step's new ones)."""
        if ONE_QUERY:
            b = t
            q_start = t
            n_q = 1
        else:
            lay_b: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            offs_b = gl.arange(0, BLOCK_B, layout=lay_b)
            ends = gl.load(cu_q + 1 + offs_b, mask=offs_b < batch, other=2147483647)
            b = gl.minimum(gl.sum((ends <= t).to(gl.int32), axis=0), batch - 1)
            q_start = gl.load(cu_q + b)
            n_q = gl.load(cu_q + b + 1) - q_start
        kv_len = gl.load(seqused + b)
        end = kv_len
        if CAUSAL:
            end = gl.minimum(kv_len, kv_len - n_q + (t - q_start) + 1)
        chunk = gl.cdiv(gl.cdiv(kv_len, SPLITS), 64) * 64
        lo = split * chunk
        hi = gl.minimum(lo + chunk, end)
        n = gl.maximum(gl.cdiv(hi - lo, 64), 0)
        valid = hi - lo - (n - 1) * 64  # visible keys of the last tile
        return b, kv_len, lo, n, valid, n_q

    @gluon.jit
    def _zero_rows(buf, col0, valid, COLS: gl.constexpr):
        """Rows ``>= valid`` of the ``[64, COLS]`` columns of ``buf`` from ``col0`` set to
        0 (a tile past the last visible key), 64 columns at a time."""
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, lay))
        keep = (rows < valid)[:, None]
        for c in gl.static_range(COLS // 64):
            part = buf.slice(col0 + c * 64, 64, dim=1)
            x = part.load(lay)
            part.store(gl.where(keep, x, gl.zeros_like(x)))

    @gluon.jit
    def _consume(ops, smem, bars, rows, C: gl.constexpr, STAGES: gl.constexpr,
                 WRITE_LSE: gl.constexpr, SPLITS: gl.constexpr):
        """Consumer ``C``: its 256 value columns over every tile, scores and softmax of the
        tiles it owns (``j % 2 == C``); then its half of the output (or split partial)."""
        out_d, part_o, part_l, lse_ptr, qk2 = ops[0]
        s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh = ops[1]
        qn_s, qr_s, kn_s, kr_s, p_s, alpha_s, m_s, rs_s = smem
        q_bar, k_ready, k_empty, p_ready, tail_bar = bars
        t, h0, split, lo, n, valid, q_row = rows
        dtype: gl.constexpr = qn_s.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        acc = gl.zeros([64, 256], gl.float32, layout=o_layout)
        l_i = gl.zeros([64], gl.float32, layout=row_o)
        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        mbarrier.wait(q_bar, 0)
        for j in range(n):
            slot = j % STAGES
            mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
            kn = kn_s.index(slot)
            if j == n - 1:
                if valid < 64:  # past the last visible key: zero those rows, both halves
                    # (for p·v; the scores of those keys are masked whatever they read)
                    _zero_rows(kn, C * 256, valid, 256)
                    if C == 0:
                        _zero_rows(kr_s.index(slot), 0, valid, 64)
                    fence_async_shared()
                    mbarrier.arrive(tail_bar, count=1)
                    mbarrier.wait(tail_bar, 0)
            v = kn.slice(C * 256, 256, dim=1)
            if j % 2 == C:  # this consumer owns the tile: scores, softmax, publish P
                s_tok = warpgroup_mma(qn_s, kn.permute((1, 0)),
                                      gl.zeros([64, 64], gl.float32, layout=s_layout),
                                      use_acc=False, is_async=True)
                s_tok = warpgroup_mma(qr_s, kr_s.index(slot).permute((1, 0)), s_tok,
                                      is_async=True)
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
                if j > 0:  # the previous tile's maximum (and its P read by us is done)
                    mbarrier.wait(p_ready, (j - 1) & 1)
                    m_i = m_s.load(row_s)
                if j == n - 1:
                    kpos = gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout))
                    s = gl.where(kpos[None, :] < valid, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1) * qk2)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                p = gl.exp2(s * qk2 - m_safe[:, None])
                alpha = gl.exp2(m_i - m_safe)
                rs = gl.sum(p, 1)
                m_i = m_new
                p16 = p.to(dtype)
                p_s.store(p16)
                alpha_s.store(alpha)
                m_s.store(m_new)
                rs_s.store(rs)
                fence_async_shared()
                mbarrier.arrive(p_ready, count=1)
                a_o = gl.convert_layout(alpha, row_o)
                acc = acc * a_o[:, None]
                l_i = l_i * a_o + gl.convert_layout(rs, row_o)
                acc_tok = warpgroup_mma(gl.convert_layout(p16, p_layout), v, acc,
                                        is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            else:  # the other consumer's tile: its P from shared memory
                mbarrier.wait(p_ready, j & 1)
                a_o = alpha_s.load(row_o)
                m_i = m_s.load(row_s)
                acc = acc * a_o[:, None]
                l_i = l_i * a_o + rs_s.load(row_o)
                acc_tok = warpgroup_mma(p_s, v, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, ))
            mbarrier.arrive(k_empty.index(slot), count=1)

        # epilogue: this consumer's 256 columns of the 64 heads
        offs_h = h0 + gl.arange(0, 64, layout=row_o)
        offs_d = C * 256 + gl.arange(0, 256, layout=col_o)
        has = l_i > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        o = acc * inv[:, None]
        m_o = gl.convert_layout(m_i, row_o)
        lse2 = gl.where(has, m_o + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        t64 = t.to(gl.int64)
        if SPLITS == 1:
            # through shared memory and TMA (a [64, 256] pointer tensor would need 256
            # registers): this consumer's columns of the slot that held tile n - 2, which
            # both consumers finished reading (the other reads only its own columns of it
            # while it may still be on tile n - 2's p·v) and no tile refills
            o_s = kn_s.index(n % STAGES).slice(C * 256, 256, dim=1)
            o_s.store(_to_output(o, dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(out_d, [q_row, C * 256], o_s)
            tma.store_wait(0)
            if WRITE_LSE:
                if C == 0:
                    gl.store(lse_ptr + t64 * s_et + offs_h * s_eh, lse2 * 0.6931471805599453)
        else:
            gl.store(part_o + t64 * s_pt + offs_h[:, None] * s_ph + split * s_ps
                     + offs_d[None, :], o)
            if C == 0:
                gl.store(part_l + t64 * s_lt + offs_h * s_lh + split, lse2)

    @gluon.jit
    def _consume_0(ops, smem, bars, rows, descs, STAGES: gl.constexpr,
                   WRITE_LSE: gl.constexpr, SPLITS: gl.constexpr, PAGE: gl.constexpr):
        _consume(ops, smem, bars, rows, 0, STAGES, WRITE_LSE, SPLITS)

    @gluon.jit
    def _consume_1(ops, smem, bars, rows, descs, STAGES: gl.constexpr,
                   WRITE_LSE: gl.constexpr, SPLITS: gl.constexpr, PAGE: gl.constexpr):
        _consume(ops, smem, bars, rows, 1, STAGES, WRITE_LSE, SPLITS)

    @gluon.jit
    def _load(ops, smem, bars, rows, descs, STAGES: gl.constexpr, WRITE_LSE: gl.constexpr,
              SPLITS: gl.constexpr, PAGE: gl.constexpr):
        """Loader (1 warp): q once, then every latent tile into a slot both consumers
        released; its page from the block table."""
        qn_d, qr_d, kn_d, kr_d, bt_row = descs
        qn_s, qr_s, kn_s, kr_s, p_s, alpha_s, m_s, rs_s = smem
        q_bar, k_ready, k_empty, p_ready, tail_bar = bars
        t, h0, split, lo, n, valid, q_row = rows
        mbarrier.expect(q_bar, qn_d.block_type.nbytes + qr_d.block_type.nbytes)
        tma.async_copy_global_to_shared(qn_d, [q_row, 0], q_bar, qn_s)
        tma.async_copy_global_to_shared(qr_d, [q_row, 512], q_bar, qr_s)
        for j in range(n):
            slot = j % STAGES
            mbarrier.wait(k_empty.index(slot), ((j // STAGES) & 1) ^ 1)
            key = lo + j * 64
            page = gl.load(bt_row + key // PAGE)
            row = page * PAGE + key % PAGE
            mbarrier.expect(k_ready.index(slot),
                            kn_d.block_type.nbytes + kr_d.block_type.nbytes)
            tma.async_copy_global_to_shared(kn_d, [row, 0], k_ready.index(slot),
                                            kn_s.index(slot))
            tma.async_copy_global_to_shared(kr_d, [row, 512], k_ready.index(slot),
                                            kr_s.index(slot))

    @gluon.jit
    def _gluon_mla_kernel(
        qn_d, qr_d, kn_d, kr_d, out_d, part_o, part_l, lse_ptr, cu_q, seqused, bt,
        qk2, num_heads, num_head_blocks, batch, s_bt,
        s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh,
        PAGE: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        WRITE_LSE: gl.constexpr, SPLITS: gl.constexpr, BLOCK_B: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
    ):
        pid = gl.program_id(0)
        split = gl.program_id(1)
        t = pid // num_head_blocks  # a token's head blocks are neighbours (shared tiles)
        hb = pid % num_head_blocks
        b, kv_len, lo, n, valid, _ = _token_split(cu_q, seqused, t, split, batch, SPLITS,
                                                  CAUSAL, BLOCK_B, num_warps)
        h0 = hb * 64

        dtype: gl.constexpr = qn_d.dtype
        qn_s = gl.allocate_shared_memory(dtype, [64, 512], qn_d.layout)
        qr_s = gl.allocate_shared_memory(dtype, [64, 64], qr_d.layout)
        kn_s = gl.allocate_shared_memory(dtype, [STAGES, 64, 512], kn_d.layout)
        kr_s = gl.allocate_shared_memory(dtype, [STAGES, 64, 64], kr_d.layout)
        p_s = gl.allocate_shared_memory(dtype, [64, 64], kr_d.layout)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        alpha_s = gl.allocate_shared_memory(gl.float32, [64], vec)
        m_s = gl.allocate_shared_memory(gl.float32, [64], vec)
        rs_s = gl.allocate_shared_memory(gl.float32, [64], vec)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        tail_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(p_ready, count=1)
        mbarrier.init(tail_bar, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)

        ops = ((out_d, part_o, part_l, lse_ptr, qk2),
               (s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh))
        smem = (qn_s, qr_s, kn_s, kr_s, p_s, alpha_s, m_s, rs_s)
        bars = (q_bar, k_ready, k_empty, p_ready, tail_bar)
        rows = (t, h0, split, lo, n, valid, t * num_heads + h0)
        descs = (qn_d, qr_d, kn_d, kr_d, bt + b.to(gl.int64) * s_bt)
        # argument tuples written out: a tuple bound to a name loses its constexprs
        # the loader is the default partition (its warpgroup gets what the consumers leave:
        # LOADER_REGS); the consumers, as workers, hold nothing of the parent region
        gl.warp_specialize([
            (_load, (ops, smem, bars, rows, descs, STAGES, WRITE_LSE, SPLITS, PAGE)),
            (_consume_0, (ops, smem, bars, rows, descs, STAGES, WRITE_LSE, SPLITS, PAGE)),
            (_consume_1, (ops, smem, bars, rows, descs, STAGES, WRITE_LSE, SPLITS, PAGE)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def launch_gluon_mla(q, kv_cache, out, cu_q, seqused_k, block_table, scale, *, splits,
                     batch, causal, lse=None, part_o=None, part_lse=None):
    """One launch over ``(tokens · heads / 64, splits)`` programs; with ``splits > 1`` it
    writes ``part_o``/``part_lse`` (:mod:`.mla`'s partials) for its merge kernel. The
    caller checked :func:`gluon_mla_reject_reason` and :func:`gluon_mla_tensors_reason`."""
    t, h, d = q.shape
    pages, page, _, _ = kv_cache.shape
    q2 = q.view(t * h, d)
    kv2 = kv_cache.view(pages * page, d)
    ln = _smem_layout(64, _RANK, q.dtype)
    lr = _smem_layout(64, _ROPE, q.dtype)
    qn_d = GluonDescriptor(q2, [t * h, _RANK], [d, 1], [64, _RANK], ln)
    qr_d = GluonDescriptor(q2, [t * h, d], [d, 1], [64, _ROPE], lr)
    kn_d = GluonDescriptor(kv2, [pages * page, _RANK], [d, 1], [64, _RANK], ln)
    kr_d = GluonDescriptor(kv2, [pages * page, d], [d, 1], [64, _ROPE], lr)
    out_d = GluonDescriptor(out.view(t * h, _RANK), [t * h, _RANK], [_RANK, 1], [64, 256], ln)
    hb = h // GLUON_MLA_BLOCK_H
    po = part_o if part_o is not None else out
    pl = part_lse if part_lse is not None else out
    # part_o [T, H, S, R] / part_lse [T, H, S]: their unit-stride last dims are implied
    ps_o = part_o.stride()[:3] if part_o is not None else (0, 0, 0)
    ps_l = part_lse.stride()[:2] if part_lse is not None else (0, 0)
    ls = lse.stride() if lse is not None else (0, 0)
    args = (qn_d, qr_d, kn_d, kr_d, out_d, po, pl, lse if lse is not None else out, cu_q,
            seqused_k, block_table, float(scale) * _LOG2E, h, hb, batch,
            block_table.stride(0), out.stride(0), out.stride(1), *ps_o, *ps_l, *ls)
    kw = dict(PAGE=page, STAGES=2, CAUSAL=bool(causal), WRITE_LSE=lse is not None,
              SPLITS=int(splits), BLOCK_B=max(2, 1 << max(0, (batch - 1).bit_length())),
              CONSUMER_REGS=_CONSUMER_REGS, LOADER_REGS=_LOADER_REGS, num_warps=4,
              maxnreg=_MAXNREG)
    _GLUON_MLA.launch((t * hb, splits), args, kw, launch_key(args, kw))
    return out


#: direct launches (:mod:`._launch`)
_GLUON_MLA = Launcher(_gluon_mla_kernel) if HAS_GLUON else None
