"""Masks from positions, segment ids and varlen packing, and ALiBi biases, as JAX arrays.

The positional rule itself (causal alignment, sliding window, per-sequence positions of packed
sequences) lives in `visibility.Visibility`, with its shape legend and diagrams;
`positional_mask` and `varlen_mask` are its dense forms in `attention()`'s argument names.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .visibility import CausalAlignment, Visibility, sequence_of


def positional_mask(
    q_len: int,
    kv_len: int,
    *,
    causal: bool,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
) -> Optional[jax.Array]:
    """(T, S) bool mask (True = visible) from causality and a sliding window, or None if all visible.

    The window (left, right) keeps keys j with p(i) - left <= j <= p(i) + right (-1: unbounded),
    p(i) the diagonal position of query i (`Visibility`); with `causal`, right is 0.
    """
    rule = Visibility.of(causal, causal_alignment, sliding_window)
    return rule.dense(q_len, kv_len) if rule.restricts else None


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


def varlen_rows(cu_seqlens: jax.Array, length: int) -> jax.Array:
    """(length,) bool: rows of a packed axis that belong to a sequence, i.e. in [cu[0], cu[N])."""
    return sequence_of(jnp.asarray(cu_seqlens, jnp.int32), length)[1]


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
    rule = Visibility.of(causal, causal_alignment, sliding_window)
    return rule.varlen_dense(cu_seqlens_q, cu_seqlens_k, q_len, kv_len)[None, None]


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
    seq_q, _ = sequence_of(cu_q, q_len)
    seq_k, _ = sequence_of(cu_k, kv_len)
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
