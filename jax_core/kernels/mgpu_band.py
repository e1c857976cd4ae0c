"""Band masks on wgmma accumulators: one compare of a register against a constant per score.

In the wgmma layout a score at (row, col) of a warpgroup's accumulator sits at (row_t + row_r,
col_t + col_r): row_t and col_t depend on the thread only, row_r and col_r on the register only, and
the two never carry into each other. So col - row = (col_t - row_t) + (col_r - row_r), and once a
block's bound is taken off the thread's part, each score compares one register with a constant.
Built from two iotas instead, the compiler keeps each register's index live through the key loop:
at head dim 64 the backward spilled them (BENCHMARKS.md, "Band masks by constants").

`keep_band` runs the same rule through `jnp.where` off the GPU (the interpreter), so the kernels'
interpreter tests check the bounds they pass; the layout arithmetic is checked on the GPU.
"""

from __future__ import annotations

import itertools
from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu


def keep_band(x, *, fill: float, diff: int, lo=None, hi=None, row_end=None, col_end=None, on_gpu: bool):
    """x (2-D float32, the wgmma layout on the GPU) with `fill` wherever a score is outside the band.

    A score at (row, col) is kept when lo <= d <= hi for d = col - row (`diff` = 1) or row - col
    (`diff` = -1), row < row_end and col < col_end; a bound left None does not apply. The bounds are
    int32 scalars (a block's key or query offset folded in)."""
    if diff not in (1, -1):
        raise ValueError(f"diff={diff!r}: expected 1 (col - row) or -1 (row - col)")
    bounds = {name: v for name, v in (("lo", lo), ("hi", hi), ("row_end", row_end), ("col_end", col_end))
              if v is not None}
    if not bounds:
        return x
    if not on_gpu:
        return _keep_band_where(x, fill, diff, bounds)
    names = tuple(bounds)
    args = tuple(jnp.asarray(bounds[n], jnp.int32) for n in names)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, *(plgpu.Layout.WG_SPLAT(shape=()) for _ in names)),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, plgpu.Layout.WGMMA))
    def masked(ctx, acc, *scalars):
        del ctx
        return _keep_band_registers(acc, fill, diff, dict(zip(names, (s.registers.flat[0] for s in scalars))))

    return masked(x, *args)


def _keep_band_where(x, fill, diff, bounds):
    row = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    col = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    d = (col - row) * diff
    keep = jnp.ones(x.shape, jnp.bool_)
    if "lo" in bounds:
        keep &= d >= bounds["lo"]
    if "hi" in bounds:
        keep &= d <= bounds["hi"]
    if "row_end" in bounds:
        keep &= row < bounds["row_end"]
    if "col_end" in bounds:
        keep &= col < bounds["col_end"]
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))


def layout_offsets(layout, shape) -> tuple[list, list, int]:
    """(thread offsets [(row_t, col_t)], register offsets [(register index, (row_r, col_r))], vector
    length) of a 2-D tiled `layout` (a register holds `vector length` scores along a row), after
    checking that every thread's offsets add to every register's without a carry (else
    NotImplementedError)."""
    if len(shape) != 2:
        raise NotImplementedError(f"shape={shape}: band masks take 2-D accumulators")
    cols = shape[1]
    strides = layout.tiling.tile_strides((cols, 1))
    tiled = layout.tiling.tile_shape(shape)
    thread_dims = tuple(layout.warp_dims) + tuple(layout.lane_dims)
    if not all(isinstance(d, int) for d in thread_dims):
        raise NotImplementedError(f"{layout}: replicated thread dimensions")
    threads = [divmod(sum(i * strides[d] for i, d in zip(idx, thread_dims)), cols)
               for idx in itertools.product(*(range(tiled[d]) for d in thread_dims))]
    registers = [(reg_idx, divmod(sum(i * s for i, s in zip(reg_idx, strides)), cols))
                 for reg_idx in np.ndindex(layout.registers_shape(shape))]
    vector = layout.vector_length
    if (max(c for _, c in threads) + max(c for _, (_, c) in registers) + vector > cols
            or max(r for r, _ in threads) + max(r for _, (r, _) in registers) >= shape[0]):
        raise NotImplementedError(f"{layout}: thread and register offsets of {shape} carry into each other")
    return threads, registers, vector


def _keep_band_registers(acc, fill, diff, bounds: dict):
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import arith, vector
    from jax.experimental.mosaic import gpu as mgpu

    i32 = ir.IntegerType.get_signless(32)
    _, offsets, width = layout_offsets(acc.layout, acc.shape)
    row_t, col_t = (arith.index_cast(i32, v) for v in next(iter(acc.layout.thread_idxs(acc.shape))))
    d_t = arith.subi(col_t, row_t) if diff == 1 else arith.subi(row_t, col_t)
    # Each bound taken off the thread's part once: what is left per score is a constant.
    lo = arith.subi(d_t, bounds["lo"]) if "lo" in bounds else None
    hi = arith.subi(d_t, bounds["hi"]) if "hi" in bounds else None
    row_end = arith.subi(row_t, bounds["row_end"]) if "row_end" in bounds else None
    col_end = arith.subi(col_t, bounds["col_end"]) if "col_end" in bounds else None
    const = lambda v: mgpu.utils.c(int(v), i32)  # noqa: E731
    fill_value = mgpu.utils.c(float(fill), acc.mlir_dtype)
    registers = np.empty_like(acc.registers)
    for reg_idx, (row_r, col_r) in offsets:
        reg = acc.registers[reg_idx]
        if not isinstance(reg.type, ir.VectorType):
            raise NotImplementedError(f"{acc.layout}: registers of {reg.type}, expected vectors")
        for e in range(width):
            k = diff * (col_r + e - row_r)
            keep: Optional[ir.Value] = None
            for cond in ((lo is not None and arith.cmpi(arith.CmpIPredicate.sge, lo, const(-k))),
                         (hi is not None and arith.cmpi(arith.CmpIPredicate.sle, hi, const(-k))),
                         (row_end is not None and arith.cmpi(arith.CmpIPredicate.slt, row_end, const(-row_r))),
                         (col_end is not None
                          and arith.cmpi(arith.CmpIPredicate.slt, col_end, const(-(col_r + e))))):
                if cond is not False:
                    keep = cond if keep is None else arith.andi(keep, cond)
            position = ir.DenseI64ArrayAttr.get([e])
            value = vector.extract(reg, dynamic_position=[], static_position=position)
            reg = vector.insert(arith.select(keep, value, fill_value), reg, dynamic_position=[],
                                static_position=position)
        registers[reg_idx] = reg
    return mgpu.FragmentedArray(_registers=registers, _layout=acc.layout, _is_signed=None)
