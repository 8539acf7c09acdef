"""Causal prefill/extend: our paged kernel, our dense two-pass kernel (``extend_attention``)
and cuDNN, side by side, plus a small launch-config sweep of the dense kernel.

Rows (``../shared/PERFORMANCE.md`` shapes: GQA 32/8, head dim 128, page 16, bf16): causal
prefill ``1×2k``, ``1×8k``, ``1×16k``, ``8×2k``, and ``1×8k`` new tokens over a ``4k`` paged
prefix (``extend``). Implementations:

* ``ours-paged``: ``aiter_attn.ops.paged_attention(backend="triton")`` over the paged cache
  holding every token (today's prefill path, validation and plan included in each call);
* ``ours-dense``: :class:`aiter_attn.kernels.triton.extend.TritonExtendAttention` (the
  registry's ``extend_attention``): the step's new K/V as dense ``[T, Hkv, D]`` tensors,
  the prefix through the paged kernel, merged by LSE. Planned once (what an engine does
  once per step), then ``run`` is timed (what a layer costs);
* ``cudnn``: ``scaled_dot_product_attention`` with cuDNN on dense ``[B, H, L, D]``
  (``enable_gqa``; the extend row uses a bottom-right causal mask, ``causal_lower_right``).

Every result is checked against the float32 reference (last 128 query rows of up to 4
requests, relative error ≤ 2e-2) before it is timed. Timings: ``triton.testing.do_bench``
(eager, L2 flushed) and ``do_bench_cudagraph`` (replay), medians. TFLOP/s count the visible
(query, key) pairs × 4·D·Hq (the causal triangle; plus the full prefix for the extend row).

The sweep (``--sweep``, on by default) times up to 8 dense launch configurations per row
(eager, after the same correctness check) and reports the best; the default configuration
is :func:`aiter_attn.kernels.triton.prefill.choose_prefill_config`'s. ``--budget-s`` (default
150) caps the sweep's own time (compiles included); the rows themselves always run.

Usage (GPU)::

    python benchmarks/bench_prefill.py --out "$OUT"           # table + bench_prefill.json
    python benchmarks/bench_prefill.py --smoke --out /tmp/x   # CPU interpreter: harness check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (label, batch, new tokens per request, cached prefix per request)
ROWS = [("prefill 1x2k", 1, 2048, 0), ("prefill 1x8k", 1, 8192, 0),
        ("prefill 1x16k", 1, 16384, 0), ("prefill 8x2k", 8, 2048, 0),
        ("extend 1x8k+4k", 1, 8192, 4096)]
SMOKE_ROWS = [("smoke 2x40+0", 2, 40, 0), ("smoke 1x24+48", 1, 24, 48)]
#: dense launch configs of the sweep: (block_m, block_n, num_warps, num_stages, tma, m_slow,
#: one_loop[, {more PrefillConfig fields}]); 64-row 4-warp tiles put two CTAs on an SM (two independent warpgroups)
SWEEP = [(128, 128, 8, 2, True, False, False), (128, 128, 8, 2, True, True, False),
         (64, 64, 4, 3, True, False, False), (64, 64, 4, 3, True, True, False),
         (64, 64, 4, 2, True, False, False), (128, 64, 8, 3, True, True, False),
         (64, 32, 4, 3, True, False, False),
         # the Gluon kernel (softmax overlapped with the tensor cores; 8th field: more fields)
         (64, 64, 4, 2, True, False, False, {"gluon": True}),
         (64, 64, 4, 2, True, True, False, {"gluon": True}),
         (64, 64, 4, 3, True, False, False, {"gluon": True}),
         (64, 128, 4, 2, True, False, False, {"gluon": True}),
         (128, 64, 8, 2, True, False, False, {"gluon": True}),
         (64, 32, 4, 2, True, False, False, {"gluon": True}),
         (64, 32, 4, 4, True, False, False, {"gluon": True}),
         # warp-specialised Gluon: 128-row programs, two consumers sharing K/V, a loader warp
         (128, 64, 4, 2, True, False, False, {"gluon": True, "warp_specialize": True}),
         (128, 64, 4, 3, True, False, False, {"gluon": True, "warp_specialize": True}),
         (128, 64, 4, 4, True, False, False, {"gluon": True, "warp_specialize": True}),
         (128, 128, 4, 2, True, False, False, {"gluon": True, "warp_specialize": True}),
         (128, 64, 4, 3, True, True, False, {"gluon": True, "warp_specialize": True}),
         (128, 128, 4, 2, True, True, False, {"gluon": True, "warp_specialize": True}),
         (128, 128, 4, 3, True, False, False, {"gluon": True, "warp_specialize": True})]
SMOKE_SWEEP = [(16, 16, 4, 1, True, False, False), (16, 16, 4, 1, True, True, True),
               (16, 16, 4, 1, True, False, False, {"gluon": True}),
               (32, 16, 4, 1, True, False, False, {"gluon": True, "warp_specialize": True})]
RTOL = 2e-2


class Inputs:
    """One row's tensors: queries, the new K/V (dense, token-major), the paged cache holding
    prefix + new tokens (block-permuted, null page 0), dense ``[B, Hkv, L, D]`` copies."""

    def __init__(self, bs, n, prefix, *, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16,
                 device="cuda", seed=0):
        g = torch.Generator(device=device).manual_seed(seed)
        L = n + prefix
        self.bs, self.n, self.prefix, self.L = bs, n, prefix, L
        self.hq, self.hkv, self.d, self.page = hq, hkv, d, page
        self.dense_k = torch.randn(bs, hkv, L, d, device=device, dtype=dtype, generator=g)
        self.dense_v = torch.randn(bs, hkv, L, d, device=device, dtype=dtype, generator=g)
        npp = -(-L // page)
        perm = torch.randperm(bs * npp, device=device, generator=g)
        self.k_cache = self._paged(self.dense_k, npp, perm, g)
        self.v_cache = self._paged(self.dense_v, npp, perm, g)
        self.block_table = (1 + perm).view(bs, npp).to(torch.int32)
        self.q = torch.randn(bs * n, hq, d, device=device, dtype=dtype, generator=g)
        self.k_new = self.dense_k[:, :, prefix:].permute(0, 2, 1, 3).reshape(bs * n, hkv, d) \
            .contiguous()
        self.v_new = self.dense_v[:, :, prefix:].permute(0, 2, 1, 3).reshape(bs * n, hkv, d) \
            .contiguous()
        self.cu = torch.arange(0, bs + 1, device=device, dtype=torch.int32) * n
        self.seqused = torch.full((bs,), L, device=device, dtype=torch.int32)
        self.scale = d ** -0.5

    def _paged(self, dense, npp, perm, g):
        b, h, L, d = dense.shape
        padded = torch.zeros(b, h, npp * self.page, d, device=dense.device, dtype=dense.dtype)
        padded[:, :, :L] = dense
        tokens = padded.permute(0, 2, 1, 3).reshape(b * npp, self.page, h, d)
        cache = torch.randn(b * npp + 1, self.page, h, d, device=dense.device,
                            dtype=dense.dtype, generator=g)
        cache[1 + perm] = tokens
        return cache

    @property
    def flops(self) -> float:
        pairs = self.n * self.prefix + self.n * (self.n + 1) / 2
        return 4.0 * self.bs * self.hq * self.d * pairs

    def reference(self, last_q=128, rows_b=4):
        """Float32 reference of the last ``last_q`` queries of the first requests."""
        from aiter_attn.kernels.reference import paged_attention_reference

        rows_b = min(rows_b, self.bs)
        nq = min(last_q, self.n)
        idx = torch.cat([torch.arange(b * self.n + self.n - nq, (b + 1) * self.n)
                         for b in range(rows_b)]).to(self.q.device)
        cu = torch.arange(0, rows_b + 1, dtype=torch.int32, device=self.q.device) * nq
        out = torch.empty(idx.numel(), self.hq, self.d, dtype=torch.float32,
                          device=self.q.device)
        paged_attention_reference(self.q[idx].float(), self.k_cache, self.v_cache, out,
                                  cu_seqlens_q=cu, seqused_k=self.seqused[:rows_b],
                                  block_table=self.block_table[:rows_b],
                                  softmax_scale=self.scale)
        return out, idx


# ------------------------------------------------------------------------------ runners

def make_paged(x):
    from aiter_attn import ops

    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    kw = dict(cu_seqlens_q=x.cu, seqused_k=x.seqused, block_table=x.block_table,
              softmax_scale=x.scale, causal=True, out=out, max_seqlen_q=x.n,
              max_seqlen_k=x.L, backend="triton")

    def fn():
        ops.paged_attention(x.q, x.k_cache, x.v_cache, **kw)

    fn()
    return fn, out, None


def make_dense(x, config=None):
    """The registry's ``extend_attention``, planned once; ``fn`` is one layer's ``run``."""
    import attrs

    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
    from aiter_attn.kernels.triton import prefill as pf
    from aiter_attn.kernels.triton.extend import extend_attention_request
    from aiter_attn.plugins import kernel_registry

    req = extend_attention_request(x.q, x.k_cache, x.v_cache)
    kernel = kernel_registry().select(req, backend="triton").bind(req)
    md = _adhoc_metadata(x.q, x.k_cache, x.cu, x.seqused, x.block_table, None, None, x.n, x.L,
                         "paged_attention")
    md.extras["max_prefix_len"] = x.prefix
    saved = dict(pf.PREFILL_OVERRIDES)
    if config is not None:
        bm, bn, nw, ns, tma, m_slow, one_loop, extra = (tuple(config) + ({},))[:8]
        # every field: an entry leaves nothing of the chooser's pick in place (a default
        # with warp_specialize would otherwise turn a plain entry into a declined launch)
        pf.PREFILL_OVERRIDES.update(attrs.asdict(pf.PrefillConfig(
            bm, bn, nw, ns, tma=tma, m_slow=m_slow, one_loop=one_loop, **extra)))
    try:
        plan = kernel.plan(md)
    finally:
        pf.PREFILL_OVERRIDES.clear()
        pf.PREFILL_OVERRIDES.update(saved)
    params = LayerParams.create(scale=x.scale, device=x.q.device)
    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    cache = (x.k_cache, x.v_cache)

    def fn():
        kernel.run(x.q, cache, plan, params, out, k=x.k_new, v=x.v_new)

    fn()
    return fn, out, attrs.asdict(plan.dense_cfg)


def make_cudnn(x):
    """cuDNN SDPA on the dense copies. Prefill rows: ``is_causal`` with ``enable_gqa``. The
    extend row (queries over more keys) needs a bottom-right causal mask, which ``is_causal``
    (top-left) is not: the first form that runs of an explicit boolean mask with
    ``enable_gqa``, the same with K/V heads expanded, and ``causal_lower_right`` (which torch
    may route to flash/efficient rather than cuDNN: the ``layout`` field says which ran)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = x.q.view(x.bs, x.n, x.hq, x.d).transpose(1, 2)
    holder = {}
    attempts = []
    if not x.prefix:
        def plain():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                holder["o"] = F.scaled_dot_product_attention(
                    q, x.dense_k, x.dense_v, is_causal=True, scale=x.scale, enable_gqa=True)
        attempts.append(("cudnn is_causal", plain))
    else:
        mask = torch.ones(x.n, x.L, dtype=torch.bool, device=x.q.device).tril(x.prefix)
        g = x.hq // x.hkv

        def masked_gqa():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                holder["o"] = F.scaled_dot_product_attention(
                    q, x.dense_k, x.dense_v, attn_mask=mask, scale=x.scale, enable_gqa=True)

        kx = vx = None

        def masked_expanded():
            nonlocal kx, vx
            if kx is None:
                kx = x.dense_k.repeat_interleave(g, 1)
                vx = x.dense_v.repeat_interleave(g, 1)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                holder["o"] = F.scaled_dot_product_attention(q, kx, vx, attn_mask=mask,
                                                             scale=x.scale)

        def lower_right():
            from torch.nn.attention.bias import causal_lower_right

            nonlocal kx, vx
            if kx is None:
                kx = x.dense_k.repeat_interleave(g, 1)
                vx = x.dense_v.repeat_interleave(g, 1)
            holder["o"] = F.scaled_dot_product_attention(
                q, kx, vx, attn_mask=causal_lower_right(x.n, x.L), scale=x.scale)

        attempts += [("cudnn bool mask, enable_gqa", masked_gqa),
                     ("cudnn bool mask, K/V expanded", masked_expanded),
                     ("causal_lower_right (torch's choice, not cuDNN)", lower_right)]
    errors = []
    for layout, fn in attempts:
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            errors.append(f"{layout}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        info = layout + (f" (after: {'; '.join(errors)})" if errors else "")
        return fn, lambda: holder["o"].transpose(1, 2).reshape(x.bs * x.n, x.hq, x.d), info
    raise RuntimeError("; ".join(errors))


# ------------------------------------------------------------------------------ timing

def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_ms(fn, graph: bool, rep: int, smoke: bool):
    if smoke:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing as tt

    try:
        if graph:
            return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        return float(tt.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median"))
    except Exception as exc:
        print(f"    timing failed ({'graph' if graph else 'eager'}): {exc!r}"[:200], flush=True)
        return None


def measure(name, make, x, ref, args, *, graph=True, rep=None):
    rec = {"impl": name}
    try:
        fn, out, info = make(x)
    except Exception as exc:
        rec["missing"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return rec
    if info is not None:
        rec["config" if isinstance(info, dict) else "layout"] = info
    if not args.smoke:
        torch.cuda.synchronize()
    expected, idx = ref
    got = (out() if callable(out) else out)[idx]
    err = rel_err(got, expected)
    rec["rel_err"] = err
    if not math.isfinite(err) or err > RTOL:
        rec["wrong"] = f"relative error {err:.3e} > {RTOL:.0e}; not timed"
        return rec
    rep = rep or args.rep
    if getattr(args, "host", False) and not args.smoke:
        # host time of one call: 50 calls queued back to back (the GPU runs behind), the
        # CPU's own clock; the queue is drained before the timings below
        t = time.perf_counter()
        for _ in range(50):
            fn()
        rec["host_us"] = (time.perf_counter() - t) / 50 * 1e6
        torch.cuda.synchronize()
    rec["eager_ms"] = time_ms(fn, False, rep, args.smoke)
    if graph and args.graphs and not args.smoke:
        rec["graph_ms"] = time_ms(fn, True, rep, args.smoke)
    for mode in ("eager", "graph"):
        ms = rec.get(f"{mode}_ms")
        if ms:
            rec[f"{mode}_tflops"] = x.flops / (ms * 1e-3) / 1e12
    return rec


def summarize(rec) -> str:
    name = rec["impl"]
    if "missing" in rec:
        return f"{name:>28}: missing ({rec['missing'][:120]})"
    if "wrong" in rec:
        return f"{name:>28}: WRONG ({rec['wrong']})"
    parts = [f"{name:>28}: err {rec['rel_err']:.1e}"]
    for mode in ("eager", "graph"):
        if rec.get(f"{mode}_ms"):
            parts.append(f"{mode} {rec[f'{mode}_ms']:.4f} ms = {rec[f'{mode}_tflops']:.1f} "
                         "TFLOP/s")
    if rec.get("host_us"):
        parts.append(f"host {rec['host_us']:.0f} us/call")
    return "  ".join(parts)


def _cfg_name(c) -> str:
    bm, bn, nw, ns, tma, m_slow, one_loop, extra = (tuple(c) + ({},))[:8]
    return (f"dense {bm}x{bn} w{nw} s{ns}{'' if tma else ' ptr'}"
            f"{' m-slow' if m_slow else ''}{' one-loop' if one_loop else ''}"
            + "".join(f" {k}" if v is True else f" {k}={v}" for k, v in extra.items()))


def run(args) -> list:
    rows = SMOKE_ROWS if args.smoke else ROWS
    if args.rows:
        wanted = {r.strip() for r in args.rows.split(",")}
        rows = [r for r in rows if r[0] in wanted]
    sweep = SMOKE_SWEEP if args.smoke else SWEEP
    if args.configs:
        sweep = [sweep[int(i)] for i in args.configs.split(",")]
    device = "cpu" if args.smoke else "cuda"
    dims = dict(hq=4, hkv=2, d=64, page=16, dtype=torch.float16) if args.smoke else {}
    results = []
    sweep_s = 0.0  # seconds spent sweeping (compiles included), against --budget-s
    for label, bs, n, prefix in rows:
        print(f"== {label}", flush=True)
        x = Inputs(bs, n, prefix, device=device, **dims)
        ref = x.reference()
        row = {"case": label, "bs": bs, "new": n, "prefix": prefix, "flops": x.flops,
               "impls": [], "sweep": []}
        impls = [("ours-paged", make_paged), ("ours-dense", make_dense)]
        if not args.smoke:
            impls.append(("cudnn", make_cudnn))
        for name, make in impls:
            rec = measure(name, make, x, ref, args)
            row["impls"].append(rec)
            print("   ", summarize(rec), flush=True)
        if args.sweep:
            for c in sweep:
                if args.budget_s and sweep_s > args.budget_s:
                    row.setdefault("sweep_skipped", []).append(_cfg_name(c))
                    continue
                t = time.monotonic()
                rec = measure(_cfg_name(c), lambda inp, c=c: make_dense(inp, c), x, ref, args,
                              graph=args.sweep_graphs and args.graphs and not args.smoke,
                              rep=max(10, args.rep // 2))
                sweep_s += time.monotonic() - t
                rec["cfg"] = list(c)
                row["sweep"].append(rec)
                print("   ", summarize(rec), flush=True)
            timed = [r for r in row["sweep"] if r.get("eager_ms")]
            if timed:
                # replayed sweeps rank by the replayed time (what a captured step costs)
                rank = "graph_ms" if all(r.get("graph_ms") for r in timed) else "eager_ms"
                best = min(timed, key=lambda r: r[rank])
                row["best"] = best["cfg"]
                if not args.smoke and args.graphs:  # the winner replayed too
                    rec = measure("ours-dense best", lambda inp: make_dense(inp, best["cfg"]),
                                  x, ref, args)
                    rec["cfg"] = best["cfg"]
                    row["impls"].append(rec)
                    print("   ", summarize(rec), flush=True)
        results.append(row)
        del x
        if not args.smoke:
            torch.cuda.empty_cache()
        dump(results, args)
    return results


def _get(row, impl, mode):
    for r in row["impls"]:
        if r["impl"] == impl:
            return r.get(f"{mode}_tflops")
    return None


def table(results, mode) -> str:
    lines = ["| row | ours-paged | ours-dense | dense best | cuDNN | paged/cuDNN | dense/cuDNN | "
             "best/cuDNN | best config (bm, bn, w, s, tma, m_slow, one_loop) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(v):
        return "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.3g}"

    def r(a, b):
        return "—" if not a or not b else f"{a / b:.2f}×"

    for row in results:
        p, d, b, c = (_get(row, n, mode) for n in ("ours-paged", "ours-dense",
                                                   "ours-dense best", "cudnn"))
        if b is None and mode == "eager" and row.get("sweep"):
            timed = [s for s in row["sweep"] if s.get("eager_tflops")]
            b = max((s["eager_tflops"] for s in timed), default=None)
        lines.append(f"| {row['case']} | {f(p)} | {f(d)} | {f(b)} | {f(c)} | {r(p, c)} | "
                     f"{r(d, c)} | {r(b, c)} | {row.get('best', '—')} |")
    return "\n".join(lines)


def dump(results, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_prefill.json"), "w") as f:
        json.dump({"meta": args.meta, "rows": results}, f, indent=1, default=str)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=60, help="ms of timed repetitions")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument("--no-sweep", dest="sweep", action="store_false")
    p.add_argument("--sweep-graphs", action="store_true",
                   help="also replay every sweep configuration (and rank them replayed)")
    p.add_argument("--rows", default=None,
                   help="comma list of row labels to run (e.g. 'prefill 1x16k,prefill 8x2k')")
    p.add_argument("--host", action="store_true",
                   help="also record each implementation's host time per call (host_us)")
    p.add_argument("--configs", default=None,
                   help="comma list of indices into the sweep's configurations (default: all)")
    p.add_argument("--budget-s", type=float, default=150,
                   help="stop sweeping once the sweep has taken this many seconds, compiles "
                        "included (0: no limit)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU (TRITON_INTERPRET=1), tiny shapes: the harness runs")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("bench_prefill needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1).")
    import triton

    args.meta = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(),
                 "torch": torch.__version__, "triton": triton.__version__,
                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "command": " ".join(["python", "benchmarks/bench_prefill.py"] + sys.argv[1:]),
                 "sweep_configs": [list(c) for c in (SMOKE_SWEEP if args.smoke else SWEEP)]}
    t = time.monotonic()
    results = run(args)
    args.meta["wall_s"] = time.monotonic() - t
    dump(results, args)
    report = "\n".join([
        f"Device: {args.meta['device']}; torch {args.meta['torch']}, triton "
        f"{args.meta['triton']}; {args.meta['wall_s']:.0f} s. TFLOP/s (causal pairs).",
        "", "CUDA-graph replay (median):", "", table(results, "graph"),
        "", "Eager (median, L2 flushed; 'dense best' = best sweep config):", "",
        table(results, "eager"), ""])
    print()
    print(report)
    return results


if __name__ == "__main__":
    main()
