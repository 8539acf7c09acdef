"""``aiter-attn info``: environment, plugins, kernels with capabilities, and the
mode × architecture table with the strategy and kernel each cell would use here."""

from __future__ import annotations

import json
import platform

import torch

from ..types import AttnArch, ForwardMode

__all__ = ["add_parser", "collect_info", "mode_arch_table", "table_markdown", "kv_formats_table",
           "kv_formats_markdown", "CASCADE_NOTE", "BATCH_INVARIANT_NOTE", "ENGINE_STEPS_NOTE",
           "HOPPER_NOTE"]


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
                # the pairs registered for this cell and why each declined (their supports())
                own = [(p.name, p.reject_reason(mode, arch, cfg)) for p in strategies.pairs()
                       if p.arch == arch and mode in p.modes]
                if own:
                    why += ": " + "; ".join(f"{n}: {r}" for n, r in own)
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


#: KV-cache formats the table lists: (label, cache dtypes, kv_scale_granularity, scales).
_KV_FORMATS = [
    ("fp16 / bf16 / fp32", ("float16", "bfloat16", "float32"), "per_layer",
     "none (K/V stored as given; k/v scales ignored)"),
    ("fp8 e4m3", ("float8_e4m3fn",), "per_layer", "`LayerSpec.k_scale`/`v_scale`"),
    ("fp8 e5m2", ("float8_e5m2",), "per_layer", "`LayerSpec.k_scale`/`v_scale`"),
    ("fp8 e4m3, per-(token, head) scales", ("float8_e4m3fn",), "per_token_head",
     "float32 per slot and KV head (pool), layer scales on top"),
    ("fp8 e5m2, per-(token, head) scales", ("float8_e5m2",), "per_token_head",
     "float32 per slot and KV head (pool), layer scales on top"),
]

#: Ops of each architecture family: attention op, KV-write ops, request dims.
_KV_OPS = [
    ("MHA/SWA", "paged_attention", ("write_kv", "write_kv_swa"),
     dict(head_dim=128, v_head_dim=128, page_size=16)),
    ("VEC5D", "paged_attention_5d", ("write_kv_5d",),
     dict(head_dim=128, v_head_dim=128, page_size=16)),
    ("MLA", "mla_paged_attention", ("write_kv",),
     dict(head_dim=576, v_head_dim=512, page_size=64)),
]
_BUILTIN_KERNELS = ("reference", "triton")


def kv_formats_table() -> list[dict]:
    """One row per KV-cache format: its scales, the architectures a ``BackendConfig`` accepts
    it on, and per architecture family the built-in kernels (reference, Triton) whose declared
    capabilities serve its attention op and KV writes (on CUDA; device-independent)."""
    from ..kernels.registry import KernelRequest
    from ..kv_scales import PER_TOKEN_HEAD, TOKEN_SCALE_FEATURE
    from ..plugins import kernel_registry
    from ..types import BackendConfig

    reg = kernel_registry()

    def served(op, dtypes, features, dims):
        names = []
        for impl in reg.implementations(op):
            if impl.name not in _BUILTIN_KERNELS:
                continue
            ok = all(impl.capabilities.reject_reason(KernelRequest(
                op=op, device="cuda", dtype=torch.bfloat16, kv_dtype=getattr(torch, d),
                features=features, **dims)) is None for d in dtypes)
            if ok:
                names.append(impl.name)
        return ", ".join(sorted(names)) or "—"

    rows = []
    for label, dtypes, gran, scales in _KV_FORMATS:
        archs = []
        for arch in AttnArch:
            try:
                BackendConfig(arch=arch, kv_cache_dtype=getattr(torch, dtypes[0]),
                              kv_scale_granularity=gran)
                archs.append(arch.name)
            except ValueError:
                pass
        fp8 = dtypes[0].startswith("float8")
        features = ({"fp8"} if fp8 else set()) | (
            {TOKEN_SCALE_FEATURE} if gran == PER_TOKEN_HEAD else set())
        row = {"format": label, "cache_dtype": ", ".join(f"torch.{d}" for d in dtypes),
               "kv_scale_granularity": gran, "scales": scales, "archs": archs, "kernels": {}}
        for family, attn_op, write_ops, dims in _KV_OPS:
            if not set(family.split("/")) & set(archs):
                row["kernels"][family] = "—"
                continue
            attn = served(attn_op, dtypes, features, dims)
            writes = " / ".join(dict.fromkeys(served(w, dtypes, features, dims)
                                              for w in write_ops))
            row["kernels"][family] = f"attention: {attn}; write: {writes}"
        rows.append(row)
    return rows


def kv_formats_markdown(rows: list[dict]) -> str:
    """The KV formats table as Markdown (``docs/modes.md`` embeds it)."""
    fams = [f for f, *_ in _KV_OPS]
    lines = ["| format | cache dtype | `kv_scale_granularity` | scales | architectures | "
             + " | ".join(f"{f} kernels" for f in fams) + " |",
             "| --- " * (5 + len(fams)) + "|"]
    for r in rows:
        lines.append(f"| {r['format']} | {r['cache_dtype']} | `{r['kv_scale_granularity']}` | "
                     f"{r['scales']} | {', '.join(r['archs'])} | "
                     + " | ".join(r["kernels"][f] for f in fams) + " |")
    return "\n".join(lines) + "\n"


def collect_info(device: str | None = None) -> dict:
    """Everything ``aiter-attn info`` reports; ``device``: the device type the table's
    kernels are selected for (default: ``cuda`` where available, else ``cpu``)."""
    from ..plugins import kernel_registry, loaded_plugins, shadowed_plugins, skipped_plugins

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
                # None is "any"; an empty set serves nothing and is shown as such ([])
                "devices": sorted(c.devices) if c.devices is not None else "any",
                "dtypes": (sorted(str(d).replace("torch.", "") for d in c.dtypes)
                           if c.dtypes is not None else "any"),
                "page_sizes": sorted(c.page_sizes) if c.page_sizes is not None else "any",
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
        "shadowed_plugins": shadowed_plugins(),
        "kernels": kernels,
        "table": mode_arch_table(device=device),
        "engine_steps": ENGINE_STEPS_NOTE,
        "cascade": CASCADE_NOTE,
        "batch_invariant": BATCH_INVARIANT_NOTE,
        "hopper_kernels": HOPPER_NOTE,
        "kv_formats": kv_formats_table(),
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


#: The warp-specialised Gluon kernels (issue 14): where they run instead of the Triton ones.
HOPPER_NOTE = (
    "Warp-specialised Hopper kernels (Gluon; automatic on NVIDIA sm_90, nothing to set): "
    "causal dense prefill and extend passes of bf16/fp16 at head dim 64/128 (left windows "
    "included) run `prefill_gluon_ws` (a loader warp and two 64-row consumer warpgroups "
    "sharing each K/V tile); MLA decode and verify in 64-head blocks of bf16/fp16 latents "
    "512 + 64 (pages of a multiple of 64 keys, no mask) run `mla_gluon` "
    "(`aiter_attn.kernels.triton.mla.mla_paged_attention(..., gluon=False)` keeps the Triton kernel); plain bf16/fp16 "
    "decode (no sinks, soft-cap, left window or scales; NHD pages of a multiple of 16 keys) "
    "runs `decode_gluon` (TMA page loads, keys as the wgmma M side; "
    "`TUNING_OVERRIDES['gluon_decode'] = False` keeps the Triton kernel); every other launch "
    "runs the Triton kernels.")


#: Batch-invariant mode (issue 16): how it is turned on, what it promises, what it turns off.
BATCH_INVARIANT_NOTE = (
    "Batch-invariant mode (`BackendConfig(batch_invariant=True)`, "
    "`EngineConfig(batch_invariant=True)`, `aiter-attn generate --deterministic`, "
    "`ops.*(..., batch_invariant=True)`; off by default): every cell above selects only "
    "kernels declaring the `batch_invariant` feature (reference and Triton for "
    "`paged_attention`, `paged_attention_5d` and `mla_paged_attention`; not aiter's), with "
    "tiles fixed by the head geometry, keys split at absolute 512-key positions and the "
    "splits reduced in index order without atomics, so a request's attention output is "
    "bitwise identical whatever shares its batch, eager or CUDA-graph replayed; cascade "
    "attention and the engine's one-forward mixed steps are off in this mode.")


def _print_text(info: dict) -> None:
    print(f"aiter_attn {info['aiter_attn']}  python {info['python']}  torch {info['torch']}  "
          f"triton {info['triton']}")
    print(f"devices: {', '.join(info['cuda_devices']) or 'cpu only'}")
    print(f"plugins: {', '.join(info['plugins'])}")
    for name, reason in info["skipped_plugins"].items():
        print(f"  skipped {name}: {reason}")
    for entry, reason in info["shadowed_plugins"].items():
        print(f"  left out {entry}: {reason}")
    print("\nkernels:")
    for k in info["kernels"]:
        print(f"  {k['op']:<24} {k['name']:<12} prio={k['priority']:<4} devices={k['devices']} "
              f"dtypes={k['dtypes']} pages={k['page_sizes']} cg={k['cg_support']} "
              f"features={','.join(k['features']) or '-'}")
    print("\nmode × architecture:")
    print(f"  {'mode':<20} {'arch':<6} {'strategy':<24} {'graph: pair/cell':<28} "
          "kernel / why not")
    for r in info["table"]:
        if r["strategy"]:
            cg = f"{r['cg_support']}/{r['cell_cg_support']}"
            print(f"  {r['mode']:<20} {r['arch']:<6} {r['strategy']:<24} {cg:<28} {r['kernel']}")
        else:
            print(f"  {r['mode']:<20} {r['arch']:<6} {'-':<24} {'-':<28} {r['why']}")
    print(f"\n{info['engine_steps']}")
    print(f"\n{info['cascade']}")
    print(f"\n{info['batch_invariant']}")
    print(f"\n{info['hopper_kernels']}")
    print("\nKV formats (built-in kernels per architecture family):")
    for r in info["kv_formats"]:
        print(f"  {r['format']:<36} {r['kv_scale_granularity']:<15} "
              f"archs={','.join(r['archs'])}")
        for fam, k in r["kernels"].items():
            print(f"      {fam:<8} {k}")


def table_markdown(rows: list[dict]) -> str:
    """The mode × architecture table as Markdown (``docs/modes.md`` embeds it)."""
    lines = ["| mode | arch | strategy | CUDA graph: pair / cell | kernel op:impl (or why none) |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if r["strategy"]:
            lines.append(f"| {r['mode']} | {r['arch']} | `{r['strategy']}` | {r['cg_support']} / "
                         f"{r['cell_cg_support']} | {r['kernel']} |")
        else:
            lines.append(f"| {r['mode']} | {r['arch']} | — | — | {r['why']} |")
    lines += ["", ENGINE_STEPS_NOTE, "", CASCADE_NOTE, "", BATCH_INVARIANT_NOTE, "",
              HOPPER_NOTE]
    return "\n".join(lines) + "\n"


def _device_type(device: str | None) -> str | None:
    """``--device``'s device type (``cuda:1`` → ``cuda``: kernels declare types)."""
    from .errors import UsageError

    if device is None:
        return None
    try:
        return torch.device(device).type
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {device!r} is not a device: {str(exc).splitlines()[0]} "
                         "Pass a device type such as cpu or cuda.") from exc


def run(args) -> int:
    device = _device_type(args.device)
    if args.markdown:
        print(table_markdown(mode_arch_table(device=device)), end="")
        return 0
    if args.kv_formats:
        print(kv_formats_markdown(kv_formats_table()), end="")
        return 0
    info = collect_info(device=device)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        _print_text(info)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="show environment, plugins, kernels and the mode×arch table")
    output = p.add_mutually_exclusive_group()  # each prints a different document
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument("--markdown", action="store_true",
                        help="print only the mode × architecture table as Markdown")
    output.add_argument("--kv-formats", action="store_true",
                        help="print only the KV-cache formats table as Markdown")
    p.add_argument("--device", default=None, help="device type the table's kernels are for")
    p.set_defaults(func=run)
