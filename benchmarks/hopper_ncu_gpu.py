"""Where the Hopper forward's cycles go, against torch's cuDNN: Nsight Compute's pipe utilisation,
issue rate, warp stall reasons and the most-sampled SASS instructions of each kernel, the kernel
alone (`flash_forward_mgpu_tiles` on the persistent grid, the tuned tiles; with `--variant`, also a
modified copy of `flash_fwd_mgpu.py`) and cuDNN's forward in the same process, causal bf16.

    python benchmarks/hopper_ncu_gpu.py --shapes 16x1024x16x64,2x8192x16x128 --out DIR [--variant COPY]
    python benchmarks/hopper_ncu_gpu.py --summarize DIR     # summary.json again from DIR's exports

Shapes are B x L x H x D. Runs itself under `ncu --profile-from-start off --clock-control none` with
the sections below (the GPU's own clocks; each kernel replayed once per pass), keeps the report
(DIR/fwd.ncu-rep), its raw metrics (DIR/raw.csv) and its SASS page with the stall samples
(DIR/source.csv), and writes DIR/summary.json: per kernel, in launch order, its time, the share of
peak of each pipe (xu is the special-function unit: exp2, tanh), the warp stall reasons per issued
instruction, the count of the softmax's instructions and its 12 most-sampled instructions.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import re
import shutil
import subprocess
import sys

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats", "InstructionStats",
            "SourceCounters", "LaunchStats")
OPCODES = ("MUFU", "FFMA", "FADD", "FMUL", "FMNMX", "F2FP", "SHFL", "HGMMA")


def _profiled(shapes: str, variant: str | None) -> None:
    """Inside ncu: each shape's forward (and the variant's) and cuDNN's, once each between
    cudaProfilerStart and Stop."""
    import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
    import jax
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hopper_kernels_gpu import forward_fns
    from kernel_variants import load_variant
    from jaxattn.jax_core import calls
    from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles

    todo = []
    for text in shapes.split(","):
        b, l, h, d = (int(x) for x in text.split("x"))
        tiles = calls.hopper_tiles("forward", d, l)
        options = {"ours": (flash_forward_mgpu_tiles, tiles)}
        if variant:
            options["variant"] = (load_variant(variant).flash_forward_mgpu_tiles, tiles)
        ours = forward_fns((b, l, h, d), options)
        q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def cudnn(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for _ in range(3):
            for fn in ours.values():
                jax.block_until_ready(fn())
            cudnn()
        torch.cuda.synchronize()
        todo += [(text, name, fn) for name, fn in ours.items()] + [(text, "cudnn", cudnn)]
    cudart = torch.cuda.cudart()
    for text, name, fn in todo:
        print(f"## {text} {name}", flush=True)
        cudart.cudaProfilerStart()
        out = fn()
        jax.block_until_ready(out) if name != "cudnn" else torch.cuda.synchronize()
        cudart.cudaProfilerStop()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


#: Pipes reported, by the raw metric of their share of peak: xu is the special-function unit (exp2, tanh).
PIPE_METRICS = {"xu": "sm__inst_executed_pipe_xu", "tensor": "sm__pipe_tensor_cycles_active",
                "alu": "sm__inst_executed_pipe_alu", "fma": "sm__inst_executed_pipe_fma",
                "uniform": "sm__inst_executed_pipe_uniform", "adu": "sm__inst_executed_pipe_adu",
                "lsu": "sm__inst_executed_pipe_lsu"}
_SCALE = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
          "cycle/nsecond": 1.0, "cycle/usecond": 1e-3, "cycle/second": 1e-9}


def _kernels_raw(path: str) -> list[dict]:
    rows = list(csv.reader(open(path)))
    header, units, data = rows[0], rows[1], rows[2:]
    out = []
    for values in data:
        r = dict(zip(header, values))
        unit = dict(zip(header, units))

        def scaled(name):
            return _number(r[name]) * _SCALE.get(unit[name], 1.0)
        entry = dict(kernel=r["Kernel Name"][:90], us=scaled("gpu__time_duration.sum"),
                     sm_ghz=scaled("gpc__cycles_elapsed.avg.per_second"),
                     issue_pct_of_peak=_number(r["sm__inst_issued.avg.pct_of_peak_sustained_elapsed"]),
                     pipes_pct_of_peak={p: round(_number(r[f"{m}.avg.pct_of_peak_sustained_active"]), 2)
                                        for p, m in PIPE_METRICS.items()})
        prefix, suffix = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
        stalls = {k[len(prefix):-len(suffix)]: _number(v) for k, v in r.items() if k.startswith(prefix) and k.endswith(suffix)}
        entry["stalls_per_issue"] = {k: round(v, 3) for k, v in sorted(stalls.items(), key=lambda x: -x[1]) if v >= 0.05}
        out.append(entry)
    return out


def _kernels_source(path: str) -> list[dict]:
    lines = open(path).read().split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith('"Kernel Name"')] + [len(lines)]
    out = []
    for a, b in zip(starts, starts[1:]):
        rows = list(csv.DictReader(lines[a + 1:b]))
        counts = collections.Counter()
        for r in rows:
            m = re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", r["Source"].strip())
            if m and m.group(2) in OPCODES:
                counts[m.group(2)] += _number(r["Instructions Executed"])
        samples = "Warp Stall Sampling (All Samples)"
        top = sorted(rows, key=lambda r: -_number(r[samples]))[:12]
        total = sum(_number(r[samples]) for r in rows) or 1.0
        out.append(dict(warp_instructions=dict(counts), top_sampled=[
            dict(sass=r["Source"].strip()[:80], share_pct=round(100 * _number(r[samples]) / total, 2),
                 executed=_number(r["Instructions Executed"])) for r in top]))
    return out


def summarize(folder: str, calls: list[str] | None = None) -> dict:
    kernels = _kernels_raw(os.path.join(folder, "raw.csv"))
    for k, s in zip(kernels, _kernels_source(os.path.join(folder, "source.csv"))):
        k.update(s)
    if calls and len(calls) == len(kernels):
        for k, c in zip(kernels, calls):
            k["call"] = c
    summary = dict(kernels=kernels)
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16x1024x16x64,2x8192x16x128")
    parser.add_argument("--out", default="ncu_forward")
    parser.add_argument("--variant", default=None, help="a modified copy of flash_fwd_mgpu.py, profiled beside it")
    parser.add_argument("--summarize", metavar="DIR", help="rebuild DIR/summary.json from DIR's exports")
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)  # the run inside ncu
    args = parser.parse_args()
    if args.profiled:
        return _profiled(args.shapes, args.variant)
    if args.summarize:
        summarize(args.summarize)
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        raise SystemExit(f"ncu: not found on PATH nor at {ncu}; hint: install Nsight Compute (CUDA toolkit)")
    os.makedirs(args.out, exist_ok=True)
    report = os.path.join(os.path.abspath(args.out), "fwd")
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--import-source", "no", "-f", "-o", report]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, os.path.abspath(__file__), "--profiled", "--shapes", args.shapes]
    if args.variant:
        cmd += ["--variant", os.path.abspath(args.variant)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    calls = [line[3:] for line in done.stdout.splitlines() if line.startswith("## ")]
    if done.returncode != 0 or not os.path.exists(report + ".ncu-rep"):
        raise SystemExit(f"ncu failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    for page, name, extra in (("raw", "raw.csv", []), ("source", "source.csv", ["--print-source", "sass"])):
        export = subprocess.run([ncu, "-i", report + ".ncu-rep", "--page", page, "--csv", *extra],
                                capture_output=True, text=True)
        with open(os.path.join(args.out, name), "w") as f:
            f.write(export.stdout)
    for k in summarize(args.out, calls)["kernels"]:
        pipes = " ".join(f"{p} {v:.1f}%" for p, v in k["pipes_pct_of_peak"].items())
        print(f"{k.get('call', k['kernel'][:40]):28} {k['us']:9.1f} us  issue {k['issue_pct_of_peak']:.1f}%  {pipes}")


if __name__ == "__main__":
    main()
