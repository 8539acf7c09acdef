"""Which aiter function serves a ``paged_attention`` step, bound to what the ``amd-aiter``
wheel's kernels can do (read from the wheel's source on the CPU).

- ``paged_attention_ragged`` launches one query token per request (query row ``b`` is
  request ``b``: ``query_loc = seq_idx * MTP`` over ``num_seqs = query.size(0)``) and its
  launcher switches on GQA ratios 1…16 only: other decode steps go to the extend route.
- Its launcher switches on head sizes 64 and 128 only, and the JIT kernel it runs computes
  ``VHELOOP = HEAD_SIZE / 16 / NWARPS`` blocks of 64 value dims: for 16, 80 or 96 some value
  dims are never computed. Those decode steps go to the extend route too.
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


_PA_KERNELS = "aiter_meta/csrc/cpp_itfs/pa/pa_kernels.cuh"
_PA_RAGGED_JIT = "aiter_meta/csrc/cpp_itfs/pa/pa_ragged.cpp.jinja"
#: lanes per wavefront on the CDNA GPUs aiter targets (gfx90a/gfx942/gfx950)
_WAVE = 64


def _value_dims_computed(wheel, head_size: int) -> int:  # noqa: F811
    """How many value dims the JIT ragged kernel computes for ``head_size``: its
    ``VHELOOP = HEAD_SIZE / 16 / NWARPS`` (integer division) blocks of ``16·NWARPS``, with
    ``NWARPS = NTHR / 64`` and ``NTHR`` the block size its launcher template uses."""
    kernel, launcher = wheel.read(_PA_KERNELS), wheel.read(_PA_RAGGED_JIT)
    assert kernel and launcher, f"{_PA_KERNELS} or {_PA_RAGGED_JIT} is missing from the wheel"
    m = re.search(r"constexpr int VHELOOP\s*=\s*HEAD_SIZE\s*/\s*16\s*/\s*NWARPS\s*;", kernel)
    assert m, "the ragged kernel's VHELOOP formula changed: re-derive the served head sizes"
    nthr = int(re.search(r"constexpr int NTHR\s*=\s*(\d+)\s*;", launcher).group(1))
    nwarps = nthr // _WAVE
    return head_size // 16 // nwarps * 16 * nwarps


def test_ragged_head_sizes_are_the_wheels(wheel):  # noqa: F811
    """Our head sizes for paged_attention_ragged are the ones its launcher switches on, and
    the JIT kernel computes every value dim of each; 16, 80 and 96 would leave dims unwritten."""
    src = wheel.read(_RAGGED_CU)
    assert src, f"{_RAGGED_CU} is missing from the wheel"
    sizes = _switch_cases(src, "CALL_CUSTOM_LAUNCHER_BLK_HEAD", "head_size")
    assert M.RAGGED_HEAD_SIZES == sizes
    for d in sizes:
        assert _value_dims_computed(wheel, d) == d, d
    for d in (16, 80, 96):
        assert _value_dims_computed(wheel, d) < d, d


def _step(hq, hkv, d, q_lens, kv_lens=(20, 33), kv_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), hq, d, generator=g).bfloat16()
    k = torch.randn(12, 16, hkv, d, generator=g).to(kv_dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    bt = torch.tensor([[3, 7, 0], [5, 1, 9]], dtype=torch.int32)[: len(q_lens)]
    lens = torch.tensor(kv_lens[: len(q_lens)], dtype=torch.int32)
    md = _adhoc_metadata(q, k, cu, lens, bt, None, None, max(q_lens), 48, "paged_attention")
    return q, k, md


@pytest.mark.parametrize("hq,hkv,d,q_lens,route", [
    pytest.param(8, 2, 64, (1, 1), "paged_attention_ragged", id="gqa4-decode"),
    pytest.param(16, 1, 64, (1, 1), "paged_attention_ragged", id="gqa16-decode"),
    pytest.param(8, 2, 128, (1, 1), "paged_attention_ragged", id="gqa4-D128-decode"),
    pytest.param(32, 1, 64, (1, 1), "mha_batch_prefill_func", id="mqa32-decode"),
    pytest.param(64, 2, 64, (1, 1), "mha_batch_prefill_func", id="gqa32-decode"),
    pytest.param(8, 2, 64, (1, 0), "mha_batch_prefill_func", id="request-without-query"),
    pytest.param(8, 2, 16, (1, 1), "mha_batch_prefill_func", id="gqa4-D16-decode"),
    pytest.param(8, 2, 80, (1, 1), "mha_batch_prefill_func", id="gqa4-D80-decode"),
    pytest.param(8, 2, 96, (1, 1), "mha_batch_prefill_func", id="gqa4-D96-decode"),
    pytest.param(8, 2, 256, (1, 1), "mha_batch_prefill_func", id="gqa4-D256-decode"),
])
def test_decode_route_follows_what_ragged_launches(wheel, monkeypatch, hq, hkv, d,  # noqa: F811
                                                   q_lens, route):
    """A decode step goes to paged_attention_ragged only when it launches it: one query
    token per request, a GQA ratio and a head size its launcher has; otherwise the extend
    route (which takes ragged cu_seqlens_q, any GQA ratio and these head sizes)."""
    install_fake_aiter(monkeypatch, read_signatures(wheel), wheel.label)
    q, k, md = _step(hq, hkv, d, q_lens)
    kernel = A.AiterPagedAttention(paged_attention_request(q, k, k))
    assert kernel.plan(md).route == route


def test_fp8_decode_with_an_unlaunched_head_size_dequantises_elsewhere(wheel,  # noqa: F811
                                                                       monkeypatch):
    """An fp8 decode step of head size 96 cannot take paged_attention_ragged; on a release
    whose mha_batch_prefill_func takes no k_descale it goes to unified_attention (which
    dequantises), with the scales."""
    sigs = read_signatures(wheel)
    calls = install_fake_aiter(monkeypatch, sigs, wheel.label)
    q, k, md = _step(8, 2, 96, (1, 1), kv_dtype=torch.float8_e4m3fnuz)
    kernel = A.AiterPagedAttention(paged_attention_request(q, k, k))
    takes = "k_descale" in sigs["mha_batch_prefill_func"][1].parameters
    assert kernel.plan(md).route == ("mha_batch_prefill_func" if takes else "unified_attention")
    A.aiter_paged_attention(q, k, k, torch.empty_like(q), cu_seqlens_q=md.query.cu_seqlens_q,
                            seqused_k=md.pages.seqused_k, block_table=md.pages.block_table,
                            softmax_scale=0.1, k_scale=torch.tensor(0.5),
                            v_scale=torch.tensor(2.0), max_seqlen_q=1)
    (name, args), = calls
    assert name != "paged_attention_ragged" and args["k_descale"] is not None


def test_ragged_reason_names_the_limit():
    dims = dict(head_dim=128, v_head_dim=128)
    why = M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=64, kv_heads=2, **dims)
    assert "gqa ratio 64/2 = 32" in why and "1..16" in why
    why = M.ragged_decode_reason(num_tokens=1, batch=2, q_heads=8, kv_heads=2, **dims)
    assert "1 query tokens for 2 requests" in why
    assert M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=8, kv_heads=2, **dims) is None
    why = M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=8, kv_heads=2, head_dim=80,
                                 v_head_dim=80)
    assert "head_dim=80" in why and "64, 128" in why and "extend route" in why
    why = M.ragged_decode_reason(num_tokens=2, batch=2, q_heads=8, kv_heads=2, head_dim=128,
                                 v_head_dim=64)
    assert "v_head_dim=64" in why and "head_dim=128" in why


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
