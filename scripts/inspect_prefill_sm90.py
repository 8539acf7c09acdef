"""Compile the dense prefill kernel (:mod:`aiter_attn.kernels.triton.prefill`) for sm_90 on
any host (no GPU: Triton's wheel carries ptxas) and report what Triton made of it: shared
memory, TMA / ``cp.async`` / plain loads, ``wgmma``, warp-specialised partitions, spills.

Usage::

    python scripts/inspect_prefill_sm90.py '{"BLOCK_M": 128, "BLOCK_N": 128, "warps": 8,
        "stages": 2, "USE_TMA": true, "ONE_LOOP": true}' [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_prefill(q="bf16", warps=8, stages=2, **const):
    from aiter_attn.kernels.triton import prefill as pf

    c = dict(GROUP=4, D=128, D_PAD=128, DV=128, DV_PAD=128, BLOCK_M=128, BLOCK_N=128,
             CAUSAL=True, HAS_WINDOW=False, HAS_SOFTCAP=False, HAS_SINKS=False,
             HAS_PREFIX=False, WRITE_LSE=False, USE_TMA=True, DOT_PRECISION="tf32",
             NUM_STAGES=stages, ONE_LOOP=False, M_SLOW=False, SEARCH=False)
    c.update(const)
    fn = pf._dense_prefill_kernel
    names = fn.arg_names
    ptrs = dict(Q=q, K=q, V=q, O=q, LSE="fp32", OP=q, LSEP="fp32", Sinks="fp32", CuQ="i32",
                CuK="i32")
    sig = {}
    for n in names:
        if n in c:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
        elif n in ("Qd", "Kd", "Vd"):
            if c["USE_TMA"]:
                rows = c["BLOCK_M"] if n == "Qd" else c["BLOCK_N"]
                sig[n] = f"tensordesc<{q}[{rows}, {c['D']}]>"
            else:
                sig[n] = "*i32"
        elif n in ("qk2", "softcap"):
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    no_div = {"left", "right", "qk2", "softcap", "num_seqs"}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] not in ("constexpr", "fp32") and not sig[n].startswith("tensordesc")
             and n not in no_div}
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in c.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def report(kernel) -> dict:
    from inspect_sm90 import resource_usage

    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    res = resource_usage(kernel)
    return {
        "registers": res["REG"],
        "stack bytes (ptxas spills)": res.get("STACK", 0),
        "shared_bytes": kernel.metadata.shared,
        "num_warps (incl. partitions)": kernel.metadata.num_warps,
        "tma loads (cp.async.bulk.tensor)": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "cp.async (16 B)": len(re.findall(r"cp\.async\.cg", ptx)),
        "ld.global": len(re.findall(r"ld\.global", ptx)),
        "local-memory ops in the PTX": len(re.findall(r"(ld|st)\.local", ptx)),
        "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "mma.sync": len(re.findall(r"mma\.sync", ptx)),
        "warp_specialize ops": len(re.findall(r"ttg\.warp_specialize", ttgir)),
        "setmaxnreg": len(re.findall(r"setmaxnreg", ptx)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="{}", help="JSON constexprs / options")
    ap.add_argument("--dump", help="write k.ttgir and k.ptx into this folder")
    args = ap.parse_args(argv)
    k = compile_prefill(**json.loads(args.config))
    for key, val in report(k).items():
        print(f"{key:34s} {val}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(args.dump, "k." + ext), "w") as f:
                f.write(k.asm[ext])
    return 0


if __name__ == "__main__":
    sys.exit(main())
