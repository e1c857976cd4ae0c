"""Hopper forward prototype (jax_core/kernels/flash_fwd_tma_triton.py) against our current flash kernel,
torch's cuDNN and flash SDPA backends and JAX's Pallas Mosaic GPU attention: forward only, bf16,
(B, H, L, D) contiguous, causal (and one non-causal shape).

    python benchmarks/flash_hopper_gpu.py [--out hopper.json] [--no-warp-specialize] [--quick]

Timing: CUDA events around a batch of back-to-back calls (enough calls to cover ~2 ms, so launch
overhead does not count at small shapes), 3 warm-up batches, median of 10 batches. TFLOP/s use
flash-attn's convention: 4*B*H*L*S*D, halved for causal. Each output is checked against torch's SDPA
in float32 (default backend choice): the max abs error is printed and errors > 2e-2 are flagged. Every
flash kernel rounds the probabilities to bf16 before P.V, so errors of the order of cuDNN's are expected.

Defensive by design (it runs on a machine nobody watches): every variant runs in try/except and the
run goes on after a failure; results print as they come. Warp-specialized variants run last, in a
second phase, and a watchdog prints the table so far and exits if one variant takes longer than
--variant-timeout seconds (a kernel that deadlocks cannot be interrupted otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
import traceback

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.jax_core.kernels.flash_fwd_tma_triton import flash_fwd_tma_kernel
from jaxattn.jax_core.kernels.flash_plan import Operand
from jaxattn.jax_core.kernels.flash_tma_plan import TmaTile, fwd_tma_launch
from jaxattn.torch_api import flash_attention

SHAPES = [(1, 16, 16384, 128), (2, 16, 8192, 128), (4, 16, 4096, 64), (16, 16, 1024, 64)]
NON_CAUSAL_SHAPE = (1, 16, 16384, 128)
ERROR_FLAG = 2e-2
DEVICE = "cuda"  # a module setting so that a CPU dry run (Triton's interpreter) can exercise the script
TARGET_BATCH_MS = 2.0

# Prototype variants per head dim: (name, tile). Shared memory per program is about
# (BLOCK_M + 2 * stages * BLOCK_N) * D * 2 bytes, within Hopper's 227 KiB for all of these.
TILES = {
    128: [
        ("tma 64x64 w4 s3", TmaTile(64, 64, 4, 3)),  # the current kernel's tile, with TMA
        ("tma 128x64 w8 s3", TmaTile(128, 64, 8, 3)),
        ("tma 128x128 w8 s2", TmaTile(128, 128, 8, 2)),
        ("tma 128x64 w8 s3 m-fastest", TmaTile(128, 64, 8, 3, heads_fastest=False)),
        ("tma 128x64 w8 s3 ws", TmaTile(128, 64, 8, 3, warp_specialize=True)),
        ("tma 128x128 w8 s2 ws", TmaTile(128, 128, 8, 2, warp_specialize=True)),
    ],
    64: [
        ("tma 64x64 w4 s3", TmaTile(64, 64, 4, 3)),
        ("tma 128x64 w8 s4", TmaTile(128, 64, 8, 4)),
        ("tma 128x128 w8 s3", TmaTile(128, 128, 8, 3)),
        ("tma 128x64 w8 s4 m-fastest", TmaTile(128, 64, 8, 4, heads_fastest=False)),
        ("tma 128x64 w8 s4 ws", TmaTile(128, 64, 8, 4, warp_specialize=True)),
        ("tma 128x128 w8 s3 ws", TmaTile(128, 128, 8, 3, warp_specialize=True)),
    ],
}


def flops(b, h, l, s, d, causal):
    return 4 * b * h * l * s * d / (2 if causal else 1)


# ----------------------------------------------------------------------------- the prototype's launcher

def _scratch(size, alignment, stream):
    """Global scratch for device-side TMA descriptors (Triton asks for it at each launch)."""
    return torch.empty(size, dtype=torch.int8, device=DEVICE)


def prototype(q, k, v, *, causal, tile, scale=None):
    """The prototype on (B, H, L, D) tensors, top-left causal; returns (out, lse)."""
    b, hq, l, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, hq, l), dtype=torch.float32, device=q.device)
    launch = fwd_tma_launch(
        *(Operand(tuple(t.shape), tuple(t.stride())) for t in (q, k, v, out)),
        dtype_bytes=q.element_size(), scale=d ** -0.5 if scale is None else scale, causal=causal,
        diag_offset=0, tile=tile, base_addresses=[t.data_ptr() for t in (q, k, v, out)])
    flash_fwd_tma_kernel[launch.grid](q, k, v, out, lse, **launch.args, num_warps=launch.num_warps,
                                      num_stages=launch.num_stages)
    return out, lse


# ----------------------------------------------------------------------------- Pallas Mosaic GPU

def mosaic_gpu_attention(causal):
    """A torch-callable (q, k, v) -> out in (B, L, H, D) layout running JAX's Pallas Mosaic GPU
    attention through `plgpu.as_torch_kernel`, or raises with the reason. That kernel has no softmax
    scale: the caller passes q pre-scaled.

    `as_torch_kernel` takes a function holding one Mosaic GPU kernel call and nothing else; the public
    `attention` wraps it in jit and custom_vjp, so if that does not convert, the module's forward
    function (no wrappers) is tried. The conversion happens at the first call."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    config = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=causal)

    def public(q, k, v):
        return attention_mgpu.attention(q, k, v, config)

    def unwrapped(q, k, v):
        return attention_mgpu._attention_forward(q, k, v, config)

    kernels = [plgpu.as_torch_kernel(public)]
    if hasattr(attention_mgpu, "_attention_forward"):
        kernels.append(plgpu.as_torch_kernel(unwrapped))

    def call(q, k, v):
        while True:
            try:
                return kernels[0](q, k, v)
            except Exception as exc:  # noqa: BLE001 - fall back to the next form, else re-raise
                if len(kernels) == 1:
                    raise
                print(f"note: mosaic-gpu through `attention` failed ({type(exc).__name__}: {exc}); "
                      "trying its unwrapped forward", flush=True)
                kernels.pop(0)
    return call


# ----------------------------------------------------------------------------- timing and checks

def time_ms(fn):
    """Median over 10 batches of back-to-back calls (after 3 warm-up batches) of the time per call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()  # compiles
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, math.ceil(TARGET_BATCH_MS / max(start.elapsed_time(end), 1e-3)))
    samples = []
    for i in range(13):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        if i >= 3:
            samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


class Watchdog:
    """Prints the results so far and ends the process if one variant runs past `seconds`."""

    def __init__(self, seconds, report):
        self.seconds, self.report, self._timer = seconds, report, None

    def arm(self, label):
        self.disarm()

        def fire():
            print(f"\n!! {label} ran past {self.seconds} s (deadlock?): stopping the run", flush=True)
            self.report()
            os._exit(3)
        self._timer = threading.Timer(self.seconds, fire)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class Bench:
    def __init__(self, timeout):
        self.rows = []
        self.watchdog = Watchdog(timeout, self.print_table)

    def run(self, shape, causal, name, fn, want, layout="bhld"):
        """Times `fn` (returning the output in `layout`) and checks it against `want` (B, H, L, D)."""
        b, h, l, d = shape
        row = dict(shape=list(shape), causal=causal, variant=name)
        self.watchdog.arm(f"{name} at {shape}")
        try:
            got = fn()
            if layout == "blhd":
                got = got.transpose(1, 2)
            row["max_abs_err"] = (got.float() - want.float()).abs().max().item()
            row["ms"] = time_ms(fn)
            row["tflops"] = flops(b, h, l, l, d, causal) / (row["ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            traceback.print_exc(limit=2)
        finally:
            self.watchdog.disarm()
        self.rows.append(row)
        print(self.format_row(row), flush=True)
        return row

    @staticmethod
    def format_row(row):
        head = f"{str(tuple(row['shape'])):22} {'causal' if row['causal'] else 'full':6} {row['variant']:30}"
        if "error" in row:
            return f"{head} FAILED {row['error']}"
        flag = "  <-- ERROR > 2e-2" if row["max_abs_err"] > ERROR_FLAG else ""
        return f"{head} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err {row['max_abs_err']:.2e}{flag}"

    def print_table(self):
        print("\n" + "=" * 110, flush=True)
        print(f"{'shape (B, H, L, D)':22} {'mask':6} {'variant':30} {'time':>11} {'TFLOP/s':>15}  max abs err")
        for row in self.rows:
            print(self.format_row(row))
        print("=" * 110, flush=True)


def inputs(shape, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen, device=DEVICE, dtype=dtype) for _ in range(3))


def reference(q, k, v, causal):
    """torch's SDPA on float32 copies: every bf16 variant's error is then its own (about half a bf16
    ulp of the output at best), not the sum of two roundings."""
    with torch.no_grad():
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)


def baselines(bench, shape, causal, q, k, v, want, mgpu):
    if causal:  # the current kernel's figure is the causal one the issue quotes
        bench.run(shape, causal, "ours flash (current kernel)",
                  lambda: flash_attention(q, k, v, causal=causal, implementation="flash"), want)
    for name, backend in (("torch sdpa cuDNN", SDPBackend.CUDNN_ATTENTION),
                          ("torch sdpa flash", SDPBackend.FLASH_ATTENTION)):
        if not causal and backend == SDPBackend.FLASH_ATTENTION:
            continue

        def call(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        bench.run(shape, causal, name, call, want)
    if causal and mgpu is not None:
        # (B, L, H, D) copies, q pre-scaled (the kernel has no scale); made outside the timed calls.
        blhd = [x.transpose(1, 2).contiguous() for x in (q * shape[3] ** -0.5, k, v)]
        row = bench.run(shape, causal, "jax pallas mosaic-gpu", lambda: mgpu(*blhd), want, layout="blhd")
        if "error" in row:  # its shared-memory buffers were float16-only in some JAX versions
            blhd = [x.half() for x in blhd]
            bench.run(shape, causal, "jax pallas mosaic-gpu (fp16)", lambda: mgpu(*blhd), want, layout="blhd")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--no-warp-specialize", action="store_true", help="skip the warp-specialized variants")
    parser.add_argument("--quick", action="store_true", help="first shape only")
    parser.add_argument("--variant-timeout", type=float, default=180.0)
    args = parser.parse_args()
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    triton.set_allocator(_scratch)
    mgpu = None
    try:
        mgpu = mosaic_gpu_attention(causal=True)
    except Exception as exc:  # noqa: BLE001
        print(f"note: JAX Pallas Mosaic GPU attention skipped ({type(exc).__name__}: {exc})", flush=True)

    bench = Bench(args.variant_timeout)
    shapes = SHAPES[:1] if args.quick else SHAPES
    started = time.perf_counter()
    print("-- phase 1: baselines and prototype variants without warp specialization", flush=True)
    for shape in shapes:
        q, k, v = inputs(shape)
        want = reference(q, k, v, causal=True)
        baselines(bench, shape, True, q, k, v, want, mgpu)
        for name, tile in TILES[shape[3]]:
            if not tile.warp_specialize:
                bench.run(shape, True, name, lambda tile=tile: prototype(q, k, v, causal=True, tile=tile)[0], want)
        del q, k, v, want
    q, k, v = inputs(NON_CAUSAL_SHAPE)
    want = reference(q, k, v, causal=False)
    baselines(bench, NON_CAUSAL_SHAPE, False, q, k, v, want, mgpu)
    for name, tile in TILES[NON_CAUSAL_SHAPE[3]][:3]:
        bench.run(NON_CAUSAL_SHAPE, False, name, lambda tile=tile: prototype(q, k, v, causal=False, tile=tile)[0],
                  want)
    del q, k, v, want
    bench.print_table()

    if not args.no_warp_specialize:
        print("-- phase 2: warp-specialized prototype variants", flush=True)
        for shape in shapes:
            q, k, v = inputs(shape)
            want = reference(q, k, v, causal=True)
            for name, tile in TILES[shape[3]]:
                if tile.warp_specialize:
                    bench.run(shape, True, name, lambda tile=tile: prototype(q, k, v, causal=True, tile=tile)[0],
                              want)
            del q, k, v, want
        bench.print_table()
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), triton=triton.__version__, torch=torch.__version__,
                           rows=bench.rows), f, indent=1)


if __name__ == "__main__":
    main()
