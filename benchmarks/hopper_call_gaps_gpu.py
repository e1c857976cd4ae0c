"""Where a back-to-back call of the Hopper forward spends its time beside the kernel, against torch's
cuDNN: per call, the host's time to issue it (200 calls queued behind a 0.1 s sleep kernel, so the
GPU never waits for the host), the time between CUDA events over back-to-back calls, the time per
call replayed from a CUDA graph of 20 calls, and the torch profiler's span and kernels.

    python benchmarks/hopper_call_gaps_gpu.py

Rows: "ours" (the drop-in, `scaled_dot_product_attention`, no gradients, the Hopper kernels at every
length), "ours+launcher ctx" (the same inside `sdpa_launcher("native")`), "MosaicKernel" (the forward
kernel launched on folded views directly) and "cudnn" (F.scaled_dot_product_attention under
`sdpa_kernel`). Causal bf16, head dim 64, (16, 16, 1024) and (32, 16, 512). A drop-in call inside a
CUDA graph capture does not launch the Mosaic GPU kernel (`mosaic_launch.mosaic_reasons`), so its
"graph" column times another path.
"""

from __future__ import annotations

import functools
import statistics
import time

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import kernel_profile, time_torch
from hopper_kernels_gpu import sms
from jaxattn.bridge import triton_program
from jaxattn.bridge.mosaic_launch import MosaicKernel
from jaxattn.jax_core import calls
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles
from jaxattn.torch_api import hopper_flash, scaled_dot_product_attention, sdpa_launcher


def host_us(fn, calls_=200):
    """Host time per call, the calls queued behind a sleep kernel (median of 3)."""
    times = []
    for _ in range(3):
        torch.cuda._sleep(int(1.5e9 * 0.1))
        t0 = time.perf_counter()
        for _ in range(calls_):
            fn()
        times.append((time.perf_counter() - t0) / calls_ * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def graph_us(fn, calls_=20):
    """Time per call replayed from a CUDA graph of `calls_` calls, or why none was captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls_):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return f"{time_torch(graph.replay, warmup=2, iters=5, repeats=5) / calls_:6.1f}"
    except Exception as e:  # noqa: BLE001  (reported, not raised: the other columns stand)
        return f"no graph: {type(e).__name__}: {str(e)[:120]}"


def main():
    print("compiled programs", triton_program.wait(600))
    hopper_flash.HOPPER_MIN_LENGTH.update(forward=0, train=0)
    hopper_flash.HOPPER_MIN_LENGTH_PROGRAM = {kind: {} for kind in hopper_flash.HOPPER_MIN_LENGTH_PROGRAM}
    for (b, h, l, d) in ((16, 16, 1024, 64), (32, 16, 512, 64)):
        q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def ours():
            with torch.no_grad():
                return scaled_dot_product_attention(q, k, v, is_causal=True)

        def ours_launcher():
            with torch.no_grad(), sdpa_launcher("native"):
                return scaled_dot_product_attention(q, k, v, is_causal=True)

        def cudnn():
            with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        folded = (x.reshape(b * h, l, 1, d) for x in (q, k, v))
        direct = functools.partial(MosaicKernel(flash_forward_mgpu_tiles), *folded, scale=d ** -0.5, causal=True,
                                   programs=sms(), **calls.hopper_tiles("forward", d, l))
        for name, fn in (("ours", ours), ("ours+launcher ctx", ours_launcher), ("MosaicKernel", direct),
                         ("cudnn", cudnn)):
            fn()
            torch.cuda.synchronize()
            host = host_us(fn)
            events = time_torch(fn, iters=20, repeats=5)
            graph = graph_us(fn)
            kernels, span = kernel_profile(fn, calls=20)
            named = {n[:40]: round(t, 1) for n, t in kernels.items()}
            print(f"{(b, h, l, d)} {name:18s} host {host:6.1f} us | events {events:6.1f} | graph {graph} | "
                  f"span {span:6.1f} | kernels {named}")


if __name__ == "__main__":
    main()
