"""Defects found hunting the KV pools (page allocator, request→token table, SWA allocator, pool
geometry) and multi-step draft decode: each test failed before its fix."""

import pytest
import torch

from aiter_attn import BackendConfig, ForwardBatch, ForwardMode, SpecDecodeConfig
from aiter_attn.kvcache import (MHAKVPool, MLAKVPool, PageAllocator, ReqToTokenPool, SWAKVPool,
                                SWAPageAllocator, Vec5DKVPool)
from aiter_attn.multistep import MultiStepDraftBackend


def _one_request(ps=4, tokens=12, pages=16):
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(pages, ps)
    row = pool.alloc()
    alloc.extend(pool, row, tokens)
    return pool, alloc, row


# -- PageAllocator / ReqToTokenPool -----------------------------------------------------------
def test_share_prefix_refuses_a_negative_token_count():
    """``share_prefix(num_tokens=-1)`` shared all but the last page (``pages[:-1]``), set the
    destination's held length to -4 and copied ``req_to_token[src, :-4]`` (almost the whole
    row) into the destination."""
    pool, alloc, src = _one_request()
    dst = pool.alloc()
    with pytest.raises(ValueError, match=r"num_tokens=-1 must be an integer ≥ 0"):
        alloc.share_prefix(pool, src, dst, -1)
    assert alloc.tokens_held(dst) == 0 and alloc.pages_of(dst) == []
    assert int(pool.req_to_token[dst].abs().sum()) == 0


def test_a_tensor_row_is_its_int_row():
    """A row read from ``req_pool_indices`` (a one-element tensor) hashes by identity: each
    ``extend`` started the request over at token 0 (overwriting its slots, leaking its pages)
    and ``free`` of the same row twice put it on the free list twice (two requests got it)."""
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(16, 4)
    row = pool.alloc()
    first = alloc.extend(pool, torch.tensor(row), 3)
    second = alloc.extend(pool, torch.tensor(row), 3)
    assert alloc.tokens_held(row) == 6
    assert alloc.free_pages == 16 - 1 - 2
    assert torch.equal(pool.req_to_token[row, :6].long(), torch.cat([first, second]))
    alloc.release(pool, torch.tensor(row))
    assert alloc.free_pages == 16 - 1
    with pytest.raises(ValueError, match=rf"row {row} is not allocated"):
        pool.free(torch.tensor(row))
    assert pool.available == 3


@pytest.mark.parametrize("bad", [True, 1.0, torch.tensor(1.0), torch.tensor(True), "1"])
def test_a_row_that_is_not_an_integer_is_refused(bad):
    """``True`` passed as row 1 and ``1.0`` was looked up as row 1 in the free set, then broke
    the table's indexing; a row must be an integer."""
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(16, 4)
    assert pool.alloc() == 1
    with pytest.raises(ValueError, match="is not a row index"):
        alloc.extend(pool, bad, 1)
    with pytest.raises(ValueError, match="is not a row index"):
        pool.free(bad)
    assert alloc.tokens_held(1) == 0 and pool.available == 2


@pytest.mark.parametrize("call", ["extend", "truncate"])
@pytest.mark.parametrize("bad", [True, 0.5, 2.0])
def test_token_counts_must_be_integers(call, bad):
    """``truncate(row, 0.5)`` set the held length to 0.5 (the next ``extend`` then failed in
    ``torch.arange`` or built float slots) and ``extend(row, True)`` reserved one token."""
    pool, alloc, row = _one_request(tokens=4)
    name = "num_new_tokens" if call == "extend" else "num_tokens"
    with pytest.raises(ValueError, match=rf"{name}={bad!r} must be an integer ≥ 0"):
        if call == "extend":
            alloc.extend(pool, row, bad)
        else:
            alloc.truncate(row, bad)
    assert alloc.tokens_held(row) == 4


# -- SWAPageAllocator ---------------------------------------------------------------------------
def _swa(ps=4):
    pool = SWAKVPool.create(num_full_pages=16, num_swa_pages=16, page_size=ps, num_kv_heads=1,
                            head_dim=4, layer_is_swa=[True, False], dtype=torch.float32)
    req = ReqToTokenPool(3, 64)
    return pool, req, SWAPageAllocator(pool)


def test_swa_truncate_below_freed_window_is_refused():
    """After ``free_swa_out_of_window(next_position=10, window=3)`` unmapped tokens 0..7,
    ``truncate(row, 9)`` was accepted: the next query (position 9) sees key 7, whose SWA
    slot now translates to the null slot 0, so SWA layers read zeros."""
    pool, req, alloc = _swa()
    row = req.alloc()
    alloc.extend(req, row, 12)
    assert alloc.free_swa_out_of_window(row, 3, next_position=10) == 2  # tokens 0..7
    with pytest.raises(ValueError, match=r"truncate\(row=1, num_tokens=9\).*≥ 10"):
        alloc.truncate(row, 9)
    assert alloc.tokens_held(row) == 12
    alloc.truncate(row, 10)  # the query at 10 sees keys 8.. (all mapped)
    keys = req.req_to_token[row, 8:10].long()
    assert bool((pool.translate(keys) > 0).all())
    alloc.release(req, row)
    row = req.alloc()  # the same row, a new request: no floor left from the old one
    alloc.extend(req, row, 4)
    alloc.truncate(row, 0)


# -- pool geometry ------------------------------------------------------------------------------
@pytest.mark.parametrize("make,name", [
    (lambda: MHAKVPool(8, 4, 0, 8, 1), "num_kv_heads"),
    (lambda: MHAKVPool(8, 4, 2, 8, 1, v_head_dim=0), "v_head_dim"),
    (lambda: MHAKVPool(0, 4, 2, 8, 1), "num_pages"),
    (lambda: MHAKVPool(8, 4, 2, 8, -1), "num_layers"),
    (lambda: MHAKVPool(8, 4, 2, 8, 1, dtype=torch.int32), "dtype"),
    (lambda: Vec5DKVPool(8, 8, 0, 8, 1), "num_kv_heads"),
    (lambda: Vec5DKVPool(8, 8, 2, 0, 1), "head_dim"),
    (lambda: MLAKVPool(8, True, 8, 4, 1), "page_size"),
    (lambda: MLAKVPool(8, 4, 8, 4, 1, dtype=torch.int64), "dtype"),
])
def test_pool_geometry_is_checked_up_front(make, name):
    """These pools were built (zero heads, zero-width values, no pages, an int cache, a bool
    page size) and failed only later, far from the cause, or never."""
    with pytest.raises(ValueError, match=rf"\.{name}="):
        make()


# -- MultiStepDraftBackend ----------------------------------------------------------------------
def _multistep():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=2, num_steps=3))
    pool = ReqToTokenPool(4, 64)
    alloc = PageAllocator(32, 4)
    rows = [pool.alloc(), pool.alloc()]
    for row in rows:
        alloc.extend(pool, row, 9 + 2 * 8)
    return cfg, pool, rows


def _batch(rpi, seq_lens, seq_lens_cpu):
    return ForwardBatch(forward_mode=ForwardMode.DECODE, req_pool_indices=rpi,
                        seq_lens=seq_lens, seq_lens_cpu=seq_lens_cpu,
                        out_cache_loc=torch.zeros(len(seq_lens_cpu), dtype=torch.int64))


@pytest.mark.parametrize("field,rpi,seq_lens,exc", [
    # one row for two requests: request 1's branches read and wrote request 0's slots
    ("req_pool_indices", [1], [9, 9], ValueError),
    ("req_pool_indices", torch.tensor([1.0, 2.0]), [9, 9], TypeError),
    ("seq_lens", [1, 2], [9, 9, 9], ValueError),
    ("seq_lens", [1, 2], torch.tensor([[9], [9]], dtype=torch.int32), ValueError),
])
def test_multistep_refuses_batch_tensors_that_do_not_fit(field, rpi, seq_lens, exc):
    """``MultiStepDraftBackend`` skipped the batch's structural checks: ``req_pool_indices``
    shorter than the batch planned request 1 on request 0's row (its draft K/V written into
    another request's slots); float rows or a 2-D ``seq_lens`` were planned or failed deep in
    the index op with a message about the step buffers."""
    cfg, pool, _ = _multistep()
    ms = MultiStepDraftBackend(cfg, pool, None)
    rpi = rpi if isinstance(rpi, torch.Tensor) else torch.tensor(rpi)
    seq_lens = (seq_lens if isinstance(seq_lens, torch.Tensor)
                else torch.tensor(seq_lens, dtype=torch.int32))
    with pytest.raises(exc, match=rf"batch\.{field}"):
        ms.plan(_batch(rpi, seq_lens, torch.tensor([9, 9])))


@pytest.mark.parametrize("kw", [dict(topk=2.5), dict(num_steps=3.7), dict(topk=True)])
def test_multistep_refuses_fractional_topk_and_steps(kw):
    """``int(2.5)``: a fractional ``topk`` / ``num_steps`` was silently rounded down (and
    ``True`` taken as 1), so the plan's draft layout differed from the caller's."""
    cfg, pool, _ = _multistep()
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"{name}={kw[name]!r} must be an integer ≥ 1"):
        MultiStepDraftBackend(cfg, pool, None, **kw)
