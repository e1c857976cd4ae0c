"""Flash-attention backward for Hopper (sm90) in Pallas Mosaic GPU: dQ, dK, dV in one kernel.

The forward is `flash_fwd_mgpu.py`; this kernel takes its LSE. Imports only JAX.

Arrays, (batch, length, heads, head dim) as TMA wants them:
    q, do (B, L, Hq, D); k, v (B, S, Hk, D); bf16 or fp16, D 64, 128 or 256; GQA as in the forward, the
        folded batches too (k, v (Bk, S, Hk, D), query batch b reading KV batch b // (B / Bk)).
    lse_log2 (B, Hq, L) float32: the forward's LSE times log2(e), +inf for a row that saw no key
        (so that its probabilities are exp2(s - inf) = 0, not NaN); `backward_operands` makes it.
    delta (B, Hq, L) float32: rowsum(dO * O), from `backward_operands`.
    dq_accum (B, L, Hq, D) float32: zeros the kernel adds scale * dS K into (see below).
Returns dq_accum (the same buffer, now holding dQ in float32), dk and dv (B, S, Hk, D) in q's dtype.
Any L, S >= 1: TMA moves whole tiles only, so `flash_backward_mgpu` pads q and do with zero rows to
a multiple of block_q (with lse_log2 +inf and delta 0 there, so that padded rows contribute nothing)
and k, v to a multiple of 2 * block_kv (a copy only when a length is not one already), runs the
kernel with the true key count `kv_len` and slices dq, dk, dv back. `flash_backward_mgpu_tiles` is
the bare kernel call on whole tiles, for launchers (such as `plgpu.as_torch_kernel`) that pad
themselves.

The work is items of 2 * block_kv keys of one KV head, each walking the query blocks of every query
head of its group that see them (with `head_splits` > 1, of its share of the group: a short GQA grid
gets more items, each writing float32 partial dK, dV to be summed). One program (a CUDA block of
three warpgroups) takes one item, or, with `programs` (a persistent grid, one program per
multiprocessor), several in turn (`_Items`, dealt by `persistent_waves`): the memory warpgroup's
ring runs on from item to item, so the next item's first query blocks load while the compute
warpgroups store the last item's dK and dV and load its K and V. Per program:
    * warpgroup 2 (memory) streams Q, dO, LSE and delta blocks by TMA into a ring of `stages`
      shared-memory slots; `*_ready` barriers say a slot is filled, `*_free` barriers (one arrival
      per compute warpgroup) say both have read it.
    * warpgroup w in {0, 1} (compute) keeps its block_kv keys' K, V and its dK, dV accumulators for
      an item's whole walk. Per query block, with wgmma: S^T = K Q^T, P^T = exp2(scale log2(e) S^T - LSE),
      dP^T = V dO^T, dV += P^T dO, dS^T = P^T (scale dP^T - scale delta), dK += dS^T Q, and a share of
      dQ = dS K read from dS^T in shared memory (`dq_split`). At head dim 128 the two warpgroups
      split dQ's columns (64 each), at head dim 64 with 128-row query blocks its rows (64 each),
      over both warpgroups' keys: one rendezvous per block, half the registers and half the adds.
      Otherwise (head dim 64, 64-row blocks) each computes dQ over its own keys. At head dim 256 one
      warpgroup's dK and dV would not fit in its registers: there the two share the item's keys
      (block_kv = 32, items of 64 keys) and split the scores by query rows and the gradients by
      columns, with one dO slot (`flash_bwd_mgpu_wide.py`).
    * with `cluster=2` the programs run in clusters of two on adjacent items of one KV head and
      split, stepping through the query blocks either one's keys see together: the memory
      warpgroups each load half of a block and multicast it to both, a slot is free once all four
      compute warpgroups of the cluster have read it, and a program skips the blocks only the other
      one's keys see (`flash_bwd_mgpu_walks.py`).
    * dQ: every program adds its partial dQ into dq_accum by a TMA reduce-add (float32, in L2).
      The sum is therefore not bit-reproducible run to run (the order of the adds varies); the
      Triton kernels remain the deterministic backward.
    * dK, dV leave through shared memory: in the K and V tiles (head dim 128), or, where it fits
      (head dim 64, 128-row query blocks: `out_staging`), in the dQ staging tile's memory; with head
      splits the float32 partials leave through the staging tile too. Where the K and V tiles are
      not the way out, the next item's K and V load as soon as a walk ends, while this item's dK and
      dV are stored.
Features, compiled in (none of them costs anything when unused), as in the forward:
    * causal and sliding window `window=(left, right)` (-1: unbounded side): query row i sees keys
      i + diag_offset - left <= j <= i + diag_offset + right (causal: right = 0). A program walks
      only the query blocks that see some of its keys and masks only those that cross a band edge
      (leading masked blocks, an unmasked middle, trailing masked blocks); keys from kv_len on are
      masked in the one program that holds some.
    * logits soft cap: s -> softcap * tanh(scale * s / softcap); dS takes the factor 1 - tanh^2,
      tanh recomputed from S^T. The LSE must be the forward's with the same cap.
    * attention sinks need nothing in the kernel (the forward's LSE includes them); their gradient
      is `sinks_gradient`, plain JAX ops like `backward_operands`.
The steps of a query block and of an item carry names (`jax.named_scope`: the softmax, each product,
each wait) for Mosaic GPU's in-kernel profiler (`mgpu_timeline.recorded`); without it they emit nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_mgpu_checks import COMPUTE_WGS, SMEM_BYTES, SMEM_RESERVE  # noqa: F401 (re-exported)
from .mgpu_band import keep_band
from .flash_mgpu_checks import (BACKWARD_HEAD_DIMS, batch_group, check_arrays, check_backward_operands, check_blocks,
                                check_features, check_whole_tiles)
from .mgpu_timeline import compiler_params
from .flash_bwd_mgpu_walks import _item, _Items, _walk_item
from .persistent_waves import waves

LOG2E = math.log2(math.e)


def backward_operands(out, do, lse):
    """(lse_log2, delta) from the forward's out and lse and the output gradient (plain JAX ops)."""
    delta = jnp.einsum("blhd,blhd->bhl", out.astype(jnp.float32), do.astype(jnp.float32))
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2E).astype(jnp.float32)
    return lse_log2, delta


def sinks_gradient(sinks, lse, delta):
    """d loss / d sinks, (Hq,) float32, from the sinks (Hq,), the forward's lse (B, Hq, L) (natural
    log, the sink included) and delta (B, Hq, L) from `backward_operands`.

    The sink's weight in row i is exp(sink - lse_i) and its logit reaches the output only through the
    normaliser, so d loss / d sink = -sum_i exp(sink - lse_i) * delta_i. A row with lse -inf (a -inf
    sink and no key) contributes 0."""
    weight = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
    weight = jnp.where(jnp.isneginf(lse), 0.0, weight)
    return -jnp.einsum("bhl,bhl->h", weight, delta.astype(jnp.float32))


def wide(d):
    """Whether the two compute warpgroups share an item's 2 * block_kv keys and split the head's
    columns (head dim 256, `flash_bwd_mgpu_wide.py`): there one warpgroup's dK and dV of its own keys
    (64 x 256 float32 each) would take all of its registers."""
    return d > COMPUTE_WGS * 64


#: Columns of one dQ product (and of the float32 staging tile it leaves through) at head dim 256.
WIDE_DQ_COLS = 64


def do_stages(d, stages):
    """Slots of the dO ring: `stages`, but one at head dim 256, where a second 32 KiB slot does not
    fit beside the two Q slots."""
    return 1 if wide(d) else stages


def dq_split(d, block_q):
    """How the two compute warpgroups share a query block's dQ = dS K: "columns" (head dim 128: each
    takes 64 columns, the 128-byte swizzle tile), "rows" (head dim 64 with 128-row query blocks: each
    takes 64 rows), or None (each computes a whole partial dQ over its own keys). Split either way,
    dQ is over both warpgroups' keys, so it needs both warpgroups' dS in shared memory (a rendezvous
    per step), but half the accumulator registers and half the float32 adds to global memory."""
    if d % (COMPUTE_WGS * 64) == 0:
        return "columns"
    if d == 64 and block_q == COMPUTE_WGS * 64:
        return "rows"
    return None


def _staging_shape(d, block_q):
    """One compute warpgroup's float32 dQ staging tile: its share of a query block's dQ."""
    if wide(d):
        return block_q, WIDE_DQ_COLS
    split = dq_split(d, block_q)
    if split == "columns":
        return block_q, d // COMPUTE_WGS
    if split == "rows":
        return block_q // COMPUTE_WGS, d
    return block_q, d


def smem_bytes(d, itemsize, *, block_q, block_kv, stages):
    """Shared-memory buffers of one program: K and V of both warpgroups, the Q and dO rings, their
    LSE and delta slots, dS^T (at head dim 256, P^T too) and the float32 dQ staging tiles."""
    kv = 2 * COMPUTE_WGS * block_kv * d * itemsize
    rings = (stages + do_stages(d, stages)) * block_q * (d * itemsize + 4)
    ds = COMPUTE_WGS * block_kv * block_q * itemsize * (2 if wide(d) or dq_split(d, block_q) else 1)
    rows, cols = _staging_shape(d, block_q)
    return kv + rings + ds + COMPUTE_WGS * rows * cols * 4


def out_staging(d, itemsize, *, block_q, block_kv, stages, splits):
    """Whether dK and dV leave through the dQ staging tiles' memory (a union of the two) rather than
    through the K and V tiles: where they are bf16 or fp16 (one split) and the union fits. The K and
    V tiles are then free as soon as a walk ends, so the next item's K and V load while this item's
    dK and dV are stored."""
    rows, cols = _staging_shape(d, block_q)
    grown = max(0, 2 * block_kv * d * itemsize - rows * cols * 4) * COMPUTE_WGS
    need = smem_bytes(d, itemsize, block_q=block_q, block_kv=block_kv, stages=stages) + grown
    return splits == 1 and not wide(d) and need <= SMEM_BYTES - SMEM_RESERVE


def _check(q, k, v, do, lse_log2, delta, dq_accum, *, scale, diag_offset, window, softcap, block_q, block_kv,
           stages, row_tile=1):
    """Raises ValueError naming the argument, its value, what is expected and a hint. lse_log2 and
    delta have L rounded up to a multiple of `row_tile` rows."""
    check_arrays(q, k, v, head_dims=BACKWARD_HEAD_DIMS)
    check_backward_operands(q, do, lse_log2, delta, dq_accum, row_tile=row_tile)
    d = q.shape[3]
    check_blocks(block_q, block_kv, stages, kv_multiple=32 if wide(d) else 64)
    if wide(d) and (block_q, block_kv) != (64, 32):
        raise ValueError(f"block_q={block_q}, block_kv={block_kv} at head dim {d}: expected 64 and 32 (the two "
                         "warpgroups share an item's 64 keys, each taking 32 of a query block's 64 rows); hint: "
                         "calls.hopper_tiles('backward', 256, ...)")
    need = smem_bytes(d, jnp.dtype(q.dtype).itemsize, block_q=block_q, block_kv=block_kv, stages=stages)
    if need > SMEM_BYTES - SMEM_RESERVE:
        raise ValueError(f"stages={stages}, block_q={block_q}, block_kv={block_kv}, head_dim={d}: {need} bytes "
                         f"of shared-memory buffers, expected at most {SMEM_BYTES - SMEM_RESERVE}; hint: fewer "
                         "stages or smaller blocks")
    check_features(q.shape[2], scale=scale, diag_offset=diag_offset, window=window, softcap=softcap, sinks=None)


class _Settings(NamedTuple):
    """What the kernel compiles in (static): scale, mask rule, tiles, GQA group, query blocks.

    Row i sees keys i + diag_offset - left <= j <= i + diag_offset + right (None: that side
    unbounded; causal is right = 0) and j < kv_len."""
    scale: float
    diag_offset: int
    left: int | None
    right: int | None
    kv_len: int
    softcap: float | None
    block_q: int
    block_kv: int
    stages: int
    out_staging: bool  # dK and dV leave through the dQ staging tiles' memory (`out_staging`)
    wide: bool  # the warpgroups share an item's keys and split its columns (`wide`)
    do_stages: int  # slots of the dO (and delta) ring (`do_stages`)
    group: int  # query heads per KV head
    batches: int  # query batches per KV batch (`batch_group`: (batch, head) pairs folded into the batch)
    splits: int  # items per (KV batch and head, key block) that share its query sources (`head_splits`)
    cluster: int  # programs per cluster, walking adjacent key blocks in step (`_Item`; 1 or 2)
    num_q_blocks: int
    items: _Items
    interpret: object  # interpret-mode parameters, or None on the GPU

    @property
    def ragged_end(self):
        """Whether the last program holds padding keys (kv_len and up) to mask."""
        return self.kv_len % (COMPUTE_WGS * self.block_kv) != 0

    @property
    def sources(self):
        """Query (batch, head) pairs that read one KV (batch, head): source s is query batch
        b * batches + s // group and head h * group + s % group of KV batch b and head h."""
        return self.batches * self.group

    @property
    def sources_per_item(self):
        return self.sources // self.splits


def _program(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *, cfg: _Settings):
    d, dtype = q_ref.shape[-1], q_ref.dtype
    block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    if cfg.wide:
        _program_wide(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, cfg=cfg)
        return
    # 128-byte rows in 128-byte swizzled tiles, the layout TMA writes and wgmma reads without bank
    # conflicts (as in the forward).
    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    smem = (
        plgpu.SMEM((COMPUTE_WGS, block_kv, d), dtype, **tiled),  # K, then dK
        plgpu.SMEM((COMPUTE_WGS, block_kv, d), dtype, **tiled),  # V, then dV
        plgpu.SMEM((stages, block_q, d), dtype, **tiled),  # Q ring
        plgpu.SMEM((stages, block_q, d), dtype, **tiled),  # dO ring
        plgpu.SMEM((stages, block_q), jnp.float32),  # LSE ring
        plgpu.SMEM((stages, block_q), jnp.float32),  # delta ring
        # dS^T of each warpgroup; with dQ split, two buffers by step parity (the other warpgroup may
        # still read the previous step's).
        plgpu.SMEM(((2,) if dq_split(d, block_q) else ()) + (COMPUTE_WGS, block_kv, block_q), dtype, **tiled),
        _staging(d, dtype, block_q, block_kv, cfg.out_staging, tiled, on_gpu=cfg.interpret is None),
    )
    barriers = dict(_ring_barriers(cfg), ds_ready=plgpu.Barrier(num_arrivals=COMPUTE_WGS))
    refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref)
    pl.run_scoped(lambda bufs, bars: _warpgroups(refs, bufs, bars, cfg), smem, barriers, collective_axes="wg")


def _ring_barriers(cfg: _Settings):
    """The barriers of the K and V loads (one per compute warpgroup, K and V apart so both load at
    once) and of the Q, dO, LSE and delta rings (ready per slot; free per slot, one arrival per
    compute warpgroup)."""
    stages, do_slots = cfg.stages, cfg.do_stages
    if cfg.cluster > 1 and cfg.interpret is None:
        # A slot is refilled by a load multicast to every program of the cluster: all of them must
        # have read it. (The interpreter has no cluster barriers, and there every program loads whole
        # blocks itself: its own readers are all a slot waits for.)
        free = functools.partial(plgpu.ClusterBarrier, collective_axes=("pair",))
    else:
        free = plgpu.Barrier
    return dict(
        k_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        v_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        q_ready=plgpu.Barrier(num_barriers=stages),
        do_ready=plgpu.Barrier(num_barriers=do_slots),
        lse_ready=plgpu.Barrier(num_barriers=stages),
        delta_ready=plgpu.Barrier(num_barriers=do_slots),
        q_free=free(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        do_free=free(num_arrivals=COMPUTE_WGS, num_barriers=do_slots),
    )


def _program_wide(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, *, cfg: _Settings):
    """`_program` at head dim 256 (`flash_bwd_mgpu_wide.py`): the item's K and V in column halves (each
    compute warpgroup loads and stores one: a TMA copy wants contiguous shared memory), one dO slot,
    P^T and dS^T tiles both warpgroups write half of. 64-byte swizzle throughout: a warpgroup's 32
    query rows of P^T and dS^T are whole 64-byte tiles, and wgmma wants both operands in one swizzle."""
    d, dtype = q_ref.shape[-1], q_ref.dtype
    block_q, keys, stages, do_slots = cfg.block_q, COMPUTE_WGS * cfg.block_kv, cfg.stages, cfg.do_stages
    tiled = dict(transforms=(plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(64)))
    smem = (
        plgpu.SMEM((COMPUTE_WGS, keys, d // COMPUTE_WGS), dtype, **tiled),  # K by column halves, then dK
        plgpu.SMEM((COMPUTE_WGS, keys, d // COMPUTE_WGS), dtype, **tiled),  # V, then dV
        plgpu.SMEM((stages, block_q, d), dtype, **tiled),  # Q ring
        plgpu.SMEM((do_slots, block_q, d), dtype, **tiled),  # dO ring
        plgpu.SMEM((stages, block_q), jnp.float32),  # LSE ring
        plgpu.SMEM((do_slots, block_q), jnp.float32),  # delta ring (with dO)
        plgpu.SMEM((2, keys, block_q), dtype, **tiled),  # P^T and dS^T
        plgpu.SMEM((COMPUTE_WGS, *_staging_shape(d, block_q)), jnp.float32),  # dQ staging, per warpgroup
    )
    barriers = dict(
        _ring_barriers(cfg),
        pds_ready=plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # both halves of P^T and dS^T written
        pds_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # both warpgroups done reading them
        kv_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # both done reading an item's K and V
    )
    refs = (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref)
    pl.run_scoped(lambda bufs, bars: _warpgroups(refs, bufs, bars, cfg), smem, barriers, collective_axes="wg")


def _staging(d, dtype, block_q, block_kv, union, tiled, *, on_gpu):
    """The float32 dQ staging tile of each compute warpgroup; with `union`, sharing its memory with
    each warpgroup's dK and dV tiles (2, block_kv, d) on their way out (warpgroup w's tiles lie in
    its own staging tile's bytes: both arrays lead with the warpgroup). Mosaic GPU's interpreter
    (jax 0.10 to 0.11) has no unions: there the two are apart, in the same order of use."""
    staging = plgpu.SMEM((COMPUTE_WGS, *_staging_shape(d, block_q)), jnp.float32)
    if not union:
        return staging
    out = plgpu.SMEM((COMPUTE_WGS, 2, block_kv, d), dtype, **tiled)
    return plgpu.RefUnion(staging, out) if on_gpu else (staging, out)


def _warpgroups(refs, bufs, bars, cfg: _Settings):
    program, wg = lax.axis_index("programs"), lax.axis_index("wg")
    if cfg.interpret is None:
        # Programmatic dependent launch, as in the forward: every global read and write below waits
        # for the kernel before this one; the kernel after this one may take the multiprocessors
        # this grid leaves.
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
    # A program's place in its cluster, read here once: Mosaic GPU's interpreter (jax 0.10) cannot
    # lower a cluster index taken inside a loop's body.
    rank = lax.axis_index("pair") if cfg.cluster > 1 else 0

    @pl.when(wg < COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(240, action="increase")
        if cfg.wide:
            from .flash_bwd_mgpu_wide import compute_wide

            compute_wide(refs, bufs, bars, cfg, program=program, wg=wg)
        else:
            _compute(refs, bufs, bars, cfg, program=program, wg=wg, rank=rank)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(24, action="decrease")
        _memory(refs, bufs, bars, cfg, program=program, rank=rank)


def _memory(refs, bufs, bars, cfg: _Settings, *, program, rank):
    block_q, stages, do_slots = cfg.block_q, cfg.stages, cfg.do_stages
    q_ref, _, _, do_ref, lse_ref, delta_ref = refs[:6]
    _, _, q_smem, do_smem, lse_smem, delta_smem = bufs[:6]
    pair = "pair" if cfg.cluster > 1 else None  # Q and dO multicast to the cluster (LSE, delta: each its own)

    def item(j, loaded):
        """Streams the j-th item's query blocks; `loaded` counts the blocks of the earlier items (block
        number n goes to ring slot n % stages: the ring runs on from item to item)."""
        it = _item(program, j, cfg, rank)

        @pl.loop(0, it.steps(cfg))
        def _(step):
            n = loaded + step
            slot = lax.rem(n, jnp.int32(stages))
            do_slot = slot if do_slots == stages else lax.rem(n, jnp.int32(do_slots))
            q_batch, head, rows = it.block(step, cfg)
            block = (q_batch, pl.ds(rows, block_q), head)
            vector = (q_batch, head, pl.ds(rows, block_q))

            @pl.when(n >= stages)  # the slot's previous block must have been read by both
            @jax.named_scope("slot_wait")
            def _():
                plgpu.barrier_wait(bars["q_free"].at[slot])
            plgpu.copy_gmem_to_smem(q_ref.at[block], q_smem.at[slot], bars["q_ready"].at[slot], collective_axes=pair)
            plgpu.copy_gmem_to_smem(lse_ref.at[vector], lse_smem.at[slot], bars["lse_ready"].at[slot])

            @pl.when(n >= do_slots)
            @jax.named_scope("do_slot_wait")
            def _():
                plgpu.barrier_wait(bars["do_free"].at[do_slot])
            plgpu.copy_gmem_to_smem(do_ref.at[block], do_smem.at[do_slot], bars["do_ready"].at[do_slot],
                                    collective_axes=pair)
            plgpu.copy_gmem_to_smem(delta_ref.at[vector], delta_smem.at[do_slot], bars["delta_ready"].at[do_slot])
        return loaded + it.steps(cfg)

    loaded = lax.fori_loop(0, cfg.items.count(program), item, jnp.int32(0))

    # Observe the last releases too, so that every barrier phase is consumed before the barriers go.
    @pl.loop(jnp.maximum(loaded - stages, 0), loaded)
    def _(n):
        plgpu.barrier_wait(bars["q_free"].at[lax.rem(n, jnp.int32(stages))])

    @pl.loop(jnp.maximum(loaded - do_slots, 0), loaded)
    def _(n):
        plgpu.barrier_wait(bars["do_free"].at[lax.rem(n, jnp.int32(do_slots))])


# Mosaic GPU's interpreter (jax 0.10 to 0.11) has no layouts, no wgmma on a transposed or register
# operand and no TMA reduction: under `on_gpu=False` the helpers below compute the same products as
# plain dots on the same shared-memory slots, and each warpgroup adds its partial dQ by
# read-modify-write into a buffer of its own (`_store_dq`).
def _layout(x, *, on_gpu, reduce=None):
    if not on_gpu:
        return x
    layout = plgpu.Layout.WGMMA if reduce is None else plgpu.Layout.WGMMA.reduce(reduce)
    return plgpu.layout_cast(x, layout)


def _load_vector(ref, *, on_gpu):
    """A block_q vector laid out along the columns of a (block_kv, block_q) wgmma accumulator."""
    if not on_gpu:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))


class _T(NamedTuple):
    """A shared-memory operand read transposed."""
    ref: object


def _value(x):
    """An operand as an array (interpreter path)."""
    if isinstance(x, _T):
        return x.ref[...].T
    return x if isinstance(x, jax.Array) else x[...]


def _mma(*terms, on_gpu):
    """[acc + a @ b for (acc, a, b) in terms], float32, issued together and waited for once.

    acc: an accumulator array, or a (rows, cols) shape for a fresh zero one. a: 16-bit registers (in
    the wgmma layout) or a shared-memory ref; b: a shared-memory ref; either ref may be `_T(ref)`.
    a and b may also be equal-length tuples: acc + sum of a_i @ b_i."""
    def init(acc):
        return _layout(jnp.zeros(acc, jnp.float32), on_gpu=on_gpu) if isinstance(acc, tuple) else acc

    terms = [(acc, a, b) if type(a) is tuple else (acc, (a,), (b,)) for acc, a, b in terms]  # _T is a tuple too
    if not on_gpu:
        return [init(acc) + sum(lax.dot(_value(x), _value(y), preferred_element_type=jnp.float32) for x, y in zip(a, b))
                for acc, a, b in terms]

    def operand(x):
        return plgpu.transpose_ref(x.ref, (1, 0)) if isinstance(x, _T) else x

    def issue(acc_refs):
        for acc_ref, (_, a, b) in zip(acc_refs, terms):
            for x, y in zip(a, b):
                plgpu.wgmma(acc_ref, operand(x), operand(y))
    return list(pl.run_state(issue)(tuple(plgpu.ACC.init(init(acc)) for acc, _, _ in terms)))


def _compute(refs, bufs, bars, cfg: _Settings, *, program, wg, rank):
    scale, interpret = cfg.scale, cfg.interpret
    block_q, block_kv, stages = cfg.block_q, cfg.block_kv, cfg.stages
    _, k_ref, v_ref, _, _, _, dq_ref, dk_ref, dv_ref = refs
    k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, ds_all, staging = bufs
    if cfg.out_staging:
        dq_smem, out_smem = staging
        out_smem = out_smem.at[wg]
    else:
        dq_smem = staging
    k_smem, v_smem, dq_smem = k_all.at[wg], v_all.at[wg], dq_smem.at[wg]
    d, dtype = k_smem.shape[-1], k_smem.dtype
    split = dq_split(d, block_q)
    on_gpu = interpret is None
    # With a soft cap the exponent is softcap * log2(e) * tanh(scale / softcap * s) (as in the forward).
    scale_log2 = (scale if cfg.softcap is None else cfg.softcap) * LOG2E
    early_cap_factor = cfg.softcap is not None and block_q * block_kv > EARLY_CAP_FACTOR_MIN_SCORES

    items = cfg.items.count(program)

    def part_of(w):
        """The interpreter's dQ buffer of warpgroup w (`_store_dq`): one per warpgroup of the cluster,
        whose programs the interpreter runs at once."""
        return rank * COMPUTE_WGS + w
    # Whether the K and V tiles are never the source of a store (dK and dV leave through the staging
    # tiles): then the next item's K and V load as soon as this item's walk has read them.
    early_kv = cfg.out_staging or cfg.splits > 1

    def load_kv(j):
        """Starts the loads of this warpgroup's K and V tiles of item j, both at once (a short walk, a
        few query blocks, waits for one load, not two in turn)."""
        it = _item(program, j, cfg, rank)
        kv_block = (it.batch, pl.ds(it.kv_start + wg * block_kv, block_kv), it.kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_block], k_smem, bars["k_ready"].at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_block], v_smem, bars["v_ready"].at[wg])

    def item(j, loaded):
        """The j-th item; `loaded` counts the query blocks of the earlier ones, as the memory warpgroup
        does: step `step` reads ring slot (loaded + step) % stages."""
        it = _item(program, j, cfg, rank)
        batch, kv_head, part = it.batch, it.kv_head, it.part
        keys = it.kv_start + wg * block_kv
        if early_kv:  # loaded as the last item's walk ended (the first item's now)
            pl.when(j == 0)(lambda: load_kv(j))
        else:
            if on_gpu:
                @pl.when(j > 0)  # the last item's dK and dV stores have read the K and V tiles
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            load_kv(j)
        with jax.named_scope("kv_wait"):
            plgpu.barrier_wait(bars["k_ready"].at[wg])
            plgpu.barrier_wait(bars["v_ready"].at[wg])

        def q_step(step, carry, *, masked):
            dk, dv = carry
            n = loaded + step  # the block's number in the ring's run
            slot = lax.rem(n, jnp.int32(stages))
            own = _per_step(wg, n)  # == wg; see `_per_step`
            k_smem, v_smem = k_all.at[own], v_all.at[own]
            q_batch, head, rows = it.block(step, cfg)
            with jax.named_scope("q_wait"):
                plgpu.barrier_wait(bars["q_ready"].at[slot])
                plgpu.barrier_wait(bars["lse_ready"].at[slot])
                plgpu.barrier_wait(bars["do_ready"].at[slot])
            q_slot, do_slot = q_smem.at[slot], do_smem.at[slot]
            # S^T = K Q^T and dP^T = V dO^T: both (block_kv, block_q), issued together.
            with jax.named_scope("s_dp"):
                s_t, dp_t = _mma(((block_kv, block_q), k_smem, _T(q_slot)),
                                 ((block_kv, block_q), v_smem, _T(do_slot)), on_gpu=on_gpu)
            with jax.named_scope("softmax"):
                lse = _load_vector(lse_smem.at[slot], on_gpu=on_gpu)
                if early_cap_factor:
                    s_t = t = _tanh_cap(s_t, cfg)
                    cap_grad = None
                else:
                    s_t, cap_grad = _soft_cap(s_t, cfg)
                p_t = jnp.exp2(s_t * scale_log2 - lax.broadcast_in_dim(lse, s_t.shape, [1]))
                if masked:
                    p_t = _hide(p_t, rows, keys, cfg, on_gpu=on_gpu)
                p16 = p_t.astype(dtype)
                if early_cap_factor:  # P^T (1 - t^2): one multiply and one FMA, and t dies here
                    p_t = p_t - (p_t * t) * t
                plgpu.barrier_wait(bars["delta_ready"].at[slot])
                delta = _load_vector(delta_smem.at[slot], on_gpu=on_gpu)
                ds16 = _capped(_ds(p_t, dp_t, delta, scale), cap_grad).astype(dtype)
            dq_rows = (q_batch, pl.ds(rows, block_q), head)
            if not split:
                # dS^T to shared memory, where the dQ product reads it transposed.
                ds_smem = ds_all.at[wg]
                with jax.named_scope("ds_store"):
                    ds_smem[...] = ds16
                    plgpu.commit_smem()
                # dV += P^T dO, dK += dS^T Q, and this warpgroup's keys' share of dQ, dS K: issued together.
                with jax.named_scope("dv_dk_dq"):
                    dv, dk, dq = _mma((dv, p16, do_slot), (dk, ds16, q_slot), ((block_q, d), _T(ds_smem), k_smem),
                                      on_gpu=on_gpu)
                plgpu.barrier_arrive(bars["do_free"].at[slot])
                plgpu.barrier_arrive(bars["q_free"].at[slot])
                _store_dq(dq, dq_smem, dq_ref.at[dq_rows if on_gpu else (part_of(wg), *dq_rows)], on_gpu=on_gpu)
                return dk, dv
            ds_both = ds_all.at[lax.rem(n, 2)]
            with jax.named_scope("ds_store"):
                ds_both.at[wg][...] = ds16
                plgpu.commit_smem()
                plgpu.barrier_arrive(bars["ds_ready"])
            with jax.named_scope("dv_dk"):
                dv, dk = _mma((dv, p16, do_slot), (dk, ds16, q_slot), on_gpu=on_gpu)
            plgpu.barrier_arrive(bars["do_free"].at[slot])
            with jax.named_scope("ds_wait"):  # the other warpgroup's dS^T is in shared memory too
                plgpu.barrier_wait(bars["ds_ready"])
            assert COMPUTE_WGS == 2
            for w in range(COMPUTE_WGS):  # static slices (swizzle tiles), one branch per warpgroup
                @pl.when(wg == w)
                def _():
                    # (Indices derived from wg: Mosaic GPU in jax 0.11 rejects constant ones into these refs.)
                    both = (own, 1 - own)
                    if split == "columns":  # dQ[:, cols] = dS K[:, cols]
                        cols = pl.ds(w * (d // 2), d // 2)
                        ds_parts = tuple(_T(ds_both.at[u]) for u in both)
                        k_parts = tuple(k_all.at[u, :, cols] for u in both)
                        target = (*dq_rows, cols)
                    else:  # dQ[rows] = dS[rows] K: the rows are columns of dS^T
                        half = pl.ds(w * (block_q // 2), block_q // 2)
                        ds_parts = tuple(_T(ds_both.at[u, :, half]) for u in both)
                        k_parts = tuple(k_all.at[u] for u in both)
                        target = (q_batch, pl.ds(rows + w * (block_q // 2), block_q // 2), head)
                    with jax.named_scope("dq"):
                        dq, = _mma((dq_smem.shape, ds_parts, k_parts), on_gpu=on_gpu)
                    _store_dq(dq, dq_smem, dq_ref.at[target if on_gpu else (part_of(w), *target)], on_gpu=on_gpu)
            plgpu.barrier_arrive(bars["q_free"].at[slot])
            return dk, dv

        def skip_step(step, carry):
            """A query block only the cluster's other program's keys see: its loads are waited for
            (every barrier phase is consumed, and the slot is released only once its data is in)."""
            slot = lax.rem(loaded + step, jnp.int32(stages))
            for name in ("q_ready", "lse_ready", "do_ready", "delta_ready"):
                plgpu.barrier_wait(bars[name].at[slot])
            plgpu.barrier_arrive(bars["do_free"].at[slot])
            plgpu.barrier_arrive(bars["q_free"].at[slot])
            return carry

        zeros = _layout(jnp.zeros((block_kv, d), jnp.float32), on_gpu=on_gpu)
        dk, dv = _walk_item(it, cfg, q_step, (zeros, zeros), skip_step)
        with jax.named_scope("kv_out"):  # the walk ends: dK and dV leave
            if split:  # the other warpgroup's last dQ product reads this one's K: let it finish
                plgpu.barrier_arrive(bars["ds_ready"])
                plgpu.barrier_wait(bars["ds_ready"])
            if early_kv:
                pl.when(j + 1 < items)(lambda: load_kv(j + 1))
            out_block = (batch, pl.ds(keys, block_kv), kv_head)
            if cfg.out_staging:  # through the staging tile's memory, once the last dQ add has read it
                if on_gpu:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                out_smem.at[0][...] = dk.astype(dtype)
                out_smem.at[1][...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[0], dk_ref.at[out_block])
                plgpu.copy_smem_to_gmem(out_smem.at[1], dv_ref.at[out_block])
            elif cfg.splits == 1:  # K and V are no longer read: their tiles take dK and dV on the way out
                k_smem[...] = dk.astype(dtype)
                v_smem[...] = dv.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[out_block])
                plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[out_block])
            else:  # this split's float32 partial sums, column block by column block through the dQ staging tile
                width = dq_smem.shape[-1]
                for acc, out in ((dk, dk_ref), (dv, dv_ref)):
                    for c in range(0, d, width):
                        if on_gpu:
                            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile's previous copy has read it
                        dq_smem[...] = acc[:, c:c + width]
                        plgpu.commit_smem()
                        target = out.at[part, batch, pl.ds(keys, block_kv), kv_head, pl.ds(c, width)]
                        plgpu.copy_smem_to_gmem(dq_smem, target)
                        if not on_gpu:
                            plgpu.wait_smem_to_gmem(0)
            if not on_gpu:  # the interpreter's copies complete here (on the GPU the next item waits)
                plgpu.wait_smem_to_gmem(0)
        return loaded + it.steps(cfg)

    lax.fori_loop(0, items, item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)


def _per_step(index, step):
    """`index` (< 3), recomputed every step as (index + 3 step) mod 3, a form the compilers do not
    prove loop-invariant. K and V indexed by it keep their wgmma descriptors (one 64-bit value per
    operand and k-step of 16) inside the loop, a few uniform-register adds each step: hoisted out of
    the loop as invariants they held about 50 registers and spilled at head dim 128 (ptxas: 488
    bytes of spill stores, reloaded every step; the backward at (1, 16, 16384, 128) causal ran at
    484 TFLOP/s with them hoisted, 532 without)."""
    assert COMPUTE_WGS < 3
    return lax.rem(index + 3 * step, 3)


def _hide(p_t, rows, keys, cfg: _Settings, *, on_gpu):
    """p_t (keys [keys, keys + block_kv) x query rows [rows, rows + block_q)) with 0 where the key is
    hidden from the row: outside its band, or at kv_len and beyond (padding). In p_t's own indices
    (r, c) the band is keys - rows - (diag_offset + right) <= c - r <= keys - rows - (diag_offset -
    left), and the padding r >= kv_len - keys."""
    lo = None if cfg.right is None else keys - rows - (cfg.diag_offset + cfg.right)
    hi = None if cfg.left is None else keys - rows - (cfg.diag_offset - cfg.left)
    row_end = cfg.kv_len - keys if cfg.ragged_end else None
    return keep_band(p_t, fill=0.0, diff=1, lo=lo, hi=hi, row_end=row_end, on_gpu=on_gpu)


#: Scores a warpgroup holds (block_kv x block_q) above which the soft cap's factor 1 - t^2 is folded
#: into P^T as soon as P^T is converted for dV, instead of living as a third score tile beside P^T and
#: dP^T until dS^T (at head dim 64, 64 x 128 scores: 64 registers a thread a tile, where the compute
#: warpgroups' registers are tightest; not profiled). Backward alone, cap 30, causal bf16, H200, µs
#: cool / sustained, folded early / at dS^T (BENCHMARKS.md, "Groups by the bytes they share"): (4, 16,
#: 4096, 64) 964 / 969 against 1034 / 1045; at head dim 128 (64 x 64 scores) (2, 16, 8192, 128)
#: 2954 / 2985 against 2924 / 2956.
EARLY_CAP_FACTOR_MIN_SCORES = 64 * 64


def _soft_cap(s_t, cfg: _Settings):
    """(what the exponent scales, what dS is multiplied by): (s_t, None) without a cap; with one,
    t = tanh(scale / softcap * s_t) and d(softcap * t) / d(scale * s_t) = 1 - t^2."""
    if cfg.softcap is None:
        return s_t, None
    t = _tanh_cap(s_t, cfg)
    return t, 1.0 - t * t


def _tanh_cap(s_t, cfg: _Settings):
    """t = tanh(scale / softcap * s_t): what the exponent scales under a cap."""
    return jnp.tanh(s_t * (cfg.scale / cfg.softcap))


def _ds(p_t, dp_t, delta, scale):
    """dS^T = scale P^T (dP^T - delta) without the soft cap, as P^T (scale dP^T - scale delta): one FMA
    and one multiply a score (the scale taken by the delta vector), not a subtraction and two
    multiplies."""
    return p_t * (dp_t * scale - lax.broadcast_in_dim(delta * scale, dp_t.shape, [1]))


def _capped(ds, cap_grad):
    """dS through the soft cap's tanh (ds itself without a cap)."""
    return ds if cap_grad is None else ds * cap_grad


@jax.named_scope("dq_add")
def _store_dq(dq, dq_smem, dq_gmem, *, on_gpu):
    """dq_gmem += dq through the warpgroup's staging tile."""
    if on_gpu:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous add has read the tile
        dq_smem[...] = dq
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dq_smem, dq_gmem, reduction_op="add")
        return
    # The interpreter has no TMA reduction. It runs one program (one cluster) at a time, and each
    # warpgroup adds into its own buffer (`dq_gmem` is its slice), so a read-modify-write is exact.
    dq_smem[...] = dq_gmem[...] + dq
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(dq_smem, dq_gmem)
    plgpu.wait_smem_to_gmem(0)


def padded_lengths(l, s, *, block_q=64, block_kv=64, cluster=1):
    """(L, S) rounded up to the kernel's whole tiles: block_q query rows, cluster * 2 * block_kv keys."""
    keys = cluster * COMPUTE_WGS * block_kv
    return pl.cdiv(l, block_q) * block_q, pl.cdiv(s, keys) * keys


def _pad(x, length, axis, value=0):
    """x with `value` appended along `axis` up to `length` (x itself when it has that length)."""
    if x.shape[axis] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def flash_backward_mgpu(q, k, v, do, lse_log2, delta, dq_accum, *, scale, causal, diag_offset=0, block_q=64,
                        block_kv=64, stages=2, window=None, softcap=None, head_splits=1, programs=None, cluster=1,
                        interpret=None):
    """(dq_accum + dQ, dK, dV) of softmax(scale * q k^T [causal, window, soft cap]) v, any L, S >= 1;
    see the module docstring.

    Pads to whole tiles (no copy when they are whole already: then this is one Mosaic GPU kernel
    call and nothing else, so that `plgpu.as_torch_kernel` can launch it on torch tensors, dq_accum
    updated in place), runs the kernel and slices the padding off. `window`: (left, right), -1
    unbounded, or None. `softcap`: float or None (lse_log2 must then be the capped forward's).
    `head_splits`: programs per (KV head, key block), each walking Hq / Hk / head_splits of its group's
    query heads (a divisor of the group; more programs for a short GQA grid), whose float32 partial
    dK, dV are summed here. `programs`: None for one program per item (2 * block_kv keys of one KV
    head and split), or the size of a persistent grid (the GPU's multiprocessor count) whose
    programs walk the items in turn, the query-block ring running on from one to the next.
    `cluster`: 1, or 2 for clusters of two programs taking adjacent key blocks, which load each
    query block once for both (`_Item`; `programs` then even, head dim 64 or 128).
    `interpret`: Mosaic GPU interpret-mode parameters to run on a CPU, or None
    to compile for the GPU."""
    _check(q, k, v, do, lse_log2, delta, dq_accum, scale=scale, diag_offset=diag_offset, window=window,
           softcap=softcap, block_q=block_q, block_kv=block_kv, stages=stages)
    l, s = q.shape[1], k.shape[1]
    rows, keys = padded_lengths(l, s, block_q=block_q, block_kv=block_kv, cluster=cluster)
    # Padded query rows: zero q and do, +inf LSE (their probabilities are 0) and zero delta, so they
    # add nothing to dK, dV; padded keys (zero K, V) are masked as keys >= kv_len.
    q, do, dq_accum = (_pad(x, rows, 1) for x in (q, do, dq_accum))
    lse_log2, delta = _pad(lse_log2, rows, 2, jnp.inf), _pad(delta, rows, 2)
    k, v = _pad(k, keys, 1), _pad(v, keys, 1)
    dq, dk, dv = _launch(q, k, v, do, lse_log2, delta, dq_accum, cfg=_settings(
        q, k, scale=scale, causal=causal, diag_offset=diag_offset, window=window, softcap=softcap, kv_len=s,
        block_q=block_q, block_kv=block_kv, stages=stages, head_splits=head_splits, programs=programs,
        cluster=cluster, interpret=interpret))
    if head_splits > 1:
        dk, dv = dk.sum(0).astype(k.dtype), dv.sum(0).astype(v.dtype)
    if rows != l:
        dq = dq[:, :l]
    if keys != s:
        dk, dv = dk[:, :s], dv[:, :s]
    return dq, dk, dv


def flash_backward_mgpu_tiles(q, k, v, do, lse_log2, delta, dq_accum, *, scale, causal, kv_len=None, diag_offset=0,
                              block_q=64, block_kv=64, stages=2, window=None, softcap=None, head_splits=1,
                              programs=None, cluster=1, tma_edges=False, interpret=None):
    """`flash_backward_mgpu` on whole tiles: L a multiple of block_q, S of 2 * block_kv (see
    `padded_lengths`), keys from `kv_len` on (default S: none) masked as padding. Padded query rows
    must hold lse_log2 = +inf and delta = 0 (they then add nothing to dK, dV; their dQ is computed
    and left to the caller to drop); padding must be finite (zeros, say). One Mosaic GPU kernel call
    and nothing else, so that `plgpu.as_torch_kernel` can launch a function that calls this on torch
    tensors. With `head_splits` > 1, dK and dV come as float32 partial sums (head_splits, B, S, Hk, D)
    for the caller to sum.

    `tma_edges` (GPU only): L and S any multiples of 8 instead, read in place (dq_accum of L rows
    too). The last tiles run past them: TMA fills the rows it loads past an array's end with zeros
    and drops the rows it stores or adds there. Keys past S are masked as padding is. lse_log2 and
    delta keep whole tiles' rows, (B, Hq, L') for L' = L rounded up to a multiple of block_q, with
    +inf and 0 past L: a 1-D copy past the end of one (batch, head) row would run on into the next
    one's."""
    _check(q, k, v, do, lse_log2, delta, dq_accum, scale=scale, diag_offset=diag_offset, window=window,
           softcap=softcap, block_q=block_q, block_kv=block_kv, stages=stages, row_tile=block_q)
    kv_len = k.shape[1] if kv_len is None else kv_len
    check_whole_tiles(q.shape[1], k.shape[1], kv_len, block_q, block_kv, rows=("block_q", block_q),
                      keys=("2 * block_kv", COMPUTE_WGS * block_kv), caller="flash_backward_mgpu",
                      tma_edges=tma_edges, interpret=interpret)
    return _launch(q, k, v, do, lse_log2, delta, dq_accum, cfg=_settings(
        q, k, scale=scale, causal=causal, diag_offset=diag_offset, window=window, softcap=softcap,
        kv_len=int(kv_len), block_q=block_q, block_kv=block_kv, stages=stages, head_splits=head_splits,
        programs=programs, cluster=cluster, interpret=interpret))


#: Largest head dim whose persistent grid takes its groups of KV heads by the bytes they share too
#: (`persistent_waves.waves`' `column_bytes`). Backward alone under sustained load, causal bf16, H200,
#: µs, groups by bytes / filling a wave (BENCHMARKS.md, "Groups by the bytes they share"): (1, 8192, 32/8 heads, 64)
#: 1507 / 1570, (2, 4096, 32/8, 64) 798 / 792; at head dim 128, where a score costs twice the
#: products, (1, 8192, 16/8, 128) 1387 / 1379: the programs a smaller group leaves idle cost more
#: than its DRAM reads saved.
GROUPS_BY_BYTES_MAX_HEAD_DIM = 64


def _settings(q, k, *, scale, causal, diag_offset, window, softcap, kv_len, block_q, block_kv, stages, head_splits,
              programs, cluster, interpret):
    """The kernel's static settings for checked arguments (whole tiles, or the last ones running past L
    and S with `tma_edges`)."""
    group, batches = q.shape[2] // k.shape[2], batch_group(q, k)
    if not (isinstance(head_splits, int) and head_splits >= 1 and (group * batches) % head_splits == 0):
        raise ValueError(f"head_splits={head_splits!r}: expected a positive divisor of the query heads per KV head "
                         f"(Hq / Hk = {group}, times query batches per KV batch {batches}); hint: 1 walks them all "
                         "in one item")
    staging_rows = _staging_shape(q.shape[3], block_q)[0]
    if head_splits > 1 and staging_rows != block_kv * (COMPUTE_WGS if wide(q.shape[3]) else 1):
        raise ValueError(f"head_splits={head_splits} with block_q={block_q}, block_kv={block_kv}, head dim "
                         f"{q.shape[3]}: expected a dQ staging tile of block_kv rows (it has {staging_rows}; the "
                         "partial dK, dV leave through it); hint: block_q == block_kv, or head_splits=1")
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    _check_cluster(cluster, programs, q.shape[3], k.shape[1], block_kv)
    b, columns = k.shape[0], k.shape[2] * head_splits
    key_blocks = pl.cdiv(k.shape[1], cluster * COMPUTE_WGS * block_kv)  # a cluster's adjacent blocks
    programs = None if programs is None else programs // cluster  # clusters
    # What the items of one column share (each reads all of it): its query sources' Q, dO and float32 dQ.
    column_bytes = 0 if q.shape[3] > GROUPS_BY_BYTES_MAX_HEAD_DIM else (
        (group * batches // head_splits) * q.shape[1] * q.shape[3] * (2 * jnp.dtype(q.dtype).itemsize + 4))
    dealing = waves(b * columns * key_blocks, programs, columns=b * columns, column_bytes=column_bytes)
    return _Settings(scale=float(scale), diag_offset=int(diag_offset), left=None if left < 0 else int(left),
                     right=None if right < 0 else int(right), kv_len=kv_len,
                     softcap=None if softcap is None else float(softcap), block_q=block_q, block_kv=block_kv,
                     stages=stages, group=group, batches=batches, splits=head_splits, cluster=cluster,
                     wide=wide(q.shape[3]),
                     do_stages=do_stages(q.shape[3], stages),
                     out_staging=out_staging(q.shape[3], jnp.dtype(q.dtype).itemsize, block_q=block_q,
                                             block_kv=block_kv, stages=stages, splits=head_splits),
                     num_q_blocks=pl.cdiv(q.shape[1], block_q),
                     items=_Items(batch=b, columns=columns, waves=dealing),
                     interpret=interpret)


def _check_cluster(cluster, programs, d, s, block_kv):
    """Raises ValueError naming `cluster` unless it is 1, or 2 where two programs can pair up."""
    if cluster == 1:
        return
    reason = None
    if cluster != 2 or isinstance(cluster, bool):
        reason = "expected 1 or 2 (programs per cluster)"
    elif wide(d):
        reason = f"head dim {d}: clusters are for head dims 64 and 128"
    elif programs is not None and programs % 2:
        reason = f"programs={programs}: a persistent grid of clusters of two needs an even size"
    elif s % (cluster * COMPUTE_WGS * block_kv):
        reason = (f"S={s}: expected a multiple of cluster * 2 * block_kv = {cluster * COMPUTE_WGS * block_kv} "
                  "(`padded_lengths` with the cluster)")
    if reason:
        raise ValueError(f"cluster={cluster!r}: {reason}; hint: cluster=1")


def _launch(q, k, v, do, lse_log2, delta, dq_accum, *, cfg: _Settings):
    """The kernel call on whole tiles (arguments checked)."""
    interpret = cfg.interpret
    # With clusters, "programs" numbers the clusters and "pair" a program's place in its cluster.
    clusters = dict(cluster=(cfg.cluster,), cluster_names=("pair",)) if cfg.cluster > 1 else {}
    mesh = plgpu.Mesh(grid=(cfg.items.programs,), grid_names=("programs",), num_threads=COMPUTE_WGS + 1,
                      thread_name="wg", **clusters)
    if cfg.splits == 1:
        grads_kv = (jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype))
    else:  # float32 partial sums per split (every element written by one program)
        grads_kv = (jax.ShapeDtypeStruct((cfg.splits, *k.shape), jnp.float32),
                    jax.ShapeDtypeStruct((cfg.splits, *v.shape), jnp.float32))
    kernel = functools.partial(pl.kernel, mesh=mesh,
                               compiler_params=compiler_params(interpret=interpret, approx_math=True))
    if interpret is None:  # dq_accum goes in as a mutable ref: the kernel adds into it in place
        run = kernel(lambda *refs: _program(*refs, cfg=cfg), out_type=grads_kv)
        dq_ref = jax.new_ref(dq_accum)
        dk, dv = run(q, k, v, do, lse_log2, delta, dq_ref)
        return dq_ref[...], dk, dv
    # The interpreter takes no mutable refs: one zero-initialised float32 output per compute
    # warpgroup of a cluster takes its partial sums instead (`_store_dq`).
    interpret = dataclasses.replace(interpret, uninitialized_memory="zero")
    parts = jax.ShapeDtypeStruct((cfg.cluster * COMPUTE_WGS, *q.shape), jnp.float32)
    run = kernel(lambda *r: _program(*r[:6], r[8], *r[6:8], cfg=cfg), out_type=(*grads_kv, parts),
                 interpret=interpret)
    dk, dv, dq_parts = run(q, k, v, do, lse_log2, delta)
    return dq_accum + dq_parts.sum(0), dk, dv
