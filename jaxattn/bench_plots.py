"""PNG plots of `jaxattn bench` rows (matplotlib, imported here only: ImportError when it is absent).

    tflops_vs_seqlen.png    TFLOP/s against sequence length per implementation (the "sweep" cases),
                            one panel per dtype and mode
    small_call_latency.png  µs per call of the small calls, bars per implementation (log scale)
    decode_gbps.png         GB/s of the decode cases, bars per implementation
    vs_torch.png            our implementations' paired ratio to torch's fastest backend per cell

Every point and bar is the median over the repeats, with an error bar from the slowest to the
fastest repeat (for ratios: the lowest to the highest per-round ratio); rows too unsteady to
compare (`jaxattn.bench_spread`) are drawn hollow (bars) or with a white centre (points).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from .bench_report import throughput_range

SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _ok(rows, pred):
    return [r for r in rows if r["status"] == "ok" and pred(r)]


#: One colour per implementation in every plot (ours: blues, greens, orange; torch's: reds, purple, greys).
COLORS = {
    "sdpa": "#1f77b4", "flash": "#ff7f0e", "decode": "#2ca02c", "vanilla": "#17becf", "auto": "#bcbd22",
    "torch-math": "#7f7f7f", "torch-efficient": "#9467bd", "torch-flash": "#8c564b", "torch-cudnn": "#d62728",
}


def _color(impl: str) -> str:
    spare = ("#e377c2", "#393b79", "#637939", "#8c6d31")
    return COLORS.get(impl, spare[sum(map(ord, impl)) % len(spare)])


def _style(impl: str) -> dict:
    return {"linestyle": "--" if impl.startswith("torch-") else "-", "marker": "o", "markersize": 4,
            "color": _color(impl)}


def error_bar(row: dict, value: str) -> tuple[float, float]:
    """(below, above) the median of `value` ("tflops", "gbps", "time_us" or "vs_torch_paired") to the
    lowest and highest over the repeats; (0, 0) when the row kept no spread."""
    mid = row.get(value)
    if value == "time_us":
        lo, hi = row.get("min_us"), row.get("max_us")
    elif value == "vs_torch_paired":
        lo, hi = row.get("vs_torch_min"), row.get("vs_torch_max")
    else:
        lo, hi = throughput_range(row, value)
    if mid is None or lo is None or hi is None:
        return 0.0, 0.0
    return max(mid - lo, 0.0), max(hi - mid, 0.0)


def _title(meta: dict, what: str) -> str:
    return f"{what} — {meta.get('device_name', meta.get('device'))}, {meta.get('date')}"


def plot_sweep(rows: Sequence[dict], meta: dict, path: str) -> bool:
    """TFLOP/s against L for the "sweep" cases; False when there are none."""
    picked = _ok(rows, lambda r: r["group"] == "sweep")
    if not picked:
        return False
    plt = _pyplot()
    dtypes = list(dict.fromkeys(r["dtype"] for r in picked))
    modes = list(dict.fromkeys(r["mode"] for r in picked))
    fig, axes = plt.subplots(len(dtypes), len(modes), figsize=(5.5 * len(modes), 4 * len(dtypes)), squeeze=False)
    for i, dtype in enumerate(dtypes):
        for j, mode in enumerate(modes):
            ax = axes[i][j]
            cell = [r for r in picked if r["dtype"] == dtype and r["mode"] == mode]
            for impl in dict.fromkeys(r["impl"] for r in cell):
                pts = sorted((r for r in cell if r["impl"] == impl), key=lambda r: r["q_len"])
                errs = [error_bar(r, "tflops") for r in pts]
                ax.errorbar([r["q_len"] for r in pts], [r["tflops"] for r in pts],
                            yerr=[[e[0] for e in errs], [e[1] for e in errs]], capsize=3, label=impl, **_style(impl))
                shaky = [r for r in pts if r.get("unsteady")]
                ax.plot([r["q_len"] for r in shaky], [r["tflops"] for r in shaky], "o", linestyle="none",
                        markersize=4, markerfacecolor="white", markeredgecolor=_color(impl))
            ax.set_xscale("log", base=2)
            lengths = sorted({r["q_len"] for r in cell})
            ax.set_xticks(lengths)
            ax.set_xticklabels([str(n) for n in lengths], fontsize=7)
            ax.minorticks_off()
            ax.set_xlabel("sequence length L = S")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"{SHORT.get(dtype, dtype)} {mode}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    sample = picked[0]
    fig.suptitle(_title(meta, f"causal, H={sample['q_heads']}, D={sample['head_dim']}, B·L constant; median, bars "
                              "[min, max] over repeats; white centre: unsteady"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _bars(rows: Sequence[dict], meta: dict, path: str, value: str, ylabel: str, log: bool, what: str,
          line_at: Optional[float] = None) -> bool:
    if not rows:
        return False
    plt = _pyplot()
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    groups = list(dict.fromkeys((r["case"], r["mode"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, len(dtypes), figsize=(max(6.0, 1.1 * len(groups) * len(impls) / 2 + 2) * len(dtypes),
                                                      4.2), squeeze=False)
    width = 0.8 / len(impls)
    for ax, dtype in zip(axes[0], dtypes):
        for k, impl in enumerate(impls):
            xs, ys, errs, fills = [], [], [], []
            for g, (case, mode) in enumerate(groups):
                hit = [r for r in rows if r["dtype"] == dtype and r["impl"] == impl and (r["case"], r["mode"]) ==
                       (case, mode)]
                if hit:
                    xs.append(g + (k - (len(impls) - 1) / 2) * width)
                    ys.append(hit[0][value])
                    errs.append(error_bar(hit[0], value))
                    fills.append(_color(impl) if not hit[0].get("unsteady") else "none")
            ax.bar(xs, ys, width, yerr=[[e[0] for e in errs], [e[1] for e in errs]], capsize=3, label=impl,
                   color=fills, edgecolor=_color(impl), hatch="//" if impl.startswith("torch-") else None)
        ax.set_xticks(range(len(groups)))
        crowded = len(groups) > 4  # long case labels overlap side by side: slanted
        ax.set_xticklabels([f"{c}\n{m}" for c, m in groups], fontsize=7, rotation=30 if crowded else 0,
                           ha="right" if crowded else "center")
        if log:
            ax.set_yscale("log")
        if line_at is not None:
            ax.axhline(line_at, color="black", linewidth=0.8)
        ax.set_ylabel(ylabel)
        ax.set_title(SHORT.get(dtype, dtype))
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(_title(meta, what + " — median, bars: [min, max] over repeats; hollow: unsteady"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def write_plots(rows: Sequence[dict], meta: dict, out_dir: str) -> list[str]:
    """Writes the plots that have data into `out_dir`; returns their file names.

    Raises:
        ImportError: matplotlib is not installed.
    """
    _pyplot()
    written = []
    if plot_sweep(rows, meta, os.path.join(out_dir, "tflops_vs_seqlen.png")):
        written.append("tflops_vs_seqlen.png")
    small = _ok(rows, lambda r: r["group"] == "small")
    if _bars(small, meta, os.path.join(out_dir, "small_call_latency.png"), "time_us", "µs per call (log)", True,
             "small calls"):
        written.append("small_call_latency.png")
    decode = _ok(rows, lambda r: r["decode"])
    if _bars(decode, meta, os.path.join(out_dir, "decode_gbps.png"), "gbps", "GB/s", False, "decode"):
        written.append("decode_gbps.png")
    ratios = _ok(rows, lambda r: r["family"] == "ours" and r.get("vs_torch_paired") is not None)
    if _bars(ratios, meta, os.path.join(out_dir, "vs_torch.png"), "vs_torch_paired",
             "torch's best time / ours, paired (log; > 1: ours faster)", True, "ratio to torch", line_at=1.0):
        written.append("vs_torch.png")
    return written
