"""Regression tests for defects found in the value types (types.py), the batch builder
(batch.py), the strategy registry (registry.py) and the testing helpers (invariants,
hypothesis strategies): each fails on the defect it names."""

import attrs
import pytest
import torch
from hypothesis import find, given, settings

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, LayerSpec,
                        MHAKVPool, SpecInfo, StrategyPair)
from aiter_attn.backend import validate_batch
from aiter_attn.contract import TREE_VERIFY, contract_of
from aiter_attn.metadata import CustomMask
from aiter_attn.registry import Cell
from aiter_attn.testing.invariants import InvariantError, check_invariants
from aiter_attn.testing.strategies import paged_batches
from aiter_attn.types import SpecDecodeConfig

_LAYER = dict(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=8)


# -- types: LayerSpec -------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("layer_id", True), ("layer_id", -1), ("layer_id", 1.5),
    ("num_q_heads", 4.0), ("num_kv_heads", True), ("head_dim", 8.5), ("v_head_dim", 8.0),
    ("kv_lora_rank", 2.5), ("qk_rope_head_dim", True),
], ids=lambda v: repr(v))
def test_layer_spec_refuses_sizes_that_are_not_integers(field, value):
    """A bool or a float passed the positivity checks: ``layer_id=True`` served layer 1's
    buffers silently, ``head_dim=8.5`` set ``scaling`` from 8.5, ``num_q_heads=4.0`` failed in
    torch's ``view()`` naming no argument."""
    kw = {**_LAYER, field: value}
    if field == "kv_lora_rank":
        kw["scaling"] = 1.0
    with pytest.raises(ValueError, match=rf"{field}={value!r} must be"):
        LayerSpec(**kw)


@pytest.mark.parametrize("window", [2.9, True, 4.0], ids=repr)
def test_layer_spec_sliding_window_must_be_an_integer(window):
    """``int()`` truncated ``sliding_window=2.9`` to a 2-token window and read ``True`` as a
    window of 1: a different attention pattern, no error."""
    with pytest.raises(ValueError, match=rf"sliding_window={window!r} must be an integer"):
        LayerSpec(**_LAYER, sliding_window=window)


def test_layer_spec_sliding_window_keeps_its_conventions():
    assert LayerSpec(**_LAYER, sliding_window=4).sliding_window == 4
    for off in (None, 0, -1):
        assert LayerSpec(**_LAYER, sliding_window=off).sliding_window is None


# -- types: BackendConfig / SpecDecodeConfig --------------------------------------------------
@pytest.mark.parametrize("value", [0, 1, "false", "auto"], ids=repr)
def test_backend_config_dense_extend_is_none_or_a_bool(value):
    """The strategies read ``dense_extend`` by identity (``is True`` / ``is not False``):
    ``dense_extend=0`` meant the automatic rule, not off, and ``"false"`` too."""
    with pytest.raises(TypeError, match=rf"dense_extend={value!r}; allowed: None"):
        BackendConfig(dense_extend=value)
    for ok in (None, True, False):
        assert BackendConfig(dense_extend=ok).dense_extend is ok


@pytest.mark.parametrize("field", ["debug_checks", "batch_invariant"])
def test_backend_config_flags_are_bools(field):
    """``batch_invariant="no"`` is truthy: batch-invariant kernels were selected."""
    with pytest.raises(TypeError, match=rf"{field}='no' must be True or False"):
        BackendConfig(**{field: "no"})


@pytest.mark.parametrize("kw", [
    dict(page_size=True), dict(max_context_len=100.5), dict(max_batch_size=8.0),
    dict(tp_size=True), dict(dense_extend_min_tokens=1.5),
], ids=lambda kw: f"{next(iter(kw))}={next(iter(kw.values()))!r}")
def test_backend_config_sizes_are_integers(kw):
    """``max_context_len=100.5`` made ``max_pages_per_request`` a float (a buffer shape)."""
    with pytest.raises(ValueError, match="must be a positive integer"):
        BackendConfig(**kw)


def test_spec_decode_config_counts_are_integers():
    with pytest.raises(ValueError, match="num_draft_tokens=2.5 must be a positive integer"):
        SpecDecodeConfig(num_draft_tokens=2.5)


# -- registry: StrategyPair -------------------------------------------------------------------
def _pair(**kw):
    base = dict(name="x.decode", arch="mha", modes={"decode"}, metadata=object, execution=object)
    return StrategyPair(**{**base, **kw})


def test_pair_contract_keyed_by_another_mode_is_refused():
    """``contracts={DECODE: <TARGET_VERIFY's contract>}`` was kept: ``pair.contract(DECODE)``
    then gave decode batches the draft count (3 query tokens per request here)."""
    with pytest.raises(ValueError, match=r"contracts\[DECODE\] is the contract of TARGET_VERIFY"):
        _pair(contracts={"decode": contract_of("target_verify")})


def test_pair_contract_for_a_mode_it_does_not_serve_is_refused():
    with pytest.raises(ValueError, match="contracts names TARGET_VERIFY, which the pair does "
                                         "not serve"):
        _pair(contracts={"target_verify": TREE_VERIFY})
    pair = _pair(modes={"decode", "target_verify"}, contracts={"target_verify": TREE_VERIFY})
    assert pair.contract("target_verify") is TREE_VERIFY


def test_pair_contract_must_be_a_mode_contract():
    with pytest.raises(TypeError, match="a contract is an aiter_attn.contract.ModeContract"):
        _pair(contracts={"decode": "tree"})


@pytest.mark.parametrize("modes,exc,match", [
    ("decode", TypeError, r"modes='decode' is a single str; pass a set"),
    (ForwardMode.DECODE, TypeError, r"is a single ForwardMode; pass a set"),
    (set(), ValueError, "modes is empty"),
], ids=["str", "member", "empty"])
def test_pair_modes_must_be_a_non_empty_collection(modes, exc, match):
    """``modes="decode"`` failed on the letter ``'d'``, a single member with "not iterable",
    and an empty set made a pair that serves nothing, silently."""
    with pytest.raises(exc, match=match):
        _pair(modes=modes)
    with pytest.raises(exc, match=match):
        Cell(name="c", modes=modes, metadata=object)


# -- batch: ForwardBatch.from_lengths ---------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(extend_seq_lens=[2]), r"extend_seq_lens has 1 entries for 2 requests"),
    (dict(seq_lens=[5], req_pool_indices=[1], extend_seq_lens=[2, 3]),
     r"extend_seq_lens has 2 entries for 1 requests"),
    (dict(req_pool_indices=[1]), r"req_pool_indices has 1 entries for 2 requests"),
    (dict(seq_lens=[5.5, 7]), r"seq_lens=\[5.5, 7.0\] must be a flat sequence of integers"),
    (dict(extend_seq_lens=[2.5, 3]), r"extend_seq_lens=\[2.5, 3.0\] must be"),
], ids=["ext-short", "ext-long", "rows-short", "float-seq", "float-ext"])
def test_from_lengths_refuses_inconsistent_host_lists(kw, match):
    """Counts that disagree broadcast (positions, prefix lengths of the wrong length) and
    floats were truncated to int64, all silently."""
    base = dict(forward_mode="extend", req_pool_indices=[1, 2], seq_lens=[5, 7],
                extend_seq_lens=[2, 3], out_cache_loc=torch.arange(5))
    with pytest.raises(ValueError, match=match):
        ForwardBatch.from_lengths(**{**base, **kw})


# -- testing.invariants -----------------------------------------------------------------------
def _planned(mode=ForwardMode.EXTEND, pool_pages=None):
    pb = find(paged_batches(mode=mode, page_size=4),
              lambda p: p.batch.batch_size >= 2 and p.batch.max_seq_len > 4)
    pool = MHAKVPool(pool_pages or pb.allocator.num_pages, 4, 1, 8, 1, dtype=torch.float32)
    be = AttentionBackend(pb.config, pb.req_pool, pool)
    return pb, be, be.init_forward_metadata(pb.batch)


def test_check_invariants_catches_a_plan_of_another_page_size():
    """A page table planned with page size 1 (slot ids as page ids) over a pool of 4-token
    pages is consistent with itself: the checker compared it with its own ``page_size`` and
    passed it (here the pool is large enough that the ids stay inside it)."""
    pb, be, md = _planned(pool_pages=512)
    check_invariants(md, pb.batch, be.ctx)
    b, r2t = pb.batch, pb.req_pool.req_to_token
    bt = torch.zeros(b.batch_size, b.max_seq_len, dtype=torch.int32)
    for i, (row, n) in enumerate(zip(b.req_pool_indices.tolist(), b.seq_lens_cpu.tolist())):
        bt[i, :n] = r2t[row, :n]
    bad = attrs.evolve(md, pages=attrs.evolve(md.pages, block_table=bt, page_size=1))
    with pytest.raises(InvariantError, match="pages.page_size=1 but the pool's pages hold 4"):
        check_invariants(bad, b, be.ctx)


@pytest.mark.parametrize("part", ["block_table", "seqused_k", "cu_seqlens_q"])
def test_check_invariants_catches_float_index_tensors(part):
    pb, be, md = _planned()
    if part == "cu_seqlens_q":
        bad = attrs.evolve(md, query=attrs.evolve(md.query, cu_seqlens_q=md.query.cu_seqlens_q
                                                  .float()))
    else:
        bad = attrs.evolve(md, pages=attrs.evolve(md.pages,
                                                  **{part: getattr(md.pages, part).float()}))
    with pytest.raises(InvariantError, match=f"{part} has dtype torch.float32"):
        check_invariants(bad, pb.batch, be.ctx)


def _mask(q_lens, seq_lens, shift=0):
    blocks = (q_lens * seq_lens).long()
    indptr = torch.zeros(len(blocks) + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(blocks, 0)
    indptr[1:-1] += shift
    return CustomMask(custom_mask=torch.ones(int(indptr[-1]), dtype=torch.bool),
                      mask_indptr=indptr)


def test_check_invariants_checks_the_custom_mask():
    """The tree mask was never looked at: a ``mask_indptr`` whose blocks do not match
    ``q_len · seq_len`` (each request reading another's mask rows) passed."""
    pb, be, md = _planned()
    b = pb.batch
    check_invariants(attrs.evolve(md, mask=_mask(b.q_lens_cpu, b.seq_lens_cpu)), b, be.ctx)
    with pytest.raises(InvariantError, match="mask_indptr differences"):
        check_invariants(attrs.evolve(md, mask=_mask(b.q_lens_cpu, b.seq_lens_cpu, shift=-1)),
                         b, be.ctx)
    short = _mask(b.q_lens_cpu, b.seq_lens_cpu)
    short = attrs.evolve(short, custom_mask=short.custom_mask[:-1])
    with pytest.raises(InvariantError, match="custom_mask has .* elements"):
        check_invariants(attrs.evolve(md, mask=short), b, be.ctx)


# -- testing.strategies -----------------------------------------------------------------------
@settings(max_examples=40, derandomize=True, database=None, deadline=None)
@given(pb=paged_batches(mode=ForwardMode.DECODE, page_size=64, max_context_len=100,
                        max_prefix=60, max_new=10))
def test_paged_batches_with_pages_larger_than_half_the_context(pb):
    """The unrelated request drew up to ``2 · page_size`` tokens whatever
    ``max_context_len``: with 64-token pages and a 100-token context the draw itself raised
    ("request row 1 would hold 101 tokens"), though every requested length fits."""
    validate_batch(pb.batch, pb.config, pb.req_pool.req_to_token)


def test_paged_batches_refuses_lengths_past_max_context_len():
    """``max_prefix + max_new > max_context_len`` drew valid batches until one was too long,
    then raised from the allocator mid-test; it is a clear error up front."""
    with pytest.raises(ValueError, match=r"max_prefix=300.*> max_context_len=256"):
        find(paged_batches(mode=ForwardMode.EXTEND, max_prefix=300), lambda p: True)


def test_check_invariants_accepts_padding_rows_of_the_reserved_row():
    """Padding rows point at ``req_to_token`` row 0 (reserved: every token maps to the null
    slot), so their page table is the null page, as planned; the checker called that "uses the
    null page 0", so ``AITER_ATTN_DEBUG=1`` refused every padded batch."""
    pb, be, _ = _planned(mode=ForwardMode.DECODE)
    b = pb.batch
    padded = ForwardBatch.from_lengths(
        forward_mode="decode", req_pool_indices=b.req_pool_indices.tolist() + [0],
        seq_lens=b.seq_lens_cpu.tolist() + [1],
        out_cache_loc=torch.cat([b.out_cache_loc, torch.zeros(1, dtype=torch.int64)]))
    md = be.init_forward_metadata(padded)
    check_invariants(md, padded, be.ctx)


def _draft_steps(monkeypatch, debug):
    from aiter_attn.kvcache import PageAllocator, ReqToTokenPool
    from aiter_attn.multistep import MultiStepDraftBackend
    from aiter_attn.testing.spec_cases import DraftLayout, reserve_draft_slots

    if debug:
        monkeypatch.setenv("AITER_ATTN_DEBUG", "1")
    ps, topk, steps, prefixes = 2, 2, 3, [3, 5]
    req_pool = ReqToTokenPool(5, 64)
    alloc = PageAllocator(64, ps, shuffle_seed=0)
    rows = [req_pool.alloc() for _ in prefixes]
    for row, p in zip(rows, prefixes):
        alloc.extend(req_pool, row, p)
    layout = DraftLayout(ps, topk, steps)
    reserve_draft_slots(alloc, req_pool, rows, prefixes, layout)
    cfg = BackendConfig(page_size=ps, max_context_len=64, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=topk, num_steps=steps))
    ms = MultiStepDraftBackend(cfg, req_pool, None)
    draft = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=rows,
                                      seq_lens=prefixes,
                                      out_cache_loc=torch.zeros(len(rows), dtype=torch.int64))
    return ms, draft, req_pool, alloc, layout


def test_debug_mode_accepts_multistep_draft_steps(monkeypatch):
    """A draft step's page table is the multi-step planner's (``spec_info.block_table``:
    branch ``k``'s tokens are not in ``req_to_token`` order); the checker compared it with the
    ``req_to_token`` row and raised on every correct plan, so ``AITER_ATTN_DEBUG=1`` broke
    multi-step draft decoding (eager and graph capture alike)."""
    from aiter_attn.testing.spec_cases import check_draft_step

    ms, draft, req_pool, alloc, layout = _draft_steps(monkeypatch, debug=True)
    step_batches = ms.init_forward_metadata(draft)
    for i, sb in enumerate(step_batches):  # the plans are right: the test helper agrees
        check_draft_step(sb, ms.step_metadata[i], i, draft, req_pool.req_to_token, layout, alloc)


def test_check_invariants_of_a_draft_step_still_catch_a_wrong_table(monkeypatch):
    ms, draft, *_ = _draft_steps(monkeypatch, debug=False)
    sb = ms.init_forward_metadata(draft)[0]
    md = ms.step_metadata[0]
    check_invariants(md, sb, ms.ctx)
    bt = md.pages.block_table.clone()
    bt[0, 0] += 1
    with pytest.raises(InvariantError, match="differs from the batch's spec_info.block_table"):
        check_invariants(attrs.evolve(md, pages=attrs.evolve(md.pages, block_table=bt)), sb,
                         ms.ctx)
    bt = md.pages.block_table.clone()
    bt[0, -1] = 5  # a live page past the row's length
    sb.spec_info.block_table = bt
    with pytest.raises(InvariantError, match="entries past its"):
        check_invariants(attrs.evolve(md, pages=attrs.evolve(md.pages, block_table=bt)), sb,
                         ms.ctx)
