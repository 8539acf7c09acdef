"""Plugin loading: built-ins and third parties through one pluggy path, lazily and once.

Sources, in load order:

1. core built-ins (:data:`CORE_PLUGINS`: reference kernels, strategy families) — always loaded;
2. optional built-ins (:data:`OPTIONAL_PLUGINS`: the ``triton`` and ``aiter`` kernels);
3. third parties: every entry point of the group ``aiter_attn`` (``name = "module[:attr]"``).

``AITER_ATTN_PLUGINS`` (comma-separated names) is an allow-list: when set, only the core
built-ins and the named plugins load, and every named plugin is *requested*: if it is missing,
fails to import, fails validation or its hook raises, loading raises :class:`PluginLoadError`.
A plugin that was not requested by name and fails any of those steps is logged (warning) and
skipped; :func:`skipped_plugins` says why.

Validation (:func:`validate_plugin`): every attribute named ``aiter_attn_*`` must be a hook of
:class:`~aiter_attn.hookspecs.AiterAttnSpec` marked ``@hookimpl``, not as a wrapper (so a
typo cannot be silently ignored); pluggy checks the argument names on ``register`` and
``PluginManager.check_pending`` runs after each plugin. A hook registers through the
``register`` it is given while it runs and returns ``None`` (:func:`build_registries`).

Loading is lazy (first call of :func:`kernel_registry` / :func:`strategy_registry` /
:func:`get_plugin_manager`) and idempotent (one process-wide state; :func:`reset_plugins`
forgets it, e.g. after changing ``AITER_ATTN_PLUGINS``). Tests build their own managers with
:func:`new_plugin_manager`, :func:`load_plugins` and :func:`build_registries`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import threading
from typing import Iterable, Optional

import attrs
import pluggy

from .hookspecs import HOOK_PREFIX, PROJECT, AiterAttnSpec, hook_names

__all__ = [
    "CORE_PLUGINS",
    "OPTIONAL_PLUGINS",
    "ENTRY_POINT_GROUP",
    "ENV_ALLOW",
    "PluginLoadError",
    "PluginValidationError",
    "PluginSource",
    "LoadReport",
    "allow_list",
    "discover_plugins",
    "new_plugin_manager",
    "validate_plugin",
    "register_plugin",
    "load_plugins",
    "build_registries",
    "add_kernels",
    "get_plugin_manager",
    "kernel_registry",
    "strategy_registry",
    "loaded_plugins",
    "skipped_plugins",
    "reset_plugins",
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


class PluginValidationError(ValueError):
    """A plugin's hook implementations do not match :class:`AiterAttnSpec`."""


@attrs.frozen
class PluginSource:
    """Where one plugin comes from.

    Attributes:
        name: the plugin's name (allow-list key, ``source`` of its registrations).
        target: ``"module"`` or ``"module:attribute"``.
        kind: ``"core"``, ``"builtin"`` (optional built-in) or ``"entry_point"``.
    """

    name: str
    target: str
    kind: str


@attrs.define
class LoadReport:
    """What :func:`load_plugins` did: plugin names in load order, skipped ones with reasons."""

    loaded: list = attrs.Factory(list)
    skipped: dict = attrs.Factory(dict)
    requested: frozenset = frozenset()
    #: entry points not loaded because their name was taken: ``{"name = target (distribution
    #: d)": why}`` (the name's plugin that loads instead is in ``loaded``)
    shadowed: dict = attrs.Factory(dict)


def allow_list(value: Optional[str] = None) -> Optional[frozenset]:
    """Parse an allow-list (default: ``$AITER_ATTN_PLUGINS``); ``None`` means everything."""
    raw = os.environ.get(ENV_ALLOW, "") if value is None else value
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    return names or None


def _target_module(target: str) -> str:
    """The module of ``"module[:attr] [extras]"`` (an entry point's value may end in extras,
    which the packaging spec says consumers parse and may ignore)."""
    return target.partition("[")[0].partition(":")[0].strip()


def _import_target(target: str):
    _, _, attr = target.partition("[")[0].partition(":")
    obj = importlib.import_module(_target_module(target))
    for part in filter(None, attr.strip().split(".")):
        obj = getattr(obj, part)
    return obj


def discover_plugins(*, builtins: bool = True, entry_points: bool = True,
                     shadowed: Optional[dict] = None) -> list[PluginSource]:
    """Every known plugin source in load order (built-ins first, then entry points by name).
    An entry point whose name is taken (by a built-in or another distribution's entry point)
    is left out with a warning, and recorded in ``shadowed`` (a dict, when given) as
    ``{"name = target (distribution d)": why}``."""
    sources: list[PluginSource] = []
    if builtins:
        sources += [PluginSource(n, m, "core") for n, m in CORE_PLUGINS.items()]
        sources += [PluginSource(n, m, "builtin") for n, m in OPTIONAL_PLUGINS.items()]
    if entry_points:
        seen = {s.name: s for s in sources}
        eps = sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        for ep in eps:
            taken = seen.get(ep.name)
            if taken is not None:
                by = ("a built-in plugin" if taken.kind != "entry_point" else
                      f"the entry point {taken.name} = {taken.target} of another distribution, "
                      "which loads instead")
                log.warning("entry point %s = %s%s ignored: the name %r is taken by %s; "
                            "rename one of them (the entry point's name is the plugin's name)",
                            ep.name, ep.value, _dist_of(ep), ep.name, by)
                if shadowed is not None:
                    shadowed[f"{ep.name} = {ep.value}{_dist_of(ep)}"] = (
                        f"the name {ep.name!r} is taken by {by}")
                continue
            seen[ep.name] = source = PluginSource(ep.name, ep.value, "entry_point")
            sources.append(source)
    return sources


def _dist_of(ep) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    return f" (distribution {name})" if name else ""


def new_plugin_manager() -> pluggy.PluginManager:
    """An empty :class:`pluggy.PluginManager` for the project's hooks."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(AiterAttnSpec)
    return pm


def validate_plugin(pm: pluggy.PluginManager, name: str, plugin) -> None:
    """Raise :class:`PluginValidationError` unless every ``aiter_attn_*`` attribute of
    ``plugin`` is a known hook marked ``@hookimpl``."""
    known = hook_names()
    for attr in dir(plugin):
        if not attr.startswith(HOOK_PREFIX):
            continue
        if attr not in known:
            raise PluginValidationError(
                f"plugin {name!r} defines {attr!r}, which is not an aiter_attn hook; the hooks "
                f"are {sorted(known)}. Fix the name, or drop the {HOOK_PREFIX!r} prefix if it is "
                "not meant as a hook."
            )
        if pm.parse_hookimpl_opts(plugin, attr) is None:
            raise PluginValidationError(
                f"plugin {name!r} defines {attr!r} without the @hookimpl marker, so it would "
                "never be called; decorate it with aiter_attn.hookspecs.hookimpl."
            )


def register_plugin(pm: pluggy.PluginManager, name: str, plugin) -> None:
    """Validate and register ``plugin`` under ``name``; on any problem nothing stays registered.

    Raises :class:`PluginValidationError` (bad hooks) or ``ValueError`` (name taken).
    """
    if pm.has_plugin(name):
        raise ValueError(f"a plugin named {name!r} is already registered; names must be unique.")
    validate_plugin(pm, name, plugin)
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginValidationError(
            f"plugin {name!r} does not match the hook specs: {exc}") from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        pm.unregister(name=name)
        raise PluginValidationError(f"plugin {name!r} implements unknown hooks: {exc}") from exc
    # registration hooks are called once per plugin with a recorder (build_registries), not
    # through pluggy's call loop: a wrapper would only be started, never run
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.hookwrapper or impl.wrapper):
                pm.unregister(name=name)
                raise PluginValidationError(
                    f"plugin {name!r} marks {caller.name!r} as a hook wrapper "
                    "(hookwrapper=True or wrapper=True); the aiter_attn hooks are called once "
                    "per plugin and take no wrappers. Use a plain @hookimpl."
                )


def _fail(report: LoadReport, source: PluginSource, what: str, exc: BaseException, *,
          quiet: bool = False) -> None:
    reason = f"{what}: {type(exc).__name__}: {exc}"
    if source.name in report.requested:
        raise PluginLoadError(
            f"plugin {source.name!r} ({source.target}), requested in {ENV_ALLOW}, {reason}"
        ) from exc
    report.skipped[source.name] = reason
    if quiet:
        log.debug("built-in plugin %s (%s) is not present", source.name, source.target)
    else:
        log.warning("plugin %s (%s) skipped: %s", source.name, source.target, reason)


def load_plugins(
    pm: pluggy.PluginManager,
    *,
    allow: "Optional[Iterable[str] | str]" = "env",
    builtins: bool = True,
    entry_points: bool = True,
    sources: Optional[Iterable[PluginSource]] = None,
) -> LoadReport:
    """Import, validate and register plugins into ``pm``.

    Args:
        allow: names to load besides the core built-ins; ``"env"`` reads ``AITER_ATTN_PLUGINS``;
            ``None`` loads everything. Named plugins are *requested*: failures raise.
        builtins, entry_points: which sources to consider (ignored when ``sources`` is given).
        sources: explicit plugin sources (tests).

    Returns:
        A :class:`LoadReport`; raises :class:`PluginLoadError` for a requested plugin that is
        missing or broken.
    """
    if allow == "env":
        allow = allow_list()
    elif isinstance(allow, str):
        allow = allow_list(allow)
    elif allow is not None:
        allow = frozenset(allow)
    report = LoadReport(requested=frozenset(allow or ()))
    if sources is None:
        sources = discover_plugins(builtins=builtins, entry_points=entry_points,
                                   shadowed=report.shadowed)
        clash = sorted(k for k in report.shadowed if k.partition(" = ")[0] in report.requested)
        if clash:
            raise PluginLoadError(
                f"{ENV_ALLOW} requests a plugin whose name more than one plugin has: "
                f"{clash} left out ({'; '.join(report.shadowed[k] for k in clash)}). Which "
                "one would load is an accident of install order: uninstall one of them or "
                "rename its entry point.")
    sources = list(sources)
    for source in sources:
        if allow is not None and source.kind != "core" and source.name not in allow:
            continue
        if pm.has_plugin(source.name):  # loaded before: loading is idempotent
            if source.name not in report.loaded:
                report.loaded.append(source.name)
            continue
        try:
            plugin = _import_target(source.target)
        except ModuleNotFoundError as exc:
            # A built-in module that this build does not have yet is no news.
            own_module = exc.name == _target_module(source.target)
            _fail(report, source, "could not be imported", exc,
                  quiet=own_module and source.kind != "entry_point")
            continue
        except (Exception, SystemExit) as exc:  # a broken plugin must never take the
            # library down, not even one that calls sys.exit() when its driver is missing
            _fail(report, source, "failed to import", exc)
            continue
        if pm.is_registered(plugin):
            log.debug("plugin %s is already registered under another name", source.name)
            continue
        try:
            register_plugin(pm, source.name, plugin)
        except (PluginValidationError, ValueError) as exc:
            _fail(report, source, "is invalid", exc)
            continue
        report.loaded.append(source.name)
    if allow is not None:
        known = {s.name for s in sources}
        missing = sorted(set(allow) - known)
        if missing:
            raise PluginLoadError(
                f"{ENV_ALLOW} names plugins that are not installed: {missing}; installed: "
                f"{sorted(known)}. Install the plugin package (entry-point group "
                f"'{ENTRY_POINT_GROUP}') or fix the name."
            )
    return report


def build_registries(pm: pluggy.PluginManager, *, requested: Iterable[str] = (),
                     report: Optional[LoadReport] = None):
    """Run every plugin's registration hooks into fresh registries, plugins in load order.

    A plugin counts as a whole: if one of its hooks raises, or one of its registrations is
    refused (a name taken without ``replace=True``, a wrong argument), none of its
    registrations are kept and it is unregistered and logged, unless it is in ``requested``
    (or ``report.requested``): then :class:`PluginLoadError`. Returns
    ``(KernelRegistry, StrategyRegistry)``.
    """
    from .kernels.registry import Capabilities, KernelRegistry
    from .registry import StrategyRegistry

    requested = frozenset(requested) | (report.requested if report else frozenset())
    names = [name for name, _ in pm.list_name_plugin()]
    staged: dict = {name: [] for name in names}
    failed: dict = {}

    def fail(name: str, msg: str, exc: Exception) -> None:
        if name in requested:
            raise PluginLoadError(f"plugin {name!r}: {msg}") from exc
        log.warning("plugin %s skipped: %s", name, msg)
        failed[name] = msg

    # 1. call the hooks, recording what each plugin registers
    for kind, hook in (("kernel", pm.hook.aiter_attn_register_kernels),
                       ("strategy", pm.hook.aiter_attn_register_strategies)):
        for impl in hook.get_hookimpls():
            name = impl.plugin_name
            if name in failed:
                continue
            register = _Recorder(kind, name, hook.name)
            try:
                result = impl.function(register=register)
            except (Exception, SystemExit) as exc:  # SystemExit: as at import (load_plugins)
                fail(name, f"its {hook.name} hook failed: {type(exc).__name__}: {exc}", exc)
                continue
            finally:
                register.closed = True
            if result is not None:
                msg = (f"its {hook.name} hook returned {result!r}; a hook registers by calling "
                       "register(...) and returns None (a returned value is never used)")
                fail(name, msg, TypeError(msg))
                continue
            staged.setdefault(name, []).extend(register.calls)

    # 2. apply them in load order; a refused registration drops its plugin and starts over
    while True:
        kernels, strategies = KernelRegistry(), StrategyRegistry()
        culprit = None
        for name in names:
            if name in failed:
                continue
            try:
                for kind, a, k in staged.get(name, ()):
                    if kind == "kernel":
                        _apply_kernel(kernels, Capabilities, name, *a, **k)
                    else:
                        _apply_strategy(strategies, name, *a, **k)
            except Exception as exc:
                fail(name, f"a registration was refused: {type(exc).__name__}: {exc}", exc)
                culprit = name
                break
        if culprit is None:
            break

    for name, msg in failed.items():
        if pm.has_plugin(name):
            pm.unregister(name=name)
        if report is not None:
            report.skipped[name] = msg
            if name in report.loaded:
                report.loaded.remove(name)
    return kernels, strategies


class _Recorder:
    """The ``register`` callback one plugin's hook gets: records its calls while the hook
    runs; a call after the hook returned (a plugin that kept the callback) raises, since the
    registries are already built and the registration would be lost silently."""

    def __init__(self, kind: str, plugin: str, hook: str):
        self.kind, self.plugin, self.hook = kind, plugin, hook
        self.calls: list = []
        self.closed = False

    def __call__(self, *args, **kwargs):
        if self.closed:
            raise RuntimeError(
                f"plugin {self.plugin!r} called register{_call_repr(args, kwargs)} after its "
                f"{self.hook} hook returned; registrations are taken only while the hook runs "
                "(the registries are built once, at first use). Call register inside the hook; "
                "to extend a built registry call its register() method, or "
                "aiter_attn.plugins.reset_plugins() to load the plugins again."
            )
        self.calls.append((self.kind, args, kwargs))


def _call_repr(args, kwargs) -> str:
    parts = [repr(a) for a in args[:2]] + (["..."] if len(args) > 2 or kwargs else [])
    return f"({', '.join(parts)})"


def _apply_kernel(kernels, capabilities_type, source, op, name, fn, capabilities=None,
                  priority=0, *, replace=False):
    if capabilities is None:
        raise TypeError(
            f"register({op!r}, {name!r}, fn) without capabilities: pass a "
            f"{capabilities_type.__module__}.Capabilities that states at least cg_support "
            "(how far the kernel runs under CUDA-graph capture)."
        )
    kernels.register(op, name, fn, capabilities, priority, source=source, replace=replace)


def add_kernels(registry, hook, *, source: str, skip_registered: bool = False) -> None:
    """Run one plugin's kernel hook (``aiter_attn_register_kernels``) into an existing
    ``registry`` (the same checks as loading; ``skip_registered``: leave names the registry
    already has for an op). For callers that extend a registry after loading, e.g. the
    conformance self-test adding its mutants."""
    from .kernels.registry import Capabilities

    def register(op, name, fn, capabilities=None, priority=0, *, replace=False):
        if skip_registered and any(i.name == name for i in registry.implementations(op)):
            return
        _apply_kernel(registry, Capabilities, source, op, name, fn, capabilities, priority,
                      replace=replace)

    hook(register=register)


def _apply_strategy(strategies, source, pair, *, replace=False):
    strategies.register(pair, replace=replace, source=source)


_lock = threading.RLock()
_state: dict = {}


def _ensure() -> dict:
    with _lock:
        if "pm" not in _state:
            pm = new_plugin_manager()
            report = load_plugins(pm)
            kernels, strategies = build_registries(pm, report=report)
            _state.update(pm=pm, report=report, kernels=kernels, strategies=strategies)
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
    """Names of the registered plugins, in load order."""
    return [name for name, _ in get_plugin_manager().list_name_plugin()]


def skipped_plugins() -> dict:
    """``{name: reason}`` for plugins that were found but skipped (import/validation/hook)."""
    return dict(_ensure()["report"].skipped)


def shadowed_plugins() -> dict:
    """``{"name = target (distribution d)": reason}`` for entry points left out because
    their name was taken (:attr:`LoadReport.shadowed`)."""
    return dict(_ensure()["report"].shadowed)


def reset_plugins() -> None:
    """Forget loaded plugins and registries (tests; after changing ``AITER_ATTN_PLUGINS``)."""
    with _lock:
        _state.clear()
