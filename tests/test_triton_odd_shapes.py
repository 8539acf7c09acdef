"""Triton paged attention on shapes and batches the conformance grid leaves out, against the
float64 oracle (block-permuted pools with a null page 0, :class:`Case`): head dims 96/112/192
with a value head dim of their own, GQA 5:1 and MQA, pages of 1, 3, 48 and 64, requests
with no queries or no keys beside long ones, fewer keys than queries, and the 5-D layout with
one-token pages (whose V page axis PyTorch leaves with a non-unit stride even in a
``.contiguous()`` tensor: it has one element).

Bounds as in ``test_triton_paged_attention`` (float32 1e-5, float16 2e-3; the LSE 1e-5
absolute against the float64 oracle's in float32).
"""

from __future__ import annotations

import pytest
import torch

import aiter_attn.ops as ops
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention

from ._triton_util import requires_triton
from .test_triton_5d import _run_5d
from .test_triton_paged_attention import RTOL, Case

pytestmark = requires_triton


def _oracle_lse(case: Case, **kw):
    lses, t = [], 0
    for b, n in enumerate(case.q_lens):
        _, lse = dense_attention(case.q[t:t + n], case.dense_k[b], case.dense_v[b],
                                 scale=case.scale, return_lse=True, **kw)
        lses.append(lse)
        t += n
    return torch.cat(lses)


def _through_ops(case: Case, **kw):
    dev = case.device
    return ops.paged_attention(
        case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev),
        cu_seqlens_q=case.cu.to(dev), seqused_k=case.seqused_k.to(dev),
        block_table=case.block_table.to(dev), softmax_scale=case.scale, backend="triton",
        return_lse=True, **kw)


SHAPES = [
    # q_lens, kv_lens, hq, hkv, d, dv, page, causal
    pytest.param([1, 4, 1], [20, 9, 1], 5, 1, 96, 96, 3, True, id="D96-MQA5-page3"),
    pytest.param([2, 1], [10, 17], 4, 1, 112, 112, 1, True, id="D112-MQA-page1"),
    pytest.param([3, 1], [50, 70], 10, 2, 192, 128, 48, True, id="D192-Dv128-GQA5:1-page48"),
    pytest.param([1, 5], [65, 5], 10, 2, 80, 64, 64, True, id="D80-Dv64-page64"),
    pytest.param([0, 1, 6, 0], [5, 30, 40, 9], 4, 2, 32, 32, 16, True, id="q0-mixed"),
    pytest.param([2, 1, 3], [0, 5, 7], 4, 2, 32, 32, 4, False, id="kv0-non-causal"),
    pytest.param([4, 1], [2, 6], 4, 2, 32, 32, 4, True, id="kv-shorter-than-q"),
]


@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,dv,page,causal", SHAPES)
def test_odd_shapes_rows_and_lse(q_lens, kv_lens, hq, hkv, d, dv, page, causal):
    """Rows and the LSE against the oracle; rows with nothing visible are 0 with LSE -inf."""
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, dv=dv, page=page, seed=d + page)
    out, lse = _through_ops(case, causal=causal)
    assert_close_rel(out, case.expected(causal=causal), RTOL[case.dtype], "rows")
    want = _oracle_lse(case, causal=causal)
    dead = torch.isneginf(want)
    assert torch.equal(torch.isneginf(lse.cpu()), dead), "LSE -inf exactly where nothing is seen"
    assert (out.cpu()[dead] == 0).all(), "rows with nothing visible are zeros"
    assert (lse.cpu()[~dead].double() - want[~dead]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_5d_hd_page_with_one_token_pages(dtype):
    """hd_page V ``[pages, H, Dv, 1]``: a contiguous tensor whose one-element token axis has
    PyTorch's non-unit stride; it used to be refused as "not contiguous" (advice that cannot
    be followed: ``.contiguous()`` gives the same strides)."""
    case = Case([1, 5], [40, 9], hq=5, hkv=1, d=96, dv=48, page=1, dtype=dtype, seed=3)
    sinks = torch.randn(5, generator=torch.Generator().manual_seed(1))
    out = _run_5d(case, v_shuffled=False, sinks=sinks.to(case.device), softcap=3.0,
                  window_size=(7, 0))
    assert_close_rel(out, case.expected(sinks=sinks, softcap=3.0, window_size=(7, 0)),
                     RTOL[dtype], "5-D hd_page, page 1")
