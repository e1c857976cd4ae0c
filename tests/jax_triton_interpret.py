"""A stand-in for `jax_triton.triton_call` that launches the kernel from torch.

It lets the suite exercise the whole JAX code path of the Triton kernels (the JAX wrapper, its custom
VJP, the entry kernels and the kernels) where jax-triton is missing or JAX does not run on the GPU:
each call becomes a `jax.pure_callback` that copies the inputs to torch tensors, launches
`kernel[grid]` with the meta-parameters as keywords (jax-triton's convention: inputs, then outputs,
then constexprs) and returns the outputs. The kernel runs wherever the session's Triton runs it
(conftest.py decides once per session): under the interpreter on CPU tensors, or compiled on CUDA
tensors. Outputs start filled with NaN (ints with -1) so that an element the kernels fail to write is
caught, as uninitialised GPU memory would be.
"""

from __future__ import annotations

import importlib.machinery
import os
import types

import jax
import numpy as np
import torch

_TORCH = {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16, np.dtype("int8"): torch.int8,
          np.dtype("int32"): torch.int32, np.dtype("float64"): torch.float64}


def _launch_device() -> str:
    """Where Triton runs kernels in this session: "cpu" under the interpreter, else "cuda"."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("the jax_triton stand-in cannot launch: TRITON_INTERPRET is unset (Triton compiles "
                           "kernels) but torch sees no CUDA device; set TRITON_INTERPRET=1 before anything "
                           "imports triton to run the kernels on CPU tensors")
    return "cuda"


def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=2, **meta):
    """Same signature as `jax_triton.triton_call` (the parts the flash and decode wrappers use)."""
    single = not isinstance(out_shape, (tuple, list))
    outs = (out_shape,) if single else tuple(out_shape)
    grid = grid if isinstance(grid, tuple) else (grid,)

    def host(*arrays):
        device = _launch_device()
        inputs = [torch.from_numpy(np.array(a, copy=True)).to(device) for a in arrays]
        results = []
        for o in outs:
            dtype = _TORCH[np.dtype(o.dtype)]
            fill = float("nan") if dtype.is_floating_point else -1
            results.append(torch.full(o.shape, fill, dtype=dtype, device=device))
        # warps and stages mean nothing to the interpreter; compiled, they are the launch's own
        launch = {} if device == "cpu" else dict(num_warps=num_warps, num_stages=num_stages)
        kernel[grid](*inputs, *results, **meta, **launch)
        return tuple(r.cpu().numpy() for r in results)

    result = jax.pure_callback(host, tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs), *args)
    return result[0] if single else result


def module() -> types.ModuleType:
    """A `jax_triton` module object holding the stand-in (install it in sys.modules)."""
    mod = types.ModuleType("jax_triton")
    mod.__spec__ = importlib.machinery.ModuleSpec("jax_triton", None)
    mod.triton_call = triton_call
    return mod


def real_jax_triton_runs() -> bool:
    """Whether jax-triton itself launches the kernels in this session: Triton compiles (TRITON_INTERPRET
    unset), torch and JAX both run on the GPU, and jax-triton is installed. Elsewhere the stand-in does."""
    import importlib.util

    return (os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and torch.cuda.is_available()
            and jax.default_backend() == "gpu" and importlib.util.find_spec("jax_triton") is not None)


def install(monkeypatch) -> None:
    """Puts the stand-in in `sys.modules` as `jax_triton` (undone by pytest's `monkeypatch`) unless
    `real_jax_triton_runs()`."""
    import sys

    if not real_jax_triton_runs():
        monkeypatch.setitem(sys.modules, "jax_triton", module())
