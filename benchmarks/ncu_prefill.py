"""Nsight Compute evidence for the prefill kernel (issue 14 item 6): one causal prefill launch
of our Triton ``paged_attention`` (``ours``), our dense prefill (``dense``: Gluon on sm_90)
and cuDNN SDPA on the same shape, so ``ncu`` can read their counters side by side.

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


def make_dense(x):
    """Our dense prefill (``dense_prefill``, the default launch: Gluon on sm_90) over the same
    keys and values as ``[T, Hkv, D]`` tensors."""
    from aiter_attn.kernels.triton.prefill import dense_prefill

    def flat(t):  # [B, H, L, D] -> [B·L, H, D]
        return t.permute(0, 2, 1, 3).reshape(-1, t.shape[1], t.shape[3]).contiguous()

    k, v = flat(x.dense_k), flat(x.dense_v)
    out = torch.empty_like(x.q)

    def fn():
        dense_prefill(x.q, k, v, out, cu_seqlens_q=x.cu_seqlens_q, cu_seqlens_k=x.cu_seqlens_q,
                      max_seqlen_q=x.q_len, max_seqlen_k=x.q_len, softmax_scale=x.scale)

    return fn, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--impl", default="ours,cudnn", help="comma list of ours (paged), dense, "
                   "cudnn")
    a = p.parse_args()
    x = make_mha(a.bs, a.ctx, q_len=a.ctx, dtype=torch.bfloat16, device="cuda")
    for impl in a.impl.split(","):
        fn, _ = {"ours": make_ours, "cudnn": make_cudnn, "dense": make_dense}[impl](x)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        print(f"{impl}: ran 3 launches of bs={a.bs} causal prefill {a.ctx}", flush=True)


if __name__ == "__main__":
    main()
