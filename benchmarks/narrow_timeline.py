"""Where a replayed 16-head MLA step's time goes inside the narrow Gluon kernel: each program
stamps the global timer at fixed points (``launch_narrow_mla(stamps=...)``, fields
:data:`~aiter_attn.kernels.triton.mla_narrow_gluon.STAMP_FIELDS`) and its SM id.

The row is planned as the default plans it (:class:`~aiter_attn.kernels.triton.mla.TritonMLA`,
static workspace: the narrow kernel's splits and the merge by PDL), then ``--steps`` steps
are captured back to back in one CUDA graph, each with its own rows of the timeline buffer,
and the graph is replayed ``--reps`` times. For each step after the first (µs, medians over
the replays)::

    period      first entry to the next step's first entry
    entry skew  last program's entry after the first's
    q staged    entry -> q in shared memory (the first two tiles issued before it)
    first tile  entry -> consumer 0's first tile in shared memory
    stream      first tile -> the later consumer's last tile (median program; min, max)
    epilogue    the later consumer's last tile -> rows stored (median program)
    end spread  the last program's end after the median program's (the tail)
    gap         the last program's end -> the next step's first entry (the merge, launches)
    wait        a program's start -> its entry (the PDL wait: a launch that starts early)
    start gap   the last program's end -> the next step's first start (before its wait)

On the GPU::

    python3 benchmarks/narrow_timeline.py --rows 16x64x4096,16x128x8192 --programs P.jsonl

Then, anywhere, whether a program's stream time is set by the SM it ran on (the figures of
:func:`by_sm`)::

    python3 benchmarks/narrow_timeline.py --by-sm P.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from statistics import median

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def summarize(stamps: torch.Tensor) -> dict:
    """The timeline of consecutive steps: ``stamps`` int64 ``[steps, programs, 9]`` in the
    order of ``STAMP_FIELDS`` (ns; field 1 the SM). Returns µs figures of the steps after
    the first (each measured against the step before or after it), medians over steps."""
    s = stamps.to(torch.int64).cpu()
    entry, q_staged, first = s[..., 0], s[..., 2], s[..., 3]
    done = torch.maximum(s[..., 4], s[..., 5])
    end, start = s[..., 6], s[..., 8]
    us = 1e-3
    per = {k: [] for k in ("period", "entry skew", "q staged", "first tile", "stream",
                           "stream min", "stream max", "epilogue", "end spread", "gap",
                           "wait", "start gap")}
    steps = s.shape[0]
    for r in range(1, steps - 1):
        e0, e1 = entry[r].min(), entry[r + 1].min()
        stream = (done[r] - first[r]).float()
        per["period"].append(float(e1 - e0) * us)
        per["entry skew"].append(float(entry[r].max() - e0) * us)
        per["q staged"].append(float((q_staged[r] - entry[r]).float().median()) * us)
        per["first tile"].append(float((first[r] - entry[r]).float().median()) * us)
        per["stream"].append(float(stream.median()) * us)
        per["stream min"].append(float(stream.min()) * us)
        per["stream max"].append(float(stream.max()) * us)
        per["epilogue"].append(float((end[r] - done[r]).float().median()) * us)
        # medians of differences: the int64 ns themselves are beyond float32's precision
        rel_end = (end[r] - e0).float()
        per["end spread"].append(float(rel_end.max() - rel_end.median()) * us)
        per["gap"].append(float(e1 - end[r].max()) * us)
        per["wait"].append(float((entry[r] - start[r]).float().median()) * us)
        per["start gap"].append(float(start[r + 1].min() - end[r].max()) * us)
    out = {k: round(median(v), 3) for k, v in per.items() if v}
    sms = s[..., 1]
    out["programs"] = int(s.shape[1])
    out["most programs on one SM"] = int(torch.bincount(sms[1].flatten()).max())
    return out


def program_rows(stamps: torch.Tensor, rep: int) -> list:
    """One dict per (step after the first, program) of a replay's ``stamps`` (as in
    :func:`summarize`): the program's SM and its entry, first tile, last tile and end in ns
    after the step's first entry (to find whether the slow streams sit on given SMs or
    given requests)."""
    s = stamps.to(torch.int64).cpu()
    rows = []
    for r in range(1, s.shape[0] - 1):
        e0 = s[r, :, 0].min()
        done = torch.maximum(s[r, :, 4], s[r, :, 5])
        for p in range(s.shape[1]):
            rows.append({"rep": rep, "step": r, "program": p, "sm": int(s[r, p, 1]),
                         "entry": int(s[r, p, 0] - e0), "first": int(s[r, p, 3] - e0),
                         "done": int(done[p] - e0), "end": int(s[r, p, 6] - e0)})
    return rows


def steal_bound(means: dict, overhead: float) -> float:
    """When the last program would end if programs that finish early took tiles off the
    slower ones, each thief paying ``overhead`` µs once (its own epilogue, the claim, q
    restaged, the first stolen tile's latency), tiles divisible at will: the end ``E`` where
    the work past ``E`` on the SMs slower than ``E`` equals what the SMs faster than
    ``E - overhead`` can take in their time left. ``means``: ``{sm: mean stream µs}`` of
    equal work; an SM's rate is 1 / its mean. A fluid bound: real steals come in whole
    tiles and one thief seldom serves many victims."""
    lo, hi = min(means.values()), max(means.values())
    for _ in range(60):  # bisection on E
        e = (lo + hi) / 2
        need = sum((t - e) / t for t in means.values() if t > e)
        give = sum((e - overhead - t) / t for t in means.values() if t < e - overhead)
        lo, hi = (lo, e) if give >= need else (e, hi)
    return hi


def sm_streams(rows: list) -> dict:
    """``{sm: [stream µs of each program that ran there]}`` of :func:`program_rows` (the
    stream: first tile in -> last tile done)."""
    per = {}
    for r in rows:
        per.setdefault(r["sm"], []).append((r["done"] - r["first"]) * 1e-3)
    return per


def by_sm(rows: list) -> dict:
    """Whether the stream time (``done - first`` of :func:`program_rows`, µs) is a property
    of the SM: programs move between SMs from step to step, so a spread of the SMs' mean
    streams well above the spread within one SM means the SM (its GPC's share of the memory
    system) sets the pace. Also: the step's stream if the same tiles ran at the SMs' summed
    rate (perfect balancing over the SMs used), against the slowest SM's mean."""
    from statistics import mean, pstdev

    per = sm_streams(rows)
    means = {sm: mean(v) for sm, v in per.items()}
    order = sorted(means, key=means.get)
    # each program streams the same tiles, so an SM's rate is 1 / its mean stream
    balanced = len(means) / sum(1.0 / t for t in means.values())
    return {"sms": len(means), "sd of SM means": round(pstdev(means.values()), 3),
            "sd within an SM": round(mean(pstdev(v) for v in per.values()), 3),
            "fastest SM": [order[0], round(means[order[0]], 3)],
            "slowest SM": [order[-1], round(means[order[-1]], 3)],
            "balanced stream": round(balanced, 3),
            "stealing with 2/4/6 us a thief": [round(steal_bound(means, o), 3)
                                               for o in (2.0, 4.0, 6.0)],
            "fastest eighth": sorted(order[:max(1, len(order) // 8)])}


def sm_rates(rows: list, sms: int) -> tuple:
    """One rate per SM ``0 .. sms - 1`` (1 / its mean stream time of
    :func:`program_rows`, µs⁻¹: programs of equal work), for ``TritonMLA``'s
    ``balanced_rates``; an SM no program ran on gets the median rate."""
    from statistics import mean, median as med

    rates = {sm: 1.0 / mean(v) for sm, v in sm_streams(rows).items() if sm < sms}
    if not rates:
        raise ValueError("no program rows: run timeline(..., programs=rows) first")
    fill = med(rates.values())
    return tuple(rates.get(sm, fill) for sm in range(sms))


def measure_sm_rates(device="cuda", heads: int = 16, bs: int = 64, ctx: int = 4096) -> tuple:
    """Each SM's streaming rate on this GPU, from the narrow kernel's stamps over a replayed
    ``heads x bs x ctx`` row (:func:`timeline`, :func:`sm_rates`)."""
    from aiter_attn.kernels.triton._kvutil import num_sms

    rows = []
    timeline(heads, bs, ctx, steps=6, reps=3, device=device, programs=rows)
    return sm_rates(rows, num_sms(torch.device(device)))


def timeline(heads: int, bs: int, ctx: int, *, steps: int = 8, reps: int = 5,
             device="cuda", programs: list | None = None, tuning: dict | None = None,
             fence: bool = False, writer: bool = False) -> dict:
    """The row's :func:`summarize` from ``reps`` replays of ``steps`` captured steps;
    ``programs``, if given, gets every replay's :func:`program_rows`; ``tuning``: the
    ``TritonMLA`` options planned (e.g. ``{"pdl": "early"}``); ``fence``: a small torch
    kernel between steps (it does not signal its dependents, as an engine's K/V write or
    GEMM: no step starts before the one before has ended); ``writer``: before each step,
    our K/V write (``write_kv``, which signals its dependents at its start on sm_90) of
    every request's last key, as an engine's decode step does."""
    from _inputs import make_mla

    from _runners import capture_steps, planned_mla

    from aiter_attn.kernels.triton.kv_write import write_kv
    from aiter_attn.kernels.triton.mla_merge import merge_splits
    from aiter_attn.kernels.triton.mla_narrow_gluon import STAMP_FIELDS, launch_narrow_mla

    x = make_mla(bs, ctx, heads=heads, device=device)
    out = torch.empty(bs, heads, x.rank, dtype=x.q.dtype, device=device)
    kernel, params, plan = planned_mla(x, dict(tuning or {}), {}, "narrow_timeline")
    if plan.narrow is None:
        raise RuntimeError(f"{heads}x{bs}x{ctx}: the default plan does not take the narrow "
                         "kernel here (it needs sm_90 and bf16/fp16)")
    nsplits, part_o, part_lse, _, _, one_q, pdl, merge_kw = plan.narrow
    cu, seqused, table = plan.args
    descs = kernel._cache_descs(x.kv_cache)
    stamps = torch.zeros(steps, bs * nsplits, len(STAMP_FIELDS), dtype=torch.int64,
                         device=device)

    spacer = torch.zeros(256, device=device)
    last = x.seqused_k.long() - 1
    slots = x.block_table.long().gather(1, (last // x.page)[:, None])[:, 0] * x.page \
        + last % x.page
    latents = torch.randn(bs, 1, x.kv_cache.shape[-1], device=device).to(x.kv_cache.dtype)

    def step(r):
        if fence:
            spacer.add_(1.0)
        if writer:
            write_kv(x.kv_cache, None, slots, latents, None)
        launch_narrow_mla(x.q, x.kv_cache, out, cu, seqused, table, params.scale,
                          splits=nsplits, batch=plan.batch, causal=params.causal,
                          part_o=part_o if nsplits > 1 else None,
                          part_lse=part_lse if nsplits > 1 else None,
                          one_query=one_q, descs=descs, pdl=pdl, stamps=stamps[r])
        if nsplits > 1:
            merge_splits(out, part_o, part_lse, None, x.rank, kernel.block_dv, **merge_kw)

    graph = capture_steps(step, steps)  # each step run once first: compiled, warm
    runs = []
    for _ in range(reps):
        graph.replay()
        torch.cuda.synchronize()
        runs.append(summarize(stamps))
        if programs is not None:
            programs.extend(program_rows(stamps, len(runs) - 1))
    rec = {"row": f"{heads}x{bs}x{ctx}", "splits": nsplits, "pdl": pdl, "fence": fence,
           "writer": writer}
    rec.update({k: round(median(run[k] for run in runs), 3) for k in runs[0]})
    return rec


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="16x64x4096,16x128x8192",
                   help="heads x batch x context, comma-separated")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--programs", default="",
                   help="write every program's stamps (program_rows) here, JSON lines")
    p.add_argument("--tuning", default="{}",
                   help="TritonMLA options as JSON, e.g. '{\"pdl\": \"early\"}'")
    p.add_argument("--fence", action="store_true",
                   help="a torch kernel between steps (it does not signal early)")
    p.add_argument("--writer", action="store_true",
                   help="our K/V write of each request's last key before every step")
    p.add_argument("--by-sm", default="",
                   help="summarise a --programs file by SM (by_sm, per row) and exit")
    a = p.parse_args()
    if a.by_sm:
        rows = {}
        import gzip

        opener = gzip.open if a.by_sm.endswith(".gz") else open
        with opener(a.by_sm, "rt") as f:
            for line in f:
                rec = json.loads(line)
                rows.setdefault(rec["row"], []).append(rec)
        for row, recs in rows.items():
            print(json.dumps({"row": row, **by_sm(recs)}))
        return
    for row in a.rows.split(","):
        h, b, c = (int(v) for v in row.split("x"))
        progs = [] if a.programs else None
        try:
            rec = timeline(h, b, c, steps=a.steps, reps=a.reps, programs=progs,
                           tuning=json.loads(a.tuning), fence=a.fence, writer=a.writer)
        except RuntimeError as exc:  # no narrow kernel here: say so, no traceback
            raise SystemExit(str(exc)) from None
        print(json.dumps(rec), flush=True)
        if progs:
            with open(a.programs, "a") as f:
                for rec in progs:
                    f.write(json.dumps({"row": row, **rec}) + "\n")


if __name__ == "__main__":
    main()
