"""Regression tests for defects found in the core modules (backend, batch, types) and the
testing helpers (compare, invariants, strategies): each fails on the defect it names."""

import attrs
import pytest
import torch
from hypothesis import find

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, LayerSpec,
                        MHAKVPool, SpecInfo)
from aiter_attn.backend import validate_batch
from aiter_attn.kvcache import PageAllocator, ReqToTokenPool
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.invariants import InvariantError, check_invariants
from aiter_attn.testing.strategies import paged_batches
from aiter_attn.types import SpecDecodeConfig


@pytest.fixture
def setup():
    cfg = BackendConfig(page_size=4, max_batch_size=4, max_context_len=64, dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=8)
    sc = PagedScenario.make(cfg, [layer], [3, 5], seed=1)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    return cfg, layer, sc, be


# -- testing.compare --------------------------------------------------------------------------
def test_assert_close_rel_refuses_a_nan_reference():
    """A NaN reference made the relative error NaN, and ``NaN > rtol`` is False: the check
    passed whatever ``actual`` held."""
    expected = torch.tensor([1.0, float("nan"), 3.0])
    with pytest.raises(AssertionError, match="expected.*non-finite"):
        assert_close_rel(torch.tensor([1.0, 2.0, 3.0]), expected, 1e-3, "ref")


# -- testing.invariants -----------------------------------------------------------------------
def _planned(mode=ForwardMode.EXTEND):
    pb = find(paged_batches(mode=mode, page_size=4),
              lambda p: p.batch.batch_size >= 2 and p.batch.max_seq_len > 4)
    pool = MHAKVPool(pb.allocator.num_pages, 4, 1, 8, 1, dtype=torch.float32)
    be = AttentionBackend(pb.config, pb.req_pool, pool)
    return pb, be, be.init_forward_metadata(pb.batch)


@pytest.mark.parametrize("field,change", [
    ("query", lambda md: attrs.evolve(md.query, num_tokens=md.query.num_tokens + 3)),
    ("batch_size", lambda md: md.batch_size + 1),
    ("mode", lambda md: ForwardMode.DECODE),
], ids=["num_tokens", "batch_size", "mode"])
def test_check_invariants_catches_a_wrong_host_field(field, change):
    """QueryLayout.num_tokens (documented ``== cu_seqlens_q[-1]``, the step's query tokens),
    AttnMetadata.batch_size and mode were never compared with the batch: a plan with any of
    them wrong passed the checker."""
    pb, be, md = _planned()
    check_invariants(md, pb.batch, be.ctx)  # the real plan passes
    broken = attrs.evolve(md, **{field: change(md)})
    with pytest.raises(InvariantError):
        check_invariants(broken, pb.batch, be.ctx)


# -- testing.strategies -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", [ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2])
def test_paged_batches_of_draft_modes_are_valid(mode):
    """``paged_batches(mode=<draft mode>, draft_tokens=n)`` gave n slots per request but no
    spec_info (so q_lens_cpu said 1) and no BackendConfig.spec: the batch it drew was refused
    by the backend's own validation."""
    pb = find(paged_batches(mode=mode, draft_tokens=3), lambda p: True)
    assert pb.batch.q_lens_cpu.tolist() == [3] * pb.batch.batch_size
    assert pb.config.spec is not None and pb.config.spec.num_draft_tokens == 3
    validate_batch(pb.batch, pb.config, pb.req_pool.req_to_token)


# -- backend: forward's q/k/v checks ---------------------------------------------------------
def test_forward_refuses_k_v_of_another_dtype(setup):
    """k/v in a dtype other than the backend's went into the KV write unchecked (silently
    cast into the cache, even from an integer tensor)."""
    cfg, layer, sc, be = setup
    batch = sc.next_batch("extend", [2, 3])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    with pytest.raises(TypeError, match=r"k has dtype torch.float16.*float32"):
        be.forward(q, k.half(), v, layer, batch)
    with pytest.raises(TypeError, match=r"v has dtype torch.int32.*float32"):
        be.forward(q, k, v.to(torch.int32), layer, batch)


def test_forward_refuses_k_v_on_another_device(setup):
    """k/v on another device than the pools reached torch with an error naming no argument."""
    cfg, layer, sc, be = setup
    batch = sc.next_batch("extend", [2, 3])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    with pytest.raises(ValueError, match="k is on meta"):
        be.forward(q, k.to("meta"), v, layer, batch)
    with pytest.raises(ValueError, match="v is on meta"):
        be.forward(q, k, v.to("meta"), layer, batch)


# -- backend: validate_batch ------------------------------------------------------------------
def test_validate_batch_checks_extend_seq_lens_cpu_shape(setup):
    """An ``extend_seq_lens_cpu`` of the wrong length broadcast against ``seq_lens_cpu``; a
    batch of 2 requests with a 1-entry mirror planned num_tokens / max_seqlen_q from it."""
    cfg, layer, sc, be = setup
    batch = sc.next_batch("extend", [2, 2])
    batch.extend_seq_lens_cpu = torch.tensor([4])
    with pytest.raises(ValueError, match=r"batch.extend_seq_lens_cpu has shape \(1,\); "
                                         r"expected \(2,\)"):
        be.init_forward_metadata(batch)


def test_validate_batch_checks_extend_seq_lens_cpu_device(setup):
    """The host mirror must be on the CPU (as ``seq_lens_cpu`` is checked to be)."""
    cfg, layer, sc, be = setup
    batch = sc.next_batch("extend", [2, 2])
    batch.extend_seq_lens_cpu = batch.extend_seq_lens_cpu.to("meta")
    with pytest.raises(ValueError, match="extend_seq_lens_cpu must live on the CPU"):
        be.init_forward_metadata(batch)


def test_validate_batch_checks_seq_lens_cpu_dtype(setup):
    """A float ``seq_lens_cpu`` (documented int64) was accepted and truncated by int()."""
    cfg, layer, sc, be = setup
    batch = sc.next_batch("decode", [1, 1])
    batch.seq_lens_cpu = batch.seq_lens_cpu.float() + 0.5
    with pytest.raises(TypeError, match="batch.seq_lens_cpu has dtype torch.float32"):
        be.init_forward_metadata(batch)


def test_verify_may_hold_its_draft_tokens_past_max_context_len():
    """The TARGET_VERIFY contract gives KV a slack of the step's draft tokens past
    ``max_context_len`` (the graph buffers are sized for it), but eager validation refused
    such a batch even when ``req_to_token`` is wide enough."""
    n, ctx_len, ps = 3, 16, 4
    cfg = BackendConfig(page_size=ps, max_batch_size=2, max_context_len=ctx_len,
                        dtype=torch.float32, spec=SpecDecodeConfig(num_draft_tokens=n))
    req_pool = ReqToTokenPool(3, ctx_len + n)
    alloc = PageAllocator(16, ps, shuffle_seed=0)
    pool = MHAKVPool(16, ps, 1, 8, 1, dtype=torch.float32)
    row = req_pool.alloc()
    alloc.extend(req_pool, row, ctx_len)
    locs = alloc.extend(req_pool, row, n)
    batch = ForwardBatch.from_lengths(forward_mode="target_verify", req_pool_indices=[row],
                                      seq_lens=[ctx_len + n], out_cache_loc=locs,
                                      spec_info=SpecInfo(num_draft_tokens=n))
    be = AttentionBackend(cfg, req_pool, pool)
    md = be.init_forward_metadata(batch)
    check_invariants(md, batch, be.ctx)
    # past the slack, or in a mode without slack, it is still refused
    batch_dec = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=[row],
                                          seq_lens=[ctx_len + 1], out_cache_loc=locs[:1])
    with pytest.raises(ValueError, match="max_context_len"):
        be.init_forward_metadata(batch_dec)


# -- types ------------------------------------------------------------------------------------
@pytest.mark.parametrize("v_head_dim", [0, -4])
def test_layer_spec_refuses_non_positive_v_head_dim(v_head_dim):
    """head_dim was checked positive but v_head_dim was not."""
    with pytest.raises(ValueError, match="v_head_dim"):
        LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=8, v_head_dim=v_head_dim)
