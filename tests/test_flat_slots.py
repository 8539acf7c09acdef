"""Slot-index K/V addressing (the paged Triton kernel's ``FLAT_SLOTS``,
``TUNING_OVERRIDES["flat_slots"]``, ``LaunchConfig.flat_slots``): on contiguous NHD pages a
key's row is ``(page · page_size + in_page) · token_stride``, an int32 slot index widened
once, instead of two 64-bit products per row.

Against the float64 oracle on block-permuted pools whose null page 0 is noise (decode, the
split path, prefill with a prefix, pages inside one tile and tiles inside one page, page
size 48, page size 1, windows / sinks / soft-cap, the carried page lookup on top); strided
(HND-stored) caches must not take it, and a spy confirms which launches did.
"""

from __future__ import annotations

import pytest
import torch

from ._launch_options import (PAGING_SHAPES, check_plain_and_featured, spy_constexpr,
                              spy_launch_option)
from ._triton_util import HAS_CUDA, INTERPRET, requires_triton
from .test_triton_paged_attention import Case, _check

pytestmark = requires_triton


@pytest.fixture
def flat(monkeypatch):
    """Turns ``flat_slots`` on; the ``FLAT_SLOTS`` constexpr of every launch planned."""
    return spy_launch_option(monkeypatch, "FLAT_SLOTS", "flat_slots")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page", PAGING_SHAPES)
def test_slot_addressing_vs_oracle(flat, dtype, q_lens, kv_lens, hq, hkv, d, page):
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype, seed=d + page)
    check_plain_and_featured(case, "slot addressing", window=11, softcap=5.0, sinks_seed=1)
    assert flat and all(flat), flat


@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("ahead", [False, True], ids=["per-tile", "carried"])
def test_slot_addressing_split_path(flat, monkeypatch, splits, ahead):
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, "num_splits", splits)
    if ahead:  # with the carried page lookup too (the per-tile lookup: page_chunk 0)
        monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_chunk", 0)
        monkeypatch.setitem(pa.TUNING_OVERRIDES, "page_ahead", True)
    case = Case([1, 1, 2], [200, 9, 77], hq=8, hkv=2, d=32, page=16, dtype=torch.float16,
                seed=splits)
    _check(case, f"slot addressing, {splits} splits")
    assert flat and all(flat), flat


def test_strided_pages_keep_page_addressing(flat):
    """Caches stored head-major (HND, passed as a strided NHD view): the page stride is not
    page_size token rows, so the launch keeps the page · stride form, and is exact."""
    case = Case([1, 1, 3], [150, 20, 61], hq=8, hkv=2, d=32, page=16, dtype=torch.float16,
                seed=4)
    case.k_cache = case.k_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    case.v_cache = case.v_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    _check(case, "HND-stored caches")
    assert flat and not any(flat), flat


def test_default_takes_it_for_decode_only(monkeypatch):
    """No override: a decode batch launches with slot addressing, an extend batch without."""
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.delitem(pa.TUNING_OVERRIDES, "flat_slots", raising=False)
    seen = spy_constexpr(monkeypatch, attn.TritonPagedAttention, "FLAT_SLOTS")
    _check(Case([1, 1], [90, 33], hq=8, hkv=2, d=32, page=16, dtype=torch.float16, seed=7),
           "decode, default")
    assert seen and all(seen), seen
    seen.clear()
    _check(Case([40, 9], [90, 33], hq=8, hkv=2, d=32, page=16, dtype=torch.float16, seed=8),
           "extend, default")
    assert seen and not any(seen), seen


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="compiled Triton on CUDA")
@pytest.mark.parametrize("q_lens,kv_lens,page", [
    pytest.param([1], [9000], 16, id="decode-bs1-split"),
    pytest.param([1] * 3, [4100, 33, 1], 16, id="decode-split"),
    pytest.param([1] * 40, [700 + 13 * i for i in range(40)], 16, id="decode-bs40"),
    pytest.param([1] * 2, [3000, 129], 64, id="decode-page64"),
])
def test_gpu_slot_addressing_default(monkeypatch, q_lens, kv_lens, page):
    """The compiled launches with the library's default on CUDA-sized shapes that take slot
    addressing on a GPU of 132 SMs (at most two programs per SM, or no splits): GQA 32/8,
    head dim 128, bf16, with and without window + sinks + soft-cap."""
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.delitem(pa.TUNING_OVERRIDES, "flat_slots", raising=False)
    seen = spy_constexpr(monkeypatch, attn.TritonPagedAttention, "FLAT_SLOTS")
    case = Case(q_lens, kv_lens, hq=32, hkv=8, d=128, page=page, dtype=torch.bfloat16,
                seed=len(q_lens), device="cuda")
    check_plain_and_featured(case, "slot addressing (default)", window=511, softcap=30.0,
                             sinks_seed=0)
    assert seen and all(seen), seen
