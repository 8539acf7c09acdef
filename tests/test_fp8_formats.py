"""KV formats beyond fp8 e4m3 with one scale per layer (issue 16, item 4): fp8 **e5m2** caches on
the MHA and SWA paths (pools, quantising writes, attention reads; reference and Triton; the 5-D
and MLA kernels too), and **per-(token, head) scales** (``kv_scale_granularity=
"per_token_head"``, :mod:`aiter_attn.kv_scales`) on the MHA and SWA paths.

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


@requires_triton
@pytest.mark.parametrize("kernel", ["reference", "triton"])
def test_e5m2_5d_layout(kernel):
    """The 5-D vectorised layout (x = 16 one-byte elements per vector) on an e5m2 cache, both
    value layouts, against the oracle over the dequantised cache."""
    from aiter_attn.kernels.reference_5d import paged_attention_5d_reference

    from .test_triton_5d import _run_5d
    from .test_triton_paged_attention import Case

    case = Case([1, 6], [90, 40], hq=10, hkv=2, d=80, page=16, dtype=torch.float16,
                kv_dtype=E5M2, k_scale=0.05, v_scale=0.25, seed=11)
    scales = dict(k_scale=torch.tensor([0.05], device=case.device),
                  v_scale=torch.tensor([0.25], device=case.device))
    for shuffled in (True, False):
        out = _run_5d(case, v_shuffled=shuffled,
                      kernel=paged_attention_5d_reference if kernel == "reference" else None,
                      **(scales if kernel == "triton" else {k: v.cpu() for k, v in scales.items()}))
        assert_close_rel(out, case.expected(), RTOL[torch.float16],
                         f"5-D e5m2 {kernel} shuffled={shuffled}")


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_e5m2_mla_latent_cache(dtype):
    """MLA's latent cache in e5m2 (absorbed form): Triton and the reference against the
    oracle over the dequantised latent, decode and verify rows, 64-token pages."""
    from aiter_attn.kernels.reference import mla_paged_attention_reference

    from .test_triton_mla import RTOL as MLA_RTOL
    from .test_triton_mla import MLACase

    case = MLACase([1, 3, 1], [70, 21, 130], page=64, dtype=dtype, kv_dtype=E5M2,
                   kv_scale=0.05, seed=9)
    assert_close_rel(case.run(), case.expected(), MLA_RTOL[dtype], "triton MLA e5m2")
    ref = torch.empty(case.q.shape[0], case.heads, case.rank, dtype=dtype)
    mla_paged_attention_reference(case.q, case.kv_cache, ref, **case.kwargs("cpu"))
    assert_close_rel(ref, case.expected(), MLA_RTOL[dtype], "reference MLA e5m2")


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



# =============================================================================================
# per-(token, head) scales (kv_scale_granularity="per_token_head")
# =============================================================================================

E4M3 = torch.float8_e4m3fn
FORMATS = [pytest.param(E4M3, id="e4m3fn"), pytest.param(E5M2, id="e5m2")]


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _byte_diff(name, ref, got) -> str:
    """How many elements of ``got`` differ bytewise from ``ref`` and the first few (index,
    both values as float32 and raw), for a failure message that says what went wrong."""
    diff = (_raw(ref) != _raw(got)).nonzero()
    lines = [f"{name}: {diff.shape[0]} of {ref.numel()} Triton values differ bytewise from "
             "the reference"]
    for idx in diff[:4].tolist():
        r, g = ref[tuple(idx)], got[tuple(idx)]
        lines.append(f"  at {idx}: reference {float(r.float()):.9g} ({int(_raw(r.reshape(1))[0])})"
                     f", Triton {float(g.float()):.9g} ({int(_raw(g.reshape(1))[0])})")
    return "\n".join(lines)


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("layer", [1.0, 0.25, 3.0])
def test_token_head_round_trip_bound(fp8, layer):
    """Each (token, head) vector quantised with ``s = amax / (fp8_max · layer)``: its largest
    element lands on ±fp8_max, every element is within half an ulp (relative 2⁻⁴ e4m3 / 2⁻³
    e5m2) or half a subnormal step (× s · layer) of the input; an all-zero vector gets s = 1
    and stays zero. Across tokens of very different magnitude the per-token error (relative
    to each vector's amax) beats one scale per layer by orders of magnitude."""
    from aiter_attn.kernels.reference import quantize_per_token_head

    g = torch.Generator().manual_seed(2)
    T, H, D = 64, 3, 80
    x = torch.randn(T, H, D, generator=g) * torch.logspace(-8, 4, T).view(T, 1, 1)
    x[5, 1] = 0.0
    q, s = quantize_per_token_head(x, fp8, layer)
    assert q.dtype == fp8 and s.dtype == torch.float32 and s.shape == (T, H)
    fin = torch.finfo(fp8)
    amax = x.abs().amax(-1)
    want = amax / (torch.tensor(fin.max) * torch.tensor(layer))
    want[5, 1] = 1.0
    assert torch.equal(s, want)
    back = q.float() * (s * layer).unsqueeze(-1)
    assert torch.equal(q[5, 1].float(), torch.zeros(D))
    mant = {E4M3: 3, E5M2: 2}[fp8]  # mantissa bits
    half_ulp = 2.0 ** -(mant + 1)
    sub = fin.smallest_normal * 2.0 ** -(mant + 1)  # half a subnormal step
    bound = half_ulp * x.abs() + sub * (s * layer).unsqueeze(-1)
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all()
    top = q.float().abs().amax(-1)
    assert torch.equal(top[amax > 0], torch.full_like(top[amax > 0], fin.max))
    # one scale per layer (the max over everything) loses the small tokens
    per_layer = quantize_to_cache(x, fp8, float(amax.max()) / fin.max).float() * (
        float(amax.max()) / fin.max)
    rel_tok = ((back - x).abs().amax(-1) / amax.clamp_min(1e-30))[amax > 0].max()
    rel_layer = ((per_layer - x).abs().amax(-1) / amax.clamp_min(1e-30))[amax > 0].max()
    assert rel_tok <= half_ulp * (1 + 1e-5)
    assert rel_layer > 0.5  # the smallest tokens flush to zero under one scale per layer


def _exact_vectors(fp8, T, H, D, g, layer=1.0):
    """Vectors whose per-token quantisation is exact (grid values × a power of two, the
    largest at fp8_max): the interpreter's float→fp8 cast, which rounds unfaithfully, then
    has nothing to round, so Triton's bytes can be compared with the reference's on the CPU."""
    fmax = torch.finfo(fp8).max
    base = (torch.randn(T, H, D, generator=g) * fmax / 8).to(fp8).float()
    base[..., 0] = fmax * torch.sign(torch.randn(T, H, generator=g)).clamp_min(0).mul(2).sub(1)
    c = 2.0 ** torch.randint(-8, 4, (T, H, 1), generator=g).float()
    return base * c * layer


def _write_pair(writer, fp8, translated, layer, seed, device="cpu"):
    """Random caches and scale buffers (the null page too), exact vectors, slots with padding
    (negative) rows; returns ``(before, after, slots, table)`` after ``writer`` ran (CPU
    copies)."""
    g = torch.Generator().manual_seed(seed)
    P, S, H, D = 6, 5, 2, 80
    k = _exact_vectors(fp8, 9, H, D, g, layer)
    v = _exact_vectors(fp8, 9, H, D, g, layer)
    v[3, 0] = 0.0  # an all-zero vector: scale 1, zeros stored
    slots = torch.tensor([7, -1, 12, 26, -1, 5, 29, 1, -3])
    raw = torch.randint(0, 100, (2, P, S, H, D), generator=g, dtype=torch.uint8)
    before = [raw[0].view(fp8), raw[1].view(fp8), *(torch.rand(2, P, S, H, generator=g) + 0.5)]
    kw = dict(k_scale=layer, v_scale=torch.tensor([layer], device=device))
    table = None
    if translated:
        table = torch.randperm(P * S, generator=g)
        table[12] = -1  # a full slot without an SWA slot: skipped too
        kw["full_to_swa"] = table.to(device)
    bufs = [t.clone().to(device) for t in before]
    writer(bufs[0], bufs[1], slots.to(device), k.to(device), v.to(device),
           k_scale_cache=bufs[2], v_scale_cache=bufs[3], **kw)
    return before, [b.cpu() for b in bufs], slots, table, k


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("translated", [False, True], ids=["nhd", "swa"])
@pytest.mark.parametrize("writer", ["reference", pytest.param("triton", marks=requires_triton)])
def test_token_head_write_stores_scales_and_skips_other_slots(fp8, translated, writer):
    """The quantising write stores each (token, head) vector and its scale at the token's slot
    (through the full→SWA table for the SWA pool); negative slots and negative translations are
    skipped; every other slot of the caches and of the scale buffers is byte-identical; the
    stored vectors dequantise back to the inputs (exactly representable data). The Triton
    write equals the reference byte for byte (on the CPU with exact data;
    ``test_gpu_token_head_write_bytes_equal_reference`` rounds random data on the GPU)."""
    from aiter_attn.kernels import reference as R
    from aiter_attn.kernels.reference_extra import write_kv_translated_reference

    ref_fn = write_kv_translated_reference if translated else R.write_kv_reference
    fn, dev = ref_fn, "cpu"
    if writer == "triton":
        from aiter_attn.kernels.triton.kv_write import write_kv, write_kv_translated

        fn, dev = (write_kv_translated if translated else write_kv), DEVICE
    for layer in (1.0, 0.5):
        seed = int(layer * 10) + translated
        before, ref, slots, table, k = _write_pair(ref_fn, fp8, translated, layer, seed)
        _, got, _, _, _ = _write_pair(fn, fp8, translated, layer, seed, dev)
        names = ("k", "v", "k_scales", "v_scales")
        for name, a, b in zip(names, ref, got):
            assert torch.equal(_raw(a), _raw(b)), f"{writer} {name}: differs from the reference"
        dst = slots.clone()
        if table is not None:
            dst = torch.where(slots >= 0, table[slots.clamp_min(0)], slots)
        live = set(dst[dst >= 0].tolist())
        for name, a, b in zip(names, before, got):
            fa, fb = _raw(a).reshape(30, -1), _raw(b).reshape(30, -1)
            changed = set((fa != fb).any(1).nonzero().flatten().tolist())
            assert changed <= live, f"{writer} {name}: wrote slots {changed - live}"
        src = dst >= 0
        ks = got[2].view(30, 2)[dst[src]]
        deq = got[0].view(30, 2, 80)[dst[src]].float() * (ks * layer).unsqueeze(-1)
        assert torch.equal(deq, k[src]), f"{writer}: stored K does not dequantise to the input"


def _token_case(q_lens, kv_lens, *, fp8, hq, hkv, d, page, dtype, layer=(1.0, 1.0), seed=0):
    """Block-permuted fp8 caches with per-(token, head) scale buffers (null page 0 and every
    unused slot full of noise, scales included), K/V of magnitudes spread over 10⁴ across
    tokens, quantised per (token, head) on top of the layer scales ``layer``; the dense
    dequantised K/V per request."""
    from aiter_attn.kernels.reference import quantize_per_token_head

    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-L // page) for L in kv_lens]
    total = 1 + sum(n_pages) + 3
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    kc = (torch.randn(total, page, hkv, d, generator=g) * 8).to(fp8)
    vc = (torch.randn(total, page, hkv, d, generator=g) * 8).to(fp8)
    ksc = torch.rand(total, page, hkv, generator=g) * 3
    vsc = torch.rand(total, page, hkv, generator=g) * 3
    bt = torch.zeros(len(q_lens), max(n_pages) + 2, dtype=torch.int32)
    dense = []
    for b, L in enumerate(kv_lens):
        pages = [perm.pop() for _ in range(n_pages[b])]
        bt[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        mag = torch.logspace(-2, 2, L)[torch.randperm(L, generator=g)].view(L, 1, 1)
        kq, ks = quantize_per_token_head(torch.randn(L, hkv, d, generator=g) * mag, fp8, layer[0])
        vq, vs = quantize_per_token_head(torch.randn(L, hkv, d, generator=g) * mag, fp8, layer[1])
        for i, p in enumerate(pages):
            n = min(page, L - i * page)
            sl = slice(i * page, i * page + n)
            kc[p, :n], vc[p, :n], ksc[p, :n], vsc[p, :n] = kq[sl], vq[sl], ks[sl], vs[sl]
        dense.append((kq.float() * ks.unsqueeze(-1) * layer[0],
                      vq.float() * vs.unsqueeze(-1) * layer[1]))
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    kw = dict(cu_seqlens_q=cu, seqused_k=torch.tensor(kv_lens, dtype=torch.int32),
              block_table=bt, softmax_scale=d ** -0.5, k_scale=layer[0], v_scale=layer[1],
              k_scale_cache=ksc, v_scale_cache=vsc)
    return q, kc, vc, kw, dense


def _attn_fn(kernel):
    if kernel == "triton":
        from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton
    return paged_attention_reference


TOKEN_SHAPES = [
    pytest.param([1, 1, 1], [97, 1, 48], 10, 2, 80, 48, id="decode-GQA5:1-D80-page48"),
    pytest.param([7, 1, 20], [30, 130, 20], 10, 2, 80, 16, id="mixed-GQA5:1-D80"),
    pytest.param([5, 3], [40, 3], 8, 2, 64, 1, id="extend-page1"),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", TOKEN_SHAPES)
def test_token_head_attention_vs_oracle(kernel, fp8, q_lens, kv_lens, hq, hkv, d, page):
    """Paged attention (reference, Triton) dequantising each key and value with its slot's
    per-(token, head) scale and the layer scales on top, against the float64 oracle over the
    dequantised cache; plain, and with window + sinks + soft-cap; float32 and float16 queries."""
    dev = DEVICE if kernel == "triton" else "cpu"
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(1))
    for dtype, layer in ((torch.float32, (1.0, 1.0)), (torch.float16, (0.5, 2.0))):
        q, kc, vc, kw, dense = _token_case(q_lens, kv_lens, fp8=fp8, hq=hq, hkv=hkv, d=d,
                                           page=page, dtype=dtype, layer=layer, seed=d + page)
        for extra in ({}, dict(window_size=(11, 0), softcap=5.0, sinks=sinks)):
            out = torch.full((q.shape[0], hq, d), float("nan"), dtype=dtype, device=dev)
            args = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in {**kw, **extra}.items()}
            _attn_fn(kernel)(q.to(dev), kc.to(dev), vc.to(dev), out, **args)
            exp = _oracle(q, q_lens, dense, kw["softmax_scale"],
                          window=extra.get("window_size", (-1, -1)),
                          softcap=extra.get("softcap", 0.0), sinks=extra.get("sinks"))
            assert_close_rel(out, exp, RTOL[dtype], f"{kernel} {dtype} layer {layer} {sorted(extra)}")


@requires_triton
@pytest.mark.parametrize("splits", [2, 5])
def test_token_head_triton_split_kv_and_chunked_pages(monkeypatch, splits):
    """Per-token scales through the split path (partials + reduction) and the chunked page
    lookup (PAGE_CHUNK), where tiles take their pages from a preloaded chunk."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", splits)
    monkeypatch.setitem(mod.TUNING_OVERRIDES, "page_chunk", 2)
    q, kc, vc, kw, dense = _token_case([1, 1, 3], [200, 9, 77], fp8=E4M3, hq=8, hkv=2, d=32,
                                       page=16, dtype=torch.float16, layer=(0.5, 0.25),
                                       seed=splits)
    out = torch.empty(q.shape[0], 8, 32, dtype=torch.float16, device=DEVICE)
    _attn_fn("triton")(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), out,
                       **{k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in kw.items()})
    assert_close_rel(out, _oracle(q, [1, 1, 3], dense, kw["softmax_scale"]),
                     RTOL[torch.float16], f"triton per-token scales, {splits} splits")


def test_token_head_scales_are_applied():
    """Doubling one key's stored scale changes the output (the kernels read them), and scales
    on page 0 / unused slots (noise) do not (the kernels read only the request's slots)."""
    q, kc, vc, kw, dense = _token_case([1], [30], fp8=E4M3, hq=2, hkv=1, d=16, page=4,
                                       dtype=torch.float32)
    out = torch.empty(1, 2, 16)
    paged_attention_reference(q, kc, vc, out, **kw)
    page = int(kw["block_table"][0, 0])
    kw["k_scale_cache"][0].mul_(7.0)  # the null page
    again = torch.empty(1, 2, 16)
    paged_attention_reference(q, kc, vc, again, **kw)
    assert torch.equal(out, again)
    kw["v_scale_cache"][page, 1, 0] *= 2
    paged_attention_reference(q, kc, vc, again, **kw)
    assert not torch.allclose(out, again)


@requires_triton
def test_token_head_batch_invariant_triton():
    """Batch-invariant launches (fixed splits, ordered reduction) with per-token scales: the
    oracle's result, and a request's bits do not depend on the rest of the batch."""
    q, kc, vc, kw, dense = _token_case([1, 1, 4], [700, 9, 77], fp8=E4M3, hq=10, hkv=2, d=80,
                                       page=48, dtype=torch.float32, layer=(0.5, 2.0), seed=4)
    dev = DEVICE
    args = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}
    out = torch.empty(q.shape[0], 10, 80, device=dev)
    fn = _attn_fn("triton")
    fn(q.to(dev), kc.to(dev), vc.to(dev), out, batch_invariant=True, **args)
    assert_close_rel(out, _oracle(q, [1, 1, 4], dense, kw["softmax_scale"]), 1e-5, "batch inv.")
    alone = torch.empty(1, 10, 80, device=dev)
    one = dict(args, cu_seqlens_q=args["cu_seqlens_q"][:2], seqused_k=args["seqused_k"][:1],
               block_table=args["block_table"][:1])
    fn(q[:1].to(dev), kc.to(dev), vc.to(dev), alone, batch_invariant=True, **one)
    assert torch.equal(alone[0], out[0])


def test_token_head_debug_checks_backend():
    """The checked mode (``debug_checks=True``) wraps the per-token writes and attention and
    passes the scale buffers through."""
    cfg = BackendConfig(page_size=4, max_context_len=64, dtype=torch.float32,
                        kv_cache_dtype=E4M3, kv_scale_granularity="per_token_head",
                        debug_checks=True)
    layer = LayerSpec(layer_id=0, num_q_heads=4, num_kv_heads=2, head_dim=16)
    sc = _token_mha_scenario(cfg, [layer], [5, 0], seed=2)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _token_steps(sc, be, [layer], torch.float32, [("extend", [3, 4]), ("decode", [1, 1])])


# ----------------------------------------------------------------------------- backend

class TokenScaleScenario(PagedScenario):
    """:class:`PagedScenario` whose dense copies are the per-(token, head) round trip (each
    token's quantisation depends on its own vector only, so the oracle can redo it)."""

    @staticmethod
    def _roundtrip(x, dtype, scale):
        from aiter_attn.kernels.reference import quantize_per_token_head

        q, s = quantize_per_token_head(x, dtype, scale)
        return q.float() * s.unsqueeze(-1) * scale


def _write_prefix_token_scales(pool, layer, slots, k, v):
    """The prefix through the reference write with the pool's scale buffers (SWA layers at
    their translated slots)."""
    from aiter_attn.kernels.reference import write_kv_reference

    if hasattr(pool, "is_swa_layer") and pool.is_swa_layer(layer.layer_id):
        slots = pool.translate(slots)
    kc, vc = pool.kv_buffers(layer.layer_id)
    ksc, vsc = pool.scale_buffers(layer.layer_id)
    dev = kc.device
    write_kv_reference(kc, vc, slots.to(dev), k.to(dev), v.to(dev), k_scale=layer.k_scale,
                       v_scale=layer.v_scale, k_scale_cache=ksc, v_scale_cache=vsc)


def _noise(bufs, g):
    for b in bufs:
        b.copy_((torch.rand(b.shape, generator=g) * 3 if b.dtype == torch.float32
                 else torch.randn(b.shape, generator=g)).to(b.dtype))


def _token_mha_scenario(cfg, layers, prefixes, seed):
    from aiter_attn.kvcache import MHAKVPool, PageAllocator

    g = torch.Generator().manual_seed(seed)
    n = 2 * PagedScenario.pages_needed(prefixes, cfg.page_size)
    l0 = layers[0]
    pool = MHAKVPool(n, cfg.page_size, l0.num_kv_heads, l0.head_dim, len(layers),
                     dtype=cfg.kv_cache_dtype, device=cfg.device,
                     kv_scale_granularity="per_token_head")
    _noise(pool.k_buffers + pool.v_buffers + pool.k_scale_buffers + pool.v_scale_buffers, g)
    alloc = PageAllocator(n, cfg.page_size, shuffle_seed=seed + 1)
    return TokenScaleScenario.from_pool(cfg, layers, pool, alloc, prefixes, generator=g,
                                        write_prefix=_write_prefix_token_scales)


def _pool_bytes(pool):
    subs = [pool.full, pool.swa] if hasattr(pool, "full") else [pool]
    return [_raw(t).clone() for p in subs for t in
            p.k_buffers + p.v_buffers + p.k_scale_buffers + p.v_scale_buffers]


def _token_steps(sc, be, layers, dtype, steps):
    for mode, lens in steps:
        batch = sc.next_batch(mode, lens)
        be.init_forward_metadata(batch)
        before = _pool_bytes(sc.kv_pool)
        for layer in layers:
            q, k, v = sc.step_inputs(layer)
            out = be.forward(q, k, v, layer, batch)
            assert_close_rel(out, sc.expected(layer, q), RTOL[dtype],
                             f"{mode} layer {layer.layer_id} (window {layer.sliding_window})")
        # the step wrote its own slots only (SWA pools: their translated slots)
        pool = sc.kv_pool
        full = set(batch.out_cache_loc.tolist())
        allowed = full
        after = _pool_bytes(pool)
        n_full = 0
        if hasattr(pool, "full"):
            n_full = len(_pool_bytes(pool.full))
            swa = set(pool.translate(batch.out_cache_loc).tolist())
        for i, (a, b) in enumerate(zip(before, after)):
            ok = swa if (n_full and i >= n_full) else allowed
            changed = (a.reshape(a.shape[0] * a.shape[1], -1)
                       != b.reshape(b.shape[0] * b.shape[1], -1)).any(1)
            assert set(changed.nonzero().flatten().tolist()) <= ok, f"{mode}: foreign slot written"
        sc.commit_step()


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_token_head_mha_backend(monkeypatch, kernel, fp8):
    """AttentionBackend with ``kv_scale_granularity="per_token_head"`` on an MHA pool:
    prefix-cached extend, decode, chunked extend; sinks, soft-cap, a window, layer scales on
    top; GQA 5:1, head dim 80, 48-token pages; writes touch only the step's slots (caches
    and scale buffers)."""
    _force(monkeypatch, kernel)
    dev = DEVICE if kernel == "triton" else "cpu"
    dtype = torch.float32 if dev == "cpu" else torch.float16
    g = torch.Generator().manual_seed(0)
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=80, logit_cap=3.0,
                        sliding_window=w, sinks=torch.randn(10, generator=g).to(dev),
                        k_scale=ks, v_scale=vs)
              for i, (w, ks, vs) in enumerate([(None, 1.0, 1.0), (40, 0.5, 2.0)])]
    cfg = BackendConfig(page_size=48, max_batch_size=4, max_context_len=256, dtype=dtype,
                        kv_cache_dtype=fp8, device=dev, kv_scale_granularity="per_token_head")
    sc = _token_mha_scenario(cfg, layers, [0, 48, 53], seed=7)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    _token_steps(sc, be, layers, dtype, [(ForwardMode.EXTEND, [9, 1, 30]),
                                         (ForwardMode.DECODE, [1, 1, 1]),
                                         (ForwardMode.EXTEND, [50, 2, 1])])


@pytest.mark.parametrize("kernel", KERNELS)
def test_token_head_swa_backend(monkeypatch, kernel):
    """The hybrid SWA pool with per-(token, head) scales in both sub-pools: windowed layers
    write through the full→SWA translation (scales included) and read their own scales."""
    from aiter_attn import SWAKVPool, SWAPageAllocator

    _force(monkeypatch, kernel)
    dev = DEVICE if kernel == "triton" else "cpu"
    dtype = torch.float32 if dev == "cpu" else torch.float16
    cfg = BackendConfig(page_size=6, max_context_len=128, dtype=dtype, kv_cache_dtype=E4M3,
                        arch="swa", device=dev, kv_scale_granularity="per_token_head")
    layers = hybrid_layers(10, 2, 80, [5, None, 13], logit_cap=20.0,
                           sinks=torch.linspace(-1.0, 2.0, 10).to(dev), k_scale=0.5,
                           v_scale=0.25)
    g = torch.Generator().manual_seed(5)
    prefixes = [7, 0, 13]
    need = 2 * PagedScenario.pages_needed(prefixes, 6)
    pool = SWAKVPool.create(num_full_pages=need, num_swa_pages=need, page_size=6,
                            num_kv_heads=2, head_dim=80, layer_is_swa=[True, False, True],
                            dtype=E4M3, device=dev, kv_scale_granularity="per_token_head")
    for sub in (pool.full, pool.swa):
        _noise(sub.k_buffers + sub.v_buffers + sub.k_scale_buffers + sub.v_scale_buffers, g)
    alloc = SWAPageAllocator(pool, shuffle_seed=6)
    sc = TokenScaleScenario.from_pool(cfg, layers, pool, alloc, prefixes, generator=g,
                                      write_prefix=_write_prefix_token_scales)
    be = AttentionBackend(cfg, sc.req_pool, pool)
    _token_steps(sc, be, layers, dtype, [("extend", [3, 6, 2]), ("decode", [1, 1, 1]),
                                         ("extend", [8, 1, 7])])


# ----------------------------------------------------------------------------- checks

def test_token_head_config_and_pool_checks():
    """Refused before any kernel runs, each with the argument, the value and the fix."""
    from aiter_attn import MHAKVPool, ReqToTokenPool, SWAKVPool

    with pytest.raises(ValueError, match="kv_scale_granularity='per_token'.*allowed"):
        BackendConfig(kv_cache_dtype=E4M3, kv_scale_granularity="per_token")
    with pytest.raises(ValueError, match="fp8 caches only"):
        BackendConfig(kv_scale_granularity="per_token_head")  # fp16 cache
    for arch in ("mla", "vec5d"):
        with pytest.raises(ValueError, match="MHA and SWA architectures"):
            BackendConfig(kv_cache_dtype=E4M3, arch=arch, kv_scale_granularity="per_token_head")
    with pytest.raises(ValueError, match="MHAKVPool.kv_scale_granularity.*fp8 caches only"):
        MHAKVPool(4, 4, 1, 16, 1, dtype=torch.bfloat16, kv_scale_granularity="per_token_head")
    with pytest.raises(ValueError, match="fp8 caches only"):
        SWAKVPool.create(num_full_pages=4, num_swa_pages=4, page_size=4, num_kv_heads=1,
                         head_dim=16, layer_is_swa=[True], kv_scale_granularity="per_token_head")
    per_tok = BackendConfig(page_size=4, kv_cache_dtype=E4M3, kv_scale_granularity="per_token_head")
    plain = MHAKVPool(4, 4, 1, 16, 1, dtype=E4M3)
    assert plain.scale_buffers(0) is None
    with pytest.raises(ValueError, match="has kv_scale_granularity='per_layer' but "
                                         "BackendConfig.kv_scale_granularity='per_token_head'"):
        AttentionBackend(per_tok, ReqToTokenPool(4, 16), plain)
    pool = MHAKVPool(4, 4, 1, 16, 1, dtype=E4M3, kv_scale_granularity="per_token_head")
    ks, vs = pool.scale_buffers(0)
    assert ks.shape == (4, 4, 1) and ks.dtype == torch.float32 and ks is not vs
    with pytest.raises(ValueError, match="has kv_scale_granularity='per_token_head' but"):
        AttentionBackend(BackendConfig(page_size=4, kv_cache_dtype=E4M3),
                         ReqToTokenPool(4, 16), pool)


@pytest.mark.parametrize("kernel", KERNELS)
def test_token_head_kernel_argument_checks(kernel):
    """Scale caches on a float cache, of the wrong shape or dtype, or only one of the two:
    a clear error from the attention kernels and the writes, nothing launched."""
    dev = DEVICE if kernel == "triton" else "cpu"
    q, kc, vc, kw, _ = _token_case([1], [9], fp8=E4M3, hq=2, hkv=1, d=16, page=4,
                                   dtype=torch.float32)
    kw = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}
    q, kc, vc = q.to(dev), kc.to(dev), vc.to(dev)
    out = torch.zeros(1, 2, 16, device=dev)
    fn = _attn_fn(kernel)
    with pytest.raises(ValueError, match="fp8 caches only"):
        fn(q, kc.float(), vc.float(), out, **kw)
    with pytest.raises(ValueError, match=r"k_scale_cache is torch.float32 \(4, 4\); expected "
                                         r"float32 \(7, 4, 1\)"):
        fn(q, kc, vc, out, **{**kw, "k_scale_cache": kw["k_scale_cache"][:4, :, 0]})
    with pytest.raises(ValueError, match="v_scale_cache is torch.float16"):
        fn(q, kc, vc, out, **{**kw, "v_scale_cache": kw["v_scale_cache"].half()})
    with pytest.raises(ValueError, match="go together"):
        fn(q, kc, vc, out, **{**kw, "v_scale_cache": None})
    assert torch.equal(out, torch.zeros_like(out))
    if kernel == "triton":
        from aiter_attn.kernels.triton.kv_write import write_kv as writer
    else:
        from aiter_attn.kernels.reference import write_kv_reference as writer
    k = torch.randn(2, 1, 16, device=dev)
    slots = torch.tensor([5, 6], device=dev)
    with pytest.raises(ValueError, match="fp8 caches only"):
        writer(kc.float(), vc.float(), slots, k, k, k_scale_cache=kw["k_scale_cache"],
               v_scale_cache=kw["v_scale_cache"])


def test_token_head_feature_selects_only_kernels_that_declare_it():
    """The feature travels in the kernel request: the 5-D layout's kernels (and any plugin
    that does not declare ``kv_scale_per_token_head``) are passed over with that reason."""
    from aiter_attn.kernels.registry import KernelRequest, KernelSelectionError
    from aiter_attn.kv_scales import TOKEN_SCALE_FEATURE
    from aiter_attn.plugins import kernel_registry

    reg = kernel_registry()
    for op in ("paged_attention", "write_kv", "write_kv_swa"):
        req = KernelRequest(op=op, device="cpu", dtype=torch.float32, kv_dtype=E4M3,
                            head_dim=16, v_head_dim=16, page_size=4,
                            features={"fp8", TOKEN_SCALE_FEATURE},
                            extra=(("q_heads", 2), ("kv_heads", 1)))
        assert reg.select(req, backend="reference").impl.name == "reference"
    req = KernelRequest(op="paged_attention_5d", device="cpu", dtype=torch.float32,
                        kv_dtype=E4M3, head_dim=16, v_head_dim=16, page_size=16,
                        features={"fp8", TOKEN_SCALE_FEATURE})
    with pytest.raises(KernelSelectionError, match=TOKEN_SCALE_FEATURE):
        reg.select(req)


# ----------------------------------------------------------------------------- graphs

def _token_graph_run(dev, use_cuda_graph, dtype):
    """Decode steps replayed through CudaGraphManager (captured at 2 and 8) on a per-token
    pool, each checked against the oracle; returns the backend and the pool."""
    from aiter_attn.graph import CudaGraphManager

    cfg = BackendConfig(page_size=48, max_batch_size=8, max_context_len=256, dtype=dtype,
                        kv_cache_dtype=E4M3, device=dev, kv_scale_granularity="per_token_head")
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=80,
                        k_scale=0.5 * (i + 1)) for i in range(2)]
    sc = _token_mha_scenario(cfg, layers, [0, 48, 51, 101, 7], seed=5)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    tokens = {f"{t}{l.layer_id}": ((800 if t == "q" else 160,), dtype)
              for l in layers for t in "qkv"}
    mgr = CudaGraphManager(be, capture_sizes=[2, 8], use_cuda_graph=use_cuda_graph,
                           token_inputs=tokens)
    mgr.capture(lambda b, x: tuple(be.forward(x[f"q{l.layer_id}"], x[f"k{l.layer_id}"],
                                              x[f"v{l.layer_id}"], l, b) for l in layers))
    pointers = mgr.buffer_pointers()
    for _ in range(3):
        batch = sc.next_batch("decode", [1] * 5)
        inputs = {}
        for l in layers:
            q, k, v = sc.step_inputs(l)
            inputs.update({f"q{l.layer_id}": q, f"k{l.layer_id}": k, f"v{l.layer_id}": v})
        outs = mgr.replay(batch, **inputs)
        assert mgr.last_entry.bs == 8
        for l, o in zip(layers, outs):
            assert_close_rel(o, sc.expected(l, inputs[f"q{l.layer_id}"]), RTOL[dtype],
                             f"replayed layer {l.layer_id}")
        sc.commit_step()
    assert mgr.buffer_pointers() == pointers
    return be, sc.kv_pool


def test_token_head_graph_replay_reads_the_pools_scale_buffers():
    """Captured decode (the manager's no-capture mode on the CPU) writes and reads the pool's
    own scale buffers: no new static buffer, the bound layer params point at the pool's
    tensors (fixed addresses for a real capture), and replays match the oracle."""
    be, pool = _token_graph_run("cpu", False, torch.float32)
    bound = [b for ex in (inst[1] for inst in be._instances.values()) for b in ex._layers.values()]
    assert bound
    for b in bound:
        ks, vs = pool.scale_buffers(b.layer.layer_id)
        assert b.params.k_scale_cache is ks and b.params.v_scale_cache is vs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
def test_gpu_token_head_graph_capture_replay(monkeypatch):
    """Real CUDA-graph capture of per-token-head decode (Triton writes and attention)."""
    _force(monkeypatch, "triton")
    _token_graph_run("cuda", True, torch.bfloat16)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("translated", [False, True], ids=["nhd", "swa"])
def test_gpu_token_head_write_bytes_equal_reference(fp8, translated):
    """Random bf16 data, rounded: the Triton write's fp8 bytes and scales equal the
    reference's (the same float32 operations in the same order, RNE, saturation); padding rows
    skipped; other slots untouched."""
    from aiter_attn.kernels import reference as R
    from aiter_attn.kernels.reference_extra import write_kv_translated_reference
    from aiter_attn.kernels.triton.kv_write import write_kv, write_kv_translated

    g = torch.Generator().manual_seed(3)
    P, S, H, D, T = 64, 16, 8, 128, 300
    src = (torch.randn(T, H, D, generator=g) * torch.logspace(-3, 3, T).view(T, 1, 1))
    src = src.to(torch.bfloat16).cuda()
    vsrc = torch.randn(T, H, D, generator=g).to(torch.bfloat16).cuda()
    vsrc[7] = 0
    slots = torch.randperm(P * S, generator=g)[:T].cuda()
    slots[::17] = -1
    raw = torch.randint(0, 100, (2, P, S, H, D), generator=g, dtype=torch.uint8)
    caches = [raw[0].view(fp8).cuda(), raw[1].view(fp8).cuda(),
              *(torch.rand(2, P, S, H, generator=g) + 0.5).cuda()]
    kw = dict(k_scale=0.7, v_scale=torch.tensor(0.03, device="cuda"))
    ref_fn, fn = R.write_kv_reference, write_kv
    if translated:
        kw["full_to_swa"] = torch.randperm(P * S, generator=g).cuda()
        ref_fn, fn = write_kv_translated_reference, write_kv_translated
    a = [c.clone() for c in caches]
    b = [c.clone() for c in caches]
    ref_fn(a[0], a[1], slots, src, vsrc, k_scale_cache=a[2], v_scale_cache=a[3], **kw)
    fn(b[0], b[1], slots, src, vsrc, k_scale_cache=b[2], v_scale_cache=b[3], **kw)
    for name, x, y in zip(("k", "v", "k_scales", "v_scales"), a, b):
        assert torch.equal(_raw(x), _raw(y)), _byte_diff(name, x, y)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_token_head_attention_and_backend(monkeypatch, fp8, dtype):
    """CUDA-sized shapes (GQA 4:1, head dim 128, long contexts: the split path chosen by the
    heuristic), then the backend end to end with Triton writes and attention."""
    q, kc, vc, kw, dense = _token_case([1, 1, 1, 300], [4100, 33, 700, 1000], fp8=fp8, hq=32,
                                       hkv=8, d=128, page=16, dtype=dtype, layer=(0.5, 2.0))
    out = torch.empty(q.shape[0], 32, 128, dtype=dtype, device="cuda")
    _attn_fn("triton")(q.cuda(), kc.cuda(), vc.cuda(), out,
                       **{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()})
    assert_close_rel(out, _oracle(q, [1, 1, 1, 300], dense, kw["softmax_scale"]), RTOL[dtype],
                     "triton per-token scales on CUDA")
    _force(monkeypatch, "triton")
    g = torch.Generator().manual_seed(1)
    layers = [LayerSpec(layer_id=i, num_q_heads=40, num_kv_heads=8, head_dim=128,
                        sinks=torch.randn(40, generator=g).cuda(), sliding_window=w,
                        k_scale=0.05, v_scale=0.2) for i, w in enumerate([None, 300])]
    cfg = BackendConfig(page_size=48, max_batch_size=8, max_context_len=2048, dtype=dtype,
                        kv_cache_dtype=fp8, device="cuda", kv_scale_granularity="per_token_head")
    sc = _token_mha_scenario(cfg, layers, [0, 480, 1000], seed=9)
    _token_steps(sc, AttentionBackend(cfg, sc.req_pool, sc.kv_pool), layers, dtype,
                 [(ForwardMode.EXTEND, [9, 1, 30]), (ForwardMode.DECODE, [1, 1, 1]),
                  (ForwardMode.EXTEND, [50, 2, 1])])
