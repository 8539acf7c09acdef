"""Defects found hunting the plugin loader, the kernel registry's selection and the
``aiter-attn`` command line (plugins, hookspecs, cli, commands/info, kernels/registry): each
test failed before its fix.

Entry points are made the way an installed distribution has them (a ``*.dist-info`` folder
with ``entry_points.txt`` in a temporary folder put on ``sys.path``); every test builds its own
plugin manager or registry, and the ones that touch the process-wide registries reset them."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from aiter_attn import AttnArch, ForwardMode, plugins
from aiter_attn.kernels.registry import (Capabilities, KernelRegistry, KernelRequest,
                                         KernelSelectionError)
from aiter_attn.plugins import (PluginLoadError, PluginSource, build_registries, load_plugins,
                                new_plugin_manager)
from aiter_attn.types import CGSupport

NEVER = Capabilities(cg_support=CGSupport.NEVER)
PLUGIN_MODULE = '''
from aiter_attn.hookspecs import hookimpl
from aiter_attn.kernels.registry import Capabilities
from aiter_attn.types import CGSupport

def kernel(*a, **k):
    return None

@hookimpl
def aiter_attn_register_kernels(register):
    register("write_kv", {name!r}, kernel, Capabilities(cg_support=CGSupport.NEVER))
'''


def _kernel(*a, **k):
    return None


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder on ``sys.path`` to install fake distributions into: ``site(dist, module,
    entry_points)`` writes ``module`` (a kernel hook registering ``write_kv`` under the
    module's name) and ``dist``'s dist-info whose ``[aiter_attn]`` entry points are given."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.ENV_ALLOW, raising=False)

    def install(dist: str, module: str, entry_points: dict) -> None:
        (tmp_path / f"{module}.py").write_text(PLUGIN_MODULE.format(name=module))
        info = tmp_path / f"{dist.replace('-', '_')}-0.1.dist-info"  # as pip names it
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[aiter_attn]\n{lines}")
        importlib.invalidate_caches()
        monkeypatch.delitem(sys.modules, module, raising=False)

    return install


# --- plugin loading ------------------------------------------------------------------------


def test_entry_point_with_extras_loads(site):
    """``name = module:attr [extra]`` is a valid entry point (the packaging spec: consumers
    parse the extras and may ignore them); the loader imported a module named
    ``'hunt_extras [fast]'`` and skipped the plugin."""
    site("hunt-extras", "hunt_extras", {"hunt_extras": "hunt_extras [fast]",
                                        "hunt_extras_attr": "hunt_extras : kernel [fast, gpu]"})
    sources = [s for s in plugins.discover_plugins(builtins=False)
               if s.name.startswith("hunt_extras")]
    assert [s.name for s in sources] == ["hunt_extras", "hunt_extras_attr"]
    assert plugins._import_target(sources[1].target) is sys.modules["hunt_extras"].kernel
    pm = new_plugin_manager()
    report = load_plugins(pm, allow={"hunt_extras"})
    assert "hunt_extras" in report.loaded and not report.skipped
    kernels, _ = build_registries(pm, report=report)
    assert [i.source for i in kernels.implementations("write_kv")
            if i.name == "hunt_extras"] == ["hunt_extras"]


def test_entry_point_name_taken_by_another_distribution_is_named(site, caplog):
    """Two distributions with the same entry-point name: the warning said the name "is taken
    by a built-in plugin" (there is none by that name), so the author looked in the wrong
    place; it must name the other entry point, which loads instead."""
    site("hunt-dup-a", "hunt_dup_a", {"hunt_dup": "hunt_dup_a"})
    site("hunt-dup-b", "hunt_dup_b", {"hunt_dup": "hunt_dup_b"})
    with caplog.at_level(logging.WARNING, logger="aiter_attn.plugins"):
        sources = [s for s in plugins.discover_plugins(builtins=False) if s.name == "hunt_dup"]
    (kept,) = sources
    (msg,) = [r.getMessage() for r in caplog.records if "hunt_dup" in r.getMessage()]
    assert "built-in" not in msg
    ignored = "hunt_dup_b" if kept.target == "hunt_dup_a" else "hunt_dup_a"
    assert f"entry point hunt_dup = {ignored}" in msg
    assert f"the entry point hunt_dup = {kept.target} of another distribution" in msg
    assert "rename one of them" in msg
    # a clash with a built-in still says so
    caplog.clear()
    site("hunt-clash", "hunt_clash", {"triton": "hunt_clash"})
    with caplog.at_level(logging.WARNING, logger="aiter_attn.plugins"):
        plugins.discover_plugins()
    assert any("triton = hunt_clash" in r.getMessage() and "a built-in plugin" in r.getMessage()
               for r in caplog.records)


def test_entry_point_left_out_for_its_name_is_in_the_report(site):
    """The left-out entry point was only logged: ``LoadReport.shadowed`` (and ``aiter-attn
    info``) name it, and asking for that name in ``AITER_ATTN_PLUGINS`` is refused, since
    which of the two loads is an accident of install order."""
    site("hunt-twin-a", "hunt_twin_a", {"hunt_twin": "hunt_twin_a"})
    site("hunt-twin-b", "hunt_twin_b", {"hunt_twin": "hunt_twin_b"})
    report = load_plugins(new_plugin_manager(), allow=None)
    (entry,) = [k for k in report.shadowed if k.startswith("hunt_twin = ")]
    assert "(distribution hunt-twin-" in entry
    assert "another distribution" in report.shadowed[entry]
    assert "hunt_twin" in report.loaded
    with pytest.raises(PluginLoadError, match=r"hunt_twin = .*uninstall one of them or rename"):
        load_plugins(new_plugin_manager(), allow={"hunt_twin"})
    plugins.reset_plugins()
    try:
        from aiter_attn.commands.info import collect_info

        assert entry in collect_info()["shadowed_plugins"]
    finally:
        plugins.reset_plugins()


def _source_module(monkeypatch, name, body):
    """A plugin module ``name`` made from ``body``, importable for this test only."""
    import types

    mod = types.ModuleType(name)
    exec(compile(textwrap.dedent(body), name, "exec"), mod.__dict__)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


def test_plugin_calling_sys_exit_is_skipped_not_fatal(tmp_path, monkeypatch):
    """A vendor module that calls ``sys.exit()`` at import (its driver is missing) ended the
    whole process at the first kernel selection: the loader caught ``Exception`` only. It
    is a broken plugin like any other: skipped with the reason, or ``PluginLoadError`` when
    requested by name. The same for a hook that exits."""
    (tmp_path / "hunt_exits_at_import.py").write_text(
        "import sys\nsys.exit('hunt vendor driver not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    _source_module(monkeypatch, "hunt_exits_in_hook", """
        import sys
        from aiter_attn.hookspecs import hookimpl

        @hookimpl
        def aiter_attn_register_kernels(register):
            sys.exit(3)
    """)
    src = [PluginSource("reference", "aiter_attn.kernels.reference", "core"),
           PluginSource("exits_at_import", "hunt_exits_at_import", "entry_point"),
           PluginSource("exits_in_hook", "hunt_exits_in_hook", "entry_point")]
    pm = new_plugin_manager()
    report = load_plugins(pm, allow=None, sources=src)
    kernels, _ = build_registries(pm, report=report)
    assert report.loaded == ["reference"]
    assert "SystemExit: hunt vendor driver not found" in report.skipped["exits_at_import"]
    assert "SystemExit: 3" in report.skipped["exits_in_hook"]
    assert kernels.implementations("paged_attention")[0].name == "reference"
    sys.modules.pop("hunt_exits_at_import", None)
    with pytest.raises(PluginLoadError, match="exits_at_import.*requested.*SystemExit"):
        load_plugins(new_plugin_manager(), allow={"exits_at_import"}, sources=src)
    pm = new_plugin_manager()
    report = load_plugins(pm, allow={"exits_in_hook"}, sources=src)
    with pytest.raises(PluginLoadError, match="exits_in_hook.*SystemExit: 3"):
        build_registries(pm, report=report)


# --- kernel registration -------------------------------------------------------------------


@pytest.mark.parametrize("device,match", [
    pytest.param("CUDA", r"'CUDA' is not a torch device type.*such as 'cuda'", id="capitals"),
    pytest.param("gpu", r"'gpu' is not a torch device type", id="unknown"),
    pytest.param("cuda:0", r"'cuda:0' names a device, not a device type.*use 'cuda'",
                 id="index"),
])
def test_capabilities_refuse_devices_that_never_match(device, match):
    """Requests carry the inputs' device *type* (``q.device.type``): a kernel declared for
    ``"CUDA"``, ``"gpu"`` or ``"cuda:0"`` was accepted and then never selected anywhere (a
    typo silently dropping the kernel, while a typo in ``features`` is refused)."""
    with pytest.raises(ValueError, match=match):
        Capabilities(devices={"cpu", device}, cg_support=CGSupport.NEVER)
    assert Capabilities(devices={"cuda", "cpu"}, cg_support=CGSupport.NEVER).devices == {
        "cuda", "cpu"}


def test_request_with_an_unknown_feature_names_the_typo():
    """``KernelRequest(features={"sink"})`` (an engine author's or plugin strategy's typo) made
    every kernel report "missing features ['sink']" and the error advised changing the layer
    or picking another backend; no kernel can ever declare an unknown feature, so the request
    is refused naming the name and the allowed ones."""
    with pytest.raises(ValueError, match=r"unknown features \['sink'\]; allowed: .*'sinks'"):
        KernelRequest(op="paged_attention", features={"sink", "window"})
    assert KernelRequest(op="paged_attention", features={"sinks"}).features == {"sinks"}


def test_numpy_priority_is_stored_as_an_int_and_info_json_prints_a_number(capsys):
    """A numpy integer priority is accepted (it sorts like an int) but was stored as is:
    ``aiter-attn info --json`` then printed ``"priority": "7"`` (a string, via
    ``default=str``) for that kernel while every other priority is a number."""
    import numpy as np

    from aiter_attn.cli import main

    reg = KernelRegistry()
    impl = reg.register("write_kv", "np", _kernel, NEVER, priority=np.int64(7))
    assert type(impl.priority) is int and impl.priority == 7
    plugins.reset_plugins()
    try:
        plugins.kernel_registry().register("write_kv", "hunt_np_prio", _kernel, NEVER,
                                           priority=np.int32(-3))
        assert main(["info", "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        (row,) = [k for k in data["kernels"] if k["name"] == "hunt_np_prio"]
        assert row["priority"] == -3
    finally:
        plugins.reset_plugins()


def test_kernel_name_with_surrounding_whitespace_is_refused():
    """``AITER_ATTN_BACKEND`` is read stripped (as ``AITER_ATTN_PLUGINS``): a kernel named
    ``" fast"`` could never be forced through it."""
    reg = KernelRegistry()
    with pytest.raises(ValueError, match=r"name=' fast' has surrounding whitespace; pass 'fast'"):
        reg.register("paged_attention", " fast", _kernel, NEVER)
    assert reg.implementations("paged_attention") == []


# --- AITER_ATTN_BACKEND --------------------------------------------------------------------


def _two_kernels():
    reg = KernelRegistry()
    reg.register("paged_attention", "plain", _kernel, NEVER, priority=10)
    reg.register("paged_attention", "full", _kernel,
                 Capabilities(features={"sinks", "lse"}, cg_support=CGSupport.NEVER))
    return reg


def test_backend_from_the_environment_is_read_stripped(monkeypatch):
    """``AITER_ATTN_BACKEND=" full"`` (a ``.env`` file, a quoted export) raised "backend=' full'
    has no kernel ... available: ['plain', 'full']" although ``full`` is right there; the
    allow-list ``AITER_ATTN_PLUGINS`` strips its names, this one must too."""
    reg = _two_kernels()
    req = KernelRequest(op="paged_attention")
    monkeypatch.setenv("AITER_ATTN_BACKEND", " full \n")
    assert reg.select(req).impl.name == "full"
    assert reg.bound("k", req).name == "full"
    monkeypatch.setenv("AITER_ATTN_BACKEND", "   ")
    assert reg.select(req).impl.name == "plain"  # blank: the automatic choice


def test_unknown_backend_from_the_environment_names_the_variable(monkeypatch):
    """A typo in ``AITER_ATTN_BACKEND`` failed every op call with "backend='tritn' has no
    kernel": the caller passed no ``backend=``, so the error must name the variable and say
    how to fix it."""
    reg = _two_kernels()
    monkeypatch.setenv("AITER_ATTN_BACKEND", "Full")
    with pytest.raises(KernelSelectionError) as err:
        reg.select(KernelRequest(op="paged_attention"))
    msg = str(err.value)
    assert msg.startswith("AITER_ATTN_BACKEND='Full' has no kernel for op 'paged_attention'; "
                          "available: ['plain', 'full']")
    assert "Set AITER_ATTN_BACKEND to one of those, unset it" in msg
    with pytest.raises(KernelSelectionError, match=r"^backend='Full' has no kernel.*Pick one"):
        reg.select(KernelRequest(op="paged_attention"), backend="Full")


@pytest.mark.parametrize("via_env", [True, False], ids=["env", "argument"])
def test_forced_backend_that_cannot_serve_names_the_kernels_that_can(monkeypatch, via_env):
    """A forced backend lacking a feature listed every other kernel as "not the requested
    backend" and advised "pick a backend that supports it" without saying which one does or
    that a variable forced the choice: the error names the forcing (argument or variable),
    the forced kernel's reason, and the kernels that serve the request."""
    reg = _two_kernels()
    req = KernelRequest(op="paged_attention", features={"sinks"})
    reg2 = KernelRegistry()
    reg2.register("paged_attention", "full", _kernel,
                  Capabilities(features={"sinks"}, cg_support=CGSupport.NEVER), priority=10)
    reg2.register("paged_attention", "plain", _kernel, NEVER)
    for r in (reg, reg2):  # the forced kernel after and before the one that can serve
        if via_env:
            monkeypatch.setenv("AITER_ATTN_BACKEND", "plain")
            call = lambda: r.select(req)  # noqa: E731
        else:
            call = lambda: r.select(req, backend="plain")  # noqa: E731
        with pytest.raises(KernelSelectionError) as err:
            call()
        msg = str(err.value)
        assert "plain: missing features ['sinks']" in msg
        assert "not the requested backend" not in msg
        if via_env:
            assert ("AITER_ATTN_BACKEND='plain' forces 'plain'; ['full'] can serve it: unset "
                    "AITER_ATTN_BACKEND") in msg
        else:
            assert "backend='plain' forces 'plain'; ['full'] can serve it: pass backend=None" \
                in msg
    # nothing serves it: every kernel's own reason and the old advice
    with pytest.raises(KernelSelectionError) as err:
        reg.select(KernelRequest(op="paged_attention", features={"window"}), backend="full")
    msg = str(err.value)
    assert "full: missing features ['window']; plain: missing features ['window']" in msg
    assert "Change the layer/config" in msg and "can serve it" not in msg


# --- aiter-attn info -----------------------------------------------------------------------


def test_info_shows_an_empty_capability_set_as_none_not_any(capsys):
    """``Capabilities(devices=set())`` serves no device (e.g. a plugin that computed its
    devices and found none); ``aiter-attn info`` printed ``devices=any`` for it, the opposite
    of what selection does. ``None`` is "any"; an empty set is shown as ``[]``."""
    from aiter_attn.cli import main

    plugins.reset_plugins()
    try:
        plugins.kernel_registry().register(
            "write_kv", "hunt_nothing", _kernel,
            Capabilities(devices=set(), dtypes=(), page_sizes=frozenset(),
                         cg_support=CGSupport.NEVER))
        assert main(["info", "--json"]) == 0
        (row,) = [k for k in json.loads(capsys.readouterr().out)["kernels"]
                  if k["name"] == "hunt_nothing"]
        assert row["devices"] == [] and row["dtypes"] == [] and row["page_sizes"] == []
        (ref,) = [k for k in plugins.kernel_registry().implementations("write_kv")
                  if k.name == "reference"]
        assert ref.capabilities.devices is None  # and the reference still reads "any"
        from aiter_attn.commands.info import collect_info

        (row,) = [k for k in collect_info(device="cpu")["kernels"]
                  if k["op"] == "write_kv" and k["name"] == "reference"]
        assert row["devices"] == "any"
    finally:
        plugins.reset_plugins()


def test_info_table_says_why_a_cells_strategies_declined():
    """A plugin that replaces a cell's strategy pairs with ones whose ``supports()`` declines
    left the table's cell with "no registered strategy serves DECODE × MHA" and no reason,
    although the registry keeps one per pair (the rule: reasons for every rejection)."""
    import attrs

    from aiter_attn.commands.info import mode_arch_table

    plugins.reset_plugins()
    try:
        strategies = plugins.strategy_registry()
        own = [p for p in strategies.pairs()
               if p.arch == AttnArch.MHA and ForwardMode.DECODE in p.modes]
        assert own
        for p in own:
            strategies.register(attrs.evolve(p, supports=lambda cfg: "hunt vendor driver missing"),
                                replace=True)
        rows = mode_arch_table(device="cpu")
        (row,) = [r for r in rows if r["mode"] == "DECODE" and r["arch"] == "MHA"]
        assert row["strategy"] is None
        assert row["why"].startswith("no registered strategy serves DECODE × MHA: ")
        for p in own:
            assert f"{p.name}: hunt vendor driver missing" in row["why"]
    finally:
        plugins.reset_plugins()


def test_output_cut_short_by_its_reader_ends_quietly():
    """``aiter-attn info | head -1``: the reader closes the pipe and the command died with a
    ``BrokenPipeError`` traceback (plus "Exception ignored ... BrokenPipeError" at exit). It
    must end quietly with 141 (128 + SIGPIPE), as a shell reports for a closed pipe."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("AITER_ATTN_PLUGINS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(plugins.__file__)))
    try:  # from the package's folder: the aiter_attn under test, not an installed one
        proc = subprocess.run([sys.executable, "-m", "aiter_attn.cli", "info", "--markdown"],
                              stdout=write, stderr=subprocess.PIPE, env=env, timeout=120,
                              cwd=root)
    finally:
        os.close(write)
    assert proc.stderr.decode() == ""
    assert proc.returncode == 141
