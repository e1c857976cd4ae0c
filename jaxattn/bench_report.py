"""Rows, table, files and Markdown summary of `jaxattn bench` (see jaxattn/bench.py)."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
import statistics
import sys
import textwrap
import time
from typing import Optional, Sequence

from .bench_spread import LEGEND, MARK, loaded_warning, mark_unsteady, paired_ratios, ratio_summary, spread
from .bench_timing import Timing, attention_flops, decode_bytes

COLUMNS = (
    "group", "case", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "causal", "decode", "dtype",
    "mode", "impl", "family", "status", "reason", "time_us", "min_us", "max_us", "first_call_s", "tflops", "gbps",
    "vs_torch_best", "torch_best", "iters", "repeats",
    # The spread of the repeats (jaxattn/bench_spread.py): slowest / fastest repeat, the paired
    # ratio to torch_best (median, min, max over rounds), and whether the row is too unsteady to compare.
    "spread", "vs_torch_paired", "vs_torch_min", "vs_torch_max", "unsteady", "unsteady_why",
)
#: Kept in bench.json only (a list per row): each round's time per call, µs, in the order they ran.
JSON_ONLY = ("repeat_us",)
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
REASON_CHARS = 300  # reasons are stored up to this length
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def metrics(case, dtype: str, mode: str, timing: Timing) -> dict:
    """Time (µs), first-call time (s), TFLOP/s, and GB/s for decode cases, of one measurement."""
    flops = attention_flops(case.batch, case.q_heads, case.q_len, case.kv_len, case.head_dim, case.head_dim,
                            case.causal, backward=mode == "fwd+bwd")
    out = {
        "time_us": timing.median_s * 1e6, "min_us": timing.min_s * 1e6, "max_us": timing.max_s * 1e6,
        "first_call_s": timing.first_call_s, "tflops": flops / timing.median_s / 1e12, "gbps": None,
        "iters": timing.iters, "repeats": timing.repeats, "repeat_us": [t * 1e6 for t in timing.per_call_s] or None,
        "spread": timing.max_s / timing.min_s if timing.min_s > 0 else None,
    }
    if case.decode:
        nbytes = decode_bytes(case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim,
                              case.head_dim, ITEMSIZE[dtype])
        out["gbps"] = nbytes / timing.median_s / 1e9
    return out


def finish_cell(cell: Sequence[dict], case, dtype: str, mode: str) -> list[dict]:
    """Adds the cell's fields and the ratio to torch's fastest backend in the cell to each row."""
    torch_ok = [r for r in cell if r["family"] == "torch" and r["status"] == "ok"]
    best = min(torch_ok, key=lambda r: r["time_us"]) if torch_ok else None
    rows = []
    for r in cell:
        row = dict.fromkeys(COLUMNS)
        row.update(group=case.group, case=case.label, batch=case.batch, q_heads=case.q_heads, kv_heads=case.kv_heads,
                   q_len=case.q_len, kv_len=case.kv_len, head_dim=case.head_dim, causal=case.causal,
                   decode=case.decode, dtype=dtype, mode=mode)
        row.update(r)
        if best is not None:
            row["torch_best"] = best["impl"]
            if row["status"] == "ok":
                row["vs_torch_best"] = best["time_us"] / row["time_us"]
                if best.get("repeat_us") and row.get("repeat_us"):
                    row.update(ratio_summary(paired_ratios(best["repeat_us"], row["repeat_us"])))
        rows.append(row)
    return rows


class Progress:
    """A progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, width: int = 28):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str, count: int = 1) -> None:
        self.done += count
        if not self.enabled:
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {self.done}/{self.total} {time.perf_counter() - self.t0:5.0f}s {label}"
        if self.tty:
            sys.stderr.write("\r" + text[:150].ljust(150))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def _versions() -> dict:
    from ._version import __version__
    from .jax_core.kernels.jax_triton_module import jax_triton

    out = {"jaxattn": __version__, "python": platform.python_version()}
    for name in ("torch", "jax", "jaxlib", "triton", "jax_triton", "numpy"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = jax_triton() if name == "jax_triton" else __import__(name)
            except Exception:  # an optional package that is absent or broken
                continue
        out[name] = getattr(module, "__version__", "?")
    try:
        import torch

        if torch.backends.cudnn.is_available():
            out["cudnn (torch)"] = str(torch.backends.cudnn.version())
        if torch.version.cuda:
            out["cuda (torch)"] = torch.version.cuda
    except Exception:  # versions are informative only
        pass
    return out


def run_metadata(device: str, plan, impls, dtypes, modes, max_minutes) -> dict:
    """Where, when and how a run was made (the JSON's "meta")."""
    import torch

    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return {
        "device": device, "device_name": name, "date": time.strftime("%Y-%m-%d"), "versions": _versions(),
        "preset": plan.name, "impls": list(impls), "dtypes": list(dtypes), "modes": list(modes),
        "repeats": plan.repeats, "target_s": plan.target_s, "max_score_gib": plan.max_score_gib,
        "max_minutes": max_minutes, "command": "jaxattn " + " ".join(sys.argv[1:]) if sys.argv else None,
        "timing": "median over repeats of back-to-back loops (CUDA events on CUDA, host clock on CPU); warm-up "
                  "excluded; first call (trace + compile) reported as first_call_s",
        "flops": "2*B*Hq*(visible pairs)*(D+Dv) forward, causal = top-left visible pairs; x3.5 forward+backward",
        "bytes": "decode: q, K, V read once, output written",
    }


def _sig(x: float) -> str:
    """Three significant digits, no exponent for the usual ranges (0.00123, 12.3, 456)."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _fmt_time(us: Optional[float]) -> str:
    if us is None:
        return "-"
    return f"{us / 1e3:.2f} ms" if us >= 1e4 else f"{us:.1f} us"


def _range(lo: Optional[float], hi: Optional[float], fmt=None, sep: str = "-") -> str:
    """" [lo-hi]" (empty when either end is unknown)."""
    fmt = fmt or _sig
    return "" if lo is None or hi is None else f" [{fmt(lo)}{sep}{fmt(hi)}]"


def _time_cell(row: dict) -> str:
    """Median time per call and its [fastest-slowest] repeat, in the median's unit."""
    us = row["time_us"]
    if us is None:
        return "-"
    scale, unit = (1e3, "ms") if us >= 1e4 else (1.0, "us")
    lo, hi = row.get("min_us"), row.get("max_us")
    return f"{_sig(us / scale)} {unit}" + _range(None if lo is None else lo / scale, None if hi is None else hi / scale)


def throughput_range(row: dict, key: str) -> tuple[Optional[float], Optional[float]]:
    """(lowest, highest) of a throughput ("tflops" or "gbps") over the repeats: the slowest and fastest repeat."""
    value, us, lo_us, hi_us = row.get(key), row.get("time_us"), row.get("min_us"), row.get("max_us")
    if value is None or not us or not lo_us or not hi_us:
        return None, None
    return value * us / hi_us, value * us / lo_us


def _throughput(row: dict) -> str:
    if row["status"] != "ok":
        return "-"
    key, unit = ("gbps", "GB/s") if row["decode"] else ("tflops", "TFLOP/s")
    return f"{_sig(row[key])} {unit}" + _range(*throughput_range(row, key))


def vs_torch_cell(row: dict, sep: str = "-") -> str:
    """The ratio to torch's fastest backend: the paired median [min-max] over rounds when the rounds
    were kept, else the ratio of the medians; "-" without one."""
    if row.get("vs_torch_paired") is not None:
        return f"{row['vs_torch_paired']:.2f}x" + _range(row["vs_torch_min"], row["vs_torch_max"], "{:.2f}".format,
                                                         sep)
    return "-" if row.get("vs_torch_best") is None else f"{row['vs_torch_best']:.2f}x"


NOTE_WIDTH = 80  # the notes of rows that did not run wrap at word boundaries to this width


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table, one line per timed row with the [min-max] of its repeats, the paired ratio
    to torch with its [min-max] and the unsteady mark; rows that did not run show their reason,
    wrapped at word boundaries (never cut)."""
    mark_unsteady(rows)
    head = f"{'case':<34} {'dtype':<5} {'mode':<7} {'impl':<15} {'time [min-max]':>22} " \
           f"{'throughput [min-max]':>32} {'vs torch [min-max]':>19} {'':1} {'1st call':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = f"{r['case']:<34} {SHORT_DTYPE.get(r['dtype'], r['dtype']):<5} {r['mode']:<7} {r['impl']:<15} "
        if r["status"] != "ok":
            note = textwrap.wrap(f"{r['status']}: {short_reason(r['reason'])}", NOTE_WIDTH, break_long_words=False,
                                 break_on_hyphens=False) or [r["status"]]
            lines.append(lead + note[0])
            lines += [" " * len(lead) + more for more in note[1:]]
            continue
        first = f"{r['first_call_s']:.2f} s" if r["first_call_s"] is not None else "-"
        mark = MARK if r.get("unsteady") else ""
        lines.append(f"{lead}{_time_cell(r):>22} {_throughput(r):>32} {vs_torch_cell(r):>19} {mark:1} {first:>8}")
    lines += ["", "time: median per call [fastest-slowest repeat]; vs torch: torch's fastest backend's time over this "
              "row's, paired per round: median [min-max] (> 1: faster than torch)"]
    if any(r.get("unsteady") for r in rows):
        lines.append(LEGEND)
    return "\n".join(lines)


def _cell_keys(rows):
    return list(dict.fromkeys((r["group"], r["case"], r["dtype"], r["mode"]) for r in rows))


def _impls_in(rows):
    return list(dict.fromkeys(r["impl"] for r in rows))


def _with_range(row: dict, key: str) -> str:
    """A Markdown cell: the median's value of `key` and its [lowest-highest] over the repeats."""
    lo, hi = (row.get("min_us"), row.get("max_us")) if key == "time_us" else throughput_range(row, key)
    return _sig(row[key]) + _range(lo, hi, sep="–")


def _best_ours(cell: dict) -> Optional[dict]:
    """The row of ours with the highest ratio to torch (paired median when kept)."""
    ours = [r for r in cell.values() if r["family"] == "ours" and r["status"] == "ok"
            and (r.get("vs_torch_paired") or r.get("vs_torch_best"))]
    return max(ours, key=lambda r: r.get("vs_torch_paired") or r["vs_torch_best"], default=None)


def _pivot(rows, groups, value, unit_note):
    """A Markdown table: one line per cell, one column per implementation, and ours-best / torch-best."""
    picked = [r for r in rows if r["group"] in groups]
    if not picked:
        return []
    impls = [i for i in _impls_in(picked) if any(r["impl"] == i and r["status"] == "ok" for r in picked)]
    out = [f"| case | dtype | mode | {' | '.join(impls)} | best ours vs torch best [min–max] |",
           "| --- | --- | --- |" + " --- |" * (len(impls) + 1)]
    for key in _cell_keys(picked):
        cell = {r["impl"]: r for r in picked if (r["group"], r["case"], r["dtype"], r["mode"]) == key}
        values = []
        for impl in impls:
            r = cell.get(impl)
            if r is None or r["status"] != "ok":
                values.append("n/a")
            else:
                values.append(value(r) + (f" {MARK}" if r.get("unsteady") else ""))
        best = _best_ours(cell)
        label = "n/a" if best is None else f"{best['impl']} {vs_torch_cell(best, '–')}" + (
            f" {MARK}" if best.get("unsteady") else "")
        out.append(f"| {key[1]} | {SHORT_DTYPE.get(key[2], key[2])} | {key[3]} | {' | '.join(values)} | {label} |")
    return [unit_note + " median [min–max] over the repeats", ""] + out + [""]


def markdown_summary(rows: Sequence[dict], meta: dict) -> str:
    """Markdown tables of a run (what BENCHMARKS.md shows): throughput, small-call times, decode
    bandwidth, first-call times, and why some implementations did not run."""
    v = meta.get("versions", {})
    lines = [f"- Device: {meta.get('device_name')} ({meta.get('device')}); date {meta.get('date')}; "
             f"preset {meta.get('preset')}; {meta.get('elapsed_s')} s",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), ""]
    unsteady = mark_unsteady(rows)
    lines += _pivot(rows, ("sweep", "shape"), lambda r: _with_range(r, "tflops"), "TFLOP/s (higher is better):")
    lines += _pivot([r for r in rows if not r["decode"]], ("small",), lambda r: _with_range(r, "time_us"),
                    "Small prefill calls, µs per call (lower is better):")
    lines += _pivot([r for r in rows if r["decode"]], ("decode", "small"),
                    lambda r: f"{_with_range(r, 'gbps')} GB/s, {_with_range(r, 'time_us')} µs",
                    "Decode, GB/s (bytes of q, K, V and the output over time) and µs per call:")
    lines += ["Ratios to torch are paired: per round, torch's fastest backend's time over ours (both ran back to "
              "back in that round), median [min–max] over the rounds.", ""]
    if unsteady:
        lines += [LEGEND, "", loaded_warning(rows, meta.get("repeats")), ""]
    first = {}
    for r in rows:
        if r["family"] == "ours" and r["status"] == "ok":
            first.setdefault(r["impl"], []).append(r["first_call_s"])
    if first:
        lines += ["First call (trace + compile, synchronised), seconds over the cells: median (max):", "",
                  "| impl | median | max | cells |", "| --- | --- | --- | --- |"]
        lines += [f"| {k} | {statistics.median(s):.2f} | {max(s):.2f} | {len(s)} |" for k, s in first.items()]
        lines.append("")
    reasons = {}
    for r in rows:
        if r["status"] != "ok":
            reasons.setdefault((r["impl"], r["status"], short_reason(r["reason"])), []).append(r["case"])
    if reasons:
        lines += ["Not run (n/a above; columns where nothing ran are left out):", ""]
        for (impl, status, reason), cases in reasons.items():
            lines.append(f"- {impl}, {status} in {len(cases)} cell(s): {reason}")
        lines.append("")
    return "\n".join(lines)


def clip_reason(text: str) -> str:
    """`text` of at most REASON_CHARS characters, cut at a word boundary with "…" when longer."""
    text = " ".join(str(text).split())
    if len(text) <= REASON_CHARS:
        return text
    head = text[:REASON_CHARS - 1]
    return (head[:head.rfind(" ")] if " " in head else head) + "…"


def short_reason(text: str) -> str:
    """A reason without torch's source locations and per-shape size lists (so that equal reasons group)."""
    cut = len(str(text)) >= REASON_CHARS or str(text).endswith("…")
    text = " ".join(str(text).split())
    if cut:  # cut by the recorder: drop the broken last sentence
        text = text[:text.rfind(". ") + 1] or text
    text = re.sub(r"\s*\(Triggered internally at [^)]*\)\.?", "", text)
    text = re.sub(r"\s*\w+[ .]sizes\(\): \[[0-9, ]*\],?", "", text)
    text = re.sub(r"\[[0-9, ]*\]", "[...]", text)
    text = re.sub(r"[^.;]*\bnot used because:\s*;?\s*", "", text)  # a header line before the real reason
    return text.strip(" ;")


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_outputs(rows: Sequence[dict], meta: dict, out_dir: str, *, plots: bool, complete: bool) -> list[str]:
    """Writes bench.csv, bench.json, summary.md (and PNGs with `plots`); returns notes to print."""
    os.makedirs(out_dir, exist_ok=True)
    mark_unsteady(rows)
    with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in COLUMNS})
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": {**meta, "complete": complete},
                   "rows": [{k: _clean(r.get(k)) for k in COLUMNS + JSON_ONLY} for r in rows]}, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown_summary(rows, meta))
    notes = [f"wrote {out_dir}/bench.csv, bench.json, summary.md"] if complete else []
    if plots:
        from .bench_plots import write_plots

        try:
            written = write_plots(rows, meta, out_dir)
        except ImportError:
            notes.append("matplotlib is not installed: no PNG plots (the bench extra: pip install -e '.[bench]' in "
                         "the jaxattn checkout).")
        else:
            notes.append(f"wrote plots to {os.path.abspath(out_dir)}: {', '.join(written)}" if written else
                         f"no plots: no timed rows to draw in {out_dir}")
    return notes


def load_json(path: str) -> tuple[list[dict], dict]:
    """Rows and meta of a bench.json (to re-draw tables and plots without measuring)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "rows" not in data or "meta" not in data:
        raise ValueError(f"{path!r}: expected a bench.json written by `jaxattn bench --out` (keys 'meta', 'rows').")
    return data["rows"], data["meta"]
