"""Launch plan of the Hopper (sm90) flash forward prototype, `flash_fwd_tma_triton.py`.

Plain Python over ints, like `flash_plan.py`: sizes and strides in, grid, warps, stages and every
scalar argument of `flash_fwd_tma_kernel` by name out, so any launcher (torch or JAX) launches the
kernel the same way. It also checks what the tensor-memory-accelerator (TMA) descriptors need, so a
bad call fails here with a clear message instead of inside a kernel:

* unit stride on the head dim, every other stride a multiple of 16 bytes, 16-byte aligned bases;
* head dims 64 or 128 (the whole head is one descriptor block), the same for Q, K and V;
* 2-byte inputs (float16 / bfloat16: tensor-core dots) or 4-byte float32 (exact fp32 dots, slow:
  for checking the kernel's math, not for speed).

Shape legend: B batch, Hq / Hk query / KV heads (Hq % Hk == 0), L query length, S key length, D head
dim. Operands are `flash_plan.Operand`s in (B, H, T, D) order whatever their memory layout.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

from .flash_plan import Launch, Operand

HEAD_DIMS = (64, 128)
DTYPE_BYTES = (2, 4)
TMA_ALIGN_BYTES = 16
_MAX_GRID_YZ = 65535  # CUDA's limit on grid dims 1 and 2


class TmaTile(NamedTuple):
    """Launch choices of the prototype (the things a benchmark varies).

    Attributes:
        block_m: query rows per program (power of two in [16, 256]).
        block_n: keys per loop step (power of two in [16, 256]).
        num_warps: warps per program.
        num_stages: software-pipeline depth of the key loops (`tl.range(num_stages=...)`, and the
            kernel-level setting).
        warp_specialize: `tl.range(warp_specialize=True)` on the key loops (producer warps issue
            the TMA loads, consumer warps the dots and the softmax).
        heads_fastest: grid (B * Hq, query blocks) instead of (query blocks, B * Hq). GPUs start
            programs in grid order, dim 0 fastest, and the kernel reverses the query-block index,
            so with heads fastest the first wave holds the last (longest causal) block of every
            head; otherwise each head's blocks start together, longest first.
    """

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    warp_specialize: bool = False
    heads_fastest: bool = True


DEFAULT_TILE = TmaTile()


def _fail(name, value, expected, hint):
    raise ValueError(f"{name}={value!r}: expected {expected}. {hint}")


def _check_operand(name: str, op: Operand, dtype_bytes: int, head_dim: int) -> None:
    dims, strides = op.dims, op.strides
    if len(dims) != 4 or len(strides) != 4:
        _fail(f"{name}.dims/strides", op, "4 sizes and 4 strides in (B, H, T, D) order",
              "Describe the tensor as (batch, heads, length, head_dim).")
    if any(int(n) < 1 for n in dims):
        _fail(f"{name}.dims", dims, "every size >= 1", "Empty tensors need no kernel launch.")
    if dims[3] != head_dim:
        _fail(f"{name}.dims[3] (head dim)", dims[3], f"{head_dim} (the query's head dim)",
              "The prototype needs one head dim for Q, K, V and Out.")
    if strides[3] != 1:
        _fail(f"{name}.strides[3] (head-dim stride)", strides[3], "1 (TMA reads rows of contiguous elements)",
              "Call .contiguous() on the tensor first.")
    for axis, (n, s) in enumerate(zip(dims[:3], strides[:3])):
        if n > 1 and (s <= 0 or (s * dtype_bytes) % TMA_ALIGN_BYTES):
            _fail(f"{name}.strides[{axis}]", s, f"a positive multiple of {TMA_ALIGN_BYTES // dtype_bytes} elements "
                  f"({TMA_ALIGN_BYTES} bytes, a TMA requirement)", "Call .contiguous() on the tensor first.")


def _seq_stride(op: Operand) -> int:
    """The descriptor's row stride: a length-1 sequence may report stride 0 (a broadcast dim), which a
    TMA descriptor cannot hold; any aligned value works there since only row 0 is read."""
    return op.strides[2] if op.dims[2] > 1 else op.dims[3]


def _check_tile(tile: TmaTile) -> None:
    for name in ("block_m", "block_n"):
        value = getattr(tile, name)
        if not isinstance(value, int) or value < 16 or value > 256 or value & (value - 1):
            _fail(f"tile.{name}", value, "a power of two in [16, 256]",
                  "tl.dot needs tiles of at least 16 on NVIDIA GPUs; a TMA box has at most 256 rows.")
    if tile.num_warps not in (4, 8):
        _fail("tile.num_warps", tile.num_warps, "4 or 8", "Hopper's warp-group dots use groups of 4 warps.")
    if not isinstance(tile.num_stages, int) or tile.num_stages < 1:
        _fail("tile.num_stages", tile.num_stages, "an int >= 1", "Use 1 for no pipelining.")


def fwd_tma_launch(q: Operand, k: Operand, v: Operand, out: Operand, *, dtype_bytes: int, scale: float,
                   causal: bool, diag_offset: int = 0, tile: TmaTile = DEFAULT_TILE,
                   base_addresses: Optional[Sequence[int]] = None) -> Launch:
    """The launch of `flash_fwd_tma_kernel` (without its buffers Q, K, V, Out, Lse).

    Args:
        q, k, v, out: (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D), (B, Hq, L, D) `Operand`s.
        dtype_bytes: bytes per element of q / k / v / out (2 or 4).
        scale: softmax scale (logits = scale * q k^T), finite.
        causal: hide keys j > i + diag_offset from query i.
        diag_offset: 0 for top-left alignment, S - L for bottom-right.
        tile: the launch choices (`TmaTile`).
        base_addresses: the data addresses of q, k, v, out, checked for 16-byte alignment when given.

    Returns:
        `flash_plan.Launch`: grid, num_warps, num_stages and the kernel's scalar arguments by name.
        Lse is (B, Hq, L) float32 contiguous.

    Raises:
        ValueError naming the argument for anything the kernel or TMA cannot take.
    """
    _check_tile(tile)
    if dtype_bytes not in DTYPE_BYTES:
        _fail("dtype_bytes", dtype_bytes, f"one of {DTYPE_BYTES}", "Pass float16 / bfloat16 (or float32 for checks).")
    b, hq, l, d = (int(n) for n in q.dims)
    if d not in HEAD_DIMS:
        _fail("q.dims[3] (head dim)", d, f"one of {HEAD_DIMS}", "Other head dims use the portable flash kernel.")
    for name, op in (("q", q), ("k", k), ("v", v), ("out", out)):
        _check_operand(name, op, dtype_bytes, d)
    hk, s = int(k.dims[1]), int(k.dims[2])
    if k.dims[0] != b or v.dims[0] != b:
        _fail("k.dims[0]/v.dims[0] (batch)", (k.dims[0], v.dims[0]), f"{b} (the query's batch)", "Pass matching batches.")
    if tuple(v.dims[:3]) != (b, hk, s):
        _fail("v.dims", v.dims, f"({b}, {hk}, {s}, {d}) like k", "K and V need the same heads and length.")
    if tuple(out.dims) != (b, hq, l, d):
        _fail("out.dims", out.dims, f"({b}, {hq}, {l}, {d}) like q", "Allocate Out with the query's shape.")
    if hq % hk:
        _fail("k.dims[1] (KV heads)", hk, f"a divisor of the {hq} query heads", "GQA needs Hq % Hk == 0.")
    if not math.isfinite(float(scale)):
        _fail("scale", scale, "a finite float", "The default is 1 / sqrt(head_dim).")
    if not isinstance(diag_offset, int) or isinstance(diag_offset, bool):
        _fail("diag_offset", diag_offset, "an int", "Use 0 (top-left) or S - L (bottom-right).")
    if base_addresses is not None:
        for name, addr in zip(("q", "k", "v", "out"), base_addresses):
            if int(addr) % TMA_ALIGN_BYTES:
                _fail(f"{name} data address", hex(int(addr)), f"a multiple of {TMA_ALIGN_BYTES}",
                      "Call .clone() on the tensor (a fresh allocation is aligned).")
    blocks = -(-l // tile.block_m)
    grid = (b * hq, blocks) if tile.heads_fastest else (blocks, b * hq)
    if grid[1] > _MAX_GRID_YZ:
        _fail("grid[1]", grid[1], f"<= {_MAX_GRID_YZ} programs", "Use heads_fastest=True, or larger blocks.")
    args = dict(
        sqb=q.strides[0], sqh=q.strides[1], sqm=_seq_stride(q),
        skb=k.strides[0], skh=k.strides[1], skn=_seq_stride(k),
        svb=v.strides[0], svh=v.strides[1], svn=_seq_stride(v),
        sob=out.strides[0], soh=out.strides[1], som=_seq_stride(out),
        Hq=hq, Hk=hk, L=l, S=s, scale=float(scale), diag_offset=int(diag_offset),
        CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        NUM_STAGES=tile.num_stages, WARP_SPECIALIZE=bool(tile.warp_specialize),
        HEADS_FASTEST=bool(tile.heads_fastest),
    )
    return Launch(grid, tile.num_warps, tile.num_stages, args)
