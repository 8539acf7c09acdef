"""Absorbed-MLA decode with balanced key splits (``tuning["balanced"]`` of :mod:`.mla`):
every program gets the same number of key tiles, whatever the requests' lengths.

The split launch (:mod:`.mla_kernel`) cuts each request into the same number of splits, so
its programs are as long as the longest request's splits, and a grid of ``tokens × splits``
programs leaves slots of the SMs empty when ``resident · SMs`` is not a multiple of the
token count (16 heads 64×4k on 132 SMs, two programs each: 256 programs for 264 slots; a
64×4k step timed 112.3 µs where 66×4k took 114.1: the two requests more nearly filled empty
slots, docs/benchmarks.md "Twenty-fifth session"). Here (stream-K over the keys)::

    tiles_b = ⌈L_b / BLOCK_N⌉,   total = Σ_b tiles_b,   TW = ⌈total / P⌉   (on the device)
    program p owns the global tiles [p·TW, (p+1)·TW) of the requests laid end to end

A request inside one program's range is finished there (its row and LSE written); one
crossing a program boundary leaves a partial ``(o, lse)`` in each program it touches: the
program's *head* slot (0) when the request began before the program's range, else its *tail*
slot (1), so a program writes at most two partials whatever the batch. The merge launch
(one program per (token, head)) finds a crossing request's programs ``⌊cs/TW⌋ .. ⌊(ce−1)/TW⌋``
from the same lengths and combines their partials by LSE, in program order (deterministic);
it also writes the zero rows (LSE -inf) of requests with no keys. No host reads: the grid is
``P = resident · SMs`` programs (a host integer), so the launch is CUDA-graph safe. The
partition follows every row's keys, a graph's padding rows (one key each) included, so a
padded replay may round differently from the eager step in the last bits.

**Weighted shares** (``shares``): program ``s`` owns the global tiles
``[bound(s), bound(s+1))`` with ``bound(s) = ⌊total · w_s⌋`` for a float32 cumulative weight
vector ``w`` ``[P + 1]`` (``w_0 = 0``, ``w_P = 1``; :func:`share_weights`), instead of equal
``TW``-tile ranges; a slot may be empty. With ``claim`` each program first claims the slot
meant for the SM it runs on (``%smid``; SMs stream at different rates, set by their GPC: a
slot's weight is its SM's measured rate, docs/benchmarks.md "Twenty-ninth session"), and
any free slot if that one is taken (:func:`_claim_slot`), so any placement stays correct.
The merge finds a request's slots from the same bounds.

Serves (:func:`balanced_reject_reason`): one query per request (decode), up to 16 heads (one
head block), a cache of q's dtype (16- or 32-bit), no custom mask, not batch-invariant.

Shapes: q ``[T, H, R + rope]``; kv_cache ``[pages, page_size, 1, R + rope]``; out
``[T, H, R]`` (q's dtype); lse ``[T, H]`` float32 (natural log); part_o
``[P, 2, H, R]`` (float32 or q's 16-bit dtype); part_lse ``[P, 2, H]`` float32 (log2).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ._kvutil import next_pow2
from ._launch import Launcher, launch_key
from ._softmax import to_output
from .mla_kernel import _mla_tile
from .mla_merge import _partial_f32
from ._pdl import gdc_wait, pdl_kwargs, wait_then_release

__all__ = ["balanced_reject_reason", "balanced_workspace_shapes", "launch_balanced_mla",
           "BALANCED_MAX_HEADS", "check_rates", "share_weights", "claim_state", "CLAIM_SM",
           "CLAIM_SCATTER"]

#: how a claiming program picks the slot it tries first (``claim_hint``): the one meant for
#: its SM (``%smid``, CUDA only), or a scatter of its program id (the interpreter, tests:
#: hints that collide, so the fallback scan runs)
CLAIM_SM, CLAIM_SCATTER = 1, 2

BALANCED_MAX_HEADS = 16
#: the most requests one launch takes (the lengths are read as one vector per program)
BALANCED_MAX_BATCH = 4096
_LOG2E = tl.constexpr(1.4426950408889634)


def balanced_reject_reason(*, heads: int, q_dtype, kv_dtype, one_query: bool, masked: bool,
                           batch_invariant: bool, batch: int) -> Optional[str]:
    """Why the balanced launch cannot serve a plan (``None``: it can). Host values only."""
    if not one_query:
        return "more than one query per request (the balanced splits serve decode)"
    if heads > BALANCED_MAX_HEADS:
        return f"{heads} heads (at most {BALANCED_MAX_HEADS}: one head block)"
    if kv_dtype != q_dtype:
        return f"a {kv_dtype} cache under {q_dtype} queries (the cache must be q's dtype)"
    if masked:
        return "custom masks stay on the split launch"
    if batch_invariant:
        return "batch-invariant launches stay on the split launch"
    if batch > BALANCED_MAX_BATCH:
        return f"{batch} requests (at most {BALANCED_MAX_BATCH})"
    return None


def check_rates(rates, what: str = "rates") -> tuple:
    """``rates`` as a tuple of floats, or ``ValueError`` unless it is a non-empty sequence
    of positive, finite numbers (one per SM)."""
    ok = isinstance(rates, (tuple, list)) and len(rates) > 0 and all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
        for r in rates)
    if not ok:
        raise ValueError(f"{what}={rates!r:.80}: one positive, finite rate per SM, e.g. 1 / "
                         "each SM's mean stream time (benchmarks/narrow_timeline.py --by-sm).")
    return tuple(float(r) for r in rates)


def share_weights(rates, programs: int, device=None) -> torch.Tensor:
    """Cumulative float32 weights ``[programs + 1]`` of the slots (``shares``): slot ``s``
    belongs to SM ``s // (programs // len(rates))`` and weighs that SM's ``rates`` entry
    (any positive unit: keys per µs, 1 / a measured stream time). ``w[0] = 0``,
    ``w[-1] = 1`` exactly, non-decreasing. ``programs`` must be a multiple of the SM count
    (the resident programs of every SM)."""
    rates = check_rates(rates)
    if programs < len(rates) or programs % len(rates):
        raise ValueError(f"programs={programs} must be a positive multiple of the "
                         f"{len(rates)} SMs the rates describe (each SM's resident programs).")
    per_sm = programs // len(rates)
    cum = torch.cumsum(torch.tensor([rates[i // per_sm] for i in range(programs)],
                                    dtype=torch.float64), 0)
    # over its own last sum: ends at exactly 1 (rounding to float32 keeps the order)
    cum = torch.cat([torch.zeros(1, dtype=torch.float64), cum / cum[-1]]).to(torch.float32)
    return cum if device is None else cum.to(device)


def claim_state(programs: int, device) -> tuple:
    """Zeroed ``(ticket int64 [1], claims int64 [programs])`` for claiming launches: kept
    across launches (each launch's programs draw tickets ``k·P .. k·P + P - 1``, so launch
    ``k`` claims slots for epoch ``k + 1``; no reset needed). One state per stream: two
    launches sharing it must not overlap."""
    return (torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(programs, dtype=torch.int64, device=device))


def balanced_workspace_shapes(programs: int, heads: int, rank: int):
    """``(part_o shape, part_lse shape)`` of a launch over ``programs`` programs."""
    return (programs, 2, heads, rank), (programs, 2, heads)


@triton.jit
def _lengths(seqused_ptr, batch, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lens, tiles, ends, total)``: keys and key tiles per request ``[BLOCK_B]``, the
    tiles' running sum and the batch's total (requests past ``batch`` count zero)."""
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(seqused_ptr + offs_b, mask=offs_b < batch, other=0).to(tl.int32)
    tiles = (lens + BLOCK_N - 1) // BLOCK_N
    ends = tl.cumsum(tiles, axis=0)
    return lens, tiles, ends, tl.sum(tiles, axis=0)


@triton.jit
def _program_tiles(total, num_programs):
    """Key tiles a program owns: ``⌈total / P⌉``, or the power of two above it where that
    is at most 10 % more (requests of a power-of-two tile count then start on program
    boundaries: one segment a program, as the split launch; 128×8k: 125 -> 128 tiles)."""
    tw = tl.maximum((total + num_programs - 1) // num_programs, 1)
    t2 = tw * 0 + 1
    while t2 < tw:
        t2 = t2 * 2
    return tl.where(t2 * 10 <= tw * 11, t2, tw)


@triton.jit
def _share_bound(shares_ptr, s, total, num_programs):
    """Slot ``s``'s first global tile, ``⌊total · w_s⌋`` (``total`` past the last slot);
    the kernel and the merge compute it alike, so they agree on every boundary."""
    w = tl.load(shares_ptr + tl.minimum(s, num_programs))
    b = tl.minimum((w * total.to(tl.float32)).to(tl.int32), total)
    return tl.where(s >= num_programs, total, b)


@triton.jit
def _claim_slot(ticket_ptr, claims_ptr, p, num_programs, per_sm, HINT: tl.constexpr):
    """The slot this program works on: its launch's epoch from a ticket (one per program,
    ``P`` a launch), then the first slot from its hint whose claim (the epoch it was last
    taken in) it raises, scanning on where another program of the epoch was first."""
    epoch = tl.atomic_add(ticket_ptr, 1) // num_programs + 1
    if HINT == 1:  # the slot meant for this SM
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                       is_pure=False, pack=1)
        s = (sm * per_sm) % num_programs
    else:  # a scatter of the program id whose pairs collide (tests)
        s = ((p // 2) * 7) % num_programs
    found = 0
    while found == 0:
        old = tl.atomic_max(claims_ptr + s, epoch)
        found = (old < epoch).to(tl.int32)
        s = tl.where(found != 0, s, (s + 1) % num_programs)
    return s


@triton.jit
def _mla_balanced_kernel(
    q_ptr, kv_ptr, out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, seqused_ptr, bt_ptr, scale_ptr,
    qk_scale_log2, kv_scale_val, num_heads, batch, num_programs,
    stride_qt, stride_qh, stride_kvp, stride_kvs, stride_ot, stride_oh, stride_bt,
    stride_pp, stride_pw, stride_ph, stride_lp, stride_lw, stride_lh, stride_ot_lse,
    stride_oh_lse, shares_ptr, ticket_ptr, claims_ptr, per_sm,
    PAGE_SIZE: tl.constexpr, KV_LORA: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
    IEEE: tl.constexpr, TILE_IN_PAGE: tl.constexpr, EVEN_D: tl.constexpr,
    WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False, SHARES: tl.constexpr = False,
    CLAIM: tl.constexpr = 0,
):
    if PDL:  # the writes before this launch first; then the merge may start (its prologue)
        wait_then_release()
    p = tl.program_id(0)
    if CLAIM > 0:  # the slot (its share and its partials) this program takes
        p = _claim_slot(ticket_ptr, claims_ptr, p, num_programs, per_sm, CLAIM)
    offs_b = tl.arange(0, BLOCK_B)
    lens, tiles, ends, total = _lengths(seqused_ptr, batch, BLOCK_B, BLOCK_N)
    if SHARES:
        g0 = _share_bound(shares_ptr, p, total, num_programs)
        g1 = _share_bound(shares_ptr, p + 1, total, num_programs)
    else:
        tw = _program_tiles(total, num_programs)
        g0 = p * tw
        g1 = tl.minimum(g0 + tw, total)
    # the first request ending past g0, and where its tiles begin
    r = tl.sum((ends <= g0).to(tl.int32), axis=0)
    cs = tl.sum(tl.where(offs_b < r, tiles, 0), axis=0)

    kv_scale = kv_scale_val
    if SCALE_FROM_PTR:
        kv_scale = tl.load(scale_ptr).to(tl.float32)
    qk_scale = qk_scale_log2 * kv_scale
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < KV_LORA
    offs_dr = tl.arange(0, BLOCK_DR)
    mask_dr = offs_dr < ROPE
    offs_t = tl.arange(0, BLOCK_N)
    o_mask = mask_h[:, None] & mask_dv[None, :]
    unused = tl.zeros([BLOCK_H, 16], dtype=tl.float32)

    while (cs < g1) & (r < batch):
        kv_len = tl.sum(tl.where(offs_b == r, lens, 0), axis=0)  # no second read
        ce = cs + (kv_len + BLOCK_N - 1) // BLOCK_N
        if ce > cs:
            lo = (tl.maximum(g0, cs) - cs) * BLOCK_N
            hi = tl.minimum((tl.minimum(g1, ce) - cs) * BLOCK_N, kv_len)
            q_row = q_ptr + r.to(tl.int64) * stride_qt + offs_h[:, None] * stride_qh
            q_nope = tl.load(q_row + offs_dv[None, :], mask=mask_h[:, None] & mask_dv[None, :],
                             other=0.0)
            q_rope = tl.load(q_row + KV_LORA + offs_dr[None, :],
                             mask=mask_h[:, None] & mask_dr[None, :], other=0.0)
            m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
            bt_row = bt_ptr + r.to(tl.int64) * stride_bt
            if TILE_IN_PAGE:
                page_next = tl.load(bt_row + lo // PAGE_SIZE)
            else:
                page_next = tl.load(bt_row + (lo + offs_t) // PAGE_SIZE, mask=lo + offs_t < hi,
                                    other=0)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + offs_t
                nxt = start + BLOCK_N
                page = page_next.to(tl.int64)
                if TILE_IN_PAGE:
                    page_next = tl.load(bt_row + nxt // PAGE_SIZE, mask=nxt < hi, other=0)
                    row = (page * stride_kvp + (start % PAGE_SIZE) * stride_kvs
                           + offs_t.to(tl.int64) * stride_kvs)
                else:
                    page_next = tl.load(bt_row + (nxt + offs_t) // PAGE_SIZE,
                                        mask=nxt + offs_t < hi, other=0)
                    row = page * stride_kvp + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kvs
                acc, _a, _c, _d, m_i, l_i = _mla_tile(
                    acc, unused, m_i, l_i, q_nope, q_rope, qk_scale, kv_ptr, row, offs_n, hi,
                    kv_ptr, offs_dv, offs_dr, mask_dv, mask_dr, KV_LORA, False, IEEE, EVEN_D,
                    False, False, acc_c=unused, acc_d=unused)
            has = l_i > 0
            l_safe = tl.where(has, l_i, 1.0)
            o = acc * tl.where(has, kv_scale / l_safe, 0.0)[:, None]
            if (cs >= g0) & (ce <= g1):  # the whole request in this program: its row
                tl.store(out_ptr + r.to(tl.int64) * stride_ot + offs_h[:, None] * stride_oh
                         + offs_dv[None, :], to_output(o, out_ptr), mask=o_mask)
                if WRITE_LSE:
                    lse = tl.where(has, (m_i + tl.log2(l_safe)) / _LOG2E, float("-inf"))
                    tl.store(lse_ptr + r.to(tl.int64) * stride_ot_lse + offs_h * stride_oh_lse,
                             lse, mask=mask_h)
            else:  # a crossing request: the head slot if it began before g0, else the tail
                slot = tl.where(cs < g0, 0, 1)
                base = p.to(tl.int64) * stride_pp + slot * stride_pw
                tl.store(part_o_ptr + base + offs_h[:, None] * stride_ph + offs_dv[None, :],
                         o.to(part_o_ptr.dtype.element_ty), mask=o_mask)
                lse2 = tl.where(has, m_i + tl.log2(l_safe), float("-inf"))
                tl.store(part_lse_ptr + p.to(tl.int64) * stride_lp + slot * stride_lw
                         + offs_h * stride_lh, lse2, mask=mask_h)
        cs = ce
        r += 1


@triton.jit
def _mla_balanced_merge_kernel(
    out_ptr, lse_ptr, part_o_ptr, part_lse_ptr, seqused_ptr, batch, num_programs,
    stride_ot, stride_oh, stride_pp, stride_pw, stride_ph, stride_lp, stride_lw, stride_lh,
    stride_ot_lse, stride_oh_lse, shares_ptr,
    KV_LORA: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr, WRITE_LSE: tl.constexpr, PDL: tl.constexpr = False,
    SHARES: tl.constexpr = False, BLOCK_P: tl.constexpr = 16,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_B)
    lens, tiles, ends, total = _lengths(seqused_ptr, batch, BLOCK_B, BLOCK_N)
    tw = _program_tiles(total, num_programs)
    cs = tl.sum(tl.where(offs_b < r, tiles, 0), axis=0)
    ce = cs + tl.sum(tl.where(offs_b == r, tiles, 0), axis=0)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < KV_LORA
    o_ptrs = out_ptr + r.to(tl.int64) * stride_ot + h * stride_oh + offs_dv
    if PDL:  # launched early (the lengths above overlap the attention's tail): its rows,
        gdc_wait()  # partials and LSEs first
    if ce == cs:  # no keys: a zero row, LSE -inf (what the split launch writes)
        tl.store(o_ptrs, tl.zeros([BLOCK_DV], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask_dv)
        if WRITE_LSE:
            tl.store(lse_ptr + r.to(tl.int64) * stride_ot_lse + h * stride_oh_lse,
                     float("-inf"))
    else:
        if SHARES:  # the slots holding its first and last tile (never an empty slot:
            # the last slot whose bound is at most the tile)
            offs_p = tl.arange(0, BLOCK_P)
            inner = (offs_p >= 1) & (offs_p < num_programs)
            bnd = _share_bound(shares_ptr, offs_p, total, num_programs)
            p0 = tl.sum((inner & (bnd <= cs)).to(tl.int32), axis=0)
            p1 = tl.sum((inner & (bnd <= ce - 1)).to(tl.int32), axis=0)
        else:
            p0 = cs // tw
            p1 = (ce - 1) // tw
        if p1 > p0:  # a crossing request (else its program wrote the row)
            m = tl.full([1], float("-inf"), dtype=tl.float32)
            den = tl.zeros([1], dtype=tl.float32)
            acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
            # four programs' partials a step, their loads unrolled (issued together: one
            # step waits for memory once, not four times)
            for c in range(p0, p1 + 1, 4):
                for j in tl.static_range(4):
                    pp64 = (c + j) + tl.zeros([1], dtype=tl.int64)
                    valid = pp64 <= p1
                    if SHARES:  # (an empty slot inside the request wrote an empty
                        # partial, LSE -inf: weight 0)
                        first = _share_bound(shares_ptr, pp64, total, num_programs)
                    else:
                        first = pp64 * tw
                    slot = tl.where(cs < first, 0, 1)
                    lse = tl.load(part_lse_ptr + pp64 * stride_lp + slot * stride_lw
                                  + h * stride_lh, mask=valid, other=float("-inf"))
                    o = tl.load(part_o_ptr + pp64 * stride_pp + slot * stride_pw
                                + h * stride_ph + offs_dv, mask=mask_dv & valid, other=0.0)
                    o = _partial_f32(o, part_o_ptr)
                    m_new = tl.maximum(m, lse)
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m - m_ref)
                    beta = tl.exp2(lse - m_ref)
                    # a part of weight 0 (nothing visible, or past p1) is selected away,
                    # never multiplied
                    acc = acc * alpha + tl.where(beta > 0.0, o * beta, 0.0)
                    den = den * alpha + beta
                    m = m_new
            has = den > 0.0
            safe = tl.where(has, den, 1.0)
            tl.store(o_ptrs, to_output(acc / safe, out_ptr), mask=mask_dv)
            if WRITE_LSE:
                m_safe = tl.where(m == float("-inf"), 0.0, m)
                lse_out = tl.where(has, (m_safe + tl.log2(safe)) / _LOG2E, float("-inf"))
                tl.store(lse_ptr + r.to(tl.int64) * stride_ot_lse + h * stride_oh_lse
                         + tl.zeros([1], dtype=tl.int32), lse_out)


def launch_balanced_mla(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                        seqused_k: torch.Tensor, block_table: torch.Tensor, *, rank: int,
                        qk_scale_log2: float, kv_scale_val: float = 1.0,
                        scale_ptr: Optional[torch.Tensor] = None,
                        lse: Optional[torch.Tensor] = None, part_o: torch.Tensor,
                        part_lse: torch.Tensor, programs: int, block_n: int = 32,
                        num_warps: int = 4, num_stages: int = 3, ieee: bool = False,
                        launches: tuple = ("attention", "merge"), pdl=False,
                        shares: Optional[torch.Tensor] = None, claim: Optional[tuple] = None,
                        claim_hint: int = CLAIM_SM, per_sm: int = 1) -> None:
    """Both launches over ``batch = seqused_k.numel()`` one-query requests (row ``b`` of q
    is request ``b``); checked and planned by the caller (:mod:`.mla`), which passes host
    integers only. ``part_o`` / ``part_lse``: :func:`balanced_workspace_shapes` of
    ``programs``, any contents (every slot the merge reads is written first).
    ``launches``: which of the two run (a benchmark's time split; both by default);
    ``pdl``: :func:`._pdl.pdl_mode` (the merge starts while the attention ends).
    ``shares``: float32 ``[programs + 1]`` cumulative slot weights (:func:`share_weights`)
    instead of equal tile counts. ``claim``: :func:`claim_state` of this stream (needs
    ``shares``): programs claim the slot of their SM (``claim_hint`` :data:`CLAIM_SM`,
    CUDA: slot ``smid · per_sm``, ``per_sm`` each SM's slots as :func:`share_weights` laid
    them out) or of a scatter of their id (:data:`CLAIM_SCATTER`), any free one if taken."""
    if claim is not None and shares is None:
        raise ValueError("claim needs shares: the slots' weights (share_weights)")
    if shares is not None and (shares.dtype != torch.float32 or shares.dim() != 1
                               or shares.numel() != programs + 1):
        raise ValueError(f"shares: float32 [programs + 1 = {programs + 1}] cumulative "
                         f"weights, got {shares.dtype} {tuple(shares.shape)}; make them with "
                         "share_weights(rates, programs).")
    batch, heads, dim = seqused_k.shape[0], q.shape[1], q.shape[2]
    rope = dim - rank
    # at least 16 wide, as the split launch pads them (mla.TritonMLA._bind): q·Kᵀ takes
    # them as its dots' K, which NVIDIA's Triton wants >= 16 (rope 8 did not compile)
    block_dv, block_dr = max(16, next_pow2(rank)), max(16, next_pow2(max(rope, 1)))
    block_b = max(16, next_pow2(batch))
    lse_t = lse if lse is not None else part_lse
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    if "attention" in launches:
        _attention(q, kv_cache, out, seqused_k, block_table, rank, rope, qk_scale_log2,
                   kv_scale_val, scale_ptr, lse, lse_t, lse_strides, part_o, part_lse,
                   programs, block_n, block_dv, block_dr, block_b, num_warps, num_stages,
                   ieee, pdl, shares, claim, claim_hint, per_sm)
    if "merge" in launches:
        args = (out, lse_t, part_o, part_lse, seqused_k, batch, programs,
                out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1),
                part_o.stride(2), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
                *lse_strides, shares if shares is not None else part_lse)
        kw = dict(KV_LORA=rank, BLOCK_DV=block_dv, BLOCK_N=block_n, BLOCK_B=block_b,
                  WRITE_LSE=lse is not None, num_warps=4, SHARES=shares is not None,
                  BLOCK_P=max(16, next_pow2(programs + 1)),
                  **pdl_kwargs(pdl, reduction=True))
        _BALANCED_MERGE.launch((batch, heads), args, kw, launch_key(args, kw))


def _attention(q, kv_cache, out, seqused_k, block_table, rank, rope, qk_scale_log2,
               kv_scale_val, scale_ptr, lse, lse_t, lse_strides, part_o, part_lse, programs,
               block_n, block_dv, block_dr, block_b, num_warps, num_stages, ieee, pdl,
               shares, claim, claim_hint, per_sm):
    batch, heads = seqused_k.shape[0], q.shape[1]
    page_size = kv_cache.shape[1]
    ticket, claims = claim if claim is not None else (part_lse, part_lse)
    args = (q, kv_cache, out, lse_t, part_o, part_lse, seqused_k, block_table,
            scale_ptr if scale_ptr is not None else part_lse,
            qk_scale_log2, kv_scale_val, heads, batch, programs,
            q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1),
            out.stride(0), out.stride(1), block_table.stride(0),
            part_o.stride(0), part_o.stride(1), part_o.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2), *lse_strides,
            shares if shares is not None else part_lse, ticket, claims, per_sm)
    kw = dict(
        PAGE_SIZE=page_size, KV_LORA=rank, ROPE=rope, BLOCK_DV=block_dv, BLOCK_DR=block_dr,
        BLOCK_H=max(16, next_pow2(heads)), BLOCK_N=block_n, BLOCK_B=block_b,
        SCALE_FROM_PTR=scale_ptr is not None, IEEE=ieee,
        TILE_IN_PAGE=page_size % block_n == 0,
        EVEN_D=block_dv == rank and block_dr == rope, WRITE_LSE=lse is not None,
        num_warps=num_warps, num_stages=num_stages, SHARES=shares is not None,
        CLAIM=int(claim_hint) if claim is not None else 0,
        **pdl_kwargs(pdl, reduction=False))
    _BALANCED.launch((programs,), args, kw, launch_key(args, kw))


#: both launches, direct once compiled (:mod:`._launch`)
_BALANCED = Launcher(_mla_balanced_kernel)
_BALANCED_MERGE = Launcher(_mla_balanced_merge_kernel)
