"""Absorbed-MLA decode (:mod:`.mla`) for few heads (up to 16) on sm_90, in Gluon: the key
tile is wgmma's M side, as in :mod:`.decode_gluon`.

The Triton kernel runs a 16-head block as ``mma.sync`` tiles of 16 rows with per-thread
``cp.async`` loads of the 576-wide latent rows (80% of DRAM throughput at 64×4k, 3.72 TB/s
for the step: docs/benchmarks.md, "Issue 14"). The 128-head Gluon kernel
(:mod:`.mla_gluon`) needs 64-head blocks. Here one program (token ``t``, all its ``H <= 16``
heads, one key split) runs::

    loader (1 warp)        page ids of a tile a tile ahead; TMA of each page piece's latent
                           rows (c_nope [.., 512] and c_rope [.., 64]) into a ring of
                           ``STAGES`` slots of 64 keys (from the third tile: the program
                           issued the first two)
    consumer c (4 warps,   tiles j ≡ c (mod 2), each with its own running state:
    two of them)             Sᵀ [64, HP] = c_nope · q_nopeᵀ + c_rope · q_ropeᵀ   (wgmma, m64n16)
                             Pᵀ = exp2(Sᵀ · qk2 - m)       (one cross-warp maximum a tile)
                             Oᵀ [512, HP] += c_nopeᵀ · Pᵀ  (the same tile read transposed)

``HP`` is the head count padded to the wgmma N of 8 or 16 (its columns read zero queries).
q (both parts) is staged once per program by the parent region. Consumer 1 hands its
``(m, l, Oᵀ)`` to consumer 0 through shared memory, which writes the rows (one split) or
the split partials of :mod:`.mla` (``o / l`` and the log2 LSE) for its merge kernel.

The last tile of a split masks keys past the token's last visible key (the request's end,
or the causal bound of a verify token) and zeroes those latent rows before ``P · V``.

The default of :class:`.mla.TritonMLA` for up to 16 heads where it serves
(``_launch_config.MLA_NARROW``; ``mla_paged_attention(..., narrow=False)`` opts out): on the
H200 it ran 16 heads 64×4k at 3.87–3.88 TB/s and 128×8k at 4.43–4.44 replayed, against
3.81–3.82 / 4.16–4.18 for the Triton kernel (docs/benchmarks.md, "Twenty-fifth session").
The program issues the split's first two tiles itself, before staging q, so that their
page lookups and TMA do not wait for q; the loader takes the rest. With splits it lets its
merge launch start at once (PDL, ``_launch_config.MLA_NARROW_PDL``): the merge waits on the
device for this kernel's end. By default (``pdl="early"``) the launch itself starts while
the kernel before it runs: before its ``griddepcontrol.wait`` it reads the lengths and page
ids, prefetches q to L2 and issues those first tiles whose keys all precede the step's new
ones (``_issue_early``'s parts 1 and 2), as ``_pdl``'s contract allows.

Serves (:func:`narrow_mla_reject_reason`): NVIDIA sm_90, fp16/bf16 q and cache of the
same dtype, ``kv_lora_rank`` 512 + rope 64, up to 16 heads, ``gcd(page_size, 64) >= 16``,
no custom mask, not batch-invariant, row-contiguous (TMA-able) q, cache and out.
"""

from __future__ import annotations

import math
from typing import Optional

from ._launch import Launcher, intern_spec, tensor_key
from ._pdl import EARLY_KEYS, pdl_kwargs
from .prefill_gluon import _LOG2E, HAS_GLUON, _smem_layout, sm90_gluon_reason

__all__ = ["narrow_mla_reject_reason", "narrow_mla_layout_reason", "narrow_mla_splits",
           "narrow_descriptors", "narrow_plan_spec",
           "launch_narrow_mla", "NARROW_MLA_MAX_HEADS", "STAMP_FIELDS"]

NARROW_MLA_MAX_HEADS = 16
#: what a program's row of the timeline buffer holds (``launch_narrow_mla(stamps=...)``):
#: global-timer ns at each point, and the SM it ran on
STAMP_FIELDS = ("entry", "sm", "q_staged", "first_tile", "c0_tiles_done", "c1_tiles_done",
                "rows_stored", "last_issue", "start")
_RANK, _ROPE, _BLOCK_N, _STAGES = 512, 64, 64, 2
_MAXNREG, _LOADER_REGS = 128, 48


def _box_rows(page_size: int) -> int:
    return math.gcd(int(page_size), _BLOCK_N)


def narrow_mla_reject_reason(*, heads: int, rank: int, rope: int, dtype, kv_dtype,
                             page_size: int, device, masked: bool,
                             batch_invariant: bool) -> Optional[str]:
    """Why the narrow Gluon MLA kernel cannot serve a plan (``None``: it can). Host
    integers only; :func:`narrow_mla_layout_reason` checks the cache at launch."""
    why = sm90_gluon_reason(device, dtype, kv_dtype)
    if why is not None:
        return why
    if rank != _RANK or rope != _ROPE:
        return f"kv_lora_rank {rank} + rope {rope} (512 + 64 only)"
    if heads > NARROW_MLA_MAX_HEADS:
        return f"{heads} heads (at most {NARROW_MLA_MAX_HEADS})"
    if _box_rows(page_size) < 16:
        return f"page size {page_size} (gcd with 64 must be >= 16)"
    if masked:
        return "custom masks stay on the Triton kernel"
    if batch_invariant:
        return "batch-invariant launches stay on the Triton kernel"
    return None


def narrow_mla_layout_reason(kv_cache) -> Optional[str]:
    """The launch-time check of the cache (``None``: TMA reads its rows): row-contiguous,
    16-byte aligned rows ``page_size`` rows apart. Checked once per cache tensor by the
    callers that keep its descriptors; they also need unit last-dim strides of q and out."""
    p, ps, _, d = kv_cache.shape
    s = kv_cache.stride()
    if s[3] != 1 or s[0] != ps * s[1] or (s[1] * kv_cache.element_size()) % 16:
        return "kv_cache rows are not contiguous 16-byte aligned pages"
    if kv_cache.data_ptr() % 16:
        return "kv_cache not 16-byte aligned"
    if p * ps >= 2 ** 31:
        return "more than 2^31 cache slots"
    return None


def narrow_mla_splits(tokens: int, max_k: int, sms: int) -> int:
    """Key splits: one program per SM (the ring and q take most of one SM's shared memory),
    each split at least four 64-key tiles."""
    if tokens <= 0:
        return 1
    return max(1, min(sms // tokens, -(-max_k // (4 * _BLOCK_N))))


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .decode_gluon import _hand_over, _keys_softmax, _mask_tail, _pick, _tile_rows
    from .mla_gluon import _token_split
    from .prefill_gluon import _to_output

    #: tiles the program issues itself before staging q (the whole ring: the loader starts
    #: at the third tile), so the first tiles' page lookups and TMA do not wait for q
    _EARLY = gl.constexpr(_STAGES)
    #: a program's row of the timeline buffer (:data:`STAMP_FIELDS`)
    _STAMP_ROW = gl.constexpr(len(STAMP_FIELDS))

    @gluon.jit
    def _stamp(stamps, t, split, i: gl.constexpr, SPLITS: gl.constexpr, STAMPS: gl.constexpr):
        """``STAMPS``: entry ``i`` of program ``(t, split)``'s row of the timeline buffer
        (int64 ``[T * SPLITS, len(STAMP_FIELDS)]``) set to the global timer (ns),
        or, for ``i == 1``, to the SM's id. Nothing when ``STAMPS`` is off."""
        if STAMPS:
            if i == 1:
                v = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                              is_pure=False, pack=1).to(gl.int64)
            else:
                v = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                              dtype=gl.int64, is_pure=False, pack=1)
            gl.store(stamps + (t.to(gl.int64) * SPLITS + split) * _STAMP_ROW + i, v)

    @gluon.jit
    def _pdl_wait_then_release():
        """``griddepcontrol.wait`` (the kernel before has ended and its writes are
        visible; a no-op unless this launch started early), then
        ``griddepcontrol.launch_dependents`` (the next PDL launch may start)."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r",
                                  [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _load_q(q_row, hq, heads, num_warps: gl.constexpr):
        """q's two parts ``[HP, 512]`` and ``[HP, 64]`` from the head rows ``q_row``
        (``[HP, 1]`` pointers; heads past ``heads`` read zeros)."""
        lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        dn = gl.arange(0, 512, layout=gl.SliceLayout(0, lq))
        dr = gl.arange(0, 64, layout=gl.SliceLayout(0, lq))
        ok = (hq < heads)[:, None]
        return (gl.load(q_row + dn[None, :], mask=ok, other=0.0),
                gl.load(q_row + 512 + dr[None, :], mask=ok, other=0.0))

    @gluon.jit
    def _prefetch_q_l2(q_ptr, t, heads, s_qt, s_qh, HP: gl.constexpr, num_warps: gl.constexpr):
        """``prefetch.global.L2`` of token ``t``'s q rows (``heads`` rows of 576, one
        address per 64 elements and the row's last). Before the PDL wait this is safe even
        though the kernel before may be writing q: L2 is where writes land, so a line
        fetched early is updated by them, and the kernel reads q after its wait through L2
        (its loads stay out of L1 until then). Issued before the first tiles: read after
        them, q's loads queued behind the whole grid's first tiles (18 MB at 64×4k) and
        reached shared memory 5.2 µs after the wait, where read first they took 1.5; and
        where the kernel before does not signal early the wait is no wait at all."""
        lp: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [num_warps, 1], [1, 0])
        hp = gl.minimum(gl.arange(0, HP, layout=gl.SliceLayout(1, lp)), heads - 1)
        cp = gl.minimum(gl.arange(0, 16, layout=gl.SliceLayout(0, lp)) * 64, 575)
        ptrs = (q_ptr + t.to(gl.int64) * s_qt + hp.to(gl.int64)[:, None] * s_qh
                + cp[None, :])
        gl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs],
                                  dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _issue(kn_d, kr_d, kn_s, kr_s, bar, slot, cur, offs, BOX: gl.constexpr,
               BOXES: gl.constexpr):
        mbarrier.expect(bar, 64 * 576 * kn_d.dtype.primitive_bitwidth // 8)
        for i in gl.static_range(BOXES):
            r = _pick(cur, offs, i)
            tma.async_copy_global_to_shared(kn_d, [r, 0], bar,
                                            kn_s.index(slot).slice(i * BOX, BOX, dim=0))
            tma.async_copy_global_to_shared(kr_d, [r, 512], bar,
                                            kr_s.index(slot).slice(i * BOX, BOX, dim=0))

    @gluon.jit
    def _issue_early(kn_d, kr_d, kn_s, kr_s, ready, bt_row, lo, n, last, fresh,
                     PAGE: gl.constexpr, BOX: gl.constexpr, num_warps: gl.constexpr,
                     PART: gl.constexpr = 0):
        """The split's first ``_EARLY`` tiles into the empty ring, issued by the program
        as soon as its key count is in, while q is still on its way to shared memory.
        ``PART`` 0: all of them; 1: those whose keys all lie before key ``fresh`` (the
        step's first new key: the kernel before may still be writing it and the keys
        after it); 2: the others."""
        BOXES: gl.constexpr = 64 // BOX
        lay: gl.constexpr = gl.BlockedLayout([BOXES], [32], [num_warps], [0])
        offs = gl.arange(0, BOXES, layout=lay)
        for j in gl.static_range(_EARLY):
            if PART == 1:
                go = (j < n) & (lo + (j + 1) * 64 <= fresh)
            elif PART == 2:
                go = (j < n) & (lo + (j + 1) * 64 > fresh)
            else:
                go = j < n
            if go:
                cur = _tile_rows(bt_row, lo + j * 64, last, PAGE, BOX, BOXES, lay)
                _issue(kn_d, kr_d, kn_s, kr_s, ready.index(j), j, cur, offs, BOX, BOXES)

    @gluon.jit
    def _attend_tile(kn, kr, qn_t, qr_t, p_t, s_zero, m_i, l_acc, acc, qk2, last, valid,
                     row: gl.constexpr):
        """One consumer's 64-key latent tile (``kn`` ``[64, 512]``, ``kr`` ``[64, 64]`` in
        shared memory): Sᵀ = kn · q_nopeᵀ + kr · q_ropeᵀ (``last``: keys from ``valid`` on
        get no logit and zero latent rows), the softmax update of ``(m_i, l_acc, acc)``, then
        Oᵀ += knᵀ · Pᵀ with P through ``p_t``. Returns the updated ``(m_i, l_acc, acc)``."""
        s_tok = warpgroup_mma(kn, qn_t, s_zero, use_acc=False, is_async=True)
        s_tok = warpgroup_mma(kr, qr_t, s_tok, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        if last:
            if valid < 64:  # past the last visible key: no logit, zero latent rows
                s = _mask_tail(s, kn, valid, 64, 512, row)
        p, m_i, l_acc, acc = _keys_softmax(s, m_i, l_acc, acc, qk2)
        p_t.store(p.to(p_t.dtype))
        fence_async_shared()
        o_tok = warpgroup_mma(kn.permute((1, 0)), p_t, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, ))
        return m_i, l_acc, acc

    @gluon.jit
    def _load(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
              BOX: gl.constexpr, SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
              FUSED: gl.constexpr, STAMPS: gl.constexpr):
        """Loader (1 warp): every tile of the split after the first ``_EARLY`` (the
        program issued those), page ids a tile ahead."""
        kn_d, kr_d = ops[0][0], ops[0][1]
        kn_s, kr_s = smem[2], smem[3]
        ready, empty = bars[0], bars[1]
        bt_row, lo, n, last = rows[2], rows[3], rows[4], rows[6]
        BOXES: gl.constexpr = 64 // BOX
        lay: gl.constexpr = gl.BlockedLayout([BOXES], [32], [1], [0])
        offs = gl.arange(0, BOXES, layout=lay)
        # tiles 0 and 1 were issued by the program before q was staged (_issue_early)
        nxt = _tile_rows(bt_row, lo + _EARLY * 64, last, PAGE, BOX, BOXES, lay)
        for j in range(_EARLY, n):
            cur = nxt
            nxt = _tile_rows(bt_row, lo + (j + 1) * 64, last, PAGE, BOX, BOXES, lay)
            slot = j % 2
            mbarrier.wait(empty.index(slot), ((j // 2) & 1) ^ 1)
            _issue(kn_d, kr_d, kn_s, kr_s, ready.index(slot), slot, cur, offs, BOX, BOXES)
        _stamp(ops[1][7], rows[0], rows[1], 7, SPLITS, STAMPS)

    @gluon.jit
    def _consume(ops, smem, bars, rows, C: gl.constexpr, HP: gl.constexpr,
                 SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr, FUSED: gl.constexpr,
                 STAMPS: gl.constexpr):
        out, part_o, part_l, lse_ptr, qk2, heads, count, _ = ops[1]
        s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh = ops[2]
        qn_s, qr_s, kn_s, kr_s, p_s, m_x, l_x, o_x = smem
        ready, empty, done = bars
        t, split, bt_row, lo, n, valid, last = rows
        s_lay: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16])
        col: gl.constexpr = gl.SliceLayout(0, s_lay)
        row: gl.constexpr = gl.SliceLayout(1, s_lay)
        qn_t = qn_s.permute((1, 0))  # [512, HP]
        qr_t = qr_s.permute((1, 0))  # [64, HP]
        p_t = p_s.index(C).permute((1, 0))  # [64, HP]

        acc = gl.zeros([512, HP], gl.float32, layout=s_lay)
        l_acc = gl.zeros([64, HP], gl.float32, layout=s_lay)
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=col)
        s_zero = gl.zeros([64, HP], gl.float32, layout=s_lay)
        for j in range(C, n, 2):
            slot = j % 2
            mbarrier.wait(ready.index(slot), (j // 2) & 1)
            if C == 0:
                if j == 0:
                    _stamp(ops[1][7], t, split, 3, SPLITS, STAMPS)  # the first tile is in
            m_i, l_acc, acc = _attend_tile(kn_s.index(slot), kr_s.index(slot), qn_t, qr_t, p_t,
                                           s_zero, m_i, l_acc, acc, qk2, j == n - 1, valid,
                                           row)
            mbarrier.arrive(empty.index(slot), count=1)
        l_i = gl.sum(l_acc, 0)
        _stamp(ops[1][7], t, split, 4 + C, SPLITS, STAMPS)  # this consumer's last tile done

        m_i, l_i, acc = _hand_over(C, m_i, l_i, acc, m_x, l_x, o_x, done, col, s_lay)
        if C == 0:
            h = gl.arange(0, HP, layout=col)
            h_ok = h < heads
            has = l_i > 0.0
            l_safe = gl.where(has, l_i, 1.0)
            lse2 = gl.where(has, m_i + gl.log2(l_safe), float("-inf"))
            t64 = t.to(gl.int64)
            h64 = h.to(gl.int64)
            # the normalised rows through shared memory, stored 64 latent columns at a time
            # (a [512, HP] pointer tensor would take 128 registers a thread)
            gl.thread_barrier()  # every thread has read consumer 1's O from o_x
            o_x.store(acc / l_safe[None, :])
            gl.thread_barrier()
            st: gl.constexpr = gl.BlockedLayout([1, HP // 4], [32, 1], [1, 4], [0, 1])
            dd = gl.arange(0, 64, layout=gl.SliceLayout(1, st))
            hh = gl.arange(0, HP, layout=gl.SliceLayout(0, st))
            ok = (hh < heads)[None, :]
            hh64 = hh.to(gl.int64)[None, :]
            for c in gl.static_range(8):
                o = o_x.slice(c * 64, 64, dim=0).load(st)
                d = (c * 64 + dd)[:, None]
                if SPLITS == 1:
                    gl.store(out + t64 * s_ot + hh64 * s_oh + d,
                             _to_output(o, out.dtype.element_ty), mask=ok)
                else:
                    gl.store(part_o + t64 * s_pt + hh64 * s_ph + split.to(gl.int64) * s_ps
                             + d, _to_output(o, part_o.dtype.element_ty), mask=ok)
            if SPLITS == 1:
                if WRITE_LSE:
                    gl.store(lse_ptr + t64 * s_et + h64 * s_eh, lse2 * 0.6931471805599453,
                             mask=h_ok)
            else:
                gl.store(part_l + t64 * s_lt + h64 * s_lh + split.to(gl.int64), lse2,
                         mask=h_ok)
                if FUSED:
                    # the last split of this token to finish merges it (a counter, zero
                    # before the launch and after it; the barrier orders every thread's
                    # partial stores before the acq_rel count)
                    gl.thread_barrier()
                    arrived = gl.atomic_add(count + t, 1, sem="acq_rel")
                    if arrived == SPLITS - 1:
                        _merge_token(out, part_o, part_l, lse_ptr, t64, heads, s_ot, s_oh,
                                     s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh, HP, SPLITS,
                                     WRITE_LSE)
                        gl.atomic_xchg(count + t, 0, sem="relaxed")
            _stamp(ops[1][7], t, split, 6, SPLITS, STAMPS)  # the rows are stored

    @gluon.jit
    def _part_chunk(row, c: gl.constexpr, dd, ok):
        """Columns ``64c .. 64c + 63`` of one split's partial rows (``row``: ``[1, HP]``
        pointers to each head's row), float32 ``[64, HP]``, read through L2."""
        return gl.load(row + (c * 64 + dd)[:, None], mask=ok, other=0.0,
                       cache_modifier=".cg").to(gl.float32)

    @gluon.jit
    def _store_chunk(row, a, inv, c: gl.constexpr, dd, ok):
        """Merged columns ``64c .. 64c + 63`` (``a · inv``) to the output rows ``row``."""
        gl.store(row + (c * 64 + dd)[:, None], _to_output(a * inv, row.dtype.element_ty),
                 mask=ok)

    @gluon.jit
    def _merge_token(out, part_o, part_l, lse_ptr, t64, heads, s_ot, s_oh, s_pt, s_ph, s_ps,
                     s_lt, s_lh, s_et, s_eh, HP: gl.constexpr, SPLITS: gl.constexpr,
                     WRITE_LSE: gl.constexpr):
        """Token ``t64``'s rows from its ``SPLITS`` partials, in split order (the fused
        merge, run by the last split to finish; partials read through L2).

        Every read of the partials comes before the first store to ``out`` (which may alias
        them as far as ptxas knows: a store between two chunks' reads would hold the second
        chunk's reads back a whole L2 round trip, eight in a row), with the eight 64-column
        accumulators in registers, and each thread reads and writes 16 bytes of one head's
        row at a time."""
        VEC: gl.constexpr = 8 if HP == 16 else 4
        vl: gl.constexpr = gl.BlockedLayout([VEC, 1], [64 // VEC, VEC * 4 // 8], [1, 4],
                                            [0, 1])
        hcol: gl.constexpr = gl.SliceLayout(0, vl)
        hh = gl.arange(0, HP, layout=hcol)
        h_ok = hh < heads
        hh64 = hh.to(gl.int64)
        ok = h_ok[None, :]
        dd = gl.arange(0, 64, layout=gl.SliceLayout(1, vl))
        lse_row = part_l + t64 * s_lt + hh64 * s_lh
        o_row = (part_o + t64 * s_pt + hh64 * s_ph)[None, :]
        m = gl.full([HP], float("-inf"), gl.float32, layout=hcol)
        for s in gl.static_range(SPLITS):
            m = gl.maximum(m, gl.load(lse_row + s, mask=h_ok, other=float("-inf"),
                                      cache_modifier=".cg"))
        m = gl.where(m == float("-inf"), 0.0, m)
        den = gl.zeros([HP], gl.float32, layout=hcol)
        a0 = gl.zeros([64, HP], gl.float32, layout=vl)
        a1 = a0
        a2 = a0
        a3 = a0
        a4 = a0
        a5 = a0
        a6 = a0
        a7 = a0
        for s in gl.static_range(SPLITS):
            w1 = gl.exp2(gl.load(lse_row + s, mask=h_ok, other=float("-inf"),
                                 cache_modifier=".cg") - m)
            den += w1
            w = w1[None, :]
            row = o_row + s * s_ps
            a0 += _part_chunk(row, 0, dd, ok) * w
            a1 += _part_chunk(row, 1, dd, ok) * w
            a2 += _part_chunk(row, 2, dd, ok) * w
            a3 += _part_chunk(row, 3, dd, ok) * w
            a4 += _part_chunk(row, 4, dd, ok) * w
            a5 += _part_chunk(row, 5, dd, ok) * w
            a6 += _part_chunk(row, 6, dd, ok) * w
            a7 += _part_chunk(row, 7, dd, ok) * w
        has = den > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, den, 1.0), 0.0)[None, :]
        out_row = (out + t64 * s_ot + hh64 * s_oh)[None, :]
        _store_chunk(out_row, a0, inv, 0, dd, ok)
        _store_chunk(out_row, a1, inv, 1, dd, ok)
        _store_chunk(out_row, a2, inv, 2, dd, ok)
        _store_chunk(out_row, a3, inv, 3, dd, ok)
        _store_chunk(out_row, a4, inv, 4, dd, ok)
        _store_chunk(out_row, a5, inv, 5, dd, ok)
        _store_chunk(out_row, a6, inv, 6, dd, ok)
        _store_chunk(out_row, a7, inv, 7, dd, ok)
        if WRITE_LSE:
            lse = gl.where(has, (m + gl.log2(gl.where(has, den, 1.0))) * 0.6931471805599453,
                           float("-inf"))
            gl.store(lse_ptr + t64 * s_et + hh64 * s_eh, lse, mask=h_ok)

    @gluon.jit
    def _consume_0(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
                   BOX: gl.constexpr, SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
                   FUSED: gl.constexpr, STAMPS: gl.constexpr):
        _consume(ops, smem, bars, rows, 0, HP, SPLITS, WRITE_LSE, FUSED, STAMPS)

    @gluon.jit
    def _consume_1(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
                   BOX: gl.constexpr, SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr,
                   FUSED: gl.constexpr, STAMPS: gl.constexpr):
        _consume(ops, smem, bars, rows, 1, HP, SPLITS, WRITE_LSE, FUSED, STAMPS)

    @gluon.jit
    def _narrow_mla_kernel(
        kn_d, kr_d, q_ptr, out, part_o, part_l, lse_ptr, cu_q, seqused, bt, count, stamps,
        qk2, heads, batch, s_bt, s_qt, s_qh,
        s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh,
        HP: gl.constexpr, PAGE: gl.constexpr, BOX: gl.constexpr, CAUSAL: gl.constexpr,
        SPLITS: gl.constexpr, WRITE_LSE: gl.constexpr, BLOCK_B: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, num_warps: gl.constexpr,
        FUSED: gl.constexpr = False, ONE_QUERY: gl.constexpr = False,
        PDL: gl.constexpr = False, STAMPS: gl.constexpr = False, EARLY: gl.constexpr = False,
    ):
        _stamp(stamps, gl.program_id(0), gl.program_id(1), 8, SPLITS, STAMPS)  # start
        if PDL and not EARLY:  # the kernel before first (a no-op unless launched early),
            # then let the split merge's programs start: they wait for this kernel's end
            _pdl_wait_then_release()
        t = gl.program_id(0)
        split = gl.program_id(1)
        if not EARLY:
            _stamp(stamps, t, split, 0, SPLITS, STAMPS)  # entry (after the PDL wait)
        _stamp(stamps, t, split, 1, SPLITS, STAMPS)  # the SM
        dtype: gl.constexpr = kn_d.dtype
        # q [HP, 576]: its loads go out first (heads past ``heads`` read zeros); it reaches
        # shared memory after the first tiles are issued
        lq: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        hq = gl.arange(0, HP, layout=gl.SliceLayout(1, lq))
        q_row = q_ptr + t.to(gl.int64) * s_qt + hq.to(gl.int64)[:, None] * s_qh
        if not EARLY:
            qn, qr = _load_q(q_row, hq, heads, num_warps)
        b, kv_len, lo, n, valid, n_q = _token_split(cu_q, seqused, t, split, batch, SPLITS,
                                                    CAUSAL, BLOCK_B, num_warps, ONE_QUERY)

        qn_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 512], dtype)
        qr_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 64], dtype)
        qn_s = gl.allocate_shared_memory(dtype, [HP, 512], qn_l)
        qr_s = gl.allocate_shared_memory(dtype, [HP, 64], qr_l)
        kn_s = gl.allocate_shared_memory(dtype, [2, 64, 512], kn_d.layout)
        kr_s = gl.allocate_shared_memory(dtype, [2, 64, 64], kr_d.layout)
        p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HP, 64], dtype)
        p_s = gl.allocate_shared_memory(dtype, [2, HP, 64], p_l)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        flat2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        m_x = gl.allocate_shared_memory(gl.float32, [HP], flat)
        l_x = gl.allocate_shared_memory(gl.float32, [HP], flat)
        o_x = gl.allocate_shared_memory(gl.float32, [512, HP], flat2)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        mbarrier.init(done, count=1)
        fence_async_shared()

        last = gl.maximum(gl.cdiv(kv_len, PAGE) - 1, 0)
        bt_row = bt + b.to(gl.int64) * s_bt
        if EARLY:  # before the wait: the tiles of keys the kernel before does not write
            fresh = kv_len - n_q  # the step's first new key
            # q's lines ahead of the tiles in the memory queues (read after the wait)
            _prefetch_q_l2(q_ptr, t, heads, s_qt, s_qh, HP, num_warps)
            _issue_early(kn_d, kr_d, kn_s, kr_s, ready, bt_row, lo, n, last, fresh, PAGE,
                         BOX, num_warps, 1)
            _pdl_wait_then_release()
            _stamp(stamps, t, split, 0, SPLITS, STAMPS)  # "entry": past the wait
            qn, qr = _load_q(q_row, hq, heads, num_warps)
            _issue_early(kn_d, kr_d, kn_s, kr_s, ready, bt_row, lo, n, last, fresh, PAGE,
                         BOX, num_warps, 2)
        else:
            _issue_early(kn_d, kr_d, kn_s, kr_s, ready, bt_row, lo, n, last, kv_len, PAGE,
                         BOX, num_warps)
        qn_s.store(qn)
        qr_s.store(qr)
        fence_async_shared()
        gl.thread_barrier()
        _stamp(stamps, t, split, 2, SPLITS, STAMPS)  # q staged, the first tiles issued
        ops = ((kn_d, kr_d), (out, part_o, part_l, lse_ptr, qk2, heads, count, stamps),
               (s_ot, s_oh, s_pt, s_ph, s_ps, s_lt, s_lh, s_et, s_eh))
        smem = (qn_s, qr_s, kn_s, kr_s, p_s, m_x, l_x, o_x)
        bars = (ready, empty, done)
        rows = (t, split, bt_row, lo, n, valid, last)
        gl.warp_specialize([
            (_consume_0, (ops, smem, bars, rows, HP, PAGE, BOX, SPLITS, WRITE_LSE, FUSED,
                          STAMPS)),
            (_consume_1, (ops, smem, bars, rows, HP, PAGE, BOX, SPLITS, WRITE_LSE, FUSED,
                          STAMPS)),
            (_load, (ops, smem, bars, rows, HP, PAGE, BOX, SPLITS, WRITE_LSE, FUSED, STAMPS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def narrow_descriptors(kv_cache):
    """The two TMA descriptors (latent and rope columns) of ``kv_cache`` viewed as rows
    ``[slots, R + rope]``."""
    p, ps, _, d = kv_cache.shape
    rows = kv_cache.as_strided((p * ps, d), (kv_cache.stride(1), 1))
    box = _box_rows(ps)
    kn = GluonDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [box, _RANK],
                         _smem_layout(box, _RANK, kv_cache.dtype))
    kr = GluonDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [box, _ROPE],
                         _smem_layout(box, _ROPE, kv_cache.dtype))
    return kn, kr


def narrow_plan_spec(*, splits: int, batch: int, cu_q, seqused_k, block_table, part_o=None,
                     part_lse=None, counters=None, one_query: bool = False,
                     pdl=False) -> int:
    """The interned id (:func:`._launch.intern_spec`) of what a plan fixes of
    :func:`launch_narrow_mla`'s specialisation: its index tensors, split partials and
    counters (dtype, alignment), their strides, the splits, batch, ``one_query`` and
    ``pdl``. Made once per plan; passed as ``planned=`` it stands for those in each call's
    launch key, which then only adds the call's own tensors (q, out, the cache's dtype and
    page size, the LSE) and flags."""
    tensors = (cu_q, seqused_k, block_table, part_o, part_lse, counters)
    return intern_spec((
        "narrow-mla", int(splits), int(batch), block_table.stride(0),
        part_o.stride()[:3] if part_o is not None else None,
        part_lse.stride()[:2] if part_lse is not None else None, bool(one_query), pdl,
        tuple(tensor_key(t) if t is not None else None for t in tensors)))


def launch_narrow_mla(q, kv_cache, out, cu_q, seqused_k, block_table, scale, *, splits: int,
                      batch: int, causal: bool, lse=None, part_o=None, part_lse=None,
                      descs=None, counters=None, one_query: bool = False, pdl=False,
                      stamps=None, planned: Optional[int] = None):
    """One launch over ``(tokens, splits)`` programs; with ``splits > 1`` it writes
    ``part_o`` ``[T, H, S, R]`` / ``part_lse`` ``[T, H, S]`` (:mod:`.mla`'s partials) for
    its merge kernel, or, given ``counters`` (zeroed int32 ``[T]``, left zero), merges
    them itself (the last split of each token). ``one_query``: every request has one
    query. ``pdl`` (:func:`._pdl.pdl_mode`): truthy, the kernel lets the next launch (its
    split merge, launched with ``launch_pdl``) start at once; ``True``, it also starts
    early itself and waits for the kernel before it; ``"early"`` (:data:`._pdl.EARLY_KEYS`),
    it starts early and, before that wait, reads its lengths and page ids and issues its
    first tiles of keys older than the step's new ones (the kernel before may be writing
    the new keys and q, never the index tensors or the older keys). ``stamps``: an int64 CUDA tensor
    ``[tokens * splits, 8]`` that each program ``(t, s)`` fills at row ``t * splits + s``
    with its timeline (:data:`STAMP_FIELDS`: global-timer ns and its SM; ``entry`` after
    the PDL wait, ``start`` before it), for
    ``benchmarks/narrow_timeline.py``; off (``None``) it is compiled out. ``planned``:
    :func:`narrow_plan_spec` of this call's plan arguments (``splits`` through ``pdl``),
    so that the launch key is a few per-call values and a launched key skips building the
    constexprs. The caller checked :func:`narrow_mla_reject_reason`,
    :func:`narrow_mla_layout_reason` and unit last-dim strides of q and out."""
    t, h, _ = q.shape
    kn_d, kr_d = descs if descs is not None else narrow_descriptors(kv_cache)
    po = part_o if part_o is not None else out
    pl = part_lse if part_lse is not None else out
    ps_o = part_o.stride()[:3] if part_o is not None else (0, 0, 0)
    ps_l = part_lse.stride()[:2] if part_lse is not None else (0, 0)
    ls = lse.stride() if lse is not None else (0, 0)
    fused = counters is not None and splits > 1
    args = (kn_d, kr_d, q, out, po, pl, lse if lse is not None else out, cu_q, seqused_k,
            block_table, counters if fused else cu_q, stamps if stamps is not None else cu_q,
            float(scale) * _LOG2E, h, batch,
            block_table.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *ps_o, *ps_l, *ls)
    grid = (t, int(splits))
    key = None
    if planned is not None:  # the plan's id, then what only this call fixes
        key = (planned, h, tensor_key(q), q.stride(0), q.stride(1), tensor_key(out),
               out.stride(0), out.stride(1), kv_cache.dtype, kv_cache.shape[1], bool(causal),
               None if lse is None else (tensor_key(lse), *ls),
               None if stamps is None else tensor_key(stamps))
        if _NARROW.launch_cached(grid, args, key):
            return out
    kw = dict(HP=8 if h <= 8 else 16, PAGE=kv_cache.shape[1], BOX=_box_rows(kv_cache.shape[1]),
              CAUSAL=bool(causal), SPLITS=int(splits), WRITE_LSE=lse is not None,
              BLOCK_B=max(2, 1 << max(0, (batch - 1).bit_length())),
              CONSUMER_REGS=_MAXNREG, LOADER_REGS=_LOADER_REGS, num_warps=4,
              maxnreg=_MAXNREG, FUSED=fused, ONE_QUERY=bool(one_query),
              STAMPS=stamps is not None, EARLY=pdl == EARLY_KEYS,
              **pdl_kwargs(pdl, reduction=False))
    if key is None:
        key = (tuple(tensor_key(a) if hasattr(a, "data_ptr") else None for a in args[2:12]),
               args[13:], tuple(sorted(kw.items())), kv_cache.dtype, tuple(kn_d.block_shape))
    _NARROW.launch(grid, args, kw, key)
    return out


#: direct launches (:mod:`._launch`)
_NARROW = Launcher(_narrow_mla_kernel) if HAS_GLUON else None
