"""How many CPU threads the engine's torch ops use.

torch's default is every logical CPU, which collapses when other processes compete for the
cores (OpenMP workers spin-wait on each other: one trial ran 10× slower). The automatic
choice is the cores this process may run on (its affinity mask) capped at the physical
cores and at :data:`MAX_AUTO_THREADS`, minus the cores other processes keep busy (the
one-minute load average, rounded down), never below one. An explicit ``--threads N`` or
``OMP_NUM_THREADS`` wins.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Optional

import attrs

__all__ = ["ThreadChoice", "choose_threads", "apply_threads", "physical_cores",
           "MAX_AUTO_THREADS"]

#: more threads rarely help the small models the engine serves on a CPU.
MAX_AUTO_THREADS = 16


@attrs.frozen
class ThreadChoice:
    """``threads`` and how they were chosen (``source``: ``"--threads"``,
    ``"OMP_NUM_THREADS"`` or ``"auto"``; ``detail``: the numbers behind an automatic
    choice)."""

    threads: int
    source: str
    detail: str = ""

    def as_dict(self) -> dict:
        return attrs.asdict(self)


def physical_cores() -> Optional[int]:
    """Physical cores from ``/proc/cpuinfo`` (distinct ``(physical id, core id)``), or
    ``None`` where that file says nothing (not Linux, some containers)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    return len(cores) or None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: Optional[int] = None, *, environ=None, load: Optional[float] = None,
                   affinity: Optional[int] = None,
                   physical: Optional[int] = -1) -> ThreadChoice:
    """The thread count for the engine's CPU work (see the module docstring).

    ``environ`` / ``load`` / ``affinity`` / ``physical`` replace what the machine says
    (tests). Raises ``ValueError`` for a request that is not an int ≥ 1 or an
    ``OMP_NUM_THREADS`` that is not a positive integer.
    """
    env = os.environ if environ is None else environ
    if requested is not None:
        # int(2.5) would run 2 threads without a word; a str failed comparing with 1
        if isinstance(requested, bool) or not isinstance(requested, numbers.Integral) \
                or requested < 1:
            raise ValueError(f"--threads={requested!r}; must be an int ≥ 1.")
        return ThreadChoice(int(requested), "--threads")
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        # str.isdigit also takes digits int() refuses (superscripts: "²")
        if not (omp.isascii() and omp.isdigit()) or int(omp) < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r}; must be a positive integer (or unset).")
        return ThreadChoice(int(omp), "OMP_NUM_THREADS")
    aff = _affinity() if affinity is None else affinity
    phys = physical_cores() if physical == -1 else physical
    busy = _load() if load is None else load
    cap = min(aff, phys or aff, MAX_AUTO_THREADS)
    # at start-up this process has hardly run yet: the load average is the others' demand
    n = max(1, cap - int(busy))
    return ThreadChoice(n, "auto", f"affinity {aff}, physical cores {phys or 'unknown'}, cap "
                                   f"{MAX_AUTO_THREADS}, 1-min load {busy:.1f}")


def apply_threads(choice: ThreadChoice) -> ThreadChoice:
    """``torch.set_num_threads(choice.threads)``; returns ``choice``."""
    import torch

    torch.set_num_threads(choice.threads)
    return choice
