"""Readable float32 torch reference of cascade (shared-prefix) attention.

When consecutive requests of a batch hold the same leading pages (identical page ids at the
same positions of their page-table rows, as prefix sharing produces), their attention over
those pages can be computed in one pass for all of the group's queries and merged with the
attention over each request's own remaining pages by the log-sum-exp::

    attn(q, keys [0, L))  =  merge( attn(q, keys [0, S)),  attn(q, keys [S, L)) )

where ``S`` is the group's shared length (whole pages). The split is exact for every layer
feature the ordinary kernel has, because visibility depends only on (query position, key
position), and both passes use the true positions:

* causal: ``S ≤ L − n`` for every member (the shared pages end before the first query of
  every member), so every shared key precedes every query;
* sliding window ``(left, right)``: the shared pass masks key ``j`` for query position ``p``
  unless ``j ≥ p − left`` (a window may start inside the shared prefix); the own pass sees
  keys ``[S, L)`` at positions shifted by ``S`` together with the queries, which leaves the
  window unchanged;
* sinks: counted once, in the own pass (which always holds the query's own key);
* soft-cap: per logit, so it splits.

Grouping (:func:`cascade_groups_reference`, the host oracle of the device planner in
:mod:`aiter_attn.kernels.cascade_plan`): runs of consecutive requests, each request linked to
the previous one when their common leading *prefix pages* (non-null, both requests' whole
pages before their first query) number at least ``min_shared_pages``; a run of ≥ 2 requests
shares ``min`` of its links' page counts (the run's common prefix). Everything else is a
singleton that shares nothing.
"""

from __future__ import annotations

from typing import Optional

import torch

from .reference import (_gather_request_kv, _scale_value, merge_attention_states_reference,
                        paged_attention_reference)
from ..types import kv_dequant_scales

__all__ = ["CascadeGroup", "cascade_groups_reference", "cascade_attention_reference",
           "cascade_shared_reference"]


class CascadeGroup(tuple):
    """``(first, last, shared_pages)``: requests ``first..last`` (inclusive, consecutive)
    share their first ``shared_pages`` pages (those of row ``first``)."""

    __slots__ = ()

    def __new__(cls, first: int, last: int, shared_pages: int):
        return super().__new__(cls, (int(first), int(last), int(shared_pages)))

    first = property(lambda self: self[0])
    last = property(lambda self: self[1])
    shared_pages = property(lambda self: self[2])


def _prefix_pages(kv_len: int, q_len: int, page_size: int) -> int:
    return max(kv_len - q_len, 0) // page_size


def cascade_groups_reference(block_table, seqused_k, cu_seqlens_q, page_size: int,
                             min_shared_pages: int) -> list:
    """The groups of a batch (host Python; see the module docstring). Returns a list of
    :class:`CascadeGroup` with ``shared_pages ≥ min_shared_pages`` and ≥ 2 members, in
    request order. ``min_shared_pages < 1`` is treated as 1 (sharing nothing is no group)."""
    bt = block_table.tolist()
    lens = seqused_k.tolist()
    cu = cu_seqlens_q.tolist()
    bs = len(lens)
    need = max(int(min_shared_pages), 1)
    prefix = [_prefix_pages(lens[b], cu[b + 1] - cu[b], page_size) for b in range(bs)]
    links = [0] * bs  # links[b]: pages request b shares with request b - 1
    for b in range(1, bs):
        n = 0
        limit = min(prefix[b], prefix[b - 1])
        while n < limit and bt[b][n] == bt[b - 1][n] and bt[b][n] != 0:
            n += 1
        links[b] = n
    groups, b = [], 0
    while b < bs:
        e = b
        while e + 1 < bs and links[e + 1] >= need:
            e += 1
        if e > b:
            groups.append(CascadeGroup(b, e, min(links[b + 1:e + 1])))
        b = e + 1
    return groups


def cascade_shared_reference(q, k_cache, v_cache, groups, *, cu_seqlens_q, seqused_k,
                             block_table, softmax_scale: float, window_size=(-1, -1),
                             softcap: float = 0.0, k_scale=None, v_scale=None):
    """The shared pass in float32: for every group, its queries against its shared keys
    ``[0, S)`` at their true positions. Returns ``(out, lse)``: float32 ``[T, Hq, Dv]`` and
    ``[T, Hq]`` (``-inf`` and 0 for tokens of no group and rows whose window excludes every
    shared key)."""
    k_scale, v_scale = kv_dequant_scales(k_cache.dtype, k_scale, v_scale)
    ks, vs = _scale_value(k_scale, "k_scale"), _scale_value(v_scale, "v_scale")
    num_tokens, hq = q.shape[0], q.shape[1]
    group = hq // k_cache.shape[2]
    page_size = k_cache.shape[1]
    out = torch.zeros(num_tokens, hq, v_cache.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, hq), float("-inf"), dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seqused_k.tolist()
    left = window_size[0]
    for g in groups:
        shared = g.shared_pages * page_size
        k = _gather_request_kv(k_cache, block_table[g.first], shared) * ks
        v = _gather_request_kv(v_cache, block_table[g.first], shared) * vs
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        t0, t1 = cu[g.first], cu[g.last + 1]
        # every query of the group, at its own request's positions
        pos = torch.cat([torch.arange(lens[b] - (cu[b + 1] - cu[b]), lens[b])
                         for b in range(g.first, g.last + 1)]).to(q.device)
        s = torch.einsum("nhd,lhd->hnl", q[t0:t1].float(), k) * softmax_scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        key = torch.arange(shared, device=q.device)
        visible = key.unsqueeze(0) <= pos.unsqueeze(1)  # always true: S ≤ every prefix
        if left >= 0:
            visible &= key.unsqueeze(0) >= pos.unsqueeze(1) - left
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [Hq, n]
        safe = torch.where(torch.isfinite(row_lse), row_lse, torch.zeros_like(row_lse))
        p = torch.exp(s - safe.unsqueeze(-1))
        out[t0:t1] = torch.einsum("hnl,lhd->nhd", p, v)
        lse[t0:t1] = row_lse.transpose(0, 1)
    return out, lse


def cascade_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    block_table: torch.Tensor,
    softmax_scale: float,
    min_shared_tokens: int,
    window_size: tuple = (-1, -1),
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    k_scale=None,
    v_scale=None,
    lse: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Causal paged attention computed the cascade way (must equal
    :func:`~aiter_attn.kernels.reference.paged_attention_reference` over the full table).

    Groups from :func:`cascade_groups_reference` with ``min_shared_pages =
    ceil(min_shared_tokens / page_size)``; the own pass is the ordinary reference over each
    request's page-table row shifted by its group's shared pages (``seqused_k − S``), with
    LSE and the sinks; the shared pass is :func:`cascade_shared_reference`; the two merge by
    :func:`~aiter_attn.kernels.reference.merge_attention_states_reference`.

    Shapes as :func:`paged_attention_reference`; ``lse`` optional float32 ``[T, Hq]``.
    """
    page_size = k_cache.shape[1]
    min_pages = -(-int(min_shared_tokens) // page_size)
    groups = cascade_groups_reference(block_table, seqused_k, cu_seqlens_q, page_size,
                                      min_pages)
    shared_pages = torch.zeros(block_table.shape[0], dtype=torch.int64)
    for g in groups:
        shared_pages[g.first:g.last + 1] = g.shared_pages
    width = block_table.shape[1]
    own_table = torch.zeros_like(block_table)
    for b, sp in enumerate(shared_pages.tolist()):
        own_table[b, :width - sp] = block_table[b, sp:]
    own_lens = seqused_k - (shared_pages * page_size).to(seqused_k.device, seqused_k.dtype)
    own = torch.empty(q.shape[0], q.shape[1], v_cache.shape[3], dtype=torch.float32,
                      device=q.device)
    own_lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    paged_attention_reference(
        q, k_cache, v_cache, own, cu_seqlens_q=cu_seqlens_q, seqused_k=own_lens,
        block_table=own_table, softmax_scale=softmax_scale, causal=True,
        window_size=window_size, softcap=softcap, sinks=sinks, k_scale=k_scale,
        v_scale=v_scale, lse=own_lse)
    shared, shared_lse = cascade_shared_reference(
        q, k_cache, v_cache, groups, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
        block_table=block_table, softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    merged = torch.empty_like(own)
    merged_lse = torch.empty_like(own_lse)
    merge_attention_states_reference(own, own_lse, shared, shared_lse, merged, merged_lse)
    out.copy_(merged.to(out.dtype))
    if lse is not None:
        lse.copy_(merged_lse)
    return out
