"""Hunt: the SWA pool's full→SWA translation across sliding windows and shared prefixes, and
multi-step draft decode (tree branches, page sizes 1 and 16) on the hybrid pool."""

from __future__ import annotations

import pytest
import torch

from aiter_attn import (BackendConfig, ForwardMode, ReqToTokenPool, SpecDecodeConfig,
                        SWAKVPool, SWAPageAllocator)

from .test_swa import (backend_for, hybrid_layers, make_swa_scenario, run_multistep_draft,
                       run_step)


def _alloc(ps=4, full=32, swa=32):
    pool = SWAKVPool.create(num_full_pages=full, num_swa_pages=swa, page_size=ps,
                            num_kv_heads=1, head_dim=4, layer_is_swa=[True, False],
                            dtype=torch.float32)
    return pool, ReqToTokenPool(4, 128), SWAPageAllocator(pool, shuffle_seed=3)


# -- translation of padding and null slots ------------------------------------------------------
def test_translate_keeps_padding_slots_negative():
    """``translate`` of a padding slot -1 raised IndexError (on a GPU: a device assert); the
    SWA writes skip negative slots, so padding must stay -1 and the null slot 0 stay 0."""
    pool, req, alloc = _alloc(ps=2)
    row = req.alloc()
    slots = alloc.extend(req, row, 5)
    full = torch.cat([torch.tensor([-1, 0]), slots, torch.tensor([-1])])
    want = torch.cat([torch.tensor([-1, 0]), pool.full_to_swa_index_mapping[slots],
                      torch.tensor([-1])])
    assert torch.equal(pool.translate(full), want)
    out = torch.empty(2, 4, dtype=torch.int64)
    assert pool.translate(full.view(2, 4), out=out) is out
    assert torch.equal(out.view(-1), want)


# -- prefix sharing with SWA pages partly freed -------------------------------------------------
def test_share_prefix_never_hands_out_freed_swa_keys():
    """Donor holds 20 tokens (page 4), window 3, freed pages 0..3 (tokens 0..15). Sharing 12
    tokens gave the new request a query at 12 that sees keys 10, 11, whose SWA pages were
    freed: SWA layers read the null slot's zeros. Only a prefix whose window is still mapped
    may be shared (here none: 0 tokens)."""
    pool, req, alloc = _alloc()
    a, b = req.alloc(), req.alloc()
    alloc.extend(req, a, 20)
    assert alloc.free_swa_out_of_window(a, 3, next_position=19) == 4
    n = alloc.share_prefix(req, a, b, 12)
    keys = req.req_to_token[b, max(n - 3 + 1, 0):n].long()
    assert bool((pool.translate(keys) > 0).all()), (n, pool.translate(keys).tolist())
    assert n == 0 and alloc.pages_of(b) == []


def test_shared_row_inherits_the_truncate_floor():
    """Donor (page 4) holds 24 tokens, window 3, pages 0..2 freed. Sharing 20 tokens is fine
    (a query at 20 sees 18, 19) but the new row's truncate must then refuse lengths whose next
    query sees tokens 0..11 (SWA pages freed): before, truncate(b, 12) was accepted."""
    pool, req, alloc = _alloc()
    a, b = req.alloc(), req.alloc()
    alloc.extend(req, a, 24)
    assert alloc.free_swa_out_of_window(a, 3, next_position=15) == 3  # tokens 0..11
    assert alloc.share_prefix(req, a, b, 20) == 20
    with pytest.raises(ValueError, match=r"truncate\(row=2, num_tokens=12\).*≥ 14"):
        alloc.truncate(b, 12)
    alloc.truncate(b, 14)
    keys = req.req_to_token[b, 12:14].long()
    assert bool((pool.translate(keys) > 0).all())


def test_released_sharer_does_not_free_swa_pages_twice():
    """Two holders of a shared prefix; the donor frees its out-of-window SWA pages, keeping the
    one the sharer still sees; releasing both (the first with keep_pages) puts every SWA page
    back exactly once (a page on the free list twice is handed to two requests)."""
    pool, req, alloc = _alloc(swa=12)
    a, b = req.alloc(), req.alloc()
    alloc.extend(req, a, 16)
    alloc.share_prefix(req, a, b, 12)
    alloc.extend(req, b, 2)
    shared = frozenset(alloc.pages_of(a)[:3])
    # b's next query at 14 sees keys 12, 13 (window 3): pages 0..2 are dead for both
    alloc.free_swa_out_of_window(a, 3, keep_pages=frozenset(alloc.pages_of(a)[2:3]))
    alloc.release(req, a, keep_pages=shared)
    alloc.free_swa_out_of_window(b, 3)
    alloc.release(req, b)
    free = alloc._swa_free
    assert len(free) == len(set(free)) == pool.swa.num_pages - 1
    assert bool((pool.full_to_swa_index_mapping == 0).all())


def test_swa_pool_exhaustion_names_the_pool_and_changes_nothing():
    pool, req, alloc = _alloc(ps=4, full=32, swa=4)
    row = req.alloc()
    alloc.extend(req, row, 9)  # 3 SWA pages of 3
    before = pool.full_to_swa_index_mapping.clone()
    with pytest.raises(RuntimeError, match="SWA pool out of pages: need 1, 0 free"):
        alloc.extend(req, row, 4)
    assert alloc.tokens_held(row) == 9 and torch.equal(pool.full_to_swa_index_mapping, before)
    assert alloc.free_swa_out_of_window(row, 2) == 2  # keys ≥ 8 live: pages 0, 1 dead
    alloc.extend(req, row, 8)  # reuses the freed SWA pages
    live = [p for p in alloc.swa_pages_of(row) if p]
    assert len(live) == len(set(live)) == 3


# -- a long decode: the window slides over many pages ---------------------------------------------
@pytest.mark.parametrize("ps", [1, 16])
def test_long_decode_with_sliding_frees_matches_oracle(ps):
    """Decode across many page boundaries, freeing out-of-window SWA pages every step with an
    SWA pool just big enough for the window: outputs equal the oracle, and no SWA page is
    mapped by two full pages (a freed page handed out while still referenced)."""
    window = 5
    cfg = BackendConfig(page_size=ps, max_context_len=256, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 8, [window, None, window - 2])
    steps = 2 * ps + 6 if ps > 1 else 24
    per_req = -(-window // ps) + 2
    sc = make_swa_scenario(cfg, layers, [3, ps + 2], seed=ps, num_swa_pages=2 * per_req + 6,
                           extra_tokens=steps + 8)
    be = backend_for(sc)
    alloc = sc.allocator
    for _ in range(steps):
        for row in sc.rows:
            alloc.free_swa_out_of_window(row, window)
        run_step(sc, be, ForwardMode.DECODE, [1, 1])
        live = [p for row in sc.rows for p in alloc.swa_pages_of(row) if p]
        assert len(live) == len(set(live))
        assert not set(live) & set(alloc._swa_free)


# -- multi-step draft decode on the hybrid pool ---------------------------------------------------
@pytest.mark.parametrize("page_size,topk,steps", [
    pytest.param(1, 2, 4, id="page1-topk2-steps4"),
    pytest.param(16, 3, 4, id="page16-topk3-steps4"),
    pytest.param(16, 1, 4, id="page16-chain-steps4"),
])
def test_swa_multistep_after_window_slid(page_size, topk, steps):
    """Committed prefixes long enough that the window has left several pages (freed before
    the draft round): every step of every branch equals the oracle."""
    window = 4
    cfg = BackendConfig(page_size=page_size, max_context_len=512, dtype=torch.float32,
                        arch="swa", spec=SpecDecodeConfig(topk=topk, num_steps=steps,
                                                          num_draft_tokens=4))
    layers = hybrid_layers(4, 2, 8, [window, None, window - 1])
    prefixes = [3 * page_size + 5, 2 * page_size + 1] if page_size > 1 else [13, 6]
    sc = make_swa_scenario(cfg, layers, prefixes, seed=page_size + topk, extra_tokens=96)
    for row in sc.rows:
        sc.allocator.free_swa_out_of_window(row, window)
    assert any(p == 0 for row in sc.rows for p in sc.allocator.swa_pages_of(row))
    run_multistep_draft(sc, prefixes, topk, steps, 1e-5)
