"""DRAM traffic of the Hopper kernels against torch's cuDNN: Nsight Compute's bytes read from and
written to DRAM, L2's hit rate and the GPU time of each kernel of one call, the kernel alone as it is
and as modified copies (`docs/bench/variants/*.patch` applied to a copy of `flash_fwd_mgpu.py` or
`flash_bwd_mgpu.py`), causal bf16, persistent grid, tuned tiles.

    python benchmarks/hopper_dram_gpu.py --variants a.py[,b.py] --shapes 2x8192x16x16x128 [--out dram.json]

Shapes are B x L x Hq x Hk x D; a forward copy times the forward, a backward copy the backward. Runs
itself under `ncu --profile-from-start off --clock-control none` (caches flushed before each kernel,
the GPU's own clocks): each call is made three times unprofiled, then once between
cudaProfilerStart/Stop. A kernel whose inputs are B bytes reads at least B from DRAM; each re-read
from DRAM is L2 missing data another program already loaded.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct", "gpu__time_duration.sum")


def _profiled(shapes: str, variants: str) -> None:
    """Inside ncu: the calls, each once between cudaProfilerStart and Stop, announced on stdout."""
    import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
    import torch
    from hopper_variant_energy_gpu import _calls, _sync

    todo = []
    for text in shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        found, forward = _calls(shape, variants.split(","))
        for name, call in found.items():
            for _ in range(3):
                out = call()
            _sync(name, out)
            todo.append((shape, forward, name, call))
    cudart = torch.cuda.cudart()
    for shape, forward, name, call in todo:
        print(f"## {'x'.join(map(str, shape))} {'forward' if forward else 'backward'} {name}", flush=True)
        cudart.cudaProfilerStart()
        torch.cuda._sleep(1)  # a `spin_kernel`: where this call's kernels begin (a call may launch several)
        torch.cuda.synchronize()
        _sync(name, call())
        cudart.cudaProfilerStop()


def _table(text: str) -> list[dict]:
    """ncu's CSV (one row per kernel and metric) and the announcements, in launch order, as rows."""
    calls = [line[3:].split(" ", 2) for line in text.splitlines() if line.startswith("## ")]
    records = list(csv.DictReader(io.StringIO("\n".join(x for x in text.splitlines() if x.startswith('"')))))
    kernels: dict[int, dict] = {}
    for r in records:
        k = kernels.setdefault(int(r["ID"]), {"kernel": r["Kernel Name"][:60], "grid": r["Grid Size"]})
        k[r["Metric Name"]] = float(r["Metric Value"].replace(",", ""))
    # Kernels come in launch order, each call's after a spin kernel.
    rows, call = [], -1
    for kid in sorted(kernels):
        k = kernels[kid]
        if "spin_kernel" in k["kernel"]:
            call += 1
            continue
        if not 0 <= call < len(calls):
            raise ValueError(f"kernel {k['kernel']!r} (ncu ID {kid}) before the first call's marker")
        shape, part, name = calls[call]
        rows.append(dict(shape=shape, part=part, row=name, kernel=k["kernel"], grid=k["grid"],
                         dram_read_mb=k["dram__bytes_read.sum"] / 1e6, dram_write_mb=k["dram__bytes_write.sum"] / 1e6,
                         l2_hit_pct=k["lts__t_sector_hit_rate.pct"], us=k["gpu__time_duration.sum"] / 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", required=True, help="comma-separated paths of modified kernel modules")
    parser.add_argument("--shapes", required=True, help="comma-separated BxLxHqxHkxD")
    parser.add_argument("--out", default=None)
    parser.add_argument("--profiled", action="store_true", help=argparse.SUPPRESS)  # the run inside ncu
    args = parser.parse_args()
    if args.profiled:
        return _profiled(args.shapes, args.variants)
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not os.path.exists(ncu):
        raise SystemExit(f"ncu: not found on PATH nor at {ncu}; hint: install Nsight Compute (CUDA toolkit)")
    done = subprocess.run([ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv",
                           "--metrics", ",".join(METRICS), sys.executable, os.path.abspath(__file__), "--profiled",
                           "--variants", ",".join(os.path.abspath(p) for p in args.variants.split(",")),
                           "--shapes", args.shapes],
                          capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    rows = _table(done.stdout)
    if not rows:
        raise SystemExit(f"ncu gave no kernels (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    for r in rows:
        print(f"{r['shape']:18} {r['part']:8} {r['row']:28} {r['kernel'][:34]:34} read {r['dram_read_mb']:8.0f} MB  "
              f"write {r['dram_write_mb']:7.0f} MB  L2 hit {r['l2_hit_pct']:5.1f}%  {r['us']:8.1f} us")
    if args.out:
        import torch
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
