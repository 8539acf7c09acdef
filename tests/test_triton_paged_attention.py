"""Triton ``paged_attention`` against the float64 dense oracle (and the registry contract).

On CPU-only hosts the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by
``scripts/test.sh``) in float32/float16 on small shapes (bf16 only where it is just loaded and
stored, never computed in); on a GPU the same cases run compiled,
and the ``gpu`` tests add bf16/fp8, CUDA-sized shapes and int64 offsets.

Relative-error bounds (‖out − oracle‖ / ‖oracle‖, oracle in float64 over the exact values the
cache holds): float32 1e-5; float16 2e-3 (P and the output are rounded to fp16); bfloat16 1.2e-2
(8-bit mantissa on P and the output); fp8 caches with fp16/bf16 queries: the same bounds as
the query dtype, because the oracle sees the dequantised cache values.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.reference import quantize_to_cache
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention

from ._triton_util import DEVICE, requires_triton

pytestmark = requires_triton

RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def _kernel():
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    return paged_attention_triton


class Case:
    """A paged batch over a block-permuted pool whose page 0 is a null page full of noise."""

    def __init__(self, q_lens, kv_lens, *, hq=8, hkv=2, d=64, dv=None, page=16,
                 dtype=torch.float32, kv_dtype=None, k_scale=None, v_scale=None, seed=0,
                 device=DEVICE, null_rows=()):
        g = torch.Generator().manual_seed(seed)
        dv = dv or d
        kv_dtype = kv_dtype or dtype
        self.q_lens, self.kv_lens = list(q_lens), list(kv_lens)
        self.hq, self.hkv, self.d, self.dv, self.dtype = hq, hkv, d, dv, dtype
        self.k_scale, self.v_scale = k_scale, v_scale
        n_pages = [-(-L // page) for L in kv_lens]
        width = max(n_pages, default=0) + 2  # spare columns stay 0 = null page
        total = 1 + sum(n_pages) + 3
        perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
        self.k_cache = torch.randn(total, page, hkv, d, generator=g).to(kv_dtype)
        self.v_cache = torch.randn(total, page, hkv, dv, generator=g).to(kv_dtype)
        bt = torch.zeros(len(q_lens), width, dtype=torch.int32)
        self.dense_k, self.dense_v = [], []
        for b, L in enumerate(kv_lens):
            if b in null_rows:  # a CUDA-graph padding row: every page is the null page
                self.dense_k.append(self.k_cache[0, :L].float() * (k_scale or 1.0))
                self.dense_v.append(self.v_cache[0, :L].float() * (v_scale or 1.0))
                continue
            pages = [perm.pop() for _ in range(n_pages[b])]
            bt[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            k = torch.randn(L, hkv, d, generator=g)
            v = torch.randn(L, hkv, dv, generator=g)
            kq = quantize_to_cache(k, kv_dtype, k_scale if k_scale else 1.0)
            vq = quantize_to_cache(v, kv_dtype, v_scale if v_scale else 1.0)
            for i, p in enumerate(pages):
                self.k_cache[p, : min(page, L - i * page)] = kq[i * page:(i + 1) * page]
                self.v_cache[p, : min(page, L - i * page)] = vq[i * page:(i + 1) * page]
            self.dense_k.append(kq.float() * (k_scale or 1.0))
            self.dense_v.append(vq.float() * (v_scale or 1.0))
        self.block_table = bt
        self.cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        self.q = torch.randn(int(self.cu[-1]), hq, d, generator=g).to(dtype)
        self.seqused_k = torch.tensor(kv_lens, dtype=torch.int32)
        self.scale = d ** -0.5
        self.device = device

    def run(self, *, hints=True, **kw):
        dev = self.device
        out = torch.full((self.q.shape[0], self.hq, self.dv), float("nan"), dtype=self.dtype,
                         device=dev)
        extra = {}
        if hints:
            extra = dict(max_seqlen_q=max(self.q_lens), max_seqlen_k=max(self.kv_lens))
        for name in ("sinks", "custom_mask", "mask_indptr"):
            if kw.get(name) is not None:
                kw[name] = kw[name].to(dev)
        _kernel()(
            self.q.to(dev), self.k_cache.to(dev), self.v_cache.to(dev), out,
            cu_seqlens_q=self.cu.to(dev), seqused_k=self.seqused_k.to(dev),
            block_table=self.block_table.to(dev), softmax_scale=self.scale,
            k_scale=self._scale(self.k_scale), v_scale=self._scale(self.v_scale), **extra, **kw)
        return out

    def _scale(self, s):
        return None if s is None else torch.tensor([s], dtype=torch.float32, device=self.device)

    def expected(self, *, causal=True, window_size=(-1, -1), softcap=0.0, sinks=None,
                 masks=None):
        outs, t = [], 0
        for b, n in enumerate(self.q_lens):
            outs.append(dense_attention(
                self.q[t:t + n], self.dense_k[b], self.dense_v[b], scale=self.scale,
                causal=causal, window=window_size, softcap=softcap, sinks=sinks,
                mask=None if masks is None else masks[b]))
            t += n
        return torch.cat(outs)


def _check(case: Case, what: str, *, hints=True, **kw):
    out = case.run(hints=hints, **kw)
    assert_close_rel(out, case.expected(**kw), RTOL[case.dtype], what)
    return out


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]

SHAPES = [
    # id, q_lens, kv_lens, hq, hkv, d, page
    pytest.param([1, 1, 1, 1], [37, 1, 130, 16], 8, 2, 64, 16, id="decode-GQA8:2-page16"),
    pytest.param([9, 20], [9, 20], 10, 2, 80, 48, id="prefill-GQA5:1-D80-page48"),
    pytest.param([5, 3, 17], [40, 3, 150], 8, 2, 64, 1, id="extend-prefix-page1"),
    pytest.param([1, 7, 1, 30], [50, 7, 130, 95], 10, 2, 80, 16, id="mixed-GQA5:1-D80"),
    pytest.param([4, 4], [60, 19], 4, 4, 32, 7, id="verify-MHA-page7"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", SHAPES)
def test_conformance(q_lens, kv_lens, hq, hkv, d, page, dtype):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=d + page)
    _check(case, "with host hints")
    _check(case, "without host hints (static bounds, q-block search)", hints=False)


@pytest.mark.parametrize("splits", [2, 5], ids=["splits2", "splits5"])
def test_split_kv_reduction(monkeypatch, splits):
    """The flash-decoding path (partials + reduction) with sinks, forced on in the interpreter."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", splits)
    case = Case([1, 1, 3], [200, 9, 77], hq=8, hkv=2, d=64, page=16, seed=splits)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(1))
    _check(case, "split-KV")
    _check(case, "split-KV + sinks", sinks=sinks)
    _check(case, "split-KV + window", window_size=(40, 0))
    g = torch.Generator().manual_seed(splits)
    masks = [torch.rand(n, L, generator=g) < 0.7 for n, L in zip(case.q_lens, case.kv_lens)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    indptr = torch.tensor([0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist())
    out = case.run(custom_mask=flat, mask_indptr=indptr, causal=False)
    assert_close_rel(out, case.expected(causal=False, masks=masks), RTOL[case.dtype],
                     "split-KV + tree mask")


@pytest.mark.parametrize("page,chunk", [
    pytest.param(16, 2, id="page16-2pages-per-tile-chunk2"),
    pytest.param(32, 4, id="page32-1page-per-tile-chunk4"),
    pytest.param(1, 2, id="page1-32pages-per-tile-chunk2"),
    pytest.param(64, 2, id="page64-2tiles-per-page-chunk2"),
    pytest.param(128, 4, id="page128-4tiles-per-page-chunk4"),
])
def test_page_chunks(monkeypatch, page, chunk):
    """The chunked block-table path (PAGE_CHUNK): the pages of ``chunk`` key tiles are read
    once and each tile picks its own; contexts of several full and one partial chunk, with
    splits whose tile ranges start mid-chunk."""
    from aiter_attn.kernels.triton import paged_attention as mod

    monkeypatch.setitem(mod.TUNING_OVERRIDES, "page_chunk", chunk)
    case = Case([1, 40, 1], [300, 270, 33], hq=8, hkv=2, d=32, page=page, seed=page + chunk)
    _check(case, "chunked page lookup")
    monkeypatch.setitem(mod.TUNING_OVERRIDES, "num_splits", 3)
    _check(case, "chunked page lookup, 3 splits")


@pytest.mark.parametrize("w", [1, 4, 5, 6], ids=["w1", "w4", "w5", "w6"])
def test_sliding_window_boundaries(w):
    """HF sliding_window=w is (w-1, 0); contexts of w-1, w, w+1 keys and a long one whose
    window starts several tiles in (pages outside the window are skipped)."""
    case = Case([4, 5, 6, 1, 12], [4, 5, 6, 300, 160], hq=4, hkv=2, d=32, page=16, seed=w)
    _check(case, f"window w={w}", window_size=(w - 1, 0))


def test_window_non_causal_both_sides():
    case = Case([6, 1], [30, 90], hq=4, hkv=1, d=32, page=16, seed=5)
    _check(case, "left/right window, non-causal", causal=False, window_size=(7, 3))
    _check(case, "non-causal", causal=False)


def test_sinks_and_softcap():
    case = Case([1, 6, 1], [70, 6, 3], hq=8, hkv=2, d=64, page=16, seed=11)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(2)) * 3
    _check(case, "sinks", sinks=sinks)
    _check(case, "softcap", softcap=4.0)
    _check(case, "sinks+softcap+window", sinks=sinks, softcap=4.0, window_size=(9, 0))


def test_sink_convention_by_hand():
    """One key with logit 0 and a sink of 0: the key gets weight 1/2, so out = v/2."""
    case = Case([1], [1], hq=1, hkv=1, d=16, page=16, seed=0)
    case.q.zero_()
    out = case.run(sinks=torch.zeros(1))
    v = case.dense_v[0][0, 0]
    assert_close_rel(out[0, 0].cpu(), v / 2, 1e-6, "sink halves the only key")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_e4m3fn_cache_with_scales(dtype):
    case = Case([1, 5, 1], [90, 21, 8], hq=8, hkv=2, d=64, page=16, dtype=dtype,
                kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.25, seed=21)
    _check(case, "fp8 e4m3fn")


def test_fp8_cache_bf16_queries_compute_in_fp16():
    """bf16 queries on an fp8 cache run their dots in fp16 (one cvt per fp8 pair); only loads
    and stores are bf16 here, which the interpreter handles. A query beyond fp16's range
    saturates instead of turning the row into NaN."""
    case = Case([1, 5, 1], [90, 21, 8], hq=8, hkv=2, d=64, page=16, dtype=torch.bfloat16,
                kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.25, seed=21)
    _check(case, "bf16 q, fp8 e4m3fn cache")
    case.q[0, 0, 0] = 1e6
    assert torch.isfinite(case.run()).all()


def test_v_head_dim_differs_and_head_dim_256():
    case = Case([3, 1], [20, 40], hq=4, hkv=2, d=48, dv=32, page=16, seed=4)
    _check(case, "Dv != D")
    case = Case([2, 1], [9, 33], hq=2, hkv=1, d=256, page=16, seed=6)
    _check(case, "D=256")


def test_custom_mask_tree_verify():
    """Tree verify: a literal bool mask per request, row-major [q_len, kv_len]; one row fully
    masked must give zeros (not NaN)."""
    g = torch.Generator().manual_seed(9)
    q_lens, kv_lens = [4, 3], [20, 70]
    case = Case(q_lens, kv_lens, hq=8, hkv=2, d=32, page=16, seed=9)
    masks = []
    for n, L in zip(q_lens, kv_lens):
        m = torch.rand(n, L, generator=g) < 0.6
        m[:, : L - n] |= torch.rand(n, L - n, generator=g) < 0.5
        masks.append(m)
    masks[0][2] = False  # nothing visible
    flat = torch.cat([m.reshape(-1) for m in masks])
    indptr = torch.tensor([0, q_lens[0] * kv_lens[0], flat.numel()], dtype=torch.int64)
    out = case.run(custom_mask=flat, mask_indptr=indptr, causal=False)
    exp = case.expected(causal=False, masks=masks)
    assert_close_rel(out, exp, RTOL[case.dtype], "tree mask")
    assert torch.all(out[2].cpu() == 0), "a fully masked row must be zeros"


def test_padding_rows_on_null_page_give_no_nan():
    """CUDA-graph padding: seq_len 1 rows whose page table is all zeros (the null page)."""
    case = Case([1, 1, 1, 1], [33, 1, 1, 5], hq=4, hkv=2, d=32, page=16, seed=3,
                null_rows=(1, 2))
    out = case.run()
    assert torch.isfinite(out).all()
    assert_close_rel(out, case.expected(), RTOL[case.dtype], "padding rows")


def test_through_ops_and_registry():
    """``ops.paged_attention(..., backend="triton")`` reaches this kernel; the CPU default stays
    the reference; shapes the kernel does not take are rejected with a reason."""
    import aiter_attn.ops as ops
    from aiter_attn.kernels.registry import KernelSelectionError
    from aiter_attn.plugins import kernel_registry

    case = Case([1, 5], [40, 12], hq=8, hkv=2, d=64, page=16, seed=13)
    dev = case.device
    out = ops.paged_attention(
        case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev),
        cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
        block_table=case.block_table.to(dev), softmax_scale=case.scale, max_seqlen_q=5,
        max_seqlen_k=40, backend="triton")
    assert_close_rel(out, case.expected(), RTOL[case.dtype], "ops backend=triton")

    req = ops.paged_attention_request(case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev))
    chosen = kernel_registry().select(req).impl.name
    assert chosen == ("triton" if dev == "cuda" else "reference")

    big = torch.zeros(2, 16, 1, 512, device=dev)
    with pytest.raises(KernelSelectionError, match="512"):
        ops.paged_attention(
            torch.zeros(1, 1, 512, device=dev), big, big,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=dev),
            seqused_k=torch.tensor([1], dtype=torch.int32, device=dev),
            block_table=torch.ones(1, 1, dtype=torch.int32, device=dev),
            softmax_scale=1.0, backend="triton")


# ---------------------------------------------------------------------------------------------
# GPU: bf16/fp16/fp8 on CUDA-sized shapes, split-KV chosen by the heuristic, int64 offsets
# ---------------------------------------------------------------------------------------------

GPU_DTYPES = [
    pytest.param(torch.bfloat16, None, id="bf16"),
    pytest.param(torch.float16, None, id="fp16"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, id="bf16-fp8e4m3fn"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kv_dtype", GPU_DTYPES)
@pytest.mark.parametrize("q_lens,kv_lens,page", [
    pytest.param([1] * 3, [4100, 33, 1], 16, id="decode-split"),
    pytest.param([1], [9000], 16, id="decode-bs1-split"),  # num_seqs unspecialised
    pytest.param([1] * 16, [700] * 16, 16, id="decode-bs16"),
    pytest.param([300, 1, 77], [300, 2000, 1000], 48, id="mixed-page48"),
    pytest.param([257], [1700], 64, id="extend-page64"),
])
def test_gpu_conformance(dtype, kv_dtype, q_lens, kv_lens, page):
    scales = dict(k_scale=0.07, v_scale=0.3) if kv_dtype is not None else {}
    case = Case(q_lens, kv_lens, hq=32, hkv=8, d=128, page=page, dtype=dtype,
                kv_dtype=kv_dtype, seed=len(q_lens), device="cuda", **scales)
    sinks = torch.randn(32, generator=torch.Generator().manual_seed(0))
    _check(case, "plain")
    _check(case, "window+sinks+softcap", window_size=(511, 0), sinks=sinks, softcap=30.0)


@pytest.mark.gpu
def test_gpu_fp32_gqa5_d80_and_fp8_e5m2():
    case = Case([1, 1, 40], [3000, 5, 900], hq=10, hkv=2, d=80, page=16,
                dtype=torch.float32, seed=2, device="cuda")
    _check(case, "fp32 D80 GQA5:1")
    case = Case([1, 9], [2000, 300], hq=32, hkv=8, d=128, page=16, dtype=torch.float16,
                kv_dtype=torch.float8_e5m2, k_scale=0.1, v_scale=0.5, seed=3, device="cuda")
    _check(case, "fp16 queries, fp8 e5m2 cache")


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """A pool of more than 2^31 elements; the request's pages sit at its end."""
    hkv, d, page = 8, 128, 16
    pages = (1 << 31) // (page * hkv * d) + 64
    try:
        k_cache = torch.zeros(pages, page, hkv, d, dtype=torch.float16, device="cuda")
        v_cache = torch.zeros_like(k_cache)
    except torch.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 2^31-element pool")
    g = torch.Generator(device="cuda").manual_seed(0)
    L = 40 * page
    bt = torch.arange(pages - 40, pages, device="cuda", dtype=torch.int32).view(1, -1)
    k = torch.randn(L, hkv, d, device="cuda", generator=g).half()
    v = torch.randn(L, hkv, d, device="cuda", generator=g).half()
    k_cache[pages - 40:] = k.view(40, page, hkv, d)
    v_cache[pages - 40:] = v.view(40, page, hkv, d)
    q = torch.randn(2, 32, d, device="cuda", generator=g).half()
    out = torch.empty(2, 32, d, dtype=torch.float16, device="cuda")
    _kernel()(q, k_cache, v_cache, out,
              cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32, device="cuda"),
              seqused_k=torch.tensor([L], dtype=torch.int32, device="cuda"), block_table=bt,
              softmax_scale=d ** -0.5, max_seqlen_q=2, max_seqlen_k=L)
    exp = dense_attention(q, k, v, scale=d ** -0.5)
    assert_close_rel(out, exp, RTOL[torch.float16], "int64 offsets")


def test_backend_steps_through_triton_kernel(monkeypatch):
    """AttentionBackend (MHA strategies: extend with prefix, then decode) with the registry
    forced to this kernel for ``paged_attention`` (the reference for every other op), fp8 KV
    with per-layer scales, sinks, soft-cap and a window, GQA 5:1 on 48-token pages."""
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.plugins import kernel_registry
    from aiter_attn.testing import PagedScenario

    reg = kernel_registry()
    select = reg.select

    def triton_for_attention(request, backend=None, **kw):
        return select(request, backend="triton" if request.op == "paged_attention"
                      else "reference")

    monkeypatch.setattr(reg, "select", triton_for_attention)
    dtype = torch.float32 if DEVICE == "cpu" else torch.float16
    g = torch.Generator().manual_seed(0)
    layers = [LayerSpec(layer_id=i, num_q_heads=10, num_kv_heads=2, head_dim=32, logit_cap=3.0,
                        sliding_window=20, sinks=torch.randn(10, generator=g).to(DEVICE),
                        k_scale=ks, v_scale=vs)
              for i, (ks, vs) in enumerate([(0.25, 0.5), (1.5, 0.75)])]
    cfg = BackendConfig(page_size=48, max_batch_size=4, max_context_len=256, dtype=dtype,
                        kv_cache_dtype=torch.float8_e4m3fn, device=DEVICE)
    sc = PagedScenario.make(cfg, layers, [0, 48, 53], seed=7)
    be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
    for mode, lens in ((ForwardMode.EXTEND, [9, 1, 30]), (ForwardMode.DECODE, [1, 1, 1])):
        batch = sc.next_batch(mode, lens)
        be.init_forward_metadata(batch)
        for layer in layers:
            q, k, v = sc.step_inputs(layer)
            out = be.forward(q, k, v, layer, batch)
            assert_close_rel(out, sc.expected(layer, q), RTOL[dtype], f"{mode.name} {layer}")
        sc.commit_step()
