"""The Hopper kernels as they are against modified copies (`docs/bench/variants/*.patch` applied to a
copy of `flash_bwd_mgpu.py` or `flash_fwd_mgpu.py`), kernel alone on the persistent grid with the
tuned tiles, causal bf16: time per call from a cool GPU and, run back to back for a few seconds, under
the board's power limit, with the energy per call (NVML's counter) and the SM clock; torch's cuDNN
(backward, or forward for forward variants) in the same run.

    python benchmarks/hopper_variant_energy_gpu.py --variants a.py,b.py --shapes 2x8192x16x16x128 \\
        [--seconds 6] [--rounds 2] [--softcap 30] [--launcher torch] [--out variant_energy.json]

Shapes are B x L x Hq x Hk x D. A variant may compute other numbers on purpose (one that moves half of
some data, to see what moving less would buy): outputs are compared and the difference printed, not
checked. Timing: `gpu_timing.time_jax` (10 back-to-back calls, median of 3) three times in turn
("cool"); then per round and row a 3 s rest and `--seconds` of chunks of 10 calls ("sustained":
median chunk, nvidia-smi's SM clock and board power over the last two thirds, energy per call over
the whole run). `--rounds 0` times the cool calls only.

`--launcher torch` (forward variants): our kernels run on torch tensors through the drop-in's launcher
(`bridge.mosaic_launch.MosaicKernel`) and are timed as cuDNN is (CUDA events for the cool calls).
Through `jax.jit` (the default) a call reads 7-12 µs slower at 512-4k tokens (BENCHMARKS.md "What the
kernel-alone rows carry"), which leaves variants comparable with each other but not with cuDNN.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import jax
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import time_jax, time_torch
from hopper_kernels_gpu import backward_fn, backward_inputs, forward_fns, sms
from hopper_step_profile_gpu import _EnergyMeter, _smi_samples
from kernel_variants import load_variant
from jaxattn.jax_core import calls
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles


def _calls(shape, paths, softcap=None, launcher="jax") -> tuple[dict, bool, set]:
    """({name: call} for the kernel as is, each variant and cuDNN (without a cap) at `shape`, whether
    forward, and the names of the calls that run on torch tensors; our backward rows with `softcap`
    (its row operands from the forward without one: the work per score is the same), our forward rows
    through `launcher`."""
    b, l, hq, hk, d = shape
    modules = {os.path.basename(p): load_variant(p) for p in paths}
    forward = any(hasattr(m, "flash_forward_mgpu_tiles") for m in modules.values())
    if forward and softcap is not None:
        raise SystemExit(f"--softcap {softcap}: backward variants only")
    if not forward and launcher != "jax":
        raise SystemExit(f"--launcher {launcher}: forward variants only")
    on_torch = {"cudnn"}
    if forward:
        tuned = calls.hopper_tiles("forward", d, l)
        options = {"as is": (flash_forward_mgpu_tiles, tuned)}
        options.update({n: (m.flash_forward_mgpu_tiles, tuned) for n, m in modules.items()})
        found = forward_fns((b, l, hq, d), options, launcher)
        if launcher == "torch":
            on_torch |= set(found)
    else:
        splits = calls.hopper_head_splits(b, hq, hk, l, d)
        args = backward_inputs(*shape)
        fns = {"as is": backward_fn(shape, splits, sms(), softcap=softcap)}
        fns.update({n: backward_fn(shape, splits, sms(), m.flash_backward_mgpu_tiles, softcap=softcap)
                    for n, m in modules.items()})
        found = {n: (lambda f=f: f(*args)) for n, f in fns.items()}
    q, do = (torch.randn(b, hq, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    if forward:
        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk)
    else:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=hq != hk)

        def cudnn():
            return torch.autograd.grad(out, leaves, do, retain_graph=True)
    found["cudnn"] = cudnn
    return found, forward, on_torch


def _sync(on_torch, out):
    if on_torch:
        torch.cuda.synchronize()
    else:
        jax.block_until_ready(out)


def _sustained(on_torch, call, seconds, meter) -> dict:
    stop, samples, chunks = threading.Event(), [], []
    sampler = threading.Thread(target=_smi_samples, args=(stop, samples))
    sampler.start()
    began, energy_before = time.perf_counter(), meter.read()
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        for _ in range(10):
            out = call()
        _sync(on_torch, out)
        chunks.append((time.perf_counter() - start) * 1e5)  # s per 10 calls -> µs per call
    energy_after = meter.read()
    stop.set()
    sampler.join()
    late = samples[len(samples) // 3:]
    smi = {key: statistics.median(x[i] for x in late) if late else float("nan")
           for i, key in enumerate(("sm_clock_mhz", "power_w"))}
    energy = None if None in (energy_before, energy_after) else (energy_after - energy_before) / (10 * len(chunks))
    return dict(first_chunk_us=chunks[0], median_us=statistics.median(chunks), energy_mj=energy, **smi)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", required=True, help="comma-separated paths of modified kernel modules")
    parser.add_argument("--shapes", required=True, help="comma-separated BxLxHqxHkxD")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--softcap", type=float, default=None, help="backward variants: time them with this soft cap")
    parser.add_argument("--launcher", choices=("jax", "torch"), default="jax",
                        help="forward variants: through jax.jit on JAX arrays, or on torch tensors as the drop-in launches")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    meter, rows = _EnergyMeter(torch.cuda.current_device()), []
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        found, forward, on_torch = _calls(shape, args.variants.split(","), args.softcap, args.launcher)
        for name, call in found.items():
            _sync(name in on_torch, call())
        cool = {name: [] for name in found}
        for _ in range(3):
            for name, call in found.items():
                cool[name].append((time_torch if name in on_torch else time_jax)(call, iters=10, repeats=3))
        for name in found:
            rows.append(dict(shape=list(shape), forward=forward, row=name, part="cool",
                             us=statistics.median(cool[name]), rounds=[round(x, 1) for x in cool[name]]))
            print(f"{shape} {name:28} cool {rows[-1]['us']:8.1f} us {rows[-1]['rounds']}", flush=True)
        for rnd in range(args.rounds):
            for name, call in found.items():
                time.sleep(3)  # each row starts from a rested GPU
                row = dict(shape=list(shape), forward=forward, row=name, part="sustained", round=rnd,
                           **_sustained(name in on_torch, call, args.seconds, meter))
                rows.append(row)
                print(f"{shape} round {rnd} {name:28} first {row['first_chunk_us']:8.1f} median {row['median_us']:8.1f}"
                      f" us | {row['sm_clock_mhz']:.0f} MHz {row['power_w']:.0f} W"
                      + ("" if row["energy_mj"] is None else f" {row['energy_mj']:.1f} mJ/call"), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, jax=jax.__version__,
                           launcher=args.launcher, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
