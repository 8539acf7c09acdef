"""Decode cost of the KV-cache formats (docs/modes.md "KV-cache formats"): the Triton paged
attention over a bf16 cache, fp8 e4m3 / e5m2 with one scale per layer, and fp8 e4m3 / e5m2
with per-(token, head) scales; plus the quantising KV write of one prefill chunk per format.
GQA 32/8, head dim 128, page 16, bf16 queries; decode timed as CUDA-graph replays
(``triton.testing.do_bench_cudagraph`` median), the write likewise.

Every row is checked first against the float32 reference kernel over the same cache (relative
error below bf16's bound). Rates: GB/s of cache bytes read (K + V, plus the scale buffers for
per-token rows), and µs per call.

Usage (GPU machine)::

    python benchmarks/bench_kv_formats.py --out "$OUT"

``--smoke`` runs tiny shapes on the CPU (Triton interpreter: ``TRITON_INTERPRET=1``) to check
the harness. Writes ``bench_kv_formats.json`` and ``bench_kv_formats.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = [(1, 4096), (16, 4096), (64, 4096), (8, 32768)]
SMOKE_ROWS = [(2, 40)]
FORMATS = [
    ("bf16 (fp16 in --smoke)", "act", "per_layer"),
    ("fp8 e4m3", "float8_e4m3fn", "per_layer"),
    ("fp8 e5m2", "float8_e5m2", "per_layer"),
    ("fp8 e4m3 per-token", "float8_e4m3fn", "per_token_head"),
    ("fp8 e5m2 per-token", "float8_e5m2", "per_token_head"),
]
RTOL_BF16 = 1.2e-2


def make_case(bs, ctx, kv_name, granularity, device, *, act=torch.bfloat16, hq=32, hkv=8, d=128,
              page=16, seed=0):
    """A block-permuted decode batch (``bs`` requests of ``ctx`` keys) in the given format
    (``kv_name`` "act": the activation dtype ``act``)."""
    from aiter_attn.kernels.reference import quantize_per_token_head, quantize_to_cache

    g = torch.Generator().manual_seed(seed)
    kv_dtype = act if kv_name == "act" else getattr(torch, kv_name)
    n_pages = -(-ctx // page)
    total = bs * n_pages + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).view(bs, n_pages).to(torch.int32)
    slots = (perm.long().view(-1, 1) * page + torch.arange(page)).view(-1)
    keep = (torch.arange(n_pages * page) < ctx).repeat(bs)
    slots = slots[keep]
    k = torch.randn(slots.numel(), hkv, d, generator=g)
    v = torch.randn(slots.numel(), hkv, d, generator=g)
    case = {"block_table": perm, "q": torch.randn(bs, hq, d, generator=g).to(act),
            "cu_seqlens_q": torch.arange(bs + 1, dtype=torch.int32),
            "seqused_k": torch.full((bs,), ctx, dtype=torch.int32), "softmax_scale": d ** -0.5}
    shape = (total, page, hkv, d)
    kc = torch.zeros(shape, dtype=kv_dtype)
    vc = torch.zeros(shape, dtype=kv_dtype)
    if granularity == "per_token_head":
        ksc = torch.zeros(shape[:3])
        vsc = torch.zeros(shape[:3])
        (kq, ks), (vq, vs) = (quantize_per_token_head(k, kv_dtype),
                              quantize_per_token_head(v, kv_dtype))
        ksc.view(-1, hkv)[slots], vsc.view(-1, hkv)[slots] = ks, vs
        case.update(k_scale_cache=ksc, v_scale_cache=vsc)
    else:
        scale = 0.05 if kv_dtype.itemsize == 1 else None
        kq = quantize_to_cache(k, kv_dtype, scale or 1.0)
        vq = quantize_to_cache(v, kv_dtype, scale or 1.0)
        if scale is not None:
            case.update(k_scale=scale, v_scale=scale)
    kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots] = kq, vq
    case.update(k_cache=kc, v_cache=vc)
    case = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in case.items()}
    n_new = min(page * 64, total * page)  # one prefill chunk of 1024 tokens (fewer in smoke)
    case["new"] = (torch.randn(n_new, hkv, d, generator=g).to(act).to(device),
                   torch.randperm(total * page, generator=g)[:n_new].to(device))
    return case


def _bytes(case) -> int:
    n = case["k_cache"].element_size() * 2 * int(case["seqused_k"].sum()) \
        * case["k_cache"].shape[2] * case["k_cache"].shape[3]
    if "k_scale_cache" in case:
        n += 2 * 4 * int(case["seqused_k"].sum()) * case["k_cache"].shape[2]
    return n


def _timer(device, rep):
    if device.type == "cuda":
        import triton.testing as tt

        return lambda fn: tt.do_bench_cudagraph(fn, rep=rep, return_mode="median")

    def once(fn):  # smoke: the harness runs; the number means nothing
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return once


def run_row(bs, ctx, label, kv_name, gran, device, timer, act, dims=None) -> dict:
    from aiter_attn.kernels.reference import paged_attention_reference
    from aiter_attn.kernels.triton.kv_write import write_kv
    from aiter_attn.kernels.triton.paged_attention import paged_attention_triton

    case = make_case(bs, ctx, kv_name, gran, device, act=act, **(dims or {}))
    kw = {n: case[n] for n in ("cu_seqlens_q", "seqused_k", "block_table", "softmax_scale")}
    for n in ("k_scale", "v_scale", "k_scale_cache", "v_scale_cache"):
        if n in case:
            kw[n] = case[n]
    q, kc, vc = case["q"], case["k_cache"], case["v_cache"]
    row = {"row": f"{bs}x{ctx}", "format": label}
    out = torch.empty(q.shape[0], q.shape[1], kc.shape[3], dtype=q.dtype, device=device)
    ref = torch.empty(out.shape, dtype=torch.float32, device=device)
    paged_attention_reference(q.float(), kc, vc, ref, **kw)

    def attn():
        paged_attention_triton(q, kc, vc, out, max_seqlen_q=1, max_seqlen_k=ctx, **kw)

    attn()
    err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-12))
    row["rel_err"] = err
    if not err < RTOL_BF16:
        row["wrong"] = f"relative error {err:.2e} >= {RTOL_BF16}"
        return row
    ms = timer(attn)
    row["decode_us"] = ms * 1e3
    row["decode_GBps"] = _bytes(case) / ms / 1e6
    new, slots = case["new"]
    wkw = {n: kw[n] for n in ("k_scale", "v_scale", "k_scale_cache", "v_scale_cache") if n in kw}

    def write():
        write_kv(kc, vc, slots, new, new, **wkw)

    write()
    row["write_us_per_1k_tokens"] = timer(write) * 1e3 * 1000 / slots.numel()
    return row


def markdown(rows) -> str:
    lines = ["| batch x ctx | format | decode µs | decode GB/s | write µs / 1k tokens |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "wrong" in r:
            lines.append(f"| {r['row']} | {r['format']} | WRONG: {r['wrong']} | | |")
            continue
        lines.append(f"| {r['row']} | {r['format']} | {r['decode_us']:.1f} | "
                     f"{r['decode_GBps']:.0f} | {r['write_us_per_1k_tokens']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    timer = _timer(device, args.rep)
    act = torch.bfloat16 if device.type == "cuda" else torch.float16  # no bf16 math on CPU
    rows = []
    for bs, ctx in (SMOKE_ROWS if args.smoke else ROWS):
        for label, kv_name, gran in FORMATS:
            try:
                rows.append(run_row(bs, ctx, label, kv_name, gran, device, timer, act,
                                    dict(hq=4, hkv=2, d=32) if args.smoke else None))
            except Exception as exc:  # one broken row is a table entry, not a lost run
                rows.append({"row": f"{bs}x{ctx}", "format": label,
                             "wrong": f"error {type(exc).__name__}: {exc}"[:160]})
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__}
    with open(os.path.join(args.out, "bench_kv_formats.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    md = markdown(rows)
    with open(os.path.join(args.out, "bench_kv_formats.md"), "w") as f:
        f.write(md)
    print(md)
    return rows


if __name__ == "__main__":
    main()
