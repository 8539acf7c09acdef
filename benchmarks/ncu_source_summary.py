"""Summarise an Nsight Compute source page exported as CSV (``ncu --import R.ncu-rep
--page source --csv --print-source sass > R.csv``): the warp-stall samples by reason, the
SASS lines holding the most samples, and the shared-memory wavefronts against the ideal.

Usage (on the GPU machine, after a run with ``--section SourceCounters``)::

    python3 benchmarks/ncu_source_summary.py R.csv [--lines 12]
"""

from __future__ import annotations

import argparse
import csv


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def summarize(path: str, lines: int = 12) -> list:
    """The summary's printed lines (``[]`` headings only where the CSV has no samples)."""
    rows = list(csv.reader(open(path)))
    head = rows[1] if len(rows) > 1 else []
    data = [r for r in rows[2:] if len(r) == len(head)]
    if "Warp Stall Sampling (All Samples)" not in head:
        return [f"no source counters in {path} (columns: {head[:6]})"]
    samp = head.index("Warp Stall Sampling (All Samples)")
    tot = sum(_num(r[samp]) for r in data) or 1.0
    stalls = [h for h in head if h.startswith("stall_") and "Not Issued" not in h]
    agg = sorted(((sum(_num(r[head.index(h)]) for r in data), h) for h in stalls),
                 reverse=True)
    out = [f"samples {tot:.0f}; top stalls: "
           + str([(h, round(100 * v / tot, 1)) for v, h in agg[:8]])]
    src = head.index("Source")
    for r in sorted(data, key=lambda r: -_num(r[samp]))[:lines]:
        out.append(f"{100 * _num(r[samp]) / tot:5.1f}% {r[src][:90]}")
    if "L1 Wavefronts Shared" in head and "L1 Wavefronts Shared Ideal" in head:
        w, wi = head.index("L1 Wavefronts Shared"), head.index("L1 Wavefronts Shared Ideal")
        out.append(f"shared wavefronts {sum(_num(r[w]) for r in data):.0f} ideal "
                   f"{sum(_num(r[wi]) for r in data):.0f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("csv")
    p.add_argument("--lines", type=int, default=12)
    a = p.parse_args()
    print("\n".join(summarize(a.csv, a.lines)))


if __name__ == "__main__":
    main()
