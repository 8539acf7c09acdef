"""Absorbed-MLA decode for few heads (up to 16) on sm_90 as one persistent stream over the
batch's keys (``tuning["stream"]`` of :mod:`.mla`): the narrow Gluon kernel's tile loop
(:mod:`.mla_narrow_gluon`) with stream-K shares that cross request boundaries.

The narrow kernel's ``tokens × splits`` grid gives every program the same keys, so 64×4k
runs 128 programs of 2,048 keys on 132 SMs, and its step waits for the slowest SM's group
(an SM's stream rate is set by its GPC: 85–98 µs for the same keys on an H100,
docs/benchmarks.md "Twenty-ninth session"). Here one program runs per SM (``P`` programs)::

    units_b = ⌈L_b / 16⌉,  total = Σ_b units_b        (16-key units, on the device)
    program p owns the global units [⌊total·w_p⌋, ⌊total·w_{p+1}⌋)

with ``w`` the cumulative slot weights (:func:`.mla_balanced.share_weights`: equal, or each
SM's measured rate, where the program first claims the slot of the SM it runs on). A
program walks the requests its range touches, one *segment* each: the loader warp streams
every segment's 64-key tiles through the two-slot ring without a break (page pieces of 16
rows by TMA, so a segment may start at any unit), and each segment's q ahead into one of
two q buffers; each consumer warpgroup takes the tiles whose global index has its parity (ring
slot ``C`` is consumer ``C``'s), and at the segment's end consumer 1 hands ``(m, l, O)``
to consumer 0, which merges and normalises them in shared memory for a writer warp: the
request's row (a request inside the range) or a partial in the program's head slot (0: the
request began before the range) or tail slot (1), as the balanced launch lays them out, so
:mod:`.mla_balanced`'s merge launch (``BLOCK_N`` 16) combines them and writes the rows of
requests with no keys.

Measured (docs/benchmarks.md, "Thirty-first session", H100): correct on CUDA, but slower than
the narrow kernel at every program count (64×4k 2.45 against 2.86 TB/s): 3.6 % slower a tile
on the same keys, more again when programs cross requests, and the narrow kernel's rows are
already at the copy ceiling on 128 SMs (3.02 TB/s; 3.03 on 132), so more SMs and weighted
shares have no bandwidth to win. Hence off by default (``MLA_STREAM``).

The sm_90 build must not spill (``tests/test_stream_sm90.py``,
``scripts/inspect_stream_mla_sm90.py``): its first builds spilled 0.9–1.7 KB a thread and
ran at half the narrow kernel's speed (docs/benchmarks.md, "Thirtieth session"). What
spilled: every wgmma's shared-memory descriptor made constant by a consumer's fixed slot
(hoisted out of the tile loop: the slot is read through an opaque move), a loop or the
global stores inside the tile loop (one flat loop a consumer; the writer warp stores).

Serves (:func:`stream_mla_reject_reason`): what the narrow kernel serves, one query per
request (decode), at most :data:`STREAM_MAX_BATCH` requests, pages of a multiple of 16
rows; and, checked per call (:func:`stream_q_reason`), a q the loader reads by TMA as rows
``[T·H, 576]`` into two buffers (a segment's q is in shared memory before its first tile:
the consumers do not wait on a load at each request).

Shapes: q ``[B, H, 576]`` (row ``b`` is request ``b``); kv_cache ``[pages, page, 1, 576]``;
out ``[B, H, 512]``; lse ``[B, H]`` float32 (natural log); part_o ``[P, 2, H, 512]``
(float32 or q's dtype); part_lse ``[P, 2, H]`` float32 (log2); shares float32 ``[P + 1]``.
"""

from __future__ import annotations

import math
from typing import Optional

from ._launch import Launcher, launch_key
from ._pdl import pdl_kwargs
from .mla_narrow_gluon import narrow_mla_reject_reason
from .prefill_gluon import _LOG2E, HAS_GLUON, _smem_layout

__all__ = ["stream_mla_reject_reason", "stream_descriptors", "stream_q_reason",
           "stream_q_descriptors", "launch_stream_mla",
           "stream_segments", "STREAM_UNIT", "STREAM_MAX_BATCH", "STREAM_STAMP_FIELDS"]

#: keys per share unit: a program's range starts and ends on these (the TMA boxes' rows)
STREAM_UNIT = 16
#: the most requests a launch takes (each program reads the lengths as one vector)
STREAM_MAX_BATCH = 4096
#: a slot's row of the timeline buffer (``launch_stream_mla(stamps=...)``): global-timer ns
#: at each point, and the SM it ran on
STREAM_STAMP_FIELDS = ("entry", "sm", "first_tile", "end")
_RANK, _ROPE = 512, 64
_MAXNREG, _LOADER_REGS, _WRITER_REGS = 128, 48, 120


def stream_mla_reject_reason(*, heads: int, rank: int, rope: int, dtype, kv_dtype,
                             page_size: int, device, masked: bool, batch_invariant: bool,
                             one_query: bool, batch: int) -> Optional[str]:
    """Why the stream kernel cannot serve a plan (``None``: it can). Host values only."""
    why = narrow_mla_reject_reason(heads=heads, rank=rank, rope=rope, dtype=dtype,
                                   kv_dtype=kv_dtype, page_size=page_size, device=device,
                                   masked=masked, batch_invariant=batch_invariant)
    if why is not None:
        return why
    if not one_query:
        return "more than one query per request (the stream kernel serves decode)"
    if page_size % STREAM_UNIT:
        return f"page size {page_size} (a multiple of {STREAM_UNIT})"
    if batch > STREAM_MAX_BATCH:
        return f"{batch} requests (at most {STREAM_MAX_BATCH})"
    return None


def stream_segments(lens, shares) -> list:
    """The device partition on the host (tests, the design's invariants): for each slot
    ``p`` of the cumulative float32 weights ``shares`` ``[P + 1]`` over requests of
    ``lens`` keys, ``{"range": (g0, g1), "segments": [(r, lo, hi, n, kind), ...],
    "iterations": nit}`` with the kernel's arithmetic: keys ``[lo, hi)`` of request ``r`` in
    ``n`` 64-key tiles, ``kind`` ``"row"`` (the whole request here), ``"head"`` (it began
    before the range: partial slot 0) or ``"tail"`` (slot 1); ``nit`` the consumers'
    iterations as the prologue counts them (tiles, and requests without keys between the
    first and the last segment), checked against the consumers' walk."""
    import torch

    lens = [int(x) for x in lens]
    units = [-(-L // STREAM_UNIT) for L in lens]
    ends, acc = [], 0
    for u in units:
        acc += u
        ends.append(acc)
    total = acc
    w = torch.as_tensor(shares, dtype=torch.float32)
    programs = w.numel() - 1

    def bound(s):
        if s >= programs:
            return total
        return min(int((w[s] * torch.tensor(float(total), dtype=torch.float32)).item()),
                   total)

    out = []
    for p in range(programs):
        g0, g1 = bound(p), bound(p + 1)
        r = sum(e <= g0 for e in ends)
        cs = ends[r - 1] if r > 0 else 0
        segs, walk, gap = [], 0, 0
        while cs < g1 and r < len(lens):
            ce = ends[r]
            lo = (max(g0, cs) - cs) * STREAM_UNIT
            hi = min((min(g1, ce) - cs) * STREAM_UNIT, lens[r])
            n = max(-(-(hi - lo) // 64), 0)
            if n > 0:
                kind = "row" if cs >= g0 and ce <= g1 else ("head" if cs < g0 else "tail")
                segs.append((r, lo, hi, n, kind))
                walk += n + (gap if len(segs) > 1 else 0)
                gap = 0
            elif segs:
                gap += 1
            cs, r = ce, r + 1
        # the prologue's count, from the lengths as vectors
        starts = [e - u for e, u in zip(ends, units)]
        n_b = []
        for b, L in enumerate(lens):
            lo = (max(g0, starts[b]) - starts[b]) * STREAM_UNIT
            hi = min((min(g1, ends[b]) - starts[b]) * STREAM_UNIT, L)
            touch = ends[b] > g0 and starts[b] < g1
            n_b.append(max(-(-(hi - lo) // 64), 0) if touch else 0)
        r0 = sum(e <= g0 for e in ends)
        last = max([b for b, n in enumerate(n_b) if n > 0], default=-1)
        nit = sum(n_b) + sum(1 for b, n in enumerate(n_b) if n == 0 and r0 < b < last)
        if nit != walk:
            raise AssertionError(f"slot {p}: the prologue counts {nit} iterations, the "
                                 f"consumers walk {walk}")
        out.append({"range": (g0, g1), "segments": segs, "iterations": nit})
    return out


if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

    from .decode_gluon import _hand_over, _tile_rows
    from .mla_narrow_gluon import _attend_tile, _issue, _pdl_wait_then_release
    from .prefill_gluon import _to_output

    _UNIT = gl.constexpr(STREAM_UNIT)
    _BOXES = gl.constexpr(64 // STREAM_UNIT)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _bound(shares, s, total, num_programs):
        """Slot ``s``'s first unit, ``⌊total · w_s⌋`` (``total`` past the last slot): the
        same float32 arithmetic as :func:`.mla_balanced._share_bound`, so the merge launch
        finds the same boundaries."""
        w = gl.load(shares + gl.minimum(s, num_programs))
        b = gl.minimum((w * total.to(gl.float32)).to(gl.int32), total)
        return gl.where(s >= num_programs, total, b)

    @gluon.jit
    def _segment(seqused, r, cs, g0, g1):
        """Request ``r`` (its units from ``cs``) within the range ``[g0, g1)``:
        ``(kv_len, ce, lo, n, valid)``: its key count, its units' end, the segment's first
        key, its 64-key tiles and the keys of the last one."""
        kv_len = gl.load(seqused + r).to(gl.int32)
        ce = cs + gl.cdiv(kv_len, _UNIT)
        lo = (gl.maximum(g0, cs) - cs) * _UNIT
        hi = gl.minimum((gl.minimum(g1, ce) - cs) * _UNIT, kv_len)
        n = gl.maximum(gl.cdiv(hi - lo, 64), 0)
        valid = hi - lo - (n - 1) * 64
        return kv_len, ce, lo, n, valid

    @gluon.jit
    def _issue_q(qn_d, qr_d, qn_s, qr_s, bar, buf, r, heads):
        """TMA of request ``r``'s q (rows ``r·H .. r·H + HP - 1`` of q viewed as rows
        ``[T·H, 576]``: heads past ``H`` read the next request's rows, or zeros past the
        end, their columns masked at the stores) into q buffer ``buf``."""
        mbarrier.expect(bar, qn_d.block_type.nbytes + qr_d.block_type.nbytes)
        row = r * heads
        tma.async_copy_global_to_shared(qn_d, [row, 0], bar, qn_s.index(buf))
        tma.async_copy_global_to_shared(qr_d, [row, 512], bar, qr_s.index(buf))

    @gluon.jit
    def _claim(ticket, claims, num_programs):
        """The slot this program takes: its launch's epoch from a ticket (``P`` a launch),
        then the slot of its SM, or the next free one (as :func:`.mla_balanced
        ._claim_slot`)."""
        epoch = gl.atomic_add(ticket, 1) // num_programs + 1
        sm = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                       is_pure=False, pack=1)
        s = sm % num_programs
        found = 0
        while found == 0:
            old = gl.atomic_max(claims + s, epoch)
            found = (old < epoch).to(gl.int32)
            s = gl.where(found != 0, s, (s + 1) % num_programs)
        return s

    @gluon.jit
    def _stamp(stamps, p, i: gl.constexpr, STAMPS: gl.constexpr):
        """``STAMPS``: entry ``i`` of slot ``p``'s row of the timeline buffer (int64
        ``[P, 4]``: :data:`STREAM_STAMP_FIELDS`) set to the global timer (ns), or for
        ``i == 1`` the SM's id; nothing when ``STAMPS`` is off."""
        if STAMPS:
            if i == 1:
                v = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=gl.int32,
                                              is_pure=False, pack=1).to(gl.int64)
            else:
                v = gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                              dtype=gl.int64, is_pure=False, pack=1)
            gl.store(stamps + p.to(gl.int64) * 4 + i, v)

    @gluon.jit
    def _load(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
              WRITE_LSE: gl.constexpr, STAMPS: gl.constexpr):
        """Loader (1 warp): every segment's tiles through the ring, in order (the program
        issued segment 0's first ``early`` tiles)."""
        kn_d, kr_d, qn_d, qr_d = ops[0][0], ops[0][1], ops[0][2], ops[0][3]
        seqused, bt, s_bt, heads = ops[1][6], ops[1][7], ops[1][8], ops[1][5]
        qn_s, qr_s, kn_s, kr_s = smem[0], smem[1], smem[2], smem[3]
        ready, empty, q_ready, q_free = bars[0], bars[1], bars[5], bars[6]
        p, r, cs, g0, g1, batch, early, nt, nit = rows
        lay: gl.constexpr = gl.BlockedLayout([_BOXES], [32], [1], [0])
        offs = gl.arange(0, _BOXES, layout=lay)
        j = early  # global tile index
        skip = early
        kq = 0  # segments with keys so far (the program issued segment 0's q)
        while (cs < g1) & (r < batch):
            kv_len, ce, lo, n, valid = _segment(seqused, r, cs, g0, g1)
            last = gl.maximum(gl.cdiv(kv_len, PAGE) - 1, 0)
            bt_row = bt + r.to(gl.int64) * s_bt
            if n > 0:
                if kq > 0:  # this segment's q into buffer kq % 2 once its last user is done
                    if kq >= 2:
                        mbarrier.wait(q_free.index(kq % 2), ((kq // 2) - 1) & 1)
                    _issue_q(qn_d, qr_d, qn_s, qr_s, q_ready.index(kq % 2), kq % 2, r, heads)
                kq += 1
            for i in range(skip, n):
                cur = _tile_rows(bt_row, lo + i * 64, last, PAGE, _UNIT, _BOXES,
                                 lay).to(gl.int32)
                slot = j % 2
                mbarrier.wait(empty.index(slot), ((j // 2) & 1) ^ 1)
                _issue(kn_d, kr_d, kn_s, kr_s, ready.index(slot), slot, cur, offs, _UNIT,
                       _BOXES)
                j += 1
            skip = 0
            cs = ce
            r += 1

    @gluon.jit
    def _consume(ops, smem, bars, rows, C: gl.constexpr, HP: gl.constexpr,
                 WRITE_LSE: gl.constexpr, STAMPS: gl.constexpr):
        """Consumer ``C``: one flat loop over the program's ``nt`` tiles (a loop around the
        tile loop kept more than the accumulator live and spilled it: 1.7 KB of spills, the
        step at half speed), computing the tiles of its parity (ring slot ``C``); at a
        segment's first tile it waits for that request's q (the loader's TMA), at its last
        the two consumers merge and consumer 0 stages the rows for the writer warp
        (:func:`_writer`)."""
        part_l, qk2, heads, seqused = ops[1][2], ops[1][4], ops[1][5], ops[1][6]
        s_lp, s_lh = ops[2][5], ops[2][7]
        qn_s, qr_s, kn_s, kr_s, p_s, m_x, l_x, o_x = smem
        ready, empty, done, taken, staged = bars[0], bars[1], bars[2], bars[3], bars[4]
        q_ready, q_free = bars[5], bars[6]
        p, r, cs, g0, g1, batch, early, nt, nit = rows
        s_lay: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HP, 16])
        col: gl.constexpr = gl.SliceLayout(0, s_lay)
        row: gl.constexpr = gl.SliceLayout(1, s_lay)
        s_zero = gl.zeros([64, HP], gl.float32, layout=s_lay)
        if C == 0:
            if (g0 == g1) & (cs < g0) & (r < batch):
                # an empty range inside a request (more slots than units): a partial of
                # weight 0 for the merge, which reads every slot the request spans
                h = gl.arange(0, HP, layout=col)
                gl.store(part_l + p.to(gl.int64) * s_lp + h.to(gl.int64) * s_lh,
                         gl.full([HP], float("-inf"), gl.float32, layout=col),
                         mask=h < heads)
        # the running state: reset by a segment's first tile (m = -inf: alpha = 0 on
        # finite values), never re-made (a zero tensor a segment is a hoisted constant)
        acc = gl.zeros([512, HP], gl.float32, layout=s_lay)
        l_acc = gl.zeros([64, HP], gl.float32, layout=s_lay)
        m_i = gl.full([HP], float("-inf"), gl.float32, layout=col)
        kv_len, ce, lo, n, valid = _segment(seqused, r, cs, g0, g1)
        s0 = 0  # the segment's first tile
        k = 0  # segments done
        g = 0  # the next tile
        # one iteration a tile, or a request without keys between two segments (skipped
        # one an iteration: a loop inside this one spilled the accumulator)
        for it in range(0, nit):
            if n == 0:
                cs = ce
                r += 1
                kv_len, ce, lo, n, valid = _segment(seqused, r, cs, g0, g1)
            else:
                i = g - s0
                if i == 0:  # this segment's q (the loader's TMA into buffer k % 2)
                    mbarrier.wait(q_ready.index(k % 2), (k // 2) & 1)
                    m_i = gl.full([HP], float("-inf"), gl.float32, layout=col)
                if g % 2 == C:
                    # slot C is consumer C's (two slots, two consumers), read through an
                    # opaque move: as a constant, its buffers' wgmma descriptors were
                    # hoisted out of the loop and spilled (1 KB a thread)
                    sl = gl.inline_asm_elementwise("mov.u32 $0, $1;", "=r,r", [g % 2],
                                                   dtype=gl.int32, is_pure=True, pack=1)
                    kn = kn_s.index(sl)
                    kr = kr_s.index(sl)
                    qn_t = qn_s.index(k % 2).permute((1, 0))  # [512, HP]
                    qr_t = qr_s.index(k % 2).permute((1, 0))  # [64, HP]
                    p_t = p_s.index(sl).permute((1, 0))  # [64, HP]
                    mbarrier.wait(ready.index(C), (g // 2) & 1)
                    if C == 0:
                        if g == 0:
                            _stamp(ops[1][9], p, 2, STAMPS)  # the first tile is in
                    # (the segment's last tile masks the keys past its end)
                    m_i, l_acc, acc = _attend_tile(kn, kr, qn_t, qr_t, p_t, s_zero, m_i,
                                                   l_acc, acc, qk2, i == n - 1, valid, row)
                    mbarrier.arrive(empty.index(C), count=1)
                if i == n - 1:  # the segment's last tile: merge the two consumers, write
                    mbarrier.arrive(q_free.index(k % 2), count=1)  # its q is read
                    # no tile of this segment here: nothing summed (l_acc holds older sums)
                    l_i = gl.where(m_i == float("-inf"), 0.0, gl.sum(l_acc, 0))
                    if C == 1:  # o_x free again: the writer has stored the last rows
                        if k > 0:
                            mbarrier.wait(taken, (k - 1) & 1)
                    # (a side without tiles has weight 0 and finite stale rows)
                    m_i, l_i, acc = _hand_over(C, m_i, l_i, acc, m_x, l_x, o_x, done, col,
                                               s_lay, k & 1)
                    if C == 0:  # normalised in place (a second [512, HP] spilled) and
                        # staged in o_x for the writer warp
                        has = l_i > 0.0
                        acc = acc / gl.where(has, l_i, 1.0)[None, :]
                        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)),
                                        float("-inf"))
                        gl.thread_barrier()  # every thread has read consumer 1's O and m
                        o_x.store(acc)
                        m_x.store(lse2)
                        gl.thread_barrier()
                        mbarrier.arrive(staged, count=1)
                    k += 1
                    s0 = g + 1
                    if g + 1 < nt:  # the next request (without keys: skipped above)
                        cs = ce
                        r += 1
                        kv_len, ce, lo, n, valid = _segment(seqused, r, cs, g0, g1)
                g += 1

    @gluon.jit
    def _store_rows(row, s_h, o_x, d, heads, HP: gl.constexpr, lr: gl.constexpr):
        """The ``heads`` rows staged in ``o_x`` (``[512, HP]`` float32) to ``row + h·s_h``
        in ``row``'s dtype, one head's row 128 columns at a time (``d``: ``[128, 1]``
        column offsets, 4 a thread)."""
        for hd in gl.static_range(HP):
            for c in gl.static_range(4):
                oc = o_x.slice(c * 128, 128, dim=0).slice(hd, 1, dim=1).load(lr)
                gl.store(row + hd * s_h + c * 128 + d, _to_output(oc, row.dtype.element_ty),
                         mask=(d < 128) & (hd < heads))

    @gluon.jit
    def _writer(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
                WRITE_LSE: gl.constexpr, STAMPS: gl.constexpr):
        """Writer (1 warp): each segment's merged rows, once consumer 0 staged them in
        ``o_x`` (normalised) and their log2 LSE in ``m_x``: request ``r``'s row and LSE
        where the whole request lies in this program's range, else its partial in slot 0
        (head: it began before the range) or 1 (tail) of program ``p``; then ``o_x`` is
        free for consumer 1's next hand-over (``taken``)."""
        out, part_o, part_l, lse_ptr = ops[1][0], ops[1][1], ops[1][2], ops[1][3]
        heads, seqused = ops[1][5], ops[1][6]
        s_ot, s_oh, s_pp, s_pw, s_ph, s_lp, s_lw, s_lh, s_et, s_eh = ops[2]
        m_x, o_x = smem[5], smem[7]
        taken, staged = bars[3], bars[4]
        p, r, cs, g0, g1, batch, early, nt, nit = rows
        # a head's row 128 columns at a time (4 a thread: few registers live)
        lr: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, 1], [0, 1])
        d0 = gl.arange(0, 128, layout=gl.SliceLayout(1, lr))[:, None]  # [128, 1]
        lh: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        h = gl.arange(0, HP, layout=lh)
        h_ok = h < heads
        h64 = h.to(gl.int64)
        k = 0
        while (cs < g1) & (r < batch):
            kv_len, ce, lo, n, valid = _segment(seqused, r, cs, g0, g1)
            if n > 0:
                mbarrier.wait(staged, k & 1)
                lse2 = m_x.load(lh)
                # the columns' offsets made here, not hoisted: 64 address sets (16 heads,
                # 4 chunks) kept live across the segments spilled
                d = d0 + gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r", [],
                                                   dtype=gl.int32, is_pure=False, pack=1)
                if (cs >= g0) & (ce <= g1):  # the whole request here: its row
                    _store_rows(out + r.to(gl.int64) * s_ot, s_oh, o_x, d, heads, HP, lr)
                    if WRITE_LSE:
                        gl.store(lse_ptr + r.to(gl.int64) * s_et + h64 * s_eh,
                                 lse2 * 0.6931471805599453, mask=h_ok)
                else:
                    slot = gl.where(cs < g0, 0, 1).to(gl.int64)
                    _store_rows(part_o + p.to(gl.int64) * s_pp + slot * s_pw, s_ph, o_x, d,
                                heads, HP, lr)
                    gl.store(part_l + p.to(gl.int64) * s_lp + slot * s_lw + h64 * s_lh,
                             lse2, mask=h_ok)
                gl.thread_barrier()
                mbarrier.arrive(taken, count=1)
                k += 1
            cs = ce
            r += 1
        _stamp(ops[1][9], p, 3, STAMPS)  # every row and partial stored

    @gluon.jit
    def _consume_0(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
                   WRITE_LSE: gl.constexpr, STAMPS: gl.constexpr):
        _consume(ops, smem, bars, rows, 0, HP, WRITE_LSE, STAMPS)

    @gluon.jit
    def _consume_1(ops, smem, bars, rows, HP: gl.constexpr, PAGE: gl.constexpr,
                   WRITE_LSE: gl.constexpr, STAMPS: gl.constexpr):
        _consume(ops, smem, bars, rows, 1, HP, WRITE_LSE, STAMPS)

    @gluon.jit
    def _stream_mla_kernel(
        kn_d, kr_d, qn_d, qr_d, out, part_o, part_l, lse_ptr, seqused, bt, shares, ticket,
        claims, stamps, qk2, heads, batch, num_programs, s_bt, s_ot, s_oh,
        s_pp, s_pw, s_ph, s_lp, s_lw, s_lh, s_et, s_eh,
        HP: gl.constexpr, PAGE: gl.constexpr, WRITE_LSE: gl.constexpr, BLOCK_B: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
        num_warps: gl.constexpr,
        CLAIM: gl.constexpr = False, PDL: gl.constexpr = False, STAMPS: gl.constexpr = False,
    ):
        if PDL:  # the kernel before first (a no-op unless launched early), then let the
            # merge launch's programs start: they wait for this kernel's end on the device
            _pdl_wait_then_release()
        p = gl.program_id(0)
        if CLAIM:
            p = _claim(ticket, claims, num_programs)
        _stamp(stamps, p, 0, STAMPS)  # entry
        _stamp(stamps, p, 1, STAMPS)  # the SM
        # the batch's units, this program's range and the first request it touches
        lay_b: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        offs_b = gl.arange(0, BLOCK_B, layout=lay_b)
        lens = gl.load(seqused + offs_b, mask=offs_b < batch, other=0).to(gl.int32)
        units = gl.cdiv(lens, _UNIT)
        total = gl.sum(units, axis=0)
        g0 = _bound(shares, p, total, num_programs)
        g1 = _bound(shares, p + 1, total, num_programs)
        ends = gl.associative_scan(units, 0, _add)
        r0 = gl.sum((ends <= g0).to(gl.int32), axis=0)
        cs0 = gl.sum(gl.where(offs_b < r0, units, 0), axis=0)

        dtype: gl.constexpr = kn_d.dtype
        qn_s = gl.allocate_shared_memory(dtype, [2, HP, 512], qn_d.layout)
        qr_s = gl.allocate_shared_memory(dtype, [2, HP, 64], qr_d.layout)
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
        taken = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        staged = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for b in gl.static_range(2):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=1)
            mbarrier.init(q_ready.index(b), count=1)
            mbarrier.init(q_free.index(b), count=2)  # both consumers
        mbarrier.init(done, count=1)
        mbarrier.init(taken, count=1)
        mbarrier.init(staged, count=1)
        fence_async_shared()

        # segment 0's first tiles (up to the ring's two) go out now: the loader takes the
        # rest, so their page lookups and TMA do not wait for the partitions to start
        # every request's tiles in this range, from the lengths already in registers (no
        # walk of dependent loads): the consumers' iterations are these tiles and the
        # requests without keys between the first and the last segment
        starts = ends - units
        lo_b = (gl.maximum(g0, starts) - starts) * _UNIT
        hi_b = gl.minimum((gl.minimum(g1, ends) - starts) * _UNIT, lens)
        touch = (ends > g0) & (starts < g1) & (offs_b < batch)
        n_b = gl.where(touch, gl.maximum(gl.cdiv(hi_b - lo_b, 64), 0), 0)
        nt = gl.sum(n_b, axis=0)
        r_last = gl.max(gl.where(n_b > 0, offs_b, -1), axis=0)
        nit = nt + gl.sum(((n_b == 0) & (offs_b > r0) & (offs_b < r_last)).to(gl.int32),
                          axis=0)
        # segment 0's first tiles (up to the ring's two) go out now: the loader takes the
        # rest, so their page lookups and TMA do not wait for the partitions to start
        n0 = gl.sum(gl.where(offs_b == r0, n_b, 0), axis=0)
        early = gl.minimum(n0, 2)
        if early > 0:
            _issue_q(qn_d, qr_d, qn_s, qr_s, q_ready.index(0), 0, r0, heads)
            lo0 = gl.sum(gl.where(offs_b == r0, lo_b, 0), axis=0)
            len0 = gl.sum(gl.where(offs_b == r0, lens, 0), axis=0)
            last = gl.maximum(gl.cdiv(len0, PAGE) - 1, 0)
            bt_row = bt + r0.to(gl.int64) * s_bt
            lay_t: gl.constexpr = gl.BlockedLayout([_BOXES], [32], [num_warps], [0])
            offs_t = gl.arange(0, _BOXES, layout=lay_t)
            for i in range(0, early):
                cur = _tile_rows(bt_row, lo0 + i * 64, last, PAGE, _UNIT, _BOXES,
                                 lay_t).to(gl.int32)
                _issue(kn_d, kr_d, kn_s, kr_s, ready.index(i), i, cur, offs_t, _UNIT,
                       _BOXES)
        ops = ((kn_d, kr_d, qn_d, qr_d),
               (out, part_o, part_l, lse_ptr, qk2, heads, seqused, bt, s_bt, stamps),
               (s_ot, s_oh, s_pp, s_pw, s_ph, s_lp, s_lw, s_lh, s_et, s_eh))
        smem = (qn_s, qr_s, kn_s, kr_s, p_s, m_x, l_x, o_x)
        bars = (ready, empty, done, taken, staged, q_ready, q_free)
        rows = (p, r0, cs0, g0, g1, batch, early, nt, nit)
        gl.warp_specialize([
            (_consume_0, (ops, smem, bars, rows, HP, PAGE, WRITE_LSE, STAMPS)),
            (_consume_1, (ops, smem, bars, rows, HP, PAGE, WRITE_LSE, STAMPS)),
            (_load, (ops, smem, bars, rows, HP, PAGE, WRITE_LSE, STAMPS)),
            (_writer, (ops, smem, bars, rows, HP, PAGE, WRITE_LSE, STAMPS)),
        ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, WRITER_REGS])


def stream_descriptors(kv_cache):
    """The two TMA descriptors (latent and rope columns) of ``kv_cache`` viewed as rows
    ``[slots, R + rope]``, in boxes of :data:`STREAM_UNIT` rows (a segment may start at
    any unit, so a tile's pieces are units)."""
    p, ps, _, d = kv_cache.shape
    rows = kv_cache.as_strided((p * ps, d), (kv_cache.stride(1), 1))
    box = math.gcd(ps, STREAM_UNIT)
    kn = GluonDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [box, _RANK],
                         _smem_layout(box, _RANK, kv_cache.dtype))
    kr = GluonDescriptor(rows, [p * ps, d], [kv_cache.stride(1), 1], [box, _ROPE],
                         _smem_layout(box, _ROPE, kv_cache.dtype))
    return kn, kr


def stream_q_reason(q) -> Optional[str]:
    """Why the stream kernel's loader cannot read ``q`` ``[T, H, 576]`` by TMA as rows
    ``[T·H, 576]`` (``None``: it can): heads ``stride(1)`` apart and tokens ``H`` rows apart,
    16-byte aligned rows, unit last stride."""
    t, h, d = q.shape
    s = q.stride()
    if s[2] != 1 or s[0] != h * s[1] or (s[1] * q.element_size()) % 16 or q.data_ptr() % 16:
        return "q is not rows [T·H, 576] of 16-byte aligned heads"
    if t * h * s[1] >= 2 ** 31:
        return "q holds 2^31 elements or more"
    return None


def stream_q_descriptors(q):
    """The loader's two TMA descriptors of ``q`` (:func:`stream_q_reason` passed): boxes of
    ``HP`` rows (the head count padded to 8 or 16) of the latent and rope columns."""
    t, h, d = q.shape
    hp = 8 if h <= 8 else 16
    rows = q.as_strided((t * h, d), (q.stride(1), 1))
    return tuple(GluonDescriptor(rows, [t * h, d], [q.stride(1), 1], [hp, w],
                                 _smem_layout(hp, w, q.dtype)) for w in (_RANK, _ROPE))


def launch_stream_mla(q, kv_cache, out, seqused_k, block_table, scale, *, part_o, part_lse,
                      shares, lse=None, descs=None, q_descs=None, claim=None, pdl=False,
                      stamps=None) -> None:
    """One launch of ``P = shares.numel() - 1`` programs (one per SM) over the
    ``seqused_k.numel()`` one-query requests; the caller runs the merge launch
    (:func:`.mla_balanced.launch_balanced_mla` with ``launches=("merge",)``,
    ``block_n=STREAM_UNIT``, the same ``shares``). ``claim``: :func:`.mla_balanced
    .claim_state` of ``P`` slots (the programs take their SM's slot). ``pdl``
    (:func:`._pdl.pdl_mode`): truthy, the merge may start at once; ``True``, this kernel
    also starts early, waiting on the device for the kernel before. ``stamps``: an int64
    CUDA tensor ``[P, 4]`` each slot fills with its timeline (:data:`STREAM_STAMP_FIELDS`,
    ``benchmarks/stream_probe.py``); off (``None``) it is compiled out. ``q_descs``:
    :func:`stream_q_descriptors` of ``q`` (made here when ``None``). Checked by the caller
    (:func:`stream_mla_reject_reason`, :func:`.mla_narrow_gluon.narrow_mla_layout_reason`,
    :func:`stream_q_reason`, a unit last-dim stride of out)."""
    batch, h, _ = q.shape[0], q.shape[1], q.shape[2]
    programs = shares.numel() - 1
    kn_d, kr_d = descs if descs is not None else stream_descriptors(kv_cache)
    qn_d, qr_d = q_descs if q_descs is not None else stream_q_descriptors(q)
    ls = lse.stride() if lse is not None else (0, 0)
    ticket, claims = claim if claim is not None else (seqused_k, seqused_k)
    args = (kn_d, kr_d, qn_d, qr_d, out, part_o, part_lse,
            lse if lse is not None else part_lse,
            seqused_k, block_table, shares, ticket, claims,
            stamps if stamps is not None else seqused_k, float(scale) * _LOG2E, h,
            seqused_k.shape[0], programs, block_table.stride(0), out.stride(0), out.stride(1),
            *part_o.stride()[:3], *part_lse.stride()[:3], *ls)
    kw = dict(HP=8 if h <= 8 else 16, PAGE=kv_cache.shape[1], WRITE_LSE=lse is not None,
              BLOCK_B=max(32 * 4, 1 << max(0, (batch - 1).bit_length())),
              CONSUMER_REGS=_MAXNREG, LOADER_REGS=_LOADER_REGS,
              WRITER_REGS=_WRITER_REGS, num_warps=4,
              maxnreg=_MAXNREG, CLAIM=claim is not None, STAMPS=stamps is not None,
              **pdl_kwargs(pdl, reduction=False))
    _STREAM.launch((programs,), args, kw, (launch_key(args[4:], kw), kv_cache.dtype,
                                          tuple(kn_d.block_shape), q.dtype,
                                          tuple(qn_d.block_shape)))


#: direct launches (:mod:`._launch`)
_STREAM = Launcher(_stream_mla_kernel) if HAS_GLUON else None
