"""Programmatic dependent launch (PDL, grid dependency control, sm_90+) for this package's
kernels: one family, host and device side.

Device: :func:`wait_then_release` (``griddepcontrol.wait`` then
``griddepcontrol.launch_dependents``) at the top of a kernel launched with
``launch_pdl=True``: it blocks until the kernel before it on the stream has finished and its
writes are visible, then lets the next PDL launch start. Both are no-ops in a launch without
the attribute. Kernels call it only under a ``PDL`` constexpr (never in the interpreter,
which has no inline PTX).

Host: :func:`pdl_mode` turns a tuning request into ``False`` / ``True`` (the attention
launch and its split reduction both start early) / ``"reduce"`` (only the reduction) /
``"early"`` (:data:`EARLY_KEYS`: as ``True``, and a kernel that can also read, before its
wait, what the kernel before never writes: the index tensors and the keys older than the
step's new ones; the narrow MLA kernel issues its first tiles of them), where the device
has PDL; :func:`pdl_kwargs` gives the constexpr and launch option of each launch.

``"early"`` is a contract with the engine: the kernel right before the attention launch, if
it lets its dependents start early (``griddepcontrol.launch_dependents``), writes none of
``cu_seqlens_q``, ``seqused_k``, the block table, or a key row other than the step's new
tokens' (the last ``q_len`` keys of each request). Kernels that do not signal their
dependents (cuBLAS, torch's own) end before the launch starts, as without PDL.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import _interpreting as interpreting

try:  # Triton >= 3.4 (NVIDIA)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never requested then
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["wait_then_release", "pdl_supported", "pdl_mode", "pdl_kwargs", "EARLY_KEYS"]

#: the ``pdl`` mode whose attention launch reads the index tensors and the older keys
#: before its wait (module docstring)
EARLY_KEYS = "early"


@triton.jit
def wait_then_release():
    """The previous kernel's writes first (the K/V cache, indices, split partials), then let
    the next PDL launch start (it waits for this kernel in turn)."""
    gdc_wait()
    gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _pdl_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_supported(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches: CUDA sm_90+, not the
    interpreter (cached host query)."""
    if device.type != "cuda" or interpreting() or torch.version.cuda is None:
        return False
    return _pdl_capable(device.index if device.index is not None
                        else torch.cuda.current_device())


def pdl_mode(requested, device: torch.device):
    """``requested`` (a tuning value: falsy, ``True``, ``"reduce"`` or ``"early"``) where
    ``device`` has PDL, else ``False``."""
    if not requested or not pdl_supported(device):
        return False
    return requested if requested in ("reduce", EARLY_KEYS) else True


def pdl_kwargs(mode, *, reduction: bool) -> dict:
    """Launch keywords for ``mode`` (:func:`pdl_mode`): the ``PDL`` constexpr of a kernel
    that signals its dependents, plus ``launch_pdl`` where that launch itself starts early
    (the reduction under any mode, the attention launch only under ``True`` and
    ``"early"``, which kernels without early reads take as ``True``)."""
    kw = {"PDL": bool(mode)}
    if mode is True or mode == EARLY_KEYS or (mode and reduction):
        kw["launch_pdl"] = True
    return kw
