"""``benchmarks/ncu_source_summary.py`` on a hand-built Nsight Compute source CSV (the
export's first row names sections, the second the columns; the counts carry commas)."""

from __future__ import annotations

import csv
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))


def _write(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


def test_stalls_and_lines_by_share(tmp_path):
    from ncu_source_summary import summarize

    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
            "stall_barrier", "stall_long_sb (Not Issued)", "L1 Wavefronts Shared",
            "L1 Wavefronts Shared Ideal"]
    p = tmp_path / "s.csv"
    _write(p, [["section"] * len(head), head,
               ["0x10", "HGMMA.64x16x16", "1,000", "900", "100", "5", "3", "2"],
               ["0x20", "BRA 0x10", "3,000", "1,000", "2,000", "5", "7", "6"],
               ["0x30", "short row"]])
    out = summarize(str(p), lines=2)
    # the reasons over all 4,000 samples (the not-issued column left out)
    assert out[0] == ("samples 4000; top stalls: [('stall_barrier', 52.5), "
                      "('stall_long_sb', 47.5)]")
    assert out[1].startswith(" 75.0% BRA 0x10") and out[2].startswith(" 25.0% HGMMA")
    assert out[3] == "shared wavefronts 10 ideal 8"


def test_without_source_counters(tmp_path):
    from ncu_source_summary import summarize

    p = tmp_path / "s.csv"
    _write(p, [["x"], ["Address", "Source"], ["0x10", "NOP"]])
    assert summarize(str(p))[0].startswith("no source counters")
