"""``aiter-attn verify --backend NAME``: run the conformance suite on one kernel backend and
print a per-case report (exit 1 if a case fails, 2 for a usage error: an unknown backend,
case or device). ``aiter-attn verify --self-test`` runs the suite on deliberately broken
kernels (:mod:`aiter_attn.testing.conformance.mutants`) and fails unless it catches each."""

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


def _device_mismatch(backend: str, kind: str) -> str:
    """Why ``backend`` cannot run on device type ``kind`` at all ("" if some kernel can)."""
    from ..plugins import kernel_registry

    reg = kernel_registry()
    impls = [i for op in reg.ops() for i in reg.implementations(op) if i.name == backend]
    if any(i.capabilities.devices is None or kind in i.capabilities.devices for i in impls):
        return ""
    where = sorted({d for i in impls for d in i.capabilities.devices})
    hint = (" (TRITON_INTERPRET=1 runs Triton kernels in Triton's CPU interpreter)"
            if backend == "triton" else "")
    return (f"backend {backend!r} runs on {where}, not on {kind!r}{hint}; pass --device "
            f"{where[0]} on a machine that has one.")


def _usage_error(args, msg: str) -> int:
    if args.json:
        print(json.dumps({"backend": args.backend, "ok": False, "error": msg}))
    else:
        print(f"aiter-attn verify: error: {msg}")
    return 2


def _no_case_matches(cases, ops, args) -> str:
    """Why the filters (``--op``/``--case``/``--quick``) leave no case, and what to drop."""
    by_name = {c.name: c for c in cases}
    why = []
    for name in args.case or ():
        c = by_name[name]
        if ops and c.op not in ops:
            why.append(f"{name} is a {c.op} case, not one of --op {', '.join(ops)}")
        elif args.quick and not c.quick:
            why.append(f"{name} is not in the --quick subset")
    if not why:
        why.append(f"no case of {', '.join(ops or ())} is in the --quick subset")
    return f"no case matches the filters: {'; '.join(why)}. Drop or change a filter."


def _self_test(args) -> int:
    from ..testing.conformance.mutants import self_test

    rows = []
    for m, report, missed in self_test(args.device, quick=args.quick):
        failed = [r for r in report.results if r.status == "fail"]
        rows.append({"mutant": m.name, "op": m.op, "bug": m.bug, "caught": not missed,
                     "failed_cases": [r.name for r in failed], "missed": missed,
                     "first_reason": failed[0].reason if failed else ""})
    ok = all(r["caught"] for r in rows)
    if args.json:
        print(json.dumps({"self_test": True, "device": args.device, "ok": ok,
                          "mutants": rows}, indent=2))
        return 0 if ok else 1
    print(f"self-test on {args.device}: the suite must fail each deliberately broken kernel")
    for r in rows:
        if r["caught"]:
            print(f"  caught  {r['mutant']:<34} ({r['bug']}): {len(r['failed_cases'])} case(s) "
                  f"fail, e.g. {r['failed_cases'][0]}: {r['first_reason']}")
        else:
            print(f"  MISSED  {r['mutant']:<34} ({r['bug']}): cases {r['missed']} passed")
    print(f"{sum(r['caught'] for r in rows)} of {len(rows)} broken kernels caught")
    return 0 if ok else 1


def run(args) -> int:
    from ..testing.conformance import CASES, OPS, run_conformance, select_cases

    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError, ValueError) as exc:  # e.g. no CUDA in this build
        return _usage_error(args, f"--device {args.device!r} is not usable here: "
                                  f"{str(exc).splitlines()[0]}")
    if args.self_test:
        if args.backend is not None:
            return _usage_error(args, "--self-test runs its own broken kernels; drop --backend.")
        ignored = [flag for flag, value in (("--op", args.op), ("--case", args.case),
                                            ("--dtype", args.dtype), ("--strict", args.strict))
                   if value]
        if ignored:  # the self-test runs each mutant on its own cases: a filter would not apply
            return _usage_error(args, f"--self-test runs each broken kernel on its own cases; "
                                      f"drop {' '.join(ignored)} (--quick and --device apply).")
        return _self_test(args)
    if args.backend is None:
        return _usage_error(args, "pass --backend NAME (see `aiter-attn info`) or --self-test.")
    known = _known_backends()
    if args.backend not in known:
        return _usage_error(args, (
            f"backend {args.backend!r} is not registered; registered: {sorted(known)}. "
            "Is its plugin installed and allowed (AITER_ATTN_PLUGINS)? See `aiter-attn info`."))
    reason = _device_mismatch(args.backend, torch.device(args.device).type)
    if reason:
        return _usage_error(args, reason)
    all_names = {c.name for c in CASES}
    unknown = sorted(set(args.case or ()) - all_names)
    if unknown:
        return _usage_error(args, f"unknown case(s) {unknown}; cases: {sorted(all_names)}")
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    ops = args.op
    missing = sorted(set(ops or ()) - known[args.backend])
    if missing:  # its cases would all be "unsupported": nothing verified, yet exit 0
        return _usage_error(args, (
            f"backend {args.backend!r} registers no {', '.join(missing)} kernel, so --op "
            f"{' --op '.join(missing)} would verify nothing; it registers "
            f"{sorted(known[args.backend])}. Drop that --op or pick a backend that has it."))
    if not ops and not args.case:  # by default, the ops this backend implements
        ops = sorted(known[args.backend] & set(OPS))
        if not ops:
            return _usage_error(args, f"backend {args.backend!r} implements none of the ops the "
                                      f"suite checks ({', '.join(OPS)}); it registers "
                                      f"{sorted(known[args.backend])}.")
    if not select_cases(CASES, ops=set(ops or ()), quick=args.quick, names=set(args.case or ())):
        # an empty report would pass: nothing verified must not read as conformance
        return _usage_error(args, _no_case_matches(CASES, ops, args))
    report = run_conformance(args.backend, device=args.device, ops=ops, quick=args.quick,
                             names=args.case, dtype=dtype)
    # no case passed (the backend declined every one): nothing was verified, so the run must
    # not read as conformance, --strict or not
    none_passed = report.count("pass") == 0
    failed = not report.ok or none_passed or (args.strict and report.count("unsupported"))
    if args.json:
        data = report.to_dict()
        data["ok"] = not failed
        print(json.dumps(data, indent=2))
    else:
        print(report.format_table())
        if report.ok and failed:  # the table says "0 failed": say why the exit code is 1
            names = [r.name for r in report.results if r.status == "unsupported"]
            if none_passed:
                print(f"FAILED: no case passed, so nothing was verified: backend "
                      f"{args.backend!r} declined every case ({', '.join(names)}; reasons "
                      "above). Run cases its kernels serve (--op / --case / --dtype), or fix "
                      "the capabilities that decline them.")
            else:
                print(f"FAILED (--strict counts unsupported cases as failures): "
                      f"{', '.join(names)}")
    return 1 if failed else 0


def add_parser(sub) -> None:
    from ..testing.conformance.cases import OPS

    p = sub.add_parser(
        "verify", help="run the conformance suite on a kernel backend (yours or a plugin's)",
        description=__doc__)
    p.add_argument("--backend",
                   help="kernel backend name as registered (reference, triton, a plugin's)")
    p.add_argument("--self-test", action="store_true",
                   help="run the suite on deliberately broken kernels; exit 1 unless each fails")
    p.add_argument("--op", action="append", choices=OPS, help="only cases of this op (repeatable)")
    p.add_argument("--case", action="append", metavar="NAME", help="only this case (repeatable)")
    p.add_argument("--quick", action="store_true", help="a small subset (a few seconds)")
    p.add_argument("--device", default="cpu", help="device for the inputs (default: cpu)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="run every case with this activation dtype (fp8 caches stay fp8); "
                        "for kernels that take no float32")
    p.add_argument("--strict", action="store_true", help="count unsupported cases as failures")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=run)
