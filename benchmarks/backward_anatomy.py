"""Where a small forward+backward call's host time goes, by taking the call apart.

    python benchmarks/backward_anatomy.py [--out anatomy.json] [--impl flash] [--shape 1,4,128,64]

bf16 causal on CUDA (float32 on CPU). Host µs per iteration of back-to-back iterations (median of 7
repeats, synchronised between repeats), each a different way of doing the same forward+backward:

  torch_sdpa        torch's own SDPA under `torch.autograd.grad` (the reference)
  engine_floor      `torch.autograd.grad` of a one-op torch graph (x * 2): torch's autograd floor
  function_floor    the same through a Python `torch.autograd.Function` (x * 2 both ways)
  dropin            the drop-in under `torch.autograd.grad` (what users run)
  dropin_1thread    the same with torch's autograd worker threads off (backward on this thread)
  dropin_hooks      the same under identity saved-tensor hooks (residuals go through torch)
  dropin_node_direct  the drop-in's forward, then its autograd node called directly (no engine)
  dropin_forward_with_grad  the drop-in's forward alone, inputs requiring grad (vjp forward)
  bridge_manual     the drop-in's own pieces without autograd: handshake, import q/k/v, vjp
                    forward, export out, handshake, import dout, backward executable, export grads
  bridge_manual_forward  its forward half alone
  bridge_manual_handoff  the same with the backward half on a worker thread, the caller waiting
                    for it (how torch's autograd runs CUDA backwards)
  jax_pair          the vjp forward and backward executables alone on JAX arrays, no bridge
  jax_pair_ready    the same, waiting for the gradients each iteration

`--profile` adds cProfile's top functions (by own time) for dropin_1thread and bridge_manual;
`--gc` only times four ways with Python's garbage collector on, frozen and off;
`--api` only counts CUDA runtime/driver calls per iteration (torch's profiler, every thread);
`--loop NAME [--iters N]` only runs one way N times, for an outside profiler (nsys, perf).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import queue
import sys
import threading
import time


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dispatch_probe import host_us  # noqa: E402  (host µs per call, median of repeats)


def profile(fn, n=300, top=30) -> str:
    for _ in range(20):
        fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--impl", default="flash")
    parser.add_argument("--shape", default="1,4,128,64")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--loop", default=None, help="only run this way --iters times (for nsys/perf)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--gc", action="store_true",
                        help="only four ways with Python's garbage collector on, frozen (gc.freeze) and off")
    parser.add_argument("--api", action="store_true",
                        help="only CUDA runtime/driver calls per iteration for four ways (torch's profiler)")
    args = parser.parse_args()

    import jaxattn.bridge  # noqa: F401  (memory policy first)
    import jax
    import torch
    import torch.nn.functional as F

    from jaxattn.bridge import dlpack
    from jaxattn.bridge.traces import backward_call
    from jaxattn.torch_api import scaled_dot_product_attention, sdpa_implementation
    from jaxattn.torch_api import sdpa as sdpa_module

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = tuple(int(n) for n in args.shape.split(","))
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(*shape, generator=gen, device=device, dtype=dtype)
    leaves = [q, k, v]
    impl = args.impl
    rows: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "impl": impl, "shape": shape}

    def torch_step():
        return torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), leaves, dout)

    x = torch.randn(*shape, generator=gen, device=device, dtype=dtype, requires_grad=True)

    def engine_step():
        return torch.autograd.grad(x * 2, [x], dout)

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    def function_step():
        return torch.autograd.grad(Twice.apply(x), [x], dout)

    def dropin_step():
        with sdpa_implementation(impl):
            return torch.autograd.grad(scaled_dot_product_attention(q, k, v, is_causal=True), leaves, dout)

    def single_thread_step():
        torch.autograd.set_multithreading_enabled(False)
        try:
            return dropin_step()
        finally:
            torch.autograd.set_multithreading_enabled(True)

    def hooks_step():
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return dropin_step()

    def node_step():
        with sdpa_implementation(impl):
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.grad_fn.apply(dout)  # the Function's backward, called directly: no engine

    def forward_only_step():
        with sdpa_implementation(impl):
            return scaled_dot_product_attention(q, k, v, is_causal=True)

    dropin_step()  # compiles, and leaves the call plan the manual steps below take apart
    plan = next(p for s, p in sdpa_module._plans.items()
                if p.static.get("implementation") in (impl, (impl,)) and s[-1] is True).call
    trace = plan.trace()
    n_in = len(plan.floating)
    jdev = plan.jax_device
    needed = tuple(range(n_in))
    grad_spec = ((0,), needed)
    sig = plan.shapes_dtypes + trace.out_sig + (trace.out_sig[0],)
    bwd = backward_call(plan.op_name, plan.spec, grad_spec, trace, n_in, sig, jdev)
    tensors = [dlpack.importable(t) for t in (q, k, v)]

    def handshake():
        return dlpack.cuda_handshake(plan.device, jdev) if cuda else (None, None)

    def manual_step():
        js, ts = handshake()
        arrays = dlpack.import_tensors(tensors, jdev, js)
        results = trace.call(*arrays)
        out = dlpack.export_arrays(results[:1], ts)
        js, ts = handshake()
        cot = dlpack.import_tensors([dout], jdev, js)
        grads = dlpack.export_arrays(bwd(*arrays, *results, *cot), ts)
        return out, grads

    arrays = dlpack.import_tensors(tensors, jdev, handshake()[0])
    cot = dlpack.import_tensors([dout], jdev, handshake()[0])
    jax.block_until_ready(arrays + cot)

    def jax_pair():
        results = trace.call(*arrays)
        return bwd(*arrays, *results, *cot)

    def manual_forward():
        js, ts = handshake()
        arrays = dlpack.import_tensors(tensors, jdev, js)
        results = trace.call(*arrays)
        return arrays, results, dlpack.export_arrays(results[:1], ts)

    def manual_backward(arrays, results):
        js, ts = handshake()
        cot = dlpack.import_tensors([dout], jdev, js)
        return dlpack.export_arrays(bwd(*arrays, *results, *cot), ts)

    # The backward on a worker thread, the caller waiting for it (as torch's CUDA autograd does).
    requests, replies = queue.SimpleQueue(), queue.SimpleQueue()

    def worker():
        while (job := requests.get()) is not None:
            replies.put(manual_backward(*job))

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()

    def handoff_step():
        arrays, results, out = manual_forward()
        requests.put((arrays, results))
        return out, replies.get()

    if args.gc:  # the same ways with Python's cyclic garbage collector frozen, then off
        import gc

        ways = {"dropin": dropin_step, "dropin_1thread": single_thread_step, "bridge_manual": manual_step,
                "torch_sdpa": torch_step}
        for name, step in ways.items():
            rows[f"{name}_gc_on"] = host_us(step, sync=sync)
            gc.collect()
            gc.freeze()  # everything alive now is left out of later collections
            rows[f"{name}_gc_frozen"] = host_us(step, sync=sync)
            gc.unfreeze()
            gc.disable()
            rows[f"{name}_gc_off"] = host_us(step, sync=sync)
            gc.enable()
            print(name, {k: round(v, 1) for k, v in rows.items() if k.startswith(name + "_gc")}, flush=True)
        print("gc thresholds", gc.get_threshold(), "tracked objects", len(gc.get_objects()), flush=True)
        requests.put(None)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.api:  # CUDA runtime/driver calls per iteration (any thread), from torch's profiler
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        ways = {"bridge_manual": manual_step, "dropin_1thread": single_thread_step, "dropin": dropin_step,
                "torch_sdpa": torch_step}
        for name, step in ways.items():
            for _ in range(50):
                step()
            sync()
            n = 200
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    step()
                sync()
            calls: dict = {}
            for e in prof.events():
                if getattr(e, "device_type", None) == torch.autograd.DeviceType.CPU and e.name.startswith("cu"):
                    c = calls.setdefault(e.name, [0, 0.0, set()])
                    c[0] += 1
                    c[1] += e.time_range.elapsed_us()
                    c[2].add(e.thread)
            rows[f"api_{name}"] = {k: {"calls": round(v[0] / n, 2), "us": round(v[1] / n, 1), "threads": len(v[2])}
                                   for k, v in sorted(calls.items(), key=lambda kv: -kv[1][1])}
            print(name, json.dumps(rows[f"api_{name}"]), flush=True)
        requests.put(None)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        return
    if args.loop:  # one way only, for an outside profiler (nsys, perf)
        step = {"torch_sdpa": torch_step, "dropin": dropin_step, "dropin_1thread": single_thread_step,
                "bridge_manual": manual_step, "bridge_manual_handoff": handoff_step, "jax_pair": jax_pair}[args.loop]
        for _ in range(50):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step()
        sync()
        print(f"{args.loop}: {(time.perf_counter() - t0) / args.iters * 1e6:.1f} us per iteration", flush=True)
        requests.put(None)
        return
    rows["torch_sdpa"] = host_us(torch_step, sync=sync)
    rows["engine_floor"] = host_us(engine_step, sync=sync)
    rows["function_floor"] = host_us(function_step, sync=sync)
    rows["dropin"] = host_us(dropin_step, sync=sync)
    rows["dropin_1thread"] = host_us(single_thread_step, sync=sync)
    rows["dropin_hooks"] = host_us(hooks_step, sync=sync)
    rows["dropin_node_direct"] = host_us(node_step, sync=sync)
    rows["dropin_forward_with_grad"] = host_us(forward_only_step, sync=sync)
    rows["bridge_manual"] = host_us(manual_step, sync=sync)
    rows["bridge_manual_forward"] = host_us(manual_forward, sync=sync)
    rows["bridge_manual_handoff"] = host_us(handoff_step, sync=sync)
    requests.put(None)
    thread.join()
    rows["jax_pair"] = host_us(jax_pair, sync=sync)
    rows["jax_pair_ready"] = host_us(lambda: jax.block_until_ready(jax_pair()), sync=sync)
    rows["vjp_forward_alone"] = host_us(lambda: trace.call(*arrays), sync=sync)
    results = trace.call(*arrays)
    rows["backward_alone"] = host_us(lambda: bwd(*arrays, *results, *cot), sync=sync)
    for name in ("torch_sdpa", "engine_floor", "function_floor", "dropin", "dropin_1thread", "dropin_hooks", "bridge_manual",
                 "dropin_node_direct", "dropin_forward_with_grad", "bridge_manual_forward", "bridge_manual_handoff",
                 "jax_pair", "jax_pair_ready", "vjp_forward_alone", "backward_alone"):
        print(f"{name:20s} {rows[name]:9.1f} us", flush=True)
    if args.profile:
        rows["profile_dropin_1thread"] = profile(single_thread_step)
        rows["profile_bridge_manual"] = profile(manual_step)
        print(rows["profile_dropin_1thread"])
        print(rows["profile_bridge_manual"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
