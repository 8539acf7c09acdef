"""fp8 MLA latents with the values read as 16-bit column pairs (the Triton MLA kernel's
``V_PAIRS``; ``mla_paged_attention(..., v_pairs=True)`` / the kernel's ``tuning``, default
:data:`~aiter_attn.kernels.triton._launch_config.MLA_FP8_VALUE_PAIRS`).

The latent tile is the value operand of ``p · V`` with the keys as its contraction axis: an
8-bit transposed operand, read byte by byte from shared memory by mma.sync (128
``ld.shared.b8`` at 16 heads, 32-key tiles on sm_90). Read as int16 pairs of adjacent latent
columns it goes through ``ldmatrix.trans``; the bytes are split by parity in registers and
feed two half-width dots. Against the float64 oracle over the dequantised latents
(block-permuted pools with a noisy null page; e4m3fn and e5m2; decode, verify, tree masks,
splits, rank 512 + rope 64), with a spy that the launches took the path, and fallbacks where
the cache layout cannot pair (rows off 16-byte boundaries). sm_90 build:
``test_triton_pipelining.py``.
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._launch_options import spy_constexpr
from ._triton_util import HAS_CUDA, INTERPRET, requires_triton
from .test_triton_mla import RTOL, MLACase

pytestmark = requires_triton

FORMATS = [pytest.param(torch.float8_e4m3fn, id="e4m3fn"),
           pytest.param(torch.float8_e5m2, id="e5m2")]


@pytest.fixture
def pairs(monkeypatch):
    from aiter_attn.kernels.triton.mla import TritonMLA

    return spy_constexpr(monkeypatch, TritonMLA, "V_PAIRS")


CASES = [
    pytest.param(dict(q_lens=[1, 1, 1], kv_lens=[5, 17, 33], page=16), {}, id="decode-p16"),
    pytest.param(dict(q_lens=[3, 2], kv_lens=[30, 49], page=48), {}, id="verify-p48"),
    pytest.param(dict(q_lens=[4, 1, 2], kv_lens=[30, 3, 64], page=8, mask_p=0.7),
                 {"num_kv_splits": 2}, id="tree-mask-split2"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[65, 20], page=64, rank=512, rope=64),
                 {"num_kv_splits": 2}, id="R512-rope64-p64"),
]


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case_kw,launch", CASES)
def test_mla_value_pairs_vs_oracle(pairs, fp8, dtype, case_kw, launch):
    case = MLACase(**case_kw, dtype=dtype, kv_dtype=fp8, kv_scale=0.05, seed=3)
    out = case.run(v_pairs=True, **launch)
    assert_close_rel(out, case.expected(), RTOL[dtype], "MLA value pairs")
    assert pairs and all(pairs), pairs


def test_mla_value_pairs_on_by_default(pairs):
    """No keyword: an fp8 cache's values are read as pairs (H200, 16 heads 64x4k: 0.97 ->
    1.32 TB/s, docs/benchmarks.md)."""
    case = MLACase([1, 2], [40, 21], page=16, dtype=torch.float16,
                   kv_dtype=torch.float8_e4m3fn, kv_scale=0.05, seed=5)
    assert_close_rel(case.run(), case.expected(), RTOL[torch.float16], "default fp8 reads")
    assert pairs and all(pairs), pairs


def test_mla_byte_wise_reads_when_off_and_bf16_untouched(pairs):
    case = MLACase([1, 2], [40, 21], page=16, dtype=torch.float16,
                   kv_dtype=torch.float8_e5m2, kv_scale=0.05, seed=4)
    assert_close_rel(case.run(v_pairs=False), case.expected(), RTOL[torch.float16],
                     "byte-wise reads")
    same = MLACase([1, 2], [40, 21], page=16, dtype=torch.float16, seed=4)
    assert_close_rel(same.run(v_pairs=True), same.expected(), RTOL[torch.float16],
                     "a 16-bit cache has nothing to pair")
    assert pairs and not any(pairs), pairs


def test_mla_value_pairs_fall_back_off_16_byte_rows(pairs):
    """Rank 64 + rope 8: 72-byte latent rows (8-byte aligned, not 16): byte-wise reads."""
    case = MLACase([1, 1], [50, 9], page=16, rope=8, dtype=torch.float16,
                   kv_dtype=torch.float8_e5m2, kv_scale=0.05, seed=5)
    assert case.kv_cache.stride(1) % 16 == 8
    assert_close_rel(case.run(v_pairs=True), case.expected(), RTOL[torch.float16],
                     "byte-wise reads off 16-byte rows")
    assert pairs and not any(pairs), pairs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("shape", [
    pytest.param(dict(q_lens=[1] * 8, kv_lens=[4096] * 8, page=64), id="decode-8x4k-p64"),
    pytest.param(dict(q_lens=[4, 2], kv_lens=[1500, 130], page=64), id="verify-p64"),
    pytest.param(dict(q_lens=[1, 1], kv_lens=[300, 99], page=48, heads=20), id="H20-p48"),
])
def test_gpu_mla_value_pairs(pairs, fp8, shape):
    """DeepSeek latents (rank 512, rope 64) on CUDA, bf16 queries (fp16 dots)."""
    case = MLACase(**shape, rank=512, rope=64, dtype=torch.bfloat16, kv_dtype=fp8,
                   kv_scale=0.05, device="cuda")
    out = case.run(v_pairs=True)
    assert_close_rel(out, case.expected(), RTOL[torch.bfloat16], "MLA value pairs on CUDA")
    assert pairs and all(pairs), pairs
