"""Kernel registration refuses what would break selection later, naming the argument: a
priority, name or op that is not usable (candidates are sorted by ``(-priority, name)`` for
every caller of the op), a callable that is not one, a kernel class of the wrong family, a
``max_head_dim`` that is not an int; a predicate that raises is one kernel's rejection reason,
never a crash of every selection of the op."""

import logging

import pytest
import torch

from aiter_attn.kernels.base import AttentionKernel, KernelPlan, MLAKernel
from aiter_attn.kernels.registry import (Capabilities, KernelRegistry, KernelRequest,
                                         KernelSelectionError)
from aiter_attn.types import CGSupport

CAPS = Capabilities(cg_support=CGSupport.NEVER)


def _kernel(*a, **k):
    return None


def _request(**kw):
    base = dict(op="paged_attention", device="cpu", dtype=torch.float32, head_dim=64,
                v_head_dim=64, page_size=16)
    return KernelRequest(**{**base, **kw})


def _registry():
    reg = KernelRegistry()
    reg.register("paged_attention", "good", _kernel, CAPS, priority=0)
    return reg


@pytest.mark.parametrize("args,match", [
    pytest.param(dict(priority=None), r"priority=None.*priority is an int", id="priority-none"),
    pytest.param(dict(priority="50"), r"priority='50'.*priority is an int", id="priority-str"),
    pytest.param(dict(priority=True), r"priority=True.*priority is an int", id="priority-bool"),
    pytest.param(dict(name=None), r"name=None; name is a non-empty str", id="name-none"),
    pytest.param(dict(name=""), r"name=''; name is a non-empty str", id="name-empty"),
    pytest.param(dict(op=None), r"op=None; op is a non-empty str", id="op-none"),
    pytest.param(dict(fn=42), r"fn=42\): fn is a int, not callable", id="fn-not-callable"),
])
def test_unusable_registration_is_refused(args, match):
    reg = _registry()
    kw = dict(op="paged_attention", name="bad", fn=_kernel, capabilities=CAPS, priority=5)
    kw.update(args)
    with pytest.raises(TypeError, match=match):
        reg.register(**kw)
    # nothing was kept: selection of the op still works for everyone
    assert reg.select(_request()).impl.name == "good"
    assert [i.name for i in reg.implementations("paged_attention")] == ["good"]


def test_numpy_style_integral_priority_is_accepted():
    import numpy as np

    reg = _registry()
    reg.register("paged_attention", "np", _kernel, CAPS, priority=np.int64(7))
    assert reg.select(_request()).impl.name == "np"


class _PagedKernel(AttentionKernel):
    def plan(self, md, out=None):
        return KernelPlan(num_tokens=md.query.num_tokens)

    def run(self, q, cache, plan, params, out, lse=None):
        return out


class _LatentKernel(MLAKernel):
    def plan(self, md, out=None):
        return KernelPlan(num_tokens=md.query.num_tokens)

    def run(self, q, cache, plan, params, out, lse=None):
        return out


@pytest.mark.parametrize("op,cls,match", [
    pytest.param("mla_paged_attention", _PagedKernel,
                 r"takes a subclass of aiter_attn.kernels.base.MLAKernel", id="paged-as-mla"),
    pytest.param("paged_attention", _LatentKernel,
                 r"_LatentKernel is an MLAKernel; derive it from AttentionKernel",
                 id="mla-as-paged"),
])
def test_kernel_class_of_the_wrong_family_is_refused(op, cls, match):
    """Its functional convenience would take the other op's arguments: every ``ops.*`` call
    would fail with an unrelated TypeError."""
    with pytest.raises(TypeError, match=match):
        KernelRegistry().register(op, "mine", cls, CAPS)


def test_kernel_classes_of_the_right_family_register():
    reg = KernelRegistry()
    reg.register("paged_attention", "p", _PagedKernel, CAPS)
    reg.register("mla_paged_attention", "m", _LatentKernel, CAPS)
    reg.register("extend_attention", "e", _PagedKernel, CAPS)


@pytest.mark.parametrize("value", [True, "256", 0, 128.0])
def test_max_head_dim_must_be_a_positive_int(value):
    with pytest.raises(TypeError, match=f"max_head_dim={value!r}.*positive int"):
        Capabilities(max_head_dim=value, cg_support=CGSupport.NEVER)


def test_predicate_that_raises_is_a_rejection_reason(caplog):
    reg = _registry()
    reg.register("paged_attention", "boom", _kernel,
                 Capabilities(cg_support=CGSupport.NEVER, predicate=lambda r: 1 // 0),
                 priority=50)
    with caplog.at_level(logging.WARNING, logger="aiter_attn.kernels.registry"):
        sel = reg.select(_request())
    assert sel.impl.name == "good"
    (name, reason), = sel.rejected
    assert name == "boom" and "predicate raised ZeroDivisionError" in reason
    assert any("predicate raised" in r.getMessage() for r in caplog.records)
    with pytest.raises(KernelSelectionError, match="boom: predicate raised ZeroDivisionError"):
        reg.select(_request(), backend="boom")
