"""Where the Hopper kernels' warpgroups spend their cycles: Mosaic GPU's in-kernel profiler
(`jax_core/kernels/mgpu_timeline.py`) on the forward and the backward alone (`jax.jit`, persistent
grid, causal bf16), summarised per warpgroup and step.

    python benchmarks/hopper_timeline_gpu.py [--out timeline.json] [--part forward backward]
                                             [--clock-ghz 1.98] [--keep-traces DIR] [--variant FILE]

Each case runs three calls compiled with the profiler and summarises the last one's trace
(`mgpu_timeline.summarise`): per warpgroup its mean span in SM cycles, the cycles of each named step
(the softmax, each product, each wait), what no step covers, and when each program ended. The
records change how ptxas schedules the kernel, so the shares say where a warpgroup waits, not how
fast the kernel runs without them (BENCHMARKS.md "Inside the kernels"). The shapes keep a
program's records within the shared memory its kernel leaves free (the cases' step counts).
`--variant FILE` profiles a modified copy of `flash_fwd_mgpu.py` or `flash_bwd_mgpu.py` instead of the
kernel as it is (as `hopper_kernels_gpu.py --part variant` times one).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from kernel_variants import load_variant

from jaxattn.jax_core.kernels.flash_bwd_mgpu import backward_operands, flash_backward_mgpu_tiles
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles
from jaxattn.jax_core.kernels.mgpu_timeline import recorded, summarise

#: (B, L, H, D, tiles, named steps one warpgroup records per call), causal. The forward at head dim 64
#: has shared memory to spare; the backward's buffers leave about 30 KiB, 16 bytes a step per warpgroup.
FORWARD = [((16, 1024, 16, 64), dict(block_q=64, block_kv=128, stages=2), 1500)]
BACKWARD = [((8, 1024, 16, 64), dict(block_q=128, block_kv=64, stages=2), 560),
            ((2, 2048, 8, 128), dict(block_q=64, block_kv=64, stages=2), 560)]
WARPGROUPS = 3  # two compute warpgroups and the memory warpgroup per program


def _programs():
    return getattr(jax.devices()[0], "core_count", None) or 132


def _inputs(shape, count, seed):
    keys = jax.random.split(jax.random.key(seed), count)
    return [jax.random.normal(key, shape, jnp.bfloat16) for key in keys]


def _case(name, fn, args, steps, clock_ghz, keep):
    directory = tempfile.mkdtemp(prefix="mgpu_timeline_")
    try:
        with recorded(directory, steps):
            run = jax.jit(fn)  # traced inside: compiled with the profiler
            for _ in range(3):
                jax.block_until_ready(run(*args))
        jax.effects_barrier()  # the trace is written by a host callback after the call
        traces = sorted(glob.glob(os.path.join(directory, "*-trace.json")))
        with open(traces[-1]) as f:
            summary = summarise(json.load(f), WARPGROUPS, clock_ghz)
        if keep:
            os.makedirs(keep, exist_ok=True)
            shutil.copy(traces[-1], os.path.join(keep, f"{name}.json"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"== {name}", flush=True)
    for wg, part in enumerate(summary["warpgroups"]):
        span = max(part["span"], 1.0)
        steps_text = ", ".join(f"{step} {100 * cycles / span:.1f}%" for step, cycles in part["steps"].items())
        other = 100 * part["other"] / span
        print(f"  warpgroup {wg}: span {part['span']:.0f} cycles; {steps_text}; other {other:.1f}%")
    ends = summary["ends_us"]
    print(f"  programs end {ends[0]:.1f} .. {ends[-1]:.1f} µs after the first began (median "
          f"{ends[len(ends) // 2]:.1f})", flush=True)
    return dict(case=name, steps_recorded=steps, **summary)


def forward(rows, clock_ghz, keep, kernel=flash_forward_mgpu_tiles):
    for shape, tiles, steps in FORWARD:
        d = shape[-1]

        def fn(q, k, v, tiles=tiles, d=d):
            return kernel(q, k, v, scale=d ** -0.5, causal=True, programs=_programs(), **tiles)
        rows.append(_case(f"forward {shape}", fn, _inputs(shape, 3, 1), steps, clock_ghz, keep))


def backward(rows, clock_ghz, keep, kernel=flash_backward_mgpu_tiles):
    for shape, tiles, steps in BACKWARD:
        d = shape[-1]
        q, k, v, do = _inputs(shape, 4, 2)
        out, lse = jax.jit(lambda q, k, v, d=d: flash_forward_mgpu_tiles(
            q, k, v, scale=d ** -0.5, causal=True, block_q=64, block_kv=128, stages=2, programs=_programs()))(q, k, v)
        lse_log2, delta = backward_operands(out, do, lse)

        def fn(q, k, v, do, lse_log2, delta, accum, tiles=tiles, d=d):
            return kernel(q, k, v, do, lse_log2, delta, accum, scale=d ** -0.5, causal=True, programs=_programs(),
                          **tiles)
        args = (q, k, v, do, lse_log2, delta, jnp.zeros(q.shape, jnp.float32))
        rows.append(_case(f"backward {shape}", fn, args, steps, clock_ghz, keep))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON file for the summaries")
    parser.add_argument("--part", nargs="+", choices=["forward", "backward"], default=["forward", "backward"])
    parser.add_argument("--clock-ghz", type=float, default=1.98,
                        help="SM clock that converts a program's cycles to µs for its end time (H100/H200 boost)")
    parser.add_argument("--keep-traces", default=None, help="directory to keep each case's Chrome trace in")
    parser.add_argument("--variant", default=None,
                        help="a modified flash_fwd_mgpu.py or flash_bwd_mgpu.py to profile instead (its part only)")
    args = parser.parse_args()
    rows = []
    if args.variant is None:
        for part in args.part:
            {"forward": forward, "backward": backward}[part](rows, args.clock_ghz, args.keep_traces)
    else:
        module = load_variant(args.variant)
        if hasattr(module, "flash_forward_mgpu_tiles"):
            forward(rows, args.clock_ghz, args.keep_traces, module.flash_forward_mgpu_tiles)
        else:
            backward(rows, args.clock_ghz, args.keep_traces, module.flash_backward_mgpu_tiles)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
