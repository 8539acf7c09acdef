"""Defects found hunting the kernel objects (base, registry, batch_invariant, reference_extra,
cascade_plan): each test failed before its fix."""

from __future__ import annotations

import torch

from aiter_attn.kernels.base import KernelPlan, MLAKernel
from aiter_attn.kernels.batch_invariant import BatchInvariantKernels
from aiter_attn.kernels.registry import Capabilities, KernelRegistry
from aiter_attn.types import CGSupport


class _RecordingMLA(MLAKernel):
    """A plugin MLA kernel that records the request each plan was made under."""

    requests: list = []

    def plan(self, md, out=None):
        type(self).requests.append(self.request)
        return KernelPlan(num_tokens=md.query.num_tokens)

    def run(self, q, cache, plan, params, out, lse=None):
        out.zero_()
        return out


def _mla_call_args(heads=2, lora=8, rope=4, page_size=4):
    q = torch.randn(3, heads, lora + rope)
    kv = torch.randn(4, page_size, 1, lora + rope)
    out = torch.empty(3, heads, lora)
    kw = dict(kv_lora_rank=lora, cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
              seqused_k=torch.tensor([3, 5], dtype=torch.int32),
              block_table=torch.tensor([[1, 0], [2, 3]], dtype=torch.int32),
              softmax_scale=0.5)
    return q, kv, out, kw


def test_mla_kernel_functional_call_binds_batch_invariant():
    """``Selection.fn`` of a plugin MLAKernel under a batch-invariant view is called with
    ``batch_invariant=True`` (what ops.mla_paged_attention does): the kernel must plan under a
    request with that feature, not drop the flag and plan unbound."""
    reg = KernelRegistry()
    reg.register("mla_paged_attention", "rec", _RecordingMLA,
                 Capabilities(features={"batch_invariant"}, cg_support=CGSupport.NEVER))
    q, kv, out, kw = _mla_call_args()
    from aiter_attn.kernels.base import mla_request

    req = mla_request(q, kv, kw["kv_lora_rank"])
    _RecordingMLA.requests.clear()
    BatchInvariantKernels(reg).select(req).fn(q, kv, out, **kw)
    (seen,) = _RecordingMLA.requests
    assert seen is not None and "batch_invariant" in seen.features
    _RecordingMLA.requests.clear()
    reg.select(req).fn(q, kv, out, batch_invariant=True, **kw)
    (seen,) = _RecordingMLA.requests
    assert seen is not None and "batch_invariant" in seen.features


def test_env_forced_backend_falls_back_when_asked(monkeypatch):
    """``select(fallback=True)`` with the backend forced through ``AITER_ATTN_BACKEND`` (an
    attention-only plugin): the KV write must fall back to the best implementation, as it
    does for ``backend=`` (the automatic retry must not read the env override again)."""
    from aiter_attn.kernels.registry import KernelRequest

    reg = KernelRegistry()
    reg.register("write_kv", "reference", lambda *a, **k: "ref",
                 Capabilities(cg_support=CGSupport.ALWAYS))
    reg.register("paged_attention", "attn_only", lambda *a, **k: None,
                 Capabilities(cg_support=CGSupport.NEVER))
    req = KernelRequest(op="write_kv")
    assert reg.select(req, backend="attn_only", fallback=True).impl.name == "reference"
    monkeypatch.setenv("AITER_ATTN_BACKEND", "attn_only")
    assert reg.select(req, fallback=True).impl.name == "reference"


def test_empty_predicate_reason_still_says_why():
    """A predicate returning ``""`` rejected its kernel with no reason at all ("a: ."): the
    error must say what went wrong, as for a predicate returning a non-str."""
    import pytest

    from aiter_attn.kernels.registry import KernelRequest, KernelSelectionError

    reg = KernelRegistry()
    reg.register("op", "a", lambda: 0,
                 Capabilities(cg_support=CGSupport.NEVER, predicate=lambda req: "  "))
    with pytest.raises(KernelSelectionError, match=r"a: predicate returned an empty reason"):
        reg.select(KernelRequest(op="op"))


def test_request_features_as_a_bare_string_is_refused():
    """``KernelRequest(features="lse")`` became the letters {'l', 's', 'e'} (then "missing
    features ['e', 'l', 's']" from every kernel); Capabilities refuses a bare string, the
    request must too, naming the argument and the fix."""
    import pytest

    from aiter_attn.kernels.registry import KernelRequest

    with pytest.raises(TypeError, match=r"features='lse'.*features=\{'lse'\}"):
        KernelRequest(op="paged_attention", features="lse")
    assert KernelRequest(op="paged_attention", features=["lse"]).features == {"lse"}
    assert KernelRequest(op="paged_attention").features == frozenset()
