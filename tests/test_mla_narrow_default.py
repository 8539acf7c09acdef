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


@pytest.fixture
def sm90(monkeypatch):
    """The narrow kernel's device and dtype checks pass; 132 SMs."""
    monkeypatch.setattr(mla, "narrow_mla_reject_reason", lambda **kw: None)
    monkeypatch.setattr(mla, "num_sms", lambda device: 132)


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
