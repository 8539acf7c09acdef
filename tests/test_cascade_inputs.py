"""``cascade_paged_attention`` checks its inputs as ``ops.paged_attention`` does.

The cascade op takes the arguments of ``ops.paged_attention``; an input that op refuses by
name (query heads not a multiple of the KV heads, sinks of the wrong length, a bad window, a
NaN softmax scale, an ``out`` of another dtype or shape, index tensors of another length) must
be refused by the cascade op too, naming the same argument, on both the reference and the
Triton path (where unchecked, the Triton shared pass read past the sinks and grouped query
heads by a truncated ratio, returning numbers).
"""

from __future__ import annotations

import pytest
import torch

from aiter_attn import ops
from aiter_attn.kernels.cascade import cascade_paged_attention
from aiter_attn.testing.compare import assert_close_rel

from ._cascade_case import SharedCase
from ._triton_util import DEVICE, requires_triton


def _case(device="cpu"):
    return SharedCase([(3, [(3, 5, 2), (3, 9, 1), (2, 4, 3)]), (1, [(1, 6, 1), (1, 2, 2)])],
                      hq=10, hkv=2, d=80, page=48, seed=11).to(device)


def _bad_inputs(case):
    """(id, the argument the error must name, overrides of the call)."""
    t, dev = case.q.shape[0], case.q.device

    def kv(heads, d):
        return torch.randn(case.k_cache.shape[0], case.page, heads, d, device=dev)

    return [
        ("gqa-10:4", "num_q_heads", dict(k_cache=kv(4, 80), v_cache=kv(4, 80))),
        ("head-dim", "head_dim", dict(k_cache=kv(2, 64), v_cache=kv(2, 64))),
        ("v-pages", "v_cache", dict(v_cache=torch.randn(3, case.page, 2, 80, device=dev))),
        ("sinks-len", "sinks", dict(sinks=torch.randn(3, device=dev))),
        ("window-neg", "window_size", dict(window_size=(-5, 0))),
        ("window-bool", "window_size", dict(window_size=(True, 0))),
        ("scale-nan", "softmax_scale", dict(softmax_scale=float("nan"))),
        ("softcap-neg", "softcap", dict(softcap=-1.0)),
        ("out-dtype", "out", dict(out=torch.empty(t, 10, 80, dtype=torch.float16, device=dev))),
        ("out-shape", "out", dict(out=torch.empty(t, 10, 64, device=dev))),
        ("cu-float", "cu_seqlens_q", dict(cu_seqlens_q=case.cu.float())),
        ("seqused-len", "seqused_k", dict(seqused_k=case.seqused_k[:-1])),
        ("q-2d", "q", dict(q=case.q[:, 0])),
    ]


BAD = ["gqa-10:4", "head-dim", "v-pages", "sinks-len", "window-neg", "window-bool",
       "scale-nan", "softcap-neg", "out-dtype", "out-shape", "cu-float", "seqused-len", "q-2d"]


def _call(case, fn, backend, **over):
    kw = dict(case.args(), q=case.q, k_cache=case.k_cache, v_cache=case.v_cache)
    kw.update(over)
    q, k, v = kw.pop("q"), kw.pop("k_cache"), kw.pop("v_cache")
    return fn(q, k, v, backend=backend, **kw)


def _cascade(q, k, v, **kw):
    return cascade_paged_attention(q, k, v, min_shared_tokens=1, **kw)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
@pytest.mark.parametrize("bad", BAD)
def test_refuses_what_paged_attention_refuses(backend, bad):
    case = _case(DEVICE if backend == "triton" else "cpu")
    arg, over = {name: (arg, over) for name, arg, over in _bad_inputs(case)}[bad]
    with pytest.raises((ValueError, TypeError), match=arg) as plain:
        _call(case, ops.paged_attention, backend, **over)
    with pytest.raises(type(plain.value), match=arg):
        _call(case, _cascade, backend, **over)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=requires_triton)])
def test_the_checked_call_still_serves(backend):
    """The same case with good inputs equals the ordinary kernel (GQA 5:1, D80, page 48)."""
    case = _case(DEVICE if backend == "triton" else "cpu")
    out = _call(case, _cascade, backend)
    assert_close_rel(out, case.oracle(), 1e-5, f"cascade {backend}")

