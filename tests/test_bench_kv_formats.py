"""benchmarks/bench_kv_formats.py runs (CPU smoke mode in the Triton interpreter: tiny shapes,
one call each; the numbers mean nothing here, the lead runs it on the H200)."""

import json
import os
import sys

import pytest

from ._triton_util import requires_triton

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@requires_triton
def test_smoke_every_format_is_checked_and_timed(tmp_path):
    sys.path.insert(0, _BENCH)
    try:
        import bench_kv_formats
    finally:
        sys.path.remove(_BENCH)
    rows = bench_kv_formats.main(["--smoke", "--out", str(tmp_path)])
    assert [r["format"] for r in rows] == [f[0] for f in bench_kv_formats.FORMATS]
    for r in rows:
        assert "wrong" not in r, r
        assert r["decode_us"] > 0 and r["write_us_per_1k_tokens"] > 0
    data = json.loads((tmp_path / "bench_kv_formats.json").read_text())
    assert len(data["rows"]) == len(rows)
    assert "per-token" in (tmp_path / "bench_kv_formats.md").read_text()
