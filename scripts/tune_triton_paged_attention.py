"""Tune and time the Triton paged_attention kernel against cuDNN SDPA on dense KV (one GPU run).

Usage (on a CUDA machine)::

    PYTHONPATH=. python scripts/tune_triton_paged_attention.py [--sweep] [--out DIR]

Shapes: GQA 32/8, head dim 128, bf16, page 16 (decode rows and causal prefill rows of
docs PERFORMANCE.md). Decode reports TB/s of K+V read; prefill TFLOP/s = 4·S²·Hq·D/2 per
sequence. ``--sweep`` also tries launch configurations (TUNING_OVERRIDES) and prints all.
Every timed configuration is checked against the float32 reference first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

from aiter_attn.kernels.reference import paged_attention_reference
from aiter_attn.kernels.triton import paged_attention as pa

HQ, HKV, D, PAGE = 32, 8, 128, 16
DECODE_ROWS = [(1, 4096), (16, 4096), (64, 4096), (256, 4096), (64, 16384), (8, 65536),
               (1, 32768)]
PREFILL_ROWS = [(1, 2048), (1, 8192), (1, 16384), (8, 2048)]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_graph(fn):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench(g.replay)


def paged_inputs(bs, ctx, q_len, dtype=torch.bfloat16, kv_dtype=None, seed=0):
    """Paged K/V (block-permuted, null page 0) and the same K/V dense for SDPA."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    n_pages = ctx // PAGE
    total = bs * n_pages + 1
    perm = torch.randperm(total - 1, device="cuda", generator=g) + 1
    bt = perm.view(bs, n_pages).int()
    k_cache = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(total, PAGE, HKV, D, device="cuda", dtype=dtype, generator=g)
    if kv_dtype != dtype:
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    q = torch.randn(bs * q_len, HQ, D, device="cuda", dtype=dtype, generator=g)
    cu = torch.arange(0, bs + 1, device="cuda", dtype=torch.int32) * q_len
    seq = torch.full((bs,), ctx, device="cuda", dtype=torch.int32)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, bt=bt, cu=cu, seq=seq, q_len=q_len,
                ctx=ctx, bs=bs)


def dense_kv(inp):
    bs, ctx = inp["bs"], inp["ctx"]
    k = inp["k_cache"][inp["bt"].long()].reshape(bs, ctx, HKV, D).transpose(1, 2).contiguous()
    v = inp["v_cache"][inp["bt"].long()].reshape(bs, ctx, HKV, D).transpose(1, 2).contiguous()
    return k, v


def ours_fn(inp, out, **kw):
    q, kc, vc = inp["q"], inp["k_cache"], inp["v_cache"]

    def fn():
        pa.paged_attention_triton(
            q, kc, vc, out, cu_seqlens_q=inp["cu"], seqused_k=inp["seq"], block_table=inp["bt"],
            softmax_scale=D ** -0.5, causal=True, max_seqlen_q=inp["q_len"],
            max_seqlen_k=inp["ctx"], **kw)
    return fn


def check(inp, out, **kw):
    """Relative error of our output against the float32 reference (on a subset of requests)."""
    nb = min(inp["bs"], 4)
    nt = nb * inp["q_len"]
    ref = torch.empty(nt, HQ, D, dtype=out.dtype, device="cuda")
    paged_attention_reference(
        inp["q"][:nt], inp["k_cache"], inp["v_cache"], ref, cu_seqlens_q=inp["cu"][: nb + 1],
        seqused_k=inp["seq"][:nb], block_table=inp["bt"][:nb], softmax_scale=D ** -0.5, **kw)
    return float((out[:nt].float() - ref.float()).norm() / ref.float().norm())


def sdpa_fn(q4, k, v, causal, backend):
    """SDPA with native GQA; if this backend refuses GQA, with K/V expanded per query head
    (then the anchor reads 4x the bytes we count: its entry says so)."""
    def fn():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)
    try:
        fn()
        return fn
    except RuntimeError:
        ke, ve = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)

        def fn_expanded():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, ke, ve, is_causal=causal)
        fn_expanded.expanded = True
        return fn_expanded


def with_overrides(ov, f):
    pa.TUNING_OVERRIDES.clear()
    pa.TUNING_OVERRIDES.update(ov)
    try:
        return f()
    finally:
        pa.TUNING_OVERRIDES.clear()


def sweep(row, configs, measure):
    """Append ``measure(ov)`` under each override set ``ov`` of ``configs`` to
    ``row["configs"]`` (a failing config is recorded with its error, the sweep goes on)."""
    for ov in configs:
        try:
            row["configs"].append(with_overrides(ov, lambda: measure(ov)))
        except Exception as exc:
            row["configs"].append(dict(ov=ov, error=repr(exc)[:300]))
        print("  ", row["kind"], row["bs"], row.get("ctx", row.get("s")), row["configs"][-1],
              flush=True)


def run_decode(rows, configs, graphs=True, kv_dtype=None):
    results = []
    for bs, ctx in rows:
        inp = paged_inputs(bs, ctx, 1, kv_dtype=kv_dtype)
        kv_bytes = bs * ctx * HKV * D * 2 * inp["k_cache"].element_size()
        row = dict(kind="decode", bs=bs, ctx=ctx, kv=str(inp["k_cache"].dtype), configs=[])
        if kv_dtype is None:
            k, v = dense_kv(inp)
            q4 = inp["q"].view(bs, 1, HQ, D).transpose(1, 2)
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                             ("fa2", SDPBackend.FLASH_ATTENTION)):
                try:
                    f = sdpa_fn(q4, k, v, False, be)
                    ms = bench(f)
                    row[name] = dict(ms=ms, tbps=kv_bytes / ms / 1e9,
                                     expanded=getattr(f, "expanded", False))
                    if graphs:
                        gms = bench_graph(f)
                        row[name].update(graph_ms=gms, graph_tbps=kv_bytes / gms / 1e9)
                except Exception as exc:  # an anchor that cannot run on this shape
                    row[name] = dict(error=repr(exc)[:200])
            del k, v
        out = torch.empty_like(inp["q"])
        scales = {}
        if kv_dtype is not None:
            one = torch.ones(1, device="cuda")
            scales = dict(k_scale=one, v_scale=one)
        def measure(ov):
            fn = ours_fn(inp, out, **scales)
            fn()
            err = check(inp, out, **scales)
            ms = bench(fn)
            gms = bench_graph(fn) if graphs else None
            return dict(ov=ov, err=err, ms=ms, tbps=kv_bytes / ms / 1e9,
                        graph_ms=gms, graph_tbps=kv_bytes / gms / 1e9 if gms else None)
        sweep(row, configs, measure)
        results.append(row)
        del inp
        torch.cuda.empty_cache()
    return results


def run_prefill(rows, configs):
    results = []
    for bs, s in rows:
        inp = paged_inputs(bs, s, s)
        flops = bs * 4 * s * s * HQ * D / 2
        row = dict(kind="prefill", bs=bs, s=s, configs=[])
        k, v = dense_kv(inp)
        q4 = inp["q"].view(bs, s, HQ, D).transpose(1, 2)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                         ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                f = sdpa_fn(q4, k, v, True, be)
                ms = bench(f)
                row[name] = dict(ms=ms, tflops=flops / ms / 1e9,
                                 expanded=getattr(f, "expanded", False))
            except Exception as exc:
                row[name] = dict(error=repr(exc)[:200])
        del k, v
        out = torch.empty_like(inp["q"])
        def measure(ov):
            fn = ours_fn(inp, out)
            fn()
            err = check(inp, out) if s <= 8192 else None
            ms = bench(fn)
            return dict(ov=ov, err=err, ms=ms, tflops=flops / ms / 1e9)
        sweep(row, configs, measure)
        results.append(row)
        del inp
        torch.cuda.empty_cache()
    return results


DECODE_SWEEP = [{}] + [
    dict(block_n=bn, num_warps=w, num_stages=st, min_split_tokens=mst)
    for bn, w, st, mst in [
        (64, 4, 2, 256), (64, 4, 4, 256), (128, 4, 3, 256), (128, 8, 3, 256), (32, 4, 4, 256),
        (64, 4, 3, 128), (64, 4, 3, 512),
    ]
]
PREFILL_SWEEP = [{}] + [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    for bm, bn, w, st in [
        (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
        (64, 128, 4, 3), (128, 64, 4, 3),
    ]
]


# --explore: the chunked block-table lookup (page_chunk, default 16) against the per-tile
# lookup (page_chunk=0), and the launch shapes it makes worth trying
EXPLORE_PREFILL = [dict(page_chunk=0), {}] + [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st, **extra)
    for bm, bn, w, st, extra in [
        (128, 128, 8, 3, {}), (128, 64, 8, 3, {}), (128, 64, 4, 3, {}), (128, 64, 8, 4, {}),
        (128, 128, 8, 3, dict(heads=1)), (128, 128, 8, 3, dict(page_chunk=64)),
        (128, 128, 8, 3, dict(warp_spec=True)),
    ]
]
EXPLORE_DECODE = [dict(page_chunk=0), {}, dict(num_stages=4), dict(block_n=64, num_stages=4),
                  dict(min_split_tokens=128)]
EXPLORE_FP8 = [dict(page_chunk=0), {}, dict(block_n=256, num_stages=3),
               dict(block_n=256, num_warps=8, num_stages=3), dict(block_n=256, num_stages=2),
               dict(num_stages=4)]
EXPLORE_MLA = [dict(page_chunk=0), {}, dict(block_n=32, num_warps=8, num_stages=3),
               dict(block_n=64, num_warps=8, num_stages=2), dict(block_n=64, num_warps=4,
                                                                   num_stages=4),
               dict(block_h=32, block_n=32, num_warps=8, num_stages=3)]


def run_mla(rows, configs):
    """MLA decode (kv_lora 512 + rope 64, page 64), graph-replayed, per launch override."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from _inputs import make_mla
    from aiter_attn.kernels.reference import mla_paged_attention_reference
    from aiter_attn.kernels.triton.mla import mla_paged_attention

    results = []
    for heads, bs, ctx, kv in rows:
        x = make_mla(bs, ctx, heads=heads, kv_dtype=torch.float8_e4m3fn if kv == "fp8" else None)
        row = dict(kind="mla", heads=heads, bs=bs, ctx=ctx, kv=kv, bytes=x.bytes_moved,
                   flops=x.flops, configs=[])
        kw = dict(kv_lora_rank=x.rank, cu_seqlens_q=x.cu_seqlens_q, seqused_k=x.seqused_k,
                  block_table=x.block_table, softmax_scale=x.scale, causal=True,
                  kv_scale=x.kv_scale, max_seqlen_q=1, max_seqlen_k=ctx)
        nb = min(bs, 2)
        ref = torch.empty(nb, heads, x.rank, dtype=x.q.dtype, device="cuda")
        mla_paged_attention_reference(
            x.q[:nb], x.kv_cache, ref, **dict(kw, cu_seqlens_q=x.cu_seqlens_q[:nb + 1],
                                               seqused_k=x.seqused_k[:nb],
                                               block_table=x.block_table[:nb]))
        out = torch.empty(bs, heads, x.rank, dtype=x.q.dtype, device="cuda")
        for ov in configs:
            try:
                def fn(ov=ov):
                    mla_paged_attention(x.q, x.kv_cache, out, **kw, **ov)
                fn()
                err = float((out[:nb].float() - ref.float()).norm() / ref.float().norm())
                gms = bench_graph(fn)
                row["configs"].append(dict(ov=ov, err=err, graph_ms=gms,
                                           graph_tbps=x.bytes_moved / gms / 1e9,
                                           tflops=x.flops / gms / 1e9))
            except Exception as exc:
                row["configs"].append(dict(ov=ov, error=repr(exc)[:300]))
            print("  mla", heads, bs, ctx, kv, row["configs"][-1], flush=True)
        results.append(row)
        del x
        torch.cuda.empty_cache()
    return results


def explore(out_dir):
    """One GPU call: old vs chunked page lookup and launch shapes, every config graph-timed
    for decode/MLA (eager, L2-flushed, for prefill). Prints one line per config."""
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__)
    res["prefill"] = run_prefill([(1, 8192), (8, 2048)], EXPLORE_PREFILL)
    res["decode"] = run_decode([(16, 4096), (64, 4096), (256, 4096), (8, 65536), (1, 32768)],
                               EXPLORE_DECODE)
    res["fp8_decode"] = run_decode([(64, 16384), (8, 65536), (1, 32768)], EXPLORE_FP8,
                                   kv_dtype=torch.float8_e4m3fn)
    res["mla"] = run_mla([(16, 64, 4096, "bf16"), (16, 128, 8192, "bf16"),
                          (128, 64, 4096, "bf16"), (16, 64, 4096, "fp8")], EXPLORE_MLA)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "explore.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    for group in ("prefill", "decode", "fp8_decode", "mla"):
        for r in res[group]:
            name = f"{r['kind']} {r.get('heads', '')} {r['bs']}x{r.get('ctx', r.get('s'))} " \
                   f"{r.get('kv', '')}"
            ref = {k: r[k][("tflops" if group == "prefill" else "graph_tbps"
                             if "graph_tbps" in r[k] else "tbps")]
                   for k in ("cudnn",) if k in r and "error" not in r[k]}
            for c in r["configs"]:
                if "error" in c:
                    print(f"{name:28s} {str(c['ov']):70s} ERROR {c['error'][:150]}")
                    continue
                vals = " ".join(f"{k}={c[k]:.3f}" for k in ("tflops", "tbps", "graph_tbps")
                                if c.get(k) is not None)
                print(f"{name:28s} {str(c['ov']):70s} {vals} err={c.get('err') or 0:.1e} "
                      f"cudnn={ref}")
    return 0


SPLITS = [{}] + [dict(num_splits=n) for n in (1, 2, 4, 6, 8, 16)]


def explore_splits(out_dir):
    """Split-count (wave quantisation) sweep for decode, fp8 launch shapes, MLA splits and the
    fp16-dot fp8 MLA path; every config graph-replayed."""
    res = dict(device=torch.cuda.get_device_name())
    res["decode"] = run_decode([(1, 4096), (16, 4096), (8, 65536), (1, 32768)], SPLITS)
    res["fp8_decode"] = run_decode(
        [(8, 65536), (64, 16384)],
        [{}, dict(num_splits=8), dict(num_splits=16), dict(num_splits=32), dict(num_warps=8),
         dict(block_n=64, num_stages=4)], kv_dtype=torch.float8_e4m3fn)
    res["mla"] = run_mla([(16, 64, 4096, "bf16")],
                         [{}] + [dict(num_kv_splits=n) for n in (2, 4, 6, 8)])
    res["mla"] += run_mla([(16, 64, 4096, "fp8"), (128, 64, 4096, "fp8"),
                           (128, 64, 4096, "bf16")], [{}])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "explore_splits.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    return 0


def best(cfgs, key):
    ok = [c for c in cfgs if "error" not in c]
    return max(ok, key=lambda c: c[key]) if ok else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--explore", action="store_true",
                    help="page-lookup and launch-shape exploration (see EXPLORE_*)")
    ap.add_argument("--explore-splits", action="store_true",
                    help="split-count / fp8 / MLA follow-up exploration")
    args = ap.parse_args()
    if args.explore:
        return explore(args.out)
    if args.explore_splits:
        return explore_splits(args.out)
    torch.manual_seed(0)
    dec_cfgs = DECODE_SWEEP if args.sweep else [{}]
    pre_cfgs = PREFILL_SWEEP if args.sweep else [{}]
    dec = run_decode(DECODE_ROWS, dec_cfgs)
    pre = run_prefill(PREFILL_ROWS if not args.sweep else [(1, 8192), (8, 2048)], pre_cfgs)
    if args.sweep:
        pre += run_prefill([(1, 2048), (1, 16384)], [{}])
    fp8 = [] if args.no_fp8 else run_decode([(64, 16384), (8, 65536), (1, 32768)], [{}],
                                            kv_dtype=torch.float8_e4m3fn)
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, decode=dec, prefill=pre, fp8_decode=fp8)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "triton_paged_attention.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)

    print("\n== sweep (all configs) ==")
    for r in dec + pre + fp8:
        name = f"{r['kind']} {r['bs']}x{r.get('ctx', r.get('s'))} {r.get('kv', '')}"
        for c in r["configs"]:
            if "error" in c:
                print(f"{name:34s} {c['ov']} ERROR {c['error'][:120]}")
                continue
            val = c.get("tbps") or c.get("tflops")
            g = f" graph {c['graph_tbps']:.2f}" if c.get("graph_tbps") else ""
            err = f"{c['err']:.1e}" if c.get("err") is not None else "-"
            print(f"{name:34s} {str(c['ov']):75s} {val:8.2f}{g} err {err}")
    print("\n== summary: default config (best of sweep) vs SDPA on dense KV ==")
    print(f"{'row':26s} {'cudnn':>8s} {'fa2':>8s} {'ours':>8s} {'graph':>8s} {'best':>8s} "
          f"{'ours/cudnn':>10s} {'best/cudnn':>10s}")
    for r in dec + pre:
        key = "tbps" if r["kind"] == "decode" else "tflops"
        name = f"{r['kind']} {r['bs']}x{r.get('ctx', r.get('s'))}"
        cd = r.get("cudnn", {}).get(key, float("nan"))
        fa = r.get("fa2", {}).get(key, float("nan"))
        d0 = r["configs"][0].get(key, float("nan"))
        gr = r["configs"][0].get("graph_tbps") or float("nan")
        b = best(r["configs"], key)
        bv = b[key] if b else float("nan")
        print(f"{name:26s} {cd:8.2f} {fa:8.2f} {d0:8.2f} {gr:8.2f} {bv:8.2f} {d0 / cd:10.2f} "
              f"{bv / cd:10.2f}  best={b['ov'] if b else None}")
    for r in fp8:
        bf = next((x for x in dec if (x["bs"], x["ctx"]) == (r["bs"], r["ctx"])), None)
        c = r["configs"][0]
        if "error" in c or bf is None:
            print(f"fp8 {r['bs']}x{r['ctx']}: {c.get('error', 'no bf16 row')}")
            continue
        speed = bf["configs"][0]["ms"] / c["ms"]
        print(f"fp8 decode {r['bs']}x{r['ctx']}: {c['ms'] * 1e3:.1f} us, {c['tbps']:.2f} TB/s "
              f"(fp8 bytes), {speed:.2f}x bf16 tokens/s, err {c['err']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
