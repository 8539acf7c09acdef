"""Kernel durations (``torch.profiler``, CUDA time per launch) of the decode step planned once
into the static workspace (``bench_variants.py``'s ``planned`` variants), with the split
reduction as its own launch and fused into the attention launch
(``TUNING_OVERRIDES["fused_reduce"]``): 1x4k, 8x64k and 1x32k, GQA 32/8, d128, page 16, bf16.

Usage (GPU)::

    python benchmarks/profile_fused_reduce.py
    ncu --clock-control none --profile-from-start off --section SpeedOfLight \
        --section LaunchStats --section WarpStateStats --section Occupancy \
        python benchmarks/profile_fused_reduce.py --ncu     # one 1x4k launch of each
"""

from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_variants as bv  # noqa: E402
from _inputs import make_mha  # noqa: E402


def ncu_launches() -> None:
    """One 1x4k launch of each variant between ``cudaProfilerStart``/``Stop`` (for ``ncu
    --profile-from-start off``), after three warm-up launches."""
    x = make_mha(1, 4096)
    for variant in ("planned", "planned-fused"):
        fn, _ = bv._ours(x, variant)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def main() -> None:
    if "--ncu" in sys.argv[1:]:
        ncu_launches()
        return
    for bs, ctx in ((1, 4096), (8, 65536), (1, 32768)):
        x = make_mha(bs, ctx)
        for variant in ("planned", "planned-fused"):
            fn, _ = bv._ours(x, variant)
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            per_kernel = {e.key[:40]: (e.count, e.self_device_time_total / max(e.count, 1))
                          for e in prof.key_averages() if e.self_device_time_total}
            print(f"{bs}x{ctx} {variant}:",
                  {k: f"n={n} {us:.1f}us" for k, (n, us) in per_kernel.items()}, flush=True)


if __name__ == "__main__":
    main()
