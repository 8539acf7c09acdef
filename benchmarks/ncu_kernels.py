"""Nsight Compute evidence for the kernel targets of issue 14 that are missed: one launch of
each case, ours beside cuDNN where cuDNN has the shape, inside one profiled region so ``ncu``
reads every kernel's counters in a single process.

Cases (``--cases``, comma-separated; default all), bf16, GQA 32/8, d128, page 16 unless said:

* ``prefill-dense`` / ``prefill-cudnn``: causal prefill 1×8k, our dense extend kernel
  (``extend_attention``, planned once) and cuDNN SDPA;
* ``decode1x4k`` / ``decode1x4k-cudnn``, ``decode16x4k`` / ``decode16x4k-cudnn``,
  ``decode1x32k`` / ``decode1x32k-cudnn``: small-batch decode (our split launch and its
  reduction are two kernels);
* ``mla16`` (16 heads, 64×4k), ``mla16-desc`` (its latent tiles through tensor descriptors),
  ``mla16-desc-lazy`` (and the lazy rescale), ``mla16-split2`` (q·Kᵀ as two mma chains),
  ``mla16-all`` (descriptors, lazy rescale, 16-bit partials, two chains),
  ``mla16-narrow`` (the same on the narrow Gluon kernel), ``mla16-stream`` (the persistent
  stream kernel, :mod:`aiter_attn.kernels.triton.mla_stream_gluon`) and
  ``mla128`` (128 heads, 64×4k): MLA decode, rank 512 + 64;
* ``fp8-64x16k`` / ``bf16-64x16k``: decode over an fp8 e4m3 cache and the same in bf16.

Every case runs three times first (compiles, autotuning), then once between
``cudaProfilerStart``/``Stop`` inside an NVTX range named after the case. On the GPU::

    ncu --clock-control none --profile-from-start off --nvtx --target-processes all \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        python3 benchmarks/ncu_kernels.py

(Firecracker runtimes read counters; on gVisor ``ncu`` cannot.) Without ``ncu`` the script
just runs every case once (a smoke of the harness on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _inputs import make_mha, make_mla  # noqa: E402
from _runners import make_cudnn, make_ours, make_ours_mla  # noqa: E402


def _prefill(impl):
    from bench_prefill import Inputs, make_cudnn as prefill_cudnn, make_dense

    x = Inputs(1, 8192, 0)
    fn = (make_dense if impl == "dense" else prefill_cudnn)(x)[0]
    return fn, x


def _decode(bs, ctx, impl, kv_dtype=None):
    x = make_mha(bs, ctx, kv_dtype=kv_dtype, dense=impl == "cudnn")
    fn = (make_cudnn if impl == "cudnn" else make_ours)(x)[0]
    return fn, x


def _mla(heads, **launch):
    x = make_mla(64, 4096, heads=heads)
    return make_ours_mla(x, **launch)[0], x


CASES = {
    "prefill-dense": lambda: _prefill("dense"),
    "prefill-cudnn": lambda: _prefill("cudnn"),
    "decode1x4k": lambda: _decode(1, 4096, "ours"),
    "decode1x4k-cudnn": lambda: _decode(1, 4096, "cudnn"),
    "decode16x4k": lambda: _decode(16, 4096, "ours"),
    "decode16x4k-cudnn": lambda: _decode(16, 4096, "cudnn"),
    "decode1x32k": lambda: _decode(1, 32768, "ours"),
    "decode1x32k-cudnn": lambda: _decode(1, 32768, "cudnn"),
    "mla16": lambda: _mla(16),
    "mla16-narrow": lambda: _mla(16, narrow=True),  # the narrow Gluon kernel (sm_90)
    "mla16-ring": lambda: _mla(16, ring=True),  # the ring Gluon kernel (sm_90)
    "mla16-stream": lambda: _mla(16, stream=True),  # the persistent stream kernel (sm_90)
    "mla16-desc": lambda: _mla(16, kv_desc=True),  # latent tiles through tensor descriptors
    "mla16-desc-lazy": lambda: _mla(16, kv_desc=True, lazy_rescale=True),  # and lazy rescale
    # and 16-bit partials, q·Kᵀ as two mma chains
    "mla16-all": lambda: _mla(16, kv_desc=True, lazy_rescale=True, half_partials=True,
                              qk_split=2),
    "mla16-split2": lambda: _mla(16, qk_split=2),  # q·Kᵀ as two mma chains
    # four chains, the lazy rescale and 16-bit partials on pointer loads
    "mla16-lazy-half-split4": lambda: _mla(16, lazy_rescale=True, half_partials=True,
                                           qk_split=4),
    "mla128": lambda: _mla(128),
    "fp8-64x16k": lambda: _decode(64, 16384, "ours", kv_dtype=torch.float8_e4m3fn),
    "bf16-64x16k": lambda: _decode(64, 16384, "ours"),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES))
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("ncu_kernels needs a CUDA GPU.")
    for name in a.cases.split(","):
        try:
            fn, keep = CASES[name]()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # one case that cannot run must not hide the others
            print(f"{name}: skipped ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            continue
        torch.cuda.profiler.start()
        with torch.cuda.nvtx.range(name):
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"{name}: profiled one launch", flush=True)
        del fn, keep
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
