"""The Hopper backward's per-row operands, made in one Triton pass (the torch launcher's).

The Mosaic GPU backward (`flash_bwd_mgpu`) reads, per query row of its padded length, the LSE in
log2 units and delta = rowsum(dO * O), and adds dQ into a float32 accumulator that starts at zero.
Made with torch ops these are five to seven small launches per backward (the delta pass, two for
the LSE, two pads, a fill): this kernel makes all three in one launch, and its host cost once. The
JAX launcher computes the same values with jnp ops that XLA fuses (`flash_bwd_mgpu.backward_operands`).
Imports only `triton`.
"""

import triton
import triton.language as tl

_LOG2E: tl.constexpr = 1.4426950408889634


@triton.jit
def hopper_backward_operands_kernel(
    Out, dOut, Lse, Delta, LseLog2, dQAccum,
    sob, soh, som, sod, sdob, sdoh, sdom, sdod, slb, slh, slm, sab, sah, sam,
    Hq, L, ROWS,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(ROWS, BLOCK_M), B * Hq); rows L..ROWS-1 are the kernels' padding.

    Args:
        Out, dOut: (B, Hq, L, D) forward output and its gradient, element strides so*, sdo*.
        Lse: (B, Hq, L) float32 natural-log LSE (-inf for a row that saw no key), strides sl*.
        Delta, LseLog2: (B * Hq, ROWS) float32 contiguous, written: rowsum(dO * O) and LSE * log2(e),
            with +inf for an LSE of -inf (its probabilities exp2(s - inf) are then 0, not NaN);
            padded rows get delta 0 and LSE +inf, so they add nothing to dK and dV.
        dQAccum: float32, D contiguous, element strides sa* in (B, Hq, row) order, zeroed on ROWS rows.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    real = rows < L
    in_tile = rows < ROWS
    ok = real[:, None] & (cols[None, :] < D)
    o = tl.load(Out + b * sob + h * soh + rows[:, None] * som + cols[None, :] * sod, mask=ok, other=0.0)
    do = tl.load(dOut + b * sdob + h * sdoh + rows[:, None] * sdom + cols[None, :] * sdod, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    lse = tl.load(Lse + b * slb + h * slh + rows * slm, mask=real, other=float("-inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    at = pid_bh.to(tl.int64) * ROWS + rows
    tl.store(Delta + at, delta, mask=in_tile)
    tl.store(LseLog2 + at, lse_log2, mask=in_tile)
    zeros = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    tl.store(dQAccum + b * sab + h * sah + rows[:, None] * sam + cols[None, :], zeros,
             mask=in_tile[:, None] & (cols[None, :] < D))
