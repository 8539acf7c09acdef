"""Where the stream MLA kernel's step goes (:mod:`aiter_attn.kernels.triton.mla_stream_gluon`),
program count by program count: each slot's global-timer stamps (entry, SM, first tile in,
rows stored) over replays of captured steps, and the step's time (CUDA events).

    python benchmarks/stream_probe.py --rows 16x64x4096 --programs 132,128,120

One JSON line per (row, programs): the step (µs a step, the merge launch included), the
entry spread (last slot's entry after the first's: a second wave shows as a spread near a
whole program's time), slots that entered after another had ended, the SMs used, and the
slots' first-tile latency and stream (first tile in -> rows stored) as min / median / max.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from statistics import median

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def summarize(stamps: torch.Tensor) -> dict:
    """One replay's stamps ``[steps, P, 4]`` (int64 ns) as medians over the steps of the
    entry spread and of the slots' first-tile latency and stream (µs, min / median / max
    over the slots with tiles); the most late entries (after some slot had ended) and the
    fewest distinct SMs of any step."""
    s = stamps.cpu().double()
    rows = {"entry spread": [], "late": [], "first": [], "stream": [], "sms": []}
    for st in s:
        entry, sm, first, end = st[:, 0], st[:, 1], st[:, 2], st[:, 3]
        e0 = entry.min()
        rows["entry spread"].append(float(entry.max() - e0) * 1e-3)
        rows["late"].append(int((entry > end.min()).sum()))
        worked = first > 0  # slots with tiles (an empty slot stamps no first tile)
        lat = ((first - entry)[worked] * 1e-3).tolist() or [0.0]
        stream = ((end - first)[worked] * 1e-3).tolist() or [0.0]
        rows["first"].append((min(lat), median(lat), max(lat)))
        rows["stream"].append((min(stream), median(stream), max(stream)))
        rows["sms"].append(len(set(sm.long().tolist())))
    out = {k: round(median(v), 3) for k, v in rows.items() if k in ("entry spread",)}
    out["late"] = max(rows["late"])  # a second wave in any step shows
    out["sms"] = min(rows["sms"])
    for k in ("first", "stream"):
        out[k] = [round(median(x[i] for x in rows[k]), 3) for i in range(3)]
    return out


def _replay_us(graph, steps: int) -> float:
    """µs a step of one replay of ``graph`` (``steps`` captured steps), by CUDA events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / steps


def rates_from_records(records: list, sms: int) -> tuple:
    """One rate per SM ``0 .. sms - 1`` (units streamed per µs: a slot's units over its
    stream time, summed over the records of that SM) from :func:`probe`'s ``records``
    (``{"sm", "units", "stream_us"}``), for ``balanced_rates``; an SM without records gets
    the median rate."""
    from statistics import median as med

    units, time = {}, {}
    for rec in records:
        if rec["stream_us"] > 0 and rec["units"] > 0:
            units[rec["sm"]] = units.get(rec["sm"], 0) + rec["units"]
            time[rec["sm"]] = time.get(rec["sm"], 0.0) + rec["stream_us"]
    rates = {sm: units[sm] / time[sm] for sm in units if sm < sms}
    if not rates:
        raise ValueError("no slot streamed: no records to take rates from")
    fill = med(rates.values())
    return tuple(rates.get(sm, fill) for sm in range(sms))


def stream_sm_rates(device="cuda", heads: int = 16, bs: int = 64, ctx: int = 4096) -> tuple:
    """Each SM's rate under the stream kernel itself (equal shares over one program per SM,
    :func:`probe`'s records, :func:`rates_from_records`): the SMs' rates with all of them
    streaming, where ``narrow_timeline.measure_sm_rates`` leaves four idle."""
    from aiter_attn.kernels.triton._kvutil import num_sms

    sms = num_sms(torch.device(device))
    records: list = []
    probe(heads, bs, ctx, sms, device=device, records=records)
    return rates_from_records(records, sms)


def probe(heads: int, bs: int, ctx: int, programs: int, *, steps: int = 8, reps: int = 5,
          device="cuda", records: list | None = None) -> dict:
    """The stamped steps of ``programs`` slots (equal shares) at ``heads x bs x ctx``: a
    JSON-able summary (module docstring); ``records``, if given, gets each stamped slot's
    ``{"sm", "units", "stream_us"}``."""
    from _inputs import make_mla

    from _runners import capture_steps, planned_mla

    from aiter_attn.kernels.triton.mla_balanced import launch_balanced_mla
    from aiter_attn.kernels.triton.mla_kernel import _LOG2E
    from aiter_attn.kernels.triton.mla_stream_gluon import (STREAM_STAMP_FIELDS,
                                                            launch_stream_mla)

    x = make_mla(bs, ctx, heads=heads, device=device)
    out = torch.empty(bs, heads, x.rank, dtype=x.q.dtype, device=device)
    kernel, params, plan = planned_mla(x, {"stream": programs}, {}, "stream_probe")
    if plan.stream is None:
        raise RuntimeError("the stream kernel does not serve here (sm_90, bf16/fp16)")
    launch_kw, merge_kw = plan.stream
    _, seqused, table = plan.args
    descs = kernel._stream_descs(x.kv_cache)
    stamps = torch.zeros(steps, programs, len(STREAM_STAMP_FIELDS), dtype=torch.int64,
                         device=device)

    def step(r):
        launch_stream_mla(x.q, x.kv_cache, out, seqused, table, params.scale, descs=descs,
                          stamps=stamps[r], **launch_kw)
        launch_balanced_mla(x.q, x.kv_cache, out, seqused, table, rank=x.rank,
                            qk_scale_log2=params.scale * _LOG2E, **merge_kw)

    graph = capture_steps(step, steps)
    times, runs = [], []
    units = None
    if records is not None:  # each slot's units, from the partition on the host
        from aiter_attn.kernels.triton.mla_stream_gluon import stream_segments

        parts = stream_segments(x.seqused_k.tolist(), launch_kw["shares"].cpu())
        units = [g1 - g0 for g0, g1 in (part["range"] for part in parts)]
    for _ in range(reps):
        times.append(_replay_us(graph, steps))
        runs.append(summarize(stamps))
        if records is not None:
            st = stamps.cpu()
            for step_st in st:
                for p, (_, sm, first, end) in enumerate(step_st.tolist()):
                    if first > 0:
                        records.append({"sm": int(sm), "units": units[p],
                                        "stream_us": (end - first) * 1e-3})
    rec = {"row": f"{heads}x{bs}x{ctx}", "programs": programs,
           "step us (stamped)": round(median(times), 2)}
    mid = runs[len(runs) // 2]
    rec.update(mid)
    return rec


def step_us(heads: int, bs: int, ctx: int, tuning: dict, *, page: int = 64, steps: int = 8,
            reps: int = 5, device="cuda") -> float:
    """Median µs a step of ``TritonMLA(tuning)`` (plan once, run per call) over replays of
    ``steps`` captured calls, on a cache of ``page``-row pages: the default (narrow) kernel
    and stream options side by side."""
    from _inputs import make_mla
    from _runners import capture_steps, make_ours_mla_planned

    x = make_mla(bs, ctx, heads=heads, page=page, device=device)
    fn, _ = make_ours_mla_planned(x, **tuning)  # (ran once: compiled)
    graph = capture_steps(lambda r: fn(), steps, warm=False)
    return round(median(_replay_us(graph, steps) for _ in range(reps)), 2)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16x64x4096")
    p.add_argument("--programs", default="", help="comma-separated program counts "
                   "(default: the SM count, then 4 and 8 fewer)")
    p.add_argument("--compare", action="store_true", help="also the step of the default "
                   "(narrow) kernel on pages of 64 and 16 rows, and of the stream kernel "
                   "without PDL and on 16-row pages (no stamps)")
    p.add_argument("--variants", default="", help="more steps to time beside --compare: "
                   "';'-separated NAME=TUNING_JSON@PAGE (e.g. 'stream 128={\"stream\": 128}@64')")
    p.add_argument("--no-probe", action="store_true", help="time the steps only (no stamps)")
    args = p.parse_args()
    from aiter_attn.kernels.triton._kvutil import num_sms

    sms = num_sms(torch.device("cuda"))
    counts = [int(c) for c in args.programs.split(",") if c] or [sms, sms - 4, sms - 8]
    for row in args.rows.split(","):
        heads, bs, ctx = (int(v) for v in row.lower().split("x"))
        for n in counts if not args.no_probe else ():
            print(json.dumps(probe(heads, bs, ctx, n)), flush=True)
        steps = [(name, json.loads(tuning), int(page)) for name, tuning, page in (
            (v.split("=", 1)[0], *v.split("=", 1)[1].rsplit("@", 1))
            for v in args.variants.split(";") if v)]
        if args.compare:
            steps = [("default", {}, 64), ("default, page 16", {}, 16),
                     ("stream", {"stream": True}, 64),
                     ("stream, page 16", {"stream": True}, 16),
                     ("stream, no pdl", {"stream": True, "pdl": False}, 64)] + steps
        if steps:
            for name, tuning, page in steps:
                print(json.dumps({"row": row, "variant": name,
                                  "step us": step_us(heads, bs, ctx, tuning, page=page)}),
                      flush=True)


if __name__ == "__main__":
    main()
