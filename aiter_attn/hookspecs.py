"""pluggy hook specifications of the ``aiter_attn`` project.

A plugin is a module (or object) with functions marked ``@hookimpl``::

    from aiter_attn.hookspecs import hookimpl
    from aiter_attn.kernels.registry import Capabilities

    @hookimpl
    def aiter_attn_register_kernels(register):
        register("paged_attention", "myvendor", my_kernel, Capabilities(devices={"cuda"}), 50)

Third-party plugins are found through the entry-point group ``aiter_attn``.
"""

from __future__ import annotations

import pluggy

__all__ = ["PROJECT", "hookspec", "hookimpl", "AiterAttnSpec"]

PROJECT = "aiter_attn"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class AiterAttnSpec:
    """The hooks a plugin may implement."""

    @hookspec
    def aiter_attn_register_kernels(self, register):
        """Register kernel implementations.

        ``register(op, name, fn, capabilities=Capabilities(), priority=0, *, replace=False)``
        adds ``fn`` as backend ``name`` of ``op`` (``"paged_attention"``,
        ``"mla_paged_attention"``, ``"write_kv"``, ``"build_page_table"``, …). Higher priority
        wins among those whose capabilities serve a request.
        """

    @hookspec
    def aiter_attn_register_strategies(self, register):
        """Register strategy pairs: ``register(pair: StrategyPair, *, replace=False)``."""
