"""Launch plans of the flash kernels, shared by both launchers (jax-triton and torch).

A plan turns a call's sizes, strides and settings into everything a launch needs except the
buffers: the grid, warps and stages, and every scalar argument of the entry kernel by name. It is
plain Python over ints (no arrays), so the JAX launcher (`flash_jax_triton`, all scalars as
constexprs) and the torch launcher (`flash_dynamic_triton` entries, sizes and strides as runtime
arguments) launch the same kernels with the same tiles and the same values.

Shape legend: B batch, Hq / Hk query / KV heads, L query length, S key length, D / Dv head dims.
Every operand is described in (B, H, T, D) order ("BHTD") whatever its memory layout: `Operand`
holds its sizes and element strides in that order, stride 0 on broadcast (size-1) dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

Tile = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


def next_power_of_2(n):
    """Smallest power of two >= n (1 for n <= 1)."""
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def head_block(d):
    """BLOCK_D / BLOCK_DV for a head dim d on a GPU: next_power_of_2(d), at least 16.

    tl.dot needs every dimension >= 16 on NVIDIA GPUs, so tiny head dims (d < 16) are padded to 16
    (the kernel masks the padding). For d >= 9 this equals next_power_of_2(d).
    """
    return max(16, next_power_of_2(d))


def fwd_block_sizes(D, Dv, dtype_bytes):
    """Default launch parameters for an H100: (BLOCK_M, BLOCK_N, num_warps, num_stages).

    Args:
        D: query/key head dim.
        Dv: value head dim.
        dtype_bytes: bytes per element of Q/K/V (2 for fp16/bf16, 4 for fp32).

    Returns:
        (BLOCK_M, BLOCK_N, num_warps, num_stages): the fastest of one-off tile sweeps on an H100
        with Triton 3.6, bf16 (`benchmarks/flash_fwd_tiles.py` and `flash_fwd_tiles_native.py`,
        removed from the tree; last in 568a808). JAX-level, 2026-11-22: D=128 469 TFLOP/s causal
        L=8192 and 485 non-causal L=2048 with (64, 64, 4, 3) (against 444 / 438 with
        (128, 64, 8, 3)), which also keeps the soft cap's cost at 11-13%; D=256 479 causal with
        (128, 64, 8, 2) (deeper pipelines exceed shared memory). D=64 (torch launcher, causal GQA at
        the model benchmark's shapes, B16 L512 to B1 L8192, both (B, L, H, D) and (B, H, L, D)
        memory, 2026-11-24):
        (64, 64, 4, 3) took 47-48 / 116-117 / 376-378 / 715-717 µs, the fastest of six tiles at
        every shape, against 65 / 124-149 / 383-397 / 741-945 µs with (128, 64, 8, 3).
    """
    d = max(next_power_of_2(D), next_power_of_2(Dv))
    if dtype_bytes >= 4:
        # float32 runs its dots as tf32x3; keep 4 warps (Triton 3.6 miscompiled a float32
        # 8-warp BLOCK_N=16 variant on an H100).
        if d <= 64:
            return 64, 64, 4, 2
        if d <= 128:
            return 64, 32, 4, 2
        return 32, 32, 4, 1
    if d <= 128:
        return 64, 64, 4, 3
    return 128, 64, 8, 2


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Static settings of one flash call (hashable: part of a JAX trace or a torch plan key).

    The launch choices (tiles, skipping fully masked tiles) are not settings: the methods below
    return the tuned ones. A benchmark comparing alternatives overrides them in a subclass of its
    own (as the tile sweeps and the block-skip benchmark did, in `benchmarks/flash_swept_config.py`,
    last in 568a808); a subclass never equals a FlashConfig, so its compilations and launch plans
    stay apart.
    """

    scale: float
    causal: bool = False
    diag_offset: int = 0  # S - L for bottom-right alignment, else 0
    window: tuple[int, int] = (-1, -1)  # (left, right); -1 = unbounded
    softcap: Optional[float] = None
    layout: str = "BHTD"
    dropout_p: float = 0.0  # needs a dropout seed
    # Varlen packing (needs cumulative sequence lengths): (max_seqlen_q, max_seqlen_k) grid bounds.
    varlen: Optional[tuple[int, int]] = None
    varlen_bottom_right: bool = False  # per-sequence bottom-right alignment (varlen only)
    fast_tanh: bool = False  # hardware tanh for the soft cap (NVIDIA; 16-bit inputs only)

    def forward_tile(self, call: FlashCall) -> Tile:
        """The forward kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages): `fwd_block_sizes`."""
        return fwd_block_sizes(call.q.dims[3], call.v.dims[3], call.dtype_bytes)

    def backward_tiles(self, call: FlashCall) -> tuple[Tile, Tile]:
        """The tiles of the dK/dV kernel and of the dQ kernel: `bwd_tiles`."""
        return bwd_tiles(call.q.dims[3], call.dtype_bytes)

    def skips_masked_blocks(self) -> bool:
        """Whether the kernels skip (query block, key block) tiles that the bool mask or a -inf bias
        masks entirely, from a block-visibility table (never with varlen): always. On an H100 the
        table cost at most 2% with a dense mask and made masks leaving an eighth visible about 6.5x
        faster (BENCHMARKS.md, "Tiles fully masked")."""
        return True


class Operand(NamedTuple):
    """Sizes and element strides of one tensor in (B, H, T, D) order (stride 0 on size-1 dims)."""

    dims: tuple[int, int, int, int]
    strides: tuple[int, int, int, int]

    @classmethod
    def of(cls, dims, strides) -> "Operand":
        """The operand of a tensor with these sizes and strides (a size-1 dim's stride becomes 0)."""
        return cls(tuple(dims), tuple(0 if n == 1 else st for n, st in zip(dims, strides)))


class Launch(NamedTuple):
    """One kernel launch without its buffers: grid, warps, stages and the scalar arguments by name."""

    grid: tuple[int, int]
    num_warps: int
    num_stages: int
    args: dict


class FlashCall(NamedTuple):
    """A flash call's operands, as the plans see them.

    Attributes:
        q, k, v: `Operand`s (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv); with varlen B = 1.
        bias, mask: `Operand`s of the (B|1, Hq|1, L|1, S) bias / int8 mask, or None.
        dtype_bytes: bytes per element of q/k/v (tile choice).
        has_sinks, has_segments: sink logits / segment tables are passed.
        num_seqs: packed sequences with varlen (len(cu_seqlens) - 1), else None.
        alibi_stride: None without ALiBi, else the batch stride of the float32 slopes: 0 for
            (Hq,) slopes, Hq for (B, Hq) ones (B = sequences with varlen).
    """

    q: Operand
    k: Operand
    v: Operand
    bias: Optional[Operand]
    mask: Optional[Operand]
    dtype_bytes: int
    has_sinks: bool = False
    has_segments: bool = False
    num_seqs: Optional[int] = None
    alibi_stride: Optional[int] = None


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a contiguous (row-major) array; size-1 dims get stride 0 (they broadcast)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step if n != 1 else 0)
        step *= n
    return tuple(reversed(strides))


def to_bhtd(values: tuple[int, int, int, int], layout: str) -> tuple[int, int, int, int]:
    """Sizes or strides of a 4-D array in `layout` ("BHTD" or "BTHD"), reordered to (B, H, T, D)."""
    a, b, c, d = values
    return (a, b, c, d) if layout == "BHTD" else (a, c, b, d)


def bwd_tiles(d: int, dtype_bytes: int) -> tuple[Tile, Tile]:
    """Default backward tiles for head dim `d`: (dK/dV kernel, dQ kernel).

    From a one-off sweep (`benchmarks/flash_bwd_tiles.py`, removed from the tree; last in 568a808)
    on an H100 (bf16, causal, L=8192): 64x64 tiles with 4 warps for both kernels at D=128
    (393 TFLOP/s fwd+bwd, against 202 with 8 warps). Above D=128 the dK/dV kernel takes 32 keys per
    program with 4 warps: forward + backward at (1, 8/4, 8192, 256) and (2, 8/4, 4096, 256) causal
    bf16 on an H200, 3207 / 1905 µs against 3720 / 2153 with 64 keys and 8 warps (the H100 sweep's
    choice), the gradients equal to the bit; 16 keys, 2 warps, 1 or 3 stages and other dQ tiles were
    slower (BENCHMARKS.md "Head dim 256"). fp32 keeps 4 warps and smaller tiles (Triton 3.6
    miscompiles some fp32 tiles with 8 warps on Hopper; shared memory is doubled).
    """
    if dtype_bytes >= 4:
        block = 64 if d <= 64 else 32
        return (block, block, 4, 2), (block, block, 4, 2)
    return ((64, 64, 4, 2) if d <= 128 else (64, 32, 4, 2)), (64, 64, 4, 2)


def forward_tile(call: FlashCall, cfg: FlashConfig) -> Tile:
    return cfg.forward_tile(call)


def backward_tiles(call: FlashCall, cfg: FlashConfig) -> tuple[Tile, Tile]:
    return cfg.backward_tiles(call)


def uses_skip_table(call: FlashCall, cfg: FlashConfig) -> bool:
    """Whether the kernels skip tiles masked entirely by the bool mask or a -inf bias."""
    return cfg.skips_masked_blocks() and (call.bias is not None or call.mask is not None) and cfg.varlen is None


def skip_fine_tile(call: FlashCall, cfg: FlashConfig) -> tuple[int, int]:
    """A tile dividing the tiles of the forward and both backward kernels."""
    fwd = forward_tile(call, cfg)
    kv, dq = backward_tiles(call, cfg)
    return math.gcd(fwd[0], kv[0], dq[0]), math.gcd(fwd[1], kv[1], dq[1])


def _named(prefix: tuple[str, str, str, str], values) -> dict:
    return dict(zip(prefix, values))


_ZERO4 = (0, 0, 0, 0)


def key_args(k: Operand, v: Operand) -> dict:
    """The scalar arguments that depend on the keys' length and layout: S and K's and V's strides."""
    return dict(**_named(("skb", "skh", "skn", "skd"), k.strides), **_named(("svb", "svh", "svn", "svd"), v.strides),
                S=k.dims[2])


def forward_follows_keys(call: FlashCall, cfg: FlashConfig) -> bool:
    """Whether `forward_launch` depends on the keys only through `key_args`, so a forward planned
    for one key length serves another (a growing KV cache) by replacing those arguments: true
    without varlen (whose grid follows the key bounds) and without skip tables (whose shape does)."""
    return cfg.varlen is None and not uses_skip_table(call, cfg)


def common_args(call: FlashCall, cfg: FlashConfig) -> dict:
    """Scalar arguments shared by the forward, dK/dV and dQ entry kernels."""
    b, hq, l, d = call.q.dims
    hk = call.k.dims[1]
    dv = call.v.dims[3]
    dropout = cfg.dropout_p > 0
    return dict(
        **_named(("sqb", "sqh", "sqm", "sqd"), call.q.strides),
        **key_args(call.k, call.v),
        **_named(("sbb", "sbh", "sbm", "sbn"), call.bias.strides if call.bias is not None else _ZERO4),
        **_named(("smb", "smh", "smm", "smn"), call.mask.strides if call.mask is not None else _ZERO4),
        Hq=hq, Hk=hk, L=l, D=d, Dv=dv, scale=float(cfg.scale),
        softcap=float(cfg.softcap or 1.0), window_left=int(cfg.window[0]), window_right=int(cfg.window[1]),
        diag_offset=int(cfg.diag_offset), CAUSAL=bool(cfg.causal), HAS_BIAS=call.bias is not None,
        HAS_MASK=call.mask is not None, SOFTCAP=cfg.softcap is not None, BLOCK_D=head_block(d),
        BLOCK_DV=head_block(dv), dropout_p=float(cfg.dropout_p), HAS_SEGMENTS=bool(call.has_segments),
        VARLEN=cfg.varlen is not None, VARLEN_BOTTOM_RIGHT=bool(cfg.varlen_bottom_right), DROPOUT=dropout,
        FAST_TANH=bool(cfg.fast_tanh) and call.dtype_bytes < 4,
        sab=int(call.alibi_stride or 0), ALIBI=call.alibi_stride is not None,
    )


def _skip_args(skip_strides: Optional[tuple[int, ...]]) -> dict:
    if skip_strides is None:
        return dict(stb=0, sth=0, str_=0, BLOCK_SKIP=False)
    return dict(stb=skip_strides[0], sth=skip_strides[1], str_=skip_strides[2], BLOCK_SKIP=True)


def _programs(call: FlashCall, cfg: FlashConfig, which: str) -> tuple[int, int]:
    """(rows to cover along the sequence, number of (sequence, head) programs) for `which` in
    ("q", "k"): the padded length and B * heads normally; the max sequence length and N * heads
    with varlen."""
    b, hq, l, _ = call.q.dims
    hk, s = call.k.dims[1], call.k.dims[2]
    heads, full = (hq, l) if which == "q" else (hk, s)
    if cfg.varlen is None:
        return full, b * heads
    bound = cfg.varlen[0] if which == "q" else cfg.varlen[1]
    return min(int(bound), full), int(call.num_seqs) * heads


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def forward_launch(call: FlashCall, cfg: FlashConfig, out_strides: tuple[int, ...],
                   skip_strides: Optional[tuple[int, ...]] = None) -> Launch:
    """The forward kernel's launch; `out_strides` of Out in (B, H, T, Dv) order."""
    block_m, block_n, warps, stages = forward_tile(call, cfg)
    rows, programs = _programs(call, cfg, "q")
    args = dict(common_args(call, cfg), **_named(("sob", "soh", "som", "sod"), out_strides),
                HAS_SINKS=bool(call.has_sinks), BLOCK_M=block_m, BLOCK_N=block_n, **_skip_args(skip_strides))
    return Launch((_cdiv(rows, block_m), programs), warps, stages, args)


def dkdv_launch(call: FlashCall, cfg: FlashConfig, do_strides, dk_strides, dv_strides,
                skip_strides: Optional[tuple[int, ...]] = None) -> Launch:
    """The dK/dV kernel's launch (strides in (B, H, T, D) order)."""
    (block_m, block_n, warps, stages), _ = backward_tiles(call, cfg)
    rows, programs = _programs(call, cfg, "k")
    args = dict(common_args(call, cfg), **_named(("sdob", "sdoh", "sdom", "sdod"), do_strides),
                **_named(("sdkb", "sdkh", "sdkn", "sdkd"), dk_strides),
                **_named(("sdvb", "sdvh", "sdvn", "sdvd"), dv_strides),
                BLOCK_M=block_m, BLOCK_N=block_n, **_skip_args(skip_strides))
    return Launch((_cdiv(rows, block_n), programs), warps, stages, args)


def dq_launch(call: FlashCall, cfg: FlashConfig, do_strides, dq_strides, ds_strides: Optional[tuple[int, ...]],
              skip_strides: Optional[tuple[int, ...]] = None) -> Launch:
    """The dQ kernel's launch; `ds_strides` of the (B, Hq, L, S) bias gradient, None when not written."""
    _, (block_m, block_n, warps, stages) = backward_tiles(call, cfg)
    rows, programs = _programs(call, cfg, "q")
    args = dict(common_args(call, cfg), **_named(("sdob", "sdoh", "sdom", "sdod"), do_strides),
                **_named(("sdqb", "sdqh", "sdqm", "sdqd"), dq_strides),
                **_named(("sdsb", "sdsh", "sdsm", "sdsn"), ds_strides if ds_strides is not None else _ZERO4),
                WRITE_DS=ds_strides is not None, BLOCK_M=block_m, BLOCK_N=block_n, **_skip_args(skip_strides))
    return Launch((_cdiv(rows, block_m), programs), warps, stages, args)


#: Rows per program of the Delta = rowsum(dOut * Out) kernel.
DELTA_BLOCK_M = 64


def delta_launch(out: Operand, do_strides: tuple[int, ...]) -> Launch:
    """The Delta kernel's launch over Out (B, Hq, L, Dv); Delta is (B, Hq, L) float32 contiguous."""
    b, hq, l, dv = out.dims
    args = dict(**_named(("sob", "soh", "som", "sod"), out.strides),
                **_named(("sdob", "sdoh", "sdom", "sdod"), do_strides),
                Hq=hq, L=l, Dv=dv, BLOCK_M=DELTA_BLOCK_M, BLOCK_DV=head_block(dv))
    return Launch((_cdiv(l, DELTA_BLOCK_M), b * hq), 4, 1, args)


def hopper_backward_operands_launch(out: Operand, do_strides: tuple[int, ...], lse_strides: tuple[int, int, int],
                                    accum_strides: tuple[int, int, int], rows: int,
                                    accum_rows: Optional[int] = None) -> Launch:
    """The launch of `hopper_bwd_passes_triton`'s operands pass over Out (B, Hq, L, D) for the Hopper
    backward's `rows` padded query rows: Delta and LseLog2 (B * Hq, rows) float32 contiguous;
    `lse_strides` of the (B, Hq, L) LSE and `accum_strides` of the float32 dQ accumulator, both in
    (B, Hq, row) order; the accumulator has `accum_rows` rows (default `rows`)."""
    b, hq, l, d = out.dims
    args = dict(**_named(("sob", "soh", "som", "sod"), out.strides),
                **_named(("sdob", "sdoh", "sdom", "sdod"), do_strides),
                **_named(("slb", "slh", "slm"), lse_strides), **_named(("sab", "sah", "sam"), accum_strides),
                Hq=hq, L=l, ROWS=rows, ACCUM_ROWS=rows if accum_rows is None else accum_rows, D=d,
                BLOCK_M=DELTA_BLOCK_M, BLOCK_D=head_block(d))
    return Launch((_cdiv(rows, DELTA_BLOCK_M), b * hq), 4, 1, args)


#: Elements per program of the Hopper backward's results pass.
RESULTS_BLOCK = 1024


def hopper_backward_results_launch(nq: int, nkv: int, splits: int) -> Launch:
    """The launch of `hopper_bwd_passes_triton`'s results pass: dQ of `nq` elements cast, dK and dV of
    `nkv` elements each summed over `splits` float32 partials."""
    grid = _cdiv(nq, RESULTS_BLOCK) + 2 * _cdiv(nkv, RESULTS_BLOCK)
    return Launch((grid,), 4, 1, dict(NQ=nq, NKV=nkv, SPLITS=splits, BLOCK=RESULTS_BLOCK))
