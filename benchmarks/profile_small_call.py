"""Where the host time of a small drop-in call goes: cProfile of back-to-back calls.

    python benchmarks/profile_small_call.py [--device cuda] [--grad]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grad", action="store_true")
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 4, 128, 64, device=args.device, dtype=dtype, requires_grad=args.grad) for _ in range(3))

    def call():
        return jax_sdpa(q, k, v, is_causal=True)

    for _ in range(30):
        call()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.calls):
        call()
    if args.device == "cuda":
        torch.cuda.synchronize()
    print(f"per call: {(time.perf_counter() - t0) / args.calls * 1e6:.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls):
        call()
    profile.disable()
    stats = pstats.Stats(profile)
    stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
