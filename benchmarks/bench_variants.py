"""Decode launch variants on one GPU, same run: the default Triton decode, the one-launch split
reduction (``TUNING_OVERRIDES["fused_reduce"]``), batch-invariant mode (fixed split size), and
cuDNN SDPA on the dense equivalent as the anchor. GQA 32/8, head dim 128, page 16, bf16;
TB/s of K+V read, CUDA-graph replay (``triton.testing.do_bench_cudagraph`` median).

Every variant is checked against the float32 reference (relative error) before it is timed.

Usage (GPU machine)::

    python benchmarks/bench_variants.py --out "$OUT"

Writes ``bench_variants.json`` under ``--out`` and prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _inputs import make_mha  # noqa: E402
from _runners import RUNNERS, Unavailable, make_ours  # noqa: E402
from bench_attention import RTOL_BF16, reference_mha, rel_err  # noqa: E402

ROWS = [(1, 4096), (16, 4096), (1, 32768), (64, 4096), (8, 65536)]
VARIANTS = ("default", "fused_reduce", "batch_invariant")
#: ``--variants`` beyond :data:`VARIANTS`: launch overrides (``TUNING_OVERRIDES`` keys) of the
#: small-batch decode rows (more, shorter splits; narrower key tiles with a deeper pipeline;
#: 8 warps; the chunked page lookup, which lets every K/V copy of a short split be in flight at
#: once instead of one tile ahead; fewer, longer splits; programmatic dependent launch off)
OVERRIDES = {
    "splits128": {"min_split_tokens": 128},
    "splits64": {"min_split_tokens": 64},
    "bn64": {"block_n": 64},
    "bn64-s4": {"block_n": 64, "num_stages": 4},
    "splits128-bn64": {"min_split_tokens": 128, "block_n": 64},
    "w8": {"num_warps": 8},
    "chunk16": {"page_chunk": 16},
    "chunk16-s4": {"page_chunk": 16, "num_stages": 4},
    "chunk16-bn64-s4": {"page_chunk": 16, "block_n": 64, "num_stages": 4},
    "chunk16-splits128": {"page_chunk": 16, "min_split_tokens": 128},
    "splits512": {"min_split_tokens": 512},
    "chunk16-splits512": {"page_chunk": 16, "min_split_tokens": 512},
    # programmatic dependent launch (the default on sm_90) off: the attention launch and the
    # split reduction each wait for the kernel before to finish before they start
    "nopdl": {"pdl": False},
    "chunk16-nopdl": {"page_chunk": 16, "pdl": False},
    "pdl": {"pdl": True},
    "pdl-reduce": {"pdl": "reduce"},  # only the reduction launched early
    "chunk0": {"page_chunk": 0},  # the per-tile lookup (1x4k's default before 2026-12-04)
    "chunk4": {"page_chunk": 4},
    "chunk8": {"page_chunk": 8},
    "chunk16-s2": {"page_chunk": 16, "num_stages": 2},
    # fewer, longer splits (16x4k: 2 and 1 split instead of 3)
    "min2k": {"min_split_tokens": 2048},
    "min4k": {"min_split_tokens": 4096},
    "splits32": {"min_split_tokens": 32},
    # the split decode's page-id prefetch (an option since 2026-12-04, not yet timed)
    "prefetch": {"prefetch_pages": True},
    # page ids carried a tile ahead on the per-tile lookup (an option since 2026-12-04: K/V
    # copies two tiles ahead on sm_90 where the per-tile lookup has none in flight); "chunk0-"
    # also for the rows that default to the chunked lookup (1x4k)
    "ahead": {"page_ahead": True},
    "chunk0-ahead": {"page_chunk": 0, "page_ahead": True},
    # carried with 128-key tiles and 3 stages the ring takes 136 KB (one program per SM,
    # where the per-tile lookup's 73 KB fit three); 64-key tiles: 181 registers and 70 KB
    # (two programs per SM, two tiles each in flight), 4 stages 102 KB (three tiles each)
    "chunk0-ahead-bn64": {"page_chunk": 0, "page_ahead": True, "block_n": 64},
    "chunk0-ahead-bn64-s4": {"page_chunk": 0, "page_ahead": True, "block_n": 64,
                             "num_stages": 4},
    # 1x4k as 32 splits of 128 keys: 256 programs, two per SM (carried lookup; or chunked,
    # 196 registers and no spills, with and without the page-id prefetch)
    "chunk0-ahead-bn64-splits128": {"page_chunk": 0, "page_ahead": True, "block_n": 64,
                                    "min_split_tokens": 128},
    "bn64-splits128": {"block_n": 64, "min_split_tokens": 128},
    "bn64-splits128-prefetch": {"block_n": 64, "min_split_tokens": 128,
                                "prefetch_pages": True},
    # 16x4k without splits (128 programs, one per SM, K/V two tiles ahead): no reduction
    # launch, which with its gap is ~7% of the step
    "chunk0-ahead-splits1": {"page_chunk": 0, "page_ahead": True, "num_splits": 1},
    # the same with 64-key tiles (70 KB: two programs per SM, 256 of them at 16x4k)
    "chunk0-ahead-bn64-splits1": {"page_chunk": 0, "page_ahead": True, "block_n": 64,
                                  "num_splits": 1},
}


def _ours_planned(x, overrides):
    """What an engine's CUDA graph replays: the step planned once into the kernel's static
    workspace (``buffer_spec``, as the graph manager allocates it), only ``run`` timed."""
    from aiter_attn.graph.buffers import GraphLimits
    from aiter_attn.kernels.base import LayerParams, _adhoc_metadata
    from aiter_attn.kernels.triton import _launch_config as lc
    from aiter_attn.kernels.triton.attention import TritonPagedAttention
    from aiter_attn.types import FP8_DTYPES, ForwardMode

    lc.TUNING_OVERRIDES.clear()
    lc.TUNING_OVERRIDES.update(overrides)
    req = TritonPagedAttention.request_for(x.q, x.k_cache, x.v_cache)
    kernel = TritonPagedAttention(req)
    limits = GraphLimits(mode=ForwardMode.DECODE, max_bs=x.bs, q_len=x.q_len,
                         max_num_tokens=x.bs * x.q_len, max_seq_len=x.ctx)
    static = kernel.buffer_spec(limits).allocate(x.q.device)
    md = _adhoc_metadata(x.q, x.k_cache, x.cu_seqlens_q, x.seqused_k, x.block_table, None, None,
                         x.q_len, x.ctx, "paged_attention")
    plan = kernel.plan(md, out=static)
    params = LayerParams.create(scale=x.scale, device=x.q.device, k_scale=x.k_scale,
                                v_scale=x.v_scale, fp8=x.k_cache.dtype in FP8_DTYPES)
    out = torch.empty(x.q.shape[0], x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    cache = (x.k_cache, x.v_cache)

    def fn():
        kernel.run(x.q, cache, plan, params, out)

    return fn, lambda: out


def variant_overrides(variant: str) -> dict:
    """The ``TUNING_OVERRIDES`` of ``variant`` (a name of :data:`VARIANTS` or
    :data:`OVERRIDES`, optionally ``planned-`` / ``planned-fused-`` in front), checked
    against the keys the kernels know; ``ValueError`` for an unknown name or key (before any
    GPU work: an unknown name would otherwise time the default under another label)."""
    from aiter_attn.kernels.triton._launch_config import check_overrides

    rest = variant.split("-")
    ov = {}
    if rest[0] == "planned":
        rest = rest[1:]
        if rest and rest[0] == "fused":
            ov["fused_reduce"] = True
            rest = rest[1:]
        name = "-".join(rest)
        if name and name not in OVERRIDES and not name.startswith("ov:"):
            raise ValueError(f"unknown variant {variant!r}: after 'planned[-fused]-' comes one "
                             f"of {sorted(OVERRIDES)}")
    else:
        name = variant
        if name not in VARIANTS and name not in OVERRIDES and not name.startswith("ov:"):
            raise ValueError(f"unknown variant {variant!r}: one of "
                             f"{sorted(VARIANTS + tuple(OVERRIDES))} or 'planned[-fused]-...'")
        if name == "fused_reduce":
            ov["fused_reduce"] = True
    ov.update(_inline_overrides(name) if name.startswith("ov:") else OVERRIDES.get(name, {}))
    return check_overrides(ov, f"variant {variant!r}")


def _inline_overrides(name: str) -> dict:
    """``ov:key=value+key=value`` (ints, ``true`` / ``false``) as overrides, e.g.
    ``planned-ov:num_splits=48+block_n=64``; ``ValueError`` on a malformed item."""
    ov = {}
    for item in name[3:].split("+"):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"variant item {item!r}: write key=value (ints, true, false)")
        low = value.lower()
        ov[key] = True if low == "true" else False if low == "false" else int(value)
    return ov


def _ours(x, variant):
    from aiter_attn import ops
    from aiter_attn.kernels.triton import _launch_config as lc

    ov = variant_overrides(variant)
    if variant.startswith("planned"):  # planned, planned-fused, planned-fused-<override>
        return _ours_planned(x, ov)
    lc.TUNING_OVERRIDES.clear()
    ops._registry().calls.clear()  # the ops call memo keeps a plan made under other overrides
    lc.TUNING_OVERRIDES.update(ov)
    extra = {"batch_invariant": True} if variant == "batch_invariant" else {}
    fn, res = make_ours(x, **extra)
    return fn, res


def cudnn_tbps(x, nbytes: int, rep: int):
    """cuDNN SDPA on the dense equivalent of ``x``: TB/s of ``nbytes`` in graph replay
    (called once first: a process's first cuDNN call on a row measured 5x slow), or why
    it could not run."""
    import triton.testing as tt

    try:
        fn, _ = RUNNERS["cudnn"](x)
        fn()
        return nbytes / tt.do_bench_cudagraph(fn, rep=rep, return_mode="median") / 1e9
    except (Unavailable, Exception) as exc:
        return f"n/a {exc}"[:80]


def main() -> None:
    import triton.testing as tt

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma list of {VARIANTS + tuple(OVERRIDES)}; 'planned' (the step "
                        "planned once into the static workspace, only run timed: what an "
                        "engine's graph replays), 'planned-fused' (and the fused reduction), "
                        "'planned[-fused]-<override>'")
    p.add_argument("--rows", default=None, help="comma list of BSxCTX (e.g. 1x4096,16x4096)")
    p.add_argument("--layouts", default="nhd",
                   help="comma list of cache storage orders: nhd ([pages, page, Hkv, D], "
                        "the default) and/or hnd ([pages, Hkv, page, D], passed as a strided "
                        "NHD view: each (page, head) contiguous)")
    p.add_argument("--pages", default="16", help="comma list of page sizes")
    args = p.parse_args()
    variants = tuple(args.variants.split(","))
    for v in variants:
        variant_overrides(v)  # unknown names or keys fail here, before any GPU work
    rows_wanted = ROWS if not args.rows else [tuple(int(v) for v in r.split("x"))
                                              for r in args.rows.split(",")]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    shapes = [(bs, ctx, layout, int(page)) for bs, ctx in rows_wanted
              for layout in args.layouts.split(",") for page in args.pages.split(",")]
    for bs, ctx, layout, page in shapes:
        x = make_mha(bs, ctx, page=page)
        if layout == "hnd":  # same values, each (page, head) stored contiguously
            x.k_cache = x.k_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
            x.v_cache = x.v_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        elif layout != "nhd":
            raise ValueError(f"--layouts: nhd or hnd, not {layout!r}")
        nbytes = 2 * bs * ctx * x.hkv * x.d * x.k_cache.element_size()
        expected, sel = reference_mha(x, min(bs, 4), 1)
        row = {"row": f"{bs}x{ctx // 1024}k"
               + ("" if (layout, page) == ("nhd", 16) else f" {layout} p{page}")}
        for variant in variants:
            try:
                fn, res = _ours(x, variant)
                fn()
                torch.cuda.synchronize()
                err = rel_err(sel(res()), expected)
                if not err < RTOL_BF16:
                    row[variant] = f"WRONG {err:.2e}"
                    continue
                ms = tt.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
                row[variant] = nbytes / ms / 1e9
            except Exception as exc:  # report and go on: one broken variant is a row entry
                row[variant] = f"error {type(exc).__name__}: {exc}"[:120]
        from aiter_attn.kernels.triton import _launch_config as lc

        lc.TUNING_OVERRIDES.clear()
        row["cudnn"] = cudnn_tbps(x, nbytes, args.rep)
        rows.append(row)
        print(row, flush=True)
        del x
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_variants.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = list(variants) + ["cudnn"]
    print("| row | " + " | ".join(f"{c} TB/s" for c in cols) + " | fused/cuDNN | invariant/default |")
    print("| --- |" + " --- |" * (len(cols) + 2))
    for r in rows:
        def f(v):
            return f"{v:.2f}" if isinstance(v, float) else str(v)

        ratio = (f"{r['fused_reduce'] / r['cudnn']:.2f}"
                 if all(isinstance(r.get(k), float) for k in ("fused_reduce", "cudnn")) else "-")
        inv = (f"{r['batch_invariant'] / r['default']:.2f}"
               if all(isinstance(r.get(k), float) for k in ("batch_invariant", "default"))
               else "-")
        print(f"| {r['row']} | " + " | ".join(f(r.get(c)) for c in cols) + f" | {ratio} | {inv} |")


if __name__ == "__main__":
    main()
