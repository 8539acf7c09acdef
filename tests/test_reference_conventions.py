"""Hand-computed convention cases for ops.paged_attention (reference kernel): window
convention, sinks, soft-cap, fully masked rows, causal offsets of ragged queries."""

import math

import pytest
import torch

from aiter_attn import ops
from aiter_attn.testing.compare import assert_close_rel
from aiter_attn.testing.oracle import dense_attention


def _one_request(L, hq=1, hkv=1, d=4, page_size=4, seed=0, n_q=1):
    g = torch.Generator().manual_seed(seed)
    pages = -(-L // page_size)
    # pages 1..pages in reverse order, page 0 is the null page full of garbage
    k_cache = torch.randn(pages + 1, page_size, hkv, d, generator=g)
    v_cache = torch.randn(pages + 1, page_size, hkv, d, generator=g)
    table = torch.arange(pages, 0, -1, dtype=torch.int32).view(1, -1)
    q = torch.randn(n_q, hq, d, generator=g)
    k = k_cache[table[0].long()].reshape(-1, hkv, d)[:L]
    v = v_cache[table[0].long()].reshape(-1, hkv, d)[:L]
    args = dict(cu_seqlens_q=torch.tensor([0, n_q], dtype=torch.int32),
                seqused_k=torch.tensor([L], dtype=torch.int32), block_table=table)
    return q, k_cache, v_cache, k, v, args


def test_window_one_sees_only_itself():
    """HF sliding_window=1 ⇒ (0, 0): each query attends to exactly its own key."""
    q, kc, vc, k, v, a = _one_request(9, n_q=3)
    out = ops.paged_attention(q, kc, vc, softmax_scale=0.5, window_size=(0, 0), **a)
    assert torch.allclose(out, v[-3:], atol=1e-6)


@pytest.mark.parametrize("w", [1, 2, 5, 6, 7], ids=lambda w: f"w{w}")
def test_window_boundary_counts_keys(w):
    """Query at position p with window (w-1, 0) sees keys p-w+1..p: with all-equal logits the
    output is the mean of exactly those w values (w-1, w, w+1 keys around a 6-key span)."""
    L = 6
    q, kc, vc, k, v, a = _one_request(L)
    q.zero_()  # equal logits: softmax is uniform over visible keys
    out = ops.paged_attention(q, kc, vc, softmax_scale=1.0, window_size=(w - 1, 0), **a)
    visible = v[max(0, L - w):L, 0]
    assert torch.allclose(out[0, 0], visible.mean(0), atol=1e-6)


def test_sink_is_an_unscaled_extra_logit():
    """One key, logit s = scale·q·k, sink logit t: out = v · e^s / (e^s + e^t)."""
    q, kc, vc, k, v, a = _one_request(1, d=4)
    scale, t = 0.7, 1.3
    s = float((q[0, 0] * k[0, 0]).sum()) * scale
    out = ops.paged_attention(q, kc, vc, softmax_scale=scale, sinks=torch.tensor([t]), **a)
    w = math.exp(s) / (math.exp(s) + math.exp(t))
    assert torch.allclose(out[0, 0], v[0, 0] * w, atol=1e-6)


def test_softcap_formula():
    """Two keys: weights follow softmax(c·tanh(s/c))."""
    q, kc, vc, k, v, a = _one_request(2, d=4)
    q.mul_(8.0)
    scale, cap = 1.0, 2.0
    s = (k[:, 0] @ q[0, 0]) * scale
    p = torch.softmax(cap * torch.tanh(s / cap), 0)
    out = ops.paged_attention(q, kc, vc, softmax_scale=scale, softcap=cap, **a)
    assert torch.allclose(out[0, 0], p @ v[:, 0], atol=1e-5)


def test_fully_masked_row_is_zero_not_nan():
    """A custom mask hiding every key yields zeros; with a sink it also yields zeros."""
    q, kc, vc, k, v, a = _one_request(5)
    mask = torch.zeros(5, dtype=torch.bool)
    indptr = torch.tensor([0, 5], dtype=torch.int64)
    out = ops.paged_attention(q, kc, vc, softmax_scale=1.0, custom_mask=mask, mask_indptr=indptr, **a)
    assert torch.equal(out, torch.zeros_like(out))
    out = ops.paged_attention(q, kc, vc, softmax_scale=1.0, custom_mask=mask, mask_indptr=indptr,
                              sinks=torch.tensor([0.5]), **a)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("width", [0, 2], ids=["no-table", "table"])
def test_request_without_keys_is_zero_with_lse_minus_inf(width):
    """A non-causal query of a request with no key (``seqused_k`` 0; its block-table row
    of ``width`` pages unread) is zeros with LSE −inf; with a sink, zeros with LSE = the
    sink. The request beside it (7 keys) is the oracle's. The reference kernel raised on an
    empty reduction here."""
    q, kc, vc, k, v, a = _one_request(7, hq=2, hkv=1, d=4)
    q2 = torch.cat([torch.randn(1, 2, 4), q])
    live = a["block_table"]  # [1, 2]: the 7 keys' two pages
    table = (torch.cat([torch.zeros_like(live), live]) if width
             else torch.zeros(2, 0, dtype=torch.int32))
    args = dict(cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                seqused_k=torch.tensor([0, 7 if width else 0], dtype=torch.int32),
                block_table=table)
    out, lse = ops.paged_attention(q2, kc, vc, softmax_scale=0.5, causal=False,
                                   return_lse=True, **args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(lse[0], torch.full_like(lse[0], float("-inf")))
    if width:
        ref = dense_attention(q, k, v, scale=0.5, causal=False)
        assert_close_rel(out[1:], ref, 1e-5, "live request")
    sink = torch.tensor([0.5, -1.0])
    out, lse = ops.paged_attention(q2, kc, vc, softmax_scale=0.5, causal=False, sinks=sink,
                                   return_lse=True, **args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.allclose(lse[0], sink)


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["full", "w4"])
def test_ragged_queries_are_last_tokens(window):
    """Query i of n sits at position L-n+i: matches the float64 oracle for a 5:1 GQA request."""
    q, kc, vc, k, v, a = _one_request(23, hq=10, hkv=2, d=80, page_size=7, n_q=6)
    out = ops.paged_attention(q, kc, vc, softmax_scale=80 ** -0.5, window_size=window, **a)
    ref = dense_attention(q, k, v, scale=80 ** -0.5, window=window)
    assert_close_rel(out, ref, 1e-5, "ragged")
