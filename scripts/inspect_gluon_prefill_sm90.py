"""Compile the Gluon dense prefill kernel (:mod:`aiter_attn.kernels.triton.prefill_gluon`) for
sm_90 on any host (no GPU: Triton's wheel carries ptxas) and report registers, spills, shared
memory and how many ``wgmma`` waits keep one group in flight (``wgmma.wait_group.sync.aligned 1``);
``--ws``: the warp-specialised form (:mod:`aiter_attn.kernels.triton.prefill_gluon_ws`), with the
partitions' register re-allocations (``setmaxnreg``).

Usage::

    python scripts/inspect_gluon_prefill_sm90.py '{"BLOCK_N": 64, "STAGES": 2}' [--ws] [--json] [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget


def compile_gluon(q="bf16", warps=4, maxnreg=None, ws=False, **const):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from aiter_attn.kernels.triton import prefill_gluon as pg
    from aiter_attn.kernels.triton import prefill_gluon_ws as pw

    c = dict(GROUP=4, D=128, DV=128, BLOCK_M=64, BLOCK_N=64, STAGES=2, HAS_SINKS=False,
             HAS_PREFIX=False, WRITE_LSE=True, M_SLOW=False, num_warps=warps)
    if ws:  # BLOCK_M: rows per consumer
        c.update(CONSUMER_REGS=pw.CONSUMER_REGS, LOADER_REGS=pw.LOADER_REGS, HAS_WINDOW=False)
        maxnreg = maxnreg or pw.WS_MAXNREG
    c.update(const)
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[q]
    fn = pw._gluon_ws_prefill_kernel if ws else pg._gluon_prefill_kernel
    names = fn.arg_names
    ql = gl.NVMMASharedLayout.get_default_for([c["BLOCK_M"], c["D"]], gdt)
    kl = gl.NVMMASharedLayout.get_default_for([c["BLOCK_N"], c["D"]], gdt)
    sig = {}
    for n in names:
        if n in c:
            sig[n] = "constexpr"
        elif n == "q_desc":
            sig[n] = f"tensordesc<{q}[{c['BLOCK_M']}, {c['D']}],{ql!r}>"
        elif n in ("k_desc", "v_desc"):
            sig[n] = f"tensordesc<{q}[{c['BLOCK_N']}, {c['D']}],{kl!r}>"
        elif n in ("O", "OP"):
            sig[n] = "*" + q
        elif n in ("LSE", "LSEP", "Sinks"):
            sig[n] = "*fp32"
        elif n in ("CuQ", "CuK"):
            sig[n] = "*i32"
        elif n == "qk2":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in c.items()})
    opts = dict(num_warps=warps, num_stages=1)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


def gluon_report(k) -> dict:
    """Registers, spills (ptxas stack bytes), shared memory, warps, wgmma count, the wgmma
    waits, the partitions' ``setmaxnreg`` values, and the shared-memory reads by kind
    (``ldmatrix``, and 16-byte ``ld.shared.v4`` vectors: an mma.sync operand read that way
    instead of by ldmatrix) of a compiled kernel ``k``."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inspect_sm90 import resource_usage

    ptx = k.asm["ptx"]
    res = resource_usage(k)
    return {
        "registers": res["REG"], "stack": res.get("STACK", 0), "shared": k.metadata.shared,
        "warps": k.metadata.num_warps, "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
        "wait_group": [int(x) for x in
                       re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
        "setmaxnreg": sorted({int(x) for x in
                              re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}),
        "ldmatrix": len(re.findall(r"ldmatrix\.", ptx)),
        "ld.shared.v4": len(re.findall(r"ld\.shared\.v4\.", ptx)),
    }


def print_report(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
    else:
        for key, val in report.items():
            print(f"{key:<14}", val)


def report_and_dump(k, as_json: bool, dump) -> None:
    """Print compiled kernel ``k``'s report; with ``dump`` (a folder) also write its TTGIR,
    PTX and cubin there (``k.ttgir``, ``k.ptx``, ``k.cubin``) and, where Triton's wheel
    carries ``nvdisasm``, its SASS (``k.sass``: the order of the loads and stores ptxas
    scheduled)."""
    print_report(gluon_report(k), as_json)
    if dump:
        os.makedirs(dump, exist_ok=True)
        for key in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"k.{key}"), "w") as f:
                f.write(k.asm[key])
        cubin = os.path.join(dump, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(k.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
        if os.path.exists(tool):
            sass = subprocess.run([tool, "-c", cubin], capture_output=True, text=True)
            with open(os.path.join(dump, "k.sass"), "w") as f:
                f.write(sass.stdout or sass.stderr)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("const", nargs="?", default="{}")
    p.add_argument("--ws", action="store_true", help="the warp-specialised kernel")
    p.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    p.add_argument("--dump", default=None)
    a = p.parse_args()
    report_and_dump(compile_gluon(ws=a.ws, **json.loads(a.const)), a.json, a.dump)


if __name__ == "__main__":
    main()
