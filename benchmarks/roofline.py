"""Roofline plot of a ``bench_attention`` run: achieved TFLOP/s against arithmetic intensity
(FLOP per byte moved), with the copy-bandwidth and matmul ceilings measured in the same run."""

from __future__ import annotations

__all__ = ["plot"]

MARKERS = {"ours": "o", "cudnn": "s", "fa2": "^", "flex": "v", "aiter": "D", "ours-bf16": "."}


def plot(results, meta, path, mode="graph"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw = meta.get("copy_tbps", 4.27)
    peak = meta.get("matmul_tflops", 672.0)
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [10 ** (i / 20) for i in range(-20, 81)]
    ax.plot(xs, [min(peak, bw * x) for x in xs], "k-", lw=1,
            label=f"ceiling: {bw:.2f} TB/s copy, {peak:.0f} TFLOP/s bf16 matmul")
    colors = {}
    for case in results:
        if "impls" not in case:
            continue
        for rec in case["impls"]:
            name = rec["impl"]
            if name not in MARKERS:
                continue
            # the record's own counts where it has them (an fp8 row's bf16 twin reads a bf16
            # cache: the row's fp8 bytes would put it at twice its intensity)
            ai = rec.get("flops", case["flops"]) / rec.get("bytes", case["bytes"])
            val = rec.get(f"{mode}_tflops") or rec.get("eager_tflops")
            if not val:
                continue
            color = colors.setdefault(case["kind"], f"C{len(colors)}")
            ax.scatter(ai, val, marker=MARKERS[name], color=color, s=36,
                       facecolors="none" if name != "ours" else color)
            if name == "ours":
                ax.annotate(case["case"], (ai, val), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
    for kind, color in colors.items():
        ax.scatter([], [], color=color, marker="o", label=kind)
    for name, m in MARKERS.items():
        ax.scatter([], [], color="gray", marker=m, facecolors="none", label=name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte moved)")
    ax.set_ylabel(f"achieved TFLOP/s ({mode})")
    ax.set_title(f"aiter_attn attention on {meta.get('device', '?')} ({meta.get('started', '')})")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
