"""The ``cascade`` section of ``bench_attention.py``: decode over a shared prefix, with and
without cascade attention.

Workload (issue 16): ``bs = 64`` decode requests whose page tables start with the same
``4096`` tokens of pages (prefix sharing) followed by ``256`` tokens of their own; bf16, GQA
32/8, head dim 128, page 16, block-permuted pool. Two launches of the same step through the
plan/run kernel objects (plan once, then only ``run`` is timed):

* ``without cascade``: the Triton ``paged_attention`` kernel over the full page table
  (every request reads all 4,352 of its keys);
* ``with cascade``: :class:`aiter_attn.kernels.cascade.CascadeKernel` around the same kernel
  (the own pass over 256 keys per request, the shared pass reading the 4,096 shared keys once
  per query tile, the LSE merge), ``min_shared_tokens = 1024``.

Both are checked against the float32 reference on the first requests before timing
(relative error). Timings: ``triton.testing.do_bench`` (eager, L2 flushed) and
``do_bench_cudagraph`` (replayed graph; the cascade path is capturable), medians in ms;
tokens/s = ``bs / time``; the ratio is with/without (target ≥ 3× on the H200).

``smoke=True`` runs tiny shapes on the CPU (the reference kernels, or Triton under
``TRITON_INTERPRET=1``) with a few timed calls: it only proves the harness runs
(``tests/test_bench_cascade.py``).
"""

from __future__ import annotations

import time

import torch

__all__ = ["run_cascade", "run_cascade_engine", "cascade_table", "make_shared_decode", "SWEEP"]

RTOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


def make_shared_decode(bs, shared, own, *, hq, hkv, d, page, dtype, device, seed=0):
    """``(q, k_cache, v_cache, block_table, cu_seqlens_q, seqused_k)`` of a decode step whose
    ``bs`` requests share ``shared`` leading tokens of pages and own ``own`` more each."""
    if shared % page:
        raise ValueError(f"shared={shared} must be whole pages of {page}.")
    g = torch.Generator(device=device).manual_seed(seed)
    sp, op = shared // page, -(-own // page)
    n_pages = 1 + sp + bs * op
    perm = torch.randperm(n_pages - 1, device=device, generator=g) + 1
    k_cache = torch.randn(n_pages, page, hkv, d, device=device, dtype=dtype, generator=g)
    v_cache = torch.randn(n_pages, page, hkv, d, device=device, dtype=dtype, generator=g)
    prefix = perm[:sp]
    owns = perm[sp:].view(bs, op)
    block_table = torch.cat([prefix.expand(bs, sp), owns], dim=1).to(torch.int32).contiguous()
    q = torch.randn(bs, hq, d, device=device, dtype=dtype, generator=g)
    cu = torch.arange(bs + 1, device=device, dtype=torch.int32)
    seqused = torch.full((bs,), shared + own, device=device, dtype=torch.int32)
    return q, k_cache, v_cache, block_table, cu, seqused


def _rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _bind(q, k_cache, v_cache, backend, lse):
    from aiter_attn import ops
    from aiter_attn.plugins import kernel_registry

    req = ops.with_call_features(ops.paged_attention_request(q, k_cache, v_cache), lse=lse)
    return kernel_registry().select(req, backend=backend).bind(req)


def _metadata(cu, seqused, block_table, page, max_k, num_tokens):
    from aiter_attn.metadata import AttnMetadata, PageTable, QueryLayout
    from aiter_attn.types import ForwardMode

    return AttnMetadata(
        mode=ForwardMode.DECODE, batch_size=cu.shape[0] - 1,
        query=QueryLayout(cu_seqlens_q=cu, max_seqlen_q=1, num_tokens=num_tokens),
        pages=PageTable(block_table=block_table, seqused_k=seqused, max_seqlen_k=max_k,
                        page_size=page))


def _timer(device, rep):
    if device.type == "cuda":
        import triton.testing as tt

        def timed(fn, graph):
            try:
                if graph:
                    return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
                return float(tt.do_bench(fn, warmup=max(5, rep // 4), rep=rep,
                                         return_mode="median"))
            except Exception as exc:  # report, keep the other rows
                print(f"    timing failed ({'graph' if graph else 'eager'}): {exc!r}"[:200],
                      flush=True)
                return None
        return timed

    def timed(fn, graph):
        if graph:
            return None
        fn()
        t0 = time.perf_counter()
        n = 3
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e3
    return timed


def run_cascade(device=None, *, smoke: bool = False, bs: int = 64, shared: int = 4096,
                own: int = 256, rep: int = 60, graphs: bool = True,
                min_shared_tokens: int = 1024, sweep=False) -> list[dict]:
    """Rows ``without cascade`` and ``with cascade`` (ms eager/graph, tokens/s, error) and
    the ratio on the cascade row; ``sweep`` adds a row per :data:`SWEEP` launch variant
    (``True`` or ``-1``: all of them; an int ``N``: the first ``N``)."""
    from aiter_attn.kernels.base import LayerParams
    from aiter_attn.kernels.cascade import CascadeKernel, _impl_for
    from aiter_attn.kernels.reference import paged_attention_reference
    from aiter_attn.kernels.triton._kvutil import interpreting

    device = torch.device(device or ("cpu" if smoke else "cuda"))
    if smoke:
        bs, shared, own, hq, hkv, d, page, dtype = 4, 32, 8, 4, 2, 16, 4, torch.float32
        min_shared_tokens = 8
        backend = "triton" if interpreting() else "reference"
        graphs = False
    else:
        hq, hkv, d, page, dtype = 32, 8, 128, 16, torch.bfloat16
        backend = "triton"
    q, kc, vc, bt, cu, seqused = make_shared_decode(bs, shared, own, hq=hq, hkv=hkv, d=d,
                                                    page=page, dtype=dtype, device=device)
    max_k = shared + own
    md = _metadata(cu, seqused, bt, page, max_k, bs)
    params = LayerParams.create(scale=d ** -0.5, device=device, num_q_heads=hq,
                                num_kv_heads=hkv, head_dim=d, v_head_dim=d)
    rows_b = min(bs, 4)
    expected = torch.empty(rows_b, hq, d, dtype=torch.float32, device=device)
    paged_attention_reference(q[:rows_b].float(), kc, vc, expected, cu_seqlens_q=cu[:rows_b + 1],
                              seqused_k=seqused[:rows_b], block_table=bt[:rows_b],
                              softmax_scale=d ** -0.5)
    plain = _bind(q, kc, vc, backend, lse=False)
    inner = _bind(q, kc, vc, backend, lse=True)
    cascade = CascadeKernel(inner, min_shared_tokens=min_shared_tokens,
                            impl=_impl_for(inner, device))
    timed = _timer(device, rep)
    label = (f"decode {bs}x({shared}+{own}) shared prefix, GQA {hq}/{hkv} d{d} page{page} "
             f"{str(dtype).replace('torch.', '')}")
    rows = []
    for name, kernel in (("without cascade", plain), ("with cascade", cascade)):
        plan = kernel.plan(md)
        # the plan's host cost per step (grouping launches, workspaces), steady state
        reps = 3 if smoke else 50
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            kernel.plan(md)
        plan_us = (time.perf_counter() - t0) / reps * 1e6
        if device.type == "cuda":
            torch.cuda.synchronize()
        out = torch.empty(bs, hq, d, dtype=dtype, device=device)

        def fn(kernel=kernel, plan=plan, out=out):
            kernel.run(q, (kc, vc), plan, params, out)

        fn()
        err = _rel_err(out[:rows_b], expected)
        rec = {"row": f"{label}: {name}", "impl": name, "bs": bs, "shared": shared, "own": own,
               "rel_err": err, "plan_us": plan_us}
        if name == "with cascade":
            rec["cascade_active"] = bool(plan.cascade)
            rec["shared_pages_req0"] = int(plan.index.shared_pages[0]) if plan.cascade else 0
        if err > RTOL[dtype]:
            rec["wrong"] = f"relative error {err:.3e} > {RTOL[dtype]:.1e}; not timed"
            rows.append(rec)
            continue
        rec["eager_ms"] = timed(fn, False)
        if graphs:
            rec["graph_ms"] = timed(fn, True)
        for mode in ("eager", "graph"):
            ms = rec.get(f"{mode}_ms")
            if ms:
                rec[f"{mode}_tokens_per_s"] = bs / (ms * 1e-3)
        rows.append(rec)
        print("   ", _summary(rec), flush=True)
    base, casc = rows[:2]
    for mode in ("eager", "graph"):
        a, b = base.get(f"{mode}_ms"), casc.get(f"{mode}_ms")
        if a and b:
            casc[f"{mode}_speedup"] = a / b
    variants = SWEEP if sweep is True or sweep == -1 else SWEEP[:max(int(sweep), 0)]
    for tune in variants:
        from aiter_attn.kernels.triton import cascade as tmod

        saved = dict(tmod.CASCADE_TUNING)
        tmod.CASCADE_TUNING.update(tune)
        try:
            plan = cascade.plan(md)
            out = torch.empty(bs, hq, d, dtype=dtype, device=device)

            def fn(plan=plan, out=out):
                cascade.run(q, (kc, vc), plan, params, out)

            fn()
            name = "with cascade " + "/".join(f"{k}={v}" for k, v in tune.items())
            rec = {"row": f"{label}: {name}", "impl": name, "rel_err": _rel_err(
                out[:rows_b], expected), "tune": tune}
            if rec["rel_err"] <= RTOL[dtype]:
                rec["graph_ms"] = timed(fn, True) if graphs else None
                rec["eager_ms"] = timed(fn, False)
                for mode in ("eager", "graph"):
                    ms, a = rec.get(f"{mode}_ms"), base.get(f"{mode}_ms")
                    if ms:
                        rec[f"{mode}_tokens_per_s"] = bs / (ms * 1e-3)
                        if a:
                            rec[f"{mode}_speedup"] = a / ms
            else:
                rec["wrong"] = f"relative error {rec['rel_err']:.3e}"
            rows.append(rec)
            print("   ", _summary(rec) if "wrong" not in rec else rec["wrong"], flush=True)
        finally:
            tmod.CASCADE_TUNING.clear()
            tmod.CASCADE_TUNING.update(saved)
    return rows


#: Launch variants of the shared pass timed by ``--cascade-sweep`` (``CASCADE_TUNING`` keys).
SWEEP = [
    {"overlap": False},  # both passes on one stream (the default before 2026-12-03 23:50)
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "split_keys": 256},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "split_keys": 512},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 3, "split_keys": 2048},
    {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "split_keys": 512},
    {"block_m": 128, "block_n": 64, "num_warps": 4, "num_stages": 3, "split_keys": 512},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3, "split_keys": 1024},
    {"block_m": 256, "block_n": 32, "num_warps": 8, "num_stages": 3, "split_keys": 256},
    {"block_m": 256, "block_n": 64, "num_warps": 8, "num_stages": 2, "split_keys": 512},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "split_keys": 1024},
]


def run_cascade_engine(device=None, *, smoke: bool = False, bs: int = 64, shared: int = 4096,
                       own: int = 256, steps: int = 32, graphs: bool = True) -> list[dict]:
    """Engine decode tokens/s on the same workload, with and without cascade: the ``host``
    group's random-weight Llama-3.2-1B-shaped bf16 model (16 layers, GQA 32/8, d64), ``bs``
    requests whose prompts share a ``shared``-token system prompt (prefix caching reuses its
    pages) plus ``own`` tokens each; after every request produced its first token, ``steps``
    pure decode steps are timed (CUDA-graph replay on the GPU). ``smoke``: a tiny model on
    the CPU."""
    from _host import _engine_model, _sync

    from aiter_attn.engine import Engine, EngineConfig, SamplingParams
    from aiter_attn.engine.models import build_engine_model

    device = torch.device(device or ("cpu" if smoke else "cuda"))
    dtype = torch.float32 if smoke else torch.bfloat16
    page = 4 if smoke else 16
    if smoke:
        bs, shared, own, steps = 3, 32, 8, 3
        graphs = False
    hf = _engine_model(device, dtype, smoke)
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (shared + 1,), generator=g).tolist()
    prompts = [system + torch.randint(3, vocab, (own - 1,), generator=g).tolist()
               for _ in range(bs)]
    new = steps + 8
    max_ctx = shared + own + new + 2 * page
    rows = []
    for cascade in (None, min(1024, shared)):
        model = build_engine_model(hf, dtype=dtype, device=device, max_positions=max_ctx)
        cfg = EngineConfig(page_size=page, max_batch_size=bs, max_context_len=max_ctx,
                           max_tokens_per_step=max(shared + own, 8192 if not smoke else 64),
                           kv_tokens=shared + bs * (own + new + 2 * page) + 4 * page,
                           prefix_caching=True, cuda_graph=graphs if device.type == "cuda"
                           else None, cascade_min_shared_tokens=cascade)
        engine = Engine(model, cfg)
        reqs = [engine.add_request(p, SamplingParams(max_new_tokens=new)) for p in prompts]
        while any(not r.output_ids for r in reqs):  # prefill (the others reuse the prefix)
            engine.step()
        engine.step()  # one untimed decode step (graph warm-up)
        _sync(device)
        t0 = time.perf_counter()
        before = engine.stats.decode_tokens
        for _ in range(steps):
            engine.step()
        _sync(device)
        elapsed = time.perf_counter() - t0
        tokens = engine.stats.decode_tokens - before
        name = "with cascade" if cascade else "without cascade"
        rows.append({
            "row": (f"engine decode {bs}x({shared}+{own}) shared system prompt, "
                    f"{'graphs' if cfg.cuda_graph else 'eager'}: {name}"),
            "impl": f"engine {name}", "bs": bs, "shared": shared, "own": own,
            "cached_tokens": sum(r.cached_tokens for r in reqs), "decode_tokens": tokens,
            "seconds": elapsed, "step_ms": elapsed / steps * 1e3,
            "decode_tokens_per_s": tokens / elapsed, "rel_err": 0.0})
        print(f"    {rows[-1]['row']}: {rows[-1]['decode_tokens_per_s']:.0f} tok/s, "
              f"{rows[-1]['step_ms']:.2f} ms/step", flush=True)
        del engine, model
    rows[1]["engine_speedup"] = rows[1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"]
    return rows


def _summary(r) -> str:
    parts = [f"{r['impl']:>16}: err {r['rel_err']:.1e}"]
    for mode in ("eager", "graph"):
        if r.get(f"{mode}_ms"):
            parts.append(f"{mode} {r[f'{mode}_ms']:.4f} ms = "
                         f"{r[f'{mode}_tokens_per_s']:.0f} tok/s")
    return "  ".join(parts)


def cascade_table(rows: list[dict]) -> str:
    """A markdown table of the cascade rows."""
    lines = ["| row | eager ms | graph ms | tokens/s (graph, else eager) | vs without | rel err "
             "| plan µs (host, per step) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]

    def f(v, fmt):
        return "—" if v is None else format(v, fmt)

    for r in rows:
        if "wrong" in r:
            lines.append(f"| {r['row']} | WRONG: {r['wrong']} ||||||")
            continue
        if "decode_tokens_per_s" in r:  # an engine row: ms per decode step
            sp = r.get("engine_speedup")
            lines.append(f"| {r['row']} | {r['step_ms']:.3f} (step) | — | "
                         f"{r['decode_tokens_per_s']:.0f} | "
                         f"{f(sp, '.2f') + '×' if sp else ''} | — | — |")
            continue
        tps = r.get("graph_tokens_per_s") or r.get("eager_tokens_per_s")
        sp = r.get("graph_speedup") or r.get("eager_speedup")
        lines.append(f"| {r['row']} | {f(r.get('eager_ms'), '.4f')} | "
                     f"{f(r.get('graph_ms'), '.4f')} | {f(tps, '.0f')} | "
                     f"{f(sp, '.2f') + '×' if sp else ''} | {r['rel_err']:.1e} | "
                     f"{f(r.get('plan_us'), '.0f')} |")
    return "\n".join(lines)
