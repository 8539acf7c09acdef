"""Which launch a 16-head MLA plan asks for when the narrow Gluon kernel is the default
(``_launch_config.MLA_NARROW``): the narrow kernel where it serves, unless the caller opts
out (``narrow=False``) or asks for the balanced launch (option or default). The device
checks are forced here (the CPU has no sm_90), so this is the choice only; the kernel's own
tests are the ``gpu`` ones in ``tests/test_triton_mla.py``."""

from __future__ import annotations

import pytest
import torch

from aiter_attn.kernels.base import mla_request
from aiter_attn.kernels.triton import mla
from aiter_attn.kernels.triton.mla import TritonMLA


def _kernel(tuning, heads=16, dtype=torch.bfloat16):
    q = torch.zeros(4, heads, 576, dtype=dtype)
    kv = torch.zeros(8, 64, 1, 576, dtype=dtype)
    return TritonMLA(mla_request(q, kv, 512), tuning)


def _force_narrow(monkeypatch):
    """The narrow kernel's device and dtype checks pass; 132 SMs."""
    monkeypatch.setattr(mla, "narrow_mla_reject_reason", lambda **kw: None)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)


@pytest.fixture
def sm90(monkeypatch):
    """The narrow kernel's device and dtype checks pass; 132 SMs."""
    _force_narrow(monkeypatch)


def _splits(kernel, tokens=64, kv=4096):
    return kernel._narrow_splits(tokens, kv, "cpu", 64, None)


@pytest.mark.parametrize("default", [True, False])
def test_narrow_default_and_opt_out(sm90, monkeypatch, default):
    monkeypatch.setattr(mla, "MLA_NARROW", default)
    assert (_splits(_kernel({})) is not None) is default
    assert _splits(_kernel({"narrow": True})) == 2  # 132 SMs over 64 tokens
    assert _splits(_kernel({"narrow": False})) is None
    assert _splits(_kernel({"gluon": False})) is None


def test_balanced_request_keeps_the_balanced_launch(sm90, monkeypatch):
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    assert _splits(_kernel({"balanced": True})) is None
    assert _splits(_kernel({"balanced": 96})) is None
    assert _splits(_kernel({"balanced": False})) == 2
    monkeypatch.setattr(mla, "MLA_BALANCED", True)
    assert _splits(_kernel({})) is None
    # both asked for: the narrow kernel, as before the default changed
    assert _splits(_kernel({"narrow": True, "balanced": True})) == 2


def test_more_than_16_heads_never_take_it(sm90, monkeypatch):
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    assert _splits(_kernel({}, heads=32)) is None
    assert _splits(_kernel({"narrow": True}, heads=128)) is None


def test_the_real_checks_decline_on_this_host(monkeypatch):
    """Without the forced device check (a CPU host): never the narrow kernel."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    assert _splits(_kernel({})) is None


# ------------------------------------------------ the narrow kernel's merge by PDL: wiring

def _step(tuning, monkeypatch, *, pdl_device=True):
    """Plan and run one 4-request decode step (16 heads, 1000 keys each) with the narrow
    kernel forced to serve on this host: its launch and the merge are recorded, not run;
    ``pdl_device``: the device takes programmatic dependent launches (sm_90)."""
    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params
    from aiter_attn.kernels.triton import _pdl

    _force_narrow(monkeypatch)
    monkeypatch.setattr(_pdl, "pdl_supported", lambda device: pdl_device)
    monkeypatch.setattr(TritonMLA, "_cache_descs", lambda self, kv, *a, **k: ("kn", "kr"))
    launched, merged = [], []
    monkeypatch.setattr(mla, "launch_narrow_mla", lambda *a, **k: launched.append(k))
    # the merge's keywords but its planned spec id (test_planned_specs_once_per_plan)
    monkeypatch.setattr(mla, "merge_splits", lambda *a, planned=None, **k: merged.append(k))
    q = torch.randn(4, 16, 576, dtype=torch.bfloat16)
    kv = torch.randn(70, 64, 1, 576, dtype=torch.bfloat16)
    cu = torch.arange(5, dtype=torch.int32)
    seqused = torch.full((4,), 1000, dtype=torch.int32)
    bt = torch.arange(1, 65, dtype=torch.int32).view(4, 16)
    kernel = TritonMLA(mla_request(q, kv, 512), tuning)
    md = _adhoc_metadata(q, kv, cu, seqused, bt, None, None, 1, 1000, "test")
    plan = kernel.plan(md)
    params = mla_layer_params(scale=0.1, device=q.device, kv_lora_rank=512, num_q_heads=16,
                              head_dim=576, kv_scale=None, fp8=False, causal=True)
    kernel.run(q, (kv,), plan, params, torch.empty(4, 16, 512, dtype=torch.bfloat16))
    return plan, launched, merged


def test_narrow_launch_and_merge_start_early_by_default(monkeypatch):
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    plan, launched, merged = _step({}, monkeypatch)
    early = {"PDL": True, "launch_pdl": True, "RELEASE_FIRST": True}
    assert plan.narrow[0] == 4 and plan.narrow[6] == "early"  # 4 splits a token
    assert plan.narrow[7] == early  # the merge's, planned
    assert launched and launched[0]["pdl"] == "early" and launched[0]["splits"] == 4
    assert merged == [early]


@pytest.mark.parametrize("tuning,attention,merge", [
    ({"pdl": False}, False, {}),
    ({"pdl": True}, True, {"PDL": True, "launch_pdl": True}),
    ({"pdl": "reduce"}, "reduce", {"PDL": True, "launch_pdl": True}),
    ({"pdl": "early"}, "early", {"PDL": True, "launch_pdl": True, "RELEASE_FIRST": True})])
def test_narrow_pdl_option(tuning, attention, merge, monkeypatch):
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    _, launched, merged = _step(tuning, monkeypatch)
    assert launched[0]["pdl"] == attention and merged == [merge]


def test_no_pdl_without_device_support_or_with_the_fused_merge(monkeypatch):
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    _, launched, merged = _step({}, monkeypatch, pdl_device=False)
    assert launched[0]["pdl"] is False and merged == [{}]
    # the narrow kernel merging its own splits: no merge launch to start early (the
    # default "early" is the attention launch's own: it stays)
    _, launched, merged = _step({"fused_merge": True}, monkeypatch)
    assert launched[0]["pdl"] == "early" and launched[0]["counters"] is not None
    assert merged == []
    _, launched, merged = _step({"fused_merge": True, "pdl": "reduce"}, monkeypatch)
    assert launched[0]["pdl"] is False and merged == []


def test_early_keys_stay_with_one_split_and_the_fused_merge(monkeypatch):
    """``pdl="early"`` is the attention launch's own (it reads its indices and older keys
    before its wait), so it stays where there is no merge launch to start early: one split
    a token, or the fused merge; ``True`` and ``"reduce"`` with one split are off. Without
    device support it is off too."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    for tuning in ({"pdl": "early", "num_kv_splits": 1}, {"pdl": "early", "fused_merge": True}):
        _, launched, merged = _step(tuning, monkeypatch)
        assert launched[0]["pdl"] == "early" and merged == [], tuning
    for pdl in (True, "reduce"):
        _, launched, _ = _step({"pdl": pdl, "num_kv_splits": 1}, monkeypatch)
        assert launched[0]["pdl"] is False
    _, launched, merged = _step({"pdl": "early"}, monkeypatch, pdl_device=False)
    assert launched[0]["pdl"] is False and merged == [{}]


def test_early_keys_launch_keywords():
    """``"early"``: kernels without early reads take it as ``True`` (both launches start
    early); an unknown mode is refused when the kernel object is built."""
    from aiter_attn.kernels.triton._pdl import pdl_kwargs

    assert pdl_kwargs("early", reduction=False) == {"PDL": True, "launch_pdl": True}
    assert pdl_kwargs("early", reduction=True) == {"PDL": True, "launch_pdl": True}
    assert pdl_kwargs("reduce", reduction=False) == {"PDL": True}
    with pytest.raises(ValueError, match="'early'"):
        _kernel({"pdl": "earliest"})


def test_fused_merge_kernel_itself_starts_early_with_pdl_true(monkeypatch):
    """``pdl=True`` with the fused merge: the attention launch waits on the device for the
    kernel before it (``launch_pdl``); there is no merge launch."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    plan, launched, merged = _step({"fused_merge": True, "pdl": True}, monkeypatch)
    assert launched[0]["pdl"] is True and launched[0]["counters"] is not None
    assert merged == [] and plan.narrow[7] == {"PDL": True, "launch_pdl": True}
    _, launched, _ = _step({"fused_merge": True, "pdl": True}, monkeypatch, pdl_device=False)
    assert launched[0]["pdl"] is False


def test_planned_specs_once_per_plan(monkeypatch):
    """The launch keys' plan share is interned once per plan (``kw_cache``) and passed to
    both launches: the same id on every layer call of a plan, and for a new plan of the
    same step shape (the id stands for what Triton specialises on, not for the plan)."""
    monkeypatch.setattr(mla, "MLA_NARROW", True)
    seen = []
    real_specs = TritonMLA._narrow_specs
    monkeypatch.setattr(TritonMLA, "_narrow_specs",
                        lambda self, plan: seen.append(1) or real_specs(self, plan))
    plan, launched, _ = _step({}, monkeypatch)
    assert len(seen) == 1 and isinstance(launched[0]["planned"], int)
    narrow_id, merge_id = plan.kw_cache[mla._NARROW_SPECS]
    assert launched[0]["planned"] == narrow_id and isinstance(merge_id, int)
    plan2, launched2, _ = _step({}, monkeypatch)
    assert plan2.kw_cache[mla._NARROW_SPECS] == (narrow_id, merge_id)
    # another split count is another specialisation: another id
    plan3, launched3, _ = _step({"num_kv_splits": 2}, monkeypatch)
    assert plan3.narrow[0] == 2 and launched3[0]["planned"] != narrow_id
    # the fused merge: no merge launch, no merge spec
    plan4, _, merged4 = _step({"fused_merge": True}, monkeypatch)
    assert plan4.kw_cache[mla._NARROW_SPECS][1] is None and merged4 == []
