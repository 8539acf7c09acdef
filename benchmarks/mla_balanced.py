"""16-head MLA decode steps, replayed (CUDA graphs, medians in µs): the split launch (each
request cut into the same number of splits) against the balanced launch
(:mod:`aiter_attn.kernels.triton.mla_balanced`: every program the same number of key tiles),
on uniform batches and skewed ones (one long request among short ones).

Each row: ``NAME=LENGTHS`` with ``LENGTHS`` a ``+``-list of ``COUNTxKEYS`` (``1x32768+63x1024``).
Bytes are the latent rows read (Σ keys · 576 · 2 for bf16); every variant's rows are checked
against the split launch's (relative error printed).

On the GPU::

    python3 benchmarks/mla_balanced.py --tunings '[{}, {"balanced": true}, {"narrow": true}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

ROWS = ("uniform64=64x4096,uniform66=66x4096,uniform128=128x8192,"
        "skew32k=1x32768+63x1024,skew16k=4x16384+60x512,mixed=16x8192+48x2048")


def parse_lengths(spec: str) -> list:
    """``"1x32768+63x1024"`` -> ``[32768, 1024, ..., 1024]`` (64 entries)."""
    out = []
    for part in spec.split("+"):
        n, keys = part.split("x")
        out += [int(keys)] * int(n)
    return out


def row(lengths, tuning, rep, *, heads=16, device="cuda", dtype=torch.bfloat16,
        split=False):
    """``(µs, out)``: the step planned once (static workspace) and replayed; ``split``: also
    ``{"attention": µs, "merge": µs}`` of the balanced launch's two launches alone (``{}``
    when the plan did not take it)."""
    from _inputs import make_mla

    from aiter_attn.kernels.base import _adhoc_metadata, mla_layer_params
    from aiter_attn.kernels.triton.mla import TritonMLA, mla_request

    x = make_mla(len(lengths), -(-max(lengths) // 64) * 64, heads=heads, dtype=dtype,
                 device=device)
    x.seqused_k.copy_(torch.tensor(lengths, dtype=torch.int32))
    out = torch.empty(x.bs, heads, x.rank, dtype=x.q.dtype, device=device)
    kernel = TritonMLA(mla_request(x.q, x.kv_cache, x.rank), dict(tuning))
    md = _adhoc_metadata(x.q, x.kv_cache, x.cu_seqlens_q, x.seqused_k, x.block_table, None,
                         None, 1, max(lengths), "mla_balanced")
    params = mla_layer_params(scale=x.scale, device=x.q.device, kv_lora_rank=x.rank,
                              num_q_heads=heads, head_dim=x.q.shape[2])
    plan = kernel.plan(md, {})

    def step():
        kernel.run(x.q, (x.kv_cache,), plan, params, out)

    step()
    if device != "cuda":
        return (0.0, out, {}) if split else (0.0, out)
    import triton.testing as tt

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return 1000.0 * float(tt.do_bench_cudagraph(fn, rep=rep, return_mode="median"))

    us = timed(step)
    if not split:
        return us, out
    parts = {}
    if plan.balanced is not None:
        from aiter_attn.kernels.triton.mla_balanced import launch_balanced_mla
        from aiter_attn.kernels.triton.mla_kernel import _LOG2E

        for name in ("attention", "merge"):
            parts[name] = timed(lambda name=name: launch_balanced_mla(
                x.q, x.kv_cache, out, x.seqused_k, x.block_table, rank=x.rank,
                qk_scale_log2=params.scale * _LOG2E, launches=(name,), **plan.balanced[3]))
    return us, out, parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=ROWS)
    p.add_argument("--tunings", default='[{}, {"balanced": true}]')
    p.add_argument("--rep", type=int, default=30)
    p.add_argument("--split", action="store_true",
                   help="also time the balanced launch's attention and merge launches alone")
    args = p.parse_args(argv)
    tunings = json.loads(args.tunings)
    for spec in args.rows.split(","):
        name, _, lens = spec.partition("=")
        lengths = parse_lengths(lens)
        nbytes = sum(lengths) * 576 * 2
        base = None
        for tuning in tunings:
            us, out, *parts = row(lengths, tuning, args.rep, split=args.split)
            parts = parts[0] if parts else {}
            err = 0.0
            if base is None:
                base = out.float().clone()
            else:
                err = float((out.float() - base).norm() / base.norm())
            print(f"row={name} lengths={lens} tuning={json.dumps(tuning)} step={us:.2f} "
                  f"TB/s={nbytes / max(us, 1e-3) / 1e6:.2f} rel_err_vs_first={err:.1e}"
                  + "".join(f" {k}={v:.2f}" for k, v in parts.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
