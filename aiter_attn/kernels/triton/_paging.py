"""Device-side (``@triton.jit``) helpers shared by the paged attention kernels: the chunked
block-table lookup, and the fp8 value read as 16-bit column pairs (:func:`fp8_pair_ptrs`).

Triton's software pipeliner issues a key tile's copies only one iteration ahead when their
addresses depend on a load in the same iteration (the page id), so the copy latency is never
hidden. The chunked lookup reads the page ids of ``PAGE_CHUNK`` consecutive key tiles in one
load *outside* the pipelined loop (:func:`load_chunk_pages`); inside it each tile picks its
own pages from registers (:func:`tile_pages_of`), and its copies run ``num_stages - 1`` tiles
ahead. Valid when the page size divides ``BLOCK_N`` or is a multiple of it
(``docs/triton_tuning.md``).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["load_chunk_pages", "prefetch_chunk_pages", "tile_pages_of", "fp8_pair_ptrs",
           "split_fp8_pairs"]


@triton.jit
def load_chunk_pages(bt_row, c0, n_in, limit,
                     BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     PAGE_CHUNK: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """Page ids (int64) of key tiles ``c0 … c0 + n_in - 1`` of one request (``bt_row``: its
    block-table row): ``[PAGE_CHUNK]`` when a tile lies inside one page (``TILE_IN_PAGE``),
    else ``[PAGE_CHUNK, BLOCK_N // PAGE_SIZE]``. Pages starting at or past ``limit`` keys
    read as 0 (never past the row's live entries)."""
    offs_c = tl.arange(0, PAGE_CHUNK)
    tiles = c0 + offs_c
    if TILE_IN_PAGE:
        return tl.load(bt_row + (tiles * BLOCK_N) // PAGE_SIZE, mask=offs_c < n_in,
                       other=0).to(tl.int64)
    else:
        PPT: tl.constexpr = BLOCK_N // PAGE_SIZE
        slots = tiles[:, None] * PPT + tl.arange(0, PPT)[None, :]
        return tl.load(bt_row + slots, mask=(offs_c < n_in)[:, None] & (slots * PAGE_SIZE < limit),
                       other=0).to(tl.int64)


@triton.jit
def prefetch_chunk_pages(bt_row, c0, n_in, width,
                         BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                         PAGE_CHUNK: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """:func:`load_chunk_pages` before the request's length is known (a guessed chunk, read
    in the program's first round trip): bounded by the row's ``width`` (the block table's
    columns) instead of the live length. Only tiles that end inside the row are read (a
    caller uses only tiles it proves full, and a full tile ends inside the row); entries
    past the request's last page hold whatever the table holds there."""
    inside = tl.maximum((width * PAGE_SIZE) // BLOCK_N - c0, 0)
    return load_chunk_pages(bt_row, c0, tl.minimum(n_in, inside), width * PAGE_SIZE,
                            BLOCK_N, PAGE_SIZE, PAGE_CHUNK, TILE_IN_PAGE)


@triton.jit
def tile_pages_of(chunk_pages, j, t,
                  BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  PAGE_CHUNK: tl.constexpr, TILE_IN_PAGE: tl.constexpr):
    """``(page, in_page)`` of the tokens of tile ``j`` of the chunk (absolute tile ``t``),
    picked from :func:`load_chunk_pages`'s registers with a select-and-sum: ``page`` is a
    scalar (``TILE_IN_PAGE``) or int64 ``[BLOCK_N]``; ``in_page`` int64 ``[BLOCK_N]``."""
    offs_c = tl.arange(0, PAGE_CHUNK)
    offs_n = tl.arange(0, BLOCK_N)
    if TILE_IN_PAGE:
        page = tl.sum(tl.where(offs_c == j, chunk_pages, 0), 0)
        in_page = ((t * BLOCK_N) % PAGE_SIZE + offs_n).to(tl.int64)
    else:
        PPT: tl.constexpr = BLOCK_N // PAGE_SIZE
        sel = tl.sum(tl.where((offs_c == j)[:, None], chunk_pages, 0), 0)  # [PPT]
        page = tl.reshape(tl.broadcast_to(sel[:, None], (PPT, PAGE_SIZE)), (BLOCK_N,))
        in_page = (offs_n % PAGE_SIZE).to(tl.int64)
    return page, in_page


@triton.jit
def fp8_pair_ptrs(base, rows, COLS: tl.constexpr):
    """Pointers ``[N, COLS/2]`` that read an fp8 value tile ``[N, COLS]`` (rows at int64
    element offsets ``rows`` from ``base``, columns contiguous) as int16, each holding two
    adjacent columns; split what they load with :func:`split_fp8_pairs` for two half-width
    dots. A 16-bit operand goes from shared memory to the MMA layout with ``ldmatrix.trans``,
    where a transposed 8-bit one is read byte by byte. The caller guarantees every row starts
    on a 16-byte boundary (the compiler is told so)."""
    return base.to(tl.pointer_type(tl.int16), bitcast=True) \
        + tl.multiple_of(rows // 2, 8)[:, None] + tl.arange(0, COLS // 2)[None, :]


@triton.jit
def split_fp8_pairs(pairs, FP8: tl.constexpr):
    """``(even, odd)`` columns (``FP8`` values) of int16 pairs read through
    :func:`fp8_pair_ptrs`."""
    odd = (pairs >> 8).to(tl.uint8).to(FP8, bitcast=True)
    even = pairs.to(tl.uint8).to(FP8, bitcast=True)
    return even, odd
