"""jaxattn: JAX attention kernels for PyTorch users.

Subpackages:
    jaxattn.jax_core   pure-JAX attention implementations, registry and dispatch
    jaxattn.bridge     torch <-> JAX: zero-copy DLPack, streams, devices, differentiable torch ops
    jaxattn.torch_api  torch-facing API (drop-in scaled_dot_product_attention)
"""

from ._version import __version__

__all__ = ["__version__"]
