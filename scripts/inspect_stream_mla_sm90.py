"""Compile the stream MLA kernel (:mod:`aiter_attn.kernels.triton.mla_stream_gluon`) for
sm_90 on any host (no GPU: Triton's wheel carries ptxas) and report registers, spills (ptxas
stack bytes), shared memory, the partitions' register re-allocations and the wgmma count
(the report of ``inspect_gluon_prefill_sm90.py``).

Its first builds spilled 0.9–1.7 KB a thread and ran at half the narrow kernel's speed
(docs/benchmarks.md, "Thirtieth session"): a consumer's ring slot, q buffer and P buffer
fixed per partition made every wgmma's shared-memory descriptor a constant, which the
compiler hoisted out of the tile loop and ptxas spilled.

Usage::

    python scripts/inspect_stream_mla_sm90.py '{"HP": 8, "CLAIM": true}' [--q fp16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget


def compile_stream(q="bf16", index="i32", **const):
    """The kernel built for sm_90 with the launch's constexprs (``const`` overrides: ``HP``,
    ``PAGE``, ``WRITE_LSE``, ``BLOCK_B``, ``CLAIM``, ``PDL``, ``STAMPS``)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from aiter_attn.kernels.triton import mla_stream_gluon as ms

    c = dict(HP=16, PAGE=64, WRITE_LSE=True, BLOCK_B=128, CONSUMER_REGS=ms._MAXNREG,
             LOADER_REGS=ms._LOADER_REGS, WRITER_REGS=ms._WRITER_REGS, num_warps=4,
             CLAIM=False, PDL=True, STAMPS=False)
    c.update(const)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[q]
    box = ms.STREAM_UNIT
    ln = gl.NVMMASharedLayout.get_default_for([box, 512], gdt)
    lr = gl.NVMMASharedLayout.get_default_for([box, 64], gdt)
    hp = c["HP"]
    qln = gl.NVMMASharedLayout.get_default_for([hp, 512], gdt)
    qlr = gl.NVMMASharedLayout.get_default_for([hp, 64], gdt)
    fn = ms._stream_mla_kernel
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in c:
            sig[n] = "constexpr"
        elif n == "kn_d":
            sig[n] = f"tensordesc<{q}[{box}, 512],{ln!r}>"
        elif n == "kr_d":
            sig[n] = f"tensordesc<{q}[{box}, 64],{lr!r}>"
        elif n == "qn_d":
            sig[n] = f"tensordesc<{q}[{hp}, 512],{qln!r}>"
        elif n == "qr_d":
            sig[n] = f"tensordesc<{q}[{hp}, 64],{qlr!r}>"
        elif n in ("out", "part_o"):
            sig[n] = f"*{q}"
        elif n in ("part_l", "lse_ptr", "shares"):
            sig[n] = "*fp32"
        elif n in ("seqused", "bt"):
            sig[n] = f"*{index}"
        elif n in ("ticket", "claims", "stamps"):
            sig[n] = "*i64"
        elif n == "qk2":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] not in ("constexpr", "fp32") and not sig[n].startswith("tensordesc")
             and n not in ("heads", "batch", "num_programs")}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in c.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1, maxnreg=ms._MAXNREG))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("const", nargs="?", default="{}")
    p.add_argument("--q", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--index", default="i32", choices=("i32", "i64"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inspect_gluon_prefill_sm90 import gluon_report, print_report

    print_report(gluon_report(compile_stream(a.q, a.index, **json.loads(a.const))), a.json)


if __name__ == "__main__":
    main()
