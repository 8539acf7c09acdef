"""Where the Triton kernel tests run, shared by every test file that launches a Triton kernel.

On a CUDA host the kernels run compiled on ``cuda``; on a CPU-only host they run in Triton's
interpreter on ``cpu``, which needs ``TRITON_INTERPRET=1`` in the environment before Triton is
imported (``scripts/test.sh`` sets it). Without either, :data:`requires_triton` skips the test.
"""

from __future__ import annotations

import os

import pytest
import torch

__all__ = ["HAS_CUDA", "INTERPRET", "DEVICE", "requires_triton", "spy_launches"]

HAS_CUDA: bool = torch.cuda.is_available()
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE: str = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

#: Skip marker for tests (or ``pytestmark`` of modules) that launch Triton kernels.
requires_triton = pytest.mark.skipif(
    DEVICE == "cpu" and not INTERPRET,
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1 (scripts/test.sh sets it)",
)


def spy_launches(monkeypatch, launcher, record=None) -> list:
    """Counts ``launcher``'s launches (a :class:`~aiter_attn.kernels.triton._launch.Launcher`):
    every launch goes through its ``launch`` (the planned direct path, ``launch_cached``, is
    turned off: a cached key would launch without it and the spy would miss the call).
    ``record(grid, args, kw, key)`` returns what each launch appends (default ``1``)."""
    calls = []
    real = launcher.launch

    def launch(grid, args, kw, key):
        calls.append(1 if record is None else record(grid, args, kw, key))
        return real(grid, args, kw, key)

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(launcher, "launch_cached", lambda grid, args, key: False)
    return calls
