"""A plugin that misuses the registration hooks is skipped with a reason (or raises when
asked for by name), never silently half-loaded and never able to break selection for the
others: a hook that returns its kernels instead of registering them, a ``register`` callback
kept and called after the registries were built, a hook marked as a pluggy wrapper, a
registration whose priority would break sorting of the op's candidates, a strategy pair whose
``supports`` check returns a bool."""

import sys
import types

import pytest
import torch

from aiter_attn import plugins
from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.registry import Capabilities, KernelRequest
from aiter_attn.plugins import (PluginLoadError, PluginSource, PluginValidationError,
                                build_registries, load_plugins, new_plugin_manager)
from aiter_attn.types import CGSupport

CAPS = Capabilities(cg_support=CGSupport.NEVER)
REQUEST = KernelRequest(op="paged_attention", device="cpu", dtype=torch.float32,
                        kv_dtype=torch.float32, head_dim=64, v_head_dim=64, page_size=16)


def _kernel(*a, **k):
    return None


def _load(monkeypatch, name, allow=None, **hooks):
    """Load the core reference kernels and a plugin module ``name`` with ``hooks``."""
    mod = types.ModuleType(f"{name}_plugin_mod")
    mod.__dict__.update(hooks)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    src = [PluginSource("reference", "aiter_attn.kernels.reference", "core"),
           PluginSource(name, mod.__name__, "entry_point")]
    pm = new_plugin_manager()
    report = load_plugins(pm, allow=allow, sources=src)
    kernels, strategies = build_registries(pm, report=report)
    return pm, report, kernels, strategies


def test_hook_that_returns_its_kernels_is_skipped(monkeypatch):
    @hookimpl
    def aiter_attn_register_kernels(register):
        return [("paged_attention", "returned", _kernel, CAPS)]

    pm, report, kernels, _ = _load(monkeypatch, "returner",
                                   aiter_attn_register_kernels=aiter_attn_register_kernels)
    assert "returner" not in report.loaded and not pm.has_plugin("returner")
    assert "hook returned [(" in report.skipped["returner"]
    assert "register(...) and returns None" in report.skipped["returner"]
    assert kernels.select(REQUEST).impl.name == "reference"
    with pytest.raises(PluginLoadError, match="'returner'.*hook returned"):
        _load(monkeypatch, "returner", allow={"returner"},
              aiter_attn_register_kernels=aiter_attn_register_kernels)


def test_register_called_after_the_hook_returned_raises(monkeypatch):
    kept = {}

    @hookimpl
    def aiter_attn_register_kernels(register):
        kept["register"] = register  # e.g. to register more kernels once a device shows up

    _, report, kernels, _ = _load(monkeypatch, "keeper",
                                  aiter_attn_register_kernels=aiter_attn_register_kernels)
    assert "keeper" in report.loaded
    with pytest.raises(RuntimeError, match=r"plugin 'keeper' called "
                                           r"register\('paged_attention', 'late', \.\.\.\) "
                                           r"after its aiter_attn_register_kernels hook "
                                           r"returned.*Call register inside the hook"):
        kept["register"]("paged_attention", "late", _kernel, CAPS, 500)
    assert [i.name for i in kernels.implementations("paged_attention")] == ["reference"]


@pytest.mark.parametrize("marker", [dict(hookwrapper=True), dict(wrapper=True)],
                         ids=["hookwrapper", "wrapper"])
def test_wrapper_hook_is_invalid(monkeypatch, marker):
    """A wrapper is a generator: called once per plugin it would register nothing."""
    @hookimpl(**marker)
    def aiter_attn_register_kernels(register):
        register("paged_attention", "wrapped", _kernel, CAPS, 500)
        yield

    mod = types.ModuleType("wrapping")
    mod.aiter_attn_register_kernels = aiter_attn_register_kernels
    pm = new_plugin_manager()
    with pytest.raises(PluginValidationError, match="marks 'aiter_attn_register_kernels' as a "
                                                    "hook wrapper.*Use a plain @hookimpl"):
        plugins.register_plugin(pm, "wrapping", mod)
    assert not pm.has_plugin("wrapping")
    _, report, _, _ = _load(monkeypatch, "wrapping",
                            aiter_attn_register_kernels=aiter_attn_register_kernels)
    assert "hook wrapper" in report.skipped["wrapping"]


def test_registration_with_an_unusable_priority_drops_only_its_plugin(monkeypatch):
    @hookimpl
    def aiter_attn_register_kernels(register):
        register("paged_attention", "noprio", _kernel, CAPS, None)

    _, report, kernels, _ = _load(monkeypatch, "noprio",
                                  aiter_attn_register_kernels=aiter_attn_register_kernels)
    assert "priority=None" in report.skipped["noprio"]
    assert kernels.select(REQUEST).impl.name == "reference"  # selection still works
