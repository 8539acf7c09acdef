"""pluggy hook specifications of the ``aiter_attn`` project.

A plugin is a module (or any object) with functions marked ``@hookimpl``::

    from aiter_attn.hookspecs import hookimpl
    from aiter_attn.kernels.registry import Capabilities
    from aiter_attn.types import CGSupport

    @hookimpl
    def aiter_attn_register_kernels(register):
        register("paged_attention", "myvendor", my_kernel,
                 Capabilities(devices={"cuda"}, cg_support=CGSupport.NEVER), priority=50)

Third-party plugins are found through the entry-point group ``aiter_attn`` (see
``docs/plugins.md``); the built-ins (reference kernels, strategies, ``triton``, ``aiter``)
load through the same loader in :mod:`aiter_attn.plugins`. Every attribute of a plugin whose
name starts with ``aiter_attn_`` must be one of the hooks below, marked ``@hookimpl``;
anything else (a typo such as ``aiter_attn_register_kernel``) makes the plugin invalid, and
so does a hook marked as a wrapper (``hookwrapper=True``/``wrapper=True``): each hook is
called once per plugin.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "HOOK_PREFIX", "hookspec", "hookimpl", "AiterAttnSpec", "hook_names"]

PROJECT = "aiter_attn"
#: Every hook's name starts with this; plugins must not use it for anything else.
HOOK_PREFIX = "aiter_attn_"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class AiterAttnSpec:
    """The hooks a plugin may implement (each is called once per plugin, at first use)."""

    @hookspec
    def aiter_attn_register_kernels(self, register):
        """Register kernel implementations.

        ``register(op, name, fn, capabilities, priority=0, *, replace=False)``
        adds ``fn`` as backend ``name`` of ``op`` (``"paged_attention"``,
        ``"mla_paged_attention"``, ``"write_kv"``, ``"build_page_table"``, …; the calling
        convention of each op is the matching ``*_reference`` function in
        :mod:`aiter_attn.kernels.reference`). ``capabilities`` is a
        :class:`~aiter_attn.kernels.registry.Capabilities` that must state ``cg_support``
        (no default); a registration without it is refused and the plugin skipped. Higher
        priority (an int) wins among those whose capabilities serve a request; ``replace=True``
        overrides an existing name. Call ``register`` while the hook runs (a call after it
        returned raises ``RuntimeError``) and return ``None``.
        """

    @hookspec
    def aiter_attn_register_strategies(self, register):
        """Register strategy pairs: ``register(pair: StrategyPair, *, replace=False)``, called
        while the hook runs; the hook returns ``None``."""


def hook_names() -> frozenset:
    """Names of every hook in :class:`AiterAttnSpec`."""
    return frozenset(n for n in vars(AiterAttnSpec) if n.startswith(HOOK_PREFIX))
