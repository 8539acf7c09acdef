"""KV cache bookkeeping: null page reserved, shuffled allocation, release, prefix sharing,
slot layout matching the page table convention."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import MHAKVPool, PageAllocator, ReqToTokenPool


@given(ps=st.sampled_from([1, 3, 16, 48]), lens=st.lists(st.integers(0, 120), min_size=1,
                                                         max_size=5), seed=st.integers(0, 99))
def test_slots_follow_pages_and_avoid_null_page(ps, lens, seed):
    """Token i of a request lives at page_of(i // ps)·ps + i % ps; page 0 is never handed out;
    no slot is shared between requests."""
    pool = ReqToTokenPool(len(lens) + 1, 128)
    used = sum(-(-(n // 2) // ps) + -(-(n - n // 2 + (n // 2) % ps) // ps) for n in lens)
    alloc = PageAllocator(used + 2, ps, shuffle_seed=seed)
    seen = set()
    for n in lens:
        row = pool.alloc()
        assert row != 0
        first = alloc.extend(pool, row, n // 2)
        rest = alloc.extend(pool, row, n - n // 2)
        slots = torch.cat([first, rest])
        assert torch.equal(pool.req_to_token[row, :n].long(), slots)
        pages = alloc.pages_of(row)
        assert 0 not in pages
        i = torch.arange(n)
        expect = torch.tensor(pages, dtype=torch.long)[i // ps] * ps + i % ps if n else slots
        assert torch.equal(slots, expect)
        assert not (seen & set(slots.tolist()))
        seen |= set(slots.tolist())
    assert alloc.free_pages == used + 1 - sum(len(alloc.pages_of(r)) for r in range(1, len(lens) + 1))


def test_release_and_prefix_sharing():
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(10, 4, shuffle_seed=3)
    a = pool.alloc()
    alloc.extend(pool, a, 10)  # 3 pages, last partial
    b = pool.alloc()
    n = alloc.share_prefix(pool, a, b, 10)
    assert n == 8  # only whole pages are shared
    assert alloc.pages_of(b) == alloc.pages_of(a)[:2]
    alloc.extend(pool, b, 3)
    assert alloc.pages_of(b)[2] not in alloc.pages_of(a)
    free_before = alloc.free_pages
    alloc.release(pool, b, keep_pages=frozenset(alloc.pages_of(a)))
    assert alloc.free_pages == free_before + 1
    assert int(pool.req_to_token[b].abs().sum()) == 0


def test_pool_shapes_and_layer_check():
    pool = MHAKVPool(6, 16, 2, 80, 3, dtype=torch.float16, v_head_dim=64)
    k, v = pool.kv_buffers(2)
    assert k.shape == (6, 16, 2, 80) and v.shape == (6, 16, 2, 64)
    assert pool.num_slots == 96
    try:
        pool.kv_buffers(3)
    except ValueError as e:
        assert "num_hidden_layers" in str(e)
    else:
        raise AssertionError("layer 3 accepted")


def test_truncate_rewinds_length_and_reuses_slots():
    """Rejected drafts: truncate moves the held length back; the next extend reuses the same
    slots (pages stay with the row); out-of-range truncation raises."""
    pool = ReqToTokenPool(3, 64)
    alloc = PageAllocator(8, 4, shuffle_seed=1)
    row = pool.alloc()
    first = alloc.extend(pool, row, 7)
    alloc.truncate(row, 5)
    assert alloc.tokens_held(row) == 5
    again = alloc.extend(pool, row, 2)
    assert torch.equal(again, first[5:7])
    try:
        alloc.truncate(row, 9)
    except ValueError as e:
        assert "0..7" in str(e)
    else:
        raise AssertionError("truncate past the held length accepted")
