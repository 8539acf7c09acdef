"""Batch-invariant kernel selection: the view of a kernel registry that a backend built with
``BackendConfig(batch_invariant=True)`` selects through.

For the attention ops (:data:`INVARIANT_OPS`) every request gains the ``batch_invariant``
feature, so only kernels that declare it are chosen (the reference and the Triton kernels; a
plugin kernel that does not declare it is passed over with that reason). A kernel object
(``Selection.bind``) is bound to the request with the feature, and plans batch-invariant
launches; the functional convenience of ``mla_paged_attention`` (``Selection.fn``) is
called with ``batch_invariant=True``. Every other op (KV writes, index builders,
``merge_attention_states``) is elementwise per request already and selects as usual. What
the Triton kernels do in this mode is in :mod:`aiter_attn.kernels.triton._launch_config`.
"""

from __future__ import annotations

import functools
from typing import Optional

import attrs

from .registry import KernelRequest, Selection

__all__ = ["INVARIANT_OPS", "BatchInvariantKernels", "invariant"]

#: Ops whose kernels serve the ``batch_invariant`` feature.
INVARIANT_OPS = frozenset({"paged_attention", "paged_attention_5d", "mla_paged_attention"})


def invariant(request: Optional[KernelRequest]) -> Optional[KernelRequest]:
    """``request`` with the ``batch_invariant`` feature (``None`` stays ``None``)."""
    if request is None or "batch_invariant" in request.features:
        return request
    return attrs.evolve(request, features=request.features | {"batch_invariant"})


@attrs.frozen
class _InvariantSelection(Selection):
    """A selection whose ``bind`` binds to the batch-invariant form of the request."""

    def bind(self, request: Optional[KernelRequest] = None):
        return super().bind(invariant(request))  # (checked-mode wrapping included)


class BatchInvariantKernels:
    """A :class:`~aiter_attn.kernels.registry.KernelRegistry` view (everything but ``select``
    and ``bound`` delegated) whose attention selections are batch-invariant."""

    def __init__(self, registry):
        self.registry = registry

    def select(self, request: KernelRequest, backend: Optional[str] = None,
               **kwargs) -> Selection:
        """:meth:`KernelRegistry.select` (its keyword options passed on) of the invariant
        request for the attention ops."""
        if request.op not in INVARIANT_OPS:
            return self.registry.select(request, backend=backend, **kwargs)
        sel = self.registry.select(invariant(request), backend=backend, **kwargs)
        impl = sel.impl
        if request.op == "mla_paged_attention":
            # its functional convenience (``impl.fn``, what ops.mla_paged_attention calls)
            # takes the flag; bound kernel objects get it from the request (``bind`` below)
            impl = attrs.evolve(impl, fn=functools.partial(impl.fn, batch_invariant=True))
        return _InvariantSelection(impl, sel.rejected, sel.check_values)

    def bound(self, key, request, backend: Optional[str] = None):
        """:meth:`KernelRegistry.bound` of the batch-invariant request."""
        def req():
            r = request() if callable(request) else request
            return invariant(r) if r.op in INVARIANT_OPS else r

        return self.registry.bound(("batch_invariant", key), req, backend=backend)

    def __getattr__(self, name):
        return getattr(self.registry, name)
