"""The flash kernels' segment tables, written by a Triton kernel that both launchers launch.

With segment ids, query i of batch b sees key j only where q_ids[b, i] == kv_ids[b, j]. The flash
kernels skip key blocks outside a query block's segments and compare ids element by element only
where a span is not one contiguous run; they read that from two int32 tables:

    SegQ (B, 4, L): per query, its id, the span [lo, hi) of key positions holding that id
        (lo = hi = 0 when no key has it), and 1 when every key in the span has the id.
    SegK (B, 4, S): the same per key, over query positions.

An id outside [0, n) of the other side's length n gets the span [0, n), not contiguous (the
kernels then compare ids everywhere): the per-id tables below are indexed by id.

This module holds the kernel and the plain-Python plan of its launch, so the JAX launcher
(jax-triton, every scalar a constexpr: `segment_table_entry_static`) and the torch launcher (sizes
and strides as runtime arguments: `segment_table_entry_dynamic`) launch it identically. Imports
only `triton`.
"""

import triton
import triton.language as tl

_BLOCK = 256  # positions handled per vector step


@triton.jit
def _spans(Ids, Other, Table, Scratch, n_ids, n_other, s_id, s_other, BLOCK: tl.constexpr):
    """Writes one batch row of a table: for each of the row's `n_ids` ids, its span among the
    `n_other` positions of `Other`. Scratch holds 3 * (n_other + 1) int32: per id slot (slot
    n_other collects out-of-range ids) the first and last position and the count.

    Three passes over the row, each followed by a barrier so that the next reads what every thread
    of the program wrote; the reads bypass L1 (volatile), where a stale line could sit.
    """
    first = Scratch
    last = Scratch + (n_other + 1)
    count = Scratch + 2 * (n_other + 1)
    for i0 in range(0, n_other + 1, BLOCK):
        slots = i0 + tl.arange(0, BLOCK)
        inside = slots <= n_other
        tl.store(first + slots, tl.zeros((BLOCK,), tl.int32) + n_other, mask=inside)
        tl.store(last + slots, tl.zeros((BLOCK,), tl.int32) - 1, mask=inside)
        tl.store(count + slots, tl.zeros((BLOCK,), tl.int32), mask=inside)
    tl.debug_barrier()
    for j0 in range(0, n_other, BLOCK):
        pos = j0 + tl.arange(0, BLOCK)
        inside = pos < n_other
        ids = tl.load(Other + pos.to(tl.int64) * s_other, mask=inside, other=0).to(tl.int32)
        slot = tl.where((ids >= 0) & (ids < n_other), ids, n_other)
        tl.atomic_min(first + slot, pos, mask=inside)
        tl.atomic_max(last + slot, pos, mask=inside)
        tl.atomic_add(count + slot, tl.zeros((BLOCK,), tl.int32) + 1, mask=inside)
    tl.debug_barrier()
    for i0 in range(0, n_ids, BLOCK):
        idx = i0 + tl.arange(0, BLOCK)
        inside = idx < n_ids
        ids = tl.load(Ids + idx.to(tl.int64) * s_id, mask=inside, other=0).to(tl.int32)
        in_range = (ids >= 0) & (ids < n_other)
        slot = tl.where(in_range, ids, n_other)
        f = tl.load(first + slot, mask=inside, other=0, volatile=True)
        la = tl.load(last + slot, mask=inside, other=0, volatile=True)
        c = tl.load(count + slot, mask=inside, other=0, volatile=True)
        present = c > 0
        lo = tl.where(in_range & present, f, 0)
        hi = tl.where(in_range, tl.where(present, la + 1, 0), n_other)
        contiguous = in_range & (c == hi - lo)
        tl.store(Table + idx, ids, mask=inside)
        tl.store(Table + n_ids + idx, lo, mask=inside)
        tl.store(Table + 2 * n_ids + idx, hi, mask=inside)
        tl.store(Table + 3 * n_ids + idx, contiguous.to(tl.int32), mask=inside)


@triton.jit
def _segment_table_body(QIds, KIds, SegQ, SegK, Scratch, L, S, sqb, sqn, skb, skn, BLOCK: tl.constexpr):
    """Grid (B, 2): program (b, 0) writes SegQ[b], program (b, 1) SegK[b]; each has its own scratch
    of 3 * (max(L, S) + 1) int32."""
    b = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    width = 3 * (tl.maximum(L, S) + 1)
    scratch = Scratch + (b * 2 + which) * width
    if which == 0:
        _spans(QIds + b * sqb, KIds + b * skb, SegQ + b * 4 * L, scratch, L, S, sqn, skn, BLOCK)
    else:
        _spans(KIds + b * skb, QIds + b * sqb, SegK + b * 4 * S, scratch, S, L, skn, sqn, BLOCK)


@triton.jit
def segment_table_entry_static(QIds, KIds, SegQ, SegK, Scratch, L: tl.constexpr, S: tl.constexpr,
                               sqb: tl.constexpr, sqn: tl.constexpr, skb: tl.constexpr, skn: tl.constexpr,
                               BLOCK: tl.constexpr):
    """The table kernel with every scalar a constexpr (jax-triton specialises nothing else)."""
    _segment_table_body(QIds, KIds, SegQ, SegK, Scratch, L, S, sqb, sqn, skb, skn, BLOCK)


@triton.jit
def segment_table_entry_dynamic(QIds, KIds, SegQ, SegK, Scratch, L, S, sqb, sqn, skb, skn, BLOCK: tl.constexpr):
    """The table kernel with sizes and strides as runtime arguments (one compilation for all lengths)."""
    _segment_table_body(QIds, KIds, SegQ, SegK, Scratch, L, S, sqb, sqn, skb, skn, BLOCK)


# ------------------------------------------------------------------------------------------- plans


def segment_table_shapes(b: int, l: int, s: int) -> tuple[tuple[int, int, int], tuple[int, int, int], tuple[int]]:
    """Shapes of SegQ, SegK and the kernel's int32 scratch."""
    return (b, 4, l), (b, 4, s), (b * 2 * 3 * (max(l, s) + 1),)


def segment_table_launch(b: int, l: int, s: int, q_strides: tuple[int, int], k_strides: tuple[int, int]
                         ) -> tuple[tuple[int, int], int, dict]:
    """Everything a launch of either entry needs except its buffers.

    Args:
        b, l, s: batch, query and key lengths.
        q_strides, k_strides: element strides (batch, position) of the (B, L) / (B, S) id arrays.

    Returns:
        (grid, num_warps, args): launch `entry[grid](q_ids, kv_ids, seg_q, seg_k, scratch, **args)`
        or `triton_call(q_ids, kv_ids, kernel=entry, out_shape=(seg_q, seg_k, scratch), ...)`.
    """
    args = dict(L=l, S=s, sqb=int(q_strides[0]), sqn=int(q_strides[1]), skb=int(k_strides[0]),
                skn=int(k_strides[1]), BLOCK=_BLOCK)
    return (b, 2), 4, args
