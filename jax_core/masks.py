"""Visibility masks built from positions (causal alignment, sliding window).

Shape legend: T query length, S key length. Query i sits at diagonal position
p(i) = i (top-left alignment) or i + S - T (bottom-right alignment):

    top_left, T=3, S=5          bottom_right, T=3, S=5
        k: 0 1 2 3 4                k: 0 1 2 3 4
    q0     x . . . .            q0     x x x . .
    q1     x x . . .            q1     x x x x .
    q2     x x x . .            q2     x x x x x
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
