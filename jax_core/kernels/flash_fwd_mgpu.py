"""Flash-attention forward for Hopper (sm90) in Pallas Mosaic GPU, FlashAttention-3 style.

The torch drop-in runs it on Hopper for the calls `torch_api.hopper_flash` accepts, with the backward
of `flash_bwd_mgpu.py`. Imports only JAX and uses Pallas Mosaic GPU APIs present from jax 0.10.2 to
0.11.

Arrays, (batch, length, heads, head dim) as Mosaic GPU's TMA wants them:
    q (B, L, Hq, D), k and v (B, S, Hk, D), bf16 or fp16, D 64, 128 or 256, any L, S >= 1; query head h
    reads KV head h // (Hq // Hk) (GQA). k and v may have a batch Bk dividing B instead, for a caller
    that folds (batch, head) pairs into the batch with GQA: query batch b then reads KV batch
    b // (B / Bk) (`flash_mgpu_checks.batch_group`). Returns out (B, L, Hq, D) in q's dtype and lse (B, Hq, L)
    float32, natural log. A row that sees no key gives out 0 and lse -inf (the sink's logit with sinks).

The work is tiles of 2 * block_q query rows of one head (compute_wgs * block_q). One program (a
CUDA block of three warpgroups) walks one tile, or, with `programs` (a persistent grid, one program
per multiprocessor), several in turn (`_Tiles`, dealt by `persistent_waves`):
    * warpgroup 2 (memory) issues TMA copies of each tile's Q and of its K and V blocks into a ring
      of `stages` shared-memory slots; `*_ready` barriers say a slot is filled, `*_free` barriers
      (two arrivals, one per compute warpgroup) say both have read it. The ring runs on from tile
      to tile, and Q has two slots per warpgroup: the next tile's Q and first key blocks load while
      the compute warpgroups finish the last tile and store its output, which one program per tile
      leaves exposed (a tile's walk is short at 1-4k tokens: 1.08-1.37x faster there, H200). At
      head dim 256 two slots do not fit beside the ring (`forward_q_slots`): the next Q loads once
      the last O has been read out. A tile's copies go warpgroup 0's Q, the first key block, then
      the other warpgroups' Q: warpgroup 0 opens the tile's turns and needs just those two (0.5-2%
      at 512-1k tokens over all Qs first, head dim 64, H200).
    * warpgroups 0 and 1 (compute) own block_q rows each: wgmma S = Q K^T, online softmax in
      registers (exp2, scale * log2(e) folded into one multiply), wgmma O += P V. A shared
      `turn` barrier makes them alternate, so one warpgroup's softmax overlaps the other's matmuls
      (`_Turns`). With `compute_wgs=3` (head dim 64) three compute warpgroups pass the turn round
      and the memory warpgroup is the fourth; a warpgroup whose rows are all padding walks nothing.
      On long walks at head dim 128 (`scores_first_default`) a turn issues the next block's Q K^T
      before the last block's P V, and waits once for both, so the scores are done when the softmax
      starts.
      O is written over the tile's Q slot and stored by TMA without waiting; the store must have
      read the slot before the memory warpgroup loads Q two tiles on (`free_next_slot`).

Features, all compiled in (none of them costs anything when unused):
    * causal and sliding window `window=(left, right)` (-1: unbounded side): query row i sees keys
      i + diag_offset - left <= j <= i + diag_offset + right; causal is right = 0 (diag_offset 0
      aligns top-left, S - L bottom-right). A program loads only the key blocks between its first
      row's left edge and its last row's right edge; a compute warpgroup releases the ring slots of
      blocks it does not need, and masks only the blocks that cross one of its rows' band edges. Of
      a last block whose second half none of its rows sees (every other warpgroup of a causal walk
      at 128-key blocks), it computes the first half only (`_halved_last_block`).
    * logits soft cap: s -> softcap * tanh(scale * s / softcap) before the softmax.
    * attention sinks: one logit per query head that joins each row's softmax normaliser (and the
      LSE) but carries no value; an extra kernel operand only when given, (Hq,), or (B, Hq) on whole
      tiles (`flash_forward_mgpu_tiles`: a caller that folds (batch, head) pairs into the batch).
Back-to-back calls: every program first waits for the kernel before it on the stream to end
(`griddepcontrol.wait`), then lets the next one launch (`griddepcontrol.launch_dependents`). jax 0.11
then launches the module with programmatic stream serialization (Mosaic GPU's host launch, which the
torch launcher calls too), so the next such kernel's launch and prologue overlap this grid's tail:
2-3% of a call at 512-1k tokens. Under jax 0.10 the instructions lower but the launch attribute is
not set; the interpreter skips both.
Edge tiles: TMA moves whole tiles only, so `flash_forward_mgpu` pads q to a multiple of 2 * block_q
rows and k, v to a multiple of block_kv (a copy only when a length is not one already), runs the
kernel with the true key count `kv_len` (keys past it are masked in the last key block only) and
slices the padded query rows off. `flash_forward_mgpu_tiles` is the bare kernel call on whole
tiles, for launchers (such as `plgpu.as_torch_kernel`) that pad themselves; `padded_lengths`
says to what.
The steps of a block and of a tile carry names (`jax.named_scope`: the softmax, each product, each
wait) for Mosaic GPU's in-kernel profiler (`mgpu_timeline.recorded`); without it they emit nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_mgpu_checks import COMPUTE_WGS, SMEM_BYTES, SMEM_RESERVE  # noqa: F401 (re-exported)
from .mgpu_band import keep_band
from .flash_mgpu_checks import (FORWARD_HEAD_DIMS, batch_group, check_arrays, check_blocks, check_compute_wgs,
                                check_features, check_tiling, check_whole_tiles, forward_q_slots)
from .mgpu_timeline import compiler_params
from .persistent_waves import Dealing, DealtWork, waves

LOG2E = math.log2(math.e)
# The running max starts finite: a fully masked block (all scores -inf) then gives exp2(-inf) = 0
# and a rescale factor of 1 instead of exp2(-inf - -inf) = NaN, with no select on the hot path.
M_FLOOR = -1e30
#: Most A = softcap * log2(e) for which a capped bf16 softmax subtracts A instead of a running row
#: maximum. A capped exponent A tanh(.) lies within [-A, A], so p = 2^(A (tanh(.) - 1)) lies within
#: [2^-2A, 1]: it never overflows, and for A <= 63 never falls below float32's and bf16's smallest
#: normal, 2^-126, so a row that sees a key keeps a positive sum and P keeps bf16's relative
#: precision (float16's 5 exponent bits would flush it: float16 keeps the running maximum). Without
#: it a block's softmax has no row reduction before its exponentials, so the special-function unit,
#: which with a cap takes two ops a score (tanh and exp2), does not wait on one; and O and the row
#: sums are never rescaled. Forward alone, cap 30, causal bf16, H200, µs, fixed / running maximum /
#: no cap (BENCHMARKS.md "A fixed maximum under a soft cap"): (1, 16384, 16, 128) 1847 / 2060 / 1824,
#: (2, 8192, 16, 128) 988 / 1066 / 924, (16, 1024, 16, 64) 136 / 145 / 118.
FIXED_MAX_MOST_CAP_LOG2 = 63.0
SMALLEST_NORMAL = 2.0 ** -126  # float32's

#: Where a compute warpgroup's turn issues the next block's Q K^T before the last block's P V
#: (`scores_first`): head dims and the fewest keys a walk may span. The turn then waits once for both products and
#: the softmax finds its scores done, about 5% fewer cycles a block step at (16, 16, 1024, 64) under
#: Nsight Compute; but a walk's first step and its last P V then take a step of their own, which a
#: short walk does not earn back, and with 256-key blocks the pending P (64 registers a thread) lives
#: beside the next scores. Forward alone, causal bf16, H200, µs sustained, scores first / as before
#: (BENCHMARKS.md "The scores issued before the P V product"): (1, 16, 16384, 128) 1902-1910 /
#: 1929-1941 (3 rounds), (2, 16, 8192, 128) 990-997 / 998-1002, (8, 16, 1024, 128) 96.1 / 95.1,
#: (16, 16, 1024, 64) 127.7 / 123.3, (4, 16, 4096, 64) 428.6 / 335.5.
SCORES_FIRST_HEAD_DIMS = (128,)
SCORES_FIRST_MIN_KEYS = 8192


def scores_first_default(head_dim, kv_len, window=None, tile_rows=2 * 64):
    """Whether the forward issues a block's Q K^T before the last block's P V by default, over kv_len
    keys with `window` (left, right) (-1 or None: unbounded; causal is right 0): where a tile's walk
    may span at least SCORES_FIRST_MIN_KEYS keys (a window bounded on both sides spans at most left +
    right + tile_rows)."""
    left, right = (-1, -1) if window is None else (-1 if w is None else w for w in window)
    walk = kv_len if left < 0 or right < 0 else min(kv_len, left + right + tile_rows)
    return head_dim in SCORES_FIRST_HEAD_DIMS and walk >= SCORES_FIRST_MIN_KEYS


@dataclasses.dataclass(frozen=True)
class _Band:
    """Which keys each query row sees, all static: row i sees keys j with
    i + diag_offset - left <= j <= i + diag_offset + right (None: that side unbounded) and j < kv_len."""
    diag_offset: int
    left: int | None
    right: int | None
    kv_len: int
    block_q: int
    block_kv: int
    wgs: int = COMPUTE_WGS  # compute warpgroups of block_q rows each: a tile is wgs * block_q rows
    q_len: int | None = None  # rows from q_len on are padding (None: the caller's rows all count)

    @property
    def tile_rows(self):
        return self.wgs * self.block_q

    @property
    def num_kv_blocks(self):
        return pl.cdiv(self.kv_len, self.block_kv)

    @property
    def ragged_end(self):
        """Whether the last key block holds padding (keys >= kv_len) to mask."""
        return self.kv_len % self.block_kv != 0


def _first_row(tile_rows, wg, band):
    """The first of compute warpgroup `wg`'s block_q rows in a tile from row `tile_rows`: the last
    warpgroup takes the tile's first rows. In a causal tile those see the fewest keys; of two
    warpgroups, warpgroup 0 waits at a tile's end for the other's last softmax (`_Turns`), which is
    then the shorter walk's."""
    return tile_rows + (band.wgs - 1 - wg) * band.block_q


def _kv_end(row_end, band):
    """One past the last key block that rows [.., row_end) need; rows from q_len on (padding) need none."""
    if band.right is None:
        return jnp.int32(band.num_kv_blocks)
    if band.q_len is not None:  # the memory warpgroup and every compute warpgroup agree on this end
        row_end = jnp.minimum(row_end, band.q_len)
    visible_end = row_end + (band.diag_offset + band.right)  # keys j < this are visible to some row
    return jnp.clip(pl.cdiv(visible_end, jnp.int32(band.block_kv)), 0, band.num_kv_blocks)


def _kv_start(row_start, kv_end, band):
    """The first key block that rows [row_start, ..) need (at most kv_end); Python 0 with no left edge."""
    if band.left is None:
        return 0
    first_key = jnp.maximum(row_start + (band.diag_offset - band.left), 0)
    return jnp.minimum(lax.div(first_key, jnp.int32(band.block_kv)), kv_end)


def _full_blocks(rows, lo, hi, band):
    """[full_lo, full_hi) within [lo, hi): the key blocks every row of rows [rows, rows + block_q)
    sees whole, so they need no mask; the blocks of [lo, full_lo) and [full_hi, hi) cross an edge."""
    full_lo = lo
    if band.left is not None:  # the last row's left edge is the tightest
        last_row_first_key = jnp.maximum(rows + (band.block_q - 1 + band.diag_offset - band.left), 0)
        full_lo = jnp.clip(pl.cdiv(last_row_first_key, jnp.int32(band.block_kv)), lo, hi)
    if band.right is None and not band.ragged_end:
        return full_lo, hi
    whole_blocks = band.kv_len // band.block_kv  # blocks with no key past kv_len
    if band.right is None:  # clipped: hi may stop short of the last block (a warpgroup of padded rows)
        return full_lo, jnp.clip(whole_blocks, full_lo, hi)
    # The first row's right edge is the tightest.
    full_end = lax.div(rows + (band.diag_offset + band.right) + 1, jnp.int32(band.block_kv))
    if band.ragged_end:
        full_end = jnp.minimum(full_end, whole_blocks)
    return full_lo, jnp.clip(full_end, full_lo, hi)


#: The smallest key block whose last block a warpgroup may walk half of (`_halved_last_block`): half of
#: it is then at least 64 keys, a whole 128-byte swizzle tile of the products' key dimension.
HALF_BLOCK_MIN = 128


def _halved_last_block(rows, lo, end, band):
    """1 if the last key block of rows [rows, rows + block_q)'s masked tail [lo, end) holds no key that
    any of them sees in its second half (so its products may stop at half the block), else 0; for
    blocks of at least HALF_BLOCK_MIN keys. The causal diagonal makes this the case for every other
    warpgroup of a causal walk: 64 query rows against 128-key blocks (the first row of a tile sees
    half a block fewer keys than its last)."""
    seen_end = jnp.int32(band.kv_len)  # one past the last key the block's last row sees
    if band.right is not None:
        seen_end = jnp.minimum(seen_end, rows + (band.block_q + band.diag_offset + band.right))
    half = (end > lo) & (seen_end - (end - 1) * band.block_kv <= band.block_kv // 2)
    return half.astype(jnp.int32)


def _mask(s, i, rows, band, *, on_gpu):
    """s (rows [rows, rows + block_q) x keys of block i) with the keys outside each row's band at -inf.
    In s's own indices (r, c) the band is i * block_kv - rows - (diag_offset + right) <= r - c <=
    i * block_kv - rows - (diag_offset - left), and the keys past the end c >= kv_len - i * block_kv."""
    first_key = i * band.block_kv
    lo = None if band.right is None else first_key - rows - (band.diag_offset + band.right)
    hi = None if band.left is None else first_key - rows - (band.diag_offset - band.left)
    col_end = band.kv_len - first_key if band.ragged_end else None
    return keep_band(s, fill=-jnp.inf, diff=-1, lo=lo, hi=hi, col_end=col_end, on_gpu=on_gpu)


@dataclasses.dataclass(frozen=True)
class _Tiles(DealtWork):
    """The work: one tile per (batch, query head, 2 * block_q query rows), numbered query block by
    query block, the last rows (the longest causal walks) first, and dealt by `waves` to its
    programs (a persistent grid, one per multiprocessor, or one program per tile)."""
    batch: int
    heads: int
    q_blocks: int
    rows: int  # query rows per tile
    waves: Dealing

    def at(self, program, j):
        """(batch, head, first row) of `program`'s j-th tile (in wave j)."""
        block, batch, head = self.block_batch_column(program, j, self.batch, self.heads)
        return batch, head, ((self.q_blocks - 1) - block) * self.rows


def _program(*refs, scale, band, softcap, has_sinks, stages, tiles, group, batches, scores_first, interpret):
    q_ref, k_ref, v_ref = refs[:3]
    sinks_ref = refs[3] if has_sinks else None
    out_ref, lse_ref = refs[-2:]
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
    block_q, block_kv, wgs = band.block_q, band.block_kv, band.wgs
    # A program walking several tiles loads the next tile's Q into a second slot while its last tile's
    # O (written over that tile's Q) is still being stored, where two fit.
    q_slots = forward_q_slots(d, jnp.dtype(dtype).itemsize, block_q, block_kv, stages, tiles.per_program, wgs)
    # 128-byte rows (64 16-bit elements) in 128-byte swizzled tiles: the layout TMA writes and
    # wgmma reads without bank conflicts.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        plgpu.SMEM((wgs, q_slots, block_q, d), dtype, transforms=transforms),  # Q, then O
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),  # K ring
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),  # V ring
        plgpu.SMEM((wgs, q_slots, block_q), jnp.float32),  # LSE rows
    )
    barriers = dict(
        q_ready=plgpu.Barrier(num_barriers=wgs * q_slots),
        q_free=plgpu.Barrier(num_barriers=wgs * q_slots),
        k_ready=plgpu.Barrier(num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
        # Two warpgroups meet at one barrier; three pass a token round, one barrier each (`_Turns`).
        turn=plgpu.Barrier(num_arrivals=2) if wgs == 2 else plgpu.Barrier(num_barriers=wgs),
    )
    cfg = dict(scale=scale, band=band, softcap=softcap, stages=stages, tiles=tiles, group=group, batches=batches,
               scores_first=scores_first, interpret=interpret)
    # Allocated once for the three warpgroups together (collective over "wg").
    pl.run_scoped(
        lambda bufs, bars: _warpgroups(q_ref, k_ref, v_ref, sinks_ref, out_ref, lse_ref, bufs, bars, **cfg),
        smem, barriers, collective_axes="wg")


def _program_blocks(program_rows, band):
    """[start, end): the key blocks of a tile, from warpgroup 0's first to the last warpgroup's last
    (their rows come later; rows from q_len on need none). The memory warpgroup loads all of them;
    each compute warpgroup releases the slots of those it does not need."""
    end = _kv_end(program_rows + band.tile_rows, band)
    start = 0 if band.left is None else _kv_start(program_rows, _kv_end(program_rows + band.block_q, band), band)
    return jnp.int32(start), end


def _warpgroups(q_ref, k_ref, v_ref, sinks_ref, out_ref, lse_ref, bufs, bars, *, scale, band, softcap,
                stages, tiles, group, batches, scores_first, interpret):
    program, wg = lax.axis_index("programs"), lax.axis_index("wg")
    if interpret is None:
        # Programmatic dependent launch: the kernel before this one in the stream may still be
        # finishing; every global read and write below waits for it. And the kernel after this one,
        # if launched with PDL, may take each multiprocessor this program leaves (its own prologue
        # overlapping this grid's tail) and then waits for the whole grid the same way. jax launches
        # the module with PDL because of this wait: without it the kernel runs in stream order.
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
    # Registers moved from the memory warpgroup to the compute ones (Hopper's setmaxnreg), all of a
    # multiprocessor's 64K 32-bit registers between them: (2 * 232 + 40) * 128 or (3 * 160 + 24) * 128.
    compute_registers, memory_registers = (232, 40) if band.wgs == 2 else (160, 24)

    @pl.when(wg < band.wgs)
    def _():
        plgpu.set_max_registers(compute_registers, action="increase")
        _compute(sinks_ref, out_ref, lse_ref, bufs, bars, program=program, wg=wg, tiles=tiles, scale=scale,
                 band=band, softcap=softcap, stages=stages, scores_first=scores_first, interpret=interpret)

    @pl.when(wg == band.wgs)
    def _():
        plgpu.set_max_registers(memory_registers, action="decrease")
        _memory(q_ref, k_ref, v_ref, bufs, bars, program=program, tiles=tiles, band=band, group=group,
                batches=batches, stages=stages)


def _memory(q_ref, k_ref, v_ref, bufs, bars, *, program, tiles, band, group, batches, stages):
    q_smem, k_smem, v_smem, _ = bufs
    q_slots = q_smem.shape[1]
    block_q, block_kv = band.block_q, band.block_kv

    def tile(j, loaded):
        """Loads the j-th tile's Q and its key blocks; `loaded` counts the key blocks before it (block
        number `loaded` goes to slot loaded % stages, so the ring's first round finds every slot free)."""
        batch, head, program_rows = tiles.at(program, j)
        q_slot = lax.rem(j, q_slots)

        def load_q(w):
            barrier = w * q_slots + q_slot

            @pl.when(j >= q_slots)  # the slot's previous tile's O has been stored (see `_compute`)
            def _():
                plgpu.barrier_wait(bars["q_free"].at[barrier])
            rows = pl.ds(_first_row(program_rows, w, band), block_q)
            plgpu.copy_gmem_to_smem(q_ref.at[batch, rows, head], q_smem.at[w, q_slot], bars["q_ready"].at[barrier])

        kv_head = lax.div(head, jnp.int32(group))
        kv_batch = batch if batches == 1 else lax.div(batch, jnp.int32(batches))  # see `batch_group`

        def kv(i, n):
            slot = lax.rem(n, jnp.int32(stages))
            keys = (kv_batch, pl.ds(i * block_kv, block_kv), kv_head)

            @pl.when(n >= stages)  # the slot's previous block must have been read by both
            @jax.named_scope("slot_wait")
            def _():
                plgpu.barrier_wait(bars["k_free"].at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], bars["k_ready"].at[slot])

            @pl.when(n >= stages)
            def _():
                plgpu.barrier_wait(bars["v_free"].at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], bars["v_ready"].at[slot])
            return n + 1

        start, end = _program_blocks(program_rows, band)
        # Warpgroup 0's Q, the first key block, then the other warpgroups' Q (the module docstring).
        load_q(0)
        first_end = jnp.minimum(start + 1, end)
        loaded = lax.fori_loop(start, first_end, kv, loaded)
        pl.loop(1, band.wgs)(load_q)
        return lax.fori_loop(first_end, end, kv, loaded)

    loaded = lax.fori_loop(0, tiles.count(program), tile, jnp.int32(0))

    # Observe the last releases too, so that every barrier phase is consumed before the barriers
    # go away (cheap: the compute warpgroups are finishing these blocks anyway).
    @pl.loop(jnp.maximum(loaded - stages, 0), loaded)
    def _(n):
        slot = lax.rem(n, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_free"].at[slot])
        plgpu.barrier_wait(bars["v_free"].at[slot])


def padded_lengths(l, s, *, block_q=64, block_kv=128, compute_wgs=COMPUTE_WGS):
    """(L, S) rounded up to the kernel's whole tiles: compute_wgs * block_q query rows, block_kv keys."""
    rows = compute_wgs * block_q
    return pl.cdiv(l, rows) * rows, pl.cdiv(s, block_kv) * block_kv


def _pad_rows(x, length):
    """x (B, n, H, D) with zero rows appended up to `length` (x itself when n is already that)."""
    if x.shape[1] == length:
        return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def _tiles(q_shape, block_q, compute_wgs, programs):
    """The `_Tiles` of q (B, L', Hq, D) on whole tiles; `programs`: None (one program per tile) or a
    positive int (at most one per tile is used)."""
    b, l, hq, _ = q_shape
    q_blocks = pl.cdiv(l, compute_wgs * block_q)
    return _Tiles(batch=b, heads=hq, q_blocks=q_blocks, rows=compute_wgs * block_q,
                  waves=waves(b * hq * q_blocks, programs, columns=b * hq))


def _checked_band(q, k, v, *, scale, causal, diag_offset, window, softcap, sinks, block_q, block_kv, stages,
                  compute_wgs, programs, per_batch_sinks=False):
    """(the checked arguments' band, all keys (kv_len = S) real, and their `_Tiles`)."""
    check_arrays(q, k, v, head_dims=FORWARD_HEAD_DIMS)
    check_blocks(block_q, block_kv, stages)
    d, itemsize = q.shape[3], jnp.dtype(q.dtype).itemsize
    check_compute_wgs(compute_wgs, d)
    tiles = _tiles(q.shape, block_q, compute_wgs, programs)
    check_tiling(d, itemsize, block_q, block_kv, stages, compute_wgs=compute_wgs,
                 q_slots=forward_q_slots(d, itemsize, block_q, block_kv, stages, tiles.per_program, compute_wgs))
    check_features(q.shape[2], scale=scale, diag_offset=diag_offset, window=window, softcap=softcap,
                   sinks=sinks, batch=q.shape[0] if per_batch_sinks else None)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    band = _Band(diag_offset=int(diag_offset), left=None if left < 0 else int(left),
                 right=None if right < 0 else int(right), kv_len=k.shape[1], block_q=block_q, block_kv=block_kv,
                 wgs=compute_wgs)
    return band, tiles


def flash_forward_mgpu(q, k, v, *, scale, causal, diag_offset=0, block_q=64, block_kv=128, stages=2,
                       window=None, softcap=None, sinks=None, programs=None, compute_wgs=COMPUTE_WGS,
                       scores_first=None, interpret=None):
    """(out, lse) of softmax(scale * q k^T [causal, window, soft cap, sinks]) v, any L, S >= 1; see
    the module docstring for layouts and features.

    Pads q, k, v to whole tiles (no copy when they are whole already), runs the kernel and slices
    the padded rows off: with whole tiles this is one Mosaic GPU kernel call and nothing else.
    `window`: (left, right), -1 unbounded, or None. `softcap`: float or None. `sinks`: (Hq,) float32
    or None. `programs`: None for one program per tile of 2 * block_q query rows, or the size of a
    persistent grid (the GPU's multiprocessor count) whose programs walk the tiles in turn, each
    loading its next tile while it finishes the last. `compute_wgs`: the compute warpgroups of a
    program, 2, or 3 at head dim 64 (tiles of 3 * block_q rows, for short walks). `scores_first`: whether
    a compute warpgroup's turn issues a block's Q K^T before the last block's P V (None:
    `scores_first_default`; the results are the same either way). `interpret`: Mosaic GPU
    interpret-mode parameters (`InterpretGPUParams`) to run on a CPU, or None to compile for the GPU."""
    l, s = q.shape[1], k.shape[1]
    rows, keys = padded_lengths(l, s, block_q=block_q, block_kv=block_kv, compute_wgs=compute_wgs)
    band, tiles = _checked_band(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, window=window,
                                softcap=softcap, sinks=sinks, block_q=block_q, block_kv=block_kv, stages=stages,
                                compute_wgs=compute_wgs, programs=programs)
    out, lse = _launch(_pad_rows(q, rows), _pad_rows(k, keys), _pad_rows(v, keys), sinks,
                       band=dataclasses.replace(band, q_len=l), tiles=tiles, scale=scale, softcap=softcap,
                       stages=stages, scores_first=scores_first, interpret=interpret)
    if rows != l:
        out, lse = out[:, :l], lse[:, :, :l]
    return out, lse


def flash_forward_mgpu_tiles(q, k, v, *, scale, causal, kv_len=None, diag_offset=0, block_q=64, block_kv=128,
                             stages=2, window=None, softcap=None, sinks=None, programs=None,
                             compute_wgs=COMPUTE_WGS, tma_edges=False, scores_first=None, interpret=None):
    """`flash_forward_mgpu` on whole tiles: L a multiple of compute_wgs * block_q, S of block_kv (see
    `padded_lengths`), keys from `kv_len` on (default S: none) masked as padding, padded query rows
    computed like the others. Padding must be finite (zeros, say): a masked key's weight is 0, and
    0 * NaN is NaN. One Mosaic GPU kernel call and nothing else, so that `plgpu.as_torch_kernel`
    can launch a function that calls this on torch tensors.

    `tma_edges` (GPU only): L and S any multiples of 8 instead, read in place. The last tiles run past
    them: TMA fills the rows it loads past an array's end with zeros (keys past S are masked as
    padding is; query rows past L compute on zeros) and drops the rows it stores there. The LSE has
    whole tiles' rows then, (B, Hq, L') for L' = L rounded up to a multiple of compute_wgs * block_q,
    and a warpgroup whose rows all lie past L skips its walk."""
    band, tiles = _checked_band(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, window=window,
                                softcap=softcap, sinks=sinks, block_q=block_q, block_kv=block_kv, stages=stages,
                                compute_wgs=compute_wgs, programs=programs, per_batch_sinks=True)
    kv_len = band.kv_len if kv_len is None else kv_len
    check_whole_tiles(q.shape[1], k.shape[1], kv_len, block_q, block_kv, rows=(f"{compute_wgs} * block_q",
                      compute_wgs * block_q), tma_edges=tma_edges, interpret=interpret)
    band = dataclasses.replace(band, kv_len=int(kv_len), q_len=q.shape[1] if tma_edges else None)
    return _launch(q, k, v, sinks, band=band, tiles=tiles, scale=scale, softcap=softcap, stages=stages,
                   scores_first=scores_first, interpret=interpret)


def _launch(q, k, v, sinks, *, band, tiles, scale, softcap, stages, scores_first, interpret):
    """The kernel call on whole tiles (arguments checked)."""
    b, l, hq, d = q.shape
    hk = k.shape[2]
    if scores_first is None:
        scores_first = scores_first_default(d, band.kv_len, (band.left, band.right), band.tile_rows)
    body = functools.partial(
        _program, scale=float(scale), band=band, softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None, stages=min(stages, band.num_kv_blocks), tiles=tiles, group=hq // hk,
        batches=batch_group(q, k), scores_first=bool(scores_first), interpret=interpret)
    call = plgpu.kernel(
        body,
        # The LSE has whole tiles' rows (L with whole tiles): a 1-D copy past the end of one (batch,
        # head) row would run on into the next one's, where a tiled one stops at the array's edge.
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct((b, hq, tiles.q_blocks * tiles.rows), jnp.float32)),
        grid=(tiles.programs,),
        grid_names=("programs",),
        num_threads=band.wgs + 1,
        thread_name="wg",
        compiler_params=compiler_params(interpret=interpret, approx_math=True),
        interpret=interpret,
    )
    return call(q, k, v) if sinks is None else call(q, k, v, sinks)


# Mosaic GPU's interpreter (jax 0.10 to 0.11) runs plain JAX ops on the CPU: it has no layout casts,
# no run_state, and its wgmma takes neither a transposed operand nor one in registers. The helpers
# below hold these GPU-only constructs and, under `on_gpu=False`, the same math as plain dots on the
# same shared-memory slots (so TMA, barriers and the pipeline still run as on the GPU).
def _wgmma_layout(x, *, on_gpu):
    """x in the layout of a wgmma accumulator (2-D) or of its row reductions (1-D)."""
    if not on_gpu:
        return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA if x.ndim == 2 else plgpu.Layout.WGMMA.reduce(1))


def _scores(q_smem, k_slot, between, *, on_gpu):
    """(between(), q @ k^T in float32) from shared memory: Q K^T is issued first, then between() runs
    (it may issue more products and wait for them), then the scores are read."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_slot, (1, 0)))
        out = between()
        with jax.named_scope("scores_wait"):
            return out, acc_ref[...]
    if on_gpu:
        return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_slot.shape[0]), jnp.float32))
    return between(), lax.dot_general(q_smem[...], k_slot[...], (((1,), (1,)), ((), ())),
                                      preferred_element_type=jnp.float32)


def _accumulate_pv(acc, p, v_slot, *, in_place):
    """acc + p @ v, p in registers. On the GPU the wgmma accumulates into acc's registers (run_state
    hands them to it and returns once it is done)."""
    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_slot)
    if in_place:
        return pl.run_state(pv)(plgpu.ACC.init(acc))
    return acc + lax.dot_general(p, v_slot[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Turns:
    """The order in which the compute warpgroups issue their products, so that one warpgroup's softmax
    runs while another's matmuls do (each step named "turn_..." for `mgpu_timeline`). A warpgroup
    holds the turn from the wgmma of P V of one key block through issuing Q K^T of the next, and
    gives it up to do that block's softmax.
    * Two warpgroups meet at one barrier (arrive and wait), warpgroup 1 one meeting ahead: its first
      meeting is at the program's start, and at a tile's end it meets before it writes its output,
      warpgroup 0 after. So warpgroup 0 writes its output while warpgroup 1 finishes its last
      softmax, and warpgroup 0's next softmax need not wait for warpgroup 1's output (a meeting at
      the tile's start did: 1.5-3% of a head-dim-64 forward at 1-8k tokens, H200). Warpgroup 0 ends
      the program with the meeting warpgroup 1 began it with. With one Q slot per warpgroup (head
      dim 256) warpgroup 1 cannot meet before its output: its next Q goes where that output is, and
      the memory warpgroup loads it before the next tile's keys, which warpgroup 0 needs to reach
      that meeting. There warpgroup 1 meets at a tile's start and warpgroup 0 before its output.
    * Three pass a token round, 0 -> 1 -> 2 -> 0, one single-arrival barrier each: a warpgroup waits
      on its own barrier and gives the turn by arriving on the next one's. Warpgroup 0 gives itself
      the first turn and takes the last one back at the program's end."""
    bars: dict
    wg: object
    wgs: int
    q_slots: int

    @property
    def _ahead(self):
        """Whether warpgroup 1 of two meets one meeting ahead (two Q slots per warpgroup)."""
        return self.wgs == 2 and self.q_slots > 1

    def _take(self):
        plgpu.barrier_wait(self.bars["turn"].at[self.wg])

    def _give(self):
        plgpu.barrier_arrive(self.bars["turn"].at[lax.rem(self.wg + 1, self.wgs)])

    def _meet(self):
        plgpu.barrier_arrive(self.bars["turn"])
        plgpu.barrier_wait(self.bars["turn"])

    def program_start(self):
        if self.wgs > 2:
            pl.when(self.wg == 0)(lambda: plgpu.barrier_arrive(self.bars["turn"].at[0]))
        elif self._ahead:
            pl.when(self.wg == 1)(self._meet)

    def program_end(self):
        if self.wgs > 2:
            pl.when(self.wg == 0)(self._take)
        elif self._ahead:
            pl.when(self.wg == 0)(self._meet)

    @jax.named_scope("turn_tile_start")
    def tile_start(self):
        if self.wgs > 2:
            self._take()
        elif not self._ahead:
            pl.when(self.wg == 1)(self._meet)

    @jax.named_scope("turn_tile_end")
    def tile_end(self, *, output_written):
        """The tile's last product is done; called before (`output_written` False) and after its output
        is written and its stores issued."""
        if self.wgs > 2:
            if not output_written:
                self._give()
        elif self._ahead:
            pl.when(self.wg == (0 if output_written else 1))(self._meet)
        elif not output_written:
            pl.when(self.wg == 0)(self._meet)

    @jax.named_scope("turn_after_scores")
    def after_scores(self):
        """Q K^T issued: another warpgroup's turn."""
        self._give() if self.wgs > 2 else self._meet()

    @jax.named_scope("turn_before_pv")
    def before_pv(self, v_ready):
        """The softmax done: waits for the V block (`v_ready`) and the turn."""
        if self.wgs > 2:
            plgpu.barrier_wait(v_ready)
            self._take()
        else:
            plgpu.barrier_arrive(self.bars["turn"])
            plgpu.barrier_wait(v_ready)
            plgpu.barrier_wait(self.bars["turn"])

    def skip(self):
        """A key block this warpgroup does not walk: the turns it would have taken."""
        if self.wgs > 2:
            self._give()
            self._take()
        else:
            self._meet()
            self._meet()


def _compute(sinks_ref, out_ref, lse_ref, bufs, bars, *, program, wg, tiles, scale, band, softcap, stages,
             scores_first, interpret):
    q_all, k_smem, v_smem, lse_all = bufs
    q_slots = q_all.shape[1]
    block_q, block_kv = band.block_q, band.block_kv
    d = q_all.shape[-1]
    dtype = q_all.dtype
    # Log2 domain: the softmax runs on t * log2(e) * s for t = scale, or with a soft cap on
    # softcap * log2(e) * tanh(scale / softcap * s), so that exp2 needs one FMA per score.
    scale_log2 = (scale if softcap is None else softcap) * LOG2E
    fixed_max = softcap is not None and scale_log2 <= FIXED_MAX_MOST_CAP_LOG2 and dtype == jnp.bfloat16
    on_gpu = interpret is None
    count = tiles.count(program)
    turns = _Turns(bars, wg, band.wgs, q_slots)
    # Whether some warpgroup's rows may all be padding (rows from q_len on): it then walks no block.
    idle_wgs = band.q_len is not None and tiles.q_blocks * tiles.rows - band.q_len >= block_q

    def tile(j, loaded):
        """The j-th tile; `loaded` counts the key blocks of the earlier ones, as the memory warpgroup
        does: block i of this tile sits in ring slot (loaded + i - program_start) % stages."""
        batch, head, program_rows = tiles.at(program, j)
        rows = _first_row(program_rows, wg, band)
        q_slot = lax.rem(j, q_slots)
        qo_smem, lse_smem = q_all.at[wg, q_slot], lse_all.at[wg, q_slot]
        program_start, program_end = _program_blocks(program_rows, band)
        # This warpgroup's key blocks [start, end) of the tile's [program_start, program_end).
        end = _kv_end(rows + block_q, band)
        if idle_wgs:
            end = jnp.where(rows < band.q_len, end, program_start)
        start = _kv_start(rows, end, band)
        full_start, full_end = _full_blocks(rows, start, end, band)

        def free_next_slot():
            """Once the last tile's O and LSE stores have read their slot, the memory warpgroup may load
            the next tile's Q there. Done at the end of this tile's first key block, not at its start:
            the stores, issued just before, then have had a block's products to read. (One slot: the
            tile's own end frees it.)"""
            if q_slots == 1:
                return

            @pl.when((j >= 1) & (j + 1 < count))
            def _():
                if on_gpu:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(bars["q_free"].at[wg * q_slots + lax.rem(j + 1, q_slots)])

        def ring_slot(i):
            return lax.rem(loaded + (i - program_start), jnp.int32(stages))

        def pv(acc, p16, i, keys=block_kv):
            """acc + p16 @ V of key block i (its first `keys` keys), waited for; frees the V slot."""
            slot = ring_slot(i)
            v_slot = v_smem.at[slot] if keys == block_kv else v_smem.at[slot, pl.ds(0, keys)]
            with jax.named_scope("pv"):
                acc = _accumulate_pv(acc, p16, v_slot, in_place=on_gpu)
            plgpu.barrier_arrive(bars["v_free"].at[slot])
            return acc

        def kv_step(i, carry, *, masked, keys=block_kv, first=False):
            """One key block; `keys` < block_kv: its first `keys` keys only (no row sees the others).
            As before `scores_first`: Q K^T, the turn passed, the softmax, the turn taken back, P V.
            With it the step holds the turn from its start and issues the block's Q K^T first, then
            the P V of the block before (none in a walk's `first` step; its P rides in the carry), so
            that the scores are done when the turn passes; a whole block leaves its own P V to the
            next step (or the walk's end), half of one, always a walk's last, does its own."""
            acc, m, l = carry[:3]
            slot = ring_slot(i)
            k_slot = k_smem.at[slot] if keys == block_kv else k_smem.at[slot, pl.ds(0, keys)]
            with jax.named_scope("k_wait"):
                plgpu.barrier_wait(bars["k_ready"].at[slot])

            if scores_first:
                def between():
                    out = acc if first else pv(acc, carry[3], i - 1)
                    turns.after_scores()  # the products issued: another warpgroup may issue its own
                    return out
                acc, s = _scores(qo_smem, k_slot, between, on_gpu=on_gpu)
            else:
                # The turn passes once the matmul is issued: another warpgroup may then issue its own.
                _, s = _scores(qo_smem, k_slot, turns.after_scores, on_gpu=on_gpu)
            plgpu.barrier_arrive(bars["k_free"].at[slot])
            with jax.named_scope("softmax"):
                if softcap is not None:  # before the mask: tanh(-inf) would be a finite -1
                    s = jnp.tanh(s * (scale / softcap))
                if masked:
                    s = _mask(s, i, rows, band, on_gpu=on_gpu)
                if fixed_max:  # m stays A (or a larger sink): see FIXED_MAX_MOST_CAP_LOG2
                    m_new = m
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m, s.shape, [0]))
                    l = l + p.sum(axis=1)
                else:
                    m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p.astype(dtype)
                # Finish the softmax before handing the tensor cores over, rather than letting the
                # compiler sink part of it past the barrier into the other warpgroup's turn.
                acc, m_new, l, p16 = lax.optimization_barrier((acc, m_new, l, p16))
            turns.before_pv(bars["v_ready"].at[slot])
            if scores_first and keys == block_kv:
                pl.when(i == program_start)(free_next_slot)
                return acc, m_new, l, p16
            acc = pv(acc, p16, i, keys)
            pl.when(i == program_start)(free_next_slot)
            return (acc, m_new, l) + tuple(carry[3:])

        def walk(carry, start, end, full_start, full_end):
            """The warpgroup's key blocks [start, end) of the tile: masked where they cross a band edge,
            the last one halved where its second half is seen by none of the rows."""
            halves = (band.right is not None or band.ragged_end) and block_kv >= HALF_BLOCK_MIN
            halved = _halved_last_block(rows, full_end, end, band) if halves else 0
            if scores_first:
                # The first step has no P V before it: one of up to three loops of at most one step
                # each takes it, so that every product and its wait stay in one stretch of code (a
                # branch around the pending product measured slower). 0/1 counts as int32: the
                # kernel's lowering takes no boolean constants.
                flag = lambda x: jnp.asarray(x).astype(jnp.int32)  # noqa: E731
                walks = flag(end > start)
                lone_half = walks * flag(end - halved == start) if halves else 0
                whole = flag(full_start <= start) * flag(start < full_end)
                firsts = [(walks * (1 - lone_half) * whole, dict(masked=False)),
                          (walks * (1 - lone_half) * (1 - whole), dict(masked=True))]
                if halves:
                    firsts.append((lone_half, dict(masked=True, keys=block_kv // 2)))
                for once, kw in firsts:
                    carry = lax.fori_loop(start, start + once, functools.partial(kv_step, first=True, **kw),
                                          carry)

            def steps(lo, hi, carry, **kw):
                if scores_first:  # the steps after the first, each taking the P V of the one before
                    lo, hi = jnp.maximum(lo, start + 1), jnp.maximum(hi, start + 1)
                return lax.fori_loop(lo, hi, functools.partial(kv_step, **kw), carry)
            if band.left is not None:
                carry = steps(start, full_start, carry, masked=True)
            carry = steps(full_start, full_end, carry, masked=False)
            if band.right is not None or band.ragged_end:
                carry = steps(full_end, end - halved, carry, masked=True)
                if halves:
                    carry = steps(end - halved, end, carry, masked=True, keys=block_kv // 2)
            if not scores_first:
                return carry
            acc, m, l, p16 = carry
            # The last whole block's P V, where the walk did not end on half a block.
            pending = walks * (1 - halved)
            acc = lax.fori_loop(end - pending, end, lambda i, acc: pv(acc, p16, i), acc)
            return acc, m, l

        def release(i, _):
            """A block of the tile this warpgroup does not need: free its slot, keep the turns."""
            slot = ring_slot(i)
            plgpu.barrier_wait(bars["k_ready"].at[slot])
            plgpu.barrier_arrive(bars["k_free"].at[slot])
            plgpu.barrier_wait(bars["v_ready"].at[slot])
            plgpu.barrier_arrive(bars["v_free"].at[slot])
            turns.skip()
            pl.when(i == program_start)(free_next_slot)

        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(bars["q_ready"].at[wg * q_slots + q_slot])
        acc = _wgmma_layout(jnp.zeros((block_q, d), jnp.float32), on_gpu=on_gpu)
        m = _wgmma_layout(jnp.full((block_q,), scale_log2 if fixed_max else M_FLOOR, jnp.float32), on_gpu=on_gpu)
        l = _wgmma_layout(jnp.zeros((block_q,), jnp.float32), on_gpu=on_gpu)
        if sinks_ref is not None:
            # The sink is one more logit with no value: the max and the sum start from it (a -inf sink
            # leaves them as they were).
            sink = (sinks_ref[head] if len(sinks_ref.shape) == 1 else sinks_ref[batch, head]) * LOG2E
            m = jnp.maximum(m, sink)
            l = jnp.exp2(sink - m)
        turns.tile_start()
        carry = (acc, m, l)
        if scores_first:  # the P of the step before, for its P V (zeros before the first)
            carry += (_wgmma_layout(jnp.zeros((block_q, block_kv), dtype), on_gpu=on_gpu),)
        if band.left is not None:
            lax.fori_loop(program_start, start, release, None)
        acc, m, l = walk(carry, start, end, full_start, full_end)
        if band.right is not None or idle_wgs:
            lax.fori_loop(end, program_end, release, None)
        pl.when(program_start == program_end)(free_next_slot)  # a tile with no key blocks
        turns.tile_end(output_written=False)

        with jax.named_scope("output"):
            # l >= 1 for a row that saw a key or has a sink (its max contributes exp2(0)), l >= 2^-126
            # under a fixed max; l = 0 (acc = 0) for one that saw neither, which max(l, 2^-126) turns
            # into out = 0, and log(0) into lse = -inf. One division a row and a multiply a score: a
            # division a score compiles to an IEEE divide each (a reciprocal on the special-function
            # unit and a refinement), which at short walks the tile's end pays for (H200: 1-3%).
            acc = acc * lax.broadcast_in_dim(1.0 / jnp.maximum(l, SMALLEST_NORMAL), acc.shape, [0])
            qo_smem[...] = acc.astype(dtype)
            lse_smem[...] = m * math.log(2.0) + jnp.log(l)
            plgpu.commit_smem()
            # Not waited for here: the next tile's first step does (`free_next_slot`), and the kernel's end.
            plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(rows, block_q), head])
            plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(rows, block_q)])
            if not on_gpu:
                plgpu.wait_smem_to_gmem(0)
        turns.tile_end(output_written=True)
        if q_slots == 1:  # the next tile's Q goes where this O is: once the stores have read it

            @pl.when(j + 1 < count)
            def _():
                if on_gpu:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(bars["q_free"].at[wg])
        return loaded + (program_end - program_start)

    turns.program_start()
    lax.fori_loop(0, count, tile, jnp.int32(0))
    turns.program_end()
    plgpu.wait_smem_to_gmem(0)
