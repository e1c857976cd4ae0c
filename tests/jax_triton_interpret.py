"""A CPU stand-in for `jax_triton.triton_call` that runs the kernel under Triton's interpreter.

It lets the CPU suite exercise the whole GPU code path of the `flash` implementation (the JAX
wrapper, its custom VJP, the entry kernels and the kernels) on CPU arrays: each call becomes a
`jax.pure_callback` that copies the inputs to torch CPU tensors, launches `kernel[grid]` with the
meta-parameters as keywords (jax-triton's convention: inputs, then outputs, then constexprs) and
returns the outputs. Outputs start filled with NaN (ints with -1) so that an element the kernels
fail to write is caught, as uninitialised GPU memory would be.
"""

from __future__ import annotations

import importlib.machinery
import types

import jax
import numpy as np
import torch

_TORCH = {np.dtype("float32"): torch.float32, np.dtype("float16"): torch.float16, np.dtype("int8"): torch.int8,
          np.dtype("int32"): torch.int32, np.dtype("float64"): torch.float64}


def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=2, **meta):
    """Same signature as `jax_triton.triton_call` (the parts the flash wrapper uses)."""
    del num_warps, num_stages  # meaningless under the interpreter
    single = not isinstance(out_shape, (tuple, list))
    outs = (out_shape,) if single else tuple(out_shape)
    grid = grid if isinstance(grid, tuple) else (grid,)

    def host(*arrays):
        inputs = [torch.from_numpy(np.array(a, copy=True)) for a in arrays]
        results = []
        for o in outs:
            dtype = _TORCH[np.dtype(o.dtype)]
            fill = float("nan") if dtype.is_floating_point else -1
            results.append(torch.full(o.shape, fill, dtype=dtype))
        kernel[grid](*inputs, *results, **meta)
        return tuple(r.numpy() for r in results)

    result = jax.pure_callback(host, tuple(jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs), *args)
    return result[0] if single else result


def module() -> types.ModuleType:
    """A `jax_triton` module object holding the stand-in (install it in sys.modules)."""
    mod = types.ModuleType("jax_triton")
    mod.__spec__ = importlib.machinery.ModuleSpec("jax_triton", None)
    mod.triton_call = triton_call
    return mod
