"""torch <-> JAX dtype mapping."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX: dict[torch.dtype, np.dtype] = {
    torch.float16: jnp.dtype(jnp.float16),
    torch.bfloat16: jnp.dtype(jnp.bfloat16),
    torch.float32: jnp.dtype(jnp.float32),
    torch.float64: jnp.dtype(jnp.float64),
    torch.bool: jnp.dtype(jnp.bool_),
    torch.int8: jnp.dtype(jnp.int8),
    torch.int16: jnp.dtype(jnp.int16),
    torch.int32: jnp.dtype(jnp.int32),
    torch.int64: jnp.dtype(jnp.int64),
    torch.uint8: jnp.dtype(jnp.uint8),
}
JAX_TO_TORCH: dict[np.dtype, torch.dtype] = {v: k for k, v in TORCH_TO_JAX.items()}

#: dtypes that need JAX's x64 mode; the bridge enables it around calls that use them.
X64_DTYPES = frozenset({torch.float64, torch.int64})


def to_jax_dtype(dtype: torch.dtype) -> np.dtype:
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no JAX equivalent; supported: {sorted(map(str, TORCH_TO_JAX))}.") from None


def to_torch_dtype(dtype) -> torch.dtype:
    try:
        return JAX_TO_TORCH[jnp.dtype(dtype)]
    except KeyError:
        raise TypeError(f"JAX dtype {dtype} has no torch equivalent.") from None
