"""Micro-timings of the pieces of a bridge call (host time, µs per call)."""

from __future__ import annotations

import time

import jaxattn.bridge  # noqa: F401
import jax
import jax.numpy as jnp
import torch
from torch._library import utils as lib_utils


def per_call(fn, n=500):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    t = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    ts = [t, t.clone(), t.clone()]
    print("jax.dlpack.from_dlpack x1", per_call(lambda: jax.dlpack.from_dlpack(t)))
    print("jaxattn to_jax x3", per_call(lambda: jaxattn.bridge.to_jax(ts)))
    arrays = jaxattn.bridge.to_jax(ts)
    f = jax.jit(lambda a, b, c: a * b + c)
    compiled = f.lower(*arrays).compile()
    print("jit call", per_call(lambda: f(*arrays)))
    print("compiled call", per_call(lambda: compiled(*arrays)))
    out = f(*arrays)
    print("torch.from_dlpack x1", per_call(lambda: torch.from_dlpack(out)))
    outs = [torch.from_dlpack(f(*arrays)) for _ in range(3)]
    print("aliasing check (3 in, 3 out)", per_call(lambda: lib_utils._c_check_aliasing_constraint("x", (ts, "a", "b"), {}, outs)))
    print("stream handshake ptr", per_call(lambda: jax.devices()[0].get_stream_for_external_ready_events()))


if __name__ == "__main__":
    main()
