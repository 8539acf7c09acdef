"""KV cache bookkeeping: null page reserved, shuffled allocation, release, prefix sharing,
slot layout matching the page table convention."""

import pytest
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


def test_double_release_does_not_hand_a_row_out_twice():
    """Releasing a request twice (or an unknown row) is refused before anything changes: the
    row must never sit twice in the free list and be given to two live requests."""
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(10, 4)
    row = pool.alloc()
    alloc.extend(pool, row, 5)
    alloc.release(pool, row)
    free_pages, free_rows = alloc.free_pages, pool.available
    with pytest.raises(ValueError, match=rf"row {row} is not allocated"):
        alloc.release(pool, row)
    with pytest.raises(ValueError, match="row 3 is not allocated"):
        alloc.release(pool, 3)  # never handed out
    assert (alloc.free_pages, pool.available) == (free_pages, free_rows)
    rows = [pool.alloc() for _ in range(pool.available)]
    assert len(set(rows)) == len(rows) == 3


def test_null_row_is_never_freed_or_filled():
    """Row 0 (padding rows of captured batches read it) can neither be freed into the free list
    nor get slots: either would make padding rows read a live request's KV."""
    pool = ReqToTokenPool(3, 64)
    alloc = PageAllocator(6, 4)
    with pytest.raises(ValueError, match="row 0 is reserved"):
        pool.free(0)
    with pytest.raises(ValueError, match="row 0 is reserved"):
        alloc.extend(pool, 0, 3)
    with pytest.raises(ValueError, match="outside"):
        alloc.extend(pool, 7, 3)
    assert int(pool.req_to_token[0].abs().sum()) == 0
    assert sorted(pool.alloc() for _ in range(pool.available)) == [1, 2]
    assert alloc.free_pages == 5


def test_bad_extend_and_share_arguments_raise_clear_errors():
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(10, 4)
    row = pool.alloc()
    alloc.extend(pool, row, 6)
    with pytest.raises(ValueError, match=r"num_new_tokens=-3.*≥ 0"):
        alloc.extend(pool, row, -3)
    assert alloc.tokens_held(row) == 6
    dst = pool.alloc()
    with pytest.raises(ValueError, match=r"src_row=3 holds no pages"):
        alloc.share_prefix(pool, 3, dst, 4)


def test_share_prefix_into_a_row_holding_pages_does_not_leak_them():
    """A row truncated to 0 tokens still owns its pages; sharing into it would drop them from
    every list (a leak), so it is refused, and releasing everything returns every page."""
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(10, 4)
    src, dst = pool.alloc(), pool.alloc()
    alloc.extend(pool, src, 8)
    alloc.extend(pool, dst, 8)
    alloc.truncate(dst, 0)
    with pytest.raises(ValueError, match=f"dst_row={dst} already holds"):
        alloc.share_prefix(pool, src, dst, 8)
    alloc.release(pool, dst)
    alloc.release(pool, src)
    assert alloc.free_pages == 9


def test_swa_double_release_is_refused_and_frees_nothing():
    from aiter_attn.kvcache import SWAKVPool, SWAPageAllocator

    kv = SWAKVPool.create(num_full_pages=8, num_swa_pages=6, page_size=4, num_kv_heads=1,
                          head_dim=8, layer_is_swa=[True, False])
    pool = ReqToTokenPool(4, 64)
    alloc = SWAPageAllocator(kv)
    row = pool.alloc()
    alloc.extend(pool, row, 9)
    alloc.release(pool, row)
    state = (alloc.free_pages, alloc.swa_free_pages, pool.available)
    with pytest.raises(ValueError, match=rf"row {row} is not allocated"):
        alloc.release(pool, row)
    assert (alloc.free_pages, alloc.swa_free_pages, pool.available) == state == (7, 5, 3)
    assert int(kv.full_to_swa_index_mapping.abs().sum()) == 0


@pytest.mark.parametrize("page_size", [0, -8])
def test_non_positive_page_size_is_refused_up_front(page_size):
    """A page size < 1 used to build empty pools (or crash with ZeroDivisionError on the first
    extend); every pool and the allocator now name the argument."""
    from aiter_attn.kvcache import Vec5DKVPool

    for make in (lambda: PageAllocator(4, page_size),
                 lambda: MHAKVPool(4, page_size, 2, 16, 1),
                 lambda: Vec5DKVPool(4, page_size, 2, 16, 1)):
        with pytest.raises(ValueError, match=rf"page_size={page_size} must be a positive"):
            make()


@given(ps=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99),
       ops=st.lists(st.tuples(st.sampled_from(["join", "extend", "truncate", "release",
                                               "release_again"]),
                              st.integers(0, 40)), max_size=25))
def test_random_lifecycles_never_share_or_leak(ps, seed, ops):
    """Any sequence of joins, extends, truncations and releases (released rows released again
    are refused): live rows hold disjoint pages, page 0 and row 0 stay out, nothing leaks."""
    pool = ReqToTokenPool(6, 128)
    alloc = PageAllocator(40, ps, shuffle_seed=seed)
    live, gone = [], []
    for op, n in ops:
        if op == "join" and pool.available:
            live.append(pool.alloc())
        elif op == "extend" and live:
            row = live[n % len(live)]
            try:
                alloc.extend(pool, row, n % 9)
            except (RuntimeError, ValueError):  # pool / context full: nothing changes
                pass
        elif op == "truncate" and live:
            row = live[n % len(live)]
            alloc.truncate(row, alloc.tokens_held(row) * (n % 3) // 2)
        elif op == "release" and live:
            row = live.pop(n % len(live))
            alloc.release(pool, row)
            gone.append(row)
        elif op == "release_again" and gone:
            row = gone[n % len(gone)]
            if row in live:
                continue
            with pytest.raises(ValueError, match="not allocated"):
                alloc.release(pool, row)
        pages = [p for r in live for p in alloc.pages_of(r)]
        assert len(pages) == len(set(pages)) and 0 not in pages
        assert alloc.free_pages + len(pages) == 39
        assert len(live) == len(set(live)) and 0 not in live
        assert pool.available + len(live) == 5
        assert int(pool.req_to_token[0].abs().sum()) == 0
