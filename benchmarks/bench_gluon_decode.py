"""The Gluon decode kernel (:mod:`aiter_attn.kernels.triton.decode_gluon`) against the default
Triton decode (planned once into the static workspace, as an engine's graph replays it) and
cuDNN SDPA on the dense equivalent. GQA 32/8, head dim 128, bf16, page 16 unless given;
TB/s of K+V read, CUDA-graph replay (``triton.testing.do_bench_cudagraph`` median). Every
variant is checked against the float32 reference first.

Variants (``--variants``, comma list): ``default`` (the Triton kernel) and Gluon tile
shapes written ``bn64.st4.nc2.r128.s16``: keys per tile, ring stages, consumer
warpgroups, the register cap, splits (``s0``: one program per SM: ``132 // programs``;
``s00``: two per SM).

Usage (GPU machine)::

    python benchmarks/bench_gluon_decode.py --out "$OUT" --rows 1x4096,16x4096,1x32768 \\
        --variants default,bn64.st4.nc2.r128.s0
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
from bench_attention import RTOL_BF16, reference_mha, rel_err  # noqa: E402
from bench_variants import _ours_planned, cudnn_tbps  # noqa: E402

SMS = 132


def parse_variant(name: str) -> dict:
    """``bn64.st4.nc2.r128.s16`` -> its fields; ``ValueError`` on anything else."""
    keys = {"bn": "block_n", "st": "stages", "nc": "consumers", "r": "maxnreg", "s": "splits"}
    out = {"block_n": 64, "stages": 4, "consumers": 2, "maxnreg": 128, "splits": "0"}
    for part in name.split("."):
        for short in sorted(keys, key=len, reverse=True):
            if part.startswith(short) and part[len(short):].isdigit():
                out[keys[short]] = part[len(short):]
                break
        else:
            raise ValueError(f"variant {name!r}: item {part!r} is not one of "
                             f"{sorted(keys)} followed by digits")
    for k in ("block_n", "stages", "consumers", "maxnreg"):
        out[k] = int(out[k])
    return out


def _splits(spec: str, programs: int, ctx: int, block_n: int) -> int:
    tiles = max(1, ctx // block_n)
    if spec in ("0", "00"):
        per_sm = 1 if spec == "0" else 2
        return max(1, min(tiles, (SMS * per_sm) // programs))
    return int(spec)


def _gluon(x, v: dict):
    from aiter_attn.kernels.triton.decode_gluon import GluonDecodeConfig, gluon_decode

    cfg = GluonDecodeConfig(v["block_n"], v["stages"], v["consumers"], v["maxnreg"])
    splits = _splits(v["splits"], x.bs * x.hkv, x.ctx, v["block_n"])
    t = x.q.shape[0]
    out = torch.empty(t, x.hq, x.d, dtype=x.q.dtype, device=x.q.device)
    pa = torch.empty(splits, t, x.hq, x.d, dtype=torch.float32, device=x.q.device)
    pm = torch.empty(splits, t, x.hq, 2, dtype=torch.float32, device=x.q.device)

    def fn():
        gluon_decode(x.q, x.k_cache, x.v_cache, out, x.cu_seqlens_q, x.seqused_k,
                     x.block_table, x.scale, splits=splits, config=cfg, part_acc=pa,
                     part_ml=pm)

    return fn, (lambda: out), splits


def main() -> None:
    import triton.testing as tt

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--rep", type=int, default=40)
    p.add_argument("--rows", default="1x4096,16x4096,1x32768,64x4096,8x65536")
    p.add_argument("--variants", default="default,bn64.st4.nc2.r128.s0")
    p.add_argument("--page", type=int, default=16)
    args = p.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if v != "default":
            parse_variant(v)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for r in args.rows.split(","):
        bs, ctx = (int(s) for s in r.split("x"))
        x = make_mha(bs, ctx, page=args.page)
        nbytes = 2 * bs * ctx * x.hkv * x.d * x.k_cache.element_size()
        expected, sel = reference_mha(x, min(bs, 4), 1)
        row = {"row": f"{bs}x{ctx // 1024}k"}
        for v in variants:
            try:
                if v == "default":
                    fn, res = _ours_planned(x, {})
                    label = v
                else:
                    fn, res, splits = _gluon(x, parse_variant(v))
                    label = f"{v}(s={splits})"
                fn()
                torch.cuda.synchronize()
                err = rel_err(sel(res()), expected)
                if not err < RTOL_BF16:
                    row[v] = f"WRONG {err:.2e}"
                    continue
                ms = tt.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
                row[v] = nbytes / ms / 1e9
                row[v + ":label"] = label
            except Exception as exc:  # one broken variant is a row entry
                row[v] = f"error {type(exc).__name__}: {exc}"[:160]
        row["cudnn"] = cudnn_tbps(x, nbytes, args.rep)
        rows.append(row)
        print(row, flush=True)
        del x
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "bench_gluon_decode.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    cols = variants + ["cudnn"]
    print("| row | " + " | ".join(cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for r in rows:
        def f(v):
            return f"{v:.2f}" if isinstance(v, float) else str(v)
        print(f"| {r['row']} | " + " | ".join(f(r.get(c)) for c in cols) + " |")


if __name__ == "__main__":
    main()
