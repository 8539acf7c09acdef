"""``benchmarks/narrow_timeline.py``'s summary of the narrow kernel's per-program timeline
(the kernel's stamps need an sm_90 GPU; the arithmetic is checked here on a hand-built
timeline of three steps of four programs)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))


def _step(t0: int, ends: list[int]) -> list[list[int]]:
    """Four programs entering at ``t0 + 0/100/200/300`` ns on SMs 0..3: q staged 500 ns
    after entry, first tile 1500, consumer 0 done at ``end - 800``, consumer 1 at
    ``end - 1000``, rows stored at ``end``; each started 50 ns before its entry (the PDL
    wait)."""
    rows = []
    for i, end in enumerate(ends):
        e = t0 + 100 * i
        rows.append([e, i, e + 500, e + 1500, end - 800, end - 1000, end, end - 2000, e - 50])
    return rows


@pytest.mark.parametrize("t0", [0, 1_764_000_000_000_000_000], ids=["zero", "global-timer"])
def test_summary_of_a_hand_built_timeline(t0):
    """The same figures at the global timer's real magnitude (ns since 1970, beyond float32's
    precision: a median taken of the raw stamps read 0 for the end spread)."""
    from narrow_timeline import program_rows, summarize

    stamps = torch.tensor([_step(0, [50_000, 50_000, 50_000, 50_000]),
                           _step(80_000, [150_000, 151_000, 152_000, 160_000]),
                           _step(170_000, [240_000, 240_000, 240_000, 240_000])])
    stamps[..., [0, 2, 3, 4, 5, 6, 7, 8]] += t0
    s = summarize(stamps)
    rows = program_rows(stamps, 0)
    assert len(rows) == 4 and rows[3] == {"rep": 0, "step": 1, "program": 3, "sm": 3,
                                          "entry": 300, "first": 1800, "done": 79_200,
                                          "end": 80_000}
    assert s["period"] == 90.0  # 80 µs -> 170 µs
    assert s["entry skew"] == 0.3
    assert s["q staged"] == 0.5 and s["first tile"] == 1.5
    # stream: (end - 800) - (entry + 1500) per program: 67.7, 68.6, 69.5, 77.4 µs
    assert s["stream min"] == 67.7 and s["stream max"] == 77.4
    assert s["stream"] == 68.6  # torch's median: the lower middle value
    assert s["epilogue"] == 0.8
    assert s["end spread"] == 9.0  # 160 µs against the lower median 151
    assert s["gap"] == 10.0  # 160 µs -> 170 µs
    assert s["wait"] == 0.05 and s["start gap"] == 9.95
    assert s["programs"] == 4 and s["most programs on one SM"] == 1


@pytest.mark.gpu
def test_gpu_timeline_of_a_small_row():
    """On sm_90, a replayed row of 16 requests: one program per SM, and the summary's parts
    positive and in order (the first tile's latency under the stream, the stream under the
    step's period)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the narrow Gluon MLA kernel is sm_90 only")
    from narrow_timeline import timeline

    rec = timeline(16, 16, 2048, steps=4, reps=2)
    assert rec["splits"] >= 1 and rec["programs"] == 16 * rec["splits"], rec
    assert rec["most programs on one SM"] == 1, rec
    for k in ("period", "q staged", "first tile", "stream", "epilogue"):
        assert rec[k] > 0, (k, rec)
    assert rec["first tile"] < rec["stream"] < rec["period"], rec


def test_by_sm_separates_the_sm_from_the_program():
    """Two SMs, one streaming 10 µs and one 20 µs, the two programs swapping SMs each step:
    the SMs' means differ by the whole spread while each SM is steady, and perfect
    balancing over their summed rate takes 2 / (1/10 + 1/20) µs."""
    from narrow_timeline import by_sm

    rows = []
    for step in range(4):
        for prog in range(2):
            sm = (prog + step) % 2
            rows.append({"rep": 0, "step": step, "program": prog, "sm": sm, "entry": 0,
                         "first": 1000, "done": 1000 + (10_000 if sm == 0 else 20_000),
                         "end": 0})
    s = by_sm(rows)
    assert s["sms"] == 2 and s["sd of SM means"] == 5.0 and s["sd within an SM"] == 0.0
    assert s["fastest SM"] == [0, 10.0] and s["slowest SM"] == [1, 20.0]
    assert s["balanced stream"] == 13.333 and s["fastest eighth"] == [0]
    # at o µs a thief, the fast SM gives (E - o - 10)/10 of its work's worth and the slow
    # one needs (20 - E)/20 taken: E = (40 + 2o)/3
    assert s["stealing with 2/4/6 us a thief"] == [14.667, 16.0, 17.333]


def test_steal_bound_without_overhead_is_the_balanced_stream():
    from narrow_timeline import steal_bound

    means = {0: 85.0, 1: 92.0, 2: 97.0, 3: 97.5}
    balanced = len(means) / sum(1 / t for t in means.values())
    assert abs(steal_bound(means, 0.0) - balanced) < 1e-6
    assert steal_bound(means, 0.0) < steal_bound(means, 3.0) < steal_bound(means, 20.0)
    assert steal_bound(means, 20.0) == 97.5  # no SM finishes 20 µs early enough to help


def test_sm_rates_one_per_sm_with_the_median_for_idle_ones():
    from narrow_timeline import sm_rates

    rows = [{"sm": sm, "first": 0, "done": t * 1000} for sm, t in
            ((0, 10), (0, 10), (1, 20), (3, 40))]
    assert sm_rates(rows, 4) == (0.1, 0.05, 0.05, 0.025)  # SM 2 idle: the median rate
    with pytest.raises(ValueError, match="no program rows"):
        sm_rates([], 4)
