"""Speculative modes on MHA through AttentionBackend: TARGET_VERIFY (chain: causal over the page
table; tree: custom mask + mask_indptr, checked against a per-token float64 reference that
applies the mask literally), DRAFT_EXTEND (ragged), DRAFT_EXTEND_V2 (fixed tokens, clear error
when ragged); metadata invariants (hypothesis); planning without device→host sync."""

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import (AttentionBackend, BackendConfig, CGSupport, ForwardMode, LayerSpec,
                        MHAKVPool, SpecDecodeConfig, SpecInfo)
from aiter_attn.plugins import kernel_registry, strategy_registry
from aiter_attn.strategies.base import StrategyContext
from aiter_attn.strategies.mha import DecodeMetadata
from aiter_attn.strategies.spec import (DraftExtendV2Metadata, VerifyChainMetadata,
                                        VerifyTreeMetadata, tree_mask_layout)
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.invariants import check_invariants
from aiter_attn.testing.nosync import meta_context, to_meta_batch
from aiter_attn.testing.spec_cases import (HostReadError, check_verify_mask, forbid_device_reads,
                                           full_verify_mask, random_tree_parents,
                                           tree_mask_from_parents, tree_parents)
from aiter_attn.testing.strategies import paged_batches

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}
VERIFY, V2 = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2

SHAPES = [
    pytest.param(1, 10, 2, 80, torch.float32, id="page1-GQA5:1-D80-fp32"),
    pytest.param(7, 10, 2, 32, torch.float32, id="page7-GQA5:1-D32-fp32"),
    pytest.param(48, 10, 2, 16, torch.float16, id="page48-GQA5:1-D16-fp16"),
]


def _setup(page_size, hq, hkv, d, dtype, *, topk=1, n=4, prefixes=(9, 1, 30), seed=0):
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=256, dtype=dtype,
                        spec=SpecDecodeConfig(topk=topk, num_draft_tokens=n, num_steps=3))
    layers = [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
              for i in range(1)]
    sc = PagedScenario.make(cfg, layers, list(prefixes), seed=seed + page_size)
    return cfg, layers, sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool)


def _step(sc, be, mode, new_lens, *, spec=None, masks=None, causal=None, dtype=torch.float32):
    batch = sc.next_batch(mode, new_lens, spec_info=spec)
    md = be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        assert_close_rel(out, sc.expected(layer, q, masks=masks, causal=causal), RTOL[dtype],
                         f"{mode.name} layer {layer.layer_id}")
    sc.commit_step()
    return batch, md


def _trees(bs, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [tree_mask_from_parents(random_tree_parents(n, g)) for _ in range(bs)]


def _mask_input(trees, seq_lens, layout):
    if layout == "tree":
        return torch.stack(trees).reshape(-1)
    return torch.cat([full_verify_mask(t, L).reshape(-1) for t, L in zip(trees, seq_lens)])


def _verify_seq_lens(sc, n):
    return [sc.allocator.tokens_held(r) + n for r in sc.rows]


# -- numerics against the float64 oracle -------------------------------------------------------
@pytest.mark.parametrize("page_size,hq,hkv,d,dtype", SHAPES)
def test_chain_verify_then_draft_extend(page_size, hq, hkv, d, dtype):
    """Prefill → chain verify (causal, q_len = num_draft_tokens) → draft extend over ragged
    accepted tokens → draft extend v2 → verify again; every step against the dense oracle."""
    n = 4
    cfg, layers, sc, be = _setup(page_size, hq, hkv, d, dtype, n=n)
    _step(sc, be, ForwardMode.EXTEND, [3, page_size + 1, 2], dtype=dtype)
    spec = SpecInfo(num_draft_tokens=n, topk=1)
    _, md = _step(sc, be, VERIFY, [n] * 3, spec=spec, dtype=dtype)
    assert be.pair_for(VERIFY).name == "mha.verify.chain"
    assert md.query.max_seqlen_q == n and md.mask is None
    _step(sc, be, ForwardMode.DRAFT_EXTEND, [1, 3, 2], dtype=dtype)
    _step(sc, be, V2, [n] * 3, spec=spec, dtype=dtype)
    _step(sc, be, VERIFY, [n] * 3, spec=spec, dtype=dtype)


@pytest.mark.parametrize("layout", ["full", "tree"])
@pytest.mark.parametrize("page_size,hq,hkv,d,dtype", SHAPES)
def test_tree_verify_applies_mask_literally(page_size, hq, hkv, d, dtype, layout):
    """Tree verify: each draft token sees the prefix and exactly its ancestors; the oracle
    applies the mask with causality off, so only the mask decides visibility."""
    n = 5
    cfg, layers, sc, be = _setup(page_size, hq, hkv, d, dtype, topk=3, n=n, seed=7)
    trees = _trees(3, n, seed=page_size)
    seq = _verify_seq_lens(sc, n)
    spec = SpecInfo(num_draft_tokens=n, topk=3, custom_mask=_mask_input(trees, seq, layout))
    masks = [full_verify_mask(t, L) for t, L in zip(trees, seq)]
    batch, md = _step(sc, be, VERIFY, [n] * 3, spec=spec, masks=masks, causal=False, dtype=dtype)
    assert be.pair_for(VERIFY).name == "mha.verify.tree"
    check_verify_mask(md, batch, trees)
    check_invariants(md, batch, be.ctx)


def test_tree_verify_differs_from_causal():
    """The mask matters: a branching tree gives other outputs than plain causal verify."""
    n = 4
    cfg, layers, sc, be = _setup(1, 4, 2, 16, torch.float32, topk=2, n=n, prefixes=(6,), seed=3)
    trees = [tree_mask_from_parents([-1, 0, 0, 1])]
    seq = _verify_seq_lens(sc, n)
    spec = SpecInfo(num_draft_tokens=n, topk=2, custom_mask=_mask_input(trees, seq, "full"))
    batch = sc.next_batch(VERIFY, [n], spec_info=spec)
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layers[0])
    out = be.forward(q, k, v, layers[0], batch)
    causal = sc.expected(layers[0], q)
    masked = sc.expected(layers[0], q, masks=[full_verify_mask(trees[0], seq[0])], causal=False)
    assert_close_rel(out, masked, 1e-5, "tree")
    rows = out.view(n, -1).double()
    assert not torch.allclose(rows[2], causal.view(n, -1)[2], rtol=1e-3)  # token 2 skips 1
    assert torch.allclose(rows[:2], causal.view(n, -1)[:2], rtol=1e-4)  # root & first child


def test_chain_ignores_a_causal_mask_sent_anyway():
    """SGLang sends a mask for chains too; the chain strategy plans no mask (causal == chain)."""
    n = 3
    cfg, layers, sc, be = _setup(7, 10, 2, 16, torch.float32, n=n, prefixes=(4, 12))
    seq = _verify_seq_lens(sc, n)
    chain = [torch.tril(torch.ones(n, n, dtype=torch.bool))] * 2
    spec = SpecInfo(num_draft_tokens=n, topk=1, custom_mask=_mask_input(chain, seq, "full"))
    _, md = _step(sc, be, VERIFY, [n, n], spec=spec)
    assert md.mask is None


def test_fully_masked_and_padding_rows_are_finite():
    """A draft token with an all-False mask row outputs zeros; graph-style padding rows (null
    request row 0, seq_len = q_len, dummy slot 0) produce no NaN."""
    n = 3
    cfg, layers, sc, be = _setup(7, 4, 2, 16, torch.float32, topk=2, n=n, prefixes=(5, 8))
    seq = _verify_seq_lens(sc, n)
    trees = [tree_mask_from_parents([-1, 0, 0])] * 2
    full = [full_verify_mask(t, L) for t, L in zip(trees, seq)]
    full[1][2] = False  # request 1, draft token 2 sees nothing
    pad_mask = torch.ones(n, n, dtype=torch.bool).reshape(-1)
    batch = sc.next_batch(VERIFY, [n, n])
    dev = batch.seq_lens.device
    padded = attrs.evolve(
        batch,
        req_pool_indices=torch.cat([batch.req_pool_indices, torch.zeros(1, dtype=torch.int64)]),
        seq_lens=torch.cat([batch.seq_lens, torch.tensor([n], dtype=torch.int32, device=dev)]),
        seq_lens_cpu=torch.cat([batch.seq_lens_cpu, torch.tensor([n])]),
        out_cache_loc=torch.cat([batch.out_cache_loc, torch.zeros(n, dtype=torch.int64)]),
        extend_seq_lens=None, extend_seq_lens_cpu=None, positions=None,
        spec_info=SpecInfo(num_draft_tokens=n, topk=2, custom_mask=torch.cat(
            [m.reshape(-1) for m in full] + [pad_mask])),
    )
    be.init_forward_metadata(padded)
    layer = layers[0]
    q = torch.randn(3 * n, layer.num_q_heads * layer.head_dim)
    kv = torch.randn(3 * n, layer.num_kv_heads * layer.head_dim)
    out = be.forward(q, kv, kv.clone(), layer, padded)
    assert torch.isfinite(out).all()
    assert torch.equal(out.view(3 * n, -1)[n + 2], torch.zeros(out.shape[1]))


# -- errors -----------------------------------------------------------------------------------
def test_draft_extend_v2_ragged_lengths_raise():
    """DRAFT_EXTEND_V2 takes a fixed token count per request; ragged lengths name the fix."""
    cfg, layers, sc, be = _setup(7, 4, 2, 16, torch.float32, n=3, prefixes=(4, 12))
    batch = sc.next_batch(V2, [2, 4], spec_info=SpecInfo(num_draft_tokens=3))
    with pytest.raises(ValueError, match=r"fixed 3 tokens per request.*\[2, 4\].*DRAFT_EXTEND"):
        be.init_forward_metadata(batch)


def test_spec_errors_are_clear():
    n = 3
    cfg, layers, sc, be = _setup(7, 4, 2, 16, torch.float32, topk=2, n=n, prefixes=(4, 12))
    batch = sc.next_batch(VERIFY, [n, n], spec_info=SpecInfo(num_draft_tokens=n, topk=2))
    with pytest.raises(ValueError, match="needs spec_info.custom_mask"):
        be.init_forward_metadata(batch)
    batch.spec_info.custom_mask = torch.ones(7, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"custom_mask has 7 elements.*tree part only"):
        be.init_forward_metadata(batch)
    batch.spec_info.custom_mask = torch.ones(2 * n * n, dtype=torch.float32)
    with pytest.raises(TypeError, match="custom_mask has dtype"):
        be.init_forward_metadata(batch)
    big = attrs.evolve(batch, spec_info=SpecInfo(num_draft_tokens=n + 1, topk=2))
    with pytest.raises(ValueError, match="> BackendConfig.spec.num_draft_tokens=3"):
        VerifyTreeMetadata(be.ctx).plan(big)
    ok = attrs.evolve(batch, spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                                                custom_mask=torch.ones(2 * n * n, dtype=torch.bool)))
    small = VerifyTreeMetadata(be.ctx).buffer_spec(2, 2 * n, 8).allocate("cpu")
    with pytest.raises(ValueError, match="static custom_mask buffer of 48"):
        VerifyTreeMetadata(be.ctx).plan(ok, out=small)
    none = attrs.evolve(batch, spec_info=None)
    with pytest.raises(ValueError, match="needs batch.spec_info"):
        VerifyChainMetadata(be.ctx).plan(none)
    chain_cfg = attrs.evolve(cfg, spec=SpecDecodeConfig(topk=1, num_draft_tokens=n))
    chain_be = AttentionBackend(chain_cfg, sc.req_pool, sc.kv_pool)
    with pytest.raises(ValueError, match="topk=2 is a tree draft"):
        chain_be.init_forward_metadata(batch)


def test_registered_pairs_fill_the_mha_cells():
    """Each speculative mode × MHA has a pair; uniform modes are graph-capturable."""
    reg = strategy_registry()
    tree_cfg = BackendConfig(spec=SpecDecodeConfig(topk=4, num_draft_tokens=8))
    chain_cfg = BackendConfig(spec=SpecDecodeConfig(topk=1, num_draft_tokens=4))
    assert reg.select(VERIFY, "mha", chain_cfg).name == "mha.verify.chain"
    assert reg.select(VERIFY, "mha", BackendConfig()).name == "mha.verify.chain"
    assert reg.select(VERIFY, "mha", tree_cfg).name == "mha.verify.tree"
    assert reg.select(ForwardMode.DRAFT_EXTEND, "mha").name == "mha.draft_extend"
    assert reg.select(V2, "mha", tree_cfg).name == "mha.draft_extend_v2"
    assert reg.select(ForwardMode.DECODE, "mha").name == "mha.decode"  # step pair never auto
    for name, mode, cfg in (("mha.verify.chain", VERIFY, chain_cfg),
                            ("mha.verify.tree", VERIFY, tree_cfg),
                            ("mha.draft_extend_v2", V2, chain_cfg)):
        pair = reg.select(mode, "mha", cfg, name=name)
        assert pair.cg_support == CGSupport.UNIFORM_BATCH
        assert pair.metadata.cg_support == CGSupport.UNIFORM_BATCH


# -- planning: static buffers, no host sync -----------------------------------------------------
def _ctx(cfg, req_to_token):
    return StrategyContext(config=cfg, req_to_token=req_to_token, kv_pool=None,
                           kernels=kernel_registry())


def _spec_batch(pb, n, topk, trees=None, layout="full"):
    spec = SpecInfo(num_draft_tokens=n, topk=topk)
    if trees is not None:
        spec.custom_mask = _mask_input(trees, pb.batch.seq_lens_cpu.tolist(), layout)
    return attrs.evolve(pb.batch, spec_info=spec)


@pytest.mark.parametrize("layout", ["full", "tree"])
@given(pb=paged_batches(mode=VERIFY, draft_tokens=4), data=st.data())
def test_tree_plan_is_sync_free_and_static_equals_eager(layout, pb, data):
    """Tree verify plans on meta tensors under the host-read guard (eager and into static
    buffers); on real tensors the static plan equals the eager one."""
    n = 4
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    trees = [tree_mask_from_parents(data.draw(tree_parents(n))) for _ in range(pb.batch.batch_size)]
    batch = _spec_batch(pb, n, 2, trees, layout)
    ctx = _ctx(cfg, pb.req_pool.req_to_token)
    planner = VerifyTreeMetadata(ctx)
    spec = planner.buffer_spec(cfg.max_batch_size, cfg.max_batch_size * n, cfg.max_context_len + n)
    meta_planner = VerifyTreeMetadata(meta_context(ctx))
    with forbid_device_reads():
        meta_planner.plan(to_meta_batch(batch))
        md_meta = meta_planner.plan(to_meta_batch(batch), out=spec.allocate("meta"))
    assert md_meta.mask.custom_mask.device.type == "meta"
    eager = planner.plan(batch)
    static = planner.plan(batch, out=spec.allocate("cpu"))
    check_verify_mask(eager, batch, trees)
    check_verify_mask(static, batch, trees)
    bs = batch.batch_size
    assert torch.equal(eager.pages.block_table[:bs, :eager.pages.block_table.shape[1]],
                       static.pages.block_table[:bs, :eager.pages.block_table.shape[1]])
    assert static.pages.max_seqlen_k >= eager.pages.max_seqlen_k >= batch.max_seq_len


@pytest.mark.parametrize("planner_cls,mode", [(VerifyChainMetadata, VERIFY),
                                              (DraftExtendV2Metadata, V2)])
@given(pb=paged_batches(mode=VERIFY, draft_tokens=3))
def test_uniform_plans_are_sync_free(planner_cls, mode, pb):
    """Chain verify and draft-extend v2 plan on meta tensors under the host-read guard."""
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(num_draft_tokens=3))
    batch = attrs.evolve(_spec_batch(pb, 3, 1), forward_mode=mode)
    planner = planner_cls(meta_context(_ctx(cfg, pb.req_pool.req_to_token)))
    with forbid_device_reads():
        md = planner.plan(to_meta_batch(batch))
        out = planner.buffer_spec(8, 24, 256).allocate("meta")
        planner.plan(to_meta_batch(batch), out=out)
    assert md.query.max_seqlen_q == 3 and md.query.num_tokens == 3 * batch.batch_size


@given(pb=paged_batches(mode=ForwardMode.DECODE))
def test_decode_plan_is_sync_free_under_the_guard(pb):
    """DECODE (the mode multi-step draft decode builds on) plans on meta tensors under the
    host-read guard, eager and into static buffers."""
    planner = DecodeMetadata(meta_context(_ctx(pb.config, pb.req_pool.req_to_token)))
    with forbid_device_reads():
        planner.plan(to_meta_batch(pb.batch))
        planner.plan(to_meta_batch(pb.batch), out=planner.buffer_spec(8, 8, 256).allocate("meta"))


def test_host_read_guard_is_not_vacuous():
    """The guard raises for a device read and lets CPU mirrors through."""
    with forbid_device_reads():
        assert torch.tensor([3]).item() == 3
        with pytest.raises(HostReadError, match="item"):
            torch.empty(2, device="meta").sum().item()
        with pytest.raises(HostReadError, match="__bool__"):
            bool(torch.empty((), device="meta"))
    assert torch.Tensor.item is not None and torch.tensor(2).item() == 2


# -- metadata invariants (hypothesis) ---------------------------------------------------------
def _backend_for(pb, cfg):
    pool = MHAKVPool(pb.allocator.num_pages, cfg.page_size, 1, 8, 1, dtype=torch.float32)
    return AttentionBackend(cfg, pb.req_pool, pool)


@given(pb=paged_batches(mode=VERIFY, draft_tokens=3))
def test_chain_verify_invariants(pb):
    """Chain verify: cu_seqlens_q = b·n ending at num_tokens; page table == req_to_token pages,
    inside the pool and owned by the request, null past each length; no mask."""
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(num_draft_tokens=3))
    be = _backend_for(pb, cfg)
    batch = _spec_batch(pb, 3, 1)
    md = be.init_forward_metadata(batch)
    check_invariants(md, batch, be.ctx)
    assert md.mask is None and md.query.max_seqlen_q == 3


@given(pb=paged_batches(mode=VERIFY, draft_tokens=5), layout=st.sampled_from(["full", "tree"]),
       data=st.data())
def test_tree_verify_invariants(pb, layout, data):
    """Tree verify: page-table invariants plus mask_indptr monotone with steps of n·seq_len and
    every mask block equal to prefix-visible + the request's ancestor mask."""
    n = 5
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(topk=3, num_draft_tokens=n))
    be = _backend_for(pb, cfg)
    trees = [tree_mask_from_parents(data.draw(tree_parents(n))) for _ in range(pb.batch.batch_size)]
    batch = _spec_batch(pb, n, 3, trees, layout)
    md = be.init_forward_metadata(batch)
    check_invariants(md, batch, be.ctx)
    check_verify_mask(md, batch, trees)


@given(pb=paged_batches(mode=ForwardMode.EXTEND, max_new=6))
def test_draft_extend_invariants(pb):
    """Draft extend over ragged accepted tokens: query layout and page-table invariants."""
    batch = attrs.evolve(pb.batch, forward_mode=ForwardMode.DRAFT_EXTEND)
    be = _backend_for(pb, pb.config)
    md = be.init_forward_metadata(batch)
    check_invariants(md, batch, be.ctx)
    assert md.query.max_seqlen_q == max(pb.new_lens)


@given(pb=paged_batches(mode=V2, draft_tokens=2))
def test_draft_extend_v2_invariants(pb):
    """Draft extend v2: uniform query layout (2 per request) and page-table invariants."""
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(num_draft_tokens=2))
    batch = _spec_batch(pb, 2, 1)
    be = _backend_for(pb, cfg)
    md = be.init_forward_metadata(batch)
    check_invariants(md, batch, be.ctx)
    assert md.query.max_seqlen_q == 2 and md.query.num_tokens == 2 * batch.batch_size


def test_mask_layout_detection():
    """The layout comes from the mask's size; a longer (static) buffer reads as full."""
    b = PagedScenario.make(BackendConfig(dtype=torch.float32, max_context_len=64),
                           [LayerSpec(layer_id=0, num_q_heads=1, num_kv_heads=1, head_dim=4)],
                           [2, 5]).next_batch(VERIFY, [3, 3], SpecInfo(num_draft_tokens=3))
    full = 3 * b.seq_lens_sum
    assert tree_mask_layout(torch.ones(full, dtype=torch.bool), b, 3) == "full"
    assert tree_mask_layout(torch.ones(2 * 9, dtype=torch.uint8), b, 3) == "tree"
    assert tree_mask_layout(torch.ones(full + 40, dtype=torch.bool), b, 3) == "full"


def test_build_tree_mask_hand_computed():
    """Tree part → SGLang's full layout: prefix columns visible, then the tree part verbatim."""
    from aiter_attn.ops import build_tree_mask

    seq_lens = torch.tensor([4, 2], dtype=torch.int32)
    tree = torch.tensor([[[1, 0], [0, 1]], [[0, 0], [1, 0]]], dtype=torch.uint8)
    indptr = torch.tensor([0, 8, 12])
    out = torch.zeros(12, dtype=torch.bool)
    build_tree_mask(seq_lens, tree, 2, indptr, out, 12)
    want = [1, 1, 1, 0,
            1, 1, 0, 1,
            0, 0,
            1, 0]
    assert out.tolist() == [bool(x) for x in want]


@pytest.mark.gpu
def test_plans_make_no_sync_on_cuda():
    """On a GPU, with real CUDA tensors: chain / tree (both mask layouts) verify, draft extend
    v2 and every multi-step draft step plan under ``set_sync_debug_mode("error")`` and the
    host-read guard."""
    from aiter_attn.multistep import MultiStepDraftBackend
    from aiter_attn.testing.spec_cases import DraftLayout, reserve_draft_slots
    from aiter_attn import ForwardBatch

    n = 3
    cfg = BackendConfig(page_size=16, max_batch_size=8, max_context_len=256,
                        dtype=torch.float16, device="cuda",
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=n, num_steps=3))
    layers = [LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=64)]
    sc = PagedScenario.make(cfg, layers, [5, 40], seed=0)
    tree_be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    chain_cfg = attrs.evolve(cfg, spec=SpecDecodeConfig(topk=1, num_draft_tokens=n, num_steps=3))
    chain_be = AttentionBackend(chain_cfg, sc.req_pool, sc.kv_pool)
    trees = _trees(2, n, seed=0)
    seq = _verify_seq_lens(sc, n)
    batches = []
    for be, mode, mask in ((tree_be, VERIFY, _mask_input(trees, seq, "full")),
                           (tree_be, VERIFY, _mask_input(trees, seq, "tree")),
                           (chain_be, VERIFY, None), (chain_be, V2, None)):
        spec = SpecInfo(num_draft_tokens=n, topk=2 if mask is not None else 1,
                        custom_mask=None if mask is None else mask.cuda())
        batch = attrs.evolve(sc.next_batch(VERIFY, [n, n], spec_info=spec), forward_mode=mode)
        batches.append((be.strategies_for(mode)[0], batch))
    committed = [sc.allocator.tokens_held(r) for r in sc.rows]
    reserve_draft_slots(sc.allocator, sc.req_pool, sc.rows, committed, DraftLayout(16, 2, 3))
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    draft = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=sc.rows,
                                      seq_lens=committed, device="cuda",
                                      out_cache_loc=torch.zeros(2, dtype=torch.int64))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with forbid_device_reads():
            for planner, batch in batches:
                planner.plan(batch)
            ms.init_forward_metadata(draft)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@given(pb=paged_batches(mode=VERIFY, draft_tokens=3, max_bs=4, max_prefix=40),
       pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_padded_and_fully_masked_rows_never_nan(pb, pad, seed):
    """Tree verify with graph-style padding rows (null row 0, seq_len = q_len, dummy slot 0)
    and random masks that blank whole rows: every output is finite and blank rows are 0."""
    n = 3
    g = torch.Generator().manual_seed(seed)
    cfg = attrs.evolve(pb.config, spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    pool = MHAKVPool(pb.allocator.num_pages, cfg.page_size, 1, 8, 1, dtype=torch.float32)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=g))
    be = AttentionBackend(cfg, pb.req_pool, pool)
    b = pb.batch
    lens = b.seq_lens_cpu.tolist() + [n] * pad
    masks = [torch.rand(n, L, generator=g) < 0.5 for L in lens]
    masks[0][0] = False  # at least one blank row
    batch = attrs.evolve(
        b, req_pool_indices=torch.cat([b.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.tensor(lens, dtype=torch.int32), seq_lens_cpu=torch.tensor(lens),
        out_cache_loc=torch.cat([b.out_cache_loc, torch.zeros(pad * n, dtype=torch.int64)]),
        positions=None, extend_seq_lens=None, extend_seq_lens_cpu=None,
        spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                           custom_mask=torch.cat([m.reshape(-1) for m in masks])))
    be.init_forward_metadata(batch)
    layer = LayerSpec(layer_id=0, num_q_heads=3, num_kv_heads=1, head_dim=8)
    t = batch.num_tokens
    out = be.forward(torch.randn(t, 24, generator=g), torch.randn(t, 8, generator=g),
                     torch.randn(t, 8, generator=g), layer, batch)
    assert torch.isfinite(out).all()
    blank = torch.cat([~m.any(dim=1) for m in masks])
    assert bool((out[blank] == 0).all())


def test_mha_tree_verify_with_window_follows_the_tree_path():
    """MHA arch, windowed layers (Mistral-style, one pool): the window is folded into the tree
    mask at the tokens' path positions (prefix + depth), like the SWA arch; the oracle applies
    ``tree[i, j] and pos(j) ≥ pos(i) − w + 1`` literally."""
    import attrs

    from aiter_attn import AttentionBackend, BackendConfig, LayerSpec, SpecDecodeConfig, SpecInfo
    from aiter_attn.testing import PagedScenario
    from aiter_attn.testing.compare import assert_close_rel
    from aiter_attn.testing.spec_cases import tree_depths, tree_verify_masks, windowed_tree_masks

    parents = [-1, 0, 0, 1, 2]  # root, two children, a grandchild under each
    n = len(parents)
    depth = torch.tensor(tree_depths(parents))
    prefixes = [9, 3, 14]
    cfg = BackendConfig(page_size=5, max_context_len=128, dtype=torch.float32,
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=16,
                        sliding_window=w) for i, w in enumerate([3, None, 2])]
    sc = PagedScenario.make(cfg, layers, prefixes, seed=5)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    masks = tree_verify_masks(prefixes, parents)
    batch = sc.next_batch(ForwardMode.TARGET_VERIFY, [n] * 3,
                          spec_info=SpecInfo(num_draft_tokens=n, topk=2,
                                             custom_mask=torch.cat([m.reshape(-1) for m in masks])))
    batch.positions = torch.cat([p + depth for p in prefixes])
    be.init_forward_metadata(batch)
    for layer in layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        literal = windowed_tree_masks(prefixes, masks, depth, layer.sliding_window)
        exp = sc.expected(attrs.evolve(layer, sliding_window=None), q, masks=literal, causal=False)
        assert_close_rel(out, exp, 1e-5, f"layer {layer.layer_id} window {layer.sliding_window}")
