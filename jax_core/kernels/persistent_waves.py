"""How a persistent grid of the Hopper kernels (flash_fwd_mgpu.py, flash_bwd_mgpu.py) deals its work
items to its programs. Imports only JAX.

The caller numbers its items longest first (the forward: query tiles, last rows first; the backward:
key blocks, first keys first, the longest causal walks). `Waves` deals them in waves of `programs`,
each wave in the opposite direction of the last: a program that took one of the longest items of a
wave takes one of the shortest of the next, so the programs' totals stay level (dealt in one
direction, the first program would take the longest item of every wave: about 10% more work than
the last at (1, 16, 16384) causal in the forward).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


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
        return jnp.where(lax.rem(wave, 2) == 0, program, (self.programs - 1) - program)

    def count(self, program):
        """How many items `program` walks: one per whole wave, and one of the last, partial wave if
        its place there is among the items left."""
        waves, left = divmod(self.total, self.programs)
        return jnp.int32(waves) + (self._position(program, jnp.int32(waves)) < left).astype(jnp.int32)

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


def waves(total: int, programs: Optional[int]) -> Waves:
    """`Waves` of `total` items; `programs`: None (one program per item) or a positive int (at most
    one per item is used). Raises ValueError naming `programs` otherwise."""
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, numbers.Integral)
                                 or programs < 1):
        raise ValueError(f"programs={programs!r}: expected None (one program per item of work) or a positive "
                         "int; hint: the GPU's multiprocessor count makes the grid persistent")
    return Waves(total=int(total), programs=int(total) if programs is None else min(int(programs), int(total)))
