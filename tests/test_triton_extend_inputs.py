"""Inputs of the two-pass ``extend_attention`` (:mod:`aiter_attn.kernels.triton.extend`) and
the dense prefill kernel (:mod:`aiter_attn.kernels.triton.prefill`) it launches: int64
request offsets (allowed for every index input of the ops) give the oracle's result, and new
keys/values whose shape or dtype does not match the layer are refused before any launch with
an error naming the argument (they used to give silently wrong rows, NaN, or an interpreter
assertion from inside the kernel).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.triton.extend import extend_attention_request
from aiter_attn.plugins import kernel_registry
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import requires_triton
from .test_triton_paged_attention import RTOL, Case
from .test_triton_prefill import DenseCase
from .test_triton_prefill_extend import _new_kv, _oracle

pytestmark = requires_triton


def _extend(case: Case, *, cu=None, seqused_k=None, k=None, v=None):
    """One functional ``extend_attention`` call (new K/V from the case unless given)."""
    dev = case.device
    k_new, v_new = _new_kv(case)
    k = k_new if k is None else k
    v = v_new if v is None else v
    q = case.q.to(dev)
    out = torch.full((q.shape[0], case.hq, case.dv), float("nan"), dtype=case.dtype, device=dev)
    req = extend_attention_request(q, case.k_cache, case.v_cache)
    fn = kernel_registry().select(req, backend="triton").fn
    fn(q, k.to(dev), v.to(dev), case.k_cache.to(dev), case.v_cache.to(dev), out,
       cu_seqlens_q=(case.cu if cu is None else cu).to(dev),
       seqused_k=(case.seqused_k if seqused_k is None else seqused_k).to(dev),
       block_table=case.block_table.to(dev), softmax_scale=case.scale)
    return out


@pytest.mark.parametrize("index_dtypes", [
    pytest.param((torch.int64, torch.int32), id="cu-int64"),
    pytest.param((torch.int64, torch.int64), id="cu-int64-seqused-int64"),
])
def test_extend_int64_request_offsets(index_dtypes):
    """int64 ``cu_seqlens_q`` (an allowed index dtype) used to fail inside the dense kernel
    (its tensor-descriptor loads take 32-bit offsets only)."""
    cu_dtype, sk_dtype = index_dtypes
    case = Case([3, 1, 5, 0], [10, 7, 5, 4], hq=10, hkv=2, d=32, page=3, seed=2)
    out = _extend(case, cu=case.cu.to(cu_dtype), seqused_k=case.seqused_k.to(sk_dtype))
    assert_close_rel(out, _oracle(case)[0], RTOL[case.dtype], "extend, int64 offsets")


def test_dense_prefill_int64_offsets():
    """The dense kernel itself with int64 ``cu_seqlens_q``/``cu_seqlens_k``."""
    case = DenseCase([5, 1, 17], [9, 1, 17], hq=4, hkv=2, d=32, seed=3)
    case.cu_q, case.cu_k = case.cu_q.long(), case.cu_k.long()
    out, _ = case.run()
    assert_close_rel(out, case.oracle()[0], 2e-5, "dense prefill, int64 offsets")


def _bad_new_kv():
    case = Case([3, 2], [10, 2], hq=4, hkv=2, d=32, dv=16, page=16, seed=4)
    k, v = _new_kv(case)
    return case, k, v


@pytest.mark.parametrize("make,match", [
    pytest.param(lambda k, v: (torch.randn(k.shape[0], k.shape[1], 16), v), r"k.*\b16\b.*32",
                 id="k-head-dim"),
    pytest.param(lambda k, v: (k, torch.randn(v.shape[0], v.shape[1], 8)), r"v.*\b8\b.*16",
                 id="v-head-dim"),
    pytest.param(lambda k, v: (k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)),
                 r"k.*\b4\b.*\b2\b", id="kv-heads"),
    pytest.param(lambda k, v: (k.half(), v), r"k.*float16.*float32", id="k-dtype"),
    pytest.param(lambda k, v: (k, v.half()), r"v.*float16.*float32", id="v-dtype"),
])
def test_extend_refuses_mismatched_new_kv(make, match):
    """New keys/values must be ``[T, kv_heads, head_dim(_v)]`` in q's dtype, like the layer
    the kernel is bound to; anything else is refused with the argument named (a wrong head
    dim used to give silently wrong rows, a wrong value dim NaN, a wrong dtype an assertion
    from inside the kernel, other KV heads than the cache's another GQA grouping)."""
    case, k, v = _bad_new_kv()
    k, v = make(k, v)
    with pytest.raises(ValueError, match=match):
        _extend(case, k=k, v=v)


@pytest.mark.parametrize("what", ["k-head-dim", "v-dtype", "v-tokens", "out-dim"])
def test_dense_prefill_refuses_mismatched_operands(what):
    """:func:`dense_prefill` refuses k/v/out that do not fit q before launching."""
    from aiter_attn.kernels.triton.prefill import dense_prefill

    case = DenseCase([4, 2], [6, 2], hq=4, hkv=2, d=32, dv=16, seed=5)
    q, k, v = case.q, case.k, case.v
    out = torch.empty(q.shape[0], 4, 16)
    if what == "k-head-dim":
        k = torch.randn(k.shape[0], 2, 24)
    elif what == "v-dtype":
        v = v.half()
    elif what == "v-tokens":
        v = v[:-1]
    else:
        out = torch.empty(q.shape[0], 4, 32)
    with pytest.raises(ValueError, match="dense prefill"):
        dense_prefill(q, k, v, out, cu_seqlens_q=case.cu_q, cu_seqlens_k=case.cu_k,
                      max_seqlen_q=4, max_seqlen_k=6, softmax_scale=case.scale)
