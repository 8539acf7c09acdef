"""Defects found hunting the Triton kernels' numerics in the interpreter (paged attention,
extend, dense prefill, MLA with its launch options, merge_attention_states, KV writes against
the float64 oracle / the reference on block-permuted pools with a null page 0): each test
failed before its fix.

The functional entry points of the Triton kernels (``paged_attention_triton``,
``mla_paged_attention``) promise the contract of the ``ops`` functions but took per-call
tensors of the wrong shape or dtype without a word: a short ``sinks`` was read past its end,
an ``lse`` of the wrong shape or dtype was written with the row layout of ``[T, H]`` float32
(an ``lse`` smaller than ``[T, H]`` was written past its end: heap corruption, ``free():
invalid size``), query heads that are not whole groups of the KV heads gave wrong rows, and an
MLA ``out`` wider than ``R`` kept garbage columns. They are now refused before the launch.
Inputs here are the same size as the valid ones, so nothing is written out of bounds before
the fix.
"""

from __future__ import annotations

import pytest
import torch

from ._triton_util import requires_triton
from .test_triton_mla import MLACase
from .test_triton_paged_attention import Case

pytestmark = requires_triton


def test_paged_attention_triton_refuses_bad_sinks_lse_and_groups():
    case = Case([1, 3], [20, 9], hq=8, hkv=2, d=32, page=16)
    t, hq = case.q.shape[0], case.hq
    with pytest.raises(ValueError, match="sinks"):
        case.run(sinks=torch.randn(hq // 2))  # read past its end before
    with pytest.raises(ValueError, match="lse"):
        case.run(lse=torch.empty(hq, t))  # [H, T]: written as [T, H] before
    with pytest.raises(ValueError, match="lse"):
        case.run(lse=torch.empty(t, hq, dtype=torch.float16))
    bad = Case([1, 2], [9, 5], hq=6, hkv=4, d=32, page=16)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="multiple"):
        bad.run()


def test_mla_paged_attention_refuses_bad_out_and_lse():
    from aiter_attn.kernels.triton.mla import mla_paged_attention

    case = MLACase([1, 2], [20, 9], heads=4, rank=32, rope=16, page=16)
    t, h = case.q.shape[0], case.heads
    with pytest.raises(ValueError, match="lse"):
        case.run(lse=torch.empty(h, t))  # [H, T]: written as [T, H] before
    with pytest.raises(ValueError, match="lse"):
        case.run(lse=torch.empty(t, h, dtype=torch.float16))
    wide = torch.zeros(t, h, case.q.shape[2])  # R + rope columns: R written, rope left as is
    with pytest.raises(ValueError, match="out"):
        mla_paged_attention(case.q, case.kv_cache, wide, **case.kwargs())


def test_paged_attention_5d_triton_refuses_bad_sinks_and_lse():
    """The 5-D entry point (same kernel, KV heads on axis 1 of its cache) had no such check: a
    short ``sinks`` was read past its end and an ``lse`` of the wrong shape or dtype written
    in the ``[T, H]`` float32 layout."""
    from .test_triton_5d import _run_5d

    case = Case([1, 3], [20, 9], hq=8, hkv=2, d=32, page=16)
    t, hq = case.q.shape[0], case.hq
    with pytest.raises(ValueError, match="sinks"):
        _run_5d(case, v_shuffled=True, sinks=torch.randn(hq // 2))
    with pytest.raises(ValueError, match="lse"):
        _run_5d(case, v_shuffled=True, lse=torch.empty(hq, t))
    with pytest.raises(ValueError, match="lse"):
        _run_5d(case, v_shuffled=False, lse=torch.empty(t, hq, dtype=torch.float16))


def test_extend_attention_refuses_bad_sinks_and_lse():
    """The two-pass extend's functional call: the same per-call checks (KV heads from the new
    ``k`` ``[T, Hkv, D]``)."""
    from aiter_attn.kernels.triton.extend import TritonExtendAttention

    from .test_triton_prefill_extend import _new_kv

    case = Case([3, 1], [10, 7], hq=8, hkv=2, d=32, page=4, seed=2)
    k, v = _new_kv(case)
    t, hq = case.q.shape[0], case.hq
    out = torch.empty(t, hq, case.dv, dtype=case.dtype)
    kw = dict(cu_seqlens_q=case.cu, seqused_k=case.seqused_k, block_table=case.block_table,
              softmax_scale=case.scale)
    call = TritonExtendAttention()
    with pytest.raises(ValueError, match="sinks"):
        call(case.q, k, v, case.k_cache, case.v_cache, out, sinks=torch.randn(hq // 2), **kw)
    with pytest.raises(ValueError, match="lse"):
        call(case.q, k, v, case.k_cache, case.v_cache, out, lse=torch.empty(hq, t), **kw)
