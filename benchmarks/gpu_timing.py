"""Steady-state timing shared by the GPU benchmark scripts (`flash_gpu.py`, `decode_gpu.py`, the Hopper
scripts), and their JSON report.

Back-to-back calls timed together, as a training loop or a decoding loop issues them, so host work
overlaps earlier GPU work; median over repeats after warm-up. The scripts are run as files
(`python benchmarks/decode_gpu.py`), so Python finds this module next to them.
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import torch


def time_torch(fn, warmup=5, iters=30, repeats=5):
    """Steady-state time per call (µs): `iters` back-to-back calls between two CUDA events, as a
    training loop issues them (host work overlaps earlier GPU work); median over `repeats`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def time_jax(fn, warmup=5, iters=30, repeats=5):
    """The same for JAX-only calls: back-to-back calls, then block_until_ready; wall time per call."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


def kernel_profile(fn, calls=30, warmup=1):
    """Each GPU kernel's time per call of `fn` ({name: µs}, longest first) and the span per call from
    the first kernel's start to the last one's end (µs), by torch's profiler (which records JAX's
    kernels too) over `calls` calls after `warmup` unprofiled ones."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    per_kernel: dict = {}
    for e in gpu:
        per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.time_range.elapsed_us() / calls
    span = (max(e.time_range.end for e in gpu) - min(e.time_range.start for e in gpu)) / calls if gpu else 0.0
    return dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])), span


def write_report(path, rows):
    """`rows` (a list of dicts) as JSON at `path`, with the device and the torch and JAX versions."""
    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, jax=jax.__version__, rows=rows),
                  f, indent=1)
