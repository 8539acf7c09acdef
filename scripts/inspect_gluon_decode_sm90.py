"""Compile the Gluon decode kernel (:mod:`aiter_attn.kernels.triton.decode_gluon`) for sm_90
on any host (no GPU: Triton's wheel carries ptxas) and report registers, spills, shared
memory, the wgmma count and the partitions' ``setmaxnreg`` (the report of
``inspect_gluon_prefill_sm90.py``).

Usage::

    python scripts/inspect_gluon_decode_sm90.py '{"BLOCK_N": 64, "STAGES": 4, "NC": 2}' [--json] [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import triton
from triton.backends.compiler import GPUTarget


def _compile_sm90(fn, c: dict, q: str, descs: dict, fp32_ptrs: tuple, maxnreg: int,
                  ptrs: dict = None, aligned: tuple = None):
    """Compile Gluon kernel ``fn`` for sm_90: constexprs ``c``, q / out of dtype ``q``, host
    tensor descriptors ``descs`` (name -> block shape), float32 pointers ``fp32_ptrs``,
    pointers of other element types ``ptrs`` (name -> Triton type name), int32 index
    pointers ``cu_q`` / ``seqused`` / ``bt``, ``qk2`` float, other ints. ``aligned``: the
    ints to compile as multiples of 16, with every pointer 16-byte aligned, as Triton's
    launch specialises them (its vectorised loads and stores); ``None``: nothing marked."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[q]
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in c:
            sig[n] = "constexpr"
        elif n in descs:
            layout = gl.NVMMASharedLayout.get_default_for(list(descs[n]), gdt)
            sig[n] = f"tensordesc<{q}[{descs[n][0]}, {descs[n][1]}],{layout!r}>"
        elif n in (ptrs or {}):
            sig[n] = "*" + ptrs[n]
        elif n in ("q_ptr", "out"):
            sig[n] = "*" + q
        elif n in fp32_ptrs:
            sig[n] = "*fp32"
        elif n in ("cu_q", "seqused", "bt", "count"):
            sig[n] = "*i32"
        elif n == "qk2":
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
    attrs = {}
    if aligned is not None:
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                 if sig[n].startswith("*") or n in aligned}
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in c.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=4, num_stages=1, maxnreg=maxnreg))


def compile_decode(q="bf16", maxnreg=None, **const):
    """The decode kernel (:mod:`aiter_attn.kernels.triton.decode_gluon`); ``maxnreg``: the
    register cap (and the worker consumer's share), the default configuration's if not
    given."""
    from aiter_attn.kernels.triton import decode_gluon as dg

    maxnreg = maxnreg or dg.DEFAULT_CONFIG.maxnreg
    c = dict(G=4, GP=8, D=128, BLOCK_N=64, STAGES=4, NC=2, PAGE=16, BOX=16, SPLITS=1,
             WRITE_LSE=False, LOADER_REGS=dg._LOADER_REGS, num_warps=4)
    c.update(const)
    c["CONSUMER_REGS"] = maxnreg
    c["BOX"] = min(c["BOX"], c["BLOCK_N"])
    box = (c["BOX"], c["D"])
    return _compile_sm90(dg._gluon_decode_kernel, c, q, {"k_d": box, "v_d": box},
                         ("part_acc", "part_ml", "lse_ptr"), maxnreg)


#: the narrow MLA kernel's strides that are multiples of 16 at 16 heads (q, out, partial
#: rows of 512 + 64 / 512 columns, block-table rows of 16·k pages)
NARROW_ALIGNED = ("s_bt", "s_qt", "s_qh", "s_ot", "s_oh", "s_pt", "s_ph", "s_ps")


def compile_narrow_mla(q="bf16", part="fp32", **const):
    """The narrow MLA kernel (:mod:`aiter_attn.kernels.triton.mla_narrow_gluon`); ``part``:
    its split partials' dtype (``"bf16"``: ``half_partials``). Pointers and
    :data:`NARROW_ALIGNED` compile as 16-aligned, as a 16-head launch specialises them."""
    from aiter_attn.kernels.triton import mla_narrow_gluon as mn

    c = dict(HP=16, PAGE=64, BOX=64, CAUSAL=True, SPLITS=1, WRITE_LSE=False, BLOCK_B=64,
             CONSUMER_REGS=mn._MAXNREG, LOADER_REGS=mn._LOADER_REGS, num_warps=4,
             FUSED=False, ONE_QUERY=False, PDL=False, STAMPS=False, EARLY=False)
    c.update(const)
    c["BOX"] = min(c["BOX"], 64)
    return _compile_sm90(mn._narrow_mla_kernel, c, q,
                         {"kn_d": (c["BOX"], 512), "kr_d": (c["BOX"], 64)},
                         ("part_l", "lse_ptr"), mn._MAXNREG,
                         ptrs={"part_o": part, "stamps": "i64"}, aligned=NARROW_ALIGNED)


def compile_ring_mla(q="bf16", **const):
    """The ring MLA kernel (:mod:`aiter_attn.kernels.triton.mla_ring_gluon`)."""
    from aiter_attn.kernels.triton import mla_ring_gluon as mr

    c = dict(HP=16, PAGE=64, BOX=32, CAUSAL=True, SPLITS=4, WRITE_LSE=False, BLOCK_B=64,
             num_warps=4)
    c.update(const)
    c["BOX"] = min(c["BOX"], 32)
    return _compile_sm90(mr._ring_mla_kernel, c, q,
                         {"kv_d": (c["BOX"], 64)}, ("part_o", "part_l", "lse_ptr"), 255)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("const", nargs="?", default="{}")
    p.add_argument("--json", action="store_true")
    p.add_argument("--dump", default=None)
    p.add_argument("--mla", action="store_true", help="the narrow MLA kernel")
    p.add_argument("--ring", action="store_true", help="the ring MLA kernel")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from inspect_gluon_prefill_sm90 import report_and_dump

    k = (compile_ring_mla if a.ring else compile_narrow_mla if a.mla
         else compile_decode)(**json.loads(a.const))
    report_and_dump(k, a.json, a.dump)


if __name__ == "__main__":
    main()
