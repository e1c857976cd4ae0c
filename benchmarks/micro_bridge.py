"""Micro-timings of the pieces of a bridge call (host time, µs per call)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxattn.bridge  # noqa: F401,E402
import jax  # noqa: E402
import torch  # noqa: E402
from foundation_gpu import time_host_loop  # noqa: E402
from torch._library import utils as lib_utils  # noqa: E402


def per_call(fn):
    return time_host_loop(fn, n=500)


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
