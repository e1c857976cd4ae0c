"""The Triton decode kernels as a JAX function, launched with jax-triton.

`decode_attention_triton(q, k, v, lengths, starts, block_table, sinks, cfg, alibi_slopes)` returns
(out, lse): the segment table (`decode_segments_triton`), the stream-K schedule
(`decode_stream_triton`), then the merge of each row's partial results. The launches are planned by `decode_plan`, the plan the torch
launcher (`torch_api/native_decode.py`) uses too. jax-triton is imported when a kernel is launched
(it needs a GPU build of jaxlib), so this module imports on any machine. Entry kernels take every
scalar as a constexpr (jax-triton's convention: inputs, then outputs, then constexprs); the cache
lengths, starts and block table are device arrays, so ragged lengths that change every step reuse
one compilation.

Shape legend: B batch, T queries per sequence, Hq / Hkv query / KV heads, S cache capacity,
D / Dv head dims, P pages, PS page size.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from ..capabilities import device_multiprocessors
from .decode_entries_triton import stream_entry, stream_merge_entry
from .decode_plan import (CACHE_LAYOUTS, DEFAULT_SMS, STREAM_PROGRAMS_PER_SM, DecodeCall,  # noqa: F401 (re-exported)
                          DecodeConfig, cache_dims, cache_order, contiguous_strides, decode_tiles, default_min_share,
                          max_parts, max_visible_blocks, plan_decode, query_order, row_block, segments_launch)
from .decode_segments_triton import segment_offsets_entry
from .flash_plan import Launch
from .jax_triton_module import jax_triton


def _device_sms() -> int:
    """Multiprocessors of JAX's first device (`DEFAULT_SMS` where it does not say)."""
    return device_multiprocessors(DEFAULT_SMS)


def segment_offsets(lengths: jax.Array, starts: Optional[jax.Array], t: int, capacity: int, cfg: DecodeConfig,
                    block_n: int, segments_per_sequence: int) -> jax.Array:
    """(B * segments_per_sequence + 1,) int32 cumulative key blocks of the stream schedule's
    segments: each sequence's blocks intersecting the positions its queries see (the kernels'
    `sequence_range`), repeated for its KV heads and row blocks; by `segment_offsets_entry`."""
    planned = segments_launch(lengths.shape[0], t, capacity, cfg, block_n, segments_per_sequence, starts is not None)
    return _launch_segments(jax_triton(), planned, lengths, starts, lengths.shape[0] * segments_per_sequence)


def _launch_segments(jt, planned: Launch, lengths: jax.Array, starts: Optional[jax.Array], segments: int) -> jax.Array:
    return jt.triton_call(
        lengths.astype(jnp.int32), _int32_or_placeholder(starts), kernel=segment_offsets_entry,
        out_shape=jax.ShapeDtypeStruct((segments + 1,), jnp.int32),
        grid=planned.grid, num_warps=planned.num_warps, num_stages=planned.num_stages, **planned.args,
    )


def _placeholder(dtype) -> jax.Array:
    return jnp.zeros((1,), dtype)


def _int32_or_placeholder(x: Optional[jax.Array]) -> jax.Array:
    return x.astype(jnp.int32) if x is not None else _placeholder(jnp.int32)


def _float_or_placeholder(x: Optional[jax.Array]) -> jax.Array:
    return x.astype(jnp.float32) if x is not None else _placeholder(jnp.float32)


def decode_call(q, k, v, block_table, sinks, starts, cfg: DecodeConfig, alibi_slopes=None) -> DecodeCall:
    """`DecodeCall` of JAX arrays (row-major: strides follow from shapes)."""
    b, t, hq, d = query_order(q.shape, cfg.q_layout)
    paged = cfg.cache_layout == "paged"
    hkv, capacity, page_size = cache_dims(k.shape, cfg.cache_layout, None if block_table is None else block_table.shape)
    cache_layout = "BSHD" if paged else cfg.cache_layout
    out_shape = (b, t, hq, v.shape[-1]) if cfg.q_layout == "BTHD" else (b, hq, t, v.shape[-1])
    return DecodeCall(
        b=b, t=t, hq=hq, d=d, dv=v.shape[-1], hkv=hkv, capacity=capacity, page_size=page_size,
        q_strides=query_order(contiguous_strides(q.shape), cfg.q_layout),
        k_strides=cache_order(contiguous_strides(k.shape), cache_layout),
        v_strides=cache_order(contiguous_strides(v.shape), cache_layout),
        out_strides=query_order(contiguous_strides(out_shape), cfg.q_layout),
        table_stride=block_table.shape[1] if paged else 0, dtype_bytes=jnp.dtype(q.dtype).itemsize,
        has_starts=starts is not None, has_sinks=sinks is not None,
        alibi_stride=None if alibi_slopes is None else (0 if alibi_slopes.ndim == 1 else hq),
    )


def decode_attention_triton(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    starts: Optional[jax.Array],
    block_table: Optional[jax.Array],
    sinks: Optional[jax.Array],
    cfg: DecodeConfig,
    alibi_slopes: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention by the Triton kernels; returns (out, lse).

    Args:
        q: (B, T, Hq, D) ("BTHD") or (B, Hq, T, D) ("BHTD"), per `cfg.q_layout`.
        k: (B, S, Hkv, D) "BSHD", (B, Hkv, S, D) "BHSD", or pages (P, PS, Hkv, D), per
            `cfg.cache_layout`; read in place, only the visible positions.
        v: the same with Dv.
        lengths: (B,) int32, valid positions end (exclusive), at most S.
        starts: (B,) int32 first valid positions, or None (0).
        block_table: (B, max_pages) int32 page of each sequence's page slot ("paged" only).
        sinks: (Hq,) float32 sink logits, or None.
        cfg: static settings.
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes, or None: -slope * |length - T + t - j|
            joins the logit of query t and position j, after scale and soft cap.

    Returns:
        out in q's layout and dtype; lse (B, Hq, T) float32 (-inf for queries that see nothing,
        unless a sink is given).
    """
    if cfg.cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout={cfg.cache_layout!r}: expected one of {CACHE_LAYOUTS}.")
    jt = jax_triton()
    call = decode_call(q, k, v, block_table, sinks, starts, cfg, alibi_slopes)
    plan = plan_decode(call, cfg, _device_sms())
    stream, merge = plan.stream, plan.merge
    seg_cum = _launch_segments(jt, plan.segments, lengths, starts, plan.num_segments)
    table = block_table.astype(jnp.int32) if cfg.cache_layout == "paged" else _placeholder(jnp.int32)
    out_part, lse_part = jt.triton_call(
        q, k, v, lengths.astype(jnp.int32), _int32_or_placeholder(starts), table, seg_cum,
        _float_or_placeholder(alibi_slopes), kernel=stream_entry,
        out_shape=(jax.ShapeDtypeStruct(plan.part_shape, jnp.float32),
                   jax.ShapeDtypeStruct(plan.part_shape[:-1], jnp.float32)),
        grid=stream.grid, num_warps=stream.num_warps, num_stages=stream.num_stages, **stream.args,
    )
    b, t, hq, _ = query_order(q.shape, cfg.q_layout)
    out_shape = (b, t, hq, call.dv) if cfg.q_layout == "BTHD" else (b, hq, t, call.dv)
    return jt.triton_call(
        out_part, lse_part, seg_cum, _float_or_placeholder(sinks), kernel=stream_merge_entry,
        out_shape=(jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
        grid=merge.grid, num_warps=merge.num_warps, num_stages=merge.num_stages, **merge.args,
    )
