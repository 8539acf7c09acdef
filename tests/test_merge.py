"""``ops.merge_attention_states`` (reference and Triton) against a float64 formula, fully masked
parts (lse = -inf on one or both sides) included, and the split identity: attention over keys
``[0, n)`` equals the merge of attention over ``[0, m)`` and over ``[m, n)``, checked against the
float64 dense oracle (random data, block-permuted tables with a null page 0, head dim 80,
page 48, GQA 5:1, windows, sinks, soft-cap, fp8).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import DEVICE, requires_triton
from .test_lse import _oracle, assert_lse
from .test_triton_paged_attention import Case

pytestmark = requires_triton

BACKENDS = ["reference", "triton"]
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _merge64(o_a, lse_a, o_b, lse_b):
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa, wb = torch.exp(la - m), torch.exp(lb - m)
    den = wa + wb
    o = (torch.where(wa[..., None] > 0, wa[..., None] * o_a.double(), 0.0)
         + torch.where(wb[..., None] > 0, wb[..., None] * o_b.double(), 0.0))
    o = o / torch.where(den > 0, den, 1.0)[..., None]
    return o, torch.where(den > 0, m + torch.log(torch.where(den > 0, den, 1.0)), -torch.inf)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("t,h,d", [(7, 5, 80), (1, 1, 16), (3, 33, 128)])
def test_merge_formula(backend, dtype, t, h, d):
    g = torch.Generator().manual_seed(t * h + d)
    o_a = torch.randn(t, h, d, generator=g).to(dtype)
    o_b = torch.randn(t, h, d, generator=g).to(dtype)
    lse_a = torch.randn(t, h, generator=g) * 5
    lse_b = torch.randn(t, h, generator=g) * 5
    # fully masked parts: one side, the other side, both
    lse_a.view(-1)[::3] = float("-inf")
    lse_b.view(-1)[1::4] = float("-inf")
    lse_b.view(-1)[::6] = float("-inf")
    o_a.view(t * h, d)[::3] = float("nan")  # an unwritten part's garbage must not leak
    out, lse = ops.merge_attention_states(o_a.to(DEVICE), lse_a.to(DEVICE), o_b.to(DEVICE),
                                          lse_b.to(DEVICE), backend=backend)
    eo, el = _merge64(o_a, lse_a, o_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_rel(out, eo, RTOL[dtype], f"merge {backend}")
    assert_lse(lse, el, 1e-6, f"merge {backend}")
    both = torch.isneginf(lse_a) & torch.isneginf(lse_b)
    assert both.any() and (out.cpu()[both] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_in_place_and_strided(backend):
    g = torch.Generator().manual_seed(1)
    o_a, o_b = torch.randn(4, 6, 32, generator=g), torch.randn(4, 6, 32, generator=g)
    lse_a = torch.randn(6, 4, generator=g).t()  # non-contiguous [4, 6]
    lse_b = torch.randn(4, 6, generator=g)
    eo, el = _merge64(o_a, lse_a, o_b, lse_b)
    o_a, o_b, lse_a, lse_b = (x.to(DEVICE) for x in (o_a, o_b, lse_a, lse_b))
    out, lse = ops.merge_attention_states(o_a, lse_a, o_b, lse_b, out=o_a, out_lse=lse_b,
                                          backend=backend)
    assert out is o_a and lse is lse_b
    assert_close_rel(out, eo, 1e-6, "in place")
    assert_lse(lse, el, 1e-6, "in place")


def test_merge_validation():
    o = torch.zeros(2, 3, 16)
    lse = torch.zeros(2, 3)
    bad = [
        (dict(lse_a=torch.zeros(2, 3, dtype=torch.float16)), "lse_a"),
        (dict(lse_b=torch.zeros(3, 2)), "lse_b"),
        (dict(o_b=torch.zeros(2, 3, 8)), "o_b"),
        (dict(o_b=torch.zeros(2, 3, 16, dtype=torch.float16)), "o_b"),
        (dict(out=torch.zeros(2, 3, 17)), "out"),
        (dict(out_lse=torch.zeros(2, 4)), "out_lse"),
    ]
    for kw, name in bad:
        args = dict(o_a=o, lse_a=lse, o_b=o, lse_b=lse)
        args.update(kw)
        with pytest.raises((TypeError, ValueError), match=name):
            ops.merge_attention_states(**args)


def _part_inputs(case: Case, masks):
    dev = case.device
    flat = torch.cat([m.reshape(-1) for m in masks]).to(dev)
    indptr = torch.tensor([0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist())
    return flat, indptr.to(dev)


def _attend(case: Case, backend, block_table, seqused, masks, **kw):
    dev = case.device
    flat, indptr = _part_inputs(case, masks)
    if kw.get("sinks") is not None:
        kw["sinks"] = kw["sinks"].to(dev)
    return ops.paged_attention(
        case.q.to(dev), case.k_cache.to(dev), case.v_cache.to(dev),
        cu_seqlens_q=case.cu.to(dev), seqused_k=seqused.to(dev),
        block_table=block_table.to(dev), softmax_scale=case.scale,
        k_scale=case._scale(case.k_scale), v_scale=case._scale(case.v_scale),
        causal=False, custom_mask=flat, mask_indptr=indptr, backend=backend, return_lse=True,
        **kw)


def _visibility(q_lens, kv_lens, *, causal=True, window=(-1, -1)):
    """The bool ``[n, L]`` visibility of each request (positions as in ``paged_attention``)."""
    masks = []
    for n, L in zip(q_lens, kv_lens):
        pos = torch.arange(L - n, L).view(n, 1)
        key = torch.arange(L).view(1, L)
        vis = torch.ones(n, L, dtype=torch.bool)
        if causal:
            vis &= key <= pos
        if window[0] >= 0:
            vis &= key >= pos - window[0]
        if window[1] >= 0:
            vis &= key <= pos + window[1]
        masks.append(vis)
    return masks


SPLIT_CASES = [
    # id, q_lens, kv_lens, hq, hkv, d, page, split (pages), dtype, features
    pytest.param([1, 1, 4], [100, 96, 120], 10, 2, 80, 48, 1, torch.float32, {},
                 id="GQA5:1-D80-page48"),
    pytest.param([1, 3], [70, 40], 8, 2, 64, 16, 2, torch.float32,
                 {"window": (20, 0)}, id="window-crosses-split"),
    pytest.param([1, 2, 1], [60, 33, 50], 8, 2, 64, 16, 2, torch.float32,
                 {"sinks": True, "softcap": 5.0}, id="sinks-softcap"),
    pytest.param([1, 1], [40, 36], 8, 2, 64, 16, 1, torch.float16,
                 {"fp8": True}, id="fp8-e4m3"),
    pytest.param([2, 1], [40, 17], 4, 2, 32, 16, 1, torch.float32,
                 {"window": (3, 0)}, id="part-a-fully-masked"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_lens,kv_lens,hq,hkv,d,page,split_pages,dtype,feat", SPLIT_CASES)
def test_split_merge_equals_whole(backend, q_lens, kv_lens, hq, hkv, d, page, split_pages,
                                  dtype, feat):
    """attention(keys [0, n)) == merge(attention([0, m)), attention([m, n))) with
    ``m = split_pages · page``: part b reads the same pages from column ``split_pages`` of the
    block table; each part's visibility is the whole's restricted to its keys (a custom mask),
    so windows and causality stay in absolute positions. Sinks go into part a only."""
    fp8 = feat.get("fp8", False)
    case = Case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=page, dtype=dtype,
                kv_dtype=torch.float8_e4m3fn if fp8 else None,
                k_scale=0.5 if fp8 else None, v_scale=0.25 if fp8 else None, seed=d + page)
    window = feat.get("window", (-1, -1))
    sinks = (torch.randn(hq, generator=torch.Generator().manual_seed(4))
             if feat.get("sinks") else None)
    softcap = feat.get("softcap", 0.0)
    m = split_pages * page
    vis = _visibility(q_lens, kv_lens, window=window)
    whole_o, whole_lse = _oracle(case, window_size=window, sinks=sinks, softcap=softcap)

    seq_a = torch.tensor([min(m, L) for L in kv_lens], dtype=torch.int32)
    seq_b = torch.tensor([max(L - m, 0) for L in kv_lens], dtype=torch.int32)
    bt_b = torch.zeros_like(case.block_table)
    bt_b[:, : bt_b.shape[1] - split_pages] = case.block_table[:, split_pages:]
    o_a, lse_a = _attend(case, backend, case.block_table, seq_a,
                         [v[:, :m] for v in vis], sinks=sinks, softcap=softcap)
    o_b, lse_b = _attend(case, backend, bt_b, seq_b, [v[:, m:] for v in vis], softcap=softcap)
    out, lse = ops.merge_attention_states(o_a, lse_a, o_b, lse_b, backend=backend)
    rtol = RTOL[dtype]
    assert_close_rel(out, whole_o, rtol, f"{backend} merged parts")
    assert_lse(lse, whole_lse, rtol, f"{backend} merged parts")
    if window == (3, 0):  # the last query rows see nothing before m: part a is -inf there
        assert torch.isneginf(lse_a).any()
