"""The ``mixed`` section of ``bench_attention.py``: engine steps/s on a mixed workload.

Workload: ``running`` requests (64-token prompts) decode; once they all decode, a new
``prompt_len``-token request arrives every ``arrive_every`` steps (``arrivals`` in all), so
steps alternate between pure decode steps and mixed steps (the arrival's prefill chunk plus
every decoding request). The same workload runs with ``EngineConfig(mixed_steps=True)`` (a
mixed step is one EXTEND forward: one attention launch per layer) and ``mixed_steps=False``
(today's DECODE forward + EXTEND forward), both with CUDA-graph decode on the GPU.
Model: the ``host`` group's random-weight Llama-3.2-1B-shaped bf16 model. Timed: the window
from the first arrival to the last arrival's first token, ``torch.cuda.synchronize()`` at
both ends (and around each step, for the median step time); steps/s, decode tokens/s and
the ratio of steps/s one-forward / two-forwards are reported. Each mode runs the workload
twice and times the second pass (the first compiles the kernels' specialisations: the
2026-12-03 17:22 run timed compiles into the one-forward row).

``smoke=True`` runs it on the CPU with a tiny model and a few requests (no targets: it only
proves the harness runs; ``tests/test_engine_mixed.py``).
"""

from __future__ import annotations

import time

import torch

from _host import _engine_model, _sync

__all__ = ["run_mixed", "mixed_table"]


def _workload(model, device, *, mixed: bool, running: int, prompt_len: int, arrive_every: int,
              arrivals: int, graphs: bool, vocab: int) -> dict:
    from aiter_attn.engine import Engine, EngineConfig, SamplingParams

    max_ctx = prompt_len + 512
    cfg = EngineConfig(page_size=16, max_batch_size=running + arrivals, max_context_len=max_ctx,
                       max_tokens_per_step=prompt_len + running + arrivals,
                       kv_tokens=(running + arrivals) * max_ctx, prefix_caching=False,
                       cuda_graph=graphs, mixed_steps=mixed)
    engine = Engine(model, cfg)
    g = torch.Generator().manual_seed(0)
    long_new = arrive_every * arrivals + 64
    for _ in range(running):
        engine.add_request(torch.randint(3, vocab, (64,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=long_new))
    while any(not r.output_ids for r in engine.requests):  # prefill the running batch
        engine.step()
    for _ in range(2):  # warm-up decode steps
        engine.step()
    late = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(arrivals)]
    step_s, kinds = [], []
    _sync(device)
    t0 = time.perf_counter()
    i = 0
    added = []
    while len(added) < arrivals or any(not r.output_ids for r in added):
        if len(added) < arrivals and i % arrive_every == 0:
            added.append(engine.add_request(late[len(added)], SamplingParams(max_new_tokens=64)))
        ts = time.perf_counter()
        st = engine.stats
        before = (st.decode_tokens, st.prefill_tokens, st.mixed_steps)
        engine.step()
        _sync(device)
        step_s.append(time.perf_counter() - ts)
        decoded, prefilled = st.decode_tokens - before[0], st.prefill_tokens - before[1]
        kinds.append((decoded, "one-forward mixed" if st.mixed_steps > before[2] else
                      "decode+extend" if decoded and prefilled else
                      "decode" if decoded else "extend"))
        i += 1
    elapsed = time.perf_counter() - t0
    decode_tokens = sum(d for d, _ in kinds)
    by_kind: dict = {}
    for t, (_, kind) in zip(step_s, kinds):
        by_kind.setdefault(kind, []).append(t)
    graphs = engine.runner.graphs
    return {"steps": i, "seconds": elapsed, "steps_per_s": i / elapsed,
            "decode_tokens_per_s": decode_tokens / elapsed,
            "mixed_steps": engine.stats.mixed_steps,
            "step_ms_median": _median(step_s) * 1e3,
            # where the time goes: median step time of each kind of step, and how many
            # forwards replayed a graph (pure decode steps should, in both modes)
            "step_ms_by_kind": {k: (len(v), _median(v) * 1e3) for k, v in by_kind.items()},
            "graph_replays": dict(graphs.replays) if graphs is not None else {}}


def _median(xs: list) -> float:
    return sorted(xs)[len(xs) // 2]


def run_mixed(device=None, dtype=None, *, smoke: bool = False, running: int = 32,
              prompt_len: int = 512, arrive_every: int = 4, arrivals: int = 8) -> list[dict]:
    """One row per mode (``one-forward``, ``two-forwards``) of the mixed workload."""
    from aiter_attn.engine.models import build_engine_model

    device = torch.device(device or ("cpu" if smoke else "cuda"))
    dtype = dtype or (torch.float32 if smoke else torch.bfloat16)
    if smoke:
        running, prompt_len, arrive_every, arrivals = 3, 12, 2, 2
    hf = _engine_model(device, dtype, smoke)
    graphs = device.type == "cuda"
    rows = []
    for mixed in (True, False):
        model = build_engine_model(hf, dtype=dtype, device=device,
                                   max_positions=prompt_len + 512)
        # the first pass compiles every kernel specialisation the workload meets (the
        # one-forward mode's ragged shapes are new to the process); the second is timed
        for _ in range(1 if smoke else 2):
            r = _workload(model, device, mixed=mixed, running=running, prompt_len=prompt_len,
                          arrive_every=arrive_every, arrivals=arrivals, graphs=graphs,
                          vocab=hf.config.vocab_size)
        r.update(row=f"engine mixed {'one-forward' if mixed else 'two-forwards'} "
                     f"bs={running}+{arrivals}x{prompt_len}")
        rows.append(r)
        del model
    rows[0]["vs_two_forwards"] = rows[0]["steps_per_s"] / rows[1]["steps_per_s"]
    return rows


def mixed_table(rows: list[dict]) -> str:
    """A markdown table of the mixed rows."""
    lines = ["| row | steps/s | decode tok/s | median step | mixed steps | vs two forwards | "
             "median step by kind (count) | graph replays |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['vs_two_forwards']:.2f}×" if "vs_two_forwards" in r else ""
        kinds = "; ".join(f"{k} {ms:.2f} ms ({n})"
                          for k, (n, ms) in sorted(r.get("step_ms_by_kind", {}).items()))
        replays = ", ".join(f"{k} {v}" for k, v in sorted(r.get("graph_replays", {}).items()))
        lines.append(f"| {r['row']} | {r['steps_per_s']:.1f} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r['step_ms_median']:.2f} ms | {r['mixed_steps']} | {ratio} | {kinds} | "
                     f"{replays or '–'} |")
    return "\n".join(lines)
