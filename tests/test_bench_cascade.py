"""The ``cascade`` section of benchmarks/bench_attention.py runs (CPU smoke mode: tiny shapes,
a few calls; the numbers mean nothing here, the lead runs it on the H200)."""

import json
import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def bench():
    sys.path.insert(0, _BENCH)
    try:
        import bench_attention

        yield bench_attention
    finally:
        sys.path.remove(_BENCH)


def test_smoke_writes_both_cascade_rows(bench, tmp_path):
    rows = bench.main(["--smoke", "--only", "cascade", "--out", str(tmp_path)])
    assert [r["impl"] for r in rows] == ["without cascade", "with cascade",
                                         "engine without cascade", "engine with cascade"]
    base, casc = rows[:2]
    eng0, eng1 = rows[2:]
    assert eng0["cached_tokens"] == eng1["cached_tokens"] == 2 * 32  # two reuse the prefix
    assert eng1["decode_tokens"] == 3 * 3 and "engine_speedup" in eng1
    assert "wrong" not in base and "wrong" not in casc, rows
    assert casc["cascade_active"] and casc["shared_pages_req0"] == 8  # 32 tokens, page 4
    assert base["eager_ms"] > 0 and casc["eager_ms"] > 0 and "eager_speedup" in casc
    data = json.loads((tmp_path / "bench_cascade.json").read_text())
    assert len(data["rows"]) == 4
    assert "with cascade" in (tmp_path / "bench_cascade.md").read_text()
