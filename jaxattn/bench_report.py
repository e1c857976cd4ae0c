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
import time
from typing import Optional, Sequence

from .bench_timing import Timing, attention_flops, decode_bytes

COLUMNS = (
    "group", "case", "batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim", "causal", "decode", "dtype",
    "mode", "impl", "family", "status", "reason", "time_us", "min_us", "max_us", "first_call_s", "tflops", "gbps",
    "vs_torch_best", "torch_best", "iters", "repeats",
)
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
        "iters": timing.iters, "repeats": timing.repeats,
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
        rows.append(row)
    return rows


class Progress:
    """A progress bar on stderr (one line per step when stderr is not a terminal)."""

    def __init__(self, total: int, enabled: bool, width: int = 28):
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self.tty = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
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


def _throughput(row: dict) -> str:
    if row["status"] != "ok":
        return "-"
    return f"{_sig(row['gbps'])} GB/s" if row["decode"] else f"{_sig(row['tflops'])} TFLOP/s"


def format_table(rows: Sequence[dict]) -> str:
    """A plain-text table, one line per row; rows that did not run show their reason."""
    head = f"{'case':<34} {'dtype':<5} {'mode':<7} {'impl':<15} {'time':>10} {'throughput':>15} {'vs torch':>8} " \
           f"{'1st call':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['vs_torch_best']:.2f}x" if r["vs_torch_best"] is not None else "-"
        first = f"{r['first_call_s']:.2f} s" if r["first_call_s"] is not None else "-"
        note = "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"[:110]
        lines.append(f"{r['case']:<34} {SHORT_DTYPE.get(r['dtype'], r['dtype']):<5} {r['mode']:<7} {r['impl']:<15} "
                     f"{_fmt_time(r['time_us']):>10} {_throughput(r):>15} {ratio:>8} {first:>9}  {note}")
    return "\n".join(lines)


def _cell_keys(rows):
    return list(dict.fromkeys((r["group"], r["case"], r["dtype"], r["mode"]) for r in rows))


def _impls_in(rows):
    return list(dict.fromkeys(r["impl"] for r in rows))


def _pivot(rows, groups, value, unit_note):
    """A Markdown table: one line per cell, one column per implementation, and ours-best / torch-best."""
    picked = [r for r in rows if r["group"] in groups]
    if not picked:
        return []
    impls = [i for i in _impls_in(picked) if any(r["impl"] == i and r["status"] == "ok" for r in picked)]
    out = [f"| case | dtype | mode | {' | '.join(impls)} | best ours vs torch best |",
           "| --- | --- | --- |" + " --- |" * (len(impls) + 1)]
    for key in _cell_keys(picked):
        cell = {r["impl"]: r for r in picked if (r["group"], r["case"], r["dtype"], r["mode"]) == key}
        values = []
        for impl in impls:
            r = cell.get(impl)
            values.append(value(r) if r is not None and r["status"] == "ok" else "n/a")
        ratios = [r["vs_torch_best"] for r in cell.values() if r["family"] == "ours" and r["vs_torch_best"]]
        best = max(ratios) if ratios else None
        label = f"{best:.2f}x" if best is not None else "n/a"
        out.append(f"| {key[1]} | {SHORT_DTYPE.get(key[2], key[2])} | {key[3]} | {' | '.join(values)} | {label} |")
    return [unit_note, ""] + out + [""]


def markdown_summary(rows: Sequence[dict], meta: dict) -> str:
    """Markdown tables of a run (what BENCHMARKS.md shows): throughput, small-call times, decode
    bandwidth, first-call times, and why some implementations did not run."""
    v = meta.get("versions", {})
    lines = [f"- Device: {meta.get('device_name')} ({meta.get('device')}); date {meta.get('date')}; "
             f"preset {meta.get('preset')}; {meta.get('elapsed_s')} s",
             "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items()), ""]
    lines += _pivot(rows, ("sweep", "shape"), lambda r: _sig(r["tflops"]), "TFLOP/s (higher is better):")
    lines += _pivot([r for r in rows if not r["decode"]], ("small",), lambda r: _sig(r["time_us"]),
                    "Small prefill calls, µs per call (lower is better):")
    lines += _pivot([r for r in rows if r["decode"]], ("decode", "small"),
                    lambda r: f"{_sig(r['gbps'])} GB/s, {_sig(r['time_us'])} µs",
                    "Decode, GB/s (bytes of q, K, V and the output over time) and µs per call:")
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


def short_reason(text: str) -> str:
    """A reason without torch's source locations and per-shape size lists (so that equal reasons group)."""
    cut = len(str(text)) >= REASON_CHARS
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
    with open(os.path.join(out_dir, "bench.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: "" if r.get(k) is None else r[k] for k in COLUMNS})
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": {**meta, "complete": complete}, "rows": [{k: _clean(r.get(k)) for k in COLUMNS}
                                                                     for r in rows]}, f, indent=1)
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
            notes.append("wrote " + ", ".join(os.path.join(out_dir, p) for p in written))
    return notes


def load_json(path: str) -> tuple[list[dict], dict]:
    """Rows and meta of a bench.json (to re-draw tables and plots without measuring)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "rows" not in data or "meta" not in data:
        raise ValueError(f"{path!r}: expected a bench.json written by `jaxattn bench --out` (keys 'meta', 'rows').")
    return data["rows"], data["meta"]
