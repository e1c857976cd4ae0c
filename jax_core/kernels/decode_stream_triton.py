"""Stream-K decode kernels in Triton: every program gets an equal slice of all the key blocks of
the batch, whatever the sequences' lengths.

A grid with a fixed number of programs per (sequence, KV head) (split-K flash-decoding) ends a
ragged batch with a last wave of programs that does not cover every multiprocessor. Here a fixed
number of programs P (a few per multiprocessor) walk one flattened list of key blocks:

    segments s = (b * Hkv + kvh) * ROW_BLOCKS + pid_m, in order; SegCum (num_segments + 1,) int32
    holds the cumulative count of the key blocks each segment must read (its visible range).

    blocks:   |--- seg 0 ---|- seg 1 -||------- seg 3 -------|-- seg 4 --|
    programs: |  p0   |  p1   |  p2   |  p3   |  p4   |  p5   |  p6   |
              each program: W = max(ceil(total / P), MIN_SHARE) consecutive blocks

A program attends its query rows to the blocks of each segment its slice touches and writes one
fp32 partial (output normalised by its own denominator, and its LSE) per segment, into slot
p - SegCum[s] // W of that segment; `decode_stream_merge_kernel` combines a segment's slots
(their number follows from SegCum and W) by log-sum-exp weights, adding the sink. A segment that
sees nothing has no slot: out = 0, lse = -inf (or the sink).

Shape legend, tensors and visibility rules as in `decode_common_triton`. Imports only triton, so
it runs under Triton's interpreter.
"""

import triton
import triton.language as tl

from .decode_common_triton import alibi_rows, attend_blocks, query_rows, sequence_range, store_rows


@triton.jit
def stream_share(SegCum, num_segments, num_programs, MIN_SHARE: tl.constexpr):
    """(total key blocks, blocks per program W)."""
    total = tl.load(SegCum + num_segments)
    return total, tl.maximum((total + num_programs - 1) // num_programs, MIN_SHARE)


@triton.jit
def decode_stream_kernel(
    Q, K, V, Lengths, Starts, BlockTable, SegCum, Alibi, Out, Lse,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_tb, stride_ab,
    stride_ob, stride_ot, stride_oh, stride_opart, stride_od,
    stride_lb, stride_lt, stride_lh, stride_lpart,
    scale, softcap, window_left, window_right, pos_shift,
    T, G, Hkv, D, Dv, capacity, num_segments, num_programs,
    CAUSAL: tl.constexpr, HAS_STARTS: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, ROW_BLOCKS: tl.constexpr, MIN_SHARE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SEG: tl.constexpr, ALIBI: tl.constexpr,
):
    """Program p's slice [p * W, (p + 1) * W) of the batch's key blocks (module docstring).

    Out/Lse: fp32 partials (B, T, Hq, MAX_PARTS, Dv) and (B, T, Hq, MAX_PARTS); only the slots
    the merge reads are written.
    """
    p = tl.program_id(0)
    total, share = stream_share(SegCum, num_segments, num_programs, MIN_SHARE)
    lo = p * share
    hi = tl.minimum(lo + share, total)
    # The segment holding block `lo`: how many segments end at or before it.
    seg = lo * 0
    for c in range(0, num_segments, BLOCK_SEG):
        offs = c + tl.arange(0, BLOCK_SEG)
        ends = tl.load(SegCum + 1 + offs, mask=offs < num_segments, other=2147483647)
        seg += tl.sum((ends <= lo).to(tl.int32), 0)
    pos = lo
    while pos < hi:
        seg_start = tl.load(SegCum + seg)
        stop = tl.minimum(hi, tl.load(SegCum + seg + 1))
        if stop > pos:
            pid_m = seg % ROW_BLOCKS
            b = (seg // ROW_BLOCKS) // Hkv
            kvh = (seg // ROW_BLOCKS) % Hkv
            b64 = b.to(tl.int64)
            length, start, seq_lo, seq_hi = sequence_range(
                Lengths, Starts, b, T, capacity, window_left, window_right, pos_shift, CAUSAL, HAS_STARTS)
            q, t, head, row_valid, row_lo, row_hi = query_rows(
                Q + b64 * stride_qb, kvh, pid_m, length, start, stride_qt, stride_qh, stride_qd,
                window_left, window_right, pos_shift, capacity, T, G, D, CAUSAL, BLOCK_M, BLOCK_D)
            slope2, alibi_pos = alibi_rows(Alibi, b64, head, t, length, row_valid, stride_ab, T, BLOCK_M, ALIBI)
            blk0 = seq_lo // BLOCK_N - seg_start
            acc, m_i, l_i = attend_blocks(
                q, tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32)
                + float("-inf"), tl.zeros([BLOCK_M], dtype=tl.float32), blk0 + pos, blk0 + stop, seq_lo, seq_hi,
                row_valid, row_lo, row_hi,
                K + kvh.to(tl.int64) * stride_kh, V + kvh.to(tl.int64) * stride_vh, BlockTable + b64 * stride_tb,
                b64, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, scale, softcap, D, Dv,
                slope2, alibi_pos, PAGED, PAGE_SIZE, SOFTCAP, FAST_TANH, BLOCK_N, BLOCK_D, BLOCK_DV, ALIBI)
            part = (p - seg_start // share).to(tl.int64)
            rows = b64 * stride_ob + t * stride_ot + head * stride_oh + part * stride_opart
            store_rows(acc, m_i, l_i, Out + rows[:, None], Lse + b64 * stride_lb + t * stride_lt
                       + head * stride_lh + part * stride_lpart, row_valid, stride_od, Dv, BLOCK_DV)
        pos = tl.maximum(pos, stop)
        seg += 1


@triton.jit
def decode_stream_merge_kernel(
    OutPart, LsePart, SegCum, Sinks, Out, Lse,
    stride_pb, stride_pt, stride_ph, stride_ppart, stride_pd,
    stride_qb, stride_qt, stride_qh, stride_qpart,
    stride_ob, stride_ot, stride_oh, stride_od,
    stride_lb, stride_lt, stride_lh,
    T, G, Hq, Dv, num_segments, num_programs,
    HAS_SINKS: tl.constexpr, MIN_SHARE: tl.constexpr, ROW_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_PARTS: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Combines the partial results of one (b, t, head) row; grid (B * T * Hq,).

    The row's segment is (b * Hkv + head // G) * ROW_BLOCKS + row // BLOCK_M with row =
    (head % G) * T + t; its slots are 0 .. n-1, n = the programs its blocks span. Writes Out
    (B, T, Hq, Dv) in its dtype and Lse (B, T, Hq) float32:
    out = sum_i exp(lse_i - lse) * out_i with lse = log(sum_i exp(lse_i) [+ exp(sink)]).
    """
    pid = tl.program_id(0)
    b = (pid // (T * Hq)).to(tl.int64)
    t = (pid // Hq) % T
    h = pid % Hq
    row = (h % G) * T + t
    seg = ((pid // (T * Hq)) * (Hq // G) + h // G) * ROW_BLOCKS + row // BLOCK_M
    _, share = stream_share(SegCum, num_segments, num_programs, MIN_SHARE)
    seg_start = tl.load(SegCum + seg)
    seg_end = tl.load(SegCum + seg + 1)
    n = tl.where(seg_end > seg_start, (seg_end - 1) // share - seg_start // share + 1, 0)

    offs_p = tl.arange(0, BLOCK_PARTS)
    offs_dv = tl.arange(0, BLOCK_DV)
    m = tl.full([], float("-inf"), tl.float32)
    if HAS_SINKS:
        m = tl.load(Sinks + h).to(tl.float32)
    denom = tl.where(m == float("-inf"), 0.0, 1.0)  # the sink's own weight, exp(sink - m)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    lse_row = LsePart + b * stride_qb + t * stride_qt + h * stride_qh
    out_row = OutPart + b * stride_pb + t * stride_pt + h * stride_ph
    for c in range(0, n, BLOCK_PARTS):
        parts = c + offs_p
        live = parts < n
        lse_p = tl.load(lse_row + parts * stride_qpart, mask=live, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse_p, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        w = tl.exp(lse_p - m_ref)
        vals = tl.load(out_row + parts[:, None] * stride_ppart + offs_dv[None, :] * stride_pd,
                       mask=live[:, None] & (offs_dv[None, :] < Dv), other=0.0)
        acc = acc * alpha + tl.sum(vals * w[:, None], 0)
        denom = denom * alpha + tl.sum(w, 0)
        m = m_new
    empty = denom == 0.0
    d_safe = tl.where(empty, 1.0, denom)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    tl.store(Out + b * stride_ob + t * stride_ot + h * stride_oh + offs_dv * stride_od,
             (acc / d_safe).to(Out.dtype.element_ty), mask=offs_dv < Dv)
    tl.store(Lse + b * stride_lb + t * stride_lt + h * stride_lh, tl.where(empty, float("-inf"), m_ref + tl.log(d_safe)))
