"""Tests found by hand mutation testing of the metadata planners (``aiter_attn/strategies``,
the index builders they call, ``aiter_attn/multistep.py`` and ``aiter_attn/graph/padding.py``):
each test here kills a mutant that the rest of the suite let survive (an off-by-one bound, a
stale static buffer, a host mirror in the wrong order, ...). Numerics are checked against the
float64 dense oracle (``PagedScenario.expected``) on block-permuted pools (null page 0, noise
everywhere); metadata against hand-computed values."""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, LayerSpec,
                        SpecDecodeConfig, SpecInfo)
from aiter_attn.strategies.spec import VerifyTreeMetadata
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.spec_cases import (check_verify_mask, full_verify_mask,
                                           random_tree_parents, tree_mask_from_parents)

VERIFY = ForwardMode.TARGET_VERIFY


def _spec_setup(*, topk=2, n=3, prefixes=(5, 5), page_size=4, seed=0):
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=128,
                        dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=topk, num_draft_tokens=n, num_steps=3))
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], list(prefixes), seed=seed)
    return cfg, layer, sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool)


def _trees(bs, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [tree_mask_from_parents(random_tree_parents(n, g)) for _ in range(bs)]


# ---------------------------------------------------------------------------------------------
# Static tree-mask buffer: a batch whose mask fills the buffer exactly fits
# (mutant: spec.py ``if total > cap`` -> ``if total >= cap`` survived)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["full", "tree"])
def test_tree_verify_mask_exactly_filling_the_static_buffer_is_planned(layout):
    n = 3
    cfg, layer, sc, be = _spec_setup(n=n, prefixes=(5, 5))
    trees = _trees(2, n, seed=3)
    seq = [sc.allocator.tokens_held(r) + n for r in sc.rows]  # 8, 8
    if layout == "tree":
        mask = torch.stack(trees).reshape(-1)
    else:
        mask = torch.cat([full_verify_mask(t, L).reshape(-1) for t, L in zip(trees, seq)])
    batch = sc.next_batch(VERIFY, [n, n], spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                                                              custom_mask=mask))
    planner = VerifyTreeMetadata(be.ctx)
    # max_tokens = 2·n, max_seq_len = 8: the buffer holds n · Σ seq_lens = 3 · 16 = 48 elements
    out = planner.buffer_spec(2, 2 * n, max(seq)).allocate("cpu")
    assert out["custom_mask"].numel() == n * sum(seq)
    md = planner.plan(batch, out=out)
    check_verify_mask(md, batch, trees)
    assert md.mask.custom_mask.data_ptr() == out["custom_mask"].data_ptr()


# ---------------------------------------------------------------------------------------------
# MLA expanded EXTEND: the dense [prefix ; new] table, hand-computed, 0 past each request
# (mutant: mla.py dropping the ``j < seq_lens`` zeroing survived; the entries past a request's
# keys then name rows past the dense K/V buffer, and a reused static buffer keeps them)
# ---------------------------------------------------------------------------------------------

def _mla_extend_plan(prefixes, new, *, out_fill=None):
    from aiter_attn.strategies.mla import MLAExtendMetadata

    from ._graph_helpers import Rig

    rig = Rig.make("mla", page_size=4, max_context_len=64, num_layers=1)
    rows = [rig.join(p) for p in prefixes]
    locs = [rig.alloc.extend(rig.req_pool, r, n) for r, n in zip(rows, new)]
    seq = [rig.alloc.tokens_held(r) for r in rows]
    batch = ForwardBatch.from_lengths(
        forward_mode="extend", req_pool_indices=rows, seq_lens=seq,
        out_cache_loc=torch.cat(locs), extend_seq_lens=list(new))
    planner = MLAExtendMetadata(rig.backend.ctx)
    out = None
    if out_fill is not None:
        out = planner.buffer_spec(4, 32, 32).allocate("cpu")
        for t in out.values():
            t.fill_(out_fill)  # stale values of an earlier step
    return rig, batch, planner.plan(batch, out=out), rows, seq


@pytest.mark.parametrize("out_fill", [None, 77], ids=["eager", "static-stale"])
def test_mla_extend_dense_table_is_hand_computed_and_zero_past_each_request(out_fill):
    prefixes, new = [5, 0, 3], [2, 3, 1]
    rig, batch, md, rows, seq = _mla_extend_plan(prefixes, new, out_fill=out_fill)
    plan = md.extras["mla_prefix"]
    total_prefix = sum(prefixes)
    assert plan.num_prefix_tokens == total_prefix
    assert md.query.cu_seqlens_q.tolist() == [0, 2, 5, 6]  # cu[0] too, over a stale buffer
    assert plan.prefix_indptr[:4].tolist() == [0, 5, 5, 8]
    r2t = rig.req_pool.req_to_token
    want_slots = torch.cat([r2t[r, :p] for r, p in zip(rows, prefixes)])
    assert plan.prefix_slots[:total_prefix].tolist() == want_slots.tolist()
    dense = plan.dense_block_table
    width = dense.shape[1]
    assert width >= max(seq)
    cu_new = [0, 2, 5]  # new tokens before each request
    pre_off = [0, 5, 5]
    for b, (p, n) in enumerate(zip(prefixes, new)):
        want = ([pre_off[b] + j for j in range(p)]
                + [total_prefix + cu_new[b] + j for j in range(n)]
                + [0] * (width - p - n))
        assert dense[b].tolist() == want, f"request {b}"
    assert md.extras["mla_dense_pages"].block_table is dense


# ---------------------------------------------------------------------------------------------
# build_page_table into a reused table wider than req_to_token's pages: 0 past each request
# (mutant: dropping ``out.zero_()`` in the reference builder survived; the stale columns past
# req_to_token's width stayed in a static table)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("swa", [False, True], ids=["full", "swa"])
def test_build_page_table_clears_stale_columns_past_req_to_token_width(swa):
    from aiter_attn import ops

    ps = 4
    r2t = torch.zeros(3, 8, dtype=torch.int32)  # 8 columns: 2 pages per request at most
    r2t[1] = torch.arange(8) + 5 * ps  # pages 5, 6
    r2t[2] = torch.cat([torch.arange(4) + 9 * ps, torch.arange(4) + 3 * ps])  # pages 9, 3
    rpi = torch.tensor([2, 1], dtype=torch.int64)
    seq = torch.tensor([8, 3], dtype=torch.int32)
    out = torch.full((2, 5), 55, dtype=torch.int32)  # a static table of an earlier, longer step
    want = [[9, 3, 0, 0, 0], [5, 0, 0, 0, 0]]
    if swa:
        full_to_swa = torch.arange(12 * ps, dtype=torch.int64).flip(0)  # page p -> 11 - p
        out_swa = torch.full_like(out, 55)
        ops.build_page_tables_swa(r2t, rpi, seq, ps, full_to_swa, out, out_swa)
        assert out_swa.tolist() == [[2, 8, 0, 0, 0], [6, 0, 0, 0, 0]]
    else:
        ops.build_page_table(r2t, rpi, seq, ps, out)
    assert out.tolist() == want


# ---------------------------------------------------------------------------------------------
# Tree verify under out=: the mask a captured graph read (the first plan's tensor) holds the
# next step's mask after the next plan (mutant: planning the full layout with the engine's own
# mask tensor instead of copying it into the static buffer survived)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["full", "tree"])
def test_tree_verify_static_plan_keeps_one_mask_address_across_steps(layout):
    n = 3
    cfg, layer, sc, be = _spec_setup(n=n, prefixes=(4, 9))
    planner = VerifyTreeMetadata(be.ctx)
    out = planner.buffer_spec(4, 4 * n, 64).allocate("cpu")
    captured = None
    for step in range(2):
        trees = _trees(2, n, seed=10 + step)
        seq = [sc.allocator.tokens_held(r) + n for r in sc.rows]
        if layout == "tree":
            mask = torch.stack(trees).reshape(-1)
        else:
            mask = torch.cat([full_verify_mask(t, L).reshape(-1) for t, L in zip(trees, seq)])
        batch = sc.next_batch(VERIFY, [n, n], spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                                                                  custom_mask=mask))
        md = planner.plan(batch, out=out)
        if captured is None:
            captured = md  # what a graph captured at step 0
        # the captured tensors now hold this step's mask
        view = attrs.evolve(captured, mask=attrs.evolve(captured.mask,
                                                        mask_indptr=md.mask.mask_indptr))
        check_verify_mask(view, batch, trees)


def test_mla_extend_prefix_plan_ignores_a_stale_prefix_mirror():
    """MLA's expanded EXTEND counts the cached prefix from ``seq_lens_cpu −
    extend_seq_lens_cpu`` (as MHA's ``max_prefix_len`` does), never from the unchecked
    ``extend_prefix_lens_cpu`` mirror (mutant: ``_prefix_total`` from that mirror survived; a
    stale all-zero mirror planned no prefix slots while the dense table pointed at them)."""
    prefixes, new = [5, 0, 3], [2, 3, 1]
    rig, batch, md_ok, rows, seq = _mla_extend_plan(prefixes, new)
    from aiter_attn.strategies.mla import MLAExtendMetadata

    stale = attrs.evolve(batch, extend_prefix_lens_cpu=torch.zeros(3, dtype=torch.int64))
    md = MLAExtendMetadata(rig.backend.ctx).plan(stale)
    plan = md.extras["mla_prefix"]
    assert plan.num_prefix_tokens == 8
    r2t = rig.req_pool.req_to_token
    want_slots = torch.cat([r2t[r, :p] for r, p in zip(rows, prefixes)])
    assert plan.prefix_slots[:8].tolist() == want_slots.tolist()
    assert torch.equal(plan.dense_block_table, md_ok.extras["mla_prefix"].dense_block_table)


# ---------------------------------------------------------------------------------------------
# Multi-step draft decode into static buffers: a request whose draft steps need more pages than
# the static draft tables hold is refused (mutant: the bound ``width·P − num_steps`` without
# ``− num_steps`` survived; the last step's page was silently cut off)
# ---------------------------------------------------------------------------------------------

def test_multistep_static_tables_refuse_a_request_past_their_bound():
    from aiter_attn.multistep import MultiStepDraftBackend, draft_columns_needed

    from ._graph_helpers import Rig

    ps, num_steps = 4, 3
    rig = Rig.make("mha", page_size=ps, max_context_len=64, num_layers=1,
                   spec=SpecDecodeConfig(topk=1, num_draft_tokens=num_steps, num_steps=num_steps))
    ms = MultiStepDraftBackend(rig.config, rig.req_pool, rig.kv_pool)
    bufs = ms.init_cuda_graph_state(max_bs=2, max_seq_len=8)
    width = bufs["draft_block_table"].shape[2]  # ceil((8 + 3) / 4) = 3 pages a row
    assert width == 3

    def batch_of(committed):
        row = rig.join(committed)
        need = int(draft_columns_needed(torch.tensor([committed]), ps, 1, num_steps)[0])
        rig.alloc.extend(rig.req_pool, row, need - committed)
        return ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=[row],
                                         seq_lens=[committed],
                                         out_cache_loc=torch.zeros(1, dtype=torch.int64))

    # 11 committed tokens: the last draft step attends over 11 + 2 = 13 keys, 4 pages > 3
    with pytest.raises(ValueError, match="static draft page tables' bound"):
        ms.init_forward_metadata(batch_of(11), out=bufs)
    # the declared bound itself fits: 8 committed tokens, 10 keys in the last step, 3 pages
    steps = ms.init_forward_metadata(batch_of(8), out=bufs)
    last = steps[-1]
    assert last.seq_lens.tolist() == [8 + num_steps - 1]
    assert int((last.spec_info.block_table[0] != 0).sum()) == 3


# ---------------------------------------------------------------------------------------------
# Windowed tree verify: key positions are path positions (prefix + depth), not index order
# (mutant: window_tree_mask with ``k_pos = j`` survived; the suite's trees were too shallow for
# an ancestor listed late in the draft order to fall out of the window)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("window", [2, 3])
def test_windowed_tree_verify_drops_a_late_listed_ancestor_outside_the_window(window):
    from aiter_attn.testing.spec_cases import tree_depths, tree_verify_masks, windowed_tree_masks

    # token 2 is a child of the root (depth 1) but listed third: token 4 (depth 3) must not see
    # it with window 2, although index order would put it two places before token 4
    parents = [-1, 0, 0, 2, 3]
    n = len(parents)
    depth = torch.tensor(tree_depths(parents))
    prefixes = [6, 2]
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16,
                      sliding_window=window)
    sc = PagedScenario.make(cfg, [layer], prefixes, seed=11)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    masks = tree_verify_masks(prefixes, parents)
    batch = sc.next_batch(VERIFY, [n] * 2, spec_info=SpecInfo(
        num_draft_tokens=n, topk=2, custom_mask=torch.cat([m.reshape(-1) for m in masks])))
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layer)
    out = be.forward(q, k, v, layer, batch)
    literal = windowed_tree_masks(prefixes, masks, depth, window)
    exp = sc.expected(attrs.evolve(layer, sliding_window=None), q, masks=literal, causal=False)
    assert_close_rel(out, exp, 1e-5, f"window {window}")


# ---------------------------------------------------------------------------------------------
# MHA EXTEND planned into reused (stale) buffers: every value is rewritten (mutant: dropping
# ``cu_seqlens_q[:1].zero_()`` in plan_query_layout survived, eager buffers being zero-filled)
# ---------------------------------------------------------------------------------------------

def test_extend_plan_into_stale_buffers_matches_hand_computed_and_oracle():
    from aiter_attn.strategies.mha import ExtendMetadata

    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = PagedScenario.make(cfg, [layer], [5, 0, 9], seed=2)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    batch = sc.next_batch(ForwardMode.EXTEND, [3, 2, 1])
    planner = ExtendMetadata(be.ctx)
    out = planner.buffer_spec(4, 16, 32).allocate("cpu")
    for t in out.values():
        t.fill_(9)  # values of an earlier, larger step
    md = planner.plan(batch, out=out)
    assert md.query.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert md.query.max_seqlen_q == 3 and md.query.num_tokens == 6
    assert md.pages.seqused_k.tolist() == [8, 2, 10]
    r2t = sc.req_pool.req_to_token
    for b, (row, L) in enumerate(zip(sc.rows, [8, 2, 10])):
        used = -(-L // 4)
        want = (r2t[row, :L:4] // 4).tolist() + [0] * (md.pages.block_table.shape[1] - used)
        assert md.pages.block_table[b].tolist() == want, f"request {b}"
    # and the attention over that plan is the oracle's
    from aiter_attn.strategies.mha import PagedExecution

    ex = PagedExecution(be.ctx)
    q, k, v = sc.step_inputs(layer)
    ex.plan_kernels(md, batch)
    got = ex.run(q, k, v, layer, batch, md)
    assert_close_rel(got, sc.expected(layer, q), 1e-5, "extend over stale buffers")


# ---------------------------------------------------------------------------------------------
# BufferSpec.merge: a buffer declared twice gets the element-wise largest shape, whichever
# order the specs merge in (mutant: keeping the later declaration's shape survived)
# ---------------------------------------------------------------------------------------------

def test_buffer_spec_merge_keeps_the_largest_bound_in_either_order():
    from aiter_attn.strategies.base import BufferSpec

    a = BufferSpec({"block_table": ((4, 9), torch.int32), "x": ((3,), torch.int64)})
    b = BufferSpec({"block_table": ((8, 2), torch.int32), "y": ((1,), torch.bool)})
    for merged in (a.merge(b), b.merge(a)):
        assert dict(merged.buffers) == {"block_table": ((8, 9), torch.int32),
                                        "x": ((3,), torch.int64), "y": ((1,), torch.bool)}
    # planners merging their own spec: a tree verify planner's table is as wide as its
    # plain page-table spec for the same bounds
    cfg, layer, sc, be = _spec_setup()
    spec = VerifyTreeMetadata(be.ctx).buffer_spec(3, 9, 21)
    assert spec.buffers["block_table"][0] == (3, 6)
    assert spec.buffers["custom_mask"][0] == (9 * 21,)


# ---------------------------------------------------------------------------------------------
# window_tree_mask over a static mask buffer longer than the step's blocks: the tail past the
# last block is False, as documented (mutant: dropping ``valid &`` survived; the tail then
# copied stale True entries whenever the last request had no cached prefix)
# ---------------------------------------------------------------------------------------------

def test_window_tree_mask_is_false_past_the_last_block():
    from aiter_attn.metadata import CustomMask, QueryLayout
    from aiter_attn.strategies.common import window_tree_mask

    n = 3
    tree = tree_mask_from_parents([-1, 0, 1])  # a chain: token i at depth i
    seq = [5, 3]  # request 1 has no cached prefix
    blocks = [full_verify_mask(tree, L).reshape(-1) for L in seq]
    total = n * sum(seq)
    flat = torch.ones(total + 7, dtype=torch.bool)  # a static buffer: stale True tail
    flat[:total] = torch.cat(blocks)
    indptr = torch.tensor([0, n * seq[0], total], dtype=torch.int64)
    batch = ForwardBatch.from_lengths(
        forward_mode="target_verify", req_pool_indices=[0, 1], seq_lens=seq,
        out_cache_loc=torch.arange(2 * n), spec_info=SpecInfo(num_draft_tokens=n, topk=2))
    query = QueryLayout(cu_seqlens_q=torch.tensor([0, n, 2 * n], dtype=torch.int32),
                        max_seqlen_q=n, num_tokens=2 * n)
    got = window_tree_mask(CustomMask(custom_mask=flat, mask_indptr=indptr), batch, query, 2)
    got = got.custom_mask
    assert not bool(got[total:].any())
    # inside the blocks: each token sees itself and its parent (window 2 on a chain)
    want0 = torch.tensor([[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    want1 = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert torch.equal(got[:15].view(3, 5), want0)
    assert torch.equal(got[15:total].view(3, 3), want1)


# ---------------------------------------------------------------------------------------------
# Static page tables one page too narrow are refused (mutant: ``width < need - 1`` survived;
# the existing check only met tables far too small, and the last page was silently dropped)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("planner", ["decode", "extend", "swa-decode"])
def test_static_page_table_one_page_short_is_refused(planner):
    from aiter_attn.strategies.mha import DecodeMetadata, ExtendMetadata

    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    if planner == "swa-decode":
        from aiter_attn.strategies.swa import SWADecodeMetadata

        from ._graph_helpers import Rig

        rig = Rig.make("swa", page_size=4, max_context_len=64, num_layers=2)
        rows = [rig.join(3), rig.join(8)]
        batch = rig.batch("decode", rows)  # seq_lens 4 and 9: 1 and 3 pages
        strategy = SWADecodeMetadata(rig.backend.ctx)
    else:
        sc = PagedScenario.make(cfg, [layer], [3, 8], seed=4)
        be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
        batch = sc.next_batch(ForwardMode.DECODE if planner == "decode" else ForwardMode.EXTEND,
                              [1, 1])
        strategy = (DecodeMetadata if planner == "decode" else ExtendMetadata)(be.ctx)
    assert batch.seq_lens_cpu.tolist() == [4, 9]
    short = strategy.buffer_spec(2, 2, 8).allocate("cpu")  # 2 pages a row; request 1 needs 3
    with pytest.raises(ValueError, match="do not fit the static"):
        strategy.plan(batch, out=short)
    fits = strategy.buffer_spec(2, 2, 9).allocate("cpu")  # 3 pages: planned
    md = strategy.plan(batch, out=fits)
    assert int((md.pages.block_table[1] != 0).sum()) == 3
