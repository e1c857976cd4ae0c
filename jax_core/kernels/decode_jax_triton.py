"""The Triton decode kernels as a JAX function, launched with jax-triton.

`decode_attention_triton(q, k, v, lengths, starts, block_table, sinks, cfg)` returns (out, lse): the
stream-K schedule (`decode_stream_triton`), then the merge of each row's partial results.
jax-triton is imported when a kernel is launched (it needs a GPU build of jaxlib), so this module
imports on any machine. Entry kernels take every scalar as a constexpr (jax-triton's convention:
inputs, then outputs, then constexprs); the cache lengths, starts and block table are device arrays,
so ragged lengths that change every step reuse one compilation.

Shape legend: B batch, T queries per sequence, Hq / Hkv query / KV heads, S cache capacity,
D / Dv head dims, P pages, PS page size.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from .jax_triton_module import jax_triton
from .decode_stream_triton import decode_stream_kernel, decode_stream_merge_kernel

#: Cache layouts: contiguous (B, S, Hkv, D) or (B, Hkv, S, D), or pages (P, PS, Hkv, D).
CACHE_LAYOUTS = ("BSHD", "BHSD", "paged")
#: Programs per multiprocessor of the stream schedule. On an H100 (`benchmarks/decode_gpu.py --stream`,
#: BENCHMARKS.md "Decode: the stream-K schedule") one to four programs with three tiles stayed within
#: 3% of two with the default tile, except two combinations that were 4-8% slower.
STREAM_PROGRAMS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static settings of one decode call (hashable: part of the JAX trace).

    Attributes:
        scale: multiplier of q·k.
        causal: query t sees positions j <= its own (pos = length - T + t + pos_shift).
        window: (left, right) around each query's position, -1 = unbounded.
        pos_shift: added to every query's position (0: the queries are the last T positions).
        softcap: c in c * tanh(logits / c), or None.
        q_layout: "BTHD" (B, T, Hq, D) or "BHTD" (B, Hq, T, D); the output has the same layout.
        cache_layout: one of `CACHE_LAYOUTS`.
        fast_tanh: hardware tanh for the soft cap (NVIDIA only; 16-bit inputs).

    The launch choices are not settings: the methods below return the tuned ones. A benchmark
    sweeping them, or a test that needs small tiles and few programs on a tiny cache, overrides
    them in a subclass of its own; a subclass never equals a DecodeConfig, so its compilations stay
    apart.
    """

    scale: float
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    pos_shift: int = 0
    softcap: Optional[float] = None
    q_layout: str = "BTHD"
    cache_layout: str = "BSHD"
    fast_tanh: bool = False

    def launch_tiles(self, d: int, dv: int, dtype_bytes: int) -> tuple[int, int, int]:
        """(BLOCK_N, num_warps, num_stages) of the attention kernel: `decode_tiles`."""
        return decode_tiles(d, dv, dtype_bytes)

    def stream_programs(self) -> int:
        """Programs of the stream schedule: `STREAM_PROGRAMS_PER_SM` per multiprocessor."""
        return STREAM_PROGRAMS_PER_SM * _device_sms()

    def stream_min_share(self, segments: int, max_blocks: int, programs: int) -> int:
        """The fewest key blocks one program takes: `default_min_share`."""
        return default_min_share(segments, max_blocks, programs)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def decode_tiles(d: int, dv: int, dtype_bytes: int) -> tuple[int, int, int]:
    """Default (BLOCK_N, num_warps, num_stages).

    From `benchmarks/decode_gpu.py --only-sweep` on an H100 (bf16, Hq=32, Hkv=8, D=128, jax 0.11.2,
    triton 3.6, 2026-11-22): (64, 4, 3) reads full caches at 94-95% of the copy bandwidth for
    (B=32, S=8192) and (B=8, S=32768); (128, 4, 3), (64, 8, 4) and (128, 8, 3) were within 2%,
    (64, 4, 2) up to 13% slower. That sweep ran the split schedule the stream one replaced; with
    the stream schedule (`--stream`, 2026-11-23) (64, 4, 4) and (128, 4, 3) stayed within 3% of
    (64, 4, 3).
    """
    width = max(_next_pow2(d), _next_pow2(dv))
    if dtype_bytes >= 4:
        return (32, 4, 2) if width > 128 else (64, 4, 2)
    if width > 128:
        return 32, 4, 3
    return 64, 4, 3


def row_block(rows: int, d: int) -> int:
    """BLOCK_M for G * T query rows: a power of two >= 16 (tl.dot's minimum), at most 64 (32 for D > 128)."""
    return min(max(16, _next_pow2(rows)), 32 if d > 128 else 64)


def max_visible_blocks(capacity: int, t: int, window: tuple[int, int], causal: bool, block_n: int) -> int:
    """The most key blocks any sequence's queries can see: the capacity's, or the window's span's,
    plus one for a span that straddles a block boundary."""
    left, right = window
    span = capacity
    if left >= 0 and (causal or right >= 0):
        span = min(capacity, left + t + (0 if causal else right) + block_n)
    return -(-span // block_n) + 1


def segment_offsets(lengths: jax.Array, starts: Optional[jax.Array], t: int, capacity: int, cfg: DecodeConfig,
                    block_n: int, segments_per_sequence: int) -> jax.Array:
    """(B * segments_per_sequence + 1,) int32 cumulative key blocks of the stream schedule's
    segments: each sequence's blocks intersecting the positions its queries see (the kernels'
    `sequence_range`), repeated for its KV heads and row blocks."""
    left, right = (min(int(w), capacity + t) for w in cfg.window)
    length = jnp.minimum(lengths.astype(jnp.int32), capacity)
    start = jnp.zeros_like(length) if starts is None else jnp.maximum(starts.astype(jnp.int32), 0)
    pos_last = length - 1 + cfg.pos_shift
    seq_lo = start if cfg.window[0] < 0 else jnp.maximum(start, length - t + cfg.pos_shift - left)
    seq_lo = jnp.maximum(seq_lo, 0)
    seq_hi = jnp.minimum(length, pos_last + 1) if cfg.causal else length
    if cfg.window[1] >= 0:
        seq_hi = jnp.minimum(seq_hi, pos_last + right + 1)
    n_blk = jnp.where(seq_hi > seq_lo, (seq_hi + block_n - 1) // block_n - seq_lo // block_n, 0)
    counts = jnp.repeat(n_blk, segments_per_sequence)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def default_min_share(segments: int, max_blocks: int, programs: int) -> int:
    """The fewest key blocks one program of the stream schedule takes: a quarter of what it gets
    when every sequence is full, and at least 4."""
    return max(4, -(-segments * max_blocks // programs) // 4)


def max_parts(max_blocks: int, min_share: int) -> int:
    """The most partial results one segment of at most `max_blocks` key blocks can have when every
    program takes at least `min_share` blocks (the slots of the partial-result buffers)."""
    return -(-max_blocks // min_share) + 1


def _device_sms() -> int:
    try:
        return int(getattr(jax.devices()[0], "core_count", 0)) or 132
    except RuntimeError:
        return 132


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return out[::-1]


def _q_strides(shape, layout: str) -> tuple[int, int, int, int]:
    """(b, t, h, d) strides of a contiguous query/output array in `layout`."""
    sb, s1, s2, sd = _strides(shape)
    return (sb, s1, s2, sd) if layout == "BTHD" else (sb, s2, s1, sd)


def _cache_strides(shape, layout: str) -> tuple[int, int, int, int]:
    """(batch or page, position or slot, head, d) strides of a contiguous cache array."""
    s0, s1, s2, s3 = _strides(shape)
    return (s0, s2, s1, s3) if layout == "BHSD" else (s0, s1, s2, s3)


def cache_dims(k_shape, layout: str, block_table_shape=None) -> tuple[int, int, int]:
    """(Hkv, capacity S, page size or 0) of a cache of shape `k_shape` in `layout`."""
    if layout == "paged":
        return k_shape[2], block_table_shape[1] * k_shape[1], k_shape[1]
    if layout == "BHSD":
        return k_shape[1], k_shape[2], 0
    return k_shape[2], k_shape[1], 0


# --- entry kernels: every scalar is a constexpr, outputs follow inputs (jax-triton's convention) ---


@triton.jit
def _stream_entry(
    Q, K, V, Lengths, Starts, BlockTable, SegCum, Out, Lse,
    sqb: tl.constexpr, sqt: tl.constexpr, sqh: tl.constexpr, sqd: tl.constexpr,
    skb: tl.constexpr, sks: tl.constexpr, skh: tl.constexpr, skd: tl.constexpr,
    svb: tl.constexpr, svs: tl.constexpr, svh: tl.constexpr, svd: tl.constexpr,
    stb: tl.constexpr,
    sob: tl.constexpr, sot: tl.constexpr, soh: tl.constexpr, sopart: tl.constexpr, sod: tl.constexpr,
    slb: tl.constexpr, slt: tl.constexpr, slh: tl.constexpr, slpart: tl.constexpr,
    scale: tl.constexpr, softcap: tl.constexpr, window_left: tl.constexpr, window_right: tl.constexpr,
    pos_shift: tl.constexpr,
    T: tl.constexpr, G: tl.constexpr, Hkv: tl.constexpr, D: tl.constexpr, Dv: tl.constexpr,
    capacity: tl.constexpr, num_segments: tl.constexpr, num_programs: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_STARTS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ROW_BLOCKS: tl.constexpr, MIN_SHARE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SEG: tl.constexpr,
):
    decode_stream_kernel(
        Q, K, V, Lengths, Starts, BlockTable, SegCum, Out, Lse,
        sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, stb,
        sob, sot, soh, sopart, sod, slb, slt, slh, slpart,
        scale, softcap, window_left, window_right, pos_shift, T, G, Hkv, D, Dv, capacity,
        num_segments, num_programs, CAUSAL, HAS_STARTS, PAGED, PAGE_SIZE, SOFTCAP, FAST_TANH,
        ROW_BLOCKS, MIN_SHARE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_SEG,
    )


@triton.jit
def _stream_merge_entry(
    OutPart, LsePart, SegCum, Sinks, Out, Lse,
    spb: tl.constexpr, spt: tl.constexpr, sph: tl.constexpr, sppart: tl.constexpr, spd: tl.constexpr,
    sqb: tl.constexpr, sqt: tl.constexpr, sqh: tl.constexpr, sqpart: tl.constexpr,
    sob: tl.constexpr, sot: tl.constexpr, soh: tl.constexpr, sod: tl.constexpr,
    slb: tl.constexpr, slt: tl.constexpr, slh: tl.constexpr,
    T: tl.constexpr, G: tl.constexpr, Hq: tl.constexpr, Dv: tl.constexpr,
    num_segments: tl.constexpr, num_programs: tl.constexpr,
    HAS_SINKS: tl.constexpr, MIN_SHARE: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_PARTS: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    decode_stream_merge_kernel(
        OutPart, LsePart, SegCum, Sinks, Out, Lse, spb, spt, sph, sppart, spd, sqb, sqt, sqh, sqpart,
        sob, sot, soh, sod, slb, slt, slh, T, G, Hq, Dv, num_segments, num_programs,
        HAS_SINKS, MIN_SHARE, ROW_BLOCKS, BLOCK_M, BLOCK_PARTS, BLOCK_DV,
    )


def _placeholder(dtype) -> jax.Array:
    return jnp.zeros((1,), dtype)


def decode_attention_triton(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    lengths: jax.Array,
    starts: Optional[jax.Array],
    block_table: Optional[jax.Array],
    sinks: Optional[jax.Array],
    cfg: DecodeConfig,
) -> tuple[jax.Array, jax.Array]:
    """Decode attention by the Triton kernels; returns (out, lse).

    Args:
        q: (B, T, Hq, D) ("BTHD") or (B, Hq, T, D) ("BHTD"), per `cfg.q_layout`.
        k: (B, S, Hkv, D) "BSHD", (B, Hkv, S, D) "BHSD", or pages (P, PS, Hkv, D), per
            `cfg.cache_layout`; read in place, only the visible positions.
        v: the same with Dv.
        lengths: (B,) int32, valid positions end (exclusive), at most S.
        starts: (B,) int32 first valid positions, or None (0).
        block_table: (B, max_pages) int32 page of each sequence's page slot ("paged" only).
        sinks: (Hq,) float32 sink logits, or None.
        cfg: static settings.

    Returns:
        out in q's layout and dtype; lse (B, Hq, T) float32 (-inf for queries that see nothing,
        unless a sink is given).
    """
    if cfg.cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout={cfg.cache_layout!r}: expected one of {CACHE_LAYOUTS}.")
    plan = _plan(q, k, v, block_table, cfg)
    return _stream_call(q, k, v, lengths, starts, block_table, sinks, cfg, plan)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Sizes and tiles of one launch (shape legend in the module docstring)."""

    b: int
    t: int
    hq: int
    d: int
    dv: int
    hkv: int
    capacity: int
    page_size: int
    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    row_blocks: int
    num_warps: int
    num_stages: int


def _plan(q, k, v, block_table, cfg: DecodeConfig) -> _Plan:
    b, t, hq, d = q.shape if cfg.q_layout == "BTHD" else (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    dv = v.shape[-1]
    hkv, capacity, page_size = cache_dims(k.shape, cfg.cache_layout, None if block_table is None else block_table.shape)
    block_n, num_warps, num_stages = cfg.launch_tiles(d, dv, jnp.dtype(q.dtype).itemsize)
    block_m = row_block((hq // hkv) * t, d)
    return _Plan(b=b, t=t, hq=hq, d=d, dv=dv, hkv=hkv, capacity=capacity, page_size=page_size, block_m=block_m,
                 block_n=block_n, block_d=max(16, _next_pow2(d)), block_dv=max(16, _next_pow2(dv)),
                 row_blocks=triton.cdiv((hq // hkv) * t, block_m), num_warps=num_warps, num_stages=num_stages)


def _float_or_placeholder(x: Optional[jax.Array]) -> jax.Array:
    return x.astype(jnp.float32) if x is not None else _placeholder(jnp.float32)


def _cache_inputs(q, k, v, lengths, starts, block_table, cfg: DecodeConfig) -> tuple[jax.Array, ...]:
    """Q, K, V, Lengths, Starts, BlockTable as the attention kernel takes them."""
    return (q, k, v, lengths.astype(jnp.int32),
            starts.astype(jnp.int32) if starts is not None else _placeholder(jnp.int32),
            block_table.astype(jnp.int32) if cfg.cache_layout == "paged" else _placeholder(jnp.int32))


def _common_meta(q, k, v, starts, block_table, cfg: DecodeConfig, plan: _Plan) -> dict:
    """The attention kernel's constexprs besides the partial results' strides and the stream's
    sizes: input strides, scalars, flags, tiles."""
    paged = cfg.cache_layout == "paged"
    window = tuple(cfg.window)
    return dict(
        **dict(zip(("sqb", "sqt", "sqh", "sqd"), _q_strides(q.shape, cfg.q_layout))),
        **dict(zip(("skb", "sks", "skh", "skd"), _cache_strides(k.shape, "BSHD" if paged else cfg.cache_layout))),
        **dict(zip(("svb", "svs", "svh", "svd"), _cache_strides(v.shape, "BSHD" if paged else cfg.cache_layout))),
        stb=block_table.shape[1] if paged else 0,
        scale=float(cfg.scale), softcap=float(cfg.softcap or 1.0), window_left=int(window[0]),
        window_right=int(window[1]), pos_shift=int(cfg.pos_shift), T=plan.t, G=plan.hq // plan.hkv, Hkv=plan.hkv,
        D=plan.d, Dv=plan.dv, capacity=plan.capacity, CAUSAL=bool(cfg.causal), HAS_STARTS=starts is not None,
        PAGED=paged, PAGE_SIZE=max(plan.page_size, 1), SOFTCAP=cfg.softcap is not None,
        FAST_TANH=bool(cfg.fast_tanh) and jnp.dtype(q.dtype).itemsize < 4,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_D=plan.block_d, BLOCK_DV=plan.block_dv,
    )


def _stream_call(q, k, v, lengths, starts, block_table, sinks, cfg: DecodeConfig, plan: _Plan):
    """The stream schedule: `decode_stream_kernel` then `decode_stream_merge_kernel`."""
    jt = jax_triton()

    b, t, hq, dv = plan.b, plan.t, plan.hq, plan.dv
    segments = b * plan.hkv * plan.row_blocks
    programs = max(1, int(cfg.stream_programs()))
    max_blocks = max_visible_blocks(plan.capacity, t, tuple(cfg.window), bool(cfg.causal), plan.block_n)
    min_share = cfg.stream_min_share(segments, max_blocks, programs)
    parts = max_parts(max_blocks, min_share)
    seg_cum = segment_offsets(lengths, starts, t, plan.capacity, cfg, plan.block_n, plan.hkv * plan.row_blocks)
    part_shape = (b, t, hq, parts, dv)
    out_part, lse_part = jt.triton_call(
        *_cache_inputs(q, k, v, lengths, starts, block_table, cfg), seg_cum,
        kernel=_stream_entry,
        out_shape=(jax.ShapeDtypeStruct(part_shape, jnp.float32), jax.ShapeDtypeStruct(part_shape[:-1], jnp.float32)),
        grid=(programs,), num_warps=plan.num_warps, num_stages=plan.num_stages,
        **_common_meta(q, k, v, starts, block_table, cfg, plan),
        **dict(zip(("sob", "sot", "soh", "sopart", "sod"), _strides(part_shape))),
        **dict(zip(("slb", "slt", "slh", "slpart"), _strides(part_shape[:-1]))),
        num_segments=segments, num_programs=programs, ROW_BLOCKS=plan.row_blocks, MIN_SHARE=min_share,
        BLOCK_SEG=min(1024, max(16, _next_pow2(segments))),
    )
    out_shape = (b, t, hq, dv) if cfg.q_layout == "BTHD" else (b, hq, t, dv)
    return jt.triton_call(
        out_part, lse_part, seg_cum, _float_or_placeholder(sinks), kernel=_stream_merge_entry,
        out_shape=(jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct((b, hq, t), jnp.float32)),
        grid=(b * t * hq,), num_warps=1, num_stages=1,
        **dict(zip(("spb", "spt", "sph", "sppart", "spd"), _strides(part_shape))),
        **dict(zip(("sqb", "sqt", "sqh", "sqpart"), _strides(part_shape[:-1]))),
        **dict(zip(("sob", "sot", "soh", "sod"), _q_strides(out_shape, cfg.q_layout))),
        slb=hq * t, slt=1, slh=t, T=t, G=hq // plan.hkv, Hq=hq, Dv=dv, num_segments=segments,
        num_programs=programs, HAS_SINKS=sinks is not None, MIN_SHARE=min_share, ROW_BLOCKS=plan.row_blocks,
        BLOCK_M=plan.block_m, BLOCK_PARTS=min(16, max(2, _next_pow2(parts))), BLOCK_DV=plan.block_dv,
    )
