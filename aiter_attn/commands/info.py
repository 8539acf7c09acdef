"""``aiter-attn info``: environment, plugins, kernels with capabilities, and the
mode × architecture table with the strategy and kernel each cell would use here."""

from __future__ import annotations

import json
import platform

import torch

from ..types import AttnArch, ForwardMode

__all__ = ["add_parser", "collect_info", "mode_arch_table"]

#: why a cell is impossible by design (not merely unimplemented).
IMPOSSIBLE: dict = {}


def _kernel_for_cell(kernels, pair, device: str, dtype: torch.dtype):
    from ..kernels.registry import KernelRequest

    op = "mla_paged_attention" if pair.arch == AttnArch.MLA else "paged_attention"
    try:
        sel = kernels.select(KernelRequest(op=op, device=device, dtype=dtype, kv_dtype=dtype,
                                           head_dim=128, v_head_dim=128, page_size=16))
        return sel.impl.name
    except ValueError as exc:
        return f"none ({exc})"


def mode_arch_table(device: str | None = None, dtype: torch.dtype | None = None) -> list[dict]:
    """One row per (mode, arch): strategy, kernel, or why none."""
    from ..plugins import kernel_registry, strategy_registry

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    strategies, kernels = strategy_registry(), kernel_registry()
    rows = []
    for arch in AttnArch:
        for mode in ForwardMode:
            pair, rejected = strategies.candidates(mode, arch)
            row = {"mode": mode.name, "arch": arch.name}
            if pair is None:
                row["strategy"] = None
                row["why"] = IMPOSSIBLE.get((mode, arch)) or (
                    f"no registered strategy serves {mode.name} × {arch.name}")
            else:
                row["strategy"] = pair.name
                row["cg_support"] = pair.cg_support.name
                row["kernel"] = _kernel_for_cell(kernels, pair, device, dtype)
            rows.append(row)
    return rows


def collect_info() -> dict:
    from ..plugins import kernel_registry, loaded_plugins

    try:
        import triton

        triton_version = triton.__version__
    except Exception as exc:  # triton is a dependency, but report rather than crash
        triton_version = f"unavailable ({exc})"
    devices = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    kernels = []
    reg = kernel_registry()
    for op in reg.ops():
        for impl in reg.implementations(op):
            c = impl.capabilities
            kernels.append({
                "op": op, "name": impl.name, "priority": impl.priority, "source": impl.source,
                "devices": sorted(c.devices) if c.devices else "any",
                "dtypes": sorted(str(d).replace("torch.", "") for d in c.dtypes) if c.dtypes else "any",
                "page_sizes": sorted(c.page_sizes) if c.page_sizes else "any",
                "features": sorted(c.features), "cg_support": c.cg_support.name,
            })
    from .. import __version__

    return {
        "aiter_attn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda_devices": devices,
        "plugins": loaded_plugins(),
        "kernels": kernels,
        "table": mode_arch_table(),
    }


def _print_text(info: dict) -> None:
    print(f"aiter_attn {info['aiter_attn']}  python {info['python']}  torch {info['torch']}  "
          f"triton {info['triton']}")
    print(f"devices: {', '.join(info['cuda_devices']) or 'cpu only'}")
    print(f"plugins: {', '.join(info['plugins'])}")
    print("\nkernels:")
    for k in info["kernels"]:
        print(f"  {k['op']:<24} {k['name']:<12} prio={k['priority']:<4} devices={k['devices']} "
              f"dtypes={k['dtypes']} pages={k['page_sizes']} cg={k['cg_support']} "
              f"features={','.join(k['features']) or '-'}")
    print("\nmode × architecture:")
    print(f"  {'mode':<16} {'arch':<6} {'strategy':<22} kernel / why not")
    for r in info["table"]:
        if r["strategy"]:
            print(f"  {r['mode']:<16} {r['arch']:<6} {r['strategy']:<22} {r['kernel']}")
        else:
            print(f"  {r['mode']:<16} {r['arch']:<6} {'-':<22} {r['why']}")


def run(args) -> int:
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_text(info)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show environment, plugins, kernels and the mode×arch table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)
