"""Batch-invariant kernel selection: the view of a kernel registry that a backend built with
``BackendConfig(batch_invariant=True)`` selects through.

For the attention ops (:data:`INVARIANT_OPS`) every request gains the ``batch_invariant``
feature, so only kernels that declare it are chosen (the reference and the Triton kernels; a
plugin kernel that does not declare it is passed over with that reason), and the chosen
kernel is called with ``batch_invariant=True`` bound. Every other op (KV writes, index
builders, ``merge_attention_states``) is elementwise per request already and selects as
usual. What the Triton kernels do in this mode is in
:mod:`aiter_attn.kernels.triton._launch_config`.
"""

from __future__ import annotations

import functools
from typing import Optional

import attrs

from .registry import KernelRequest, Selection

__all__ = ["INVARIANT_OPS", "BatchInvariantKernels"]

#: Ops whose kernels take ``batch_invariant=True``.
INVARIANT_OPS = frozenset({"paged_attention", "paged_attention_5d", "mla_paged_attention"})


class BatchInvariantKernels:
    """A :class:`~aiter_attn.kernels.registry.KernelRegistry` view (``select`` and everything
    else delegated) whose attention selections are batch-invariant."""

    def __init__(self, registry):
        self.registry = registry

    def select(self, request: KernelRequest, backend: Optional[str] = None) -> Selection:
        if request.op not in INVARIANT_OPS:
            return self.registry.select(request, backend=backend)
        req = attrs.evolve(request, features=request.features | {"batch_invariant"})
        sel = self.registry.select(req, backend=backend)
        impl = attrs.evolve(sel.impl, fn=functools.partial(sel.impl.fn, batch_invariant=True))
        return Selection(impl, sel.rejected)

    def __getattr__(self, name):
        return getattr(self.registry, name)
