"""Multi-step draft decode: every draft step planned at once over shared index buffers and run
through one strategy pair (one metadata strategy, one execution strategy; no backend per step). Each (request, branch) row attends to the committed prefix plus its branch's
draft tokens; checked against a float64 oracle on block-permuted pools, by invariants
(hypothesis), for static-buffer planning and for the absence of device→host syncs."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import (AttentionBackend, BackendConfig, ForwardBatch, ForwardMode, LayerSpec,
                        SpecDecodeConfig)
from aiter_attn.kvcache import PageAllocator, ReqToTokenPool
from aiter_attn.multistep import MultiStepDraftBackend
from aiter_attn.registry import StrategySelectionError
from aiter_attn.strategies.mha import DecodeMetadata
from aiter_attn.strategies.spec import DRAFT_DECODE_STEP
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.invariants import check_invariants
from aiter_attn.testing.spec_cases import (DraftLayout, check_draft_step, draft_branch_expected,
                                           draft_step_inputs, forbid_device_reads,
                                           reserve_draft_slots)
from aiter_attn.testing.strategies import page_sizes

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _draft_batch(rows, prefixes, device="cpu"):
    """A DECODE batch whose seq_lens are the committed lengths (out_cache_loc is not read)."""
    return ForwardBatch.from_lengths(forward_mode=ForwardMode.DECODE, req_pool_indices=rows,
                                     seq_lens=prefixes,
                                     out_cache_loc=torch.zeros(len(rows), dtype=torch.int64),
                                     device=device)


def _setup(ps, topk, steps, prefixes, dtype=torch.float32, hq=10, hkv=2, d=32, seed=0):
    cfg = BackendConfig(page_size=ps, max_batch_size=8, max_context_len=512, dtype=dtype,
                        spec=SpecDecodeConfig(topk=topk, num_steps=steps, num_draft_tokens=4))
    layers = [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
              for i in range(2)]
    pages = sum(-(-(p + topk * (steps + 2 * ps)) // ps) for p in prefixes) * 2 + 8
    sc = PagedScenario.make(cfg, layers, prefixes, seed=seed, num_pages=pages)
    layout = DraftLayout(ps, topk, steps)
    reserve_draft_slots(sc.allocator, sc.req_pool, sc.rows, prefixes, layout, sc.kv_pool)
    return cfg, layers, sc, layout


CASES = [
    pytest.param(1, 3, 4, [5, 1, 17], torch.float32, id="page1-topk3-steps4"),
    pytest.param(7, 3, 4, [9, 7, 3], torch.float32, id="page7-topk3-steps4-partial-pages"),
    pytest.param(48, 2, 3, [50, 48], torch.float16, id="page48-topk2-steps3-fp16"),
    pytest.param(7, 1, 4, [13, 2], torch.float32, id="page7-chain-steps4"),
]


@pytest.mark.parametrize("ps,topk,steps,prefixes,dtype", CASES)
def test_draft_steps_match_oracle(ps, topk, steps, prefixes, dtype):
    """Every step of every branch: prefix + that branch's draft tokens so far, GQA 5:1."""
    cfg, layers, sc, layout = _setup(ps, topk, steps, prefixes, dtype, seed=ps + topk)
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    assert ms.num_passes == steps - 1 and ms.pair.name == DRAFT_DECODE_STEP
    draft = _draft_batch(sc.rows, prefixes)
    step_batches = ms.init_forward_metadata(draft)
    g = torch.Generator().manual_seed(1)
    branch_kv = {}
    rows = [(b, k) for b in range(len(prefixes)) for k in range(topk)]
    for i, sb in enumerate(step_batches):
        check_draft_step(sb, ms.step_metadata[i], i, draft, sc.req_pool.req_to_token, layout,
                         sc.allocator)
        for layer in layers:
            q, k, v = draft_step_inputs(layer, len(rows), dtype, g)
            out = ms.forward(i, q, k, v, layer)
            expected = draft_branch_expected(sc, layer, q, k, v, rows, branch_kv)
            assert_close_rel(out, expected, RTOL[dtype], f"step {i} layer {layer.layer_id}")


def test_chain_steps_equal_plain_decode_plans():
    """topk = 1: step i's page table is exactly mha.decode's for committed + i + 1 tokens."""
    cfg, layers, sc, layout = _setup(7, 1, 4, [13, 2, 7])
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    draft = _draft_batch(sc.rows, [13, 2, 7])
    steps = ms.init_forward_metadata(draft)
    plain = DecodeMetadata(ms.ctx)
    for i, sb in enumerate(steps):
        md = ms.step_metadata[i]
        check_invariants(md, sb, ms.ctx)
        ref = plain.plan(sb)
        w = ref.pages.block_table.shape[1]
        assert torch.equal(md.pages.block_table[:, :w], ref.pages.block_table)
        assert bool((md.pages.block_table[:, w:] == 0).all())


@st.composite
def _draft_setups(draw):
    ps = draw(page_sizes(choices=(1, 2, 7, 16, 48)))
    topk = draw(st.integers(1, 4))
    steps = draw(st.integers(1, 5))
    prefixes = draw(st.lists(st.integers(1, 120), min_size=1, max_size=5))
    return ps, topk, steps, prefixes, draw(st.integers(0, 2**16))


def _pools(ps, topk, steps, prefixes, seed):
    width = 512
    req_pool = ReqToTokenPool(len(prefixes) + 3, width)
    pages = sum(-(-(p + topk * (steps + 2 * ps)) // ps) for p in prefixes) + 6
    alloc = PageAllocator(pages, ps, shuffle_seed=seed)
    other = req_pool.alloc()  # a foreign request holding pages in between
    alloc.extend(req_pool, other, ps + 1)
    rows = [req_pool.alloc() for _ in prefixes]
    for row, p in zip(rows, prefixes):
        alloc.extend(req_pool, row, p)
    layout = DraftLayout(ps, topk, steps)
    reserve_draft_slots(alloc, req_pool, rows, prefixes, layout)
    cfg = BackendConfig(page_size=ps, max_context_len=width, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=topk, num_steps=steps))
    return cfg, req_pool, alloc, rows, layout


@given(setup=_draft_setups())
def test_draft_step_invariants(setup):
    """Per step: one query per row; seqused_k = committed + step + 1; page tables list exactly
    the branch's pages (owned by the request, null past them); each row writes its branch's
    token slot, inside the listed page; no two rows share a slot."""
    ps, topk, steps, prefixes, seed = setup
    cfg, req_pool, alloc, rows, layout = _pools(ps, topk, steps, prefixes, seed)
    ms = MultiStepDraftBackend(cfg, req_pool, None)
    draft = _draft_batch(rows, prefixes)
    step_batches = ms.init_forward_metadata(draft)
    assert len(step_batches) == steps - 1
    for i, sb in enumerate(step_batches):
        check_draft_step(sb, ms.step_metadata[i], i, draft, req_pool.req_to_token, layout,
                         alloc)


@given(setup=_draft_setups())
def test_plan_is_sync_free_and_static_matches_eager(setup):
    """All steps plan on meta tensors under the host-read guard (eager and static); on real
    tensors, planning into static buffers keeps their addresses and equals the eager plan."""
    ps, topk, steps, prefixes, seed = setup
    cfg, req_pool, alloc, rows, layout = _pools(ps, topk, steps, prefixes, seed)
    meta_ms = MultiStepDraftBackend(cfg, req_pool.req_to_token.to("meta"), None)
    meta_draft = _draft_batch(rows, prefixes, device="meta")
    with forbid_device_reads():
        meta_ms.init_forward_metadata(meta_draft)
        meta_ms.init_cuda_graph_state(max_bs=len(prefixes) + 1, max_seq_len=256)
        meta_ms.init_forward_metadata_out_graph(meta_draft)

    ms = MultiStepDraftBackend(cfg, req_pool, None)
    draft = _draft_batch(rows, prefixes)
    eager = [(sb.out_cache_loc.clone(), md)
             for sb, md in zip(ms.init_forward_metadata(draft), ms.step_metadata)]
    bufs = ms.init_cuda_graph_state(max_bs=len(prefixes) + 1, max_seq_len=256)
    ptrs = {k: v.data_ptr() for k, v in bufs.items()}
    for _ in range(2):
        static = ms.init_forward_metadata_out_graph(draft)
        assert {k: v.data_ptr() for k, v in ms.graph_buffers.items()} == ptrs
    for i, (sb, (loc, md)) in enumerate(zip(static, eager)):
        smd = ms.step_metadata[i]
        assert smd.pages.block_table.data_ptr() == bufs["draft_block_table"][i].data_ptr()
        w = md.pages.block_table.shape[1]
        assert torch.equal(smd.pages.block_table[:, :w], md.pages.block_table)
        assert bool((smd.pages.block_table[:, w:] == 0).all())
        assert torch.equal(sb.out_cache_loc, loc)
        assert torch.equal(smd.pages.seqused_k, md.pages.seqused_k)


def test_errors_name_the_limit():
    cfg, req_pool, alloc, rows, layout = _pools(7, 3, 4, [20, 5], 0)
    ms = MultiStepDraftBackend(cfg, req_pool, None)
    with pytest.raises(ValueError, match="takes a DECODE batch"):
        ms.plan(ForwardBatch.from_lengths(forward_mode="extend", req_pool_indices=rows,
                                          seq_lens=[20, 5], extend_seq_lens=[1, 1],
                                          out_cache_loc=torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"needs req_to_token columns up to .* raise"):
        ms.plan(_draft_batch(rows, [500, 5]))
    ms.init_cuda_graph_state(max_bs=1)
    with pytest.raises(ValueError, match="rows > the static buffers"):
        ms.init_forward_metadata_out_graph(_draft_batch(rows, [20, 5]))
    with pytest.raises(ValueError, match="topk=0"):
        MultiStepDraftBackend(cfg, req_pool, None, topk=0)
    with pytest.raises(StrategySelectionError, match="runs each step through strategy 'nope'"):
        MultiStepDraftBackend(cfg, req_pool, None, step_strategy="nope")
    plain = AttentionBackend(cfg, req_pool, None, strategy=DRAFT_DECODE_STEP)
    with pytest.raises(ValueError, match="MultiStepDraftBackend.init_forward_metadata"):
        plain.init_forward_metadata(_draft_batch(rows, [20, 5]))


def test_single_step_has_no_decode_pass():
    """num_steps = 1: the draft extend proposes the only token; no decode backends."""
    cfg, req_pool, alloc, rows, layout = _pools(1, 2, 1, [4], 0)
    ms = MultiStepDraftBackend(cfg, req_pool, None)
    assert ms.num_passes == 0 and ms.init_forward_metadata(_draft_batch(rows, [4])) == []
    assert ms.step_metadata == []


# -- one strategy pair for every step ----------------------------------------------------------

def _counting_registry():
    """Reference kernels plus a plan/run spy (the reference attention) counting bindings and
    plans."""
    from aiter_attn.kernels import reference
    from aiter_attn.kernels.base import FunctionKernel
    from aiter_attn.kernels.registry import Capabilities, KernelRegistry
    from aiter_attn.types import CGSupport

    counts = {"bound": 0, "plans": 0}

    class Counting(FunctionKernel):
        fn = staticmethod(reference.paged_attention_reference)

        def __init__(self, request=None):
            super().__init__(request)
            counts["bound"] += request is not None  # not the registry's functional instance

        def plan(self, md, out=None):
            counts["plans"] += 1
            return super().plan(md, out)

    reg = KernelRegistry()
    reference.aiter_attn_register_kernels(reg.register)
    feats = {"sinks", "softcap", "window", "fp8", "custom_mask", "v_head_dim_differs",
             "non_causal", "lse"}
    reg.register("paged_attention", "counting", Counting,
                 Capabilities(features=feats, cg_support=CGSupport.ALWAYS), priority=1000)
    return reg, counts


def test_every_step_runs_through_one_strategy_pair():
    """One metadata and one execution strategy serve every step: a layer group's kernel is
    bound once (not once per step), each step has its own kernel plan, planned once per
    step in init_forward_metadata; steps run through ms.forward(i, …) or a step view."""
    ps, topk, steps, prefixes = 7, 2, 4, [9, 7]
    cfg, layers, sc, layout = _setup(ps, topk, steps, prefixes)
    reg, counting = _counting_registry()
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool, kernels=reg)
    draft = _draft_batch(sc.rows, prefixes)
    g = torch.Generator().manual_seed(3)
    rows = len(prefixes) * topk
    for round_ in range(2):
        ms.init_forward_metadata(draft)
        if round_:  # the layers are bound: one plan per step, made here
            assert counting["plans"] == ms.num_passes
        for i in range(ms.num_passes):
            for layer in layers:
                q, k, v = draft_step_inputs(layer, rows, cfg.dtype, g)
                out = ms.forward(i, q, k, v, layer)
                assert out.shape == (rows, layer.num_q_heads * layer.head_dim)
                view = ms.step(i)
                assert view.batch is ms.step_batches[i] and view.metadata is ms.step_metadata[i]
                assert torch.equal(view.forward(q, k, v, layer), out)
        assert counting["bound"] == 1 and len(ms.executor.groups) == 1
        plans = [md.kernel_plans.plans for md in ms.step_metadata]
        assert all(len(p) == 1 for p in plans)
        assert len({id(next(iter(p.values()))) for p in plans}) == ms.num_passes
        counting["plans"] = 0
    # the deprecated per-step alias: views, with the AttentionBackend call shape
    views = ms.attn_backends
    assert [v.index for v in views] == list(range(ms.num_passes))
    q, k, v = draft_step_inputs(layers[0], rows, cfg.dtype, g)
    views[1].forward(q, k, v, layers[0], ms.step_batches[1])
    with pytest.raises(RuntimeError, match="not its step batch"):
        views[1].forward(q, k, v, layers[0], ms.step_batches[0])
    with pytest.raises(ValueError, match=r"step=3; .* decode passes 0\.\.2"):
        ms.forward(3, q, k, v, layers[0])
    with pytest.raises(TypeError, match="layer must be a LayerSpec"):
        ms.forward(0, q, k, v, "layer")


def test_forward_before_plan_says_what_to_call():
    cfg, layers, sc, layout = _setup(1, 2, 3, [4])
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    q, k, v = draft_step_inputs(layers[0], 2, cfg.dtype, torch.Generator())
    with pytest.raises(RuntimeError, match="before init_forward_metadata"):
        ms.forward(0, q, k, v, layers[0])


def test_graph_source_is_explicit():
    """CudaGraphManager's adapter comes from the backend's graph_source(); an object that only
    looks like a multi-step backend (the attributes the old probe read) is refused."""
    from aiter_attn.graph.sources import BackendSource, MultiStepSource, source_for

    cfg, req_pool, alloc, rows, layout = _pools(7, 3, 4, [20, 5], 0)
    ms = MultiStepDraftBackend(cfg, req_pool, None)
    src = source_for(ms)
    assert isinstance(src, MultiStepSource) and src.ms is ms
    assert src.contract(ForwardMode.DECODE) is ms.pair.contract(ForwardMode.DECODE)
    assert src.planner(ForwardMode.DECODE).rows_per_request_of(None) == ms.rows_per_request == 3
    be = AttentionBackend(cfg, req_pool, None)
    assert isinstance(source_for(be), BackendSource) and source_for(src) is src

    class LooksLikeOne:
        attn_backends: list = []
        step_batches: list = []
        strategies_for = None

    with pytest.raises(TypeError, match=r"graph_source\(\).*got LooksLikeOne"):
        source_for(LooksLikeOne())
