"""The Triton flash kernels as a differentiable JAX function, launched with jax-triton.

`flash_attention_triton(q, k, v, ...)` returns (out, lse) and has a custom VJP running the backward
kernels. jax-triton is imported when a kernel is launched (it needs a GPU build of jaxlib), so this
module imports on any machine.

Shape legend: B batch, Hq / Hk query / KV heads, L query length, S key length, D / Dv head dims.
Layout "BHTD" means (B, H, T, D) arrays, "BTHD" (B, T, H, D); the kernels read either through strides.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import triton

from .jax_triton_module import jax_triton
from . import flash_plan as plan
from .flash_entries_triton import (delta_entry_static, dkdv_entry_static, dq_entry_static, dropout_mask_entry,
                                   fwd_entry_static)
from .flash_plan import FlashConfig, Operand
from .skip_table_jax import skip_table_jax
from .segment_table_triton import segment_table_entry_static, segment_table_launch, segment_table_shapes

__all__ = ["FlashConfig", "FlashExtras", "flash_attention_triton", "flash_block_forward", "flash_block_backward"]


class FlashExtras(NamedTuple):
    """Non-differentiable integer inputs of a flash call (each None when unused).

    Attributes:
        segment_ids: (q_ids (B, L), kv_ids (B, S)) integer arrays; query i sees key j only where
            the ids are equal.
        cu_seqlens: (cu_q (N + 1,), cu_k (N + 1,)) int32 offsets of N sequences packed in a batch of
            1 (varlen); causal / window rules apply per sequence.
        seed: (2,) int32 dropout seed (Philox key, low word first).
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes (B = sequences with varlen): the
            logit of query i and key j gets -slope * |i + S - L - j| after scale, soft cap and
            bias (positions and lengths of the sequence with varlen). No gradient.
    """

    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None
    seed: Optional[jax.Array] = None
    alibi_slopes: Optional[jax.Array] = None


def bwd_tiles(d: int, dtype) -> tuple[plan.Tile, plan.Tile]:
    """Default backward tiles for head dim `d` and `dtype` (`flash_plan.bwd_tiles`)."""
    return plan.bwd_tiles(d, jnp.dtype(dtype).itemsize)


def _operand(x, layout: str) -> Operand:
    """A contiguous array's sizes and strides in (B, H, T, D) order."""
    return Operand(plan.to_bhtd(tuple(x.shape), layout), plan.to_bhtd(plan.contiguous_strides(x.shape), layout))


def _bhls(x) -> Optional[Operand]:
    """A (B|1, H|1, L|1, S) bias or mask (size-1 dims broadcast with stride 0)."""
    return None if x is None else _operand(x, "BHTD")


def _call(q, k, v, bias, mask, sinks, extras: "FlashExtras", cfg: FlashConfig) -> plan.FlashCall:
    if cfg.dropout_p > 0 and extras.seed is None:
        raise ValueError(f"dropout_p={cfg.dropout_p}: FlashExtras.seed is required for dropout.")
    if (cfg.varlen is not None) != (extras.cu_seqlens is not None):
        raise ValueError("varlen: FlashConfig.varlen and FlashExtras.cu_seqlens go together.")
    return plan.FlashCall(
        q=_operand(q, cfg.layout), k=_operand(k, cfg.layout), v=_operand(v, cfg.layout),
        bias=_bhls(bias), mask=_bhls(mask), dtype_bytes=jnp.dtype(q.dtype).itemsize,
        has_sinks=sinks is not None, has_segments=extras.segment_ids is not None,
        num_seqs=None if extras.cu_seqlens is None else extras.cu_seqlens[0].shape[0] - 1,
        alibi_stride=_alibi_stride(extras.alibi_slopes),
    )


def _alibi_stride(slopes: Optional[jax.Array]) -> Optional[int]:
    """The slopes' batch stride (0 for one slope per head), None without ALiBi."""
    if slopes is None:
        return None
    return 0 if slopes.ndim == 1 or slopes.shape[0] == 1 else slopes.shape[-1]


def _alibi_input(extras: FlashExtras) -> jax.Array:
    """The kernels' float32 slopes (no gradient), or a placeholder."""
    if extras.alibi_slopes is None:
        return _placeholder()
    return jax.lax.stop_gradient(extras.alibi_slopes).astype(jnp.float32)


def dropout_keep_mask(seed: jax.Array, bh: int, l: int, s: int, dropout_p: float) -> jax.Array:
    """The dropout keep mask the flash kernels apply, materialised (for tests and debugging).

    Args:
        seed: (2,) int32, as in `FlashExtras.seed`.
        bh: B * Hq (1 * Hq for varlen, whose rows and keys are the packed positions).
        l, s: query and key lengths in memory.
        dropout_p: drop probability.

    Returns:
        (bh, l, s) bool, True where a probability is kept (and scaled by 1 / (1 - dropout_p)).
    """
    jt = jax_triton()

    keep = jt.triton_call(
        seed.astype(jnp.int32), kernel=dropout_mask_entry,
        out_shape=jax.ShapeDtypeStruct((bh, l, s), jnp.int8), grid=(triton.cdiv(l, 32), bh),
        BH=bh, L=l, S=s, dropout_p=float(dropout_p), BLOCK_M=32, BLOCK_N=64,
    )
    return keep != 0


def _fold(x: jax.Array, axis: int, tile: int) -> jax.Array:
    """Max over consecutive groups of `tile` along `axis` (zero-padded); size-1 axes stay (broadcast)."""
    n = x.shape[axis]
    if n == 1 or tile == 1:
        return x
    blocks = -(-n // tile)
    pad = [(0, blocks * tile - n if i == axis else 0) for i in range(x.ndim)]
    x = jnp.pad(x, pad)
    return jnp.max(x.reshape(x.shape[:axis] + (blocks, tile) + x.shape[axis + 1:]), axis=axis + 1)


# --- the skip table in jnp: the reference the skip-table kernel is tested against -----------------


def visibility_tiles(bias: Optional[jax.Array], mask: Optional[jax.Array],
                     tile: tuple[int, int]) -> jax.Array:
    """Which (tile_m x tile_n) tiles of the logits the bool mask and the bias leave visible.

    Args:
        bias: None or float (B|1, Hq|1, L|1, S|1); -inf masks an element (NaN does not).
        mask: None or int8 (B|1, Hq|1, L|1, S|1), nonzero = attend.
        tile: (tile_m, tile_n).

    Returns:
        int8 (B|1, Hq|1, cdiv(L, tile_m)|1, cdiv(S, tile_n)|1): 1 where some element of the tile is
        visible; a dim of size 1 in the inputs stays size 1 (it broadcasts). The causal / window /
        segment rules are not part of it (the kernels apply them separately).
    """
    vis = None
    if mask is not None:
        vis = mask != 0
    if bias is not None:
        finite = bias != -jnp.inf
        vis = finite if vis is None else vis & finite
    vis = _fold(_fold(vis.astype(jnp.int8), 2, tile[0]), 3, tile[1])
    return vis


def _skip_tiles(call: plan.FlashCall, bias, mask, cfg: FlashConfig):
    """(bias, mask) when the kernels should skip the tiles they mask entirely, else None; each kernel's
    table comes from the skip-table kernel the torch launcher also runs (`skip_table_triton`)."""
    return (bias, mask) if plan.uses_skip_table(call, cfg) else None


def skip_table(skip, block_m: int, block_n: int, l: int, s: int, along: str) -> jax.Array:
    """The kernels' int32 skip table at (block_m, block_n) tiles.

    Args:
        skip: (fine tile, fine visibility table) from `_skip_tiles`.
        block_m, block_n: the kernel's tiles. l, s: query and key lengths.
        along: "k" for kernels that loop over key blocks per query block (forward, dQ), "q" for the
            dK/dV kernel (loops over query blocks per key block).

    Returns:
        (B|1, Hq|1, R, 2 * C + 1) int32 with R the blocks of the grid's axis and C those of the loop's:
        per row, C + 1 prefix counts of live blocks (entry c = live blocks before block c), then the
        live blocks in ascending order (padded with the dead ones).
    """
    (tm, tn), fine = skip
    table = _fold(_fold(fine, 2, block_m // tm), 3, block_n // tn)
    table = jnp.broadcast_to(table, table.shape[:2] + (-(-l // block_m), -(-s // block_n)))
    if along == "q":
        table = jnp.swapaxes(table, 2, 3)
    live = table != 0
    counts = jnp.cumsum(live, axis=-1, dtype=jnp.int32)
    counts = jnp.concatenate([jnp.zeros(counts.shape[:-1] + (1,), jnp.int32), counts], axis=-1)
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    return jnp.concatenate([counts, order], axis=-1)


def _skip_table_input(skip, block_m: int, block_n: int, l: int, s: int, along: str):
    """(skip table or a placeholder, its strides or None) for a kernel with (block_m, block_n) tiles."""
    if skip is None:
        return _placeholder(jnp.int32), None
    table = skip_table_jax(*skip, block_m, block_n, l, s, along)
    return table, plan.contiguous_strides(table.shape)


def _placeholder(dtype=jnp.float32) -> jax.Array:
    return jnp.zeros((1,), dtype)


def segment_tables(q_ids: jax.Array, kv_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernels' segment tables, int32: SegQ (B, 4, L) = (ids, key span lo, key span hi, keys of
    the span all share the id) and SegK (B, 4, S) = (ids, query span lo, query span hi, contiguous),
    written by the segment-table kernel the torch launcher also runs (`segment_table_triton`)."""
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    (b, l), s = q_ids.shape, kv_ids.shape[1]
    shapes = segment_table_shapes(b, l, s)
    grid, num_warps, args = segment_table_launch(b, l, s, (l, 1), (s, 1))
    seg_q, seg_k, _ = jax_triton().triton_call(
        q_ids, kv_ids, kernel=segment_table_entry_static,
        out_shape=tuple(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in shapes),
        grid=grid, num_warps=num_warps, num_stages=1, **args,
    )
    return seg_q, seg_k


def _extra_inputs(extras: FlashExtras, seg_tables) -> tuple[jax.Array, ...]:
    """(SegQ, SegK, CuQ, CuK, Seed) kernel inputs, placeholders for unused ones."""
    seg_q, seg_k = seg_tables if seg_tables is not None else (_placeholder(jnp.int32),) * 2
    cu_q, cu_k = (
        tuple(c.astype(jnp.int32) for c in extras.cu_seqlens)
        if extras.cu_seqlens is not None else (_placeholder(jnp.int32),) * 2
    )
    seed = extras.seed.astype(jnp.int32) if extras.seed is not None else _placeholder(jnp.int32)
    return seg_q, seg_k, cu_q, cu_k, seed


def _launch(kernel, inputs, out_shape, launch: plan.Launch):
    jt = jax_triton()

    return jt.triton_call(*inputs, kernel=kernel, out_shape=out_shape, grid=launch.grid,
                          num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.args)


def _forward(q, k, v, bias, mask, sinks, extras: FlashExtras, seg_tables, skip, cfg: FlashConfig, out_dtype=None):
    call = _call(q, k, v, bias, mask, sinks, extras, cfg)
    b, hq, l, dv = call.q.dims[0], call.q.dims[1], call.q.dims[2], call.v.dims[3]
    block_m, block_n, _, _ = plan.forward_tile(call, cfg)
    out_shape = (b, hq, l, dv) if cfg.layout == "BHTD" else (b, l, hq, dv)
    vis, vis_strides = _skip_table_input(skip, block_m, block_n, l, call.k.dims[2], "k")
    launch = plan.forward_launch(call, cfg, plan.to_bhtd(plan.contiguous_strides(out_shape), cfg.layout), vis_strides)
    out, lse = _launch(
        fwd_entry_static,
        (q, k, v, bias if bias is not None else _placeholder(q.dtype),
         mask if mask is not None else _placeholder(jnp.int8), sinks if sinks is not None else _placeholder(),
         *_extra_inputs(extras, seg_tables), vis, _alibi_input(extras)),
        (jax.ShapeDtypeStruct(out_shape, out_dtype or q.dtype), jax.ShapeDtypeStruct((b, hq, l), jnp.float32)),
        launch,
    )
    if cfg.varlen is not None:  # rows after the last sequence belong to no program
        valid = jnp.arange(l) < extras.cu_seqlens[0][-1]
        out = jnp.where(valid[:, None, None] if cfg.layout == "BTHD" else valid[:, None], out, 0).astype(out.dtype)
        lse = jnp.where(valid, lse, -jnp.inf)
    return out, lse


def _delta(out, dout, layout: str) -> jax.Array:
    """rowsum(dOut * Out) in fp32, (B, Hq, L) contiguous, by the same kernel the torch launcher runs."""
    o = _operand(out, layout)
    launch = plan.delta_launch(o, _operand(dout, layout).strides)
    b, hq, l, _ = o.dims
    return _launch(delta_entry_static, (out, dout), jax.ShapeDtypeStruct((b, hq, l), jnp.float32), launch)


def _backward(q, k, v, bias, mask, dout, lse, delta, extras: FlashExtras, seg_tables, skip, cfg: FlashConfig,
              write_ds: bool, grad_dtype=None):
    call = _call(q, k, v, bias, mask, None, extras, cfg)
    b, hq, l, _ = call.q.dims
    s = call.k.dims[2]
    (kv_m, kv_n, _, _), (q_m, q_n, _, _) = plan.backward_tiles(call, cfg)
    do_strides = _operand(dout, cfg.layout).strides
    placeholders = (
        bias if bias is not None else _placeholder(q.dtype),
        mask if mask is not None else _placeholder(jnp.int8),
    )
    extra_inputs = _extra_inputs(extras, seg_tables)
    kv_vis, kv_vis_strides = _skip_table_input(skip, kv_m, kv_n, l, s, "q")
    dk, dv = _launch(
        dkdv_entry_static, (q, k, v, *placeholders, dout, lse, delta, *extra_inputs, kv_vis, _alibi_input(extras)),
        (jax.ShapeDtypeStruct(k.shape, grad_dtype or k.dtype), jax.ShapeDtypeStruct(v.shape, grad_dtype or v.dtype)),
        plan.dkdv_launch(call, cfg, do_strides, call.k.strides, call.v.strides, kv_vis_strides),
    )
    ds_shape = (b, hq, l, s) if write_ds else (1,)
    q_vis, q_vis_strides = _skip_table_input(skip, q_m, q_n, l, s, "k")
    dq, ds = _launch(
        dq_entry_static, (q, k, v, *placeholders, dout, lse, delta, *extra_inputs, q_vis, _alibi_input(extras)),
        (jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype), jax.ShapeDtypeStruct(ds_shape, jnp.float32)),
        plan.dq_launch(call, cfg, do_strides, call.q.strides,
                       plan.contiguous_strides(ds_shape) if write_ds else None, q_vis_strides),
    )
    if cfg.varlen is not None:  # rows / keys after the last sequence belong to no program
        cu_q, cu_k = extras.cu_seqlens
        dq = _zero_tail(dq, cu_q[-1], cfg.layout)
        dk, dv = _zero_tail(dk, cu_k[-1], cfg.layout), _zero_tail(dv, cu_k[-1], cfg.layout)
    return dq, dk, dv, (ds if write_ds else None)


def _zero_tail(x: jax.Array, end: jax.Array, layout: str) -> jax.Array:
    """Zeros the time positions >= `end` of a (1, T, H, D) / (1, H, T, D) array."""
    t_axis = 1 if layout == "BTHD" else 2
    valid = jnp.arange(x.shape[t_axis]) < end
    valid = valid[:, None, None] if layout == "BTHD" else valid[:, None]
    return jnp.where(valid, x, 0).astype(x.dtype)


def _reduce_to(grad: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums a (B, Hq, L, S) gradient over the dims a (B|1, H|1, L|1, S|1) bias broadcast."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True).reshape(shape)


def _seg_tables(extras: FlashExtras):
    return None if extras.segment_ids is None else segment_tables(*extras.segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def flash_attention_triton(q, k, v, bias, mask, sinks, extras: FlashExtras, cfg: FlashConfig):
    """Flash attention by Triton kernels; returns (out, lse).

    Args:
        q: (B, Hq, L, D) or (B, L, Hq, D) per `cfg.layout`. k: (.., Hk, S, D). v: (.., Hk, S, Dv).
            With varlen (`cfg.varlen`), B = 1 and L / S are the packed lengths.
        bias: None or float (B|1, Hq|1, L|1, S), added to the logits.
        mask: None or int8 (B|1, Hq|1, L|1, S), 1 = attend.
        sinks: None or float32 (Hq,) sink logits.
        extras: segment ids, varlen offsets, the dropout seed and ALiBi slopes (`FlashExtras`).
        cfg: static settings.

    Returns:
        out in q's layout and dtype, lse (B, Hq, L) float32 (-inf on rows that see nothing).
    """
    skip = _skip_tiles(_call(q, k, v, bias, mask, sinks, extras, cfg), bias, mask, cfg)
    return _forward(q, k, v, bias, mask, sinks, extras, _seg_tables(extras), skip, cfg)


def _vjp_fwd(q, k, v, bias, mask, sinks, extras, cfg):
    seg_tables = _seg_tables(extras)
    skip = _skip_tiles(_call(q, k, v, bias, mask, sinks, extras, cfg), bias, mask, cfg)
    out, lse = _forward(q, k, v, bias, mask, sinks, extras, seg_tables, skip, cfg)
    return (out, lse), (q, k, v, bias, mask, sinks, extras, seg_tables, skip, out, lse)


def _vjp_bwd(cfg, residuals, cotangents):
    q, k, v, bias, mask, sinks, extras, seg_tables, skip, out, lse = residuals
    dout, dlse = cotangents
    # Delta = rowsum(dO * O) in fp32, minus the LSE cotangent (d lse / d logit = P).
    delta = _delta(out, dout, cfg.layout) - dlse
    dq, dk, dv, ds = _backward(q, k, v, bias, mask, dout, lse, delta, extras, seg_tables, skip, cfg,
                               write_ds=bias is not None)
    dbias = None if bias is None else _reduce_to(ds, bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        # Rows outside every varlen sequence have lse = -inf and no sink weight.
        p_sink = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(sinks[None, :, None] - lse))
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dbias, None, dsinks, None


flash_attention_triton.defvjp(_vjp_fwd, _vjp_bwd)


# --- one block of a larger attention (ring attention merges these partial results) ---------------


def flash_block_forward(q, k, v, extras: FlashExtras, cfg: FlashConfig, out_dtype=None):
    """The forward kernel alone, no custom VJP: (out, lse) of q against this k/v block.

    Arguments as in `flash_attention_triton` (no bias, mask or sinks); `out_dtype` (e.g. float32)
    sets the output dtype, q's dtype by default, so partial results can be merged without rounding.
    """
    return _forward(q, k, v, None, None, None, extras, _seg_tables(extras), None, cfg, out_dtype=out_dtype)


def flash_block_backward(q, k, v, dout, lse, delta, extras: FlashExtras, cfg: FlashConfig, grad_dtype=None):
    """The backward kernels alone: (dq, dk, dv) of this k/v block's share, given row statistics of
    the whole attention: `lse` (B, Hq, L) and `delta` = rowsum(dout * out) - dLSE (B, Hq, L), both
    float32 and contiguous. Summing the results over all key blocks gives the full gradients.
    `grad_dtype` sets the gradients' dtype (q/k/v's by default)."""
    dq, dk, dv, _ = _backward(q, k, v, None, None, dout, lse, delta, extras, _seg_tables(extras), None, cfg,
                              write_ds=False, grad_dtype=grad_dtype)
    return dq, dk, dv
