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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from inspect_gluon_decode_sm90 import _compile_sm90  # noqa: E402


def compile_stream(q="bf16", index="i32", **const):
    """The kernel built for sm_90 with the launch's constexprs (``const`` overrides: ``HP``,
    ``PAGE``, ``WRITE_LSE``, ``BLOCK_B``, ``CLAIM``, ``PDL``, ``STAMPS``): pointers and the
    strides (``s_*``) compiled 16-aligned, as a launch specialises them; the head, request
    and program counts not."""
    from aiter_attn.kernels.triton import mla_stream_gluon as ms

    c = dict(HP=16, PAGE=64, WRITE_LSE=True, BLOCK_B=128, CONSUMER_REGS=ms._MAXNREG,
             LOADER_REGS=ms._LOADER_REGS, WRITER_REGS=ms._WRITER_REGS, num_warps=4,
             CLAIM=False, PDL=True, STAMPS=False)
    c.update(const)
    box, hp = ms.STREAM_UNIT, c["HP"]
    fn = ms._stream_mla_kernel
    return _compile_sm90(
        fn, c, q, {"kn_d": (box, 512), "kr_d": (box, 64), "qn_d": (hp, 512), "qr_d": (hp, 64)},
        ("part_l", "lse_ptr", "shares"), ms._MAXNREG,
        ptrs={"part_o": q, "seqused": index, "bt": index, "ticket": "i64", "claims": "i64",
              "stamps": "i64"},
        aligned=tuple(n for n in fn.arg_names if n.startswith("s_")))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("const", nargs="?", default="{}")
    p.add_argument("--q", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--index", default="i32", choices=("i32", "i64"))
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    from inspect_gluon_prefill_sm90 import gluon_report, print_report

    print_report(gluon_report(compile_stream(a.q, a.index, **json.loads(a.const))), a.json)


if __name__ == "__main__":
    main()
