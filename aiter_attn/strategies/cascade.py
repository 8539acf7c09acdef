"""Cascade attention in the execution strategies (MHA and SWA): wrap a layer group's kernel.

With ``BackendConfig.cascade_min_shared_tokens`` set, :class:`CascadeExecutionMixin` wraps
the kernel of every eligible layer group in a
:class:`~aiter_attn.kernels.cascade.CascadeKernel` once, when the group is bound. From then
on nothing changes in the hot path: the group's plan (once per step) groups the batch on the
device and plans the wrapped kernel over the own pages, and a layer call launches the own
pass, the shared pass and the merge (``attend_layer`` → ``kernel.run``).

Eligible groups: causal, no tree mask, not batch-invariant, a non-fp8 cache and a kernel
declaring ``lse`` (:func:`~aiter_attn.kernels.cascade.cascade_reject_reason`); declined groups
keep the ordinary kernel and their reason is kept in ``executor.cascade_declined``. The
shared pass runs in Triton where the wrapped kernel is not the reference (then the cell stays
CUDA-graph capturable), else in torch (eager only, like the reference kernel).
"""

from __future__ import annotations

from ..kernels.cascade import CascadeKernel, _impl_for, cascade_reject_reason

__all__ = ["CascadeExecutionMixin"]


class CascadeExecutionMixin:
    """Mixed into an :class:`~aiter_attn.strategies.base.ExecutionStrategy` whose layer
    calls go through ``attend_layer`` (NHD ``paged_attention`` groups)."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cascade_min_tokens = ctx.config.cascade_min_shared_tokens or 0
        #: group key → why its kernel was not wrapped
        self.cascade_declined: dict = {}

    def bind_layer(self, *args, **kwargs):
        b = super().bind_layer(*args, **kwargs)
        if self.cascade_min_tokens and type(b.kernel) is not CascadeKernel \
                and b.group not in self.cascade_declined:
            self._wrap_group(b)
        return b

    def _wrap_group(self, binding) -> None:
        group = self.groups[binding.group]
        kernel = group.kernel
        if type(kernel) is not CascadeKernel:
            why = ("BackendConfig.batch_invariant" if self.ctx.config.batch_invariant
                   else cascade_reject_reason(kernel.request, kernel))
            if why is not None:
                self.cascade_declined[binding.group] = why
                return
            device = self.ctx.device
            group.kernel = CascadeKernel(kernel, min_shared_tokens=self.cascade_min_tokens,
                                         impl=_impl_for(kernel, device),
                                         tag=group.pages_key or "full")
        binding.kernel = group.kernel
