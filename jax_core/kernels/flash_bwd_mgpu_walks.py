"""Which query blocks each program of the Hopper backward (`flash_bwd_mgpu.py`) walks, in what order,
and how its items are dealt to the programs. Imports only JAX.

An item is 2 * block_kv keys of one KV head and head split (`_Items`, dealt by `persistent_waves`);
its walk is the query blocks that see some of its keys, per query head of its share of the group
(`_q_range`, `_Walk`). In clusters of two (`cluster=2`) the two programs take adjacent items and step
through the union of their walks together, each skipping the blocks only the other one's keys see
(`_Item.shared`, `_walk_item`). `cfg` is the kernel's settings (`flash_bwd_mgpu._Settings`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .flash_mgpu_checks import COMPUTE_WGS
from .persistent_waves import Dealing, DealtWork


class _Walk(NamedTuple):
    """The query blocks a program walks per query head: [first, first + per_head), of which
    [full_lo, full_hi) see all of its keys (no mask) and the others cross a band edge (masked)."""
    first: object
    full_lo: object
    full_hi: object
    per_head: object


def _q_range(kv_start, cfg, keys=None):
    """The `_Walk` of the program whose keys are [kv_start, kv_start + keys) (default 2 * block_kv).

    Row i sees key j iff i + diag_offset - left <= j <= i + diag_offset + right: rows before
    kv_start - diag_offset - right see none of the program's keys (they all lie right of the band),
    nor do rows after its last real key - diag_offset + left; rows from its last key - diag_offset -
    right on clear the right edge for all of them, rows up to kv_start - diag_offset + left the left."""
    block_q, n = jnp.int32(cfg.block_q), cfg.num_q_blocks
    program_end = kv_start + (COMPUTE_WGS * cfg.block_kv if keys is None else keys)  # one past the last key
    first = jnp.int32(0)
    if cfg.right is not None:
        first = jnp.minimum(lax.div(jnp.maximum(kv_start - (cfg.diag_offset + cfg.right), 0), block_q), n)
    end = jnp.int32(n)
    if cfg.left is not None:
        row_end = jnp.minimum(program_end, cfg.kv_len) + (cfg.left - cfg.diag_offset)  # rows < this see a key
        end = jnp.clip(pl.cdiv(jnp.maximum(row_end, 0), block_q), first, n)
    full_lo = first
    if cfg.right is not None:
        full_lo = jnp.clip(pl.cdiv(jnp.maximum(program_end - 1 - (cfg.diag_offset + cfg.right), 0), block_q),
                           first, end)
    full_hi = end
    if cfg.left is not None:
        full_hi = jnp.clip(lax.div(jnp.maximum(kv_start + (cfg.left - cfg.diag_offset) + 1, 0), block_q),
                           full_lo, end)
    if cfg.ragged_end:  # the program holding keys past kv_len masks every block it walks
        full_lo = jnp.where(program_end > cfg.kv_len, end, full_lo)
        full_hi = jnp.maximum(full_hi, full_lo)
    return _Walk(first, full_lo, full_hi, end - first)


@dataclasses.dataclass(frozen=True)
class _Items(DealtWork):
    """The work: one item per (batch, KV head, split, 2 * block_kv keys), numbered key block by key
    block, the first keys (the longest causal walks) first, and dealt by `waves` to the programs (a
    persistent grid, one per multiprocessor, or one program per item)."""
    batch: int
    columns: int  # KV heads times splits
    waves: Dealing

    def at(self, program, j):
        """(batch, column, key block) of `program`'s j-th item (in wave j)."""
        key_block, batch, column = self.block_batch_column(program, j, self.batch, self.columns)
        return batch, column, key_block


class _Item(NamedTuple):
    """One item of a program's work: `2 * block_kv` keys from `kv_start` of KV head `kv_head` in KV
    batch `batch`, against query sources [first_source, first_source + sources_per_item) (split
    `part` of `splits`; the settings' `sources`), whose query blocks `walk` says.

    In a cluster of two programs (`cluster`), the two take adjacent key blocks of one KV head and
    split, and step through the query blocks that either one's keys see (`steps`, the union of
    their walks) together: each step's Q and dO blocks are loaded once, half by each program's TMA,
    and multicast to both. A program skips the steps outside its own `walk`."""
    batch: object
    kv_head: object
    part: object
    first_source: object
    kv_start: object
    walk: _Walk
    shared: _Walk  # the query blocks the cluster steps through (`walk` itself without a cluster)

    def steps(self, cfg):
        """Query blocks stepped through: per source, then source after source."""
        return cfg.sources_per_item * self.shared.per_head

    def block(self, step, cfg):
        """(query batch, query head, first row) of the item's `step`-th query block."""
        per_head = self.shared.per_head
        source = self.first_source + lax.div(step, per_head)
        rows = (self.shared.first + lax.rem(step, per_head)) * cfg.block_q
        if cfg.batches == 1:
            return self.batch, self.kv_head * cfg.group + source, rows
        group = jnp.int32(cfg.group)
        return (self.batch * cfg.batches + lax.div(source, group), self.kv_head * cfg.group + lax.rem(source, group),
                rows)


def _item(program, j, cfg, rank=0):
    """`program`'s j-th `_Item` (with clusters, `program` numbers the cluster and `rank` is the
    program's place in it)."""
    batch, column, cluster_block = cfg.items.at(program, j)
    # A column folds (KV head, split): split `part` walks query sources
    # [part * sources_per_item, (part + 1) * sources_per_item) of the KV batch and head.
    kv_head, part = lax.div(column, cfg.splits), lax.rem(column, cfg.splits)
    keys = COMPUTE_WGS * cfg.block_kv
    if cfg.cluster == 1:
        kv_start = cluster_block * keys
        walk = shared = _q_range(kv_start, cfg)
    else:  # the cluster's `cluster` adjacent key blocks, this program's the rank-th
        cluster_start = cluster_block * (cfg.cluster * keys)
        kv_start = cluster_start + rank * keys
        walk, shared = _q_range(kv_start, cfg), _q_range(cluster_start, cfg, keys=cfg.cluster * keys)
    return _Item(batch, kv_head, part, part * cfg.sources_per_item, kv_start, walk, shared)


def _walk_item(it, cfg, q_step, carry, skip_step=None):
    """`carry` through the item's steps, source after source: per source, the steps of the program's
    own walk [start, end) run q_step(step, carry, masked=...), masked where they cross a band edge (or
    hold keys past kv_len): [start, lo) and [hi, end), the others not. In a cluster the steps before
    `start` and from `end` on (query blocks only the other program's keys see) run skip_step(step,
    carry) instead; without one the own walk is all the steps."""
    per_head = it.shared.per_head
    if cfg.cluster == 1:
        start, end = 0, per_head
        lo, hi = it.walk.full_lo - it.walk.first, it.walk.full_hi - it.walk.first
    else:
        start = jnp.clip(it.walk.first - it.shared.first, 0, per_head)
        end = jnp.clip(start + it.walk.per_head, start, per_head)
        lo = jnp.clip(start + (it.walk.full_lo - it.walk.first), start, end)
        hi = jnp.clip(start + (it.walk.full_hi - it.walk.first), lo, end)

    def source_walk(g, carry):
        base = g * per_head
        if cfg.cluster > 1:
            carry = lax.fori_loop(base, base + start, skip_step, carry)
        if cfg.right is not None or cfg.ragged_end:
            carry = lax.fori_loop(base + start, base + lo, functools.partial(q_step, masked=True), carry)
        carry = lax.fori_loop(base + lo, base + hi, functools.partial(q_step, masked=False), carry)
        if cfg.left is not None:
            carry = lax.fori_loop(base + hi, base + end, functools.partial(q_step, masked=True), carry)
        if cfg.cluster > 1:
            carry = lax.fori_loop(base + end, base + per_head, skip_step, carry)
        return carry

    return lax.fori_loop(0, cfg.sources_per_item, source_walk, carry)
