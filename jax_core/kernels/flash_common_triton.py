"""Triton helpers shared by the flash forward and backward kernels (see FLASH_CONTRACT.md).

Imports only `triton` / `triton.language`, like the kernels, so it runs under the interpreter.
"""

import triton
import triton.language as tl


@triton.jit
def tanh_f32(x, FAST: tl.constexpr):
    """tanh of a float32 tensor.

    Args:
        x: float32 tensor of any shape.
        FAST: use the hardware approximation (PTX ``tanh.approx.f32``, one MUFU op; NVIDIA only,
            not under the interpreter; max relative error about 2^-11). Otherwise an overflow-free
            formula from exp that is accurate near 0.

    Returns:
        tanh(x), same shape.
    """
    if FAST:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)


@triton.jit
def load_seed(Seed):
    """The 64-bit dropout seed from two int32 words at `Seed` (low word first)."""
    lo = tl.load(Seed).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(Seed + 1).to(tl.int64) & 0xFFFFFFFF
    return (hi << 32) | lo


@triton.jit
def dropout_keep(seed, row0, rows, cols, S_mem, dropout_p):
    """Keep mask of dropout for a (rows, cols) tile: True where the element survives.

    Element (bh, i, j) of the logical (B * Hq, L, S) probability tensor draws Philox uniform number
    number ``((bh * L + i) * S + j)`` under `seed`; the forward and backward kernels (and the
    mask-materialising test kernel) therefore agree element by element.

    Args:
        seed: int64 scalar (see `load_seed`).
        row0: int64 scalar, bh * L (the first row of this (batch, head) in the flattened rows).
        rows: (BLOCK_M,) query rows in memory coordinates. cols: (BLOCK_N,) keys in memory
            coordinates.
        S_mem: key length of the key tensor in memory.
        dropout_p: drop probability in [0, 1).

    Returns:
        (BLOCK_M, BLOCK_N) bool.
    """
    offs = (row0 + rows.to(tl.int64))[:, None] * S_mem + cols.to(tl.int64)[None, :]
    return tl.rand(seed, offs) >= dropout_p


@triton.jit
def dropout_mask_kernel(Seed, Keep, BH, L, S, dropout_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Writes the (BH, L, S) int8 keep mask that the attention kernels use (tests and debugging).

    Grid (cdiv(L, BLOCK_M), BH). Keep is contiguous (BH, L, S); 1 = kept.
    """
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    seed = load_seed(Seed)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    for start_n in range(0, S, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(seed, bh * L, rows, cols, S, dropout_p)
        ptrs = Keep + (bh * L + rows.to(tl.int64))[:, None] * S + cols[None, :]
        tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < L) & (cols[None, :] < S))
