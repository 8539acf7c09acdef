"""Grid dependency control (programmatic dependent launch, sm_90+) for this package's
kernels: ``gdc_wait`` blocks until the kernel launched before on the stream has finished and
its writes are visible; ``gdc_launch_dependents`` lets the next kernel (launched with
``launch_pdl=True``) start while this one still runs. Both are no-ops in a launch without
the attribute. Kernels call them only under a ``PDL`` constexpr that the host sets where
:func:`._kvutil.pdl_supported` holds (never in the interpreter, which has no inline PTX)."""

from __future__ import annotations

try:  # Triton >= 3.4 (NVIDIA)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never requested then
    import triton

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_wait", "gdc_launch_dependents"]
