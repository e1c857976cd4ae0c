"""The Triton flash kernels as a differentiable JAX function, launched with jax-triton.

`flash_attention_triton(q, k, v, ...)` returns (out, lse) and has a custom VJP running the backward
kernels. jax-triton is imported when a kernel is launched (it needs a GPU build of jaxlib), so this
module imports on any machine.

Shape legend: B batch, Hq / Hk query / KV heads, L query length, S key length, D / Dv head dims.
Layout "BHTD" means (B, H, T, D) arrays, "BTHD" (B, T, H, D); the kernels read either through strides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from .flash_bwd_triton import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
from .flash_common_triton import dropout_mask_kernel
from .flash_fwd_triton import flash_fwd_kernel, fwd_block_sizes, head_block


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static settings of one flash call (hashable: part of the JAX trace)."""

    scale: float
    causal: bool = False
    diag_offset: int = 0  # S - L for bottom-right alignment, else 0
    window: tuple[int, int] = (-1, -1)  # (left, right); -1 = unbounded
    softcap: Optional[float] = None
    layout: str = "BHTD"
    # Backward tiles, ((BLOCK_M, BLOCK_N, num_warps, num_stages) of dK/dV, same of dQ); None: defaults.
    bwd_tiles: Optional[tuple[tuple[int, int, int, int], tuple[int, int, int, int]]] = None
    # Forward tile (BLOCK_M, BLOCK_N, num_warps, num_stages); None: `fwd_block_sizes` defaults.
    fwd_tiles: Optional[tuple[int, int, int, int]] = None
    dropout_p: float = 0.0  # needs `FlashExtras.seed`
    # Varlen packing (needs `FlashExtras.cu_seqlens`): (max_seqlen_q, max_seqlen_k) grid bounds.
    varlen: Optional[tuple[int, int]] = None
    varlen_bottom_right: bool = False  # per-sequence bottom-right alignment (varlen only)
    fast_tanh: bool = False  # hardware tanh for the soft cap (NVIDIA; 16-bit inputs only)
    # Skip (query block, key block) tiles that the bool mask or a -inf bias masks entirely, from a
    # block-visibility table built in JAX (`visibility_tiles`); not used with varlen.
    skip_masked_blocks: bool = True


class FlashExtras(NamedTuple):
    """Non-differentiable integer inputs of a flash call (each None when unused).

    Attributes:
        segment_ids: (q_ids (B, L), kv_ids (B, S)) integer arrays; query i sees key j only where
            the ids are equal.
        cu_seqlens: (cu_q (N + 1,), cu_k (N + 1,)) int32 offsets of N sequences packed in a batch of
            1 (varlen); causal / window rules apply per sequence.
        seed: (2,) int32 dropout seed (Philox key, low word first).
    """

    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None
    seed: Optional[jax.Array] = None


def bwd_tiles(d: int, dtype) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
    """Default backward tiles for head dim `d`: (dK/dV kernel, dQ kernel), each
    (BLOCK_M, BLOCK_N, num_warps, num_stages).

    From `benchmarks/flash_bwd_tiles.py` on an H100 (bf16, causal, L=8192): 64x64 tiles with 4 warps
    for both kernels at D=128 (393 TFLOP/s fwd+bwd, against 202 with 8 warps), 8 warps for dK/dV at
    D=256 (246 TFLOP/s, against 114 with 32x32 tiles). fp32 keeps 4 warps and smaller tiles
    (Triton 3.6 miscompiles some fp32 tiles with 8 warps on Hopper; shared memory is doubled).
    """
    if jnp.dtype(dtype) == jnp.float32:
        block = 64 if d <= 64 else 32
        return (block, block, 4, 2), (block, block, 4, 2)
    return (64, 64, 4 if d <= 128 else 8, 2), (64, 64, 4, 2)


def _dims(x: jax.ShapeDtypeStruct | jax.Array, layout: str) -> tuple[int, int, int, int]:
    """(B, H, T, D) sizes of an array in `layout`."""
    b, a, c, d = x.shape
    return (b, a, c, d) if layout == "BHTD" else (b, c, a, d)


def _strides(shape: tuple[int, ...], layout: str) -> tuple[int, int, int, int]:
    """Element strides of a contiguous array, in (B, H, T, D) order; size-1 dims get stride 0."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step if n != 1 else 0)
        step *= n
    sb, s1, s2, sd = reversed(strides)
    return (sb, s1, s2, sd) if layout == "BHTD" else (sb, s2, s1, sd)


def _bhls_strides(x: Optional[jax.Array]) -> tuple[int, int, int, int]:
    """Strides of a (B|1, H|1, L|1, S) bias or mask (size-1 dims broadcast with stride 0)."""
    if x is None:
        return (0, 0, 0, 0)
    return _strides(x.shape, "BHTD")


# --- entry kernels: every scalar is a constexpr, outputs follow inputs (jax-triton's convention) ---


@triton.jit
def _fwd_entry(
    Q, K, V, Bias, Mask, Sinks, SegQ, SegK, CuQ, CuK, Seed, Vis, Out, Lse,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sob: tl.constexpr, soh: tl.constexpr, som: tl.constexpr, sod: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
):
    flash_fwd_kernel(
        Q, K, V, Bias, Mask, Sinks, Out, Lse,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sob, soh, som, sod,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, HAS_SINKS, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP,
    )


@triton.jit
def _dkdv_entry(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, dK, dV,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sdob: tl.constexpr, sdoh: tl.constexpr, sdom: tl.constexpr, sdod: tl.constexpr,
    sdkb: tl.constexpr, sdkh: tl.constexpr, sdkn: tl.constexpr, sdkd: tl.constexpr,
    sdvb: tl.constexpr, sdvh: tl.constexpr, sdvn: tl.constexpr, sdvd: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
):
    flash_bwd_dkdv_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dK, dV,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP,
    )


@triton.jit
def _dq_entry(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, SegQ, SegK, CuQ, CuK, Seed, Vis, dQ, dS,
    sqb: tl.constexpr, sqh: tl.constexpr, sqm: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, skh: tl.constexpr, skn: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svh: tl.constexpr, svn: tl.constexpr, svd: tl.constexpr,
    sbb: tl.constexpr, sbh: tl.constexpr, sbm: tl.constexpr, sbn: tl.constexpr,
    smb: tl.constexpr, smh: tl.constexpr, smm: tl.constexpr, smn: tl.constexpr,
    sdob: tl.constexpr, sdoh: tl.constexpr, sdom: tl.constexpr, sdod: tl.constexpr,
    sdqb: tl.constexpr, sdqh: tl.constexpr, sdqm: tl.constexpr, sdqd: tl.constexpr,
    sdsb: tl.constexpr, sdsh: tl.constexpr, sdsm: tl.constexpr, sdsn: tl.constexpr,
    Hq: tl.constexpr, Hk: tl.constexpr, L: tl.constexpr, S: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    diag_offset: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    WRITE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    dropout_p: tl.constexpr, HAS_SEGMENTS: tl.constexpr, VARLEN: tl.constexpr,
    VARLEN_BOTTOM_RIGHT: tl.constexpr, DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
    stb: tl.constexpr, sth: tl.constexpr, str_: tl.constexpr, BLOCK_SKIP: tl.constexpr,
):
    flash_bwd_dq_kernel(
        Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dS,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sbb, sbh, sbm, sbn, smb, smh, smm, smn, sdob, sdoh, sdom, sdod,
        sdqb, sdqh, sdqm, sdqd, sdsb, sdsh, sdsm, sdsn,
        Hq, Hk, L, S, D, Dv, scale, softcap, window_left, window_right, diag_offset,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, WRITE_DS, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
        SegQ, SegK, CuQ, CuK, Seed, dropout_p, HAS_SEGMENTS, VARLEN, VARLEN_BOTTOM_RIGHT, DROPOUT, FAST_TANH,
        Vis, stb, sth, str_, BLOCK_SKIP,
    )


@triton.jit
def _dropout_mask_entry(Seed, Keep, BH: tl.constexpr, L: tl.constexpr, S: tl.constexpr, dropout_p: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    dropout_mask_kernel(Seed, Keep, BH, L, S, dropout_p, BLOCK_M, BLOCK_N)


def dropout_keep_mask(seed: jax.Array, bh: int, l: int, s: int, dropout_p: float) -> jax.Array:
    """The dropout keep mask the flash kernels apply, materialised (for tests and debugging).

    Args:
        seed: (2,) int32, as in `FlashExtras.seed`.
        bh: B * Hq (1 * Hq for varlen, whose rows and keys are the packed positions).
        l, s: query and key lengths in memory.
        dropout_p: drop probability.

    Returns:
        (bh, l, s) bool, True where a probability is kept (and scaled by 1 / (1 - dropout_p)).
    """
    import jax_triton as jt

    keep = jt.triton_call(
        seed.astype(jnp.int32), kernel=_dropout_mask_entry,
        out_shape=jax.ShapeDtypeStruct((bh, l, s), jnp.int8), grid=(triton.cdiv(l, 32), bh),
        BH=bh, L=l, S=s, dropout_p=float(dropout_p), BLOCK_M=32, BLOCK_N=64,
    )
    return keep != 0


def _fold(x: jax.Array, axis: int, tile: int) -> jax.Array:
    """Max over consecutive groups of `tile` along `axis` (zero-padded); size-1 axes stay (broadcast)."""
    n = x.shape[axis]
    if n == 1 or tile == 1:
        return x
    blocks = -(-n // tile)
    pad = [(0, blocks * tile - n if i == axis else 0) for i in range(x.ndim)]
    x = jnp.pad(x, pad)
    return jnp.max(x.reshape(x.shape[:axis] + (blocks, tile) + x.shape[axis + 1:]), axis=axis + 1)


def visibility_tiles(bias: Optional[jax.Array], mask: Optional[jax.Array],
                     tile: tuple[int, int]) -> jax.Array:
    """Which (tile_m x tile_n) tiles of the logits the bool mask and the bias leave visible.

    Args:
        bias: None or float (B|1, Hq|1, L|1, S|1); -inf masks an element (NaN does not).
        mask: None or int8 (B|1, Hq|1, L|1, S|1), nonzero = attend.
        tile: (tile_m, tile_n).

    Returns:
        int8 (B|1, Hq|1, cdiv(L, tile_m)|1, cdiv(S, tile_n)|1): 1 where some element of the tile is
        visible; a dim of size 1 in the inputs stays size 1 (it broadcasts). The causal / window /
        segment rules are not part of it (the kernels apply them separately).
    """
    vis = None
    if mask is not None:
        vis = mask != 0
    if bias is not None:
        finite = bias != -jnp.inf
        vis = finite if vis is None else vis & finite
    vis = _fold(_fold(vis.astype(jnp.int8), 2, tile[0]), 3, tile[1])
    return vis


def _skip_tiles(q, v, bias, mask, cfg: FlashConfig) -> Optional[tuple[tuple[int, int], jax.Array]]:
    """(fine tile, its visibility table) when the kernels should skip masked tiles, else None.

    The fine tile divides the tiles of the forward and both backward kernels, so each kernel's
    table is one `_fold` of it away (`skip_table`).
    """
    if not cfg.skip_masked_blocks or (bias is None and mask is None) or cfg.varlen is not None:
        return None
    d, dv = _dims(q, cfg.layout)[3], _dims(v, cfg.layout)[3]
    fwd = cfg.fwd_tiles or fwd_block_sizes(d, dv, jnp.dtype(q.dtype).itemsize)
    kv, dq = cfg.bwd_tiles or bwd_tiles(d, q.dtype)
    tile = (math.gcd(fwd[0], kv[0], dq[0]), math.gcd(fwd[1], kv[1], dq[1]))
    return tile, visibility_tiles(bias, mask, tile)


def skip_table(skip, block_m: int, block_n: int, l: int, s: int, along: str) -> jax.Array:
    """The kernels' int32 skip table at (block_m, block_n) tiles.

    Args:
        skip: (fine tile, fine visibility table) from `_skip_tiles`.
        block_m, block_n: the kernel's tiles. l, s: query and key lengths.
        along: "k" for kernels that loop over key blocks per query block (forward, dQ), "q" for the
            dK/dV kernel (loops over query blocks per key block).

    Returns:
        (B|1, Hq|1, R, 2 * C + 1) int32 with R the blocks of the grid's axis and C those of the loop's:
        per row, C + 1 prefix counts of live blocks (entry c = live blocks before block c), then the
        live blocks in ascending order (padded with the dead ones).
    """
    (tm, tn), fine = skip
    table = _fold(_fold(fine, 2, block_m // tm), 3, block_n // tn)
    table = jnp.broadcast_to(table, table.shape[:2] + (-(-l // block_m), -(-s // block_n)))
    if along == "q":
        table = jnp.swapaxes(table, 2, 3)
    live = table != 0
    counts = jnp.cumsum(live, axis=-1, dtype=jnp.int32)
    counts = jnp.concatenate([jnp.zeros(counts.shape[:-1] + (1,), jnp.int32), counts], axis=-1)
    order = jnp.argsort(~live, axis=-1, stable=True).astype(jnp.int32)
    return jnp.concatenate([counts, order], axis=-1)


def _skip_args(skip, block_m: int, block_n: int, l: int, s: int, along: str) -> tuple[jax.Array, dict]:
    """The skip table input and its kernel arguments (a placeholder and BLOCK_SKIP=False without)."""
    if skip is None:
        return _placeholder(jnp.int32), dict(stb=0, sth=0, str_=0, BLOCK_SKIP=False)
    table = skip_table(skip, block_m, block_n, l, s, along)
    strides = _strides(table.shape, "BHTD")
    return table, dict(stb=strides[0], sth=strides[1], str_=strides[2], BLOCK_SKIP=True)


def _placeholder(dtype=jnp.float32) -> jax.Array:
    return jnp.zeros((1,), dtype)


def _spans(ids: jax.Array, other: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each id in `ids` (B, L), the span [lo, hi) of positions in `other` (B, S) holding the same
    id (lo = hi = 0 when absent) and whether those positions fill the span (a contiguous run).

    O(L + S) scatters, no sort: ids in [0, S) index a table of first / last / count per id; an id
    outside that range gets the whole span [0, S), not contiguous (conservative: the kernels then
    compare ids element by element).
    """
    b, n = other.shape
    rows = jnp.arange(b)[:, None]
    pos = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), other.shape)
    slot = jnp.where((other >= 0) & (other < n), other, n)  # slot n collects out-of-range ids
    first = jnp.full((b, n + 1), n, jnp.int32).at[rows, slot].min(pos)
    last = jnp.full((b, n + 1), -1, jnp.int32).at[rows, slot].max(pos)
    count = jnp.zeros((b, n + 1), jnp.int32).at[rows, slot].add(1)
    in_range = (ids >= 0) & (ids < n)
    idx = jnp.where(in_range, ids, n)
    f, l_, c = (jnp.take_along_axis(t, idx, axis=1) for t in (first, last, count))
    present = c > 0
    lo = jnp.where(in_range, jnp.where(present, f, 0), 0)
    hi = jnp.where(in_range, jnp.where(present, l_ + 1, 0), n)
    contiguous = in_range & (c == hi - lo)
    return lo.astype(jnp.int32), hi.astype(jnp.int32), contiguous.astype(jnp.int32)


def segment_tables(q_ids: jax.Array, kv_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernels' segment tables, int32: SegQ (B, 4, L) = (ids, key span lo, key span hi, keys of
    the span all share the id) and SegK (B, 4, S) = (ids, query span lo, query span hi, contiguous)."""
    q_ids, kv_ids = q_ids.astype(jnp.int32), kv_ids.astype(jnp.int32)
    seg_q = jnp.stack([q_ids, *_spans(q_ids, kv_ids)], axis=1)
    seg_k = jnp.stack([kv_ids, *_spans(kv_ids, q_ids)], axis=1)
    return seg_q, seg_k


def _extra_inputs(extras: FlashExtras, seg_tables) -> tuple[jax.Array, ...]:
    """(SegQ, SegK, CuQ, CuK, Seed) kernel inputs, placeholders for unused ones."""
    seg_q, seg_k = seg_tables if seg_tables is not None else (_placeholder(jnp.int32),) * 2
    cu_q, cu_k = (
        tuple(c.astype(jnp.int32) for c in extras.cu_seqlens)
        if extras.cu_seqlens is not None else (_placeholder(jnp.int32),) * 2
    )
    seed = extras.seed.astype(jnp.int32) if extras.seed is not None else _placeholder(jnp.int32)
    return seg_q, seg_k, cu_q, cu_k, seed


def _common(q, k, v, bias, mask, extras: FlashExtras, cfg: FlashConfig) -> dict:
    b, hq, l, d = _dims(q, cfg.layout)
    _, hk, s, _ = _dims(k, cfg.layout)
    dv = _dims(v, cfg.layout)[3]
    dropout = cfg.dropout_p > 0
    if dropout and extras.seed is None:
        raise ValueError(f"dropout_p={cfg.dropout_p}: FlashExtras.seed is required for dropout.")
    if (cfg.varlen is not None) != (extras.cu_seqlens is not None):
        raise ValueError("varlen: FlashConfig.varlen and FlashExtras.cu_seqlens go together.")
    meta = dict(
        zip(("sqb", "sqh", "sqm", "sqd"), _strides(q.shape, cfg.layout)),
        **dict(zip(("skb", "skh", "skn", "skd"), _strides(k.shape, cfg.layout))),
        **dict(zip(("svb", "svh", "svn", "svd"), _strides(v.shape, cfg.layout))),
        **dict(zip(("sbb", "sbh", "sbm", "sbn"), _bhls_strides(bias))),
        **dict(zip(("smb", "smh", "smm", "smn"), _bhls_strides(mask))),
        Hq=hq, Hk=hk, L=l, S=s, D=d, Dv=dv, scale=float(cfg.scale),
        softcap=float(cfg.softcap or 1.0), window_left=cfg.window[0], window_right=cfg.window[1],
        diag_offset=cfg.diag_offset, CAUSAL=cfg.causal, HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
        SOFTCAP=cfg.softcap is not None, BLOCK_D=head_block(d), BLOCK_DV=head_block(dv),
        dropout_p=float(cfg.dropout_p), HAS_SEGMENTS=extras.segment_ids is not None,
        VARLEN=cfg.varlen is not None, VARLEN_BOTTOM_RIGHT=bool(cfg.varlen_bottom_right), DROPOUT=dropout,
        FAST_TANH=bool(cfg.fast_tanh) and jnp.dtype(q.dtype).itemsize < 4,
    )
    return meta


def _grid_rows(meta: dict, extras: FlashExtras, cfg: FlashConfig, which: str) -> tuple[int, int]:
    """(rows to cover along the sequence, number of (sequence, head) programs) for `which` in
    ("q", "k"): the padded length and B normally; the max sequence length and N with varlen."""
    heads = meta["Hq"] if which == "q" else meta["Hk"]
    if cfg.varlen is None:
        return (meta["L"] if which == "q" else meta["S"]), heads
    n = extras.cu_seqlens[0].shape[0] - 1
    bound = cfg.varlen[0] if which == "q" else cfg.varlen[1]
    full = meta["L"] if which == "q" else meta["S"]
    return min(int(bound), full), n * heads


def _forward(q, k, v, bias, mask, sinks, extras: FlashExtras, seg_tables, skip, cfg: FlashConfig, out_dtype=None):
    import jax_triton as jt

    meta = _common(q, k, v, bias, mask, extras, cfg)
    b, hq, l = q.shape[0], meta["Hq"], meta["L"]
    block_m, block_n, num_warps, num_stages = cfg.fwd_tiles or fwd_block_sizes(
        meta["D"], meta["Dv"], jnp.dtype(q.dtype).itemsize)
    out_shape = (b, hq, l, meta["Dv"]) if cfg.layout == "BHTD" else (b, l, hq, meta["Dv"])
    meta.update(zip(("sob", "soh", "som", "sod"), _strides(out_shape, cfg.layout)))
    rows, programs = _grid_rows(meta, extras, cfg, "q")
    if cfg.varlen is None:
        programs *= b
    vis, vis_args = _skip_args(skip, block_m, block_n, l, meta["S"], "k")
    out, lse = jt.triton_call(
        q, k, v,
        bias if bias is not None else _placeholder(q.dtype),
        mask if mask is not None else _placeholder(jnp.int8),
        sinks if sinks is not None else _placeholder(),
        *_extra_inputs(extras, seg_tables), vis,
        kernel=_fwd_entry,
        out_shape=(jax.ShapeDtypeStruct(out_shape, out_dtype or q.dtype), jax.ShapeDtypeStruct((b, hq, l), jnp.float32)),
        grid=(triton.cdiv(rows, block_m), programs),
        num_warps=num_warps, num_stages=num_stages,
        HAS_SINKS=sinks is not None, BLOCK_M=block_m, BLOCK_N=block_n, **meta, **vis_args,
    )
    if cfg.varlen is not None:  # rows after the last sequence belong to no program
        valid = jnp.arange(l) < extras.cu_seqlens[0][-1]
        out = jnp.where(valid[:, None, None] if cfg.layout == "BTHD" else valid[:, None], out, 0).astype(out.dtype)
        lse = jnp.where(valid, lse, -jnp.inf)
    return out, lse


def _backward(q, k, v, bias, mask, dout, lse, delta, extras: FlashExtras, seg_tables, skip, cfg: FlashConfig,
              write_ds: bool, grad_dtype=None):
    import jax_triton as jt

    meta = _common(q, k, v, bias, mask, extras, cfg)
    b = q.shape[0]
    hq, hk, l, s = meta["Hq"], meta["Hk"], meta["L"], meta["S"]
    (kv_m, kv_n, kv_warps, kv_stages), (q_m, q_n, q_warps, q_stages) = cfg.bwd_tiles or bwd_tiles(meta["D"], q.dtype)
    do_strides = dict(zip(("sdob", "sdoh", "sdom", "sdod"), _strides(dout.shape, cfg.layout)))
    placeholders = (
        bias if bias is not None else _placeholder(q.dtype),
        mask if mask is not None else _placeholder(jnp.int8),
    )
    extra_inputs = _extra_inputs(extras, seg_tables)
    k_rows, k_programs = _grid_rows(meta, extras, cfg, "k")
    q_rows, q_programs = _grid_rows(meta, extras, cfg, "q")
    if cfg.varlen is None:
        k_programs, q_programs = k_programs * b, q_programs * b
    kv_vis, kv_vis_args = _skip_args(skip, kv_m, kv_n, l, s, "q")
    dk, dv = jt.triton_call(
        q, k, v, *placeholders, dout, lse, delta, *extra_inputs, kv_vis,
        kernel=_dkdv_entry,
        out_shape=(jax.ShapeDtypeStruct(k.shape, grad_dtype or k.dtype), jax.ShapeDtypeStruct(v.shape, grad_dtype or v.dtype)),
        grid=(triton.cdiv(k_rows, kv_n), k_programs),
        num_warps=kv_warps, num_stages=kv_stages,
        BLOCK_M=kv_m, BLOCK_N=kv_n, **meta, **do_strides, **kv_vis_args,
        **dict(zip(("sdkb", "sdkh", "sdkn", "sdkd"), _strides(k.shape, cfg.layout))),
        **dict(zip(("sdvb", "sdvh", "sdvn", "sdvd"), _strides(v.shape, cfg.layout))),
    )
    ds_shape = (b, hq, l, s) if write_ds else (1,)
    q_vis, q_vis_args = _skip_args(skip, q_m, q_n, l, s, "k")
    dq, ds = jt.triton_call(
        q, k, v, *placeholders, dout, lse, delta, *extra_inputs, q_vis,
        kernel=_dq_entry,
        out_shape=(jax.ShapeDtypeStruct(q.shape, grad_dtype or q.dtype), jax.ShapeDtypeStruct(ds_shape, jnp.float32)),
        grid=(triton.cdiv(q_rows, q_m), q_programs),
        num_warps=q_warps, num_stages=q_stages,
        WRITE_DS=write_ds, BLOCK_M=q_m, BLOCK_N=q_n, **meta, **do_strides, **q_vis_args,
        **dict(zip(("sdqb", "sdqh", "sdqm", "sdqd"), _strides(q.shape, cfg.layout))),
        **dict(zip(("sdsb", "sdsh", "sdsm", "sdsn"), _strides((b, hq, l, s), "BHTD") if write_ds else (0, 0, 0, 0))),
    )
    if cfg.varlen is not None:  # rows / keys after the last sequence belong to no program
        cu_q, cu_k = extras.cu_seqlens
        dq = _zero_tail(dq, cu_q[-1], cfg.layout)
        dk, dv = _zero_tail(dk, cu_k[-1], cfg.layout), _zero_tail(dv, cu_k[-1], cfg.layout)
    return dq, dk, dv, (ds if write_ds else None)


def _zero_tail(x: jax.Array, end: jax.Array, layout: str) -> jax.Array:
    """Zeros the time positions >= `end` of a (1, T, H, D) / (1, H, T, D) array."""
    t_axis = 1 if layout == "BTHD" else 2
    valid = jnp.arange(x.shape[t_axis]) < end
    valid = valid[:, None, None] if layout == "BTHD" else valid[:, None]
    return jnp.where(valid, x, 0).astype(x.dtype)


def _reduce_to(grad: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sums a (B, Hq, L, S) gradient over the dims a (B|1, H|1, L|1, S|1) bias broadcast."""
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return jnp.sum(grad, axis=axes, keepdims=True).reshape(shape)


def _seg_tables(extras: FlashExtras):
    return None if extras.segment_ids is None else segment_tables(*extras.segment_ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def flash_attention_triton(q, k, v, bias, mask, sinks, extras: FlashExtras, cfg: FlashConfig):
    """Flash attention by Triton kernels; returns (out, lse).

    Args:
        q: (B, Hq, L, D) or (B, L, Hq, D) per `cfg.layout`. k: (.., Hk, S, D). v: (.., Hk, S, Dv).
            With varlen (`cfg.varlen`), B = 1 and L / S are the packed lengths.
        bias: None or float (B|1, Hq|1, L|1, S), added to the logits.
        mask: None or int8 (B|1, Hq|1, L|1, S), 1 = attend.
        sinks: None or float32 (Hq,) sink logits.
        extras: segment ids, varlen offsets and the dropout seed (`FlashExtras`).
        cfg: static settings.

    Returns:
        out in q's layout and dtype, lse (B, Hq, L) float32 (-inf on rows that see nothing).
    """
    skip = _skip_tiles(q, v, bias, mask, cfg)
    return _forward(q, k, v, bias, mask, sinks, extras, _seg_tables(extras), skip, cfg)


def _vjp_fwd(q, k, v, bias, mask, sinks, extras, cfg):
    seg_tables = _seg_tables(extras)
    skip = _skip_tiles(q, v, bias, mask, cfg)
    out, lse = _forward(q, k, v, bias, mask, sinks, extras, seg_tables, skip, cfg)
    return (out, lse), (q, k, v, bias, mask, sinks, extras, seg_tables, skip, out, lse)


def _vjp_bwd(cfg, residuals, cotangents):
    q, k, v, bias, mask, sinks, extras, seg_tables, skip, out, lse = residuals
    dout, dlse = cotangents
    # Delta = rowsum(dO * O) in fp32, minus the LSE cotangent (d lse / d logit = P).
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    if cfg.layout == "BTHD":
        delta = jnp.swapaxes(delta, 1, 2)
    delta = delta - dlse
    dq, dk, dv, ds = _backward(q, k, v, bias, mask, dout, lse, delta, extras, seg_tables, skip, cfg,
                               write_ds=bias is not None)
    dbias = None if bias is None else _reduce_to(ds, bias.shape).astype(bias.dtype)
    dsinks = None
    if sinks is not None:
        # Rows outside every varlen sequence have lse = -inf and no sink weight.
        p_sink = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(sinks[None, :, None] - lse))
        dsinks = -jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)
    return dq, dk, dv, dbias, None, dsinks, None


flash_attention_triton.defvjp(_vjp_fwd, _vjp_bwd)


# --- one block of a larger attention (ring attention merges these partial results) ---------------


def flash_block_forward(q, k, v, extras: FlashExtras, cfg: FlashConfig, out_dtype=None):
    """The forward kernel alone, no custom VJP: (out, lse) of q against this k/v block.

    Arguments as in `flash_attention_triton` (no bias, mask or sinks); `out_dtype` (e.g. float32)
    sets the output dtype, q's dtype by default, so partial results can be merged without rounding.
    """
    return _forward(q, k, v, None, None, None, extras, _seg_tables(extras), None, cfg, out_dtype=out_dtype)


def flash_block_backward(q, k, v, dout, lse, delta, extras: FlashExtras, cfg: FlashConfig, grad_dtype=None):
    """The backward kernels alone: (dq, dk, dv) of this k/v block's share, given row statistics of
    the whole attention: `lse` (B, Hq, L) and `delta` = rowsum(dout * out) - dLSE (B, Hq, L), both
    float32 and contiguous. Summing the results over all key blocks gives the full gradients.
    `grad_dtype` sets the gradients' dtype (q/k/v's by default)."""
    dq, dk, dv, _ = _backward(q, k, v, None, None, dout, lse, delta, extras, _seg_tables(extras), None, cfg,
                              write_ds=False, grad_dtype=grad_dtype)
    return dq, dk, dv
