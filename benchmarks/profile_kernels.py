"""Per-kernel GPU time of one call, from the CUDA profiler (CUPTI through ``torch.profiler``):
where the time of a multi-launch call goes, without Nsight Compute.

Cases (``--cases``, comma-separated; default all), bf16, GQA 32/8, d128, page 16:

* ``cascade`` / ``no-cascade``: the issue-16 workload (64 decode requests sharing a
  4,096-token prefix, 256 own tokens each), the cascade kernel object (own pass, shared pass,
  merge) and the plain paged kernel over the full tables;
* ``decode1x4k``, ``decode16x4k``, ``decode1x32k``: our split decode (attention + reduction)
  and cuDNN SDPA on the dense equivalent.

Each case runs 5 times untimed, then ``--iters`` times under the profiler; the table gives,
per kernel name, calls per iteration and mean µs per call, and the sum per iteration (GPU
busy time, launch gaps excluded). On the GPU::

    python3 benchmarks/profile_kernels.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


def _cascade(with_cascade: bool):
    from _cascade import _bind, _metadata, make_shared_decode

    from aiter_attn.kernels.base import LayerParams
    from aiter_attn.kernels.cascade import CascadeKernel, _impl_for

    dev = torch.device("cuda")
    bs, shared, own, hq, hkv, d, page = 64, 4096, 256, 32, 8, 128, 16
    q, kc, vc, bt, cu, seqused = make_shared_decode(bs, shared, own, hq=hq, hkv=hkv, d=d,
                                                    page=page, dtype=torch.bfloat16,
                                                    device=dev)
    md = _metadata(cu, seqused, bt, page, shared + own, bs)
    params = LayerParams.create(scale=d ** -0.5, device=dev, num_q_heads=hq, num_kv_heads=hkv,
                                head_dim=d, v_head_dim=d)
    if with_cascade:
        inner = _bind(q, kc, vc, "triton", lse=True)
        kernel = CascadeKernel(inner, min_shared_tokens=1024, impl=_impl_for(inner, dev))
    else:
        kernel = _bind(q, kc, vc, "triton", lse=False)
    plan = kernel.plan(md)
    out = torch.empty(bs, hq, d, dtype=torch.bfloat16, device=dev)
    return lambda: kernel.run(q, (kc, vc), plan, params, out)


def _ncu_case(name):
    """A decode case of ``ncu_kernels.py`` (the same inputs and runners): its launch."""
    from ncu_kernels import CASES as NCU_CASES

    return NCU_CASES[name]()[0]


CASES = {
    "cascade": lambda: _cascade(True),
    "no-cascade": lambda: _cascade(False),
    **{name: (lambda name=name: _ncu_case(name))
       for name in ("decode1x4k", "decode1x4k-cudnn", "decode16x4k", "decode16x4k-cudnn",
                    "decode1x32k", "decode1x32k-cudnn")},
}


def profile(fn, iters: int) -> dict:
    """``{kernel name: (calls per iteration, mean µs)}`` and the busy µs per iteration."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(list)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name].append(ev.device_time)
    kernels = {name[:90]: (len(ts) / iters, sum(ts) / len(ts)) for name, ts in per.items()}
    busy = sum(c * us for c, us in kernels.values())
    return {"kernels": kernels, "busy_us": busy}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for name in args.cases.split(","):
        try:
            res = profile(CASES[name](), args.iters)
        except Exception as exc:  # keep the other cases
            print(f"{name}: failed: {exc!r}"[:300], flush=True)
            continue
        results[name] = res
        print(f"== {name}: {res['busy_us']:.2f} µs GPU busy per call", flush=True)
        for k, (calls, us) in sorted(res["kernels"].items(), key=lambda kv: -kv[1][1]):
            print(f"   {calls:4.1f} × {us:8.2f} µs  {k}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_kernels.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
