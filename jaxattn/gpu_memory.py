"""GPU memory policy for a process where torch and JAX share a GPU.

JAX preallocates 75% of GPU memory on first use, leaving torch little room. Importing `jaxattn`
(any of its subpackages) sets XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX then allocates on demand) unless the
user has set any XLA_PYTHON_CLIENT_* variable. It must happen before JAX initialises its GPU
backend: import jaxattn before running any JAX computation, or set the variables yourself.
"""

from __future__ import annotations

import os
import warnings

_USER_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def configure_gpu_memory() -> bool:
    """Turns off JAX's GPU preallocation unless the user chose a policy; returns True if it did."""
    if any(name in os.environ for name in _USER_VARS):
        return False
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if _jax_backends_initialised():
        warnings.warn(
            "jaxattn: JAX's backends were initialised before jaxattn was imported, so "
            "XLA_PYTHON_CLIENT_PREALLOCATE=false came too late; JAX may hold 75% of GPU memory. "
            "Import jaxattn first or set XLA_PYTHON_CLIENT_PREALLOCATE yourself.",
            stacklevel=3,
        )
    return True


def _jax_backends_initialised() -> bool:
    import sys

    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(getattr(bridge, "_backends", None))
