"""Features through every MHA path of AttentionBackend (EXTEND, DECODE, TARGET_VERIFY chain and
tree, DRAFT_EXTEND_V2): fp8 e4m3fn KV with per-layer k/v scales, attention sinks, logit
soft-cap and sliding windows, against the float64 oracle; plus hand-computed convention cases
(w = 1 sees only itself; window boundaries at w-1, w, w+1 keys; sinks as an unscaled extra
logit with no value; soft-cap c·tanh(s/c); fp8 stores x/scale and reads back q(x/scale)·scale)."""

import math

import attrs
import pytest
import torch

from aiter_attn import (AttentionBackend, BackendConfig, ForwardMode, LayerSpec,
                        SpecDecodeConfig, SpecInfo)
from aiter_attn.kernels.reference import quantize_to_cache
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.spec_cases import (full_verify_mask, random_tree_parents,
                                           tree_depths, tree_mask_from_parents,
                                           windowed_tree_masks)

FP8 = torch.float8_e4m3fn
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}
VERIFY, V2 = ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2


def _layers(hq, hkv, d, *, fp8=False, sinks=False, softcap=0.0, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = [(0.25, 0.5), (1.5, 0.75)]  # per-layer k/v scales
    return [
        LayerSpec(layer_id=i, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, logit_cap=softcap,
                  sliding_window=window,
                  sinks=(torch.randn(hq, generator=g) * 2) if sinks else None,
                  k_scale=scales[i][0] if fp8 else 1.0, v_scale=scales[i][1] if fp8 else 1.0)
        for i in range(2)
    ]


FEATURES = [
    pytest.param(dict(fp8=True), id="fp8-e4m3fn-scales"),
    pytest.param(dict(sinks=True), id="sinks"),
    pytest.param(dict(softcap=1.0), id="softcap1"),
    pytest.param(dict(window=5), id="window5"),
    pytest.param(dict(fp8=True, sinks=True, softcap=2.0, window=4), id="all"),
]


def _check_step(sc, be, mode, new_lens, dtype, *, spec=None, masks=None):
    """``masks``: for tree verify, ``layer -> per-request bool [n, L]`` with the layer's window
    already folded in at the tokens' path positions; the oracle then applies them literally
    (its own window would be at index order, wrong for a tree)."""
    batch = sc.next_batch(mode, new_lens, spec_info=spec)
    be.init_forward_metadata(batch)
    for layer in sc.layers:
        q, k, v = sc.step_inputs(layer)
        out = be.forward(q, k, v, layer, batch)
        if masks is None:
            want = sc.expected(layer, q)
        else:
            want = sc.expected(attrs.evolve(layer, sliding_window=None), q, masks=masks(layer),
                               causal=False)
        assert_close_rel(out, want, RTOL[dtype], f"{mode.name} layer {layer.layer_id}")
    sc.commit_step()


def _through_every_path(page_size, feat, dtype, hq=10, hkv=2, d=32, seed=0):
    n = 3
    cfg = BackendConfig(page_size=page_size, max_batch_size=8, max_context_len=256, dtype=dtype,
                        kv_cache_dtype=FP8 if feat.get("fp8") else dtype,
                        spec=SpecDecodeConfig(topk=1, num_draft_tokens=n))
    layers = _layers(hq, hkv, d, seed=seed, **feat)
    sc = PagedScenario.make(cfg, layers, [2, page_size + 3, 11], seed=seed + page_size)
    chain = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    tree_cfg = attrs.evolve(cfg, spec=SpecDecodeConfig(topk=2, num_draft_tokens=n))
    tree = AttentionBackend(tree_cfg, sc.req_pool, sc.kv_pool)
    _check_step(sc, chain, ForwardMode.EXTEND, [4, 1, 6], dtype)
    _check_step(sc, chain, ForwardMode.DECODE, [1, 1, 1], dtype)
    _check_step(sc, chain, VERIFY, [n] * 3, dtype, spec=SpecInfo(num_draft_tokens=n))
    g = torch.Generator().manual_seed(seed)
    parents = [random_tree_parents(n, g) for _ in range(3)]
    trees = [tree_mask_from_parents(p) for p in parents]
    prefixes = [sc.allocator.tokens_held(r) for r in sc.rows]
    masks = [full_verify_mask(t, p + n) for t, p in zip(trees, prefixes)]

    def path_masks(layer):
        # a draft token sits at prefix + its depth in the tree, not at prefix + its index
        return [windowed_tree_masks([p], [m], torch.tensor(tree_depths(par)),
                                    layer.sliding_window)[0]
                for p, m, par in zip(prefixes, masks, parents)]

    spec = SpecInfo(num_draft_tokens=n, topk=2, custom_mask=torch.stack(trees).reshape(-1))
    _check_step(sc, tree, VERIFY, [n] * 3, dtype, spec=spec, masks=path_masks)
    _check_step(sc, chain, ForwardMode.DRAFT_EXTEND, [2, 1, 3], dtype)
    _check_step(sc, chain, V2, [n] * 3, dtype, spec=SpecInfo(num_draft_tokens=n))


@pytest.mark.parametrize("feat", FEATURES)
def test_features_through_every_mha_path(feat):
    """EXTEND → DECODE → chain verify → tree verify → draft extend → draft extend v2, GQA 5:1,
    page size 7."""
    _through_every_path(7, feat, torch.float32)


def test_all_features_page1():
    _through_every_path(1, dict(fp8=True, sinks=True, softcap=2.0, window=4), torch.float32,
                        seed=1)


def test_all_features_page48_fp16_d80():
    _through_every_path(48, dict(fp8=True, sinks=True, softcap=2.0, window=4), torch.float16,
                        hq=5, hkv=1, d=80, seed=3)


# -- hand-computed convention cases --------------------------------------------------------------
MODES = [pytest.param(ForwardMode.EXTEND, 3, id="extend"),
         pytest.param(ForwardMode.DECODE, 1, id="decode"),
         pytest.param(VERIFY, 3, id="verify")]


def _as_stored(x, dtype, scale):
    """What the pool hands back for ``x``: quantised with ``scale`` and dequantised."""
    return quantize_to_cache(x, dtype, scale).float() * scale


def _custom_step(layer, prefix_len, mode, new_len, q, k, v, *, page_size=7,
                 kv_dtype=torch.float32):
    """Run one step with the given q/k/v ``[new_len, heads, dim]`` after a random prefix; return
    the output ``[new_len, Hq, Dv]`` and every key/value ``[L, Hkv, D]`` as the pool holds them."""
    cfg = BackendConfig(page_size=page_size, max_context_len=128, dtype=torch.float32,
                        kv_cache_dtype=kv_dtype, spec=SpecDecodeConfig(num_draft_tokens=new_len))
    sc = PagedScenario.make(cfg, [layer], [prefix_len], seed=prefix_len)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    spec = SpecInfo(num_draft_tokens=new_len) if mode == VERIFY else None
    batch = sc.next_batch(mode, [new_len], spec_info=spec)
    be.init_forward_metadata(batch)
    out = be.forward(q.reshape(new_len, -1), k.reshape(new_len, -1), v.reshape(new_len, -1),
                     layer, batch)
    keys = torch.cat([sc.dense_k[(0, 0)], _as_stored(k, kv_dtype, layer.k_scale)])
    vals = torch.cat([sc.dense_v[(0, 0)], _as_stored(v, kv_dtype, layer.v_scale)])
    return out.view(new_len, layer.num_q_heads, -1).double(), keys.double(), vals.double()


def _random_new(layer, n, seed=0, zero_q=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, layer.num_q_heads, layer.head_dim, generator=g)
    if zero_q:
        q.zero_()  # every logit 0: softmax weights are uniform over the visible keys
    k = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=g)
    v = torch.randn(n, layer.num_kv_heads, layer.head_dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("mode,n", MODES)
def test_window_one_sees_only_itself(mode, n):
    """HF sliding_window = 1: each query attends to its own key only, so out = its own v."""
    layer = LayerSpec(layer_id=0, num_q_heads=6, num_kv_heads=2, head_dim=16, sliding_window=1)
    q, k, v = _random_new(layer, n, seed=n)
    out, _, _ = _custom_step(layer, 9, mode, n, q, k, v)
    want = v.double().repeat_interleave(3, dim=1)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode,n", MODES)
@pytest.mark.parametrize("offset", [-1, 0, 1], ids=["w-1_keys", "w_keys", "w+1_keys"])
def test_window_boundary(mode, n, offset):
    """sliding_window = w with w-1, w and w+1 keys: with q = 0 the last query's output is the
    mean of the v's it sees: all of them for w-1 and w keys, all but the oldest for w+1."""
    w = 6
    total = w + offset
    layer = LayerSpec(layer_id=0, num_q_heads=5, num_kv_heads=1, head_dim=8, sliding_window=w)
    q, k, v = _random_new(layer, n, seed=total, zero_q=True)
    out, _, vals = _custom_step(layer, total - n, mode, n, q, k, v, page_size=5)
    visible = min(total, w)
    assert visible == (total if offset <= 0 else total - 1)
    want = vals[total - visible:].mean(dim=0)  # [Hkv, D]
    assert torch.allclose(out[-1], want.expand(5, -1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,n", MODES)
def test_sinks_are_an_unscaled_logit_without_value(mode, n):
    """q = 0: query at position p sees p+1 keys of logit 0 and the sink t_h (not scaled), so
    out_h = Σ_{j≤p} v_j / (p + 1 + e^{t_h})."""
    sinks = torch.tensor([-1.0, 0.0, 0.5, 2.0, 3.0, -2.0])
    layer = LayerSpec(layer_id=0, num_q_heads=6, num_kv_heads=2, head_dim=16, sinks=sinks,
                      scaling=7.0)
    q, k, v = _random_new(layer, n, seed=5, zero_q=True)
    prefix = 4
    out, _, vals = _custom_step(layer, prefix, mode, n, q, k, v)
    for i in range(n):
        p = prefix + i
        summed = vals[: p + 1].sum(dim=0).repeat_interleave(3, dim=0)  # [Hq, D]
        denom = (p + 1 + torch.exp(sinks.double())).unsqueeze(1)
        assert torch.allclose(out[i], summed / denom, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,n", MODES)
def test_softcap_hand_computed(mode, n):
    """Soft-cap c = 3 on logits s = 4·k₀ (q = [4, 0, 0, 0], scale 1): the query at position p
    weighs keys j ≤ p by softmax_j(c·tanh(s_j / c)); uncapped weights give another output."""
    layer = LayerSpec(layer_id=0, num_q_heads=1, num_kv_heads=1, head_dim=4, logit_cap=3.0,
                      scaling=1.0)
    g = torch.Generator().manual_seed(n)
    q = torch.zeros(n, 1, 4)
    q[:, 0, 0] = 4.0
    k, v = torch.randn(n, 1, 4, generator=g) * 2, torch.randn(n, 1, 4, generator=g)
    out, keys, vals = _custom_step(layer, 3, mode, n, q, k, v)
    L = keys.shape[0]
    for i in range(n):
        p = L - n + i
        s = 4.0 * keys[: p + 1, 0, 0]
        w = torch.softmax(3.0 * torch.tanh(s / 3.0), dim=0)
        assert torch.allclose(out[i, 0], (w.unsqueeze(1) * vals[: p + 1, 0]).sum(0),
                              rtol=1e-6, atol=1e-7)
    uncapped = (torch.softmax(4.0 * keys[:, 0, 0], 0).unsqueeze(1) * vals[:, 0]).sum(0)
    assert not torch.allclose(out[-1, 0], uncapped, rtol=1e-2)


def test_fp8_scale_convention():
    """e4m3fn with v_scale = 0.5 stores 0.3 / 0.5 = 0.6 → 0.625 (nearest e4m3) and reads back
    0.625 · 0.5 = 0.3125; k_scale likewise scales the keys before q·k."""
    layer = LayerSpec(layer_id=0, num_q_heads=1, num_kv_heads=1, head_dim=4, k_scale=0.5,
                      v_scale=0.5, scaling=1.0)
    assert float(torch.tensor(0.6).to(FP8).float()) == 0.625
    q = torch.tensor([[[1.0, 0, 0, 0]], [[1.0, 0, 0, 0]]])
    k = torch.tensor([[[0.3, 0, 0, 0]], [[0.0, 0, 0, 0]]])
    v = torch.tensor([[[0.3, 0, 0, 0]], [[1.0, 0, 0, 0]]])
    out, _, _ = _custom_step(layer, 0, ForwardMode.EXTEND, 2, q, k, v, kv_dtype=FP8)
    assert float(out[0, 0, 0]) == pytest.approx(0.3125, abs=1e-7)  # sees only key 0
    w0 = math.exp(0.3125) / (math.exp(0.3125) + 1.0)  # key 0 logit 1·0.3125, key 1 logit 0
    assert float(out[1, 0, 0]) == pytest.approx(w0 * 0.3125 + (1 - w0) * 1.0, abs=1e-6)
