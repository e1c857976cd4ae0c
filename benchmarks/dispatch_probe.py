"""Where a small call's JAX dispatch time goes: per implementation, per XLA setting, per import kind.

    python benchmarks/dispatch_probe.py --out probe.json [--shape 1,4,128,64]

For the drop-in's compiled forward (bf16, causal on CUDA; float32 on CPU) of each implementation
(vanilla, sdpa, flash where available) this measures, in a child process per XLA_FLAGS variant:
  * host µs to dispatch the executable (no wait) and µs until its result is ready;
  * the same executable on JAX-allocated inputs instead of DLPack-imported ones;
  * the executable's kernels: the ENTRY instructions of its optimised HLO by opcode;
  * a trivial executable (x + 1) on an array of the same shape: JAX's floor per dispatch;
  * the import of one tensor with and without a stream (the latter only timed, never used);
  * forward+backward: the whole `autograd.grad` call (also with torch's autograd worker threads
    off), host µs per bridge piece inside it, the vjp forward's and the backward executable's
    dispatch and time to ready, and the backward executable's kernels.
Variants: XLA's defaults, and command buffers (CUDA graphs) off. The parent prints one JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

VARIANTS = {"default": "", "no_command_buffer": "--xla_gpu_enable_command_buffer="}


def host_us(fn, n=200, repeats=7, warmup=20, sync=None) -> float:
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        if sync:
            sync()
    return statistics.median(times)


def _ready_us(fn, n=200, repeats=7, warmup=20) -> float:
    import jax

    return host_us(lambda: jax.block_until_ready(fn()), n, repeats, warmup)


def _entry_ops(hlo: str) -> dict:
    """Opcode counts of the ENTRY computation of an optimised HLO module."""
    entry = hlo[hlo.index("ENTRY"):]
    body = entry[entry.index("{") + 1: entry.index("\n}")]
    ops = collections.Counter()
    for line in body.splitlines():
        m = re.search(r"=\s*\S+\s+([a-z\-]+)\(", line)
        if m:
            op = m.group(1)
            if op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                op = f"custom-call:{target.group(1) if target else '?'}"
            ops[op] += 1
    return dict(ops)


def child(shape, device: str) -> dict:
    import jaxattn.bridge  # noqa: F401  (memory policy first)
    import jax
    import jax.numpy as jnp
    import torch

    from jaxattn.bridge import dlpack
    from jaxattn.torch_api import scaled_dot_product_attention, sdpa_implementation
    from jaxattn.torch_api import sdpa as sdpa_module

    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else None
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen, device=device, dtype=dtype) for _ in range(3))
    row: dict = {"xla_flags": os.environ.get("XLA_FLAGS", ""), "impls": {}}
    jdev = dlpack.to_jax_device(q.device)
    jstream = dlpack.cuda_handshake(q.device, jdev)[0] if cuda else None

    native = jax.device_put(jnp.ones(shape, jnp.bfloat16 if cuda else jnp.float32), jdev)
    add = jax.jit(lambda x: x + 1).trace(native).lower().compile()
    row["trivial_dispatch_host_us"] = host_us(lambda: add(native), sync=sync)
    row["trivial_ready_us"] = _ready_us(lambda: add(native))
    row["import_one_with_stream_us"] = host_us(lambda: dlpack.import_tensors([q], jdev, jstream), sync=sync)
    if cuda:
        row["import_one_no_stream_us"] = host_us(lambda: dlpack.import_tensors([q], jdev, None), sync=sync)
        row["external_stream_query_us"] = host_us(jdev.get_stream_for_external_ready_events)
    row["handshake_us"] = host_us(lambda: dlpack.cuda_handshake(q.device, jdev), sync=sync) if cuda else None

    for impl in ("vanilla", "sdpa", "flash"):
        try:
            with torch.no_grad(), sdpa_implementation(impl):
                scaled_dot_product_attention(q, k, v, is_causal=True)
                plan = next(p for s, p in sdpa_module._plans.items()
                            if p.static.get("implementation") in (impl, (impl,)) and s[-1] is False)
        except Exception as exc:  # an implementation this machine cannot run
            row["impls"][impl] = {"error": repr(exc)[:300]}
            continue
        cp = plan.call
        trace = cp.trace()
        arrays = dlpack.import_tensors([q, k, v], jdev, jstream)
        natives = [jax.device_put(jnp.asarray(a), jdev) for a in arrays]
        jax.block_until_ready(natives)
        info = {
            "dispatch_host_us": host_us(lambda: trace.call(*arrays), n=100, sync=sync),
            "ready_us": _ready_us(lambda: trace.call(*arrays)),
            "native_dispatch_host_us": host_us(lambda: trace.call(*natives), n=100, sync=sync),
            "native_ready_us": _ready_us(lambda: trace.call(*natives)),
        }
        with torch.no_grad(), sdpa_implementation(impl):
            info["dropin_call_us"] = host_us(lambda: scaled_dot_product_attention(q, k, v, is_causal=True),
                                              sync=sync)
        try:
            info["entry_ops"] = _entry_ops(trace.call.as_text())
        except Exception as exc:  # as_text is informative only
            info["entry_ops"] = repr(exc)[:200]
        info.update(_training_breakdown(impl, q, k, v, jdev, jstream, sync))
        row["impls"][impl] = info
    return row


def _training_breakdown(impl, q, k, v, jdev, jstream, sync) -> dict:
    """forward+backward: the whole `autograd.grad` call, the vjp forward's and the backward
    executable's dispatch and time to ready, and the backward executable's kernels."""
    import jax
    import torch

    from jaxattn.bridge import dlpack
    from jaxattn.bridge.traces import CACHE
    from jaxattn.torch_api import scaled_dot_product_attention, sdpa_implementation
    from jaxattn.torch_api import sdpa as sdpa_module

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    dout = torch.randn_like(q)

    def step():
        with sdpa_implementation(impl):
            return torch.autograd.grad(scaled_dot_product_attention(*leaves, is_causal=True), leaves, dout)

    out: dict = {"fwdbwd_call_us": host_us(step, n=100, sync=sync)}
    # torch runs CUDA backwards on a per-device worker thread; in the calling thread instead:
    torch.autograd.set_multithreading_enabled(False)
    try:
        out["fwdbwd_call_single_thread_us"] = host_us(step, n=100, sync=sync)
    finally:
        torch.autograd.set_multithreading_enabled(True)
    out["fwdbwd_pieces_us"] = _pieces(step, sync)
    plan = next(p for s, p in sdpa_module._plans.items()
                if p.static.get("implementation") in (impl, (impl,)) and s[-1] is True)
    cp = plan.call
    trace = cp.trace()
    arrays = dlpack.import_tensors([dlpack.importable(t) for t in leaves], jdev, jstream)
    out["vjp_forward_dispatch_host_us"] = host_us(lambda: trace.call(*arrays), n=100, sync=sync)
    out["vjp_forward_ready_us"] = _ready_us(lambda: trace.call(*arrays))
    results = trace.call(*arrays)
    backward = [v_ for k_, v_ in CACHE._data.items() if k_[0] == "bwd" and k_[2] == cp.spec]
    if backward:
        bwd = backward[-1]
        cot = dlpack.import_tensors([dout], jdev, jstream)
        operands = [*arrays, *results, *cot]  # inputs, outputs + residuals, the output's cotangent
        try:
            out["backward_dispatch_host_us"] = host_us(lambda: bwd(*operands), n=100, sync=sync)
            out["backward_ready_us"] = _ready_us(lambda: bwd(*operands))
            out["backward_entry_ops"] = _entry_ops(bwd.as_text())
        except Exception as exc:  # informative only
            out["backward_error"] = repr(exc)[:300]
    out["forward_vjp_entry_ops"] = _entry_ops(trace.call.as_text())
    jax.block_until_ready(results)
    return out


def _pieces(step, sync, n=300) -> dict:
    """Host µs per forward+backward spent in each bridge piece (wrapped timers, any thread)."""
    import threading

    from jaxattn.bridge import call_plan

    totals: dict = collections.defaultdict(float)
    lock = threading.Lock()

    def timed(name, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with lock:
                    totals[name] += time.perf_counter() - t0
        return wrapper

    def timed_backward_call(*a, **kw):
        return timed("backward executable", call_plan_backward_call(*a, **kw))

    saved = {name: getattr(call_plan, name) for name in ("cuda_handshake", "import_tensors", "export_arrays")}
    call_plan_backward_call = call_plan.backward_call
    fwd, bwd = call_plan._EagerCall.forward, call_plan._EagerCall.backward
    trace_fn = call_plan.CallPlan.trace
    try:
        for name, fn in saved.items():
            setattr(call_plan, name, timed(name, fn))
        call_plan.backward_call = timed("backward_call lookup", timed_backward_call)
        call_plan._EagerCall.forward = staticmethod(timed("_EagerCall.forward", fwd))
        call_plan._EagerCall.backward = staticmethod(timed("_EagerCall.backward", bwd))
        original_trace = trace_fn

        def trace_timed(self):
            tr = original_trace(self)
            return _TimedTrace(tr, timed)
        call_plan.CallPlan.trace = trace_timed
        for _ in range(20):
            step()
        if sync:
            sync()
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        if sync:
            sync()
        totals["whole step"] = time.perf_counter() - t0
    finally:
        for name, fn in saved.items():
            setattr(call_plan, name, fn)
        call_plan.backward_call = call_plan_backward_call
        call_plan._EagerCall.forward, call_plan._EagerCall.backward = staticmethod(fwd), staticmethod(bwd)
        call_plan.CallPlan.trace = trace_fn
    return {k: round(v / n * 1e6, 1) for k, v in totals.items()}


class _TimedTrace:
    """A forward trace whose executable call is timed (other attributes pass through)."""

    def __init__(self, trace, timed):
        self._trace = trace
        self.call = timed("forward executable", trace.call)

    def __getattr__(self, name):
        return getattr(self._trace, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", default="1,4,128,64")
    parser.add_argument("--device", default=None, choices=["cuda", "cpu"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(n) for n in args.shape.split(","))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        print("RESULT " + json.dumps(child(shape, args.device)))
        return
    result = {"shape": shape, "device": args.device, "variants": {}}
    for name, flags in VARIANTS.items():
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
        proc = subprocess.run([sys.executable, __file__, "--child", "--shape", args.shape, "--device", args.device],
                              capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        result["variants"][name] = (json.loads(line[7:]) if line else
                                    {"returncode": proc.returncode, "error": (proc.stdout + proc.stderr)[-2000:]})
        print(name, json.dumps(result["variants"][name])[:1500], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
