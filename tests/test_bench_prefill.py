"""benchmarks/bench_prefill.py runs (CPU smoke mode in the Triton interpreter: tiny shapes,
each implementation checked against the reference and timed once, the sweep included; the
numbers mean nothing here, the lead runs it on the H200)."""

import json
import os
import sys

from ._triton_util import requires_triton

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@requires_triton
def test_smoke_checks_and_times_every_impl(tmp_path):
    sys.path.insert(0, _BENCH)
    try:
        import bench_prefill
    finally:
        sys.path.remove(_BENCH)
    rows = bench_prefill.main(["--smoke", "--out", str(tmp_path)])
    assert [r["case"] for r in rows] == [r[0] for r in bench_prefill.SMOKE_ROWS]
    for row in rows:
        for rec in row["impls"] + row["sweep"]:
            assert "wrong" not in rec and "missing" not in rec, rec
            assert rec["eager_ms"] > 0
        assert row["best"] in [list(c) for c in bench_prefill.SMOKE_SWEEP]
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert len(data["rows"]) == len(rows) and data["meta"]["command"]
