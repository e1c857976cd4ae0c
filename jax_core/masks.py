"""Visibility masks built from positions (causal alignment, sliding window), segment ids and
varlen packing.

Shape legend: T query length, S key length. Query i sits at diagonal position
p(i) = i (top-left alignment) or i + S - T (bottom-right alignment):

    top_left, T=3, S=5          bottom_right, T=3, S=5
        k: 0 1 2 3 4                k: 0 1 2 3 4
    q0     x . . . .            q0     x x x . .
    q1     x x . . .            q1     x x x x .
    q2     x x x . .            q2     x x x x x

Varlen packing (`varlen_mask`) applies the same rule per sequence, with positions local to each
sequence and the bottom-right offset len_k(n) - len_q(n) of that sequence.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .capabilities import CausalAlignment


def positional_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
) -> Optional[jax.Array]:
    """(T, S) bool mask (True = visible) from causality and a sliding window, or None if all visible.

    The window (left, right) keeps keys j with p(i) - left <= j <= p(i) + right (-1: unbounded);
    with `causal`, right is 0.
    """
    if not causal and sliding_window is None:
        return None
    offset = kv_len - q_len if causal_alignment == "bottom_right" else 0
    pos = jnp.arange(q_len)[:, None] + offset
    key = jnp.arange(kv_len)[None, :]
    visible = jnp.ones((q_len, kv_len), bool)
    if causal:
        visible &= key <= pos
    if sliding_window is not None:
        left, right = sliding_window
        if left >= 0:
            visible &= key >= pos - left
        if right >= 0:
            visible &= key <= pos + right
    return visible


def combine_masks(*masks: Optional[jax.Array]) -> Optional[jax.Array]:
    """Logical AND of broadcastable bool masks, ignoring Nones."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """(B, 1, T, S) bool mask: query i of batch b sees key j iff their segment ids are equal.

    Args:
        q_segment_ids: (B, T) integer ids of the queries.
        kv_segment_ids: (B, S) integer ids of the keys; any integers, not necessarily sorted.
    """
    return q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :]


def _sequence_of(cu_seqlens: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """For rows 0..length-1 of a packed axis: (sequence index n, row in [cu[0], cu[N]))."""
    rows = jnp.arange(length)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")  # cu[n] <= row < cu[n + 1]
    inside = (rows >= cu_seqlens[0]) & (rows < cu_seqlens[-1])
    return jnp.minimum(seq, cu_seqlens.shape[0] - 2), inside


def varlen_rows(cu_seqlens: jax.Array, length: int) -> jax.Array:
    """(length,) bool: rows of a packed axis that belong to a sequence, i.e. in [cu[0], cu[N])."""
    return _sequence_of(jnp.asarray(cu_seqlens, jnp.int32), length)[1]


def varlen_mask(
    cu_seqlens_q: jax.Array,
    cu_seqlens_k: jax.Array,
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
) -> jax.Array:
    """(1, 1, Tq, Tk) bool mask of N sequences packed back to back (True = visible).

    Sequence n holds queries [cu_q[n], cu_q[n + 1]) and keys [cu_k[n], cu_k[n + 1]). A query sees
    only keys of its own sequence; causality and the window use positions local to the sequence,
    with diagonal position p(i) = i_local (top-left) or i_local + len_k(n) - len_q(n)
    (bottom-right). Rows and columns outside [cu[0], cu[N]) (padding) see nothing.

    Args:
        cu_seqlens_q: (N + 1,) integer cumulative query lengths, non-decreasing (may be traced).
        cu_seqlens_k: (N + 1,) integer cumulative key lengths.
        q_len: Tq, the packed query length (static).
        kv_len: Tk, the packed key length (static).
        causal: keep keys with j_local <= p(i).
        causal_alignment: "top_left" or "bottom_right", per sequence.
        sliding_window: (left, right) around p(i); -1 = unbounded on that side.
    """
    cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    seq_q, in_q = _sequence_of(cu_q, q_len)
    seq_k, in_k = _sequence_of(cu_k, kv_len)
    visible = (seq_q[:, None] == seq_k[None, :]) & in_q[:, None] & in_k[None, :]
    if causal or sliding_window is not None:
        pos = jnp.arange(q_len) - cu_q[seq_q]
        if causal_alignment == "bottom_right":
            len_q, len_k = jnp.diff(cu_q), jnp.diff(cu_k)
            pos = pos + (len_k - len_q)[seq_q]
        pos = pos[:, None]
        key = (jnp.arange(kv_len) - cu_k[seq_k])[None, :]
        if causal:
            visible &= key <= pos
        if sliding_window is not None:
            left, right = sliding_window
            if left >= 0:
                visible &= key >= pos - left
            if right >= 0:
                visible &= key <= pos + right
    return visible[None, None]


def alibi_bias(
    slopes: jax.Array,
    q_len: int,
    kv_len: int,
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
) -> jax.Array:
    """ALiBi as an additive float32 bias: -slope * |i + S - T - j| for query i and key j.

    The distance is flash-attn's, aligned bottom-right whatever the causal alignment: the last
    query and the last key are at distance 0. It is the same formula with and without causality
    (flash-attn's causal kernel adds slope * j instead, which differs by a per-row constant: equal
    outputs and gradients, a different LSE). With varlen packing, i, j, T and S are the positions and
    lengths within each sequence; pairs of different sequences get an arbitrary finite value (the
    varlen mask hides them).

    Args:
        slopes: (Hq,) or (B, Hq) slopes, B the batch (the number of sequences with `cu_seqlens`).
        q_len, kv_len: T and S (the packed lengths with `cu_seqlens`).
        cu_seqlens: None, or (cu_seqlens_q (N + 1,), cu_seqlens_k (N + 1,)).

    Returns:
        float32 (1|B, Hq, T, S) bias; (Hq,) slopes broadcast over the batch. With `cu_seqlens` the
        batch dim is 1 (the packed batch) and sequence n uses slopes[n].
    """
    if cu_seqlens is None:
        return alibi_from_positions(slopes, jnp.arange(q_len) + (kv_len - q_len), jnp.arange(kv_len))
    slopes = jax.lax.stop_gradient(jnp.asarray(slopes, jnp.float32))  # ALiBi slopes get no gradient
    if slopes.ndim == 1:
        slopes = slopes[None]
    cu_q, cu_k = (jnp.asarray(c, jnp.int32) for c in cu_seqlens)
    seq_q, _ = _sequence_of(cu_q, q_len)
    seq_k, _ = _sequence_of(cu_k, kv_len)
    shift = (jnp.diff(cu_k) - jnp.diff(cu_q))[seq_q]
    rows = (jnp.arange(q_len) - cu_q[seq_q] + shift)[:, None]
    keys = (jnp.arange(kv_len) - cu_k[seq_k])[None, :]
    distance = jnp.abs(rows - keys).astype(jnp.float32)  # (T, S)
    per_row = jnp.broadcast_to(slopes, (cu_q.shape[0] - 1, slopes.shape[-1]))[seq_q]  # (T, Hq)
    return (-per_row.T[:, :, None] * distance[None])[None]


def alibi_from_positions(slopes: jax.Array, q_pos: jax.Array, k_pos: jax.Array, dtype=jnp.float32) -> jax.Array:
    """ALiBi of queries and keys at given positions: -slope * |q_pos[i] - k_pos[j]|.

    For flash-attn's bottom-right distance, q_pos holds each query's position plus S - T. Blocks of
    a longer sequence (ring attention) pass their tokens' global positions.

    Args:
        slopes: (Hq,) or (B, Hq) slopes (no gradient flows to them).
        q_pos: (T,) integer query positions; k_pos: (S,) integer key positions.
        dtype: float dtype of the result (float32, or float64 for a float64 computation).

    Returns:
        (1|B, Hq, T, S) bias in `dtype`.
    """
    slopes = jax.lax.stop_gradient(jnp.asarray(slopes, dtype))
    if slopes.ndim == 1:
        slopes = slopes[None]
    distance = jnp.abs(q_pos[:, None] - k_pos[None, :]).astype(dtype)
    return -slopes[:, :, None, None] * distance[None, None]
