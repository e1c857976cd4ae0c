"""Per-call cost of the drop-in SDPA: end to end against torch, and where the time goes.

    python benchmarks/small_call.py [--device cuda|cpu] [--out small.json] [--dropin-only] [--shape B,H,L,E]

Measures (causal; bf16 on CUDA, float32 on CPU):
  * end to end at (1, 4, 128, 64) (and (4, 16, 512, 64) on CUDA): the drop-in's inference forward
    (`torch.no_grad()`) and forward+backward (`torch.autograd.grad`), torch's default SDPA and, on
    CUDA, each of its backends (flash, efficient, cuDNN); first-call time and the cache's compile
    time; on CUDA the GPU kernel time per call from torch's profiler (it sees JAX's kernels too);
  * the breakdown of one drop-in inference forward at (1, 4, 128, 64): signature memo, operand
    views, stream handshake (CUDA), `importable`, import, executable dispatch, export; and the
    public-API pieces the bridge used before (`jax.dlpack.from_dlpack` per tensor, torch's own
    per-tensor handshake, `torch.from_dlpack`, the custom op's dispatch).
Timing: wall time per call of back-to-back calls (synchronised before and after on CUDA), median
of 7 repeats after warm-up: host-bound calls are measured as a model issues them. On CPU the
export waits for the result, so "export" there includes the wait for the computation.
`--dropin-only` times only the drop-in end to end (it runs against older checkouts too).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jaxattn.bridge  # noqa: F401  (memory policy first)
import jax
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa

SMALL, TRAIN = (1, 4, 128, 64), (4, 16, 512, 64)
DEVICE = "cuda"


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, n=200, repeats=7, warmup=20) -> float:
    """Wall time per call of `n` back-to-back calls, synchronised before and after."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def host_us(fn, n=200, repeats=7, warmup=20) -> float:
    """Host time per call (no synchronisation inside the timed loop; for host-side pieces)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return statistics.median(times)


def kernel_us(fn, n=50):
    """GPU kernel time per call (torch's profiler sees every kernel in the process, JAX's too)."""
    if DEVICE != "cuda":
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        fn()
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            sync()
        total = sum(e.time_range.elapsed_us() for e in prof.events()
                    if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA)
        return total / n if total else None
    except Exception as exc:  # the profiler is optional evidence
        return f"unavailable: {exc!r}"[:200]


def inputs(shape, seed=0):
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=gen, device=DEVICE, dtype=dtype) for _ in range(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn(*shape, generator=gen, device=DEVICE, dtype=dtype)
    return (q, k, v), leaves, dout


def end_to_end(shape, dropin_only: bool) -> dict:
    (q, k, v), leaves, dout = inputs(shape, seed=sum(shape))
    row: dict = {"shape": list(shape)}
    n = 200 if DEVICE == "cuda" else 50

    def fwd(f):
        def run():
            with torch.no_grad():
                return f(q, k, v, is_causal=True)
        return run

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(*leaves, is_causal=True), leaves, dout)

    info = jaxattn.bridge.cache_info
    t0 = time.perf_counter()
    fwd(jax_sdpa)()
    sync()
    row["dropin_first_fwd_s"] = time.perf_counter() - t0
    row["compile_time_fwd_s"] = getattr(info(), "last_compile_time_s", None)
    t0 = time.perf_counter()
    fwd_bwd(jax_sdpa)()
    sync()
    row["dropin_first_fwdbwd_s"] = time.perf_counter() - t0
    row["compile_time_total_s"] = getattr(info(), "compile_time_s", None)
    misses = info().misses
    row["dropin_fwd_us"] = per_call_us(fwd(jax_sdpa), n=n)
    row["dropin_fwdbwd_us"] = per_call_us(fwd_bwd(jax_sdpa), n=n // 2)
    row["misses_during_timing"] = info().misses - misses
    if dropin_only:
        return row
    row["torch_default_fwd_us"] = per_call_us(fwd(F.scaled_dot_product_attention), n=n)
    row["torch_default_fwdbwd_us"] = per_call_us(fwd_bwd(F.scaled_dot_product_attention), n=n // 2)
    backends = (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION)) if DEVICE == "cuda" else ()
    for name, backend in backends:
        with sdpa_kernel(backend):
            try:
                row[f"torch_{name}_fwd_us"] = per_call_us(fwd(F.scaled_dot_product_attention), n=n)
                row[f"torch_{name}_fwdbwd_us"] = per_call_us(fwd_bwd(F.scaled_dot_product_attention), n=n // 2)
            except RuntimeError as exc:
                row[f"torch_{name}_error"] = str(exc)[:200]
    for part in ("fwd", "fwdbwd"):
        times = {k: v for k, v in row.items() if k.startswith("torch_") and k.endswith(f"_{part}_us")}
        best = min(times, key=times.get)
        row[f"torch_best_{part}"] = best
        row[f"ratio_{part}_vs_torch_default"] = row[f"dropin_{part}_us"] / row[f"torch_default_{part}_us"]
        row[f"ratio_{part}_vs_torch_best"] = row[f"dropin_{part}_us"] / times[best]
    row["kernel_dropin_fwd_us"] = kernel_us(fwd(jax_sdpa))
    row["kernel_torch_default_fwd_us"] = kernel_us(fwd(F.scaled_dot_product_attention))
    row["kernel_dropin_fwdbwd_us"] = kernel_us(fwd_bwd(jax_sdpa))
    row["kernel_torch_default_fwdbwd_us"] = kernel_us(fwd_bwd(F.scaled_dot_product_attention))
    return row


def breakdown(shape) -> dict:
    """Host µs per piece of one inference forward of the drop-in, and the public pieces used before."""
    import jax.dlpack

    from jaxattn.bridge import call_plan, dlpack
    from jaxattn.torch_api import sdpa as sdpa_module
    from jaxattn.torch_api.bucketing import current_sequence_buckets
    from jaxattn.torch_api.selection import current_implementation

    (q, k, v), _, _ = inputs(shape, seed=7)
    cuda = DEVICE == "cuda"
    with torch.no_grad():
        jax_sdpa(q, k, v, is_causal=True)
        ak, sk = call_plan.arg_key, call_plan.static_key
        plan = next(p for s, p in sdpa_module._plans.items() if s[0] == ak(q) and s[-1] is False)

        def signature():
            sig = (ak(q), ak(k), ak(v), ak(None), sk(0.0), sk(True), sk(None), sk(False), sk(None),
                   current_implementation(), current_sequence_buckets(), torch.is_grad_enabled())
            return sdpa_module._plans.get(sig)

        cp = plan.call
        trace = cp.trace()
        dev, jdev = cp.device, cp.jax_device
        jstream, tstream = dlpack.cuda_handshake(dev, jdev) if cuda else (None, None)
        arrays = dlpack.import_tensors([q, k, v], jdev, jstream)
        out = trace.call(*arrays)
        jax.block_until_ready(out)
        row = {"shape": list(shape), "implementation": str(plan.static.get("implementation")),
               "fast_dlpack": dlpack.FAST_DLPACK}
        row["full_call_us"] = per_call_us(lambda: jax_sdpa(q, k, v, is_causal=True))
        row["full_call_host_us"] = host_us(lambda: jax_sdpa(q, k, v, is_causal=True))
        row["signature_memo_us"] = host_us(signature)
        row["operands_us"] = host_us(lambda: plan._operands(q, k, v, None))
        row["eager_check_us"] = host_us(call_plan._eager_possible)
        if cuda:
            row["handshake_us"] = host_us(lambda: dlpack.cuda_handshake(dev, jdev))
        row["importable_x3_us"] = host_us(lambda: [dlpack.importable(t) for t in (q, k, v)])
        row["import_x3_us"] = host_us(lambda: dlpack.import_tensors([q, k, v], jdev, jstream))
        row["trace_lookup_us"] = host_us(cp.trace)
        row["dispatch_host_us"] = host_us(lambda: trace.call(*arrays), n=50)
        row["dispatch_and_kernel_us"] = per_call_us(lambda: jax.block_until_ready(trace.call(*arrays)))
        row["kernel_us"] = kernel_us(lambda: trace.call(*arrays))
        row["export_us"] = host_us(lambda: dlpack.export_arrays(out, tstream))
        row["plan_run_us"] = host_us(lambda: cp.run([q, k, v], keep=False))
        # The public pieces the bridge used before.
        row["old_from_dlpack_first_us"] = host_us(lambda: jax.dlpack.from_dlpack(q))
        if cuda:
            ordered = dlpack._Ordered
            row["old_from_dlpack_ordered_us"] = host_us(lambda: jax.dlpack.from_dlpack(ordered(k)))
            row["old_torch_handshake_us"] = host_us(lambda: q.__dlpack__(stream=jstream)) - host_us(
                lambda: q.__dlpack__(stream=-1))
        row["old_torch_from_dlpack_us"] = host_us(lambda: torch.from_dlpack(out[0]))
        row["custom_op_call_us"] = host_us(lambda: torch.ops.jaxattn.jax_call([q, k, v], cp.op_name, cp.spec))
        row["custom_op_dispatch_us"] = row["custom_op_call_us"] - row["plan_run_us"]
    return row


def main():
    global DEVICE
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--dropin-only", action="store_true")
    parser.add_argument("--shape", default=None, help="B,H,L,E of the small call (default 1,4,128,64)")
    args = parser.parse_args()
    DEVICE = args.device
    small = SMALL if args.shape is None else tuple(int(n) for n in args.shape.split(","))
    if DEVICE == "cpu":
        torch.set_num_threads(1)  # torch's CPU SDPA and JAX's CPU client would contend for cores
    result = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
                     "cudnn_torch": torch.backends.cudnn.version() if DEVICE == "cuda" else None},
        "end_to_end": [end_to_end(s, args.dropin_only) for s in ((small, TRAIN) if DEVICE == "cuda" else (small,))],
    }
    if not args.dropin_only:
        result["breakdown"] = breakdown(small)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
