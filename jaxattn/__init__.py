"""jaxattn: JAX attention kernels for PyTorch users.

Subpackages:
    jaxattn.jax_core   pure-JAX attention implementations, registry and dispatch
    jaxattn.bridge     torch <-> JAX: zero-copy DLPack, streams, devices, differentiable torch ops
    jaxattn.torch_api  torch-facing API (drop-in scaled_dot_product_attention)
"""

import os as _os

from ._version import __version__
from .gpu_memory import configure_gpu_memory

configure_gpu_memory()  # before JAX can start its GPU backend: no 75% preallocation next to torch

# In a source checkout (not installed), the subpackages are the sibling folders of this one.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(_os.path.join(_root, "jax_core")):
    if _root not in __path__:
        __path__.append(_root)

__all__ = ["__version__"]
