"""Compile the warp-specialised Gluon MLA kernel (:mod:`aiter_attn.kernels.triton.mla_gluon`)
for sm_90 on any host (no GPU: Triton's wheel carries ptxas) and report registers, spills,
shared memory, the partitions' register re-allocations (``setmaxnreg``) and the wgmma count
(the report of ``inspect_gluon_prefill_sm90.py``).

Usage::

    python scripts/inspect_gluon_mla_sm90.py '{"SPLITS": 1, "WRITE_LSE": false}' [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget


def compile_mla(q="bf16", **const):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from aiter_attn.kernels.triton import mla_gluon as mg

    c = dict(PAGE=64, STAGES=2, CAUSAL=True, WRITE_LSE=False, SPLITS=1, BLOCK_B=64,
             CONSUMER_REGS=mg._CONSUMER_REGS, LOADER_REGS=mg._LOADER_REGS, num_warps=4)
    c.update(const)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[q]
    fn = mg._gluon_mla_kernel
    names = fn.arg_names
    ln = gl.NVMMASharedLayout.get_default_for([64, 512], gdt)
    lr = gl.NVMMASharedLayout.get_default_for([64, 64], gdt)
    sig = {}
    for n in names:
        if n in c:
            sig[n] = "constexpr"
        elif n in ("qn_d", "kn_d"):
            sig[n] = f"tensordesc<{q}[64, 512],{ln!r}>"
        elif n in ("qr_d", "kr_d"):
            sig[n] = f"tensordesc<{q}[64, 64],{lr!r}>"
        elif n == "out_d":
            sig[n] = f"tensordesc<{q}[64, 256],{ln!r}>"
        elif n in ("part_o", "part_l", "lse_ptr"):
            sig[n] = "*fp32"
        elif n in ("cu_q", "seqused", "bt"):
            sig[n] = "*i32"
        elif n == "qk2":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in c.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1, maxnreg=mg._MAXNREG))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("const", nargs="?", default="{}")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inspect_gluon_prefill_sm90 import gluon_report, print_report

    print_report(gluon_report(compile_mla(**json.loads(a.const))), a.json)


if __name__ == "__main__":
    main()
