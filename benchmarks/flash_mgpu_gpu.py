"""Our Pallas Mosaic GPU flash forward (jax_core/kernels/flash_fwd_mgpu.py) on an H100: launched on
torch tensors through `plgpu.as_torch_kernel` (no XLA runtime) at several (block_kv, stages)
variants and through `jax.jit` on JAX arrays, against torch's SDPA with the cuDNN backend and JAX's
own Pallas Mosaic GPU attention (fp16), forward only, causal bf16 and fp16 at four shapes, and one
non-causal shape.

    python benchmarks/flash_mgpu_gpu.py [--out mgpu.json] [--quick] [--variant-timeout 180]

Timing: CUDA events around a batch of back-to-back calls (enough to cover ~2 ms), 3 warm-up batches,
median of 10 batches; the `jax.jit` row uses wall time and block_until_ready the same way (its work
runs on JAX's stream, which torch's events do not see). TFLOP/s: 4*B*H*L*S*D, halved for causal.
Every output is checked against torch's SDPA on float32 copies (max abs error, flagged above 2e-2);
the LSE against a float32 logsumexp on a small shape first.

Defensive (the run is unattended): every variant runs in try/except and the run goes on; a watchdog
prints the table so far and exits if one variant runs past --variant-timeout (a deadlocked kernel
cannot be interrupted otherwise).
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
import jax
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu

SHAPES = [(1, 16, 16384, 128), (2, 16, 8192, 128), (4, 16, 4096, 64), (16, 16, 1024, 64)]
NON_CAUSAL_SHAPE = (1, 16, 16384, 128)
LSE_SHAPE = (2, 4, 1024, 128)  # (B, H, L, D), L = S
DTYPES = (torch.bfloat16, torch.float16)
# (block_kv, stages); block_q is 64 (two compute warpgroups: 128 query rows per program). Shared
# memory at D = 128: Q/O 32 KiB + stages * 2 * block_kv * 256 B, within Hopper's 227 KiB for all.
VARIANTS = [(128, 2), (128, 3), (64, 2), (64, 3), (64, 4)]
ERROR_FLAG = 2e-2
TARGET_BATCH_MS = 2.0


def flops(b, h, l, s, d, causal):
    return 4 * b * h * l * s * d / (2 if causal else 1)


# ----------------------------------------------------------------------------- launches

def ours_torch(scale, causal, block_kv, stages):
    """(q, k, v) torch (B, L, H, D) contiguous -> (out, lse) through as_torch_kernel. The function
    handed to it holds the one kernel call and nothing else, as as_torch_kernel requires; it is
    kept referenced by the returned closure (as_torch_kernel caches on it weakly)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def forward(q, k, v):
        return flash_forward_mgpu(q, k, v, scale=scale, causal=causal, block_kv=block_kv, stages=stages)
    return plgpu.as_torch_kernel(forward)


def ours_jit(scale, causal, block_kv, stages):
    return jax.jit(lambda q, k, v: flash_forward_mgpu(q, k, v, scale=scale, causal=causal,
                                                      block_kv=block_kv, stages=stages))


def jax_reference_kernel():
    """JAX's own Pallas Mosaic GPU attention on torch tensors, (B, L, H, D), no softmax scale (the
    caller pre-scales q); its unwrapped forward first (one kernel call), else the public jitted one."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas.ops.gpu import attention_mgpu as ref

    config = ref.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    forms = [plgpu.as_torch_kernel(lambda q, k, v: ref.attention(q, k, v, config))]
    if hasattr(ref, "_attention_forward"):
        forms.insert(0, plgpu.as_torch_kernel(lambda q, k, v: ref._attention_forward(q, k, v, config)))

    def call(q, k, v):
        while True:
            try:
                return forms[0](q, k, v)
            except Exception as exc:  # noqa: BLE001 - the next form, else re-raise
                if len(forms) == 1:
                    raise
                print(f"note: JAX mosaic-gpu form failed ({type(exc).__name__}: {exc}); trying the next",
                      flush=True)
                forms.pop(0)
    return call


# ----------------------------------------------------------------------------- timing

def _batched(run_batch):
    """Median per-call ms over 10 batches of back-to-back calls after 3 warm-up batches; a batch
    covers ~TARGET_BATCH_MS. run_batch(n) -> elapsed ms of n calls."""
    run_batch(1)  # compiles
    one = max(run_batch(1), 1e-3)
    calls = max(1, math.ceil(TARGET_BATCH_MS / one))
    samples = [run_batch(calls) / calls for _ in range(13)]
    return statistics.median(samples[3:])


def time_torch_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run_batch(n):
        torch.cuda.synchronize()
        start.record()
        for _ in range(n):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    return _batched(run_batch)


def time_jax_ms(fn):
    def run_batch(n):
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) * 1e3
    return _batched(run_batch)


# ----------------------------------------------------------------------------- the run

class Bench:
    def __init__(self, timeout):
        self.rows, self.timeout = [], timeout

    def run(self, shape, dtype, causal, name, fn, want, timer=time_torch_ms, to_bhld=None):
        """Checks fn()'s output (converted by to_bhld) against want (B, H, L, D) float32, then times fn."""
        b, h, l, d = shape
        row = dict(shape=list(shape), dtype=str(dtype).split(".")[-1], causal=causal, variant=name)
        timer_thread = threading.Timer(self.timeout, self._deadlock, args=(f"{name} at {shape}",))
        timer_thread.daemon = True
        timer_thread.start()
        try:
            got = fn()
            got = to_bhld(got) if to_bhld else got
            row["max_abs_err"] = (got.float() - want).abs().max().item()
            row["ms"] = timer(fn)
            row["tflops"] = flops(b, h, l, l, d, causal) / (row["ms"] * 1e-3) / 1e12
        except Exception as exc:  # noqa: BLE001 - report and go on with the next variant
            msg = str(exc).splitlines()[0][:300] if str(exc) else ""
            row["error"] = f"{type(exc).__name__}: {msg}"
            traceback.print_exc(limit=3)
        finally:
            timer_thread.cancel()
        self.rows.append(row)
        print(self.format_row(row), flush=True)
        return row

    def _deadlock(self, label):
        print(f"\n!! {label} ran past {self.timeout} s (deadlock?): stopping the run", flush=True)
        self.print_table()
        os._exit(3)

    @staticmethod
    def format_row(row):
        head = (f"{str(tuple(row['shape'])):22} {row.get('dtype', 'bfloat16'):9} "
                f"{'causal' if row['causal'] else 'full':6} {row['variant']:34}")
        if "error" in row:
            return f"{head} FAILED {row['error']}"
        if "ms" not in row:  # the LSE checks: an error, no timing
            return f"{head} {'':>36}  err {row['max_abs_err']:.2e}"
        flag = "  <-- ERROR > 2e-2" if row["max_abs_err"] > ERROR_FLAG else ""
        return f"{head} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s  err {row['max_abs_err']:.2e}{flag}"

    def print_table(self):
        print("\n" + "=" * 120, flush=True)
        print(f"{'shape (B, H, L, D)':22} {'dtype':9} {'mask':6} {'variant':34} {'time':>11} {'TFLOP/s':>15}  "
              "max abs err")
        for row in self.rows:
            print(self.format_row(row))
        print("=" * 120, flush=True)


def inputs(shape, dtype, seed=0):
    """(B, H, L, D) contiguous (for torch's SDPA) and (B, L, H, D) contiguous copies (for the kernels)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    bhld = [torch.randn(*shape, generator=gen, device="cuda", dtype=dtype) for _ in range(3)]
    return bhld, [x.transpose(1, 2).contiguous() for x in bhld]


def blhd_to_bhld(x):
    return x.transpose(1, 2)


def check_lse(bench_rows):
    """Our LSE (natural log) against torch's float32 logsumexp of the scaled, masked logits."""
    b, h, l, d = LSE_SHAPE
    for causal in (True, False):
        row = dict(shape=list(LSE_SHAPE), causal=causal, variant="lse check (as_torch_kernel)")
        try:
            (q, k, _), (qb, kb, vb) = inputs(LSE_SHAPE, torch.bfloat16, seed=1)
            _, lse = ours_torch(d ** -0.5, causal, 128, 2)(qb, kb, vb)
            logits = (q.float() @ k.float().transpose(-1, -2)) * d ** -0.5
            if causal:
                logits = logits.masked_fill(torch.ones(l, l, dtype=torch.bool, device="cuda").triu(1), -math.inf)
            row["max_abs_err"] = (lse - torch.logsumexp(logits, -1)).abs().max().item()
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc(limit=3)
        bench_rows.append(row)
        print(row, flush=True)


def run_shape(bench, shape, dtype, causal, ref_kernel, variants):
    b, h, l, d = shape
    scale = d ** -0.5
    (q, k, v), blhd = inputs(shape, dtype)
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    bench.run(shape, dtype, causal, "torch sdpa cuDNN", cudnn, want)
    if ref_kernel is not None and causal and dtype == torch.float16:
        pre_scaled = [blhd[0] * scale, blhd[1], blhd[2]]  # it has no softmax scale
        bench.run(shape, dtype, causal, "jax attention_mgpu (reference)", lambda: ref_kernel(*pre_scaled), want,
                  to_bhld=blhd_to_bhld)
    for block_kv, stages in variants:
        try:
            kernel = ours_torch(scale, causal, block_kv, stages)
        except Exception as exc:  # noqa: BLE001
            print(f"ours bkv{block_kv} s{stages}: setup failed: {exc}", flush=True)
            continue
        bench.run(shape, dtype, causal, f"ours torch bkv{block_kv} s{stages}", lambda kernel=kernel: kernel(*blhd)[0],
                  want, to_bhld=blhd_to_bhld)
    block_kv, stages = variants[0]
    try:
        jq, jk, jv = (jax.dlpack.from_dlpack(x) for x in blhd)
        jitted = ours_jit(scale, causal, block_kv, stages)
        bench.run(shape, dtype, causal, f"ours jax.jit bkv{block_kv} s{stages}", lambda: jitted(jq, jk, jv)[0], want,
                  timer=time_jax_ms, to_bhld=lambda o: blhd_to_bhld(torch.from_dlpack(o)))
    except Exception as exc:  # noqa: BLE001
        print(f"ours jax.jit: setup failed: {type(exc).__name__}: {exc}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--quick", action="store_true", help="first shape, bf16, default variant only")
    parser.add_argument("--variant-timeout", type=float, default=180.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
          f"torch {torch.__version__}, jax {jax.__version__}", flush=True)
    ref_kernel = None
    try:
        ref_kernel = jax_reference_kernel()
    except Exception as exc:  # noqa: BLE001
        print(f"note: JAX attention_mgpu skipped ({type(exc).__name__}: {exc})", flush=True)

    bench = Bench(args.variant_timeout)
    started = time.perf_counter()
    check_lse(bench.rows)
    shapes, dtypes, variants = (SHAPES[:1], DTYPES[:1], VARIANTS[:1]) if args.quick else (SHAPES, DTYPES, VARIANTS)
    for shape in shapes:
        for dtype in dtypes:
            run_shape(bench, shape, dtype, True, ref_kernel, variants)
    run_shape(bench, NON_CAUSAL_SHAPE, torch.bfloat16, False, ref_kernel, variants[:2])
    bench.print_table()
    print(f"total {time.perf_counter() - started:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, jax=jax.__version__,
                           rows=bench.rows), f, indent=1)


if __name__ == "__main__":
    main()
