"""Device-side grouping for cascade attention: no host sync, fixed-size buffers, graph-safe.

From a step's page table this plans, with torch index ops only (every size is a host bound:
batch rows, page-table width, query tokens), the same groups as the host oracle
:func:`aiter_attn.kernels.reference_cascade.cascade_groups_reference`:

1. ``links[b]`` (``b ≥ 1``): leading page ids request ``b`` shares with request ``b − 1``,
   counting only non-null pages that lie wholly before the first query of both (``prefix
   pages = (seqused_k − q_len) // page_size``);
2. request ``b`` joins its predecessor's run when ``links[b] ≥ min_shared_pages``; run ids are
   the cumulative sum of run starts; a run's shared pages are the ``amin`` of its links
   (``scatter_reduce``), 0 for a run of one request;
3. query tiles of ``block_t`` tokens over each run's contiguous token range (the run's
   requests are consecutive, so are their tokens), laid out one after the other in a fixed
   ``[num_tiles]`` table (``searchsorted`` over the runs' cumulative tile counts); tiles past
   the last run's are empty (``tok0 == tok1``) and their programs exit at once;
4. the own page table: each row shifted left by its run's shared pages (null pages after),
   ``seqused_k − S``; per token its absolute position and its run's shared length.

Everything is written into the caller's buffers (views of static buffers under CUDA graphs,
fresh ones eagerly), so a replayed graph reads the replay's grouping at the capture's
addresses.
"""

from __future__ import annotations

from typing import Optional

import attrs
import torch

__all__ = ["CascadeIndex", "cascade_index_buffers", "plan_cascade_index", "num_tiles_bound"]

_T = dict(eq=False, repr=False)


def num_tiles_bound(num_tokens: int, batch: int, block_t: int) -> int:
    """Query tiles any grouping of ``batch`` requests and ``num_tokens`` tokens can need:
    ``Σ_g ceil(n_g / block_t) ≤ ceil(T / block_t) + batch // 2`` (runs have ≥ 2 requests)."""
    return -(-max(num_tokens, 0) // block_t) + batch // 2 + 1


@attrs.frozen(kw_only=True)
class CascadeIndex:
    """One step's cascade grouping (device tensors; views of the caller's buffers).

    Attributes:
        own_block_table: int32 ``[B, W]``: each row after its run's shared pages.
        own_seqused_k: int32 ``[B]``: ``seqused_k − S`` (``S`` = the run's shared tokens).
        tiles: int32 ``[num_tiles, 4]``: per query tile ``(tok0, tok1, leader_row, S)``:
            tokens ``[tok0, tok1)`` of the tile's run that the tile starts at ``tok0`` (it
            covers ``min(block_t, tok1 − tok0)`` of them), the run's first request (whose
            page-table row holds the shared pages) and its shared tokens; an empty tile has
            ``tok0 == tok1``.
        q_pos: int32 ``[T]``: absolute position of every query token.
        tok_shared: int32 ``[T]``: shared tokens of each token's run (0: no run).
        shared_pages: int32 ``[B]``: shared pages of each request's run (0: none).
        block_t: query tokens per tile (host int).
    """

    own_block_table: torch.Tensor = attrs.field(**_T)
    own_seqused_k: torch.Tensor = attrs.field(**_T)
    tiles: torch.Tensor = attrs.field(**_T)
    q_pos: torch.Tensor = attrs.field(**_T)
    tok_shared: torch.Tensor = attrs.field(**_T)
    shared_pages: torch.Tensor = attrs.field(**_T)
    block_t: int = 1


def cascade_index_buffers(batch: int, width: int, num_tokens: int, num_tiles: int,
                          device) -> dict:
    """Fresh buffers for :func:`plan_cascade_index` (names as its ``out`` keys)."""
    z = dict(dtype=torch.int32, device=device)
    return {
        "own_block_table": torch.zeros(batch, width, **z),
        "own_seqused_k": torch.zeros(batch, **z),
        "tiles": torch.zeros(num_tiles, 4, **z),
        "q_pos": torch.zeros(num_tokens, **z),
        "tok_shared": torch.zeros(num_tokens, **z),
        "shared_pages": torch.zeros(batch, **z),
        # scratch of the Triton planner (kernels/triton/cascade_index.py)
        "links": torch.zeros(batch, **z),
        "scratch": torch.zeros(4 * batch, **z),
    }


def plan_cascade_index(block_table: torch.Tensor, seqused_k: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, *, page_size: int, min_shared_pages: int,
                       num_tokens: int, block_t: int, out: Optional[dict] = None
                       ) -> CascadeIndex:
    """Group the batch on the device (see the module docstring); no host sync.

    Args:
        block_table: int32 ``[B, W]`` page ids (0 = null page).
        seqused_k: int ``[B]`` KV length per request (this step's tokens included).
        cu_seqlens_q: int ``[B + 1]`` query offsets.
        page_size: tokens per page.
        min_shared_pages: least pages a link needs (``≥ 1``).
        num_tokens: query tokens ``T`` (host int: the plan's).
        block_t: query tokens per tile.
        out: buffers from :func:`cascade_index_buffers` (at least ``B`` rows, ``W`` columns,
            ``T`` tokens, :func:`num_tiles_bound` tiles); ``None`` allocates them.
    """
    bs, width = block_table.shape
    dev = block_table.device
    n_tiles = num_tiles_bound(num_tokens, bs, block_t)
    if out is None:
        out = cascade_index_buffers(bs, width, num_tokens, n_tiles, dev)
    own_bt = out["own_block_table"][:bs, :width]
    own_len = out["own_seqused_k"][:bs]
    tiles = out["tiles"][:n_tiles]
    q_pos = out["q_pos"][:num_tokens]
    tok_shared = out["tok_shared"][:num_tokens]
    shared_out = out["shared_pages"][:bs]
    if bs == 0:
        tiles.zero_()
        return CascadeIndex(own_block_table=own_bt, own_seqused_k=own_len, tiles=tiles,
                            q_pos=q_pos, tok_shared=tok_shared, shared_pages=shared_out,
                            block_t=block_t)
    need = max(int(min_shared_pages), 1)
    i64 = torch.int64
    cu = cu_seqlens_q[: bs + 1].to(i64)
    lens = seqused_k.to(i64)
    q_len = cu[1:] - cu[:-1]
    prefix = torch.clamp(lens - q_len, min=0) // page_size  # [B] whole pages before the queries
    bt = block_table.to(i64)
    col = torch.arange(width, device=dev, dtype=i64)

    # 1. links with the previous request
    pair_prefix = torch.minimum(prefix[1:], prefix[:-1])
    same = (bt[1:] == bt[:-1]) & (bt[1:] != 0) & (col.unsqueeze(0) < pair_prefix.unsqueeze(1))
    links = same.to(i64).cumprod(dim=1).sum(dim=1)  # [B-1]
    linked = links >= need

    # 2. runs and their shared pages
    start = torch.ones(bs, dtype=torch.bool, device=dev)
    start[1:] = ~linked
    run = torch.cumsum(start.to(i64), 0) - 1  # [B]
    big = width + 1
    run_pages = torch.full((bs,), big, dtype=i64, device=dev)
    if bs > 1:
        run_pages.scatter_reduce_(0, run[1:], torch.where(linked, links, big), "amin")
    run_pages = torch.where(run_pages >= big, 0, run_pages)
    sp = run_pages[run]  # [B] shared pages of each request's run
    shared_out.copy_(sp)
    rows = torch.arange(bs, device=dev, dtype=i64)
    leader = torch.full((bs,), bs, dtype=i64, device=dev)
    leader.scatter_reduce_(0, run, rows, "amin")
    last = torch.full((bs,), -1, dtype=i64, device=dev)
    last.scatter_reduce_(0, run, rows, "amax")
    active = run_pages > 0  # runs of ≥ 2 requests sharing ≥ need pages
    leader_c = leader.clamp(max=bs - 1)
    tok0 = cu[leader_c]
    tok1 = cu[(last + 1).clamp(min=0, max=bs)]
    ntile = torch.where(active, (tok1 - tok0 + block_t - 1) // block_t, 0)

    # 3. query tiles of the runs, back to back
    tile_end = torch.cumsum(ntile, 0)  # inclusive
    tid = torch.arange(n_tiles, device=dev, dtype=i64)
    g = torch.searchsorted(tile_end, tid, right=True)
    valid = g < bs
    gc = g.clamp(max=bs - 1)
    local = tid - (tile_end[gc] - ntile[gc])
    t_start = tok0[gc] + local * block_t
    zero = torch.zeros_like(tid)
    tiles[:, 0] = torch.where(valid, t_start, zero)
    tiles[:, 1] = torch.where(valid, tok1[gc], zero)
    tiles[:, 2] = torch.where(valid, leader_c[gc], zero)
    tiles[:, 3] = torch.where(valid, run_pages[gc] * page_size, zero)

    # 4. own tables, token positions, per-token shared length
    src = col.unsqueeze(0) + sp.unsqueeze(1)
    keep = src < width
    own_bt.copy_(torch.where(keep, torch.gather(bt, 1, src.clamp(max=width - 1)), 0))
    own_len.copy_(lens - sp * page_size)
    if num_tokens:
        t = torch.arange(num_tokens, device=dev, dtype=i64)
        req = torch.searchsorted(cu[1:], t, right=True).clamp(max=bs - 1)
        q_pos.copy_(lens[req] - (cu[req + 1] - t))
        tok_shared.copy_(sp[req] * page_size)
    return CascadeIndex(own_block_table=own_bt, own_seqused_k=own_len, tiles=tiles,
                        q_pos=q_pos, tok_shared=tok_shared, shared_pages=shared_out,
                        block_t=block_t)
