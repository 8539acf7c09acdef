"""The carried page lookup (the paged Triton kernel's ``PAGE_AHEAD``,
``TUNING_OVERRIDES["page_ahead"]``, default :data:`~aiter_attn.kernels.triton._launch_config.
CARRIED_PAGE_LOOKUP`): on the per-tile lookup, each tile's page ids are read during the
tile before and carried by the loop, so that Triton's pipeliner can keep K/V copies in
flight while a tile computes.

Against the float64 oracle on block-permuted pools whose null page 0 is noise (decode, the
split path, prefill with a prefix, pages inside one tile and tiles inside one page, page
size 48 that neither divides nor is divided by the tile, windows / sinks / soft-cap, fp8 and
per-(token, head) scales); a spy confirms the launches took it. The sm_90 pipelining it buys
is guarded in ``test_triton_pipelining.py``.
"""

from __future__ import annotations

import pytest
import torch

from ._launch_options import (PAGING_SHAPES, check_plain_and_featured,
                              check_token_head_case, spy_launch_option)
from ._triton_util import HAS_CUDA, INTERPRET, requires_triton
from .test_triton_paged_attention import Case, _check

pytestmark = requires_triton


@pytest.fixture
def ahead(monkeypatch):
    """Turns ``page_ahead`` on (on the per-tile lookup: ``page_chunk`` 0); the ``PAGE_AHEAD``
    constexpr of every launch planned."""
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_chunk", 0)
    return spy_launch_option(monkeypatch, "PAGE_AHEAD", "page_ahead")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", PAGING_SHAPES)
def test_carried_page_lookup_vs_oracle(ahead, dtype, q_lens, kv_lens, hq, hkv, d, page):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=d + page)
    check_plain_and_featured(case, "carried page ids", window=11, softcap=5.0, sinks_seed=1)
    assert ahead and all(ahead), ahead


@pytest.mark.parametrize("splits", [2, 5])
def test_carried_page_lookup_split_path(ahead, monkeypatch, splits):
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", splits)
    case = Case([1, 1, 2], [200, 9, 77], hq=8, hkv=2, d=32, page=16, dtype=torch.float16,
                seed=splits)
    _check(case, f"carried page ids, {splits} splits")
    assert ahead and all(ahead), ahead


def test_carried_page_lookup_fp8_and_token_scales(ahead, monkeypatch):
    from aiter_attn.kernels.triton import paged_attention as pa

    case = Case([1, 4, 1], [150, 60, 33], hq=8, hkv=2, d=64, page=16, dtype=torch.float16,
                kv_dtype=torch.float8_e5m2, k_scale=0.1, v_scale=0.5, seed=6)
    _check(case, "carried page ids, fp8 e5m2 cache")
    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", 3)
    monkeypatch.setitem(pa.TUNING_OVERRIDES, "v_pairs", True)  # both options together
    check_token_head_case(torch.float8_e4m3fn, 8,
                          "carried page ids, value pairs, per-(token, head) scales")
    assert ahead and all(ahead), ahead


def test_no_carried_lookup_on_the_chunked_lookup(ahead, monkeypatch):
    """The option only replaces the per-tile lookup: a chunked launch keeps its chunks."""
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_chunk", 2)
    case = Case([1, 1], [200, 50], hq=8, hkv=2, d=32, page=16, dtype=torch.float16, seed=2)
    _check(case, "chunked lookup")
    assert ahead and not any(ahead), ahead


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("dtype,kv_dtype", [
    pytest.param(torch.bfloat16, None, id="bf16"),
    pytest.param(torch.bfloat16, torch.float8_e4m3fn, id="bf16-fp8e4m3fn"),
])
@pytest.mark.parametrize("q_lens,kv_lens,page", [
    pytest.param([1] * 16, [4096] * 16, 16, id="decode-16x4k"),
    pytest.param([1] * 3, [4100, 33, 1], 16, id="decode-split"),
    pytest.param([300, 1, 77], [300, 2000, 1000], 48, id="mixed-page48"),
    pytest.param([257], [1700], 64, id="extend-page64"),
])
def test_gpu_carried_page_lookup(ahead, dtype, kv_dtype, q_lens, kv_lens, page):
    """The compiled, software-pipelined loop (K/V copies two tiles ahead on sm_90) on
    CUDA-sized shapes: GQA 32/8, head dim 128, with and without window + sinks + soft-cap."""
    scales = dict(k_scale=0.07, v_scale=0.3) if kv_dtype is not None else {}
    case = Case(q_lens, kv_lens, hq=32, hkv=8, d=128, page=page, dtype=dtype,
                kv_dtype=kv_dtype, seed=len(q_lens), device="cuda", **scales)
    check_plain_and_featured(case, "carried page ids", window=511, softcap=30.0,
                             sinks_seed=0)
    assert ahead and all(ahead), ahead


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
def test_gpu_one_wave_decode_takes_the_carried_lookup_by_default(monkeypatch):
    """No override: bf16 decode with about one wave of (request, KV head) programs (16x4k on
    an H100/H200) launches without splits on the carried lookup, and matches the oracle."""
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import paged_attention as pa

    from ._launch_options import spy_constexpr

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for key in ("page_ahead", "page_chunk", "num_splits", "block_n"):
        monkeypatch.delitem(pa.TUNING_OVERRIDES, key, raising=False)
    ahead = spy_constexpr(monkeypatch, attn.TritonPagedAttention, "PAGE_AHEAD")
    split = spy_constexpr(monkeypatch, attn.TritonPagedAttention, "SPLIT")
    batch = sms // 8  # 8 KV heads: at most one program per SM, at least 3/4 of them
    case = Case([1] * batch, [4096 - 37 * (i % 5) for i in range(batch)], hq=32, hkv=8,
                d=128, page=16, dtype=torch.bfloat16, seed=batch, device="cuda")
    _check(case, "one-wave decode")
    big_smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin >= 162 * 1024
    assert ahead and all(ahead) == big_smem and not any(split), (ahead, split)
