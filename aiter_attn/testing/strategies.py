"""Hypothesis strategies for paged-attention inputs: page sizes, GQA layer specs, and batches
over block-permuted pools (null page 0), for property tests of metadata invariants."""

from __future__ import annotations

from typing import Optional, Sequence

import attrs
import torch
from hypothesis import strategies as st

from ..batch import ForwardBatch, SpecInfo
from ..contract import contract_of
from ..kvcache import PageAllocator, ReqToTokenPool
from ..types import BackendConfig, ForwardMode, LayerSpec, SpecDecodeConfig

__all__ = ["page_sizes", "layer_specs", "request_lengths", "PagedBatch", "paged_batches"]


def page_sizes(*, choices: Sequence[int] = (1, 2, 7, 16, 48, 64)) -> st.SearchStrategy[int]:
    """Page sizes incl. 1 and non-powers-of-two."""
    return st.sampled_from(list(choices))


@st.composite
def layer_specs(draw, *, head_dims: Sequence[int] = (16, 32, 64, 80, 128),
                max_kv_heads: int = 4, max_group: int = 6, layer_id: int = 0) -> LayerSpec:
    """A GQA/MQA/MHA layer: kv heads 1..max_kv_heads, group 1..max_group (5:1 included)."""
    kv = draw(st.integers(1, max_kv_heads))
    group = draw(st.integers(1, max_group))
    d = draw(st.sampled_from(list(head_dims)))
    return LayerSpec(layer_id=layer_id, num_q_heads=kv * group, num_kv_heads=kv, head_dim=d)


@st.composite
def request_lengths(draw, *, mode: ForwardMode, max_bs: int = 6, max_prefix: int = 150,
                    max_new: int = 40, min_bs: int = 1, draft_tokens: int = 1):
    """``(prefix_lens, new_lens)`` per request; ``new ≤`` total, decode-like modes uniform."""
    bs = draw(st.integers(min_bs, max_bs))
    prefix = draw(st.lists(st.integers(0, max_prefix), min_size=bs, max_size=bs))
    tokens = contract_of(mode).tokens  # what the mode contract gives each request
    if tokens == "one":
        new = [1] * bs
    elif tokens == "draft":
        new = [draft_tokens] * bs
    else:
        new = draw(st.lists(st.integers(1, max_new), min_size=bs, max_size=bs))
    return prefix, new


@attrs.define(eq=False)
class PagedBatch:
    """A batch over a block-permuted pool, without KV data (metadata property tests)."""

    config: BackendConfig
    req_pool: ReqToTokenPool
    allocator: PageAllocator
    batch: ForwardBatch
    prefix_lens: list
    new_lens: list


@st.composite
def paged_batches(draw, *, mode: ForwardMode = ForwardMode.EXTEND,
                  page_size: Optional[int] = None, max_bs: int = 6, max_prefix: int = 150,
                  max_new: int = 40, draft_tokens: int = 1, max_context_len: int = 256):
    """A :class:`PagedBatch` for ``mode`` with shuffled page allocation and a few idle rows.

    A draft-count mode (TARGET_VERIFY, DRAFT_EXTEND_V2) gets ``draft_tokens`` per request, a
    chain ``SpecInfo`` and ``BackendConfig.spec`` to match, so the batch is valid as drawn."""
    longest = max_prefix + (max_new if contract_of(mode).tokens == "ragged" else
                            draft_tokens if contract_of(mode).tokens == "draft" else 1)
    if longest > max_context_len:  # the allocator would refuse the draw itself
        raise ValueError(
            f"paged_batches(max_prefix={max_prefix}, ...) can draw requests of {longest} "
            f"tokens > max_context_len={max_context_len}; lower max_prefix/max_new or raise "
            "max_context_len.")
    ps = page_size if page_size is not None else draw(page_sizes())
    prefix, new = draw(request_lengths(mode=mode, max_bs=max_bs, max_prefix=max_prefix,
                                       max_new=max_new, draft_tokens=draft_tokens))
    seed = draw(st.integers(0, 2**16))
    draft = contract_of(mode).tokens == "draft"
    spec_info = SpecInfo(num_draft_tokens=draft_tokens) if draft else None
    cfg = BackendConfig(page_size=ps, max_batch_size=max_bs + 2, max_context_len=max_context_len,
                        dtype=torch.float32,
                        spec=SpecDecodeConfig(num_draft_tokens=draft_tokens) if draft else None)
    total_pages = sum(-(-(p + n) // ps) for p, n in zip(prefix, new)) + 3
    req_pool = ReqToTokenPool(len(prefix) + 3, max_context_len)
    alloc = PageAllocator(total_pages + draw(st.integers(0, 8)), ps, shuffle_seed=seed)
    # an unrelated request holds pages too, so foreign pages exist in the pool
    other = req_pool.alloc()
    # (at most 2 pages, the 2 of the 3 spare pages above, and never past its row's width)
    alloc.extend(req_pool, other, draw(st.integers(0, min(2 * ps, max_context_len))))
    rows = [req_pool.alloc() for _ in prefix]
    order = draw(st.permutations(rows))
    locs = []
    for row, p in zip(order, prefix):
        alloc.extend(req_pool, row, p)
    for row, n in zip(order, new):
        locs.append(alloc.extend(req_pool, row, n))
    seq = [alloc.tokens_held(r) for r in order]
    batch = ForwardBatch.from_lengths(
        forward_mode=mode, req_pool_indices=list(order), seq_lens=seq,
        out_cache_loc=torch.cat(locs) if locs else torch.zeros(0, dtype=torch.int64),
        extend_seq_lens=new, spec_info=spec_info,
    )
    return PagedBatch(cfg, req_pool, alloc, batch, prefix, new)
