"""How a persistent grid of the Hopper kernels (flash_fwd_mgpu.py, flash_bwd_mgpu.py) deals its work
items to its programs. Imports only JAX and NumPy.

The caller numbers its items longest first (the forward: query tiles, last rows first; the backward:
key blocks, first keys first, the longest causal walks). `Waves` deals them in waves of `programs`,
each wave in the opposite direction of the last: a program that took one of the longest items of a
wave takes one of the shortest of the next, so the programs' totals stay level (dealt in one
direction, the first program would take the longest item of every wave: about 10% more work than
the last at (1, 16, 16384) causal in the forward).

Items are numbered block by block over `columns` columns (heads), so one wave dealt that way holds a
few blocks of every head, and the programs working at once read the K and V (forward) or Q, dO and
dQ (backward) of every head: far more than L2 holds, so each wave read them from DRAM again (the
head-dim-128 forward at (2, 16, 8192) read 1156 MB where its inputs are 201 MB, the backward 2581 MB
and wrote 1356 MB). `GroupedWaves` therefore takes the columns a few at a time (a group: the fewest
whose items fill a wave of programs and keep the totals level, `l2_group`) and deals each group's items in waves as above, the groups one
after another, every second one mirrored (program p in the place of programs - 1 - p, so that the
programs short of an item in one group are first in the next). The programs working at once then
share the data of a group's heads, which L2 serves to all of them from one read. Where a group that
fills a wave holds more than `L2_GROUP_BYTES` of that shared data (the GQA backward: each item walks
several query heads' Q, dO and dQ), the fewest columns that keep the totals level are taken instead,
even if a group's wave then leaves a few programs without an item.
"""

from __future__ import annotations

import functools
import numbers
from typing import NamedTuple, Optional, Union

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl


# The dealing's arithmetic runs traced in the kernels and on NumPy arrays when `l2_group` weighs
# groupings at trace time (eager JAX ops would compile once per shape there). Operands are never
# negative, so truncating and flooring division agree.
def _on_host(*xs) -> bool:
    return all(isinstance(x, (numbers.Integral, np.integer, np.ndarray, np.bool_)) for x in xs)


def _div(a, b):
    return np.floor_divide(a, b) if _on_host(a, b) else lax.div(a, b)


def _rem(a, b):
    return np.remainder(a, b) if _on_host(a, b) else lax.rem(a, b)


def _where(c, a, b):
    return np.where(c, a, b) if _on_host(c, a, b) else jnp.where(c, a, b)


def _int32(x):
    return np.asarray(x, np.int32) if _on_host(x) else jnp.asarray(x).astype(jnp.int32)


class Waves(NamedTuple):
    """`total` items dealt to `programs` programs (at most one per item)."""
    total: int
    programs: int

    @property
    def per_program(self) -> int:
        """The most items one program walks."""
        return pl.cdiv(self.total, self.programs)

    def _position(self, program, wave):
        """`program`'s place in a wave: its index in even waves, counted from the end in odd ones."""
        return _where(_rem(wave, 2) == 0, program, (self.programs - 1) - program)

    def count(self, program):
        """How many items `program` walks: one per whole wave, and one of the last, partial wave if
        its place there is among the items left."""
        waves, left = divmod(self.total, self.programs)
        return waves + _int32(self._position(program, waves) < left)

    def item(self, program, j):
        """The number of `program`'s j-th item (dealt in wave j)."""
        return j * self.programs + self._position(program, j)


class DealtWork:
    """What a kernel's work description (a frozen dataclass with a `waves` field that deals its
    items) answers about its programs."""

    @property
    def programs(self) -> int:
        return self.waves.programs

    @property
    def per_program(self) -> int:
        """The most items one program walks."""
        return self.waves.per_program

    def count(self, program):
        """How many items `program` walks."""
        return self.waves.count(program)

    def block_batch_column(self, program, j, batch, columns):
        """(block, batch index, column) of `program`'s j-th item, for items numbered block by block
        and, within a block, batch by batch over `columns` columns (heads)."""
        t = self.waves.item(program, j)
        pairs = jnp.int32(batch * columns)
        pair = lax.rem(t, pairs)
        return lax.div(t, pairs), lax.div(pair, jnp.int32(columns)), lax.rem(pair, jnp.int32(columns))


class GroupedWaves(NamedTuple):
    """`columns * blocks` items (numbered block by block over `columns` columns) dealt to `programs`
    programs `group` columns at a time (`group` divides `columns`): each group's `group * blocks`
    items in waves (`Waves`, numbered block by block over the group's columns), the groups in turn,
    odd groups mirrored."""
    columns: int
    blocks: int
    programs: int
    group: int

    @property
    def total(self) -> int:
        return self.columns * self.blocks

    @property
    def _within(self) -> Waves:
        """One group's dealing (it may hold fewer items than there are programs)."""
        return Waves(total=self.group * self.blocks, programs=self.programs)

    def _counts(self, program, mirrored):
        """(items `program` walks in an even group, in an odd one)."""
        within = self._within
        return within.count(program), within.count(mirrored)

    def count(self, program):
        """How many items `program` walks."""
        even, odd = self._counts(program, (self.programs - 1) - program)
        groups = self.columns // self.group
        return (groups // 2) * (even + odd) + (groups % 2) * even

    @property
    def per_program(self) -> int:
        """The most items one program walks."""
        return int(np.max(self.count(np.arange(self.programs, dtype=np.int32))))

    def item(self, program, j):
        """The number of `program`'s j-th item: it walks its even group's items first, then its odd
        group's, pair of groups after pair."""
        mirrored = (self.programs - 1) - program
        even, odd = self._counts(program, mirrored)
        pair = _where(even + odd > 0, even + odd, 1)  # 0 only for a program with no items (never asked)
        pairs, r = _div(j, pair), _rem(j, pair)
        in_odd = r >= even
        group = 2 * pairs + _int32(in_odd)
        t = self._within.item(_where(in_odd, mirrored, program), _where(in_odd, r - even, r))
        return _div(t, self.group) * self.columns + group * self.group + _rem(t, self.group)


Dealing = Union[Waves, GroupedWaves]


#: Bytes of shared data (see `waves`' `column_bytes`) above which a group is chosen by balance alone,
#: below an H100's or H200's 50 MB of L2 with room for the items' own blocks. Backward alone, causal
#: bf16, H200 (BENCHMARKS.md "The persistent grids' dealing and DRAM"): at (1, 8192, 32/8 heads, 64)
#: a group of 4 KV heads (64 MB of Q, dO and float32 dQ) read 205 MB from DRAM and took 1537-1566 µs
#: under sustained load, one of 2 (32 MB) read 159 MB and took 1480-1508 µs; without GQA no
#: wave-filling group reaches this size at the measured shapes.
L2_GROUP_BYTES = 40 << 20


@functools.lru_cache(maxsize=None)
def l2_group(columns: int, blocks: int, programs: int, column_bytes: int = 0) -> int:
    """The columns `waves` deals at a time: the fewest that divide `columns`, whose items fill a wave
    of `programs` and that keep the programs' causal totals within 1% of the ungrouped waves' balance
    (a small group, or an odd count of groups, can leave some programs an item more); `columns`
    (no grouping) if none does. Where that group shares more than `L2_GROUP_BYTES` (`column_bytes`
    a column), the fewest columns that keep the totals level, full waves or not."""
    level = _causal_imbalance(Waves(total=columns * blocks, programs=programs), columns, blocks)

    def level_with(g):
        return _causal_imbalance(GroupedWaves(columns=columns, blocks=blocks, programs=programs, group=g),
                                 columns, blocks) <= level + 0.01
    divisors = [g for g in range(1, columns) if columns % g == 0]
    filling = next((g for g in divisors if g * blocks >= programs and level_with(g)), columns)
    if filling * column_bytes <= L2_GROUP_BYTES:
        return filling
    return next((g for g in divisors if g < filling and level_with(g)), filling)


def _causal_imbalance(dealing: Dealing, columns: int, blocks: int) -> float:
    """The busiest program's work over the mean, an item of block b walking blocks - b blocks (the
    kernels number the longest causal walks first)."""
    program = np.arange(dealing.programs, dtype=np.int32)[:, None]
    j = np.arange(dealing.per_program, dtype=np.int32)[None, :]
    walks = np.where(j < dealing.count(program), blocks - dealing.item(program, j) // columns, 0)
    totals = walks.sum(axis=1)
    return float(totals.max() / totals.mean())


def waves(total: int, programs: Optional[int], columns: int = 1, column_bytes: int = 0) -> Dealing:
    """The dealing of `total` items numbered block by block over `columns` columns: `Waves`, or
    `GroupedWaves` where a persistent grid can take the columns a few at a time. `programs`: None
    (one program per item) or a positive int (at most one per item is used). `column_bytes`: the
    bytes of data a column's items share (read or added to by each of them), which decides how
    few columns a group takes (`l2_group`). Raises ValueError naming `programs` otherwise."""
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, numbers.Integral)
                                 or programs < 1):
        raise ValueError(f"programs={programs!r}: expected None (one program per item of work) or a positive "
                         "int; hint: the GPU's multiprocessor count makes the grid persistent")
    if total % columns:
        raise ValueError(f"columns={columns}: expected a divisor of the {total} items (numbered block by block "
                         "over the columns); hint: pass the batch size times the heads")
    total, columns = int(total), int(columns)
    plain = Waves(total=total, programs=total if programs is None else min(int(programs), total))
    if programs is None:
        return plain
    group = l2_group(columns, total // columns, plain.programs, int(column_bytes))
    if group == columns:
        return plain
    return GroupedWaves(columns=columns, blocks=total // columns, programs=plain.programs, group=group)
