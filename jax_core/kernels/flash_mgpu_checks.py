"""Argument checks of the Pallas Mosaic GPU flash kernels (flash_fwd_mgpu.py, flash_bwd_mgpu.py).

Every check raises a ValueError that names the argument, its value, what is expected and a hint.
Imports only JAX (for dtypes); no kernel code, so the kernel module stays about the kernel.
"""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

COMPUTE_WGS = 2
#: Compute warpgroups the forward may run per program, and the head dims at which it may run three
#: (three 64-row tiles at 160 registers a thread: the 64 x 64 accumulator beside the scores).
FORWARD_COMPUTE_WGS = (2, 3)
THREE_WG_HEAD_DIMS = (64,)
#: Head dims of the forward and of the backward (at 256 its two compute warpgroups share an item's keys
#: and split the head's columns: `flash_bwd_mgpu_wide.py`).
FORWARD_HEAD_DIMS = (64, 128, 256)
BACKWARD_HEAD_DIMS = (64, 128, 256)
#: Shared memory one thread block may use on sm90, and what the kernel keeps free of its buffers.
SMEM_BYTES = 232448
SMEM_RESERVE = 4096


def check_arrays(q, k, v, *, head_dims):
    """Layouts, dtypes and head counts of q (B, L, Hq, D), k and v (Bk, S, Hk, D), D one of `head_dims`
    (the kernel's): Bk = B, or Bk a divisor of B where a caller folds (batch, head) pairs into the batch
    with GQA (query batch b reads KV batch b // (B / Bk), `batch_group`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}.shape={x.shape}: expected (batch, length, heads, head_dim)")
        if x.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name}.dtype={x.dtype}: expected bfloat16 or float16 (wgmma operands); "
                             "cast float32 inputs first")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}: expected one dtype")
    b, l, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] < 1 or b % k.shape[0] or k.shape[3] != d:
        raise ValueError(f"k.shape={k.shape}, v.shape={v.shape}: expected both (Bk, S, Hk, D={d}) with Bk dividing "
                         f"q's batch B={b}; hint: Bk = B, or B = Bk * group where (batch, head) pairs are folded "
                         "into the batch with GQA")
    if l < 1 or k.shape[1] < 1:
        raise ValueError(f"query length L={l}, key length S={k.shape[1]}: expected both at least 1; "
                         "hint: skip the call for empty sequences")
    if d not in head_dims:
        raise ValueError(f"head_dim={d}: expected one of {head_dims}; hint: use the Triton flash kernel")
    if hq % k.shape[2]:
        raise ValueError(f"query heads {hq}, KV heads {k.shape[2]}: expected a multiple (GQA)")


def check_blocks(block_q, block_kv, stages, *, kv_multiple=64):
    """Tile sizes and pipeline depth (both kernels; the backward's key blocks at head dim 256 are
    32-key halves of a 64-row tile, `kv_multiple` 32)."""
    if block_q % 64 or block_kv % kv_multiple or block_q <= 0 or block_kv <= 0:
        raise ValueError(f"block_q={block_q}, block_kv={block_kv}: expected positive multiples of 64 and "
                         f"{kv_multiple} (a wgmma tile is 64 rows)")
    if stages < 2:
        raise ValueError(f"stages={stages}: expected at least 2 (one slot loading while one is read)")


def batch_group(q, k) -> int:
    """Query batches per KV batch: q's batch b reads k's and v's batch b // batch_group (1 unless a
    caller folds (batch, head) pairs into the batch with GQA: then query pair b * Hq + h reads KV pair
    b * Hk + h // (Hq / Hk), which is (b * Hq + h) // (Hq / Hk))."""
    return q.shape[0] // k.shape[0]


def _forward_buffers(d, itemsize, block_q, block_kv, stages, q_slots, compute_wgs):
    """Bytes of the forward's Q/O tiles and K and V rings; barriers and Mosaic's own scratch take a few
    KiB more (an H100 run of D=128, block_kv=128, stages=3: 229,888 bytes of buffers, 232,568 in all)."""
    return itemsize * (q_slots * compute_wgs * block_q * d + 2 * stages * block_kv * d)


def forward_q_slots(d, itemsize, block_q, block_kv, stages, tiles_per_program, compute_wgs=COMPUTE_WGS):
    """Q/O tiles per compute warpgroup in the forward: two where a program walks several tiles and they
    fit beside the rings (the next tile's Q loads while the last one's O is stored), else one (head dim
    256: two would take 128 KiB)."""
    fits = _forward_buffers(d, itemsize, block_q, block_kv, stages, 2, compute_wgs) <= SMEM_BYTES - SMEM_RESERVE
    return 2 if tiles_per_program > 1 and fits else 1


def check_compute_wgs(compute_wgs, d):
    """The forward's compute warpgroups per program at head dim `d`."""
    if compute_wgs not in FORWARD_COMPUTE_WGS or (compute_wgs == 3 and d not in THREE_WG_HEAD_DIMS):
        raise ValueError(f"compute_wgs={compute_wgs!r} at head_dim={d}: expected 2, or 3 at head dims "
                         f"{THREE_WG_HEAD_DIMS} (three accumulators of wider heads do not fit in the registers); "
                         "hint: compute_wgs=2")


def check_tiling(d, itemsize, block_q, block_kv, stages, q_slots=1, compute_wgs=COMPUTE_WGS):
    """The forward's tile sizes, pipeline depth and the shared memory they take, with `q_slots` Q/O
    tiles per compute warpgroup (`forward_q_slots`) and `compute_wgs` compute warpgroups
    (`check_compute_wgs`)."""
    check_blocks(block_q, block_kv, stages)
    buffers = _forward_buffers(d, itemsize, block_q, block_kv, stages, q_slots, compute_wgs)
    if buffers > SMEM_BYTES - SMEM_RESERVE:
        raise ValueError(f"stages={stages}, block_kv={block_kv}, head_dim={d}: {buffers} bytes of shared-memory "
                         f"buffers, expected at most {SMEM_BYTES - SMEM_RESERVE} (Hopper's {SMEM_BYTES} per block "
                         f"less {SMEM_RESERVE} for barriers and scratch); hint: fewer stages or a smaller block_kv")


#: Rows of the 8-row tiles that Mosaic GPU's tiled, swizzled copies move between global and shared
#: memory: with `tma_edges`, L and S must be whole numbers of them.
TMA_ROWS = 8


def check_whole_tiles(l, s, kv_len, block_q, block_kv, *, rows=None, keys=None, caller="flash_forward_mgpu",
                      tma_edges=False, interpret=None):
    """The kernels themselves stream whole tiles: L a multiple of `rows` (the forward: 2 * block_q,
    the default), S of `keys` (the forward: block_kv, the default), and kv_len (the true key count,
    keys past it masked) within the last key tile. `caller`: the padding entry the hints name.

    With `tma_edges`, the last query and key tiles may run past L and S instead: TMA zero-fills the
    rows of a load past an array's end and drops those of a store, which needs L and S in whole
    TMA_ROWS-row tiles, and a GPU (the interpreter refuses out-of-bounds copies)."""
    rows = ("2 * block_q", COMPUTE_WGS * block_q) if rows is None else rows
    keys = ("block_kv", block_kv) if keys is None else keys
    if tma_edges:
        if interpret is not None:
            raise ValueError("tma_edges=True with interpret-mode parameters: expected a GPU (the interpreter "
                             f"refuses copies past an array's end); hint: tma_edges=False, {caller} pads")
        if l % TMA_ROWS or s % TMA_ROWS:
            raise ValueError(f"query length L={l}, key length S={s} with tma_edges=True: expected multiples of "
                             f"{TMA_ROWS} (Mosaic GPU's tiled copies move whole {TMA_ROWS}-row tiles); hint: "
                             f"tma_edges=False and whole tiles, {caller} pads")
        rows, keys = (rows[0], TMA_ROWS), (keys[0], TMA_ROWS)
    if l % rows[1]:
        equals = f"{rows[0]} = {rows[1]}" if "*" in rows[0] else f"{rows[0]}={rows[1]}"
        raise ValueError(f"query length L={l}: expected a multiple of {equals}; hint: {caller} pads the "
                         "queries itself")
    if s % keys[1]:
        equals = f"{keys[0]} = {keys[1]}" if "*" in keys[0] else f"{keys[0]}={keys[1]}"
        raise ValueError(f"key length S={s}: expected a multiple of {equals}; hint: {caller} pads the keys "
                         "(and masks them) itself")
    if isinstance(kv_len, bool) or not (isinstance(kv_len, numbers.Integral) and s - keys[1] < kv_len <= s):
        raise ValueError(f"kv_len={kv_len!r}: expected an int in ({s - keys[1]}, {s}] (the true key count "
                         f"of keys padded to S={s}, less than one {keys[0]}={keys[1]} of padding)")


def check_features(hq, *, scale, diag_offset, window, softcap, sinks, batch=None):
    """Scale, diagonal offset, window, soft cap and sinks (all but sinks are compiled in); with `batch`,
    sinks may also be one logit per (batch, head) pair, (B, Hq)."""
    if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) and 0 < scale < math.inf):
        raise ValueError(f"scale={scale!r}: expected a positive Python float (it is compiled in)")
    if isinstance(diag_offset, bool) or not isinstance(diag_offset, numbers.Integral):
        raise ValueError(f"diag_offset={diag_offset!r}: expected a Python int (it is compiled in); hint: 0 "
                         "aligns the diagonal top-left, S - L bottom-right")
    if window is not None:
        ok = (isinstance(window, (tuple, list)) and len(window) == 2
              and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= -1 for w in window))
        if not ok:
            raise ValueError(f"window={window!r}: expected None or (left, right), two ints >= -1 (-1: "
                             "unbounded on that side); hint: (w, 0) is a causal sliding window of w + 1 keys")
    if softcap is not None and (isinstance(softcap, bool) or not (isinstance(softcap, numbers.Real)
                                                                 and 0 < softcap < math.inf)):
        raise ValueError(f"softcap={softcap!r}: expected None or a positive finite Python float (it is "
                         "compiled in); hint: None for no cap")
    if sinks is not None:
        shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
        shapes = [(hq,)] + ([] if batch is None else [(batch, hq)])
        if shape not in shapes or dtype != jnp.float32:
            per_batch = "" if batch is None else f" or (B, Hq) = ({batch}, {hq}), one per batch and head"
            raise ValueError(f"sinks of shape {shape} and dtype {dtype}: expected a float32 array of shape "
                             f"(Hq,) = ({hq},), one sink logit per query head{per_batch}; hint: "
                             "sinks.astype(jnp.float32)")


def check_backward_operands(q, do, lse_log2, delta, dq_accum, *, row_tile=1):
    """The backward's operands beside q, k, v: do like q, lse_log2 and delta (B, Hq, L') float32 for
    L' = L rounded up to a multiple of `row_tile` (the query block), dq_accum float32 of q's shape."""
    if do.shape != q.shape or do.dtype != q.dtype:
        raise ValueError(f"do: shape {do.shape} dtype {do.dtype}, expected q's shape {q.shape} and dtype {q.dtype}; "
                         "hint: cast the output gradient to the inputs' dtype")
    b, l, hq, _ = q.shape
    whole = -(-l // row_tile) * row_tile
    for name, x in (("lse_log2", lse_log2), ("delta", delta)):
        if x.shape != (b, hq, whole) or x.dtype != jnp.float32:
            raise ValueError(f"{name}: shape {x.shape} dtype {x.dtype}, expected float32 (B, Hq, L')={(b, hq, whole)} "
                             f"(L rounded up to whole {row_tile}-row query blocks); hint: backward_operands(out, do, "
                             "lse) makes both")
    if dq_accum.shape != q.shape or dq_accum.dtype != jnp.float32:
        raise ValueError(f"dq_accum: shape {dq_accum.shape} dtype {dq_accum.dtype}, expected float32 {q.shape}; "
                         "hint: jnp.zeros(q.shape, jnp.float32)")
