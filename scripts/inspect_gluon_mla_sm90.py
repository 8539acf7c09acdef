"""Compile the warp-specialised Gluon MLA kernel (:mod:`aiter_attn.kernels.triton.mla_gluon`)
for sm_90 on any host (no GPU: Triton's wheel carries ptxas) and report registers, spills,
shared memory, the partitions' register re-allocations (``setmaxnreg``) and the wgmma count.

Usage::

    python scripts/inspect_gluon_mla_sm90.py '{"SPLITS": 1, "WRITE_LSE": false}' [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    from inspect_sm90 import resource_usage

    k = compile_mla(**json.loads(a.const))
    ptx = k.asm["ptx"]
    res = resource_usage(k)
    report = {
        "registers": res["REG"], "stack": res.get("STACK", 0), "shared": k.metadata.shared,
        "warps": k.metadata.num_warps, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "setmaxnreg": sorted({int(x) for x in
                              re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
    }
    if a.json:
        print(json.dumps(report))
    else:
        for key, val in report.items():
            print(f"{key:<12}", val)


if __name__ == "__main__":
    main()
