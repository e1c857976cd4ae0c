"""Decode attention as a Pallas TPU kernel (contiguous (B, S, Hkv, D) caches and pages).

Grid (B, key blocks): one program per sequence walks the cache block by block (a page per step for
paged caches), keeping an online softmax in VMEM scratch for all Hkv heads; the G = Hq // Hkv query
heads of a KV head and the T queries form the rows of one matmul (GQA without repeating K/V).
Lengths, starts and the block table are scalar-prefetched: the K/V index maps clamp each step's block
to the blocks the sequence can see, so steps outside that range repeat the previous block index and
Pallas issues no copy for them (only visible blocks are read), and their compute is skipped.

Visibility and semantics are those of `decode_common_triton.py` (queries at positions
length - T + t + pos_shift, [start, length) valid, causal / window rule, sinks in the denominator,
out = 0 and lse = -inf for queries that see nothing, ALiBi -slope * |length - T + t - j| after the
soft cap). Tested in Pallas TPU interpret mode on the CPU only.

Shape legend: B batch, T queries, Hq / Hkv heads, S capacity, D / Dv head dims, P pages, PS page size.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp


def _block_len(s: int, target: int = 512) -> int:
    """The largest power-of-two divisor of `s` that is <= target and a multiple of 8, else `s`."""
    block = target
    while block >= 8:
        if s % block == 0:
            return block
        block //= 2
    return s


def _visible_range(length, start, *, t, capacity, causal, window, pos_shift):
    """[lo, hi): positions any of the sequence's T queries sees (scalars)."""
    length = jnp.minimum(length, capacity)
    start = jnp.maximum(start, 0)
    left, right = window
    lo = start if left < 0 else jnp.maximum(start, length - t + pos_shift - left)
    hi = length
    if causal:
        hi = jnp.minimum(hi, length + pos_shift)
    if right >= 0:
        hi = jnp.minimum(hi, length + pos_shift + right)
    return jnp.maximum(lo, 0), hi


def decode_attention_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    starts: Optional[jax.Array],
    block_table: Optional[jax.Array],
    sinks: Optional[jax.Array],
    *,
    scale: float,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    pos_shift: int = 0,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention on TPU; returns out (B, T, Hq, Dv) in q's dtype and lse (B, Hq, T) float32.

    Args:
        q: (B, T, Hq, D).
        k: contiguous (B, S, Hkv, D), or pages (P, PS, Hkv, D) with `block_table`.
        v: the same with Dv.
        lengths: (B,) int32. starts: (B,) int32 or None. block_table: (B, max_pages) int32 or None.
        sinks: (Hq,) float32 or None.
        scale, causal, window, pos_shift, softcap: as `decode_jax_triton.DecodeConfig`.
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes, or None (the ALiBi code is then not
            traced).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    b, t, hq, d = q.shape
    paged = block_table is not None
    hkv, dv = k.shape[2], v.shape[-1]
    groups, rows = hq // hkv, (hq // hkv) * t
    if paged:
        block, n_blocks = k.shape[1], block_table.shape[1]
    else:
        block = _block_len(k.shape[1])
        n_blocks = k.shape[1] // block
    capacity = block * n_blocks
    window = tuple(int(w) for w in window)
    visible_range = functools.partial(_visible_range, t=t, capacity=capacity, causal=causal, window=window,
                                      pos_shift=pos_shift)
    lengths = lengths.astype(jnp.int32)
    starts = jnp.zeros((b,), jnp.int32) if starts is None else starts.astype(jnp.int32)
    table = block_table.astype(jnp.int32) if paged else jnp.zeros((b, 1), jnp.int32)
    sink_row = (jnp.full((1, hq), -jnp.inf, jnp.float32) if sinks is None
                else sinks.astype(jnp.float32).reshape(1, hq))
    alibi = alibi_slopes is not None
    # Slopes as (B, 1, Hq): a (1, 1, Hq) block per sequence spans the last two dims whole, as TPU
    # blocks must. Without ALiBi there is no such input at all.
    slope_inputs = [] if not alibi else [
        jnp.broadcast_to(alibi_slopes.astype(jnp.float32).reshape(-1, 1, hq), (b, 1, hq))]
    slope_specs = [pl.BlockSpec((1, 1, hq), lambda i, j, *_: (i, 0, 0))] if alibi else []

    def kv_index(i, j, lengths_ref, starts_ref, table_ref):
        lo, hi = visible_range(lengths_ref[i], starts_ref[i])
        first = jnp.minimum(lo // block, n_blocks - 1)
        last = jnp.clip((hi - 1) // block, first, n_blocks - 1)
        jj = jnp.clip(j, first, last)
        return (table_ref[i, jj], 0, 0, 0) if paged else (i, jj, 0, 0)

    def kernel(lengths_ref, starts_ref, table_ref, q_ref, k_ref, v_ref, sink_ref, *refs):
        slope_ref = refs[0] if alibi else None
        o_ref, lse_ref, m_sc, l_sc, acc_sc = refs[1:] if alibi else refs
        i, j = pl.program_id(0), pl.program_id(1)

        @pl.when(j == 0)
        def _init():
            m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        length = jnp.minimum(lengths_ref[i], capacity)
        start = jnp.maximum(starts_ref[i], 0)
        lo, hi = visible_range(lengths_ref[i], starts_ref[i])
        first_col = j * block

        @pl.when((first_col < hi) & (first_col + block > lo))
        def _step():
            cols = first_col + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 1)
            pos = length - t + pos_shift + jax.lax.broadcasted_iota(jnp.int32, (rows, block), 0) // groups
            visible = (cols >= start) & (cols < length)
            if causal:
                visible &= cols <= pos
            if window[0] >= 0:
                visible &= cols >= pos - window[0]
            if window[1] >= 0:
                visible &= cols <= pos + window[1]
            in_range = ((cols[:1] >= lo) & (cols[:1] < hi)).reshape(block, 1)  # positions anyone sees
            for h in range(hkv):
                qh = q_ref[0, :, h * groups:(h + 1) * groups, :].astype(jnp.float32).reshape(rows, d)
                kh = k_ref[0, :, h, :].astype(jnp.float32)
                vh = jnp.where(in_range, v_ref[0, :, h, :].astype(jnp.float32), 0.0)  # unwritten slots may be NaN
                s = jax.lax.dot_general(qh, kh, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
                if softcap is not None:
                    s = softcap * jnp.tanh(s / softcap)
                if alibi:  # rows r = t * G + g; distance from the query's bottom-right position
                    slope = jnp.tile(slope_ref[0, 0, h * groups:(h + 1) * groups], t).reshape(rows, 1)
                    s = s - slope * jnp.abs(pos - pos_shift - cols).astype(jnp.float32)
                s = jnp.where(visible, s, -jnp.inf)
                m_prev = m_sc[h]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
                m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp(m_prev - m_ref)
                p = jnp.exp(s - m_ref)
                l_sc[h] = alpha * l_sc[h] + jnp.sum(p, axis=-1, keepdims=True)
                acc_sc[h] = alpha * acc_sc[h] + jax.lax.dot_general(
                    p, vh, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                m_sc[h] = m_new

        @pl.when(j == n_blocks - 1)
        def _finish():
            for h in range(hkv):
                sink = jnp.tile(sink_ref[0, h * groups:(h + 1) * groups], t).reshape(rows, 1)
                m = jnp.maximum(m_sc[h], sink)
                m_ref = jnp.where(m == -jnp.inf, 0.0, m)
                keys = jnp.exp(m_sc[h] - m_ref)
                denom = l_sc[h] * keys + jnp.exp(sink - m_ref)
                empty = denom == 0.0
                d_safe = jnp.where(empty, 1.0, denom)
                out = acc_sc[h] * keys / d_safe
                lse = jnp.where(empty, -jnp.inf, m_ref + jnp.log(d_safe))
                o_ref[0, :, h * groups:(h + 1) * groups, :] = out.reshape(t, groups, dv).astype(o_ref.dtype)
                lse_ref[0, h * groups:(h + 1) * groups, :] = lse.reshape(t, groups).T

    kv_block = (1, block, hkv, d)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=(b, n_blocks),
        in_specs=[
            pl.BlockSpec((1, t, hq, d), lambda i, j, *_: (i, 0, 0, 0)),
            pl.BlockSpec(kv_block, kv_index),
            pl.BlockSpec((1, block, hkv, dv), kv_index),
            pl.BlockSpec((1, hq), lambda i, j, *_: (0, 0)),
            *slope_specs,
        ],
        out_specs=[
            pl.BlockSpec((1, t, hq, dv), lambda i, j, *_: (i, 0, 0, 0)),
            pl.BlockSpec((1, hq, t), lambda i, j, *_: (i, 0, 0)),
        ],
        scratch_shapes=[
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, 1), jnp.float32),
            pltpu.VMEM((hkv, rows, dv), jnp.float32),
        ],
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=(jax.ShapeDtypeStruct((b, t, hq, dv), q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name="jaxattn_decode_attention",
    )(lengths, starts, table, q, k, v, sink_row, *slope_inputs)
    return out, lse
