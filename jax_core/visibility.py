"""Which keys each query sees from positions: the one implementation of the positional rule.

Shape legend: T query length, S key length, B batch (sequences of a cache), N packed sequences.

`Visibility` holds the static part of the rule (hashable: part of a trace or a plan key):
causality, its alignment and a sliding window (left, right), -1 meaning unbounded on that side.
Query i sits at diagonal position p(i) = i + offset, offset = 0 (top-left alignment) or S - T
(bottom-right alignment), and sees key j iff

    causal:       j <= p(i)
    left >= 0:    j >= p(i) - left
    right >= 0:   j <= p(i) + right

    top_left, T=3, S=5          bottom_right, T=3, S=5          bottom_right, window (1, -1)
        k: 0 1 2 3 4                k: 0 1 2 3 4                    k: 0 1 2 3 4
    q0     x . . . .            q0     x x x . .                q0     . x x . .
    q1     x x . . .            q1     x x x x .                q1     . . x x .
    q2     x x x . .            q2     x x x x x                q2     . . . x x

The same rule in the forms its users need:

* `dense(T, S)`: the (T, S) bool array.
* `varlen_dense(cu_q, cu_k, T, S)`: N sequences packed back to back; the rule applies per sequence
  with positions local to it and offset len_k(n) - len_q(n) (bottom-right); rows and columns
  outside [cu[0], cu[N]) see nothing.
* `cache_dense(lengths, starts, T, S)`: T new queries against a KV cache of capacity S (decode's
  convention): only positions in [start, length) exist, and query t sits at
  length - T + t (bottom-right: the last query is the last position written) or, top-left,
  length - S + t (query t at position t when the cache is full); the kernels take that shift as
  `pos_shift` (`cache_pos_shift`).
* `band(T, S)`: the rule as lo <= j - i <= hi (`Band`), what block kernels test;
  `flash_settings(T, S)`: the flash kernels' (causal, diag_offset, window) arguments.
* `features(T, S)`: the capability names (`capabilities.FEATURES`) a call with this rule needs.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp

CausalAlignment = Literal["top_left", "bottom_right"]
ALIGNMENTS = ("top_left", "bottom_right")
NO_WINDOW = (-1, -1)


class Band(NamedTuple):
    """Keys j visible from query row i: lo <= j - i <= hi; None means unbounded on that side."""

    lo: Optional[int] = None
    hi: Optional[int] = None


FULL = Band(None, None)


def _window_pair(window, name: str = "window") -> tuple[int, int]:
    """(left, right) ints >= -1 (None: (-1, -1)), or a ValueError naming the argument `name`."""
    if window is None:
        return NO_WINDOW
    try:
        left, right = (operator.index(w) for w in window)
    except (TypeError, ValueError):
        left = right = None
    if left is None or left < -1 or right < -1:
        raise ValueError(f"{name}={window!r}: expected (left, right) ints >= -1 (-1: unbounded on that side) "
                         "or None for no window.")
    return (int(left), int(right))


@dataclasses.dataclass(frozen=True)
class Visibility:
    """The positional visibility rule of one call (module docstring).

    Attributes:
        causal: keys after the query's diagonal position are hidden.
        alignment: "top_left" (p(i) = i, torch's is_causal) or "bottom_right" (p(i) = i + S - T,
            KV-cache / flash-attn style). It places the window too, with or without causality.
        window: (left, right) keys visible around p(i); -1 = unbounded; (-1, -1) = no window.
    """

    causal: bool = False
    alignment: CausalAlignment = "top_left"
    window: tuple[int, int] = NO_WINDOW

    def __post_init__(self):
        if not isinstance(self.causal, bool):
            raise ValueError(f"causal={self.causal!r}: expected a bool.")
        if self.alignment not in ALIGNMENTS:
            raise ValueError(f"alignment={self.alignment!r}: expected 'top_left' or 'bottom_right'.")
        object.__setattr__(self, "window", _window_pair(self.window))

    @classmethod
    def of(cls, causal=False, causal_alignment: CausalAlignment = "top_left",
           sliding_window: Optional[tuple[int, int]] = None) -> "Visibility":
        """From `attention()`'s arguments (sliding_window None: no window); errors name them."""
        if causal_alignment not in ALIGNMENTS:
            raise ValueError(f"causal_alignment={causal_alignment!r}: expected 'top_left' or 'bottom_right'.")
        return cls(causal=bool(causal), alignment=causal_alignment,
                   window=_window_pair(sliding_window, "sliding_window"))

    @property
    def windowed(self) -> bool:
        return self.window != NO_WINDOW

    @property
    def restricts(self) -> bool:
        """Whether the rule hides any key at all (causality or a bounded window side)."""
        return self.causal or self.windowed

    # --- the rule in kernel terms ------------------------------------------------------------------

    def diag_offset(self, q_len, kv_len):
        """p(i) - i: S - T bottom-right, else 0 (symbolic sizes stay symbolic)."""
        return kv_len - q_len if self.alignment == "bottom_right" else 0

    def band(self, q_len, kv_len) -> Band:
        """The rule as lo <= j - i <= hi for a (T, S) call (None: unbounded)."""
        offset = self.diag_offset(q_len, kv_len)
        left, right = self.window
        lo = None if left < 0 else offset - left
        hi = None if right < 0 else offset + right
        if self.causal:
            hi = offset if hi is None else offset + min(right, 0)
        return Band(lo, hi)

    def flash_settings(self, q_len, kv_len, *, varlen: bool = False) -> dict:
        """The flash kernels' (`FlashConfig`) causal, diag_offset, window and varlen_bottom_right.

        Packed sequences (varlen) align per sequence inside the kernels (VARLEN_BOTTOM_RIGHT),
        never by the packed lengths' S - T.
        """
        bottom_right = self.alignment == "bottom_right"
        return dict(causal=self.causal, diag_offset=0 if varlen else self.diag_offset(q_len, kv_len),
                    window=self.window, varlen_bottom_right=bottom_right and varlen)

    def cache_pos_shift(self, q_len, capacity) -> int:
        """The decode kernels' pos_shift: query t of a cache sits at length - T + t + pos_shift."""
        return 0 if self.alignment == "bottom_right" else q_len - capacity

    def features(self, q_len, kv_len, *, varlen: bool = False) -> frozenset:
        """Capability names this rule needs on a (T, S) call ("causal", "causal_bottom_right",
        "sliding_window"). Bottom-right differs from top-left only when T != S, or per packed
        sequence (varlen), where each sequence may have T != S."""
        shifted = self.alignment == "bottom_right" and (q_len != kv_len or varlen)
        out = set()
        if self.causal:
            out.add("causal_bottom_right" if shifted else "causal")
        elif shifted and self.windowed:
            out.add("causal_bottom_right")  # the window follows the bottom-right diagonal
        if self.windowed:
            out.add("sliding_window")
        return frozenset(out)

    # --- dense arrays ------------------------------------------------------------------------------

    def visible(self, key_pos: jax.Array, query_pos: jax.Array) -> jax.Array:
        """Elementwise: a key at key_pos is visible from a query at diagonal position query_pos
        (broadcastable integer arrays)."""
        d = key_pos - query_pos
        out = jnp.ones(d.shape, bool)
        left, right = self.window
        if self.causal:
            out &= d <= 0
        if left >= 0:
            out &= d >= -left
        if right >= 0:
            out &= d <= right
        return out

    def dense(self, q_len: int, kv_len: int) -> jax.Array:
        """(T, S) bool, True = visible."""
        pos = jnp.arange(q_len)[:, None] + self.diag_offset(q_len, kv_len)
        return self.visible(jnp.arange(kv_len)[None, :], pos)

    def varlen_dense(self, cu_seqlens_q: jax.Array, cu_seqlens_k: jax.Array, q_len: int, kv_len: int) -> jax.Array:
        """(Tq, Tk) bool for N sequences packed back to back (module docstring).

        Args:
            cu_seqlens_q, cu_seqlens_k: (N + 1,) integer cumulative lengths, non-decreasing (may be traced).
            q_len, kv_len: the packed lengths Tq and Tk (static).
        """
        cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
        seq_q, in_q = sequence_of(cu_q, q_len)
        seq_k, in_k = sequence_of(cu_k, kv_len)
        same = (seq_q[:, None] == seq_k[None, :]) & in_q[:, None] & in_k[None, :]
        if not self.restricts:
            return same
        pos = jnp.arange(q_len) - cu_q[seq_q]
        if self.alignment == "bottom_right":
            pos = pos + (jnp.diff(cu_k) - jnp.diff(cu_q))[seq_q]
        key = jnp.arange(kv_len) - cu_k[seq_k]
        return same & self.visible(key[None, :], pos[:, None])

    def cache_dense(self, lengths: jax.Array, starts: Optional[jax.Array], q_len: int, capacity: int, *,
                    pos_shift: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
        """(B, T, S) bool visibility of T new queries against caches of capacity S, and (B, S) bool
        `written`: position j in [start, length). Lengths are clamped to S, starts to 0.

        Args:
            lengths: (B,) integer valid lengths (exclusive end); starts: (B,) first valid positions or None (0).
            pos_shift: query t sits at length - T + t + pos_shift; None: `cache_pos_shift(T, S)`.
        """
        shift = self.cache_pos_shift(q_len, capacity) if pos_shift is None else pos_shift
        length = jnp.minimum(lengths.astype(jnp.int32), capacity)[:, None, None]
        start = jnp.zeros_like(length) if starts is None else jnp.maximum(starts.astype(jnp.int32), 0)[:, None, None]
        j = jnp.arange(capacity, dtype=jnp.int32)[None, None, :]
        pos = cache_positions(lengths, q_len, capacity, shift)[:, :, None]
        written = (j >= start) & (j < length)
        return written & self.visible(j, pos), written[:, 0]


def cache_positions(lengths: jax.Array, q_len: int, capacity: int, pos_shift: int = 0) -> jax.Array:
    """(B, T) int32 positions of T new queries in caches of capacity S: length - T + t + pos_shift,
    lengths clamped to S (the last query is the last position written when pos_shift = 0)."""
    length = jnp.minimum(lengths.astype(jnp.int32), capacity)[:, None]
    return length - q_len + pos_shift + jnp.arange(q_len, dtype=jnp.int32)[None, :]


def band_flash_settings(band: Band) -> tuple[bool, int, tuple[int, int]]:
    """(causal, diag_offset, window) that make the flash kernels' rule (relative to row i, top-left)
    keep exactly lo <= j - i <= hi."""
    lo, hi = band
    if hi is not None:  # j <= i + hi, and with lo: j >= i + hi - (hi - lo)
        return True, hi, ((hi - lo) if lo is not None else -1, -1)
    if lo is not None:  # j >= i + lo
        return False, lo, (0, -1)
    return False, 0, NO_WINDOW


def sequence_of(cu_seqlens: jax.Array, length: int) -> tuple[jax.Array, jax.Array]:
    """For rows 0..length-1 of a packed axis: (sequence index n, row in [cu[0], cu[N]))."""
    rows = jnp.arange(length)
    seq = jnp.searchsorted(cu_seqlens[1:], rows, side="right")  # cu[n] <= row < cu[n + 1]
    inside = (rows >= cu_seqlens[0]) & (rows < cu_seqlens[-1])
    return jnp.minimum(seq, cu_seqlens.shape[0] - 2), inside
