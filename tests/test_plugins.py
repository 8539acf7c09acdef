"""Plugin loading through pluggy: a real third-party package (installed into a temporary
folder, found through its ``aiter_attn`` entry point) is selected, overrides a built-in,
is rejected with reasons; the allow-list, validation, broken plugins and idempotent loading.

Every test builds its own PluginManager; only ``test_ops_use_the_plugin_*`` touch the
process-wide state, and reset it afterwards."""

import logging
import sys
import types

import pytest
import torch

from aiter_attn import ops, plugins
from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.registry import Capabilities, KernelRequest, KernelSelectionError
from aiter_attn.types import CGSupport
from aiter_attn.plugins import (
    PluginLoadError,
    PluginSource,
    PluginValidationError,
    build_registries,
    load_plugins,
    new_plugin_manager,
)

from .plugins.install import shared_site


@pytest.fixture(scope="session")
def plugin_site():
    """The example and test plugin packages, pip-installed into a temporary folder."""
    return shared_site()


@pytest.fixture
def installed(plugin_site, monkeypatch):
    """Make the installed plugins visible (sys.path → importlib.metadata finds their
    dist-info and entry points) and forget modules from an earlier test."""
    monkeypatch.syspath_prepend(str(plugin_site))
    monkeypatch.delenv(plugins.ENV_ALLOW, raising=False)
    for name in [m for m in sys.modules if m.startswith("aiter_attn_test_plugins")]:
        monkeypatch.delitem(sys.modules, name)
    return plugin_site


@pytest.fixture
def pm():
    """A fresh plugin manager per test."""
    return new_plugin_manager()


@pytest.fixture
def global_state():
    """Tests that go through ops.* use the process-wide registries: reset around them."""
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def _load(pm, allow=None):
    report = load_plugins(pm, allow=allow)
    kernels, strategies = build_registries(pm, report=report)
    return report, kernels


def _request(**kw):
    base = dict(op="paged_attention", device="cpu", dtype=torch.float32, kv_dtype=torch.float32,
                head_dim=64, v_head_dim=64, page_size=16)
    base.update(kw)
    return KernelRequest(**base)


def test_entry_point_discovered_and_selected(installed, pm):
    report, kernels = _load(pm)
    assert "example" in report.loaded
    sel = kernels.select(_request())
    assert sel.impl.name == "example" and sel.impl.source == "example"
    assert sel.impl.priority > kernels.implementations("paged_attention")[-1].priority


def test_override_replaces_the_builtin(installed, pm):
    import aiter_attn_test_plugins.override as override

    report, kernels = _load(pm, allow={"example_override"})
    impls = {i.name: i for i in kernels.implementations("paged_attention")}
    assert impls["reference"].source == "example_override"
    assert impls["reference"].fn is override.overriding_reference
    assert "example" not in impls  # not on the allow-list


@pytest.mark.parametrize("need,reason", [
    pytest.param(dict(features={"sinks"}), "missing features ['sinks']", id="sinks"),
    pytest.param(dict(device="cuda"), "device 'cuda' not in ['cpu']", id="device"),
    pytest.param(dict(dtype=torch.float64), "dtype torch.float64 not in", id="dtype"),
])
def test_rejected_with_reasons(installed, pm, need, reason):
    _, kernels = _load(pm, allow={"example"})
    with pytest.raises(KernelSelectionError) as err:
        kernels.select(_request(**need), backend="example")
    assert reason in str(err.value)
    if need.get("device") is None and need.get("dtype") is None:
        # automatic selection falls back to the reference and keeps the reason
        sel = kernels.select(_request(**need))
        assert sel.impl.name == "reference"
        assert ("example", reason) in sel.rejected


def test_allow_list_from_environment(installed, pm, monkeypatch):
    monkeypatch.setenv(plugins.ENV_ALLOW, " example , ")
    report = load_plugins(pm)
    assert report.requested == {"example"}
    names = set(report.loaded)
    assert "example" in names and "reference" in names  # core built-ins always load
    assert not names & {"example_override", "example_broken", "example_invalid", "triton",
                        "aiter"}


def test_allow_list_names_a_missing_plugin(installed, pm):
    with pytest.raises(PluginLoadError, match="not installed: \\['no_such_plugin'\\]"):
        load_plugins(pm, allow="example,no_such_plugin")


def test_broken_plugin_is_logged_and_skipped(installed, pm, caplog):
    with caplog.at_level(logging.WARNING, logger="aiter_attn.plugins"):
        report, kernels = _load(pm)
    assert "example_broken" not in report.loaded
    assert "aiter_attn_vendor_library_that_does_not_exist" in report.skipped["example_broken"]
    assert any("example_broken" in r.getMessage() for r in caplog.records)
    assert kernels.select(_request()).impl.name == "example"  # the rest still works


def test_broken_plugin_raises_when_requested(installed, pm):
    with pytest.raises(PluginLoadError, match="example_broken.*requested"):
        load_plugins(pm, allow={"example_broken"})


def test_misspelt_hook_is_rejected(installed, pm):
    report, _ = _load(pm)
    assert "aiter_attn_register_kernel'" in report.skipped["example_invalid"]
    assert not pm.has_plugin("example_invalid")
    with pytest.raises(PluginLoadError, match="not an aiter_attn hook"):
        load_plugins(new_plugin_manager(), allow={"example_invalid"})


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    return mod


def _assert_rejected(pm, name, hook, match):
    """Registering a plugin whose kernel hook is ``hook`` raises ``match`` and leaves no trace."""
    with pytest.raises(PluginValidationError, match=match):
        plugins.register_plugin(pm, name, _module(name, aiter_attn_register_kernels=hook))
    assert not pm.has_plugin(name)


def test_unmarked_hook_is_rejected(pm):
    def aiter_attn_register_kernels(register):
        pass

    _assert_rejected(pm, "unmarked", aiter_attn_register_kernels, "without the @hookimpl marker")


def test_hook_with_wrong_arguments_is_rejected(pm):
    @hookimpl
    def aiter_attn_register_kernels(registrar):
        pass

    _assert_rejected(pm, "wrongargs", aiter_attn_register_kernels, "does not match the hook specs")


def _failing_plugin():
    @hookimpl
    def aiter_attn_register_kernels(register):
        register("paged_attention", "half", lambda *a, **k: None, Capabilities(cg_support=CGSupport.NEVER), 99)
        raise RuntimeError("vendor driver missing")

    return _module("failing", aiter_attn_register_kernels=aiter_attn_register_kernels)


def test_failing_hook_skips_the_plugin_and_its_registrations(pm, monkeypatch):
    monkeypatch.setitem(sys.modules, "failing_plugin_mod", _failing_plugin())
    src = [PluginSource("reference", "aiter_attn.kernels.reference", "core"),
           PluginSource("failing", "failing_plugin_mod", "entry_point")]
    report = load_plugins(pm, allow=None, sources=src)
    kernels, _ = build_registries(pm, report=report)
    assert [i.name for i in kernels.implementations("paged_attention")] == ["reference"]
    assert "vendor driver missing" in report.skipped["failing"]
    assert not pm.has_plugin("failing")
    pm2 = new_plugin_manager()
    report2 = load_plugins(pm2, allow={"failing"}, sources=src)
    with pytest.raises(PluginLoadError, match="vendor driver missing"):
        build_registries(pm2, report=report2)


def test_loading_is_idempotent(installed, pm):
    first = load_plugins(pm, allow=None)
    again = load_plugins(pm, allow=None)
    assert again.loaded == first.loaded
    assert len(pm.list_name_plugin()) == len(first.loaded)


def test_builtins_load_through_the_same_path(pm):
    kinds = {s.name: s.kind for s in plugins.discover_plugins(entry_points=False)}
    assert kinds["reference"] == "core" and kinds["aiter"] == "builtin"
    assert set(plugins.CORE_PLUGINS) <= set(kinds) and set(plugins.OPTIONAL_PLUGINS) <= set(kinds)
    report, kernels = _load(pm)
    # the aiter plugin imports everywhere but registers nothing off ROCm
    assert "aiter" in report.loaded
    assert all(i.source != "aiter" for op in kernels.ops() for i in kernels.implementations(op))


def test_process_wide_state_is_lazy_and_reset(global_state):
    pm = plugins.get_plugin_manager()
    assert plugins.get_plugin_manager() is pm
    assert plugins.kernel_registry() is plugins.kernel_registry()
    plugins.reset_plugins()
    assert plugins.get_plugin_manager() is not pm


def _paged_inputs(sinks=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 16, generator=g)
    k = torch.randn(6, 4, 2, 16, generator=g)
    v = torch.randn(6, 4, 2, 16, generator=g)
    kw = dict(cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
              seqused_k=torch.tensor([5, 7], dtype=torch.int32),
              block_table=torch.tensor([[4, 2], [1, 5]], dtype=torch.int32),
              softmax_scale=0.25)
    if sinks:
        kw["sinks"] = torch.randn(4, generator=g)
    return q, k, v, kw


def test_ops_use_the_plugin_kernel(installed, global_state, monkeypatch):
    import aiter_attn_example_plugin as example

    monkeypatch.setenv(plugins.ENV_ALLOW, "example")
    q, k, v, kw = _paged_inputs()
    before = example.CALLS["paged_attention"]
    out = ops.paged_attention(q, k, v, **kw)
    assert example.CALLS["paged_attention"] == before + 1
    ref = ops.paged_attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # sinks: the example cannot serve them; auto selection falls back, a forced choice raises
    q, k, v, kw = _paged_inputs(sinks=True)
    ops.paged_attention(q, k, v, **kw)
    assert example.CALLS["paged_attention"] == before + 1
    with pytest.raises(KernelSelectionError, match="example: missing features \\['sinks'\\]"):
        ops.paged_attention(q, k, v, backend="example", **kw)


def test_refused_registration_drops_the_whole_plugin(pm, monkeypatch):
    """A plugin re-registering the built-in name without replace=True is refused as a whole:
    its other (valid) kernel is not kept either."""
    @hookimpl
    def aiter_attn_register_kernels(register):
        register("write_kv", "clash_ok", lambda *a, **k: None, Capabilities(cg_support=CGSupport.NEVER), 5)
        register("paged_attention", "reference", lambda *a, **k: None,
                 Capabilities(cg_support=CGSupport.NEVER), 5)

    monkeypatch.setitem(sys.modules, "clash_plugin_mod",
                        _module("clash", aiter_attn_register_kernels=aiter_attn_register_kernels))
    src = [PluginSource("reference", "aiter_attn.kernels.reference", "core"),
           PluginSource("clash", "clash_plugin_mod", "entry_point")]
    report = load_plugins(pm, allow=None, sources=src)
    kernels, _ = build_registries(pm, report=report)
    assert "already registered" in report.skipped["clash"]
    assert [i.name for i in kernels.implementations("write_kv")] == ["reference"]
    assert kernels.implementations("paged_attention")[0].source == "reference"
    assert report.loaded == ["reference"]


def test_capabilities_must_state_graph_support():
    """No default of ALWAYS (issue 12): a Capabilities without cg_support is refused with
    the choices, and so is a plugin registering a kernel without capabilities."""
    with pytest.raises(TypeError, match="cg_support=CGSupport.NEVER"):
        Capabilities(devices={"cuda"})
    with pytest.raises(TypeError, match="There is no default"):
        Capabilities(cg_support="always")
    assert Capabilities(cg_support=CGSupport.UNIFORM_BATCH).cg_support is CGSupport.UNIFORM_BATCH


def test_registration_without_capabilities_drops_the_plugin(pm, monkeypatch):
    @hookimpl
    def aiter_attn_register_kernels(register):
        register("paged_attention", "vague", lambda *a, **k: None)

    monkeypatch.setitem(sys.modules, "vague_plugin_mod",
                        _module("vague", aiter_attn_register_kernels=aiter_attn_register_kernels))
    src = [PluginSource("reference", "aiter_attn.kernels.reference", "core"),
           PluginSource("vague", "vague_plugin_mod", "entry_point")]
    report = load_plugins(pm, allow=None, sources=src)
    kernels, _ = build_registries(pm, report=report)
    assert "without capabilities" in report.skipped["vague"]
    assert [i.name for i in kernels.implementations("paged_attention")] == ["reference"]


def test_builtins_declare_graph_support(pm):
    _, kernels = _load(pm)
    for op in kernels.ops():
        for impl in kernels.implementations(op):
            assert isinstance(impl.capabilities.cg_support, CGSupport), (op, impl.name)


def test_kv_writes_fall_back_when_the_backend_has_none(pm):
    """select(fallback=True): a forced backend that cannot serve the op gives way to the best
    registered implementation (a strategy's KV writes under an attention-only plugin)."""
    _, kernels = _load(pm)
    req = KernelRequest(op="write_kv_swa", device="cpu", dtype=torch.float32,
                        kv_dtype=torch.float32, head_dim=16, page_size=4)
    with pytest.raises(KernelSelectionError, match="has no kernel for op 'write_kv_swa'"):
        kernels.select(req, backend="attention_only")
    assert kernels.select(req, backend="attention_only", fallback=True).impl.name in (
        "reference", "triton")
    assert kernels.select(req, backend="reference", fallback=True).impl.name == "reference"
