"""Micro-timings of the pieces of a bridge call on CUDA (host time, µs per call).

    python benchmarks/micro_bridge.py

Public DLPack functions (what the bridge used before) next to the bridge's own pieces: one
stream handshake per call, jaxlib-level import and export, the compiled executable's dispatch.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxattn.bridge  # noqa: F401,E402
import jax  # noqa: E402
import jax.dlpack  # noqa: E402
import torch  # noqa: E402
from foundation_gpu import time_host_loop  # noqa: E402

from jaxattn.bridge import dlpack  # noqa: E402


def per_call(fn):
    return time_host_loop(fn, n=500)


def main():
    t = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    ts = [t, t.clone(), t.clone()]
    dev, jdev = t.device, jaxattn.bridge.to_jax_device(t.device)
    jstream, tstream = dlpack.cuda_handshake(dev, jdev)
    print("jax.dlpack.from_dlpack x1 (torch handshake)", per_call(lambda: jax.dlpack.from_dlpack(t)))
    print("stream handshake (bridge, once per call)", per_call(lambda: dlpack.cuda_handshake(dev, jdev)))
    print("import_tensors x3", per_call(lambda: dlpack.import_tensors(ts, jdev, jstream)))
    print("to_jax x3 (importable + handshake + import)", per_call(lambda: jaxattn.bridge.to_jax(ts)))
    arrays = dlpack.import_tensors(ts, jdev, jstream)
    f = jax.jit(lambda a, b, c: a * b + c)
    compiled = f.lower(*arrays).compile()
    print("jit call", per_call(lambda: f(*arrays)))
    print("compiled call", per_call(lambda: compiled(*arrays)))
    out = compiled(*arrays)
    print("torch.from_dlpack x1", per_call(lambda: torch.from_dlpack(out)))
    print("export_arrays x1", per_call(lambda: dlpack.export_arrays([out], tstream)))


if __name__ == "__main__":
    main()
