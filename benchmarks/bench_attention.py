"""Side-by-side attention benchmark on one GPU: our Triton kernels and the anchors, same shapes.

Rows (``../shared/PERFORMANCE.md``): GQA 32/8, head dim 128, page 16, bf16 —
decode ``bs × ctx`` (TB/s of K+V read) and causal prefill ``bs × S`` (TFLOP/s); MLA decode
(kv_lora 512 + rope 64, page 64, 16 and 128 heads: TB/s and TFLOP/s); fp8 KV decode at long
context against bf16 (tokens/s ratio). Implementations: ours (``aiter_attn.ops`` with
``backend="triton"``), cuDNN and FA2 through ``torch.nn.functional.scaled_dot_product_attention``
on dense KV, ``flex_attention`` (compiled), and the seed's aiter Triton ``unified_attention``
from the ``amd-aiter`` wheel (``benchmarks/aiter_shim.py``).

Every result is checked against the float32 reference (``aiter_attn.kernels.reference``) by
relative error before it is timed (a sample of requests / the last query rows on big cases);
a wrong result is reported and not timed. Timings: ``triton.testing.do_bench`` (eager, L2
flushed between runs) and ``do_bench_cudagraph`` (replayed graph), medians in ms.

The ``host`` group (``benchmarks/_host.py``) measures host cost instead: eager
``AttentionBackend.forward`` of one decode layer against a bare launch of the same Triton kernel,
``ops.paged_attention`` against torch SDPA (median of ≥ 2,000 calls), and the engine against
transformers ``generate`` (Llama-3.2-1B-shaped random bf16 model, batch 8 and 32, 512 + 128
tokens, eager and CUDA-graph decode); ``--smoke`` runs it on the CPU with tiny shapes.
The ``mixed`` group (``benchmarks/_mixed.py``, not in the default ``--only``) measures engine
steps/s with requests arriving while 32 others decode, mixed steps as one forward against
two (``--smoke --only mixed``: the CPU harness check).
The ``cascade`` group (``benchmarks/_cascade.py``, not in the default ``--only``) measures
decode of 64 requests sharing a 4k-token prefix (256 own tokens each) with and without
cascade attention, tokens/s eager and replayed, then the engine's decode tokens/s on the same
workload (``--smoke --only cascade``: the CPU check).

Usage (on the GPU machine)::

    python benchmarks/bench_attention.py --out "$OUT"            # everything
    python benchmarks/bench_attention.py --only decode,mla --quick
    python benchmarks/bench_attention.py --only host --out "$OUT"  # host cost + engine
    python benchmarks/bench_attention.py --smoke --out /tmp/x      # CPU: the harness runs
    python benchmarks/bench_attention.py --only mixed --out "$OUT" # engine mixed steps
    python benchmarks/bench_attention.py --only cascade --out "$OUT"  # shared-prefix decode
    python benchmarks/bench_attention.py --only cascade --cascade-sweep --out "$OUT"

Writes ``bench_attention.json`` and ``roofline.png`` to ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _host import host_table, run_host  # noqa: E402
from _mixed import mixed_table, run_mixed  # noqa: E402
from _cascade import cascade_table, run_cascade, run_cascade_engine  # noqa: E402
from _inputs import make_mha, make_mla  # noqa: E402
from _runners import (RUNNERS, Unavailable, configure_aiter, make_ours_mla,  # noqa: E402
                      make_ours_mla_planned)

DECODE_ROWS = [(1, 4096), (16, 4096), (64, 4096), (256, 4096), (64, 16384), (8, 65536),
               (1, 32768)]
PREFILL_ROWS = [(1, 2048), (1, 8192), (1, 16384), (8, 2048)]
MLA_ROWS = [(16, 64, 4096), (16, 128, 8192), (128, 16, 4096), (128, 64, 4096)]  # heads, bs, ctx
FP8_ROWS = [(8, 65536), (64, 16384), (1, 32768)]
ANCHORS = ("cudnn", "fa2", "flex", "aiter")
#: ``--mla-variants``: launch options of the MLA kernel (``mla_paged_attention`` keywords)
#: timed beside the default on the 16-head rows. Programmatic dependent launch lets the split
#: merge (or both launches) start while the kernel before finishes: the merge launch and its
#: gap are ~5% of a 16-head 64x4k step.
MLA_VARIANTS = {"pdl-reduce": {"pdl": "reduce"}, "pdl": {"pdl": True},
                # the split merge in the attention launch (no second launch)
                "fused": {"fused_merge": True}, "fused-pdl": {"fused_merge": True, "pdl": True},
                # a cooperative launch: every split merges a column slice
                "coop": {"fused_merge": "cooperative"},
                # latent tiles through tensor descriptors (TMA)
                "desc": {"kv_desc": True},
                "desc-coop": {"kv_desc": True, "fused_merge": "cooperative"},
                # the accumulator rescaled only when a maximum grows past 2^8
                "lazy": {"lazy_rescale": True},
                "desc-lazy": {"kv_desc": True, "lazy_rescale": True},
                # the same on 64-key tiles, 8 warps, one program per SM
                "desc-lazy-64w8": {"kv_desc": True, "lazy_rescale": True, "block_n": 64,
                                   "num_warps": 8, "num_stages": 3},
                # split partials in q's 16-bit dtype (half the partial bytes)
                "half": {"half_partials": True},
                "desc-lazy-half": {"kv_desc": True, "lazy_rescale": True,
                                   "half_partials": True},
                "narrow": {"narrow": True},  # the narrow Gluon kernel (sm_90)
                "ring": {"ring": True},  # the ring Gluon kernel (sm_90)
                # the narrow kernel merging its own splits
                "narrow-fused": {"narrow": True, "fused_merge": True},
                # ... and the attention launch itself started early (PDL): no merge launch
                "narrow-fused-pdl": {"narrow": True, "fused_merge": True, "pdl": True},
                # q·Kᵀ as two independent mma chains (latent halves)
                "split2": {"qk_split": 2},
                "half-split2": {"half_partials": True, "qk_split": 2},
                "desc-lazy-half-split2": {"kv_desc": True, "lazy_rescale": True,
                                          "half_partials": True, "qk_split": 2},
                # q·Kᵀ as four mma chains (latent quarters), pointer loads: the sm_90 build's
                # chain 8, about 357 executed instructions a tile with the lazy rescale
                "split4": {"qk_split": 4},
                "lazy-half-split4": {"lazy_rescale": True, "half_partials": True,
                                     "qk_split": 4},
                # the last split merges (16-bit partials: half the bytes of its serial tail)
                "half-fused": {"half_partials": True, "fused_merge": True},
                "lazy-half-split4-fused": {"lazy_rescale": True, "half_partials": True,
                                           "qk_split": 4, "fused_merge": True},
                # the narrow kernel with 16-bit partials
                "narrow-half": {"narrow": True, "half_partials": True},
                # float32 split partials (the default before the twenty-fourth session)
                "f32-partials": {"half_partials": False},
                "narrow-f32": {"narrow": True, "half_partials": False},
                # the narrow kernel's split merge launched early (PDL): it waits on the
                # device; "-all": the attention launch too
                "narrow-pdl": {"narrow": True, "pdl": "reduce"},
                "narrow-pdl-all": {"narrow": True, "pdl": True},
                "narrow-no-pdl": {"narrow": True, "pdl": False},
                # the attention launch starts early too and issues its first tiles of keys
                # older than the step's before its wait (_pdl.EARLY_KEYS): here they overlap
                # the kernel before it, the previous step's merge
                "narrow-early": {"narrow": True, "pdl": "early"},
                # one program a token (64x4k: 64 programs on 132 SMs, no merge launch)
                "narrow-split1": {"narrow": True, "num_kv_splits": 1},
                # the Triton kernel, where the narrow kernel is the default
                "triton": {"narrow": False},
                # equal key tiles a program, as many programs as the SMs hold (mla_balanced)
                "balanced": {"balanced": True},
                "balanced-f32": {"balanced": True, "half_partials": False},
                # the balanced launch's slots weighed by each SM's rate, measured first on
                # this GPU (narrow_timeline.measure_sm_rates), programs claiming their SM's
                # slot; "balanced-planned": the same runner without the weights
                "balanced-sm": {"balanced": True, "balanced_rates": "measure"},
                "balanced-planned": {"balanced": True, "balanced_rates": None},
                # the persistent stream kernel (mla_stream_gluon: one program per SM over
                # shares of the batch's keys crossing requests), plan once / run per call;
                # "-sm": its shares weighed by each SM's measured rate
                "stream": {"stream": True, "balanced_rates": None},
                "stream-sm": {"stream": True, "balanced_rates": "measure"},
                # weighed by the SMs' rates under the stream kernel itself (all SMs busy)
                "stream-own-sm": {"stream": True, "balanced_rates": "measure-stream"}}
#: MLA launch configs timed by --mla-sweep: (block_h, block_n, num_warps, num_stages, splits).
MLA_SWEEP = [(16, 32, 4, 2, None), (16, 32, 4, 4, None), (16, 64, 4, 3, None),
             (16, 32, 8, 3, None), (16, 32, 4, 3, "x2"), (32, 32, 8, 3, None),
             (64, 16, 8, 3, None), (64, 32, 8, 2, None), (32, 64, 8, 2, None),
             # 8 warps at the 16-head default tiles: 138 registers and no spills, against
             # 255 and 56 spilled bytes with 4 warps (scripts/inspect_sm90.py, 2026-12-04)
             (16, 64, 8, 3, None), (16, 64, 8, 3, "x2"),
             # more splits (16 heads, 64x4k replayed: 32-key tiles with 4 splits 3.70 TB/s
             # against the default's 3.54)
             (16, 64, 4, 3, "x2"), (16, 32, 8, 3, "x2"), (16, 32, 4, 4, "x2"),
             # around the new 16-head default (32-key tiles, two programs per SM, 2x the
             # one-per-SM split count): 6 and 8 splits (64x4k: 4 by default)
             (16, 32, 4, 3, 6), (16, 32, 4, 3, 8)]


_RATES: dict = {}


def _sm_rates(device, own: bool = False) -> tuple:
    """Each SM's streaming rate on this GPU, measured once a run: under the narrow kernel
    (``narrow_timeline.measure_sm_rates``, the ``-sm`` variants), or with ``own`` under the
    stream kernel with every SM busy (``stream_probe.stream_sm_rates``, ``stream-own-sm``)."""
    if device.type != "cuda":
        raise Unavailable("per-SM rates need a kernel's stamps (sm_90)")
    key = (str(device), own)
    if key not in _RATES:
        if own:
            from stream_probe import stream_sm_rates as measure
        else:
            from narrow_timeline import measure_sm_rates as measure
        try:
            _RATES[key] = measure(device)
        except RuntimeError as exc:  # no Gluon kernel (not sm_90): the row is missing
            raise Unavailable(str(exc)) from exc
        r = _RATES[key]
        print(f"    per-SM rates{' (stream)' if own else ''}: {len(r)} SMs, "
              f"{min(r):.4g}..{max(r):.4g} per µs", flush=True)
    return _RATES[key]


def _resolve(launch: dict, x) -> dict:
    """A variant's keywords with ``balanced_rates="measure"`` / ``"measure-stream"``
    replaced by this GPU's per-SM rates (:func:`_sm_rates`; inside the runner, so a failure
    reads as the row's ``missing``)."""
    if launch.get("balanced_rates") == "measure":
        return {**launch, "balanced_rates": _sm_rates(x.q.device)}
    if launch.get("balanced_rates") == "measure-stream":
        return {**launch, "balanced_rates": _sm_rates(x.q.device, own=True)}
    return launch


def mla_configs(text: str) -> list:
    """``--mla-configs`` as sweep tuples (:data:`MLA_SWEEP` when empty): each item
    ``block_h/block_n/warps/stages/splits[/page_chunk]``, splits a number, ``auto`` (None) or
    ``x2``; ``ValueError`` naming a malformed item."""
    if not text:
        return MLA_SWEEP
    out = []
    for item in text.split(","):
        parts = item.split("/")
        if len(parts) not in (5, 6):
            raise ValueError(f"--mla-configs item {item!r}: block_h/block_n/warps/stages/"
                             "splits[/page_chunk]")
        sp = parts[4]
        sp = None if sp == "auto" else sp if sp == "x2" else int(sp)
        out.append((int(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), sp,
                    *(int(v) for v in parts[5:])))
    return out


RTOL_BF16 = 2e-2
RTOL_FP8 = 6e-2  # e4m3 cache: the reference reads the same dequantised values; q/P/out in bf16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def reference_mha(x, rows_b: int, last_q: int):
    """Float32 reference for the first ``rows_b`` requests and their last ``last_q`` queries;
    returns ``(expected, selector)``: ``selector(out)`` picks the same rows from ``[T, H, D]``."""
    from aiter_attn.kernels.reference import paged_attention_reference

    nq = min(last_q, x.q_len)
    idx = torch.cat([torch.arange(b * x.q_len + x.q_len - nq, (b + 1) * x.q_len)
                     for b in range(rows_b)]).to(x.q.device)
    q = x.q[idx]
    cu = torch.arange(0, rows_b + 1, dtype=torch.int32, device=x.q.device) * nq
    out = torch.empty(q.shape[0], x.hq, x.d, dtype=torch.float32, device=x.q.device)
    paged_attention_reference(q.float(), x.k_cache, x.v_cache, out, cu_seqlens_q=cu,
                              seqused_k=x.seqused_k[:rows_b], block_table=x.block_table[:rows_b],
                              softmax_scale=x.scale, k_scale=x.k_scale, v_scale=x.v_scale)
    return out, lambda o: o[idx]


def reference_mla(x, rows_b: int):
    from aiter_attn.kernels.reference import mla_paged_attention_reference

    out = torch.empty(rows_b, x.heads, x.rank, dtype=torch.float32, device=x.q.device)
    cu = torch.arange(0, rows_b + 1, dtype=torch.int32, device=x.q.device)
    mla_paged_attention_reference(x.q[:rows_b].float(), x.kv_cache, out, kv_lora_rank=x.rank,
                                  cu_seqlens_q=cu, seqused_k=x.seqused_k[:rows_b],
                                  block_table=x.block_table[:rows_b], softmax_scale=x.scale,
                                  kv_scale=x.kv_scale)
    return out


def time_fn(fn, graph: bool, rep: int) -> float | None:
    import triton.testing as tt

    try:
        if graph:
            return float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
        return float(tt.do_bench(fn, warmup=max(5, rep // 4), rep=rep, return_mode="median"))
    except Exception as exc:  # capture can fail for an anchor; report, keep going
        print(f"    timing failed ({'graph' if graph else 'eager'}): {exc!r}"[:200], flush=True)
        return None


def bench_impl(name, make, x, expected, select, rtol, rep, graphs):
    rec = {"impl": name}
    try:
        fn, result = make(x)
    except Unavailable as exc:
        rec["missing"] = str(exc)
        return rec
    except Exception as exc:
        rec["missing"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return rec
    torch.cuda.synchronize()
    if getattr(fn, "layout", None):
        rec["layout"] = fn.layout
    err = rel_err(select(result()), expected)
    rec["rel_err"] = err
    if not math.isfinite(err) or err > rtol:
        rec["wrong"] = f"relative error {err:.3e} > {rtol:.1e}; not timed"
        return rec
    rec["eager_ms"] = time_fn(fn, False, rep)
    if graphs:
        rec["graph_ms"] = time_fn(fn, True, rep)
    return rec


def add_rates(rec, bytes_moved, flops):
    # this record's own counts (an fp8 row's bf16 twin moves twice the K/V bytes of its row):
    # the roofline places each point at its own FLOP per byte
    rec["bytes"], rec["flops"] = bytes_moved, flops
    for mode in ("eager", "graph"):
        ms = rec.get(f"{mode}_ms")
        if ms:
            rec[f"{mode}_tbps"] = bytes_moved / (ms * 1e-3) / 1e12
            rec[f"{mode}_tflops"] = flops / (ms * 1e-3) / 1e12


def out_of_time(args, label) -> bool:
    """True (and noted) once ``--budget-s`` has passed: remaining rows are skipped, the report
    is still written."""
    if args.budget_s and time.monotonic() - args.t0 > args.budget_s:
        args.meta.setdefault("skipped_for_time", []).append(label)
        print(f"== {label}: skipped (--budget-s {args.budget_s} reached)", flush=True)
        return True
    return False


def run_mha_rows(kind, rows, args, results):
    for bs, n in rows:
        if out_of_time(args, f"{kind} {bs}x{n // 1024}k"):
            continue
        decode = kind in ("decode", "fp8")
        kv_dtype = torch.float8_e4m3fn if kind == "fp8" else None
        label = f"{kind} {bs}x{n // 1024}k"
        print(f"== {label}", flush=True)
        try:
            x = make_mha(bs, n, q_len=1 if decode else n, kv_dtype=kv_dtype,
                         dense=kind != "fp8")
        except torch.OutOfMemoryError as exc:
            results.append({"case": label, "error": f"OOM building inputs: {exc}"[:200]})
            continue
        rows_b = min(bs, 4)
        expected, select = reference_mha(x, rows_b, last_q=1 if decode else 128)
        case = {"case": label, "kind": kind, "bs": bs, "ctx": n, "bytes": x.bytes_moved,
                "flops": x.flops, "impls": []}
        impls = ["ours"] + (["ours-dense"] if kind == "prefill" else []) \
            + ([] if kind == "fp8" else list(args.anchors))
        if kind == "prefill" and "flex" in impls and not args.flex_prefill:
            impls.remove("flex")  # PERFORMANCE.md's prefill anchors: cuDNN, FA2, aiter
        if kind == "fp8":
            impls += ["aiter"] if "aiter" in args.anchors else []
        for name in impls:
            rec = bench_impl(name, RUNNERS[name], x, expected, select,
                             RTOL_FP8 if kind == "fp8" else RTOL_BF16, args.rep, args.graphs)
            add_rates(rec, x.bytes_moved, x.flops)
            case["impls"].append(rec)
            print("   ", summarize(rec, decode), flush=True)
        if kind == "fp8":  # the bf16 twin of this row, ours only, for the tokens/s ratio
            xb = make_mha(bs, n, q_len=1, dense=False)
            eb, sb = reference_mha(xb, rows_b, 1)
            rec = bench_impl("ours-bf16", RUNNERS["ours"], xb, eb, sb, RTOL_BF16, args.rep,
                             args.graphs)
            add_rates(rec, xb.bytes_moved, xb.flops)
            case["impls"].append(rec)
            print("   ", summarize(rec, decode), flush=True)
            del xb
        results.append(case)
        del x
        torch.cuda.empty_cache()
        dump(results, args)


def run_mla_rows(rows, args, results):
    swept = set()  # sweep every 16-head row, the first row of larger head counts
    for heads, bs, ctx in rows:
        for kv in args.mla_kv.split(","):
            label = f"mla H{heads} {bs}x{ctx // 1024}k {kv}"
            if out_of_time(args, label):
                continue
            print(f"== {label}", flush=True)
            x = make_mla(bs, ctx, heads=heads,
                         kv_dtype=torch.float8_e4m3fn if kv == "fp8" else None)
            rows_b = min(bs, 4)
            expected = reference_mla(x, rows_b)
            case = {"case": label, "kind": "mla", "heads": heads, "bs": bs, "ctx": ctx,
                    "bytes": x.bytes_moved, "flops": x.flops, "impls": []}
            rec = bench_impl("ours", lambda inp: make_ours_mla(inp), x, expected,
                             lambda o: o[:rows_b], RTOL_FP8 if kv == "fp8" else RTOL_BF16,
                             args.rep, args.graphs)
            add_rates(rec, x.bytes_moved, x.flops)
            case["impls"].append(rec)
            print("   ", summarize(rec, True), flush=True)
            if kv == "fp8" and heads <= 16:  # the value-pairs option (fp8 latents)
                rec = bench_impl("ours-v-pairs",
                                 lambda inp: make_ours_mla(inp, v_pairs=True), x, expected,
                                 lambda o: o[:rows_b], RTOL_FP8, args.rep, args.graphs)
                add_rates(rec, x.bytes_moved, x.flops)
                case["impls"].append(rec)
                print("   ", summarize(rec, True), flush=True)
            if heads >= 64 and kv == "bf16":  # the default is the Gluon kernel: the Triton one
                rec = bench_impl("ours-triton", lambda inp: make_ours_mla(inp, gluon=False),
                                 x, expected, lambda o: o[:rows_b], RTOL_BF16, args.rep,
                                 args.graphs)
                add_rates(rec, x.bytes_moved, x.flops)
                case["impls"].append(rec)
                print("   ", summarize(rec, True), flush=True)
            for name in (v for v in args.mla_variants.split(",") if v):
                if kv != "bf16" or heads > 16:
                    continue
                lk = MLA_VARIANTS[name]
                runner = make_ours_mla_planned if "balanced_rates" in lk else make_ours_mla
                r = bench_impl(f"ours-{name}",
                               lambda inp, lk=lk, run=runner: run(inp, **_resolve(lk, inp)),
                               x, expected, lambda o: o[:rows_b], RTOL_BF16, args.rep,
                               args.graphs)
                add_rates(r, x.bytes_moved, x.flops)
                case["impls"].append(r)
                print("   ", summarize(r, True), flush=True)
            key = (heads, bs, ctx) if heads <= 16 else heads
            if args.mla_sweep and kv == "bf16" and key not in swept:
                swept.add(key)
                for bh, bn, nw, ns, sp, *pc in mla_configs(args.mla_configs):
                    if bh > max(16, heads):
                        continue
                    if sp == "x2":  # twice the heuristic's split count
                        from aiter_attn.kernels.triton.mla import mla_launch_config

                        sp = 2 * mla_launch_config(heads, bs, ctx, x.q.device, block_h=bh,
                                                   block_n=bn)[2]
                    launch = dict(block_h=bh, block_n=bn, num_warps=nw, num_stages=ns,
                                  num_kv_splits=sp)
                    if pc:
                        launch["page_chunk"] = pc[0]
                    # replayed like the default row (eager, these direct calls are bound by
                    # Triton's launch on the host: 0.10-0.32 ms against 0.088 replayed)
                    r = bench_impl(f"ours{bh}/{bn}/{nw}/{ns}/{sp or 'auto'}"
                                   + (f"/pc{pc[0]}" if pc else ""),
                                   lambda inp, lk=launch: make_ours_mla(inp, **lk), x, expected,
                                   lambda o: o[:rows_b], RTOL_BF16, args.rep // 2, args.graphs)
                    add_rates(r, x.bytes_moved, x.flops)
                    case["impls"].append(r)
                    print("   ", summarize(r, True), flush=True)
            results.append(case)
            del x
            torch.cuda.empty_cache()
            dump(results, args)


def measure_ceilings(results_meta):
    """Device-to-device copy bandwidth and a bf16 matmul, in this run."""
    import triton.testing as tt

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = tt.do_bench(lambda: b.copy_(a), rep=100, return_mode="median")
    results_meta["copy_tbps"] = 2 * a.numel() / (ms * 1e-3) / 1e12
    del a, b
    m = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = tt.do_bench(lambda: m @ m, rep=100, return_mode="median")
    results_meta["matmul_tflops"] = 2 * 8192 ** 3 / (ms * 1e-3) / 1e12
    del m
    torch.cuda.empty_cache()


def summarize(rec, memory_bound):
    name = rec["impl"]
    if "missing" in rec:
        return f"{name:>18}: missing ({rec['missing'][:110]})"
    if "wrong" in rec:
        return f"{name:>18}: WRONG ({rec['wrong']})"
    unit, key = ("TB/s", "tbps") if memory_bound else ("TFLOP/s", "tflops")
    parts = [f"{name:>18}: err {rec['rel_err']:.1e}"]
    for mode in ("eager", "graph"):
        if rec.get(f"{mode}_ms"):
            parts.append(f"{mode} {rec[f'{mode}_ms']:.4f} ms = {rec[f'{mode}_{key}']:.2f} {unit}")
    return "  ".join(parts)


def dump(results, args):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump({"meta": args.meta, "cases": results}, f, indent=1)


def _val(case, impl, key, mode):
    for r in case["impls"]:
        if r["impl"] == impl:
            return r.get(f"{mode}_{key}")
    return None


def table(results, mode="graph") -> str:
    """Markdown table: value per implementation (``mode`` timings) and our ratios."""
    lines = ["| row | unit | ours | cuDNN | FA2 | flex | aiter | ours/cuDNN | ours/aiter |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in results:
        if "impls" not in c:
            lines.append(f"| {c['case']} | error: {c.get('error', '?')[:60]} |||||||| ")
            continue
        mem = c["kind"] in ("decode", "fp8") or (c["kind"] == "mla" and c.get("heads", 0) <= 16)
        key, unit = ("tbps", "TB/s") if mem else ("tflops", "TFLOP/s")
        vals = {n: _val(c, n, key, mode) for n in ("ours", "cudnn", "fa2", "flex", "aiter")}

        def f(v):
            return "—" if v is None else f"{v:.2f}" if v < 100 else f"{v:.0f}"

        def ratio(a, b):
            return "—" if not a or not b else f"{a / b:.2f}×"

        extra = ""
        if c["kind"] == "fp8":
            o8, ob = _val(c, "ours", "ms", mode), _val(c, "ours-bf16", "ms", mode)
            extra = f" (fp8/bf16 tokens/s {ob / o8:.2f}×)" if o8 and ob else ""
        if c["kind"] == "mla":
            fl = _val(c, "ours", "tflops", mode)
            tb = _val(c, "ours", "tbps", mode)
            extra = f" ({f(tb)} TB/s, {f(fl)} TFLOP/s)" if fl and tb else ""
        lines.append(f"| {c['case']}{extra} | {unit} | {f(vals['ours'])} | {f(vals['cudnn'])} | "
                     f"{f(vals['fa2'])} | {f(vals['flex'])} | {f(vals['aiter'])} | "
                     f"{ratio(vals['ours'], vals['cudnn'])} | {ratio(vals['ours'], vals['aiter'])} |")
        tri = _val(c, "ours-triton", key, mode)
        if tri:  # MLA at many heads: the Triton kernel beside the default (Gluon)
            lines.append(f"| {c['case']} (ours-triton) | {unit} | {f(tri)} | — | — | — | — | — | — |")
        dense = _val(c, "ours-dense", key, mode)
        if dense:  # the engine's extend path (new K/V contiguous: the dense kernel)
            lines.append(f"| {c['case']} (ours-dense) | {unit} | {f(dense)} | "
                         f"{f(vals['cudnn'])} | {f(vals['fa2'])} | {f(vals['flex'])} | "
                         f"{f(vals['aiter'])} | {ratio(dense, vals['cudnn'])} | "
                         f"{ratio(dense, vals['aiter'])} |")
    return "\n".join(lines)


def _write_host(rows, out_dir, meta) -> None:
    with open(os.path.join(out_dir, "bench_host.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_host.md"), "w") as f:
        f.write(host_table(rows) + "\n")
    print(host_table(rows), flush=True)


def _write_mixed(rows, out_dir, meta) -> None:
    with open(os.path.join(out_dir, "bench_mixed.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_mixed.md"), "w") as f:
        f.write(mixed_table(rows) + "\n")
    print(mixed_table(rows), flush=True)


def _write_cascade(rows, out_dir, meta) -> None:
    with open(os.path.join(out_dir, "bench_cascade.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    with open(os.path.join(out_dir, "bench_cascade.md"), "w") as f:
        f.write(cascade_table(rows) + "\n")
    print(cascade_table(rows), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--only", default="decode,prefill,mla,fp8,host",
                   help="comma list of row groups: decode, prefill, mla, fp8, host, mixed, "
                        "cascade")
    p.add_argument("--anchors", default=",".join(ANCHORS))
    p.add_argument("--aiter-wheel", default=None)
    p.add_argument("--rep", type=int, default=60, help="ms of timed repetitions per measurement")
    p.add_argument("--no-graphs", dest="graphs", action="store_false")
    p.add_argument("--quick", action="store_true", help="a subset of rows")
    p.add_argument("--mla-sweep", action="store_true", help="also time MLA launch configs")
    p.add_argument("--mla-rows", default="",
                   help="MLA rows instead of MLA_ROWS: comma list of HEADSxBSxCTX "
                        "(e.g. 16x64x4096)")
    p.add_argument("--mla-kv", default="bf16,fp8", help="MLA cache dtypes: bf16, fp8 or both")
    p.add_argument("--mla-configs", default="",
                   help="with --mla-sweep: these configs instead of MLA_SWEEP, comma list of "
                        "block_h/block_n/warps/stages/splits[/page_chunk] (splits: a number, "
                        "auto or x2), e.g. 16/16/4/4/6,16/32/4/3/4/16")
    p.add_argument("--mla-variants", default="",
                   help=f"comma list of MLA launch options to time on the bf16 rows of up to "
                        f"16 heads, replayed: {', '.join(MLA_VARIANTS)}")
    p.add_argument("--budget-s", type=float, default=0,
                   help="skip the remaining rows after this many seconds (0 = no limit)")
    p.add_argument("--cascade-sweep", nargs="?", type=int, const=-1, default=0, metavar="N",
                   help="also time launch variants of the cascade (_cascade.SWEEP; the first N "
                        "of them with a number)")
    p.add_argument("--flex-prefill", action="store_true", help="flex_attention on prefill too")
    p.add_argument("--overrides", default="{}",
                   help="JSON launch overrides of our paged kernel for the whole run "
                        "(aiter_attn.kernels.triton._launch_config.TUNING_OVERRIDES keys, e.g. "
                        "'{\"v_pairs\": false}')")
    p.add_argument("--host-calls", type=int, default=2000,
                   help="calls per timed round of the host rows (≥ 2,000 for the record)")
    p.add_argument("--host-batches", default="8,32", help="engine batch sizes of the host rows")
    p.add_argument("--smoke", action="store_true",
                   help="the host group only, tiny shapes on the CPU (proves the harness runs)")
    args = p.parse_args(argv)
    overrides = json.loads(args.overrides)
    if overrides:  # checked before anything else happens
        from aiter_attn.kernels.triton._launch_config import TUNING_OVERRIDES, check_overrides

        TUNING_OVERRIDES.update(check_overrides(overrides, "--overrides"))
    os.makedirs(args.out, exist_ok=True)
    if args.smoke and "cascade" in args.only.split(","):
        rows = run_cascade(smoke=True) + run_cascade_engine(smoke=True)
        _write_cascade(rows, args.out, {"smoke": True})
        return rows
    if args.smoke and "mixed" in args.only.split(","):
        rows = run_mixed(smoke=True)
        _write_mixed(rows, args.out, {"smoke": True})
        return rows
    if args.smoke:
        rows = run_host(smoke=True, n=args.host_calls)
        _write_host(rows, args.out, {"smoke": True})
        return rows
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU.")
    from aiter_shim import find_wheel

    args.anchors = tuple(a for a in args.anchors.split(",") if a)
    wheel = find_wheel(args.aiter_wheel)
    configure_aiter(wheel)
    groups = set(args.only.split(","))
    import triton

    args.meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "aiter_wheel": os.path.basename(wheel or "") or None,
                 "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                 "command": " ".join(["python", "benchmarks/bench_attention.py"] + sys.argv[1:])}
    measure_ceilings(args.meta)
    print(f"ceilings: copy {args.meta['copy_tbps']:.2f} TB/s, bf16 matmul "
          f"{args.meta['matmul_tflops']:.0f} TFLOP/s", flush=True)
    results: list = []
    args.t0 = time.monotonic()
    quick = args.quick
    host_rows = []
    try:
        if "host" in groups:  # first: the host rows want a quiet, freshly started process
            host_rows = run_host(n=args.host_calls,
                                 batches=tuple(int(b) for b in args.host_batches.split(",")),
                                 kernel_backend="triton")
            _write_host(host_rows, args.out, args.meta)
    except Exception:
        traceback.print_exc()
    try:
        if "mixed" in groups:
            _write_mixed(run_mixed(), args.out, args.meta)
    except Exception:
        traceback.print_exc()
    try:
        if "cascade" in groups:
            rows = run_cascade(rep=args.rep, graphs=args.graphs, sweep=args.cascade_sweep)
            _write_cascade(rows, args.out, args.meta)
            try:  # the engine end to end on the same workload
                rows += run_cascade_engine(graphs=args.graphs)
            except Exception:
                traceback.print_exc()
            _write_cascade(rows, args.out, args.meta)
    except Exception:
        traceback.print_exc()
    try:
        if "decode" in groups:
            run_mha_rows("decode", DECODE_ROWS[1:4] if quick else DECODE_ROWS, args, results)
        if "prefill" in groups:
            run_mha_rows("prefill", PREFILL_ROWS[:2] if quick else PREFILL_ROWS, args, results)
        if "mla" in groups:
            mla_rows = MLA_ROWS[::2] if quick else MLA_ROWS
            if args.mla_rows:
                mla_rows = [tuple(int(v) for v in r.split("x")) for r in args.mla_rows.split(",")]
            run_mla_rows(mla_rows, args, results)
        if "fp8" in groups:
            run_mha_rows("fp8", FP8_ROWS[:1] if quick else FP8_ROWS, args, results)
    except Exception:
        traceback.print_exc()
    dump(results, args)
    try:
        from roofline import plot

        plot(results, args.meta, os.path.join(args.out, "roofline.png"))
    except Exception as exc:
        print(f"roofline plot failed: {exc!r}")
    report = "\n".join([
        f"Device: {args.meta['device']}; torch {args.meta['torch']}, triton {args.meta['triton']}; "
        f"ceilings measured in this run: copy {args.meta['copy_tbps']:.2f} TB/s, bf16 matmul "
        f"{args.meta['matmul_tflops']:.0f} TFLOP/s; started {args.meta['started']}.",
        "", "CUDA-graph replay (median):", "", table(results, "graph"),
        "", "Eager (median, L2 flushed):", "", table(results, "eager"), "",
        "Host cost (eager, median of rounds):", "", host_table(host_rows), ""])
    with open(os.path.join(args.out, "bench_attention.md"), "w") as f:
        f.write(report)
    print()
    print(report)


if __name__ == "__main__":
    main()
