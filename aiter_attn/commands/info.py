"""``aiter-attn info``: environment, plugins, kernels with capabilities, and the
mode × architecture table with the strategy and kernel each cell would use here."""

from __future__ import annotations

import json
import platform

import torch

from ..types import AttnArch, ForwardMode

__all__ = ["add_parser", "collect_info", "mode_arch_table", "table_markdown", "CASCADE_NOTE"]


def _kernel_for_cell(kernels, pair, mode, cfg, device: str, dtype: torch.dtype):
    """``(text, kernel cg_support or None)``: the kernel the pair's op would get here for a
    typical layer (head dim 128, page 16), with the mask its mode contract plans."""
    from ..kernels.registry import KernelRequest

    op = pair.kernel_op
    dims = dict(head_dim=576, v_head_dim=512, page_size=64) if op == "mla_paged_attention" else \
        dict(head_dim=128, v_head_dim=128, page_size=16)
    features = {"custom_mask"} if pair.contract(mode).has_mask(cfg) else set()
    try:
        sel = kernels.select(KernelRequest(op=op, device=device, dtype=dtype, kv_dtype=dtype,
                                           features=features, **dims))
        return f"{op}:{sel.impl.name}", sel.impl.capabilities.cg_support
    except ValueError as exc:
        return f"{op}: none ({exc})", None


#: Table rows: (label, mode, spec topk or None, forced strategy name template or None).
_CELLS = [
    ("EXTEND", ForwardMode.EXTEND, None, None),
    ("DECODE", ForwardMode.DECODE, None, None),
    ("IDLE", ForwardMode.IDLE, None, None),
    ("TARGET_VERIFY chain", ForwardMode.TARGET_VERIFY, 1, None),
    ("TARGET_VERIFY tree", ForwardMode.TARGET_VERIFY, 4, None),
    ("DRAFT_EXTEND", ForwardMode.DRAFT_EXTEND, None, None),
    ("DRAFT_EXTEND_V2", ForwardMode.DRAFT_EXTEND_V2, 1, None),
    ("multi-step DRAFT", ForwardMode.DECODE, 1, "{arch}.draft_decode_step"),
]


def mode_arch_table(device: str | None = None, dtype: torch.dtype | None = None) -> list[dict]:
    """One row per (mode, arch) cell: strategy, CUDA-graph support, kernel, or why none."""
    from ..plugins import kernel_registry, strategy_registry
    from ..types import BackendConfig, SpecDecodeConfig

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    strategies, kernels = strategy_registry(), kernel_registry()
    rows = []
    for arch in AttnArch:
        for label, mode, topk, forced in _CELLS:
            spec = None if topk is None else SpecDecodeConfig(topk=topk, num_draft_tokens=4)
            cfg = BackendConfig(arch=arch, spec=spec, page_size=16)
            row = {"mode": label, "arch": arch.name}
            if forced is not None:
                name = forced.format(arch=arch.value)
                try:
                    pair = strategies.select(mode, arch, cfg, name=name)
                except ValueError as exc:
                    pair, why = None, str(exc)
            else:
                pair, rejected = strategies.candidates(mode, arch, cfg)
                why = f"no registered strategy serves {label} × {arch.name}"
            if pair is None:
                row.update(strategy=None, why=why)
            else:
                kernel, kcg = _kernel_for_cell(kernels, pair, mode, cfg, device, dtype)
                c = pair.contract(mode)
                cell = pair.cg_support if kcg is None else min(pair.cg_support, kcg)
                row.update(strategy=pair.name, cg_support=pair.cg_support.name, kernel=kernel,
                           cell_cg_support=cell.name, tokens_per_request=c.tokens,
                           kv_slack=c.kv_slack, mask="tree" if c.has_mask(cfg) else "none")
            rows.append(row)
    return rows


def collect_info() -> dict:
    from ..plugins import kernel_registry, loaded_plugins, skipped_plugins

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
        "skipped_plugins": skipped_plugins(),
        "kernels": kernels,
        "table": mode_arch_table(),
        "engine_steps": ENGINE_STEPS_NOTE,
        "cascade": CASCADE_NOTE,
    }


#: How the reference engine maps its steps onto the table's cells (``aiter_attn.engine``).
ENGINE_STEPS_NOTE = (
    "Engine steps (`aiter_attn.engine`): a pure decode step is one DECODE forward "
    "(CUDA-graph replayed); a mixed step (requests decoding while others prefill) is one "
    "EXTEND forward whose decoding requests are extend rows of query length 1, so one "
    "attention launch per layer (`EngineConfig(mixed_steps=False)`, speculative decoding "
    "and batch-invariant mode run a DECODE forward and an EXTEND forward instead).")


#: Cascade attention (issue 16): where it applies and how it is turned on.
CASCADE_NOTE = (
    "Cascade attention (`BackendConfig(cascade_min_shared_tokens=N)`, off by default): on "
    "the MHA and SWA cells whose layers are causal without a tree mask (every row above but "
    "tree verify), runs of consecutive requests whose page tables start with the same pages "
    "over ≥ N tokens read those pages once per run, merged by LSE with each request's own "
    "pages; grouped on the device every step (no sync), CUDA-graph capturable with the "
    "Triton kernels (eager-only over the reference).")


def _print_text(info: dict) -> None:
    print(f"aiter_attn {info['aiter_attn']}  python {info['python']}  torch {info['torch']}  "
          f"triton {info['triton']}")
    print(f"devices: {', '.join(info['cuda_devices']) or 'cpu only'}")
    print(f"plugins: {', '.join(info['plugins'])}")
    for name, reason in info["skipped_plugins"].items():
        print(f"  skipped {name}: {reason}")
    print("\nkernels:")
    for k in info["kernels"]:
        print(f"  {k['op']:<24} {k['name']:<12} prio={k['priority']:<4} devices={k['devices']} "
              f"dtypes={k['dtypes']} pages={k['page_sizes']} cg={k['cg_support']} "
              f"features={','.join(k['features']) or '-'}")
    print("\nmode × architecture:")
    print(f"  {'mode':<20} {'arch':<6} {'strategy':<24} {'cuda graph':<14} kernel / why not")
    for r in info["table"]:
        if r["strategy"]:
            print(f"  {r['mode']:<20} {r['arch']:<6} {r['strategy']:<24} {r['cg_support']:<14} "
                  f"{r['kernel']}")
        else:
            print(f"  {r['mode']:<20} {r['arch']:<6} {'-':<24} {'-':<14} {r['why']}")
    print(f"\n{info['engine_steps']}")
    print(f"\n{info['cascade']}")


def table_markdown(rows: list[dict]) -> str:
    """The mode × architecture table as Markdown (``docs/modes.md`` embeds it)."""
    lines = ["| mode | arch | strategy | CUDA graph | kernel op:impl (or why none) |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["strategy"]:
            lines.append(f"| {r['mode']} | {r['arch']} | `{r['strategy']}` | {r['cg_support']} | "
                         f"{r['kernel']} |")
        else:
            lines.append(f"| {r['mode']} | {r['arch']} | — | — | {r['why']} |")
    lines += ["", ENGINE_STEPS_NOTE, "", CASCADE_NOTE]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    if args.markdown:
        print(table_markdown(mode_arch_table(device=args.device)), end="")
        return 0
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_text(info)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show environment, plugins, kernels and the mode×arch table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true",
                   help="print only the mode × architecture table as Markdown")
    p.add_argument("--device", default=None, help="device type the table's kernels are for")
    p.set_defaults(func=run)
