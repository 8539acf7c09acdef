"""Helpers of the tests of the paged Triton kernel's launch options (``TUNING_OVERRIDES``
keys): a spy on the launch constexprs (which launches really took an option, so that a test
of the option cannot pass on launches that never used it) and a per-(token, head) scaled fp8
case against the oracle, and a case checked plainly and with every softmax feature on."""

from __future__ import annotations

import torch

from aiter_attn.testing.compare import assert_close_rel

import pytest

__all__ = ["spy_constexpr", "spy_launch_option", "check_token_head_case",
           "check_plain_and_featured", "PAGING_SHAPES"]

#: Paged batches that exercise a page-lookup option's cases: pages inside one tile, tiles
#: inside one page, a page size that neither divides nor is divided by the tile (48, with
#: GQA 5:1 and head dim 80), page size 1 (an extend over a prefix). Parameters
#: ``q_lens, kv_lens, hq, hkv, d, page``.
PAGING_SHAPES = [
    pytest.param([1, 1, 1, 1], [37, 1, 130, 16], 8, 2, 64, 16, id="decode-pages-in-tile"),
    pytest.param([1, 1, 1], [300, 64, 129], 8, 2, 32, 64, id="decode-tile-in-page"),
    pytest.param([9, 20], [9, 120], 10, 2, 80, 48, id="prefill-GQA5:1-D80-page48"),
    pytest.param([5, 3, 17], [40, 3, 150], 8, 2, 64, 1, id="extend-prefix-page1"),
]


def spy_constexpr(monkeypatch, kernel_cls, constexpr: str) -> list:
    """A list that receives the ``constexpr`` of every launch ``kernel_cls`` (a plan/run
    kernel with a static ``_kw(plan, key)``) builds from then on. A test that spies on the
    Triton kernel's launches targets that kernel: the Gluon decode kernel, which takes plain
    fp16/bf16 decode on sm_90 GPUs (tests/test_gluon_decode.py), is turned off for it."""
    from aiter_attn.kernels.triton import _launch_config as lc

    monkeypatch.setitem(lc.TUNING_OVERRIDES, "gluon_decode", False)
    seen: list = []
    kw_of = kernel_cls._kw

    def spy(plan, key):
        kw = kw_of(plan, key)
        seen.append(kw[constexpr])
        return kw

    monkeypatch.setattr(kernel_cls, "_kw", staticmethod(spy))
    return seen


def spy_launch_option(monkeypatch, constexpr: str, option: str, value=True) -> list:
    """Sets the paged kernel's ``TUNING_OVERRIDES[option] = value`` for the test and returns
    a list that receives the ``constexpr`` of every launch planned from then on."""
    from aiter_attn.kernels.triton import attention as attn
    from aiter_attn.kernels.triton import paged_attention as pa

    monkeypatch.setitem(pa.TUNING_OVERRIDES, option, value)
    return spy_constexpr(monkeypatch, attn.TritonPagedAttention, constexpr)


def check_token_head_case(fp8, seed: int, what: str) -> None:
    """Decode and a 3-token extend over an fp8 cache with per-(token, head) scales and layer
    scales on top (GQA 4:1, head dim 32, page 16), through the Triton kernel, against the
    float64 oracle over the dequantised cache."""
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    from ._triton_util import DEVICE
    from .test_fp8_formats import RTOL, _oracle, _token_case

    q_lens = [1, 1, 3]
    q, kc, vc, kw, dense = _token_case(q_lens, [120, 9, 77], fp8=fp8, hq=8, hkv=2, d=32,
                                       page=16, dtype=torch.float16, layer=(0.5, 0.25),
                                       seed=seed)
    out = torch.empty(q.shape[0], 8, 32, dtype=torch.float16, device=DEVICE)
    paged_attention_triton(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), out,
                           **{k: (v.to(DEVICE) if torch.is_tensor(v) else v)
                              for k, v in kw.items()})
    assert_close_rel(out, _oracle(q, q_lens, dense, kw["softmax_scale"]), RTOL[torch.float16],
                     what)


def check_plain_and_featured(case, what: str, *, window: int, softcap: float,
                             sinks_seed: int) -> None:
    """``case`` (a ``test_triton_paged_attention.Case``) against the oracle as it is, then
    with a left window of ``window`` keys, random per-head sinks (``sinks_seed``) and a
    soft-cap of ``softcap``."""
    from .test_triton_paged_attention import _check

    _check(case, what)
    sinks = torch.randn(case.hq, generator=torch.Generator().manual_seed(sinks_seed))
    _check(case, f"{what}, window+sinks+softcap", window_size=(window, 0), sinks=sinks,
           softcap=softcap)
