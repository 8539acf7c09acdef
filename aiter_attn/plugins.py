"""Plugin loading: built-ins and third parties through one pluggy path, lazily and once.

Built-in plugins are modules of this package. Third-party plugins come from the entry-point
group ``aiter_attn``. ``AITER_ATTN_PLUGINS`` (comma-separated plugin names) allow-lists the
optional ones (the ``triton`` and ``aiter`` kernels and third parties); core built-ins
(reference kernels, strategies) always load. A plugin whose import fails is logged and
skipped, and raises only if it was asked for by name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from typing import Optional

import pluggy

from .hookspecs import PROJECT, AiterAttnSpec

__all__ = [
    "CORE_PLUGINS",
    "OPTIONAL_PLUGINS",
    "PluginLoadError",
    "get_plugin_manager",
    "kernel_registry",
    "strategy_registry",
    "loaded_plugins",
    "reset_plugins",
    "build_registries",
]

log = logging.getLogger(__name__)

#: name → module; always loaded (a missing module is skipped quietly: not every build has all).
CORE_PLUGINS = {
    "reference": "aiter_attn.kernels.reference",
    "reference_extra": "aiter_attn.kernels.reference_extra",
    "strategies.mha": "aiter_attn.strategies.mha",
    "strategies.spec": "aiter_attn.strategies.spec",
    "strategies.mla": "aiter_attn.strategies.mla",
    "strategies.swa": "aiter_attn.strategies.swa",
    "strategies.vec5d": "aiter_attn.strategies.vec5d",
}
#: name → module; loaded unless ``AITER_ATTN_PLUGINS`` leaves them out.
OPTIONAL_PLUGINS = {
    "triton": "aiter_attn.kernels.triton",
    "aiter": "aiter_attn.kernels.aiter",
}
ENTRY_POINT_GROUP = PROJECT
ENV_ALLOW = "AITER_ATTN_PLUGINS"


class PluginLoadError(ImportError):
    """A plugin asked for by name (``AITER_ATTN_PLUGINS``) could not be loaded."""


_lock = threading.RLock()
_state: dict = {}


def _allow_list() -> Optional[set]:
    raw = os.environ.get(ENV_ALLOW, "").strip()
    if not raw:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def _load_module(name: str, module: str, *, requested: bool, quiet_missing: bool):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if requested:
            raise PluginLoadError(f"plugin {name!r} ({module}) could not be imported: {exc}") from exc
        if quiet_missing and exc.name == module:
            log.debug("built-in plugin %s (%s) is not present", name, module)
        else:
            log.warning("plugin %s skipped: import of %s failed: %s", name, module, exc)
    except Exception as exc:  # a broken plugin must never take the library down
        if requested:
            raise PluginLoadError(f"plugin {name!r} ({module}) failed to import: {exc}") from exc
        log.warning("plugin %s skipped: import of %s failed: %r", name, module, exc)
    return None


def _new_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(AiterAttnSpec)
    allow = _allow_list()
    for name, module in CORE_PLUGINS.items():
        mod = _load_module(name, module, requested=bool(allow and name in allow), quiet_missing=True)
        if mod is not None:
            pm.register(mod, name=name)
    for name, module in OPTIONAL_PLUGINS.items():
        if allow is not None and name not in allow:
            continue
        mod = _load_module(name, module, requested=bool(allow and name in allow), quiet_missing=True)
        if mod is not None:
            pm.register(mod, name=name)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allow is not None and ep.name not in allow:
            continue
        if pm.has_plugin(ep.name):
            continue
        try:
            obj = ep.load()
        except Exception as exc:
            if allow is not None and ep.name in allow:
                raise PluginLoadError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
            log.warning("plugin %s skipped: loading %s failed: %r", ep.name, ep.value, exc)
            continue
        pm.register(obj, name=ep.name)
    if allow is not None:
        missing = allow - {n for n, _ in pm.list_name_plugin()}
        if missing:
            raise PluginLoadError(
                f"{ENV_ALLOW} names plugins that are not installed: {sorted(missing)}; "
                f"known: {sorted(set(CORE_PLUGINS) | set(OPTIONAL_PLUGINS))} and the "
                f"'{ENTRY_POINT_GROUP}' entry points."
            )
    pm.check_pending()
    return pm


def build_registries(pm: pluggy.PluginManager):
    """Run the registration hooks of every plugin in ``pm`` into fresh registries."""
    from .kernels.registry import KernelRegistry
    from .registry import StrategyRegistry

    kernels, strategies = KernelRegistry(), StrategyRegistry()

    def kernel_registrar(source):
        def register(op, name, fn, capabilities=None, priority=0, *, replace=False):
            from .kernels.registry import Capabilities

            return kernels.register(
                op, name, fn, capabilities or Capabilities(), priority,
                source=source, replace=replace,
            )

        return register

    def strategy_registrar(source):
        def register(pair, *, replace=False):
            return strategies.register(pair, replace=replace, source=source)

        return register

    # Call each implementation with a registrar bound to its plugin's name, so every
    # registration records where it came from (pluggy's public HookImpl API).
    for impl in pm.hook.aiter_attn_register_kernels.get_hookimpls():
        impl.function(register=kernel_registrar(impl.plugin_name))
    for impl in pm.hook.aiter_attn_register_strategies.get_hookimpls():
        impl.function(register=strategy_registrar(impl.plugin_name))
    return kernels, strategies


def _ensure():
    with _lock:
        if "pm" not in _state:
            pm = _new_manager()
            kernels, strategies = build_registries(pm)
            _state.update(pm=pm, kernels=kernels, strategies=strategies)
        return _state


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager (loaded on first use)."""
    return _ensure()["pm"]


def kernel_registry():
    """The process-wide :class:`~aiter_attn.kernels.registry.KernelRegistry`."""
    return _ensure()["kernels"]


def strategy_registry():
    """The process-wide :class:`~aiter_attn.registry.StrategyRegistry`."""
    return _ensure()["strategies"]


def loaded_plugins() -> list[str]:
    return [name for name, _ in get_plugin_manager().list_name_plugin()]


def reset_plugins() -> None:
    """Forget loaded plugins and registries (tests; after changing ``AITER_ATTN_PLUGINS``)."""
    with _lock:
        _state.clear()
