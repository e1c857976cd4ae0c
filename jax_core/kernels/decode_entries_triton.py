"""Entry kernels of the stream-K decode schedule, launched by both launchers.

Every scalar is a constexpr: jax-triton passes nothing else (its convention: inputs, then outputs,
then constexprs), and the torch launcher launches the same entries so that both give the same bits
(one compilation per call signature either way; ragged lengths are device tensors and change
nothing). The arguments are named as in `decode_stream_triton`'s kernels and planned by
`decode_plan.plan_decode`. `Alibi` (float32 ALiBi slopes) and its batch stride `sab` are read only
with the ALIBI switch; other calls pass a placeholder that is never read (the switch removes the
ALiBi code at compile time). Imports only triton, so the entries run under Triton's interpreter.
"""

import triton
import triton.language as tl

from .decode_stream_triton import decode_stream_kernel, decode_stream_merge_kernel


@triton.jit
def stream_entry(
    Q, K, V, Lengths, Starts, BlockTable, SegCum, Alibi, Out, Lse,
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
    BLOCK_SEG: tl.constexpr, sab: tl.constexpr, ALIBI: tl.constexpr,
):
    decode_stream_kernel(
        Q, K, V, Lengths, Starts, BlockTable, SegCum, Alibi, Out, Lse,
        sqb, sqt, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd, stb, sab,
        sob, sot, soh, sopart, sod, slb, slt, slh, slpart,
        scale, softcap, window_left, window_right, pos_shift, T, G, Hkv, D, Dv, capacity,
        num_segments, num_programs, CAUSAL, HAS_STARTS, PAGED, PAGE_SIZE, SOFTCAP, FAST_TANH,
        ROW_BLOCKS, MIN_SHARE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, BLOCK_SEG, ALIBI,
    )


@triton.jit
def stream_merge_entry(
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
