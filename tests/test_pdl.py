"""Programmatic dependent launch (PDL, sm_90+, a tuning option: off by default): the Triton
paged-attention launch and its split reduction (and the MLA kernel and its merge) may start
while the kernel before each one still runs, and wait (``griddepcontrol.wait``) before
their first read.

CPU: the plan asks for PDL exactly where the tuning turns it on and the device has it (the
interpreter never: it has no inline PTX). The sm_90 PTX ordering (wait before the first
global read) is checked in ``test_triton_pipelining.py``. GPU: the same bits with and
without PDL, eager and replayed, and a captured graph whose cache write right before the
attention launch is seen by it (a missing wait would read the old K/V).
"""

from __future__ import annotations

import copy

import pytest
import torch

from aiter_attn.testing.compare import assert_close_rel

from ._triton_util import HAS_CUDA, requires_triton
from .test_triton_paged_attention import Case

pytestmark = requires_triton


def _plan_kw(monkeypatch, supported: bool, override=None):
    from aiter_attn.kernels.base import _adhoc_metadata
    from aiter_attn.kernels.triton import _launch_config as lc
    from aiter_attn.kernels.triton.attention import TritonPagedAttention

    from aiter_attn.kernels.triton import _pdl

    monkeypatch.setattr(_pdl, "pdl_supported", lambda device: supported)
    if override is not None:
        monkeypatch.setitem(lc.TUNING_OVERRIDES, "pdl", override)
    c = Case([1, 1], [300, 40], hq=8, hkv=2, d=64, dtype=torch.float16, device="cpu")
    kernel = TritonPagedAttention(TritonPagedAttention.request_for(c.q, c.k_cache, c.v_cache))
    md = _adhoc_metadata(c.q, c.k_cache, c.cu, c.seqused_k, c.block_table, None, None, 1, 300,
                         "paged_attention")
    return kernel.plan(md).cfg_kw


def test_plan_asks_for_pdl_only_when_tuned_on_and_supported(monkeypatch):
    """Off by default (slower at small batch on the H200); ``TUNING_OVERRIDES["pdl"]``:
    ``True`` both launches, ``"reduce"`` only the reduction (the attention kernel still
    signals it, ``PDL``, but is launched plainly)."""
    kw = _plan_kw(monkeypatch, True)
    assert kw["PDL"] is False and "launch_pdl" not in kw
    kw = _plan_kw(monkeypatch, True, override=True)
    assert kw["PDL"] is True and kw["launch_pdl"] is True
    kw = _plan_kw(monkeypatch, True, override="reduce")
    assert kw["PDL"] is True and "launch_pdl" not in kw
    kw = _plan_kw(monkeypatch, False, override=True)
    assert kw["PDL"] is False and "launch_pdl" not in kw


def test_pdl_is_never_supported_off_cuda_or_in_the_interpreter(monkeypatch):
    from aiter_attn.kernels.triton import _pdl

    assert _pdl.pdl_supported(torch.device("cpu")) is False
    monkeypatch.setattr(_pdl, "interpreting", lambda: True)
    assert _pdl.pdl_supported(torch.device("cuda", 0)) is False


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_pdl_same_bits_and_sees_the_write_before_it():
    """Split decode (GQA 32/8, d128, page 16, bf16; 3 rows of up to 3,000 keys over a
    block-permuted pool): PDL on and off give the same bits eagerly; a captured graph of
    (cache write, attention) replayed after new values were staged matches the oracle of
    the new cache, so the attention launch waited for the write."""
    from aiter_attn.kernels.triton import _launch_config as lc
    from aiter_attn.kernels.triton._pdl import pdl_supported
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    dev = torch.device("cuda")
    if not pdl_supported(dev):
        pytest.skip("programmatic dependent launch needs sm_90+")
    c = Case([1, 1, 1], [3000, 1700, 2500], hq=32, hkv=8, d=128, dtype=torch.bfloat16,
             device="cuda", seed=3)
    q, kc, vc = c.q.cuda(), c.k_cache.cuda(), c.v_cache.cuda()
    idx = dict(cu_seqlens_q=c.cu.cuda(), seqused_k=c.seqused_k.cuda(),
               block_table=c.block_table.cuda(), softmax_scale=c.scale, max_seqlen_q=1,
               max_seqlen_k=3000)
    outs = {}
    saved = dict(lc.TUNING_OVERRIDES)
    try:
        for pdl in (False, True, "reduce"):
            lc.TUNING_OVERRIDES.clear()
            lc.TUNING_OVERRIDES["pdl"] = pdl
            o = torch.full((3, 32, 128), float("nan"), dtype=torch.bfloat16, device=dev)
            paged_attention_triton(q, kc, vc, o, **idx)
            outs[pdl] = o
        assert torch.equal(outs[False], outs[True])
        assert torch.equal(outs[False], outs["reduce"])
        assert_close_rel(outs[True], c.expected(), 1.2e-2, "pdl eager")

        # graph: the cache is rewritten by a copy kernel right before the attention launch
        lc.TUNING_OVERRIDES.clear()
        lc.TUNING_OVERRIDES["pdl"] = True
        staged_k, staged_v = kc.clone(), vc.clone()
        out = torch.empty(3, 32, 128, dtype=torch.bfloat16, device=dev)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up (compile) outside capture
                kc.copy_(staged_k)
                vc.copy_(staged_v)
                paged_attention_triton(q, kc, vc, out, **idx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kc.copy_(staged_k)
            vc.copy_(staged_v)
            paged_attention_triton(q, kc, vc, out, **idx)
        # new cache contents staged; the oracle reads them through the same block table
        g = torch.Generator().manual_seed(4)
        fresh = copy.copy(c)
        fresh.k_cache, fresh.v_cache = (torch.randn(t.shape, generator=g).to(t.dtype)
                                        for t in (c.k_cache, c.v_cache))

        def dense(cache):  # each request's keys in order, through its pages
            return [cache[c.block_table[b, : -(-L // 16)].long()].flatten(0, 1)[:L].float()
                    for b, L in enumerate(c.kv_lens)]

        fresh.dense_k, fresh.dense_v = dense(fresh.k_cache), dense(fresh.v_cache)
        staged_k.copy_(fresh.k_cache)
        staged_v.copy_(fresh.v_cache)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_rel(out, fresh.expected(), 1.2e-2, "pdl replay after a new write")
    finally:
        lc.TUNING_OVERRIDES.clear()
        lc.TUNING_OVERRIDES.update(saved)
