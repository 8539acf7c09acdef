"""fp8 value reads as 16-bit column pairs: the paged Triton kernel's ``V_PAIRS`` path
(``TUNING_OVERRIDES["v_pairs"]``, default :data:`~aiter_attn.kernels.triton._launch_config.
FP8_VALUE_PAIRS`).

On an fp8 cache, decode-shaped tiles (fewer than 64 rows: mma.sync dots) read the value tile
as int16 pairs of adjacent head-dim columns, split the bytes by parity in registers and run
two half-width dots whose accumulators are interleaved back at the end. These tests hold that
path to the float64 oracle over the dequantised cache (block-permuted pools with a noisy null
page, e4m3fn and e5m2, layer and per-(token, head) scales, windows, sinks, soft-cap, the split
path and the chunked page lookup), check that the launch really took it (a spy on the launch
constexprs), and that layouts it cannot read (head dim 80 padded to 128, strides that are
not whole 16-byte vectors, an odd base address) fall back to the byte-wise reads with the same results. The sm_90 build's
effect (no 8-bit shared loads, fewer spills) is guarded in ``test_triton_pipelining.py``.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._launch_options import (check_plain_and_featured, check_token_head_case,
                              spy_launch_option)
from ._triton_util import DEVICE, HAS_CUDA, INTERPRET, requires_triton
from .test_fp8_formats import _oracle, _token_case
from .test_triton_paged_attention import RTOL, Case, _check

pytestmark = requires_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [pytest.param(E4M3, id="e4m3fn"), pytest.param(E5M2, id="e5m2")]


@pytest.fixture
def pairs(monkeypatch):
    """Turns ``v_pairs`` on; the ``V_PAIRS`` constexpr of every launch planned."""
    return spy_launch_option(monkeypatch, "V_PAIRS", "v_pairs")


SHAPES = [
    # id, q_lens, kv_lens, hq, hkv, d, page
    pytest.param([1, 1, 1, 1], [37, 1, 130, 16], 8, 2, 64, 16, id="decode-GQA8:2-page16"),
    pytest.param([1, 3, 1], [97, 40, 5], 10, 2, 32, 48, id="verify-GQA5:1-page48"),
    pytest.param([5, 3, 17], [40, 3, 150], 8, 2, 64, 1, id="extend-prefix-page1"),
]


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", SHAPES)
def test_value_pairs_vs_oracle(pairs, fp8, dtype, q_lens, kv_lens, hq, hkv, d, page):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, kv_dtype=fp8,
                k_scale=0.05, v_scale=0.25, seed=d + page)
    check_plain_and_featured(case, "value pairs", window=11, softcap=5.0, sinks_seed=1)
    assert pairs and all(pairs), pairs


@pytest.mark.parametrize("fp8", FORMATS)
def test_byte_wise_value_reads_vs_oracle(monkeypatch, fp8):
    """``v_pairs`` off (the byte-wise value reads, no longer the default) still matches the
    oracle, windows, sinks and soft-cap included."""
    seen = spy_launch_option(monkeypatch, "V_PAIRS", "v_pairs", value=False)
    case = Case([1, 3, 1], [97, 40, 5], hq=10, hkv=2, d=32, page=48, dtype=torch.float16,
                kv_dtype=fp8, k_scale=0.05, v_scale=0.25, seed=7)
    check_plain_and_featured(case, "byte-wise values", window=11, softcap=5.0, sinks_seed=2)
    assert seen and not any(seen), seen


def test_value_pairs_are_the_default(monkeypatch):
    """With no override an fp8 decode launch reads its values as pairs (H200: 8x64k 2.61 ->
    3.59 TB/s, docs/benchmarks.md)."""
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import paged_attention as pa

    from ._launch_options import spy_constexpr

    monkeypatch.delitem(pa.TUNING_OVERRIDES, "v_pairs", raising=False)
    seen = spy_constexpr(monkeypatch, attn.TritonPagedAttention, "V_PAIRS")
    case = Case([1, 1], [37, 130], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                kv_dtype=E4M3, k_scale=0.05, v_scale=0.25, seed=3)
    _check(case, "default fp8 decode")
    assert seen and all(seen), seen


@pytest.mark.parametrize("splits,chunk", [(3, 0), (2, 2)])
def test_value_pairs_split_path_and_chunked_lookup(pairs, monkeypatch, splits, chunk):
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", splits)
    monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_chunk", chunk)
    case = Case([1, 1, 2], [200, 9, 77], hq=8, hkv=2, d=32, page=16, dtype=torch.float16,
                kv_dtype=E4M3, k_scale=0.1, v_scale=0.5, seed=splits)
    _check(case, f"value pairs, {splits} splits, page chunks of {chunk}")
    assert pairs and all(pairs), pairs


@pytest.mark.parametrize("fp8", FORMATS)
def test_value_pairs_with_token_head_scales(pairs, monkeypatch, fp8):
    """Per-(token, head) value scales multiply each half of the pair split in float32."""
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", 2)
    check_token_head_case(fp8, 4, "value pairs, per-(token, head) scales")
    assert pairs and all(pairs), pairs


def _odd_base(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor of the same shape and strides that starts at an odd byte."""
    flat = torch.empty(t.numel() + 1, dtype=torch.uint8, device=t.device)
    out = flat[1:].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _padded_rows(t: torch.Tensor, extra: int) -> torch.Tensor:
    """``t`` in a buffer whose head axis holds ``extra`` more columns (its token / page / head
    strides then are no multiples of 16 bytes)."""
    pad = torch.zeros(*t.shape[:-1], t.shape[-1] + extra, dtype=torch.uint8, device=t.device)
    out = pad.view(t.dtype)[..., :t.shape[-1]]
    out.copy_(t)
    return out


@pytest.mark.parametrize("layout", ["head-dim-80", "odd-strides", "even-unaligned-strides",
                                    "odd-base"])
def test_value_pairs_fall_back_where_the_layout_cannot_pair(pairs, layout):
    d = 80 if layout == "head-dim-80" else 32
    case = Case([1, 1, 4], [70, 5, 33], hq=10, hkv=2, d=d, page=16, dtype=torch.float16,
                kv_dtype=E5M2, k_scale=0.1, v_scale=0.5, seed=7)
    if layout == "odd-strides":
        case.v_cache = _padded_rows(case.v_cache, 1)
        assert case.v_cache.stride(2) % 2 == 1
    elif layout == "even-unaligned-strides":  # pairs would start on even, unaligned bytes
        case.v_cache = _padded_rows(case.v_cache, 2)
        assert case.v_cache.stride(2) % 16 == 2
    elif layout == "odd-base":
        case.device = DEVICE
        case.v_cache = _odd_base(case.v_cache.to(DEVICE))
        assert case.v_cache.data_ptr() % 2 == 1
    _check(case, f"byte-wise value reads ({layout})")
    assert pairs and not any(pairs), pairs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("dtype,fp8", [
    pytest.param(torch.bfloat16, E4M3, id="bf16-e4m3fn"),
    pytest.param(torch.float16, E5M2, id="fp16-e5m2"),
])
@pytest.mark.parametrize("q_lens,kv_lens,page", [
    pytest.param([1] * 3, [4100, 33, 1], 16, id="decode-split"),
    pytest.param([1] * 16, [700] * 16, 16, id="decode-bs16"),
    pytest.param([4, 1, 4], [3000, 2000, 100], 48, id="verify-page48"),
])
def test_gpu_value_pairs_vs_oracle(pairs, dtype, fp8, q_lens, kv_lens, page):
    """The compiled sm_90 path (ldmatrix.trans of the pairs, two half-width mma.sync dots) on
    CUDA-sized shapes (GQA 32/8, head dim 128), with and without window + sinks + soft-cap."""
    case = Case(q_lens, kv_lens, hq=32, hkv=8, d=128, page=page, dtype=dtype, kv_dtype=fp8,
                k_scale=0.07, v_scale=0.3, seed=len(q_lens), device="cuda")
    check_plain_and_featured(case, "value pairs", window=511, softcap=30.0, sinks_seed=0)
    assert pairs and all(pairs), pairs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
def test_gpu_value_pairs_token_head_scales(pairs):
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    q_lens = [1, 1, 1, 4]
    q, kc, vc, kw, dense = _token_case(q_lens, [4100, 33, 700, 1000], fp8=E4M3, hq=32, hkv=8,
                                       d=128, page=16, dtype=torch.bfloat16, layer=(0.5, 2.0))
    out = torch.empty(q.shape[0], 32, 128, dtype=torch.bfloat16, device="cuda")
    paged_attention_triton(q.cuda(), kc.cuda(), vc.cuda(), out,
                           **{k: (v.cuda() if torch.is_tensor(v) else v) for k, v in kw.items()})
    assert_close_rel(out, _oracle(q, q_lens, dense, kw["softmax_scale"]), RTOL[torch.bfloat16],
                     "value pairs, per-(token, head) scales on CUDA")
    assert pairs and all(pairs), pairs
