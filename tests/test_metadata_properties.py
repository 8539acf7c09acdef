"""Property tests (hypothesis) of the MHA metadata strategies' invariants."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import ForwardMode, MHAKVPool, ops
from aiter_attn.backend import AttentionBackend
from aiter_attn.testing.invariants import InvariantError, check_invariants, check_ragged_kv
from aiter_attn.metadata import RaggedKV
from aiter_attn.testing.strategies import paged_batches


def _backend(pb):
    pool = MHAKVPool(pb.allocator.num_pages, pb.config.page_size, 1, 8, 1, dtype=torch.float32)
    return AttentionBackend(pb.config, pb.req_pool, pool)


@given(pb=paged_batches(mode=ForwardMode.EXTEND))
def test_extend_metadata_invariants(pb):
    """Extend plans: cu_seqlens_q monotone ending at num_tokens; page table == req_to_token pages,
    inside the pool, null page past each request's length."""
    be = _backend(pb)
    md = be.init_forward_metadata(pb.batch)
    check_invariants(md, pb.batch, be.ctx)
    assert int(md.query.cu_seqlens_q[-1]) == pb.batch.num_tokens


@given(pb=paged_batches(mode=ForwardMode.DECODE))
def test_decode_metadata_invariants(pb):
    """Decode plans: one query per request; page tables consistent with req_to_token."""
    be = _backend(pb)
    md = be.init_forward_metadata(pb.batch)
    check_invariants(md, pb.batch, be.ctx)
    assert md.query.max_seqlen_q == 1


@given(pb=paged_batches(mode=ForwardMode.EXTEND, page_size=1))
def test_ragged_indices_match_req_to_token(pb):
    """Token-level ragged indices list exactly each request's own slots, in order."""
    b = pb.batch
    total = b.seq_lens_sum
    indptr = torch.zeros(b.batch_size + 1, dtype=torch.int32)
    indices = torch.full((total + 5,), -7, dtype=torch.int32)
    ops.build_ragged_kv_indices(pb.req_pool.req_to_token, b.req_pool_indices, b.seq_lens,
                                indptr, indices, total)
    check_ragged_kv(RaggedKV(kv_indptr=indptr, kv_indices=indices), b.seq_lens_cpu,
                    b.req_pool_indices, pb.req_pool.req_to_token)
    assert bool((indices[total:] == -7).all()), "wrote past the total"


@given(pb=paged_batches(mode=ForwardMode.EXTEND), seed=st.integers(0, 1000))
def test_kv_write_touches_only_batch_slots(pb, seed):
    """write_kv changes exactly the batch's out_cache_loc slots; every other byte is identical."""
    g = torch.Generator().manual_seed(seed)
    ps = pb.config.page_size
    k_cache = torch.randn(pb.allocator.num_pages, ps, 2, 8, generator=g)
    v_cache = torch.randn(pb.allocator.num_pages, ps, 2, 8, generator=g)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = pb.batch.out_cache_loc
    k = torch.randn(slots.numel(), 2, 8, generator=g)
    v = torch.randn(slots.numel(), 2, 8, generator=g)
    ops.write_kv(k_cache, v_cache, slots, k, v)
    touched = torch.zeros(k_cache.shape[0] * ps, dtype=torch.bool)
    touched[slots] = True
    kf, vf = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(kf[~touched], k0.view(-1, 2, 8)[~touched])
    assert torch.equal(vf[~touched], v0.view(-1, 2, 8)[~touched])
    assert torch.equal(kf[slots], k) and torch.equal(vf[slots], v)
    assert not bool(touched[:ps].any()), "a live batch wrote into the null page"


def test_checker_catches_a_wrong_page():
    """The invariant checker is not vacuous: a corrupted page table fails."""
    from hypothesis import find

    pb = find(paged_batches(mode=ForwardMode.DECODE, page_size=4),
              lambda p: p.batch.max_seq_len > 4)
    be = _backend(pb)
    md = be.init_forward_metadata(pb.batch)
    md.pages.block_table[0, 0] += 1
    try:
        check_invariants(md, pb.batch, be.ctx)
    except InvariantError:
        return
    raise AssertionError("corrupted page table passed the checker")
