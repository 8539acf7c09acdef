"""KV formats beyond fp8 e4m3 with one scale per layer (issue 16, item 4): fp8 **e5m2** caches on
the MHA and SWA paths (pools, quantising writes, attention reads; reference and Triton).

Every attention check compares with the float64 dense oracle over the *dequantised* cache
(``stored · scale``), on random data in block-permuted pools whose null page 0 is full of noise,
with odd shapes (head dim 80, page 48, GQA 5:1). The bounds are the query dtype's (float32 1e-5,
float16 2e-3), since the oracle sees exactly the values the cache holds: e5m2 → fp16 is exact.

Triton on the CPU interpreter: fp8 *loads* (and their casts up) are exact, so the attention
kernels run here on e5m2 caches; fp8 *stores* are not (the interpreter's float → fp8 cast rounds
half up and loses the carry into the exponent), so the Triton KV write quantises on the GPU only
(``test_triton_index_kv.py::test_gpu_writes_bytes_equal_reference[e5m2-*]`` and the ``gpu``
tests here); on the CPU the backend tests write with the reference.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec, ops
from aiter_attn.kernels.reference import paged_attention_reference, quantize_to_cache
from aiter_attn.testing import PagedScenario
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import DEVICE, HAS_CUDA, INTERPRET, requires_triton
from .test_swa import hybrid_layers, make_swa_scenario

E5M2 = torch.float8_e5m2
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
KERNELS = ["reference", pytest.param("triton", marks=requires_triton)]


# ----------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("scale", [1.0, 0.03, 7.5])
def test_e5m2_round_trip_bound(scale):
    """x → e5m2(x / scale) · scale: relative error ≤ 2⁻³ (half an ulp of a 2-bit mantissa) in
    the normal range, absolute ≤ 2⁻¹⁷ · scale (half the smallest subnormal) below it, and
    saturation at ±57344 · scale (never inf)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-6, 5, 4096) * scale
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1e9, -1e9]) * scale])
    q = quantize_to_cache(x, E5M2, scale)
    assert q.dtype == E5M2
    back = q.float() * scale
    assert torch.isfinite(back).all()
    fmax = torch.finfo(E5M2).max
    sat = torch.tensor(fmax) * scale  # float32, as the read computes it
    assert back[-2] == sat and back[-1] == -sat
    inside = (x.abs() / scale) <= fmax
    normal = inside & ((x.abs() / scale) >= torch.finfo(E5M2).tiny)
    err = (back - x).abs()
    assert (err[normal] <= 2.0 ** -3 * x[normal].abs() * (1 + 1e-6)).all()
    small = inside & ~normal
    assert (err[small] <= 2.0 ** -17 * scale * (1 + 1e-6)).all()


# ----------------------------------------------------------------------------- kernels

def _paged_case(q_lens, kv_lens, *, hq, hkv, d, page, dtype, k_scale, v_scale, seed):
    """A block-permuted e5m2 cache (null page 0 of noise) and the dense dequantised K/V."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-L // page) for L in kv_lens]
    total = 1 + sum(n_pages) + 3
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    kc = (torch.randn(total, page, hkv, d, generator=g) * 8).to(E5M2)
    vc = (torch.randn(total, page, hkv, d, generator=g) * 8).to(E5M2)
    bt = torch.zeros(len(q_lens), max(n_pages) + 2, dtype=torch.int32)
    dense = []
    for b, L in enumerate(kv_lens):
        pages = [perm.pop() for _ in range(n_pages[b])]
        bt[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = quantize_to_cache(torch.randn(L, hkv, d, generator=g), E5M2, k_scale)
        v = quantize_to_cache(torch.randn(L, hkv, d, generator=g), E5M2, v_scale)
        for i, p in enumerate(pages):
            kc[p, :min(page, L - i * page)] = k[i * page:(i + 1) * page]
            vc[p, :min(page, L - i * page)] = v[i * page:(i + 1) * page]
        dense.append((k.float() * k_scale, v.float() * v_scale))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    kw = dict(cu_seqlens_q=cu, seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
              block_table=bt, softmax_scale=d ** -0.5)
    return q, kc, vc, kw, dense


def _oracle(q, q_lens, dense, scale, **kw):
    from aiter_attn.testing.oracle import dense_attention

    outs, t = [], 0
    for (k, v), n in zip(dense, q_lens):
        outs.append(dense_attention(q[t:t + n], k, v, scale=scale, **kw))
        t += n
    return torch.cat(outs)


E5M2_SHAPES = [
    # id, q_lens, kv_lens, hq, hkv, d, page
    pytest.param([1, 1, 1], [97, 1, 48], 10, 2, 80, 48, id="decode-GQA5:1-D80-page48"),
    pytest.param([7, 1, 20], [30, 130, 20], 10, 2, 80, 16, id="mixed-GQA5:1-D80"),
    pytest.param([5, 3], [40, 3], 8, 2, 64, 1, id="extend-page1"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", E5M2_SHAPES)
def test_e5m2_paged_attention_vs_oracle(kernel, dtype, q_lens, kv_lens, hq, hkv, d, page):
    """``ops.paged_attention`` on an e5m2 cache with scalar k/v scales (float and tensor), with
    and without window + sinks + soft-cap, against the oracle over the dequantised cache."""
    q, kc, vc, kw, dense = _paged_case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page,
                                       dtype=dtype, k_scale=0.07, v_scale=0.3, seed=d + page)
    dev = DEVICE if kernel == "triton" else "cpu"
    to = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1))
    for extra, scales in (({}, (0.07, 0.3)),
                          (dict(window_size=(11, 0), softcap=5.0, sinks=sinks),
                           (torch.tensor(0.07), torch.tensor([0.3])))):
        ex = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in extra.items()}
        out = ops.paged_attention(q.to(dev), kc.to(dev), vc.to(dev), backend=kernel,
                                  k_scale=scales[0].to(dev) if torch.is_tensor(scales[0])
                                  else scales[0],
                                  v_scale=scales[1].to(dev) if torch.is_tensor(scales[1])
                                  else scales[1], **to, **ex)
        oracle_kw = dict(window=extra.get("window_size", (-1, -1)),
                         softcap=extra.get("softcap", 0.0), sinks=extra.get("sinks"))
        exp = _oracle(q, q_lens, dense, kw["softmax_scale"], **oracle_kw)
        assert_close_rel(out, exp, RTOL[dtype], f"{kernel} e5m2 {sorted(extra)}")


@requires_triton
def test_e5m2_triton_split_kv(monkeypatch):
    """The flash-decoding split path (partials + reduction) on an e5m2 cache."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", 3)
    q, kc, vc, kw, dense = _paged_case([1, 1, 2], [200, 9, 77], hq=10, hkv=2, d=80, page=48,
                                       dtype=torch.float16, k_scale=0.5, v_scale=0.25, seed=3)
    out = ops.paged_attention(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), backend="triton",
                              k_scale=0.5, v_scale=0.25,
                              **{k: (v.to(DEVICE) if torch.is_tensor(v) else v)
                                 for k, v in kw.items()})
    assert_close_rel(out, _oracle(q, [1, 1, 2], dense, kw["softmax_scale"]),
                     RTOL[torch.float16], "triton e5m2 split-KV")


# ----------------------------------------------------------------------------- backend

def _force(monkeypatch, kernel):
    """Force ``kernel`` for the attention ops; writes stay on the reference on the CPU
    (the interpreter's fp8 stores are not faithful), Triton on a GPU."""
    from aiter_attn.plugins import kernel_registry

    reg = kernel_registry()
    select = reg.select

    def forced(request, backend=None, **kw):
        if request.op == "paged_attention":
            return select(request, backend=kernel, **kw)
        if kernel == "triton" and DEVICE == "cuda":
            return select(request, backend="triton", **kw)
        return select(request, backend="reference", **kw)

    monkeypatch.setattr(reg, "select", forced)


def _mha_steps(sc, be, layers, dtype):
    for mode, lens in ((ForwardMode.EXTEND, [9, 1, 30]), (ForwardMode.DECODE, [1, 1, 1]),
                       (ForwardMode.EXTEND, [50, 2, 1])):
        batch = sc.next_batch(mode, lens)
        be.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = sc.step_inputs(layer)
            out = be.forward(q, k, v, layer, batch)
            assert_close_rel(out, sc.expected(layer, q), RTOL[dtype],
                             f"{mode.name} layer {layer.layer_id}")
        sc.commit_step()


@pytest.mark.parametrize("kernel", KERNELS)
def test_e5m2_mha_backend_writes_and_reads(monkeypatch, kernel):
    """AttentionBackend on an e5m2 MHA pool: prefix-cached extend, decode, chunked extend with
    sinks, soft-cap and a window; GQA 5:1, head dim 80, 48-token pages; each layer's own
    scales. The written cache is the reference quantisation (the oracle's dense copies)."""
    _force(monkeypatch, kernel)
    dtype = torch.float32 if DEVICE == "cpu" else torch.float16
    dev = DEVICE if kernel == "triton" else "cpu"
    g = torch.Generator().manual_seed(0)
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=80, logit_cap=3.0,
                        sliding_window=w, sinks=torch.randn(10, generator=g).to(dev),
                        k_scale=ks, v_scale=vs)
              for i, (w, ks, vs) in enumerate([(None, 0.25, 0.5), (40, 1.5, 0.75)])]
    cfg = BackendConfig(page_size=48, max_batch_size=4, max_context_len=256, dtype=dtype,
                        kv_cache_dtype=E5M2, device=dev)
    sc = PagedScenario.make(cfg, layers, [0, 48, 53], seed=7)
    _mha_steps(sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool), layers, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
def test_e5m2_swa_backend_writes_and_reads(monkeypatch, kernel):
    """The hybrid SWA pool in e5m2: full layers and windowed layers (written through the
    full→SWA translation), sinks and soft-cap, GQA 5:1, head dim 80."""
    _force(monkeypatch, kernel)
    dev = DEVICE if kernel == "triton" else "cpu"
    dtype = torch.float32 if dev == "cpu" else torch.float16
    cfg = BackendConfig(page_size=6, max_context_len=128, dtype=dtype, kv_cache_dtype=E5M2,
                        arch="swa", device=dev)
    sinks = torch.linspace(-1.0, 2.0, 10).to(dev)
    layers = hybrid_layers(10, 2, 80, [5, None, 13], logit_cap=20.0, sinks=sinks, k_scale=0.5,
                           v_scale=0.25)
    sc = make_swa_scenario(cfg, layers, [7, 0, 13], seed=5)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    for mode, lens in (("extend", [3, 6, 2]), ("decode", [1, 1, 1]), ("extend", [8, 1, 7])):
        batch = sc.next_batch(mode, lens)
        be.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = sc.step_inputs(layer)
            out = be.forward(q, k, v, layer, batch)
            assert_close_rel(out, sc.expected(layer, q), RTOL[dtype],
                             f"{mode} layer {layer.layer_id} (window {layer.sliding_window})")
        sc.commit_step()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_e5m2_backend_triton_writes(monkeypatch, dtype):
    """On the GPU everything is Triton, the quantising write included: its bytes must be the
    reference's (the oracle's dense copies are the reference quantisation)."""
    _force(monkeypatch, "triton")
    g = torch.Generator().manual_seed(1)
    layers = [LayerSpec(layer_id=i, num_q_heads=40, num_kv_heads=8, head_dim=128,
                        sinks=torch.randn(40, generator=g).cuda(), sliding_window=w,
                        k_scale=0.05, v_scale=0.2) for i, w in enumerate([None, 300])]
    cfg = BackendConfig(page_size=48, max_batch_size=8, max_context_len=2048, dtype=dtype,
                        kv_cache_dtype=E5M2, device="cuda")
    sc = PagedScenario.make(cfg, layers, [0, 480, 1000], seed=9)
    _mha_steps(sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool), layers, dtype)

