"""``extend_attention`` (:mod:`aiter_attn.kernels.triton.extend`): the dense pass over the
step's new tokens + the paged pass over the cached prefix, merged by LSE, against the
float64 oracle over all keys. Paged batches over block-permuted pools with a null page 0
(:class:`tests.test_triton_paged_attention.Case`), ragged lengths incl. 1 and requests without
a prefix, GQA 5:1, head dim 80, pages 16/48/1, sinks (counted once), soft-cap, the LSE, fp8
caches (prefix pass), host hints present/absent/zero; the registry's choice and declines.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.registry import KernelRegistry, KernelSelectionError
from aiter_attn.kernels.triton.extend import extend_attention_request
from aiter_attn.plugins import kernel_registry
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention

from ._triton_util import DEVICE, HAS_CUDA, requires_triton
from .test_triton_paged_attention import RTOL, Case

pytestmark = requires_triton


def _new_kv(case: Case):
    """The step's new keys/values (the last ``q_len`` of each request), q's dtype."""
    ks, vs = [], []
    for b, n in enumerate(case.q_lens):
        ks.append(case.dense_k[b][len(case.dense_k[b]) - n:])
        vs.append(case.dense_v[b][len(case.dense_v[b]) - n:])
    return torch.cat(ks).to(case.dtype), torch.cat(vs).to(case.dtype)


def _oracle(case: Case, **kw):
    outs, lses, t = [], [], 0
    for b, n in enumerate(case.q_lens):
        o, l = dense_attention(case.q[t:t + n], case.dense_k[b], case.dense_v[b],
                               scale=case.scale, causal=True, return_lse=True, **kw)
        outs.append(o)
        lses.append(l)
        t += n
    return torch.cat(outs), torch.cat(lses)


def _run(case: Case, *, hints="exact", lse=True, sinks=None, softcap=0.0, backend="triton"):
    dev = case.device
    q = case.q.to(dev)
    k_cache, v_cache = case.k_cache.to(dev), case.v_cache.to(dev)
    k, v = (t.to(dev) for t in _new_kv(case))
    out = torch.full((q.shape[0], case.hq, case.dv), float("nan"), dtype=case.dtype, device=dev)
    lse_t = torch.full((q.shape[0], case.hq), float("nan"), device=dev) if lse else None
    extra = {}
    if hints == "exact":
        prefix = [L - n for L, n in zip(case.kv_lens, case.q_lens)]
        extra = dict(max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.kv_lens),
                     max_prefix_len=max(prefix))
    elif hints == "loose":
        extra = dict(max_seqlen_q=max(case.q_lens), max_seqlen_k=max(case.kv_lens))
    req = extend_attention_request(q, k_cache, v_cache, softcap=softcap, sinks=sinks)
    fn = kernel_registry().select(req, backend=backend).fn
    fn(q, k, v, k_cache, v_cache, out, cu_seqlens_q=case.cu.to(dev),
       seqused_k=case.seqused_k.to(dev), block_table=case.block_table.to(dev),
       softmax_scale=case.scale, softcap=softcap,
       sinks=None if sinks is None else sinks.to(dev), k_scale=case._scale(case.k_scale),
       v_scale=case._scale(case.v_scale), lse=lse_t, **extra)
    return out, lse_t


def _check(case, what, *, rtol=None, lse_rtol=None, **kw):
    sinks, softcap = kw.get("sinks"), kw.get("softcap", 0.0)
    eo, el = _oracle(case, sinks=sinks, softcap=softcap)
    o, l = _run(case, **kw)
    assert_close_rel(o, eo, rtol or RTOL[case.dtype], what)
    if l is not None:
        e = el.double()
        inf = torch.isneginf(e)
        assert torch.equal(torch.isneginf(l.double().cpu()), inf), f"{what}: -inf rows differ"
        assert_close_rel(l[~inf], e[~inf], lse_rtol or RTOL[case.dtype], what + " (lse)")


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
SHAPES = [
    # q_lens, kv_lens, hq, hkv, d, page
    pytest.param([1, 37, 20, 5], [1, 100, 20, 70], 10, 2, 80, 16, id="ragged-GQA5:1-D80"),
    pytest.param([9, 20], [9, 20], 10, 2, 80, 48, id="prefill-only-page48"),
    pytest.param([5, 3, 17], [40, 3, 150], 8, 2, 64, 1, id="prefix-page1"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", SHAPES)
def test_extend_matches_oracle(dtype, q_lens, kv_lens, hq, hkv, d, page):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=7)
    _check(case, "extend")


@pytest.mark.parametrize("hints", ["exact", "loose", "none"])
def test_extend_hints(hints):
    """Without a prefix hint the prefix pass runs over every request (those without a prefix
    contribute lse = -inf); without any hint the bounds come from the shapes."""
    case = Case([4, 33, 1], [4, 60, 29], hq=8, hkv=2, d=64, page=16, seed=3)
    _check(case, f"hints={hints}", hints=hints)


def test_extend_sinks_softcap_once():
    """Sinks are added exactly once (in the dense pass's epilogue), with soft-capped logits
    in both passes."""
    g = torch.Generator().manual_seed(11)
    case = Case([6, 1, 25], [40, 1, 64], hq=10, hkv=2, d=80, page=16, seed=4)
    sinks = torch.randn(case.hq, generator=g) * 2
    _check(case, "sinks", sinks=sinks)
    _check(case, "sinks+softcap", sinks=sinks, softcap=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_fp8_prefix(dtype):
    """fp8 e4m3 cache: the prefix pass dequantises; the new tokens' K/V are used as given."""
    case = Case([1, 5, 12], [90, 21, 12], hq=8, hkv=2, d=64, page=16, dtype=dtype,
                kv_dtype=torch.float8_e4m3fn, k_scale=0.05, v_scale=0.25, seed=21)
    _check(case, "fp8 prefix")


def test_registry_declines_window_mask_noncausal():
    """Windows, tree masks, non-causal layers and batch-invariant mode are declined with a
    reason (the strategy then keeps the paged kernel)."""
    case = Case([2], [10], hq=4, hkv=2, d=32, page=16)
    q, kc, vc = case.q, case.k_cache, case.v_cache
    reg = kernel_registry()
    for kw, feature in ((dict(window_size=(7, 0)), "window"),
                        (dict(causal=False), "non_causal"),
                        (dict(custom_mask=torch.ones(4, dtype=torch.bool)), "custom_mask")):
        with pytest.raises(KernelSelectionError, match=feature):
            reg.select(extend_attention_request(q, kc, vc, **kw), backend="triton")
    import attrs

    req = extend_attention_request(q, kc, vc)
    with pytest.raises(KernelSelectionError, match="batch_invariant"):
        reg.select(attrs.evolve(req, features=req.features | {"batch_invariant"}),
                   backend="triton")
    assert reg.select(req, backend="triton").impl.name == "triton"


def test_run_without_new_kv_raises():
    case = Case([2], [10], hq=4, hkv=2, d=32, page=16)
    req = extend_attention_request(case.q, case.k_cache, case.v_cache)
    kernel = kernel_registry().select(req, backend="triton").bind(req)
    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata

    dev = case.device
    md = _adhoc_metadata(case.q.to(dev), case.k_cache.to(dev), case.cu.to(dev),
                         case.seqused_k.to(dev), case.block_table.to(dev), None, None, 2, 10,
                         "paged_attention")
    params = LayerParams.create(scale=case.scale, device=dev)
    out = torch.empty(2, 4, 32, dtype=case.dtype, device=dev)
    with pytest.raises(ValueError, match="new keys and values"):
        kernel.run(case.q.to(dev), (case.k_cache.to(dev), case.v_cache.to(dev)),
                   kernel.plan(md), params, out)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_gpu(dtype):
    """bf16/fp16 on CUDA shapes: GQA 32/8, d128, page 16, new tokens over long prefixes."""
    case = Case([1, 700, 300, 1024], [1, 1500, 300, 2048], hq=32, hkv=8, d=128, page=16,
                dtype=dtype, seed=5, device="cuda")
    _check(case, "extend gpu", lse_rtol=2e-3 if dtype == torch.bfloat16 else None)


def test_extend_per_token_head_scales():
    """Per-(token, head) fp8 scales (``k_scale_cache``/``v_scale_cache``) reach the prefix
    pass; magnitudes spread over 10⁴ across tokens, layer scales on top, sinks and soft-cap."""
    from .test_fp8_formats import _oracle as fp8_oracle
    from .test_fp8_formats import _token_case

    q_lens, kv_lens = [7, 1, 20], [30, 130, 20]
    q, kc, vc, kw, dense = _token_case(q_lens, kv_lens, fp8=torch.float8_e4m3fn, hq=10, hkv=2,
                                       d=80, page=16, dtype=torch.float16, layer=(0.5, 2.0),
                                       seed=9)
    k_new = torch.cat([k[len(k) - n:] for (k, _), n in zip(dense, q_lens)]).to(q.dtype)
    v_new = torch.cat([v[len(v) - n:] for (_, v), n in zip(dense, q_lens)]).to(q.dtype)
    sinks = torch.randn(10, generator=torch.Generator().manual_seed(2))
    dev = DEVICE
    args = {k: (v.to(dev) if torch.is_tensor(v) else v) for k, v in kw.items()}
    out = torch.full((q.shape[0], 10, 80), float("nan"), dtype=q.dtype, device=dev)
    req = extend_attention_request(q, kc, vc, softcap=5.0, sinks=sinks)
    import attrs

    req = attrs.evolve(req, features=req.features | {"kv_scale_per_token_head"})
    fn = kernel_registry().select(req, backend="triton").fn
    fn(q.to(dev), k_new.to(dev), v_new.to(dev), kc.to(dev), vc.to(dev), out, softcap=5.0,
       sinks=sinks.to(dev), max_seqlen_q=20, max_seqlen_k=130, **args)
    # the oracle over what the kernel reads: the prefix from the fp8 cache (dequantised), the
    # new tokens as the fp16 K/V it was given (not their float32 values)
    seen = []
    for (k, v), n in zip(dense, q_lens):
        k, v = k.clone(), v.clone()
        k[len(k) - n:] = k[len(k) - n:].to(q.dtype).float()
        v[len(v) - n:] = v[len(v) - n:].to(q.dtype).float()
        seen.append((k, v))
    exp = fp8_oracle(q, q_lens, seen, kw["softmax_scale"], softcap=5.0, sinks=sinks)
    assert_close_rel(out, exp, RTOL[torch.float16], "per-token-head scales")


def test_extend_rejects_strided_head_dim():
    case = Case([3], [10], hq=4, hkv=2, d=32, page=16)
    dev = case.device
    k, v = (t.to(dev) for t in _new_kv(case))
    k_bad = torch.empty(k.shape[0], k.shape[1], 2 * k.shape[2], dtype=k.dtype,
                        device=dev)[..., ::2]
    req = extend_attention_request(case.q, case.k_cache, case.v_cache)
    fn = kernel_registry().select(req, backend="triton").fn
    out = torch.empty(3, 4, 32, dtype=case.dtype, device=dev)
    with pytest.raises(ValueError, match="last .*axis"):
        fn(case.q.to(dev), k_bad, v, case.k_cache.to(dev), case.v_cache.to(dev), out,
           cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
           block_table=case.block_table.to(dev), softmax_scale=case.scale)
