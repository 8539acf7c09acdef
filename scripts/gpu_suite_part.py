"""Which test files make part ``k`` of ``n`` of the gpu suite, so that a suite too long for
one 10-minute device call runs whole over ``n`` calls (``scripts/gpu_session.sh suite k n``).

Files go to parts greedily by their gpu test counts (largest first, onto the lightest part),
so the split is the same on every machine that collects the same tests. Prints the part's
files, one per line.

    python3 scripts/gpu_suite_part.py 1 2 [--counts COLLECT_OUTPUT]
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys


def file_counts(collected: str) -> dict:
    """``{file: number of tests}`` from ``pytest --collect-only -q`` output (node ids
    ``file::test``; other lines are ignored)."""
    counts = collections.Counter()
    for line in collected.splitlines():
        if "::" in line and not line.startswith(" "):
            counts[line.split("::", 1)[0]] += 1
    return dict(counts)


def split(counts: dict, parts: int) -> list:
    """``parts`` lists of files with about equal test counts (greedy, largest first; ties
    broken by name, so the split is deterministic)."""
    if parts < 1:
        raise ValueError(f"parts={parts}: need at least 1")
    loads = [(0, i, []) for i in range(parts)]
    for f, c in sorted(counts.items(), key=lambda fc: (-fc[1], fc[0])):
        load, i, files = min(loads)
        files.append(f)
        loads[i] = (load + c, i, files)
    return [sorted(files) for _, _, files in sorted(loads, key=lambda x: x[1])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("part", type=int, help="1-based")
    p.add_argument("parts", type=int)
    p.add_argument("--counts", default="", help="a saved `pytest --collect-only -q -m gpu` "
                   "output to read instead of collecting")
    a = p.parse_args()
    if not 1 <= a.part <= a.parts:
        raise SystemExit(f"part {a.part} of {a.parts}: the part must be in 1..{a.parts}")
    if a.counts:
        with open(a.counts) as f:
            text = f.read()
    else:
        text = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m",
                               "gpu", "tests", "-p", "no:randomly", "-p", "no:cacheprovider"],
                              capture_output=True, text=True).stdout
    print("\n".join(split(file_counts(text), a.parts)[a.part - 1]))


if __name__ == "__main__":
    main()
