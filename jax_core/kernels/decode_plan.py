"""Launch plans of the decode kernels, shared by both launchers (jax-triton and torch).

A decode call is three launches: the segment table (`decode_segments_triton`), the stream-K
attention kernel and the merge of its partial results (`decode_stream_triton`, through the entries
of `decode_entries_triton`). A plan turns a call's sizes, strides and `DecodeConfig` into
everything those launches need except the buffers: grids, warps, stages, every scalar argument by
name, and the shapes of the partial-result buffers. It is plain Python over ints, so the JAX
launcher (`decode_jax_triton`) and the torch launcher (`torch_api/native_decode.py`) launch the
same kernels with the same tiles and values (and so give the same bits).

Shape legend: B batch, T queries per sequence, Hq / Hkv query / KV heads, G = Hq // Hkv, S cache
capacity, D / Dv head dims, P pages, PS page size. Strides are element strides in the kernels'
order: queries and outputs (b, t, h, d); caches (batch or page, position or slot, head, d).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, NamedTuple, Optional

from .flash_plan import Launch

#: Cache layouts: contiguous (B, S, Hkv, D) or (B, Hkv, S, D), or pages (P, PS, Hkv, D).
CACHE_LAYOUTS = ("BSHD", "BHSD", "paged")
#: Programs per multiprocessor of the stream schedule. On an H100 (`benchmarks/decode_gpu.py --stream`,
#: BENCHMARKS.md "Decode: the stream-K schedule") one to four programs with three tiles stayed within
#: 3% of two with the default tile, except two combinations that were 4-8% slower.
STREAM_PROGRAMS_PER_SM = 2
#: Multiprocessors assumed when no launcher says how many the device has (an H100's 132; also the
#: count used under Triton's interpreter).
DEFAULT_SMS = 132
#: Sequences the segment-table kernel takes per step of its loop over the batch.
SEGMENT_BLOCK_B = 1024


class _PlanningDevice(threading.local):
    def __init__(self) -> None:
        self.sms = DEFAULT_SMS


_planning = _PlanningDevice()


@contextlib.contextmanager
def planning_for(sms: int) -> Iterator[None]:
    """Within the block, `DecodeConfig.stream_programs` plans for a device of `sms` multiprocessors
    (each launcher asks its own runtime: JAX's device, torch's)."""
    before, _planning.sms = _planning.sms, int(sms)
    try:
        yield
    finally:
        _planning.sms = before


def planning_sms() -> int:
    """The multiprocessors of the device being planned for (`DEFAULT_SMS` outside `planning_for`)."""
    return _planning.sms


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static settings of one decode call (hashable: part of a JAX trace or a torch plan key).

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
        """Programs of the stream schedule: `STREAM_PROGRAMS_PER_SM` per multiprocessor of the
        device being planned for (`planning_sms`)."""
        return STREAM_PROGRAMS_PER_SM * planning_sms()

    def stream_min_share(self, segments: int, max_blocks: int, programs: int) -> int:
        """The fewest key blocks one program takes: `default_min_share`."""
        return default_min_share(segments, max_blocks, programs)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def decode_tiles(d: int, dv: int, dtype_bytes: int) -> tuple[int, int, int]:
    """Default (BLOCK_N, num_warps, num_stages).

    From `benchmarks/decode_gpu.py --only-sweep` on an H100 (bf16, Hq=32, Hkv=8, D=128, jax 0.11.2,
    triton 3.6, 2026-11-22): (64, 4, 3) reads full caches at 94-95% of the copy bandwidth for
    (B=32, S=8192) and (B=8, S=32768); (128, 4, 3), (64, 8, 4) and (128, 8, 3) were within 2%,
    (64, 4, 2) up to 13% slower. That sweep ran the split schedule the stream one replaced; with
    the stream schedule (`--stream`, 2026-11-23) (64, 4, 4) and (128, 4, 3) stayed within 3% of
    (64, 4, 3).
    """
    width = max(next_pow2(d), next_pow2(dv))
    if dtype_bytes >= 4:
        return (32, 4, 2) if width > 128 else (64, 4, 2)
    if width > 128:
        return 32, 4, 3
    return 64, 4, 3


def row_block(rows: int, d: int) -> int:
    """BLOCK_M for G * T query rows: a power of two >= 16 (tl.dot's minimum), at most 64 (32 for D > 128)."""
    return min(max(16, next_pow2(rows)), 32 if d > 128 else 64)


def max_visible_blocks(capacity: int, t: int, window: tuple[int, int], causal: bool, block_n: int) -> int:
    """The most key blocks any sequence's queries can see: the capacity's, or the window's span's,
    plus one for a span that straddles a block boundary."""
    left, right = window
    span = capacity
    if left >= 0 and (causal or right >= 0):
        span = min(capacity, left + t + (0 if causal else right) + block_n)
    return -(-span // block_n) + 1


def default_min_share(segments: int, max_blocks: int, programs: int) -> int:
    """The fewest key blocks one program of the stream schedule takes: a quarter of what it gets
    when every sequence is full, and at least 4."""
    return max(4, -(-segments * max_blocks // programs) // 4)


def max_parts(max_blocks: int, min_share: int) -> int:
    """The most partial results one segment of at most `max_blocks` key blocks can have when every
    program takes at least `min_share` blocks (the slots of the partial-result buffers)."""
    return -(-max_blocks // min_share) + 1


def cache_dims(k_shape, layout: str, block_table_shape=None) -> tuple[int, int, int]:
    """(Hkv, capacity S, page size or 0) of a cache of shape `k_shape` in `layout`."""
    if layout == "paged":
        return k_shape[2], block_table_shape[1] * k_shape[1], k_shape[1]
    if layout == "BHSD":
        return k_shape[1], k_shape[2], 0
    return k_shape[2], k_shape[1], 0


def query_order(values: tuple[int, int, int, int], layout: str) -> tuple[int, int, int, int]:
    """Sizes or strides of a query / output in `layout` ("BTHD" or "BHTD"), as (b, t, h, d)."""
    a, b, c, d = values
    return (a, b, c, d) if layout == "BTHD" else (a, c, b, d)


def cache_order(values: tuple[int, int, int, int], layout: str) -> tuple[int, int, int, int]:
    """Sizes or strides of a cache in `layout`, as (batch or page, position or slot, head, d)."""
    a, b, c, d = values
    return (a, c, b, d) if layout == "BHSD" else (a, b, c, d)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous (row-major) array of `shape`."""
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(out[::-1])


class DecodeCall(NamedTuple):
    """A decode call's operands as the plans see them (strides in the kernels' order, module
    docstring).

    Attributes:
        b, t, hq, d, dv, hkv: sizes (shape legend).
        capacity: positions a sequence can hold (S, or max_pages * PS).
        page_size: PS (paged caches), else 0.
        q_strides, k_strides, v_strides, out_strides: element strides.
        table_stride: the block table's row stride (paged), else 0; its entries are consecutive.
        dtype_bytes: bytes per element of q / k / v (tile choice).
        has_starts, has_sinks: first valid positions / sink logits are given.
        alibi_stride: None without ALiBi, else the batch stride of the float32 slopes (0 for one
            slope per head (Hq,), Hq for (B, Hq)); a head's slopes are consecutive.
    """

    b: int
    t: int
    hq: int
    d: int
    dv: int
    hkv: int
    capacity: int
    page_size: int
    q_strides: tuple[int, int, int, int]
    k_strides: tuple[int, int, int, int]
    v_strides: tuple[int, int, int, int]
    out_strides: tuple[int, int, int, int]
    table_stride: int
    dtype_bytes: int
    has_starts: bool
    has_sinks: bool
    alibi_stride: Optional[int] = None


class DecodePlan(NamedTuple):
    """The three launches of a decode call and the buffers between them.

    segments: (Lengths, Starts, SegCum); stream: (Q, K, V, Lengths, Starts, BlockTable, SegCum,
    Alibi, OutPart, LsePart); merge: (OutPart, LsePart, SegCum, Sinks, Out, Lse). SegCum is
    (num_segments + 1,) int32; OutPart (part_shape) and LsePart (part_shape[:-1]) are contiguous
    float32; Lse is (B, Hq, T) float32 contiguous.
    """

    segments: Launch
    stream: Launch
    merge: Launch
    num_segments: int
    part_shape: tuple[int, int, int, int, int]


def _named(names: tuple[str, ...], values) -> dict:
    return dict(zip(names, values))


def segments_launch(b: int, t: int, capacity: int, cfg: DecodeConfig, block_n: int, segments_per_sequence: int,
                    has_starts: bool) -> Launch:
    """The segment-table kernel's launch (one program): SegCum (B * segments_per_sequence + 1,)."""
    block_b = min(SEGMENT_BLOCK_B, max(16, next_pow2(b)))
    args = dict(B=b, T=t, capacity=capacity, window_left=int(cfg.window[0]), window_right=int(cfg.window[1]),
                pos_shift=int(cfg.pos_shift), SEGMENTS_PER_SEQ=segments_per_sequence, CAUSAL=bool(cfg.causal),
                HAS_STARTS=bool(has_starts), BLOCK_N=block_n, BLOCK_B=block_b)
    return Launch((1,), 4 if block_b >= 256 else 1, 1, args)


def plan_decode(call: DecodeCall, cfg: DecodeConfig, sms: int) -> DecodePlan:
    """The launches of `call` on a device of `sms` multiprocessors (`planning_for`)."""
    if cfg.cache_layout not in CACHE_LAYOUTS:
        raise ValueError(f"cache_layout={cfg.cache_layout!r}: expected one of {CACHE_LAYOUTS}.")
    b, t, hq, d, dv, hkv = call.b, call.t, call.hq, call.d, call.dv, call.hkv
    g = hq // hkv
    block_n, num_warps, num_stages = cfg.launch_tiles(d, dv, call.dtype_bytes)
    block_m = row_block(g * t, d)
    row_blocks = cdiv(g * t, block_m)
    block_d, block_dv = max(16, next_pow2(d)), max(16, next_pow2(dv))
    segments = b * hkv * row_blocks
    with planning_for(sms):
        programs = max(1, int(cfg.stream_programs()))
    window = tuple(cfg.window)
    max_blocks = max_visible_blocks(call.capacity, t, window, bool(cfg.causal), block_n)
    min_share = cfg.stream_min_share(segments, max_blocks, programs)
    parts = max_parts(max_blocks, min_share)
    part_shape = (b, t, hq, parts, dv)
    part_strides = contiguous_strides(part_shape)
    lse_part_strides = contiguous_strides(part_shape[:-1])
    paged = cfg.cache_layout == "paged"

    stream = dict(
        **_named(("sqb", "sqt", "sqh", "sqd"), call.q_strides),
        **_named(("skb", "sks", "skh", "skd"), call.k_strides),
        **_named(("svb", "svs", "svh", "svd"), call.v_strides),
        stb=call.table_stride if paged else 0,
        **_named(("sob", "sot", "soh", "sopart", "sod"), part_strides),
        **_named(("slb", "slt", "slh", "slpart"), lse_part_strides),
        scale=float(cfg.scale), softcap=float(cfg.softcap or 1.0), window_left=int(window[0]),
        window_right=int(window[1]), pos_shift=int(cfg.pos_shift), T=t, G=g, Hkv=hkv, D=d, Dv=dv,
        capacity=call.capacity, num_segments=segments, num_programs=programs, CAUSAL=bool(cfg.causal),
        HAS_STARTS=bool(call.has_starts), PAGED=paged, PAGE_SIZE=max(call.page_size, 1),
        SOFTCAP=cfg.softcap is not None, FAST_TANH=bool(cfg.fast_tanh) and call.dtype_bytes < 4,
        ROW_BLOCKS=row_blocks, MIN_SHARE=min_share, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_DV=block_dv, BLOCK_SEG=min(1024, max(16, next_pow2(segments))),
        sab=int(call.alibi_stride or 0), ALIBI=call.alibi_stride is not None,
    )
    merge = dict(
        **_named(("spb", "spt", "sph", "sppart", "spd"), part_strides),
        **_named(("sqb", "sqt", "sqh", "sqpart"), lse_part_strides),
        **_named(("sob", "sot", "soh", "sod"), call.out_strides),
        slb=hq * t, slt=1, slh=t, T=t, G=g, Hq=hq, Dv=dv, num_segments=segments, num_programs=programs,
        HAS_SINKS=bool(call.has_sinks), MIN_SHARE=min_share, ROW_BLOCKS=row_blocks, BLOCK_M=block_m,
        BLOCK_PARTS=min(16, max(2, next_pow2(parts))), BLOCK_DV=block_dv,
    )
    return DecodePlan(
        segments=segments_launch(b, t, call.capacity, cfg, block_n, hkv * row_blocks, call.has_starts),
        stream=Launch((programs,), num_warps, num_stages, stream),
        merge=Launch((b * t * hq,), 1, 1, merge),
        num_segments=segments,
        part_shape=part_shape,
    )
