"""SWA (hybrid sliding-window) through AttentionBackend: full layers on the full pool, SWA layers
on their own pool through the full→SWA translation; every mode the seed serves, against the
float64 dense oracle on block-permuted pools; the window convention at each boundary; freeing
out-of-window SWA pages."""

from __future__ import annotations

import attrs
import pytest
import torch

from aiter_attn import (
    AttentionBackend,
    BackendConfig,
    ForwardBatch,
    ForwardMode,
    LayerSpec,
    ReqToTokenPool,
    SpecDecodeConfig,
    SpecInfo,
    SWAKVPool,
    SWAPageAllocator,
)
from aiter_attn.kvcache import MHAKVPool
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.scenario import fill_noise, write_token_major
from aiter_attn.testing.spec_cases import tree_depths, tree_verify_masks, windowed_tree_masks

from ._triton_util import DEVICE, requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


# ---------------------------------------------------------------------------------------------
# scenario: PagedScenario's bookkeeping over an SWA pool and allocator
# ---------------------------------------------------------------------------------------------

def write_prefix(pool, layer, slots, k, v):
    """Write K/V of ``layer`` at full ``slots`` (SWA layers through the translation)."""
    if pool.is_swa_layer(layer.layer_id):
        slots = pool.translate(slots)
    write_token_major(pool, layer, slots, k, v)


def make_swa_scenario(cfg: BackendConfig, layers, prefix_lens, *, seed=0, num_swa_pages=None,
                      extra_tokens=64) -> PagedScenario:
    """Layers with a ``sliding_window`` live in the SWA pool; pools filled with noise."""
    g = torch.Generator().manual_seed(seed)
    ps = cfg.page_size
    need = PagedScenario.pages_needed(prefix_lens, ps, extra_tokens)
    l0 = layers[0]
    pool = SWAKVPool.create(
        num_full_pages=2 * need, num_swa_pages=num_swa_pages or 2 * need, page_size=ps,
        num_kv_heads=l0.num_kv_heads, head_dim=l0.head_dim, v_head_dim=l0.v_head_dim,
        layer_is_swa=[lay.sliding_window is not None for lay in layers],
        dtype=cfg.kv_cache_dtype, device=cfg.device)
    for sub in (pool.full, pool.swa):
        fill_noise(sub.k_buffers + sub.v_buffers, g)
    alloc = SWAPageAllocator(pool, shuffle_seed=seed + 1)
    return PagedScenario.from_pool(cfg, layers, pool, alloc, prefix_lens, generator=g,
                                   write_prefix=write_prefix)


def hybrid_layers(hq, hkv, d, windows, **kw):
    return [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      sliding_window=w, **kw) for i, w in enumerate(windows)]


def run_step(sc, be, mode, new_lens, *, spec_info=None, positions=None, masks=None,
             expected_masks=None, dtype=None):
    batch = sc.next_batch(mode, new_lens, spec_info=spec_info)
    if positions is not None:
        batch.positions = positions
    be.init_forward_metadata(batch)
    dtype = dtype or sc.config.dtype
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        assert out.shape == (batch.num_tokens, layer.num_q_heads * layer.v_head_dim)
        if expected_masks is not None:  # a tree mask is applied literally (non-causal)
            exp = sc.expected(attrs.evolve(layer, sliding_window=None), q,
                              masks=expected_masks(layer), causal=False)
        else:
            exp = sc.expected(layer, q, masks=masks, causal=False if masks else None)
        assert_close_rel(out, exp, RTOL[dtype], f"{mode} layer {layer.layer_id} "
                                                f"(window {layer.sliding_window})")
    sc.commit_step()
    return batch


def backend_for(sc, **cfg_kw):
    return AttentionBackend(sc.config, sc.req_pool, sc.kv_pool)


# ---------------------------------------------------------------------------------------------
# the window convention, hand-computed at each boundary
# ---------------------------------------------------------------------------------------------

WINDOW_CASES = [pytest.param(1, 1, id="w1-L1"), pytest.param(1, 2, id="w1-L2")] + [
    pytest.param(w, n, id=f"w{w}-L{n}{tag}")
    for w in (3, 5) for n, tag in ((w - 1, "=w-1"), (w, "=w"), (w + 1, "=w+1"))
]


@pytest.mark.parametrize("page_size", [1, 3], ids=["page1", "page3"])
@pytest.mark.parametrize("window,kv_len", WINDOW_CASES)
def test_window_boundaries_hand_computed(window, kv_len, page_size):
    """q = 0 makes every visible key equally likely, so the output is the mean of the values
    of exactly the ``min(kv_len, w)`` most recent keys (HF ``sliding_window = w``): checked in
    prefill (every query row) and in decode (the last key)."""
    cfg = BackendConfig(page_size=page_size, max_batch_size=4, max_context_len=64,
                        dtype=torch.float32, arch="swa")
    layers = hybrid_layers(2, 1, 4, [window, None])
    sc = make_swa_scenario(cfg, layers, [0], seed=window * 10 + kv_len)
    be = backend_for(sc)
    for mode, new in ((ForwardMode.EXTEND, kv_len - 1), (ForwardMode.DECODE, 1)):
        if new == 0:
            continue
        batch = sc.next_batch(mode, [new])
        be.init_forward_metadata(batch)
        total = sc.allocator.tokens_held(sc.rows[0])
        for layer in layers:
            _, k, v = sc.step_inputs(layer)
            q = torch.zeros(new, layer.num_q_heads * layer.head_dim)
            out = be.forward(q, k, v, layer, batch).view(new, 2, 4)
            vals = torch.cat([sc.dense_v.get((layer.layer_id, 0), torch.zeros(0, 1, 4)),
                              v.view(new, 1, 4)])
            for i in range(new):
                p = total - new + i
                w = layer.sliding_window or 10 ** 6
                want = vals[max(0, p - w + 1): p + 1].mean(0)  # [1, 4]
                assert torch.allclose(out[i], want.expand(2, 4), atol=1e-6), (mode, layer, i)
        sc.commit_step()


@pytest.mark.parametrize("window", [1, 2, 5])
def test_window_convention_matches_transformers(window):
    """``LayerSpec(sliding_window=w).window_size()`` read with flash-attn semantics marks the
    same keys visible as transformers' own sliding-window causal mask for every (query, key)."""
    masking = pytest.importorskip("transformers.masking_utils")
    hf = masking.sliding_window_causal_mask_function(window)
    left, right = LayerSpec(layer_id=0, num_q_heads=1, num_kv_heads=1, head_dim=8,
                            sliding_window=window).window_size()
    for q in range(9):
        for k in range(9):
            ours = k <= q and q - left <= k and (right < 0 or k <= q + right)
            t = torch.tensor
            assert ours == bool(hf(t(0), t(0), t(q), t(k))), (window, q, k)


# ---------------------------------------------------------------------------------------------
# backend vs the dense oracle: extend / decode / chunked extend
# ---------------------------------------------------------------------------------------------

CASES = [
    pytest.param(1, 8, 2, 32, (4, None, 1, None), id="page1-GQA4:1-D32-w4,1"),
    pytest.param(12, 10, 2, 80, (13, None, 5, None), id="page12-GQA5:1-D80-w13,5"),
    pytest.param(5, 10, 2, 16, (6, 6, None), id="page5-GQA5:1-D16-w6"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("page_size,hq,hkv,d,windows", CASES)
def test_swa_extend_decode_chunked(page_size, hq, hkv, d, windows, dtype):
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=256, dtype=dtype,
                        arch="swa")
    layers = hybrid_layers(hq, hkv, d, windows)
    prefixes = [0, page_size, page_size + 3, 2 * page_size + 5]
    sc = make_swa_scenario(cfg, layers, prefixes, seed=page_size + hq)
    be = backend_for(sc)
    run_step(sc, be, ForwardMode.EXTEND, [5, 1, 9, 3])
    for _ in range(2):
        run_step(sc, be, ForwardMode.DECODE, [1, 1, 1, 1])
    run_step(sc, be, ForwardMode.EXTEND, [page_size + 2, 2, 1, 7])  # chunked prefill


def test_swa_softcap_sinks_fp8():
    """Gemma-2 soft-cap and gpt-oss sinks on SWA layers; an fp8 e4m3fn cache with scales."""
    cfg = BackendConfig(page_size=4, max_context_len=128, dtype=torch.float32,
                        kv_cache_dtype=torch.float8_e4m3fn, arch="swa")
    sinks = torch.linspace(-1.0, 2.0, 6)
    layers = hybrid_layers(6, 2, 16, [5, None, 3], logit_cap=20.0, sinks=sinks,
                           k_scale=0.5, v_scale=0.25)
    sc = make_swa_scenario(cfg, layers, [7, 0, 4], seed=5)
    be = backend_for(sc)
    run_step(sc, be, "extend", [3, 6, 2])
    run_step(sc, be, "decode", [1, 1, 1])


def test_idle_swa_returns_empty():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 16, [3, None])
    sc = make_swa_scenario(cfg, layers, [], seed=0)
    be = backend_for(sc)
    batch = sc.next_batch(ForwardMode.IDLE, [])
    be.init_forward_metadata(batch)
    q = torch.zeros(0, 64)
    assert be.forward(q, q[:, :32], q[:, :32], layers[0], batch).shape == (0, 64)


# ---------------------------------------------------------------------------------------------
# speculative modes
# ---------------------------------------------------------------------------------------------

SPEC_CASES = [
    pytest.param(1, (3, None), id="page1-w3"),
    pytest.param(6, (7, None, 2), id="page6-w7,2"),
]


@pytest.mark.parametrize("page_size,windows", SPEC_CASES)
def test_swa_verify_chain_and_draft_extend(page_size, windows):
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(10, 2, 16, windows)
    sc = make_swa_scenario(cfg, layers, [9, page_size, 2 * page_size + 1], seed=page_size)
    be = backend_for(sc)
    spec = SpecInfo(num_draft_tokens=3, topk=1)
    run_step(sc, be, ForwardMode.TARGET_VERIFY, [3, 3, 3], spec_info=spec)
    run_step(sc, be, ForwardMode.DRAFT_EXTEND, [2, 1, 4])  # accepted tokens + 1, ragged
    run_step(sc, be, ForwardMode.DRAFT_EXTEND_V2, [3, 3, 3], spec_info=spec)
    run_step(sc, be, ForwardMode.DECODE, [1, 1, 1])


def test_draft_extend_v2_rejects_ragged_lengths():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 16, [3, None])
    sc = make_swa_scenario(cfg, layers, [3, 5], seed=1)
    be = backend_for(sc)
    batch = sc.next_batch(ForwardMode.DRAFT_EXTEND_V2, [2, 2],
                          spec_info=SpecInfo(num_draft_tokens=2))
    batch.extend_seq_lens_cpu = torch.tensor([1, 3])
    with pytest.raises(ValueError, match="fixed 2 tokens per request"):
        be.init_forward_metadata(batch)


# A 5-token tree: 0 is the root (last verified token), 1 and 2 its children, 3 a child of 1,
# 4 a child of 2.
TREE_PARENTS = [-1, 0, 0, 1, 2]


@pytest.mark.parametrize("given_positions", [True, False], ids=["positions", "index-order"])
@pytest.mark.parametrize("page_size", [1, 6], ids=["page1", "page6"])
def test_swa_tree_verify_literal_mask(page_size, given_positions):
    """Tree verify: the window is applied at path positions (prefix + depth); the expected
    output applies the literal per-token mask ``tree[i, j] and pos(j) ≥ pos(i) − w + 1``. The
    positions come from the mask: the batch's own ``positions`` (here ForwardBatch.from_lengths'
    index order, wrong for a tree) are not read."""
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=torch.float32, arch="swa",
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=len(TREE_PARENTS)))
    layers = hybrid_layers(10, 2, 16, [3, None, 2, 6])
    prefixes = [7, page_size + 1, 0 + 4]
    sc = make_swa_scenario(cfg, layers, prefixes, seed=11 + page_size)
    be = backend_for(sc)
    n = len(TREE_PARENTS)
    depth = torch.tensor(tree_depths(TREE_PARENTS))
    masks = tree_verify_masks(prefixes, TREE_PARENTS)
    spec = SpecInfo(num_draft_tokens=n, topk=2,
                    custom_mask=torch.cat([m.reshape(-1) for m in masks]))
    positions = torch.cat([p + depth for p in prefixes])

    def literal(layer):
        return windowed_tree_masks(prefixes, masks, depth, layer.sliding_window)

    run_step(sc, be, ForwardMode.TARGET_VERIFY, [n] * 3, spec_info=spec,
             positions=positions if given_positions else None, expected_masks=literal)


def test_tree_mask_is_applied_literally():
    """The mask alone decides (non-causal): a query allowed to see a *later* draft token sees
    it, on full and on SWA layers (there with the window on top, at the positions the mask
    implies: prefix + the draft tokens a row sees − 1, whatever the mask's shape)."""
    n = 3
    cfg = BackendConfig(page_size=2, max_context_len=64, dtype=torch.float32, arch="swa",
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    layers = hybrid_layers(4, 2, 16, [4, None])
    prefixes = [5, 2]
    sc = make_swa_scenario(cfg, layers, prefixes, seed=6)
    masks = [torch.ones(n, p + n, dtype=torch.bool).tril(p) for p in prefixes]
    masks[0][0, -1] = True  # query 0 may see draft token 2
    masks[1][2, 0] = False
    spec = SpecInfo(num_draft_tokens=n, topk=2,
                    custom_mask=torch.cat([m.reshape(-1) for m in masks]))

    def literal(layer):
        if layer.sliding_window is None:
            return masks
        out = []
        for p, m in zip(prefixes, masks):
            pos = p + (m[:, p:].sum(1) - 1).clamp(min=0)  # [n] draft positions
            q = pos.view(-1, 1)
            k = torch.cat([torch.arange(p), pos]).view(1, -1)
            out.append(m & (k >= q - (layer.sliding_window - 1)))
        return out

    run_step(sc, backend_for(sc), ForwardMode.TARGET_VERIFY, [n, n], spec_info=spec,
             expected_masks=literal)


def test_tree_verify_without_mask_is_an_error():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa",
                        spec=SpecDecodeConfig(topk=2, num_draft_tokens=2))
    sc = make_swa_scenario(cfg, hybrid_layers(4, 2, 16, [3]), [3], seed=2)
    be = backend_for(sc)
    batch = sc.next_batch(ForwardMode.TARGET_VERIFY, [2], spec_info=SpecInfo(num_draft_tokens=2,
                                                                             topk=2))
    with pytest.raises(ValueError, match="custom_mask"):
        be.init_forward_metadata(batch)


def copy_partial_prefix_pages(sc, prefixes, layout):
    """What SGLang's EAGLE worker does for page_size > 1 and topk > 1: copy the prefix's last
    partial page into each branch's first draft page, in every layer (SWA layers through the
    translation)."""
    pool, r2t = sc.kv_pool, sc.req_pool.req_to_token
    for row, p in zip(sc.rows, prefixes):
        base = p - p % layout.page_size
        if base == p or layout.topk == 1:
            continue
        src = r2t[row, base:p].long()
        for k in range(1, layout.topk):
            dst = r2t[row, [layout.column(p, k, t) for t in range(base, p)]].long()
            for layer in sc.layers:
                s, d = src, dst
                if getattr(pool, "is_swa_layer", None) and pool.is_swa_layer(layer.layer_id):
                    s, d = pool.translate(src), pool.translate(dst)
                for buf in pool.kv_buffers(layer.layer_id):
                    flat = buf.view(-1, *buf.shape[2:])
                    flat[d] = flat[s]


def run_multistep_draft(sc, prefixes, topk, steps, rtol, *, copy_pages=True):
    """Plan every draft step with MultiStepDraftBackend (forced to ``<arch>.draft_decode_step``)
    and compare each step of each branch with the dense oracle over prefix + that branch's
    draft tokens so far (windows at their positions)."""
    from aiter_attn.multistep import MultiStepDraftBackend
    from aiter_attn.testing.spec_cases import (DraftLayout, draft_branch_expected,
                                               draft_step_inputs, reserve_draft_slots)

    layout = DraftLayout(sc.config.page_size, topk, steps)
    reserve_draft_slots(sc.allocator, sc.req_pool, sc.rows, prefixes, layout)
    if copy_pages:
        copy_partial_prefix_pages(sc, prefixes, layout)
    ms = MultiStepDraftBackend(sc.config, sc.req_pool, sc.kv_pool, topk=topk, num_steps=steps)
    draft = ForwardBatch.from_lengths(forward_mode=ForwardMode.DECODE, req_pool_indices=sc.rows,
                                      seq_lens=prefixes,
                                      out_cache_loc=torch.zeros(len(prefixes), dtype=torch.int64))
    g = torch.Generator().manual_seed(7)
    branch_kv = {}
    rows = [(b, k) for b in range(len(prefixes)) for k in range(topk)]
    dtype = sc.config.dtype
    assert ms.pair.name.endswith(".draft_decode_step")
    for i, _ in enumerate(ms.init_forward_metadata(draft)):
        for layer in sc.layers:
            q, k, v = draft_step_inputs(layer, len(rows), dtype, g)
            out = ms.forward(i, q, k, v, layer)
            expected = draft_branch_expected(sc, layer, q, k, v, rows, branch_kv)
            assert_close_rel(out, expected, rtol, f"step {i} layer {layer.layer_id}")


@pytest.mark.parametrize("page_size,topk,steps", [
    pytest.param(1, 3, 4, id="page1-topk3-steps4"),
    pytest.param(5, 2, 3, id="page5-topk2-steps3-partial-pages"),
    pytest.param(6, 1, 4, id="page6-chain-steps4"),
])
def test_swa_multistep_draft_decode(page_size, topk, steps):
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=torch.float32, arch="swa",
                        spec=SpecDecodeConfig(topk=topk, num_steps=steps, num_draft_tokens=4))
    layers = hybrid_layers(10, 2, 16, [3, None, 5])
    prefixes = [7, page_size, 2 * page_size + 3]
    sc = make_swa_scenario(cfg, layers, prefixes, seed=page_size + topk, extra_tokens=64)
    run_multistep_draft(sc, prefixes, topk, steps, 1e-5)


def test_swa_draft_step_table_keeps_its_address_across_static_plans():
    """Planned into the multi-step backend's static buffers twice (capture, then a replay with
    other lengths), each step's SWA table is the same storage, refilled in place."""
    from aiter_attn.multistep import MultiStepDraftBackend
    from aiter_attn.testing.spec_cases import DraftLayout, reserve_draft_slots

    cfg = BackendConfig(page_size=4, max_context_len=128, dtype=torch.float32, arch="swa",
                        spec=SpecDecodeConfig(topk=2, num_steps=3))
    sc = make_swa_scenario(cfg, hybrid_layers(4, 2, 16, [3, None]), [6, 9], seed=1)
    reserve_draft_slots(sc.allocator, sc.req_pool, sc.rows, [6, 9], DraftLayout(4, 2, 3))
    ms = MultiStepDraftBackend(cfg, sc.req_pool, sc.kv_pool)
    ms.init_cuda_graph_state(max_bs=2, max_seq_len=32)
    ptrs = []
    for lens in ([6, 9], [5, 2]):
        draft = ForwardBatch.from_lengths(forward_mode="decode", req_pool_indices=sc.rows,
                                          seq_lens=lens, out_cache_loc=torch.zeros(2))
        ms.init_forward_metadata_out_graph(draft)
        ptrs.append([md.extras["swa_pages"].block_table.data_ptr()
                     for md in ms.step_metadata])
    assert ptrs[0] == ptrs[1]


# ---------------------------------------------------------------------------------------------
# the SWA pool is smaller: freeing pages that left every window
# ---------------------------------------------------------------------------------------------

def test_free_out_of_window_keeps_results_and_bounds_the_pool():
    """Decode 40 tokens with a 9-page SWA pool (page 4, window 6): without freeing it would
    need 12+ pages per request; freed pages are reused and outputs still match the oracle."""
    ps, window = 4, 6
    cfg = BackendConfig(page_size=ps, max_context_len=128, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 8, [window, None, window - 2])
    sc = make_swa_scenario(cfg, layers, [5, 2], seed=3, num_swa_pages=9)
    be = backend_for(sc)
    alloc: SWAPageAllocator = sc.allocator
    for _ in range(40):
        for row in sc.rows:
            alloc.free_swa_out_of_window(row, window)
        run_step(sc, be, ForwardMode.DECODE, [1, 1])
    for row in sc.rows:
        live = [p for p in alloc.swa_pages_of(row) if p]
        assert len(live) <= -(-window // ps) + 1
        assert len(alloc.full.pages_of(row)) >= 40 // ps


def test_allocator_free_semantics():
    ps = 2
    pool = SWAKVPool.create(num_full_pages=16, num_swa_pages=8, page_size=ps, num_kv_heads=1,
                            head_dim=4, layer_is_swa=[True, False], dtype=torch.float32)
    req = ReqToTokenPool(3, 32)
    alloc = SWAPageAllocator(pool, shuffle_seed=0)
    row = req.alloc()
    slots = alloc.extend(req, row, 9)  # 5 pages: tokens 0..8
    m = pool.full_to_swa_index_mapping
    assert torch.equal(m[slots] % ps, slots % ps)  # page-aligned translation
    assert len(set((m[slots] // ps).tolist())) == 5 and bool((m[slots] > 0).all())
    # next query at 9 with w = 4 sees keys ≥ 6: pages 0..2 (tokens 0..5) are dead
    assert alloc.free_swa_out_of_window(row, 4) == 3
    assert alloc.swa_pages_of(row)[:3] == [0, 0, 0] and all(alloc.swa_pages_of(row)[3:])
    assert bool((m[slots[:6]] == 0).all()) and bool((m[slots[6:]] > 0).all())
    assert alloc.free_swa_out_of_window(row, 4) == 0  # idempotent
    # speculative rollback: only what the committed length allows
    row2 = req.alloc()
    alloc.extend(req, row2, 8)
    assert alloc.free_swa_out_of_window(row2, 3, next_position=5) == 1  # keys ≥ 3 live
    with pytest.raises(ValueError, match="next_position"):
        alloc.free_swa_out_of_window(row2, 3, next_position=9)
    with pytest.raises(ValueError, match="window"):
        alloc.free_swa_out_of_window(row2, 0)
    free_before = alloc.swa_free_pages
    alloc.release(req, row)
    assert alloc.swa_free_pages == free_before + 2
    with pytest.raises(RuntimeError, match="SWA pool out of pages"):
        alloc.extend(req, row2, 30)


def test_allocator_shared_prefix_keeps_shared_swa_pages():
    """A prefix shared by two requests shares its SWA pages too (one translation per full
    page); releasing one request with ``keep_pages`` leaves them mapped for the other."""
    pool = SWAKVPool.create(num_full_pages=12, num_swa_pages=12, page_size=3, num_kv_heads=1,
                            head_dim=4, layer_is_swa=[True], dtype=torch.float32)
    req = ReqToTokenPool(3, 32)
    alloc = SWAPageAllocator(pool, shuffle_seed=4)
    a, b = req.alloc(), req.alloc()
    alloc.extend(req, a, 8)
    assert alloc.share_prefix(req, a, b, 7) == 6  # two whole pages
    alloc.extend(req, b, 2)
    shared = frozenset(alloc.pages_of(a)[:2])
    assert alloc.swa_pages_of(b)[:2] == alloc.swa_pages_of(a)[:2]
    assert alloc.free_swa_out_of_window(a, 1, keep_pages=shared) == 0  # only shared pages dead
    alloc.release(req, a, keep_pages=shared)
    m = pool.full_to_swa_index_mapping
    assert bool((m[req.req_to_token[b, :8].long()] > 0).all())
    assert alloc.free_pages == 12 - 1 - 3 and alloc.swa_free_pages == 12 - 1 - 3


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_swa_tables_come_from_one_fused_pass(monkeypatch):
    """Every SWA planner that builds its own page table builds the SWA table in the same
    pass (op ``build_page_tables_swa``, no separate ``build_page_table``), and the result
    equals translating the full table afterwards."""
    from aiter_attn import ops
    from aiter_attn.strategies.swa import plan_swa_tables

    calls = []
    fused, plain = ops.build_page_tables_swa, ops.build_page_table
    monkeypatch.setattr(ops, "build_page_tables_swa",
                        lambda *a, **k: calls.append("fused") or fused(*a, **k))
    monkeypatch.setattr(ops, "build_page_table",
                        lambda *a, **k: calls.append("plain") or plain(*a, **k))
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 16, [5, None])
    sc = make_swa_scenario(cfg, layers, [13, 6], seed=3, extra_tokens=8)
    for row in sc.rows:  # some SWA pages freed: their entries must be the null page
        sc.allocator.free_swa_out_of_window(row, 5)
    be = backend_for(sc)
    for mode, lens in ((ForwardMode.EXTEND, [3, 2]), (ForwardMode.DECODE, [1, 1])):
        calls.clear()
        run_step(sc, be, mode, lens)
        assert calls == ["fused"], (mode, calls)
        md = be.forward_metadata
        again = plan_swa_tables(sc.kv_pool, md.pages, torch.empty_like(md.pages.block_table))
        assert torch.equal(md.extras["swa_pages"].block_table, again.block_table)


def test_swa_backend_needs_swa_pool():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa")
    req = ReqToTokenPool(3, 64)
    be = AttentionBackend(cfg, req, MHAKVPool(8, 4, 2, 16, 1, dtype=torch.float32))
    batch = ForwardMode.DECODE
    with pytest.raises(TypeError, match="SWAKVPool"):
        be.strategies_for(batch)


def test_layer_in_swa_pool_without_window_is_an_error():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="swa")
    layers = hybrid_layers(4, 2, 16, [3, None])
    sc = make_swa_scenario(cfg, layers, [3], seed=4)
    be = backend_for(sc)
    batch = sc.next_batch(ForwardMode.DECODE, [1])
    be.init_forward_metadata(batch)
    q, k, v = sc.step_inputs(layers[0])
    bad = attrs.evolve(layers[0], sliding_window=None)
    with pytest.raises(ValueError, match="no sliding_window"):
        be.forward(q, k, v, bad, batch)


# ---------------------------------------------------------------------------------------------
# the same path on the Triton kernels (interpreter on CPU hosts, the GPU otherwise)
# ---------------------------------------------------------------------------------------------

@requires_triton
def test_swa_on_triton_kernels_with_freed_pages():
    """kernel_backend='triton': write_kv_swa, write_kv and paged_attention (windowed, over an
    SWA table whose freed pages point at the null page) match the oracle."""
    ps, window = 4, 5
    cfg = BackendConfig(page_size=ps, max_context_len=64, dtype=torch.float16, arch="swa",
                        kernel_backend="triton", device=DEVICE)
    layers = hybrid_layers(4, 2, 16, [window, None])
    sc = make_swa_scenario(cfg, layers, [13, 6], seed=8, extra_tokens=8)
    for row in sc.rows:
        sc.allocator.free_swa_out_of_window(row, window)
    be = backend_for(sc)
    run_step(sc, be, ForwardMode.EXTEND, [3, 2])
    run_step(sc, be, ForwardMode.DECODE, [1, 1])
