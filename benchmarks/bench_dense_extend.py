"""``BackendConfig(dense_extend=...)`` on engine-shaped EXTEND steps: one layer's
``AttentionBackend.forward`` (K/V write included, eager: EXTEND steps are not graph-captured)
with the two-pass extend (dense tiles over the step's new tokens + the paged prefix, merged by
LSE) against the paged kernel alone, same pools, same batch, same inputs.

Rows (bf16, GQA 32/8, head dim 128, page 16): plain prefills, extends over a cached prefix,
and the engine's one-forward mixed steps (many decode rows of one new token beside one
arrival's prefill chunk), where the two-pass path adds launches for little dense work.
Each row is checked first: both paths against each other (relative error, bf16 bound).

Usage (GPU)::

    python benchmarks/bench_dense_extend.py --out "$OUT"

Prints a markdown table (ms per layer forward, median of ``triton.testing.do_bench``, and
paged / dense speedup) and writes ``bench_dense_extend.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (name, [(cached prefix, new tokens) per request])
ROWS = [
    ("prefill 1x8k", [(0, 8192)]),
    ("prefill 8x2k", [(0, 2048)] * 8),
    ("prefill 1x16k", [(0, 16384)]),
    ("extend 1x8k over 4k", [(4096, 8192)]),
    ("extend 4x1k over 2k", [(2048, 1024)] * 4),
    # where the two passes start to pay: few new tokens per request
    ("extend 16x64 over 1k", [(1024, 64)] * 16),
    ("extend 8x128 over 2k", [(2048, 128)] * 8),
    ("extend 8x256 over 2k", [(2048, 256)] * 8),
    ("prefill 32x128", [(0, 128)] * 32),
    ("prefill 4x512", [(0, 512)] * 4),
    ("mixed 32x(1k+1) + 512", [(1024, 1)] * 32 + [(0, 512)]),
    ("mixed 32x(1k+1) + 2k", [(1024, 1)] * 32 + [(0, 2048)]),
    ("mixed 64x(4k+1) + 512", [(4096, 1)] * 64 + [(0, 512)]),
    ("mixed 8x(2k+1) + 1k over 1k", [(2048, 1)] * 8 + [(1024, 1024)]),
]


def run_row(reqs, *, device="cuda", dtype=torch.bfloat16, hq=32, hkv=8, d=128, page=16,
            rep=50, smoke=False):
    from aiter_attn import AttentionBackend, BackendConfig, ForwardMode, LayerSpec
    from aiter_attn.testing import PagedScenario

    prefix = [p for p, _ in reqs]
    new = [n for _, n in reqs]
    max_ctx = max(p + n for p, n in reqs) + page
    layer = LayerSpec(layer_id=0, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    base = dict(page_size=page, max_batch_size=len(reqs), max_context_len=max_ctx, dtype=dtype,
                device=device)
    pages = sum(-(-(p + n) // page) for p, n in reqs)
    sc = PagedScenario.make(BackendConfig(**base), [layer], prefix, seed=0,
                            num_pages=2 * pages + 16)
    batch = sc.next_batch(ForwardMode.EXTEND, new)
    q, k, v = sc.step_inputs(layer)
    out = {}
    fns = {}
    for dense in (False, True):
        cfg = BackendConfig(**base, dense_extend=dense)
        be = AttentionBackend(cfg, sc.req_pool, sc.kv_pool)
        be.init_forward_metadata(batch)

        def fn(be=be):
            return be.forward(q, k, v, layer, batch)

        out[dense] = fn().float()
        fns[dense] = fn
    err = ((out[True] - out[False]).norm() / out[False].norm()).item()
    rec = {"rel_err_dense_vs_paged": err}
    if smoke:
        return rec
    import triton.testing as tt

    for dense, fn in fns.items():
        rec["dense_ms" if dense else "paged_ms"] = tt.do_bench(fn, warmup=10, rep=rep,
                                                               return_mode="median")
    rec["speedup"] = rec["paged_ms"] / rec["dense_ms"]
    return rec


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=50)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny rows, correctness only")
    p.add_argument("--rows", default=None, help="comma list of row-name prefixes to run")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    if args.smoke:
        smoke_rows = [("prefill 1x40", [(0, 40)]), ("mixed 3x(20+1) + 12", [(20, 1)] * 3 + [(0, 12)])]
        for name, reqs in smoke_rows:
            rec = run_row(reqs, device="cpu", dtype=torch.float32, hq=4, hkv=2, d=16, page=4,
                          smoke=True)
            rec["row"] = name
            rows.append(rec)
            print(rec, flush=True)
        return
    wanted = args.rows.split(",") if args.rows else None
    for name, reqs in ROWS:
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        try:
            rec = run_row(reqs, rep=args.rep)
        except Exception as exc:  # one broken row is a row entry
            rec = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        rec["row"] = name
        rows.append(rec)
        print(rec, flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_dense_extend.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("| row | paged ms | dense-extend ms | paged / dense | rel. err |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | {r['error']} | | | |")
            continue
        print(f"| {r['row']} | {r['paged_ms']:.4f} | {r['dense_ms']:.4f} | {r['speedup']:.2f}× | "
              f"{r['rel_err_dense_vs_paged']:.1e} |")


if __name__ == "__main__":
    main()
