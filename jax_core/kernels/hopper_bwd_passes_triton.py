"""The two Triton passes around the Hopper backward (the torch launcher's), one launch each.

Before it, `hopper_backward_operands_kernel`: the Mosaic GPU backward (`flash_bwd_mgpu`) reads, per
query row of its padded length, the LSE in log2 units and delta = rowsum(dO * O), and adds dQ into a
float32 accumulator that starts at zero. After it, `hopper_backward_results_kernel`: dQ leaves that
accumulator in the inputs' dtype, and with `head_splits` > 1 dK and dV are sums of float32 partials.
Made with torch ops these are five to seven small launches before and one to five after: the passes
make them in one launch each, with their host cost once. The JAX launcher computes the same values
with jnp ops that XLA fuses (`flash_bwd_mgpu.backward_operands`, `flash_bwd_mgpu.flash_backward_mgpu`).
Imports only `triton`.
"""

import triton
import triton.language as tl

from .flash_bwd_triton import row_delta

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def hopper_backward_operands_kernel(
    Out, dOut, Lse, Delta, LseLog2, dQAccum,
    sob, soh, som, sod, sdob, sdoh, sdom, sdod, slb, slh, slm, sab, sah, sam,
    Hq, L, ROWS, ACCUM_ROWS,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (cdiv(ROWS, BLOCK_M), B * Hq); rows L..ROWS-1 are the kernels' padding.

    Args:
        Out, dOut: (B, Hq, L, D) forward output and its gradient, element strides so*, sdo*.
        Lse: (B, Hq, L) float32 natural-log LSE (-inf for a row that saw no key), strides sl*.
        Delta, LseLog2: (B * Hq, ROWS) float32 contiguous, written: rowsum(dO * O) and LSE * log2(e),
            with +inf for an LSE of -inf (its probabilities exp2(s - inf) are then 0, not NaN);
            padded rows get delta 0 and LSE +inf, so they add nothing to dK and dV.
        dQAccum: float32, D contiguous, element strides sa* in (B, Hq, row) order, zeroed on its
            ACCUM_ROWS rows (ROWS, or fewer where the kernels read the queries in place past L).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    in_tile = rows < ROWS
    delta = row_delta(Out, dOut, b, h, rows, cols, L, D, sob, soh, som, sod, sdob, sdoh, sdom, sdod)
    lse = tl.load(Lse + b * slb + h * slh + rows * slm, mask=rows < L, other=float("-inf"))
    lse_log2 = tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)
    at = pid_bh.to(tl.int64) * ROWS + rows
    tl.store(Delta + at, delta, mask=in_tile)
    tl.store(LseLog2 + at, lse_log2, mask=in_tile)
    zeros = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    tl.store(dQAccum + b * sab + h * sah + rows[:, None] * sam + cols[None, :], zeros,
             mask=(rows < ACCUM_ROWS)[:, None] & (cols[None, :] < D))


@triton.jit
def hopper_backward_results_kernel(
    dQAccum, dQ, dKParts, dK, dVParts, dV, NQ, NKV, SPLITS, BLOCK: tl.constexpr,
):
    """dQ = dQAccum and dK, dV = the sums of their SPLITS partials, in the output pointers' dtype.

    Grid (cdiv(NQ, BLOCK) + 2 * cdiv(NKV, BLOCK),): the first programs cast dQ, then dK's, then dV's.

    Args:
        dQAccum: float32, NQ elements contiguous; dQ: NQ elements written.
        dKParts, dVParts: float32 (SPLITS, NKV) contiguous; dK, dV: NKV elements written.
    """
    pid = tl.program_id(0).to(tl.int64)
    q_programs = tl.cdiv(NQ, BLOCK)
    kv_programs = tl.cdiv(NKV, BLOCK)
    lanes = tl.arange(0, BLOCK)
    if pid < q_programs:
        at = pid * BLOCK + lanes
        x = tl.load(dQAccum + at, mask=at < NQ)
        tl.store(dQ + at, x.to(dQ.dtype.element_ty), mask=at < NQ)
    else:
        block = pid - q_programs
        if block < kv_programs:
            at = block * BLOCK + lanes
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            part = dKParts + at  # 64-bit pointer steps: SPLITS * NKV may pass 2**31
            for _ in range(SPLITS):
                total += tl.load(part, mask=at < NKV)
                part += NKV
            tl.store(dK + at, total.to(dK.dtype.element_ty), mask=at < NKV)
        else:
            at = (block - kv_programs) * BLOCK + lanes
            total = tl.zeros((BLOCK,), dtype=tl.float32)
            part = dVParts + at
            for _ in range(SPLITS):
                total += tl.load(part, mask=at < NKV)
                part += NKV
            tl.store(dV + at, total.to(dV.dtype.element_ty), mask=at < NKV)
