"""Nsight Compute evidence for the prefill kernel (issue 14 item 6): one causal prefill launch
of our Triton ``paged_attention`` and of cuDNN SDPA on the same shape, so ``ncu`` can read
their counters side by side.

Run on the GPU machine (the Firecracker runtime reads counters; leave the clocks alone)::

    ncu --clock-control none --target-processes all -k regex:'attn|attention|cudnn|sm90' \
        --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section ComputeWorkloadAnalysis \
        python3 benchmarks/ncu_prefill.py --ctx 8192

Each implementation runs three times (two warm-ups: compilation and autotuning happen there,
then the profiled launch), ours first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _inputs import make_mha  # noqa: E402
from _runners import make_cudnn, make_ours  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--impl", default="ours,cudnn")
    a = p.parse_args()
    x = make_mha(a.bs, a.ctx, q_len=a.ctx, dtype=torch.bfloat16, device="cuda")
    for impl in a.impl.split(","):
        fn, _ = {"ours": make_ours, "cudnn": make_cudnn}[impl](x)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"{impl}: ran 3 launches of bs={a.bs} causal prefill {a.ctx}", flush=True)


if __name__ == "__main__":
    main()
