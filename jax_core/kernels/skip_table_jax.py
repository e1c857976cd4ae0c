"""The flash kernels' block-skip table computed on device by the Triton kernel, launched from JAX.

The plan (grid, warps, kernel arguments) is `skip_table_triton.skip_table_launch`, shared with the
torch launcher; here every scalar goes to jax-triton as a constexpr (`skip_table_entry_static`).
jax-triton is imported when the kernel is launched, so this module imports on any machine.

Shape legend: B batch, H heads, L query length, S key length; R / C the table's rows and loop
blocks (see `skip_table_triton`).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .jax_triton_module import jax_triton
from .skip_table_triton import broadcast_strides, skip_table_entry_static, skip_table_launch, skip_table_shape


def _checked(x: Optional[jax.Array], l: int, s: int, name: str) -> Optional[jax.Array]:
    if x is not None and (x.ndim != 4 or x.shape[2] not in (1, l) or x.shape[3] not in (1, s)):
        raise ValueError(f"{name} must be (B|1, H|1, {l}|1, {s}|1), got shape {x.shape}")
    return x


def skip_table_jax(bias: Optional[jax.Array], mask: Optional[jax.Array], block_m: int, block_n: int,
                   l: int, s: int, along: str) -> jax.Array:
    """The flash kernels' int32 skip table at (block_m, block_n) tiles.

    Args:
        bias: None or float (B|1, H|1, L|1, S|1); -inf masks an element (NaN does not).
        mask: None or int8 (B|1, H|1, L|1, S|1), nonzero = attend.
        block_m, block_n: the flash kernel's query / key tiles (powers of 2).
        l, s: query and key lengths.
        along: "k" for kernels that loop over key blocks per query block (forward, dQ), "q" for the
            dK/dV kernel (loops over query blocks per key block).

    Returns:
        (B|1, H|1, R, 2 * C + 1) int32: per row, C + 1 prefix counts of live blocks, then the live
        blocks in ascending order followed by the dead ones in ascending order.
    """
    jt = jax_triton()

    mask, bias = _checked(mask, l, s, "mask"), _checked(bias, l, s, "bias")
    given = [x for x in (mask, bias) if x is not None]
    if not given:
        raise ValueError("skip_table_jax needs a mask or a bias")
    b = max(x.shape[0] for x in given)
    h = max(x.shape[1] for x in given)
    if any(x.shape[0] not in (1, b) or x.shape[1] not in (1, h) for x in given):
        raise ValueError(f"mask and bias do not broadcast: {[x.shape for x in given]}")
    # Arrays are row-major: their strides follow from their shapes.
    grid, num_warps, args = skip_table_launch(
        b, h, l, s, block_m, block_n, along,
        mask_strides=None if mask is None else broadcast_strides(mask.shape),
        bias_strides=None if bias is None else broadcast_strides(bias.shape),
    )
    return jt.triton_call(
        jnp.zeros((1,), jnp.int8) if mask is None else mask.astype(jnp.int8),
        jnp.zeros((1,), jnp.float32) if bias is None else bias,
        kernel=skip_table_entry_static,
        out_shape=jax.ShapeDtypeStruct(skip_table_shape(b, h, l, s, block_m, block_n, along), jnp.int32),
        grid=grid, num_warps=num_warps, **args,
    )
