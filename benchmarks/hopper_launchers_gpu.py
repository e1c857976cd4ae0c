"""The Hopper forward through its two launchers and two memory layouts, against torch's cuDNN in the
same run, causal bf16:

    * "jax.jit": `flash_forward_mgpu_tiles` on JAX arrays (B, L, H, D), tuned tiles, persistent grid,
      as `hopper_variant_energy_gpu.py` and `hopper_kernels_gpu.py` time it (wall clock around
      back-to-back calls, then `block_until_ready`);
    * "drop-in, (B, H, L, D)": `scaled_dot_product_attention` on contiguous tensors (the kernel sees
      (B * H, L, 1, D)), as `hopper_torch_gpu.py --targets` times it (CUDA events);
    * "drop-in, (B, L, H, D) seen transposed": the same on `x.transpose(1, 2)` of (B, L, H, D)
      tensors, the layout transformers' attention passes;
    * torch's cuDNN on both layouts.

    python benchmarks/hopper_launchers_gpu.py [--shapes 16x16x1024x64,...] [--rounds 3] [--out FILE]

Shapes are B x H x L x D. The rows are timed in turn, `--rounds` times; each reports its median.
It says whether a kernel-alone comparison with cuDNN carries the launcher's cost, and whether the
layout a model passes runs as fast as the one the targets time.
"""

from __future__ import annotations

import argparse
import statistics

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import jax
import torch
from torch.nn.attention import SDPBackend

from gpu_timing import time_jax, time_torch, write_report
from hopper_kernels_gpu import forward_fns
from hopper_torch_gpu import drop_in, torch_backend
from jaxattn.bridge import triton_program
from jaxattn.jax_core import calls
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles


def _rows(b, h, l, d):
    """{name: (timer, call)} at one shape."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    contiguous = [torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    transposed = [torch.randn(b, l, h, d, generator=gen, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(3)]
    [jitted] = forward_fns((b, l, h, d), {"jax.jit": (flash_forward_mgpu_tiles, calls.hopper_tiles("forward", d, l))}
                           ).values()

    def torch_row(fn, qkv):
        def call():
            with torch.no_grad():
                return fn(*qkv, True)
        return time_torch, call

    ours, cudnn = drop_in(True), torch_backend(SDPBackend.CUDNN_ATTENTION)
    return {"jax.jit, (B, L, H, D)": (time_jax, jitted),
            "drop-in, (B, H, L, D)": torch_row(ours, contiguous),
            "drop-in, (B, L, H, D) seen transposed": torch_row(ours, transposed),
            "torch cudnn, (B, H, L, D)": torch_row(cudnn, contiguous),
            "torch cudnn, (B, L, H, D) seen transposed": torch_row(cudnn, transposed)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="16x16x1024x64,32x16x512x64,4x16x4096x64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, jax {jax.__version__}", flush=True)
    print("compiled programs:", triton_program.wait(600), flush=True)
    report = []
    for text in args.shapes.split(","):
        b, h, l, d = (int(x) for x in text.split("x"))
        rows = _rows(b, h, l, d)
        times = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, (timer, call) in rows.items():
                times[name].append(round(timer(call, iters=10, repeats=3), 1))
        for name, rounds in times.items():
            us = statistics.median(rounds)
            print(f"({b}, {h}, {l}, {d}) {name:45s} {us:8.1f} us {rounds}", flush=True)
            report.append(dict(shape=[b, h, l, d], row=name, us=us, rounds=rounds))
    if args.out:
        write_report(args.out, report)


if __name__ == "__main__":
    main()
