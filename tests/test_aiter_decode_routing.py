"""Which aiter function serves a ``paged_attention`` step, bound to what the ``amd-aiter``
wheel's kernels can do (read from the wheel's source on the CPU).

- ``paged_attention_ragged`` launches one query token per request (query row ``b`` is
  request ``b``: ``query_loc = seq_idx * MTP`` over ``num_seqs = query.size(0)``) and its
  launcher switches on GQA ratios 1…16 only: other decode steps go to the extend route.
- ``mha_batch_prefill_func`` of a release without ``k_descale`` takes no fp8 cache and
  ``unified_attention`` is causal only, so a non-causal fp8 layer is declined by the
  capabilities (with the reason), not accepted and then refused in ``plan``.
"""

from __future__ import annotations

import re

import pytest
import torch

import aiter_attn.kernels.aiter as A
from aiter_attn.kernels import aiter_marshal as M
from aiter_attn.kernels.base import _adhoc_metadata
from aiter_attn.kernels.registry import KernelRequest
from aiter_attn.ops import paged_attention_request

from .test_aiter_contract import install_fake_aiter, read_signatures, wheel  # noqa: F401

_RAGGED_CU = "aiter_meta/csrc/kernels/attention_ragged.cu"


def _switch_cases(src: str, macro: str, var: str) -> set:
    """The ``case N:`` labels of ``switch(var)`` inside the ``#define macro`` of ``src``."""
    m = re.search(r"#define\s+%s\b(.*?)\n\s*\n" % re.escape(macro), src, re.S)
    assert m, f"{macro} not found in {_RAGGED_CU}"
    body = m.group(1)
    sw = re.search(r"switch\s*\(\s*%s\s*\)(.*)" % re.escape(var), body, re.S)
    assert sw, f"{macro} has no switch({var})"
    return {int(n) for n in re.findall(r"case\s+(\d+)\s*:", sw.group(1))}


def _ragged_gqa_cases(src: str) -> set:
    body = src[src.index("paged_attention_custom_launcher("):]
    sw = re.search(r"switch\s*\(\s*gqa_ratio\s*\)(.*?)default", body, re.S)
    assert sw, "the launcher's switch(gqa_ratio) was not found"
    return {int(n) for n in re.findall(r"case\s+(\d+)\s*:", sw.group(1))}


def test_ragged_gqa_bound_is_the_wheels(wheel):  # noqa: F811
    """Our GQA bound for paged_attention_ragged is the set its launcher dispatches on."""
    src = wheel.read(_RAGGED_CU)
    assert src, f"{_RAGGED_CU} is missing from the wheel"
    cases = _ragged_gqa_cases(src)
    assert cases == set(range(1, M.RAGGED_MAX_GQA + 1))
    # the head sizes it dispatches on (reported, see ragged_decode_reason's docstring)
    assert _switch_cases(src, "CALL_CUSTOM_LAUNCHER_BLK_HEAD", "head_size") == {64, 128}


def _step(hq, hkv, d, q_lens, kv_lens=(20, 33), kv_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16()
    k = torch.randn(12, 16, hkv, d, generator=g).to(kv_dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor([[3, 7, 0], [5, 1, 9]], dtype=torch.int32)[: len(q_lens)]
    lens = torch.tensor(kv_lens[: len(q_lens)], dtype=torch.int32)
    md = _adhoc_metadata(q, k, cu, lens, bt, None, None, max(q_lens), 48, "paged_attention")
    return q, k, md


@pytest.mark.parametrize("hq,hkv,q_lens,route", [
    pytest.param(8, 2, (1, 1), "paged_attention_ragged", id="gqa4-decode"),
    pytest.param(16, 1, (1, 1), "paged_attention_ragged", id="gqa16-decode"),
    pytest.param(32, 1, (1, 1), "mha_batch_prefill_func", id="mqa32-decode"),
    pytest.param(64, 2, (1, 1), "mha_batch_prefill_func", id="gqa32-decode"),
    pytest.param(8, 2, (1, 0), "mha_batch_prefill_func", id="request-without-query"),
])
def test_decode_route_follows_what_ragged_launches(wheel, monkeypatch, hq, hkv, q_lens,  # noqa: F811
                                                   route):
    """A decode step goes to paged_attention_ragged only when it launches it: one query
    token per request and a GQA ratio its launcher has; otherwise the extend route (which
    takes ragged cu_seqlens_q and any GQA ratio)."""
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, k, md = _step(hq, hkv, 64, q_lens)
    kernel = A.AiterPagedAttention(paged_attention_request(q, k, k))
    assert kernel.plan(md).route == route


def test_ragged_reason_names_the_limit():
    why = M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=64, kv_heads=2)
    assert "gqa ratio 64/2 = 32" in why and "1..16" in why
    why = M.ragged_decode_reason(num_tokens=1, batch=2, q_heads=8, kv_heads=2)
    assert "1 query tokens for 2 requests" in why
    assert M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=8, kv_heads=2) is None


def _req(**kw):
    base = dict(op="paged_attention", device="cuda", dtype=torch.bfloat16,
                kv_dtype=torch.float8_e4m3fnuz, head_dim=128, v_head_dim=128, page_size=16,
                features={"fp8", "non_causal"})
    base.update(kw)
    return KernelRequest(**base)


def test_noncausal_fp8_declined_where_the_release_cannot_serve_it(wheel, monkeypatch):  # noqa: F811
    """0.1.7's mha_batch_prefill_func takes no k_descale (and checks k.dtype == q.dtype),
    and unified_attention asserts causal: the capabilities decline the layer with a reason
    instead of accepting it and raising in plan on its first extend step."""
    sigs = read_signatures(wheel)
    takes = "k_descale" in sigs["mha_batch_prefill_func"][1].parameters
    install_fake_aiter(monkeypatch, sigs, wheel.label)
    caps = A.capabilities()["paged_attention"]
    reason = caps.reject_reason(_req())
    if takes:
        assert reason is None
    else:
        assert reason and "k_descale" in reason and "non-causal" in reason
        # what the accepted request would have done on the wheel: refuse in plan
        with pytest.raises(ValueError, match="causal=False"):
            M.route_paged_attention(9, causal=False, is_fp8=True,
                                    prefill_params=frozenset(sigs["mha_batch_prefill_func"][1]
                                                             .parameters))
    # causal fp8 and non-causal 16-bit layers stay accepted
    assert caps.reject_reason(_req(features={"fp8"})) is None
    assert caps.reject_reason(_req(kv_dtype=torch.bfloat16, features={"non_causal"})) is None


def test_noncausal_fp8_accepted_with_a_descale_release(wheel, monkeypatch):  # noqa: F811
    """A release whose mha_batch_prefill_func takes k_descale serves it (fp8 extend there)."""
    import inspect

    sigs = read_signatures(wheel)
    mod, sig, node = sigs["mha_batch_prefill_func"]
    if "k_descale" not in sig.parameters:
        P = inspect.Parameter
        extra = [P("k_descale", P.POSITIONAL_OR_KEYWORD, default=None),
                 P("v_descale", P.POSITIONAL_OR_KEYWORD, default=None)]
        sigs["mha_batch_prefill_func"] = (mod, sig.replace(
            parameters=list(sig.parameters.values()) + extra), node)
    install_fake_aiter(monkeypatch, sigs, wheel.label + "+descale")
    assert A.capabilities()["paged_attention"].reject_reason(_req()) is None
