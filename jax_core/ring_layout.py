"""Sequence layouts for ring attention, their permutations, and the per-step work plan.

A sequence of length L (a multiple of n, or of 2n for zigzag) is split over n devices of a ring:

    contiguous: device d holds positions [d L/n, (d + 1) L/n).
    zigzag:     the sequence is cut into 2n chunks of C = L / (2n); device d holds chunks d and
                2n - 1 - d (head and tail), so under a causal mask every device has the same work.
    striped:    device d holds positions d, d + n, d + 2n, ... (every n-th token).

    L = 8, n = 2      device 0        device 1
    contiguous        0 1 2 3         4 5 6 7
    zigzag            0 1 6 7         2 3 4 5
    striped           0 2 4 6         1 3 5 7

`layout_permutation` gives the gather order that turns a natural-order sequence into the
concatenation of the devices' shards; `to_layout` / `from_layout` apply it and its inverse to whole
arrays, `to_layout_sharded` / `from_layout_sharded` do the same inside `shard_map` with collectives
(no device ever holds more than its shard).

Work plan: at ring step t, device r holds the key/value block of device j = (r - t) mod n. The
global visibility rule lo <= key_pos - query_pos <= hi (`GlobalBand`: causal is (None, 0), a sliding
window (left, right) is (-left, right)) becomes, per pair of position runs ("slots") of the two
shards, a `Band` in local coordinates, which is empty, full or partial. `plan_step` groups the
non-empty pairs into as few rectangular pieces as possible; the distinct piece lists over all r are
the branches of a `lax.switch` indexed by the device's position in the ring, so every kernel call
sees static shapes and masks, and fully masked blocks are never computed.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from .visibility import FULL, Band, Visibility

Layout = Literal["contiguous", "zigzag", "striped"]
LAYOUTS = ("contiguous", "zigzag", "striped")


def _check(length: int, n: int, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}.")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: expected a positive number of devices.")
    unit = 2 * n if layout == "zigzag" else n
    if length % unit:
        raise ValueError(f"sequence length {length} is not a multiple of {unit} (layout={layout!r} on {n} devices); "
                         "pad the sequence first.")


def length_multiple(n: int, layout: str, from_natural_shards: bool = False) -> int:
    """The sequence lengths a layout accepts are multiples of this. `from_natural_shards`: the
    sequence arrives as natural contiguous shards and is permuted with collectives
    (`to_layout_sharded`), which for striped needs n tokens of each shard per device (n * n)."""
    if layout == "zigzag":
        return 2 * n
    return n * n if layout == "striped" and from_natural_shards else n


def layout_permutation(length: int, n: int, layout: Layout) -> np.ndarray:
    """(length,) int: natural position of the token at each index of the concatenated shards."""
    _check(length, n, layout)
    pos = np.arange(length)
    if layout == "contiguous":
        return pos
    if layout == "striped":
        return pos.reshape(length // n, n).T.reshape(-1)
    chunks = pos.reshape(2 * n, length // (2 * n))
    return np.concatenate([np.concatenate([chunks[d], chunks[2 * n - 1 - d]]) for d in range(n)])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv


def to_layout(x: jax.Array, n: int, layout: Layout, axis: int = 1) -> jax.Array:
    """Reorders the natural-order sequence axis of `x` so that equal splits are the layout's shards."""
    return jnp.take(x, jnp.asarray(layout_permutation(x.shape[axis], n, layout)), axis=axis)


def from_layout(x: jax.Array, n: int, layout: Layout, axis: int = 1) -> jax.Array:
    """Inverse of `to_layout`."""
    perm = inverse_permutation(layout_permutation(x.shape[axis], n, layout))
    return jnp.take(x, jnp.asarray(perm), axis=axis)


def shard_positions(layout: Layout, n: int, local_len: int, device: int) -> np.ndarray:
    """Natural positions of the `local_len` tokens device `device` holds."""
    return layout_permutation(local_len * n, n, layout)[device * local_len:(device + 1) * local_len]


def positions_of_device(layout: Layout, n: int, local_len: int, device: jax.Array) -> jax.Array:
    """(local_len,) int32 natural positions of a shard (as `shard_positions`) for a device index
    that may be traced (`lax.axis_index` inside `shard_map`): arithmetic, no table of the sequence."""
    i = jnp.arange(local_len, dtype=jnp.int32)
    device = jnp.asarray(device, jnp.int32)
    if layout == "contiguous":
        return device * local_len + i
    if layout == "striped":
        return device + n * i
    c = local_len // 2  # zigzag: chunk `device` (head), then chunk 2n - 1 - device (tail)
    return jnp.where(i < c, device * c + i, (2 * n - 1 - device) * c + (i - c))


# --- the same permutations inside shard_map -------------------------------------------------------


def _swap_halves_by_parity(a, b, axis_name):
    """(a, b) on even devices, (b, a) on odd ones."""
    odd = jax.lax.axis_index(axis_name) % 2 == 1
    return jnp.where(odd, b, a), jnp.where(odd, a, b)


def to_layout_sharded(x: jax.Array, axis_name: str, n: int, layout: Layout, axis: int = 1) -> jax.Array:
    """Inside `shard_map`: the local contiguous shard of a natural-order sequence -> this device's
    shard of `layout`. Uses collectives only (`ppermute` for zigzag, `all_to_all` for striped)."""
    if layout == "contiguous" or n == 1:
        return x
    local = x.shape[axis]
    if layout == "striped":  # token a*n + m of the shard goes to device m, at local row (r*local + a*n + m) // n
        if local % n:
            raise ValueError(f"striped from natural shards needs shard lengths that are multiples of n={n}, "
                             f"got {local} (a sequence length that is a multiple of n * n = {n * n}).")
        parts = x.reshape(*x.shape[:axis], local // n, n, *x.shape[axis + 1:])
        moved = jax.lax.all_to_all(parts, axis_name, split_axis=axis + 1, concat_axis=axis + 1, tiled=False)
        # moved[..., a, r, ...] = token a*n + m of device r's shard: striped local index r * local/n + a
        moved = jnp.swapaxes(moved, axis, axis + 1)
        return moved.reshape(x.shape)
    _check(local * n, n, "zigzag")
    half = local // 2
    first, second = jnp.split(x, 2, axis=axis)  # chunks 2r and 2r + 1
    dest = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731  (the device holding chunk c)
    even = jax.lax.ppermute(first, axis_name, [(r, dest(2 * r)) for r in range(n)])
    odd = jax.lax.ppermute(second, axis_name, [(r, dest(2 * r + 1)) for r in range(n)])
    # device d holds chunks d (head) and 2n-1-d (tail): on even d the head is the even chunk
    head, tail = _swap_halves_by_parity(even, odd, axis_name)
    del half
    return jnp.concatenate([head, tail], axis=axis)


def from_layout_sharded(x: jax.Array, axis_name: str, n: int, layout: Layout, axis: int = 1) -> jax.Array:
    """Inverse of `to_layout_sharded`."""
    if layout == "contiguous" or n == 1:
        return x
    local = x.shape[axis]
    if layout == "striped":
        parts = x.reshape(*x.shape[:axis], n, local // n, *x.shape[axis + 1:])
        parts = jnp.swapaxes(parts, axis, axis + 1)  # (.., a, r, ..)
        moved = jax.lax.all_to_all(parts, axis_name, split_axis=axis + 1, concat_axis=axis + 1, tiled=False)
        return moved.reshape(x.shape)
    head, tail = jnp.split(x, 2, axis=axis)
    even, odd = _swap_halves_by_parity(head, tail, axis_name)
    dest = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731
    first = jax.lax.ppermute(even, axis_name, [(dest(2 * r), r) for r in range(n)])
    second = jax.lax.ppermute(odd, axis_name, [(dest(2 * r + 1), r) for r in range(n)])
    return jnp.concatenate([first, second], axis=axis)


# --- work plan -------------------------------------------------------------------------------------


class GlobalBand(NamedTuple):
    """lo <= key_position - query_position <= hi in natural positions (None: unbounded)."""

    lo: Optional[int] = None
    hi: Optional[int] = None


class Slot(NamedTuple):
    """A run of a shard: local rows [start, start + length) hold positions pos, pos + stride, ..."""

    start: int
    length: int
    pos: int
    stride: int


class Piece(NamedTuple):
    """One kernel call: local query rows [q_start, q_start + q_len) against rows
    [k_start, k_start + k_len) of the key/value block in hand, with `band` in piece coordinates."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    band: Band


EMPTY = "empty"


def slots(layout: Layout, n: int, local_len: int, device: int) -> tuple[Slot, ...]:
    """The position runs of a device's shard."""
    if layout == "contiguous":
        return (Slot(0, local_len, device * local_len, 1),)
    if layout == "striped":
        return (Slot(0, local_len, device, n),)
    c = local_len // 2
    return (Slot(0, c, device * c, 1), Slot(c, c, (2 * n - 1 - device) * c, 1))


def normalize(band: Band, lq: int, lk: int):
    """`band` restricted to an lq x lk rectangle (j - i in [-(lq - 1), lk - 1]): EMPTY, or a Band
    whose bounds are None where the rectangle does not reach them."""
    lo, hi = band
    if (lo is not None and lo > lk - 1) or (hi is not None and hi < -(lq - 1)) or (
            lo is not None and hi is not None and lo > hi):
        return EMPTY
    return Band(None if lo is None or lo <= -(lq - 1) else lo, None if hi is None or hi >= lk - 1 else hi)


def pair_band(qs: Slot, ks: Slot, rule: GlobalBand) -> Band:
    """The global rule between two slots, in their local coordinates (not normalised)."""
    if rule.lo is None and rule.hi is None:
        return FULL
    if qs.stride != ks.stride:
        raise ValueError("slots of different strides cannot be paired under a positional mask.")
    s, delta = qs.stride, ks.pos - qs.pos  # key_pos - query_pos = s (j - i) + delta
    lo = None if rule.lo is None else -((delta - rule.lo) // s)  # ceil((lo - delta) / s)
    hi = None if rule.hi is None else (rule.hi - delta) // s  # floor((hi - delta) / s)
    return Band(lo, hi)


def _shift(band: Band, by: int) -> Band:
    return Band(None if band.lo is None else band.lo + by, None if band.hi is None else band.hi + by)


def _group(q_slots, k_slots, bands) -> Optional[list[Piece]]:
    """One piece covering the given slots (adjacent in memory), or [] if all empty, or None if no
    single band describes their visibility."""
    q0, k0 = q_slots[0].start, k_slots[0].start
    lq = sum(s.length for s in q_slots)
    lk = sum(s.length for s in k_slots)
    subs = [(qs, ks, normalize(bands[(qs.start, ks.start)], qs.length, ks.length)) for qs in q_slots for ks in k_slots]
    if all(b == EMPTY for _, _, b in subs):
        return []
    candidates = [FULL] + [_shift(bands[(qs.start, ks.start)], (ks.start - k0) - (qs.start - q0))
                           for qs, ks, b in subs if b != EMPTY]
    for cand in candidates:
        if all(normalize(_shift(cand, (qs.start - q0) - (ks.start - k0)), qs.length, ks.length) == b
               for qs, ks, b in subs):
            band = normalize(cand, lq, lk)
            return [Piece(q0, lq, k0, lk, band)]
    return None


def plan_pieces(q_slots, k_slots, rule: GlobalBand) -> tuple[Piece, ...]:
    """The fewest pieces (whole block; per query slot; per key slot; per pair) covering the
    visible part of one (query shard, key/value block) pair."""
    bands = {(qs.start, ks.start): pair_band(qs, ks, rule) for qs in q_slots for ks in k_slots}
    groupings = [
        [(q_slots, k_slots)],
        [((qs,), k_slots) for qs in q_slots],
        [(q_slots, (ks,)) for ks in k_slots],
        [((qs,), (ks,)) for qs in q_slots for ks in k_slots],
    ]
    best = None
    for grouping in groupings:
        pieces = []
        for qg, kg in grouping:
            got = _group(qg, kg, bands)
            if got is None:
                break
            pieces += got
        else:
            if best is None or len(pieces) < len(best):
                best = pieces
    return tuple(best)


class StepPlan(NamedTuple):
    """Ring step t: `branches[index[r]]` is the piece list device r computes."""

    branches: tuple[tuple[Piece, ...], ...]
    index: tuple[int, ...]


def plan_step(t: int, n: int, layout: Layout, q_local: int, kv_local: int, rule: GlobalBand) -> StepPlan:
    """The plan of ring step t (device r holds the block of device (r - t) mod n)."""
    branches, index = [], []
    for r in range(n):
        j = (r - t) % n
        pieces = plan_pieces(slots(layout, n, q_local, r), slots(layout, n, kv_local, j), rule)
        if pieces not in branches:
            branches.append(pieces)
        index.append(branches.index(pieces))
    return StepPlan(tuple(branches), tuple(index))


def work_per_device(n: int, layout: Layout, q_local: int, kv_local: int, rule: GlobalBand) -> list[int]:
    """Visible (query, key) pairs each device computes over the whole ring (for load-balance checks)."""
    def area(p: Piece) -> int:
        lo = -(p.q_len - 1) if p.band.lo is None else p.band.lo
        hi = p.k_len - 1 if p.band.hi is None else p.band.hi
        return sum(max(0, min(p.k_len - 1, i + hi) - max(0, i + lo) + 1) for i in range(p.q_len))

    work = [0] * n
    for t in range(n):
        plan = plan_step(t, n, layout, q_local, kv_local, rule)
        for r in range(n):
            work[r] += sum(area(p) for p in plan.branches[plan.index[r]])
    return work


def rule_for(causal: bool, sliding_window: Optional[tuple[int, int]]) -> GlobalBand:
    """The GlobalBand of a causal flag and a (left, right) window (-1: unbounded)."""
    return GlobalBand(*Visibility.of(causal, "top_left", sliding_window).band(0, 0))


def default_layout(causal: bool, sliding_window: Optional[tuple[int, int]]) -> Layout:
    """zigzag for a causal mask without a window (balanced work); contiguous otherwise (no mask:
    balanced anyway; a window much shorter than a shard: balanced and fewer kernel variants)."""
    return "zigzag" if causal and sliding_window is None else "contiguous"


def padded_length(length: int, n: int, layout: Layout, from_natural_shards: bool = False) -> int:
    unit = length_multiple(n, layout, from_natural_shards)
    return math.ceil(length / unit) * unit
