"""``aiter-attn verify --backend NAME``: run the conformance suite on one kernel backend and
print a per-case report (exit 1 if a case fails, 2 if the backend is unknown)."""

from __future__ import annotations

import json

import torch

__all__ = ["add_parser", "run"]


def _known_backends() -> dict:
    from ..plugins import kernel_registry

    reg = kernel_registry()
    names: dict = {}
    for op in reg.ops():
        for impl in reg.implementations(op):
            names.setdefault(impl.name, set()).add(op)
    return names


def run(args) -> int:
    from ..testing.conformance import CASES, run_conformance

    known = _known_backends()
    if args.backend not in known:
        msg = (f"backend {args.backend!r} is not registered; registered: {sorted(known)}. "
               "Is its plugin installed and allowed (AITER_ATTN_PLUGINS)? See `aiter-attn info`.")
        if args.json:
            print(json.dumps({"backend": args.backend, "ok": False, "error": msg}))
        else:
            print(msg)
        return 2
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError, ValueError) as exc:  # e.g. no CUDA in this build
        print(f"--device {args.device!r} is not usable here: {exc}")
        return 2
    all_names = {c.name for c in CASES}
    unknown = sorted(set(args.case or ()) - all_names)
    if unknown:
        print(f"unknown case(s) {unknown}; cases: {sorted(all_names)}")
        return 2
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    report = run_conformance(args.backend, device=args.device, ops=args.op, quick=args.quick,
                             names=args.case, dtype=dtype)
    failed = not report.ok or (args.strict and report.count("unsupported"))
    if args.json:
        data = report.to_dict()
        data["ok"] = not failed
        print(json.dumps(data, indent=2))
    else:
        print(report.format_table())
    return 1 if failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "verify", help="run the conformance suite on a kernel backend (yours or a plugin's)")
    p.add_argument("--backend", required=True,
                   help="kernel backend name as registered (reference, triton, a plugin's)")
    p.add_argument("--op", action="append", choices=("paged_attention", "mla_paged_attention"),
                   help="only cases of this op (repeatable)")
    p.add_argument("--case", action="append", metavar="NAME", help="only this case (repeatable)")
    p.add_argument("--quick", action="store_true", help="a small subset (a few seconds)")
    p.add_argument("--device", default="cpu", help="device for the inputs (default: cpu)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="run every case with this activation dtype (fp8 caches stay fp8); "
                        "for kernels that take no float32")
    p.add_argument("--strict", action="store_true", help="count unsupported cases as failures")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=run)
