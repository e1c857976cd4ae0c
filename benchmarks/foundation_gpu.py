"""GPU timings of the drop-in against torch's backends and JAX's own cuDNN call.

    python benchmarks/foundation_gpu.py [--out results.json]

Measures (bf16, causal):
  * (8,16,2048,128) and (1,32,16384,128): forward and forward+backward of the drop-in, torch's
    cuDNN and flash backends, and jax.nn.dot_product_attention(implementation="cudnn") called from
    JAX directly on (B,T,H,D) arrays (no bridge);
  * the end-to-end small call at (1,4,128,64) against torch's SDPA.
Large shapes: steady-state time per call, i.e. back-to-back calls timed together (CUDA events for
torch-side calls, wall time to block_until_ready for JAX-only calls), median of 5 repeats after
warm-up. Small call: wall time per call of back-to-back calls (host-bound). The first call (trace
and compile) is reported separately.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jaxattn.bridge  # noqa: F401  (memory policy first)
import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa


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


def time_host_loop(fn, n=200):
    """Per-call wall time of back-to-back calls (for small calls, host overhead dominates)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def large_shape(b, h, l, e, iters):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, l, e, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, l, e, generator=gen, device="cuda", dtype=torch.bfloat16)
    flops_fwd = 4 * b * h * l * l * e / 2  # causal halves the work
    row = {"shape": [b, h, l, e]}

    def fwd(f):
        def run():
            with torch.no_grad():  # forward = inference forward, as JAX's forward-only call
                return f(q, k, v, is_causal=True)
        return run

    def fwd_bwd(f):
        def run():
            out = f(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    t0 = time.perf_counter()
    jax_sdpa(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    row["dropin_first_call_s"] = time.perf_counter() - t0
    row["dropin_fwd_us"] = time_torch(fwd(jax_sdpa), iters=iters)
    row["dropin_fwdbwd_us"] = time_torch(fwd_bwd(jax_sdpa), iters=iters)
    for name, backend in (("torch_cudnn", SDPBackend.CUDNN_ATTENTION), ("torch_flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            try:
                row[f"{name}_fwd_us"] = time_torch(fwd(F.scaled_dot_product_attention), iters=iters)
                row[f"{name}_fwdbwd_us"] = time_torch(fwd_bwd(F.scaled_dot_product_attention), iters=iters)
            except RuntimeError as exc:
                row[f"{name}_error"] = str(exc)[:200]

    keys = jax.random.split(jax.random.key(0), 3)
    qj, kj, vj = (jax.random.normal(kk, (b, l, h, e), jnp.bfloat16) for kk in keys)
    jf = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    row["jax_cudnn_fwd_us"] = time_jax(lambda: jf(qj, kj, vj), iters=iters)
    jg = jax.jit(jax.grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    row["jax_cudnn_fwdbwd_us"] = time_jax(lambda: jg(qj, kj, vj), iters=iters)
    row["dropin_vs_jax_cudnn_fwd"] = row["jax_cudnn_fwd_us"] / row["dropin_fwd_us"]
    row["dropin_tflops_fwd"] = flops_fwd / row["dropin_fwd_us"] / 1e6
    return row


def small_call():
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 4, 128, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn_like(q)
    row = {"shape": [1, 4, 128, 64]}
    row["dropin_fwd_us"] = time_host_loop(lambda: jax_sdpa(q, k, v, is_causal=True))
    row["torch_sdpa_fwd_us"] = time_host_loop(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

    def fb(f):
        return lambda: torch.autograd.grad(f(qg, kg, vg, is_causal=True), (qg, kg, vg), dout)

    row["dropin_fwdbwd_us"] = time_host_loop(fb(jax_sdpa))
    row["torch_sdpa_fwdbwd_us"] = time_host_loop(fb(F.scaled_dot_product_attention))
    row["fwd_ratio"] = row["dropin_fwd_us"] / row["torch_sdpa_fwd_us"]
    row["fwdbwd_ratio"] = row["dropin_fwdbwd_us"] / row["torch_sdpa_fwdbwd_us"]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
                     "cudnn_torch": torch.backends.cudnn.version()},
        "small_call": small_call(),
        "large": [large_shape(8, 16, 2048, 128, 20), large_shape(1, 32, 16384, 128, 5)],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
