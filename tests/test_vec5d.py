"""VEC5D: the vectorised 5-D KV layout (K [pages, H, D/x, page, x], V shuffled
[pages, H, page/x, Dv, x] or hd_page [pages, H, Dv, page]) through AttentionBackend in every
mode, against the float64 dense oracle on block-permuted pools; the layout element by element;
the 5-D attention op against the NHD one."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from aiter_attn import (
    AttentionBackend,
    BackendConfig,
    ForwardMode,
    LayerSpec,
    PageAllocator,
    ReqToTokenPool,
    SpecDecodeConfig,
    SpecInfo,
    Vec5DKVPool,
    ops,
)
from aiter_attn.kernels.reference_extra import kv_5d_from_nhd
from aiter_attn.kvcache import MHAKVPool
from aiter_attn.strategies.vec5d import paged_attention_5d, write_kv_5d
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.scenario import fill_noise
from aiter_attn.testing.spec_cases import tree_depths, tree_verify_masks

from .test_swa import TREE_PARENTS, run_multistep_draft

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.float8_e4m3fn: 1e-5}


def write_5d(pool, layer, slots, k, v):
    """Write a prefix of ``layer`` into the 5-D layout through the reference writer."""
    kc, vc = pool.kv_buffers(layer.layer_id)
    write_kv_5d(kc, vc, slots, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale)


def make_5d_scenario(cfg: BackendConfig, layers, prefix_lens, *, seed=0, v_layout="shuffled"):
    g = torch.Generator().manual_seed(seed)
    ps = cfg.page_size
    num_pages = 2 * PagedScenario.pages_needed(prefix_lens, ps)
    l0 = layers[0]
    pool = Vec5DKVPool(num_pages, ps, l0.num_kv_heads, l0.head_dim, len(layers),
                       dtype=cfg.kv_cache_dtype, device=cfg.device, v_head_dim=l0.v_head_dim,
                       v_layout=v_layout)
    fill_noise(pool.k_buffers + pool.v_buffers, g)
    alloc = PageAllocator(num_pages, ps, shuffle_seed=seed + 1)
    return PagedScenario.from_pool(cfg, layers, pool, alloc, prefix_lens, generator=g,
                                   write_prefix=write_5d)


def layers_of(hq, hkv, d, n=2, windows=None, **kw):
    windows = windows or [None] * n
    return [LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                      sliding_window=w, **kw) for i, w in enumerate(windows)]


def run_step(sc, be, mode, new_lens, *, spec_info=None, positions=None, masks=None, rtol):
    batch = sc.next_batch(mode, new_lens, spec_info=spec_info)
    if positions is not None:
        batch.positions = positions
    be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        exp = sc.expected(layer, q, masks=masks, causal=False if masks else None)
        assert_close_rel(out, exp, rtol,
                         f"{mode} layer {layer.layer_id}")
    sc.commit_step()


# ---------------------------------------------------------------------------------------------
# the layout, element by element
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,x", [(torch.float32, 4), (torch.float16, 8),
                                     (torch.float8_e4m3fn, 16)], ids=["fp32", "fp16", "fp8"])
@pytest.mark.parametrize("v_layout", ["shuffled", "hd_page"])
def test_layout_element_placement(dtype, x, v_layout):
    """Token t in slot s = page·P + o: k[t, h, d] at K[page, h, d // x, o, d % x]; v[t, h, d] at
    V[page, h, o // x, d, o % x] (shuffled) or V[page, h, d, o] (hd_page)."""
    ps, heads, dim = 2 * x, 2, 2 * x
    pool = Vec5DKVPool(4, ps, heads, dim, 1, dtype=dtype, v_layout=v_layout)
    assert pool.x == x
    kc, vc = pool.kv_buffers(0)
    assert kc.shape == (4, heads, dim // x, ps, x)
    shuffled = v_layout == "shuffled"
    assert vc.shape == ((4, heads, ps // x, dim, x) if shuffled else (4, heads, dim, ps))
    slots = torch.tensor([ps * 2 + x + 1, ps * 3 + 0, ps * 1 + ps - 1])
    k = ((torch.arange(3 * heads * dim).view(3, heads, dim) % 13).float() - 6) / 2  # exact in fp8
    v = -k
    write_kv_5d(kc, vc, slots, k.to(torch.float32), v.to(torch.float32))
    for t, s in enumerate(slots.tolist()):
        page, o = divmod(s, ps)
        for h in range(heads):
            for d in range(dim):
                assert float(kc[page, h, d // x, o, d % x]) == float(k[t, h, d])
                got_v = vc[page, h, o // x, d, o % x] if shuffled else vc[page, h, d, o]
                assert float(got_v) == float(v[t, h, d])
    untouched = torch.ones(4 * ps, dtype=torch.bool)
    untouched[slots] = False
    k_nhd, _ = pool.nhd_view(0)
    assert not k_nhd.reshape(4 * ps, -1)[untouched].float().any()


# ---------------------------------------------------------------------------------------------
# backend vs the dense oracle
# ---------------------------------------------------------------------------------------------

CASES = [
    pytest.param(torch.float32, 12, 10, 2, 80, "shuffled", id="fp32-page12-GQA5:1-D80"),
    pytest.param(torch.float16, 24, 8, 2, 32, "shuffled", id="fp16-page24-GQA4:1-D32"),
    pytest.param(torch.float32, 1, 10, 2, 16, "hd_page", id="fp32-page1-hd_page-GQA5:1"),
    pytest.param(torch.float16, 5, 4, 4, 16, "hd_page", id="fp16-page5-hd_page-MHA"),
]


@pytest.mark.parametrize("dtype,page_size,hq,hkv,d,v_layout", CASES)
def test_vec5d_extend_decode_chunked(dtype, page_size, hq, hkv, d, v_layout):
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=dtype, arch="vec5d")
    layers = layers_of(hq, hkv, d, windows=[None, 7])
    prefixes = [0, page_size, page_size + 3, 2 * page_size + 1]
    sc = make_5d_scenario(cfg, layers, prefixes, seed=page_size + d, v_layout=v_layout)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    rtol = RTOL[dtype]
    run_step(sc, be, ForwardMode.EXTEND, [5, 1, 9, 3], rtol=rtol)
    for _ in range(2):
        run_step(sc, be, ForwardMode.DECODE, [1, 1, 1, 1], rtol=rtol)
    run_step(sc, be, ForwardMode.EXTEND, [page_size + 2, 2, 1, 4], rtol=rtol)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz],
                         ids=["e4m3fn", "e4m3fnuz"])
def test_vec5d_fp8_softcap_sinks(kv_dtype):
    cfg = BackendConfig(page_size=16, max_context_len=128, dtype=torch.float32,
                        kv_cache_dtype=kv_dtype, arch="vec5d")
    layers = layers_of(6, 2, 32, windows=[None, 5], logit_cap=15.0,
                       sinks=torch.linspace(-1, 1, 6), k_scale=0.5, v_scale=0.25)
    sc = make_5d_scenario(cfg, layers, [3, 17], seed=9)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    run_step(sc, be, "extend", [4, 2], rtol=1e-5)
    run_step(sc, be, "decode", [1, 1], rtol=1e-5)


@pytest.mark.parametrize("page_size,v_layout", [(1, "hd_page"), (12, "shuffled")],
                         ids=["page1", "page12"])
def test_vec5d_speculative_modes(page_size, v_layout):
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=torch.float32,
                        arch="vec5d")
    layers = layers_of(10, 2, 16, windows=[None, None])
    prefixes = [6, page_size + 2, 1]
    sc = make_5d_scenario(cfg, layers, prefixes, seed=21, v_layout=v_layout)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    chain = SpecInfo(num_draft_tokens=3, topk=1)
    run_step(sc, be, ForwardMode.TARGET_VERIFY, [3, 3, 3], spec_info=chain, rtol=1e-5)
    run_step(sc, be, ForwardMode.DRAFT_EXTEND, [1, 3, 2], rtol=1e-5)
    run_step(sc, be, ForwardMode.DRAFT_EXTEND_V2, [3, 3, 3], spec_info=chain, rtol=1e-5)
    # tree verify with the literal per-token mask (a tree backend: spec.topk > 1)
    n = len(TREE_PARENTS)
    sc.config = attrs.evolve(cfg, spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    be = AttentionBackend(sc.config, sc.req_pool, sc.kv_pool)
    held = [sc.allocator.tokens_held(r) for r in sc.rows]
    masks = tree_verify_masks(held, TREE_PARENTS)
    tree = SpecInfo(num_draft_tokens=n, topk=2,
                    custom_mask=torch.cat([m.reshape(-1) for m in masks]))
    depth = torch.tensor(tree_depths(TREE_PARENTS))
    run_step(sc, be, ForwardMode.TARGET_VERIFY, [n] * 3, spec_info=tree,
             positions=torch.cat([p + depth for p in held]), masks=masks, rtol=1e-5)


@pytest.mark.parametrize("page_size,topk,v_layout", [
    pytest.param(1, 3, "hd_page", id="page1-topk3-hd_page"),
    pytest.param(8, 1, "shuffled", id="page8-chain-shuffled"),
])
def test_vec5d_multistep_draft_decode(page_size, topk, v_layout):
    cfg = BackendConfig(page_size=page_size, max_context_len=256, dtype=torch.float32,
                        arch="vec5d", spec=SpecDecodeConfig(topk=topk, num_steps=3))
    layers = layers_of(10, 2, 16, windows=[None, 4])
    prefixes = [5, page_size + 2]
    sc = make_5d_scenario(cfg, layers, prefixes, seed=3, v_layout=v_layout)
    run_multistep_draft(sc, prefixes, topk, 3, 1e-5, copy_pages=False)


# ---------------------------------------------------------------------------------------------
# the 5-D op against the NHD op on the same data
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("v_shuffled", [True, False], ids=["shuffled", "hd_page"])
def test_paged_attention_5d_matches_nhd(v_shuffled):
    g = torch.Generator().manual_seed(0)
    pages, ps, hkv, d = 9, 8, 2, 16
    k = torch.randn(pages, ps, hkv, d, generator=g)
    v = torch.randn(pages, ps, hkv, 8, generator=g)
    k5, v5 = kv_5d_from_nhd(k, v, 4, v_shuffled=v_shuffled)
    q = torch.randn(7, 6, d, generator=g)
    args = dict(cu_seqlens_q=torch.tensor([0, 1, 7], dtype=torch.int32),
                seqused_k=torch.tensor([11, 20], dtype=torch.int32),
                block_table=torch.tensor([[5, 2, 0], [7, 1, 3]], dtype=torch.int32),
                softmax_scale=0.3, window_size=(6, 0), softcap=5.0)
    want = ops.paged_attention(q, k, v, **args)
    got = paged_attention_5d(q, k5, v5, **args)
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_pool_rejects_unaligned_shapes():
    with pytest.raises(ValueError, match="page_size=5 is not a multiple of x=8"):
        Vec5DKVPool(4, 5, 2, 16, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim=20 is not a multiple of x=8"):
        Vec5DKVPool(4, 8, 2, 20, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="v_layout"):
        Vec5DKVPool(4, 8, 2, 16, 1, dtype=torch.float16, v_layout="nhd")
    Vec5DKVPool(4, 5, 2, 16, 1, dtype=torch.float16, v_layout="hd_page")  # fine


def test_op_rejects_wrong_vector_width_and_shapes():
    q = torch.randn(1, 2, 16)
    k5 = torch.zeros(3, 2, 2, 4, 8)  # fp32 needs x = 4, not 8
    v5 = torch.zeros(3, 2, 1, 16, 4)
    args = dict(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                seqused_k=torch.tensor([2], dtype=torch.int32),
                block_table=torch.tensor([[1]], dtype=torch.int32), softmax_scale=1.0)
    with pytest.raises(ValueError, match="x = 16 bytes / element size = 4"):
        paged_attention_5d(q, k5, v5, **args)
    pool = Vec5DKVPool(3, 4, 2, 16, 1, dtype=torch.float32)
    kc, vc = pool.kv_buffers(0)
    with pytest.raises(ValueError, match="k has shape"):
        write_kv_5d(kc, vc, torch.tensor([5]), torch.zeros(1, 2, 8), torch.zeros(1, 2, 16))


def test_vec5d_backend_needs_vec5d_pool():
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32, arch="vec5d")
    be = AttentionBackend(cfg, ReqToTokenPool(3, 64), MHAKVPool(8, 4, 2, 16, 1,
                                                               dtype=torch.float32))
    with pytest.raises(TypeError, match="Vec5DKVPool"):
        be.strategies_for(ForwardMode.DECODE)


@given(st.sampled_from([torch.float32, torch.float16, torch.float8_e4m3fn]),
       st.sampled_from(["shuffled", "hd_page"]), st.integers(1, 3), st.data())
def test_5d_write_touches_only_its_slots(dtype, v_layout, pages_per_x, data):
    """Through the backend's op (``write_kv_5d``): the written slots read back (as NHD) to the
    quantised K/V and every other byte of both caches is unchanged."""
    from aiter_attn.kernels.reference import quantize_to_cache

    x = 16 // torch.empty((), dtype=dtype).element_size()
    ps = x * pages_per_x if v_layout == "shuffled" else data.draw(st.integers(1, 7))
    pool = Vec5DKVPool(5, ps, 2, 2 * x, 1, dtype=dtype, v_layout=v_layout)
    kc, vc = pool.kv_buffers(0)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 999)))
    for buf in (kc, vc):
        buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    n = data.draw(st.integers(0, 4 * ps))
    slots = torch.randperm(5 * ps - ps, generator=g)[:n] + ps  # never the null page
    k = torch.randn(n, 2, 2 * x, generator=g)
    v = torch.randn(n, 2, 2 * x, generator=g)
    k_before, v_before = pool.nhd_view(0)
    write_kv_5d(kc, vc, slots, k, v, k_scale=0.5, v_scale=2.0)
    k_after, v_after = pool.nhd_view(0)
    mask = torch.ones(5 * ps, dtype=torch.bool)
    mask[slots] = False
    for before, after, new, scale in ((k_before, k_after, k, 0.5), (v_before, v_after, v, 2.0)):
        b, a = before.reshape(5 * ps, -1), after.reshape(5 * ps, -1)
        assert torch.equal(b[mask].view(torch.uint8), a[mask].view(torch.uint8))
        want = quantize_to_cache(new, dtype, scale).reshape(n, 4 * x)
        assert torch.equal(a[slots].view(torch.uint8), want.view(torch.uint8))
