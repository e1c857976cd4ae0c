"""jaxattn.bridge: torch <-> JAX, with no knowledge of what the functions compute.

* `to_jax` / `to_torch`: zero-copy DLPack conversion with CUDA stream ordering.
* `JaxOp` / `jax_op`: a JAX function as a differentiable torch op that torch.compile traces.
* `to_jax_device` / `to_torch_device`, `to_jax_dtype` / `to_torch_dtype`: mappings.
* `cache_info`, `clear_cache`, `set_cache_size`: the compiled-executable cache (hits, misses, size,
  compile time); `enable_persistent_cache`: JAX's on-disk cache across restarts.
* `initialize_from_torchrun`, `global_from_shards`, `torch_shards`: several devices and processes
  (`distributed.py`).
* `ShardedJaxOp`: a JAX function over a 1-D device mesh as a differentiable torch op on whole or
  sharded tensors; `resolve_mesh`: the mesh of such a call from what a torch caller names.

Importing jaxattn turns off JAX's 75% GPU preallocation unless XLA_PYTHON_CLIENT_* is set
(see `jaxattn.gpu_memory`); `configure_gpu_memory` is re-exported here.
"""

from ..gpu_memory import configure_gpu_memory
from .cache import enable_persistent_cache
from .devices import to_jax_device, to_torch_device
from .dlpack import importable, narrow_broadcast, to_jax, to_torch
from .distributed import global_from_shards, initialize_from_torchrun, torch_shards, torchrun_settings
from .dtypes import to_jax_dtype, to_torch_dtype
from .meshes import resolve_mesh
from .sharded_op import ShardedJaxOp
from .torch_op import JaxOp, cache_info, clear_cache, jax_op, set_cache_size
from . import exit_drain  # noqa: F401  (waits at exit for XLA:CPU work: see the module)

__all__ = [
    "JaxOp", "cache_info", "clear_cache", "enable_persistent_cache", "importable", "narrow_broadcast", "configure_gpu_memory", "jax_op", "set_cache_size",
    "to_jax", "to_jax_device", "to_jax_dtype", "to_torch", "to_torch_device", "to_torch_dtype",
    "global_from_shards", "initialize_from_torchrun", "torch_shards", "torchrun_settings",
    "ShardedJaxOp", "resolve_mesh",
]
