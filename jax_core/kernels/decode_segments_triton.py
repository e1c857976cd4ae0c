"""The stream-K decode schedule's segment table, written by a Triton kernel both launchers launch.

The stream schedule (`decode_stream_triton`) walks one flattened list of key blocks: segment
s = (b * Hkv + kvh) * ROW_BLOCKS + pid_m reads the key blocks of sequence b that some of its
queries can see (`decode_common_triton.sequence_range`, the rule the attention kernel itself
applies). SegCum (B * SEGMENTS_PER_SEQ + 1,) int32 holds the cumulative counts, with a leading 0:

    n[b] = blocks of sequence b intersecting [seq_lo, seq_hi)  (0 when that range is empty)
    SegCum[b * SEGMENTS_PER_SEQ + i + 1] = sum_{b' < b} n[b'] * SEGMENTS_PER_SEQ + (i + 1) * n[b]

for i < SEGMENTS_PER_SEQ = Hkv * ROW_BLOCKS (every KV head and row block of a sequence reads the
same blocks). The lengths and starts are device tensors, so the table is computed on the device
(no host synchronisation, and a CUDA graph replays it with the lengths of the replay). One program
walks the batch BLOCK_B sequences at a time, carrying the running total.

Every scalar is a constexpr (one compilation per call signature, as the attention kernels'
entries). Imports only triton, so it runs under Triton's interpreter.
"""

import triton
import triton.language as tl

from .decode_common_triton import sequence_range


@triton.jit
def segment_offsets_entry(
    Lengths, Starts, SegCum,
    B: tl.constexpr, T: tl.constexpr, capacity: tl.constexpr, window_left: tl.constexpr,
    window_right: tl.constexpr, pos_shift: tl.constexpr, SEGMENTS_PER_SEQ: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Writes SegCum (module docstring); grid (1,)."""
    tl.store(SegCum, 0)
    carry = tl.full([], 0, tl.int32)  # SegCum at the first segment of this chunk's first sequence
    for c in range(0, B, BLOCK_B):
        offs = c + tl.arange(0, BLOCK_B)
        live = offs < B
        # sequence_range loads without a mask: the padding lanes read the last sequence, then count 0.
        b = tl.minimum(offs, B - 1)
        _, _, seq_lo, seq_hi = sequence_range(Lengths, Starts, b, T, capacity, window_left, window_right,
                                              pos_shift, CAUSAL, HAS_STARTS)
        n = tl.where(live & (seq_hi > seq_lo), (seq_hi + BLOCK_N - 1) // BLOCK_N - seq_lo // BLOCK_N, 0)
        first = carry + (tl.cumsum(n, 0) - n) * SEGMENTS_PER_SEQ
        for i in range(0, SEGMENTS_PER_SEQ):
            tl.store(SegCum + 1 + offs * SEGMENTS_PER_SEQ + i, first + (i + 1) * n, mask=live)
        carry += tl.sum(n, 0) * SEGMENTS_PER_SEQ
