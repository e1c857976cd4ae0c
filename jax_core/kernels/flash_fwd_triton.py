"""Flash-attention forward kernel in Triton (see FLASH_CONTRACT.md, which this file implements).

The kernel imports only `triton` / `triton.language`, so it can be launched by jax-triton on a GPU
and by tests under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors. It uses only APIs
present in both Triton 3.6 and 3.9.

Shape legend:
    B:  batch size.
    Hq: number of query heads; Hk: number of key/value heads (Hq % Hk == 0; query head h reads
        KV head h // (Hq // Hk), i.e. GQA / MQA without repeating K and V).
    L:  query length; S: key/value length.
    D:  query/key head dim; Dv: value head dim (both <= 256, any value; padded to BLOCK_D /
        BLOCK_DV, powers of two, with masks).

Tensors (each passed as a pointer plus 4 element strides):
    Q (B, Hq, L, D), K (B, Hk, S, D), V (B, Hk, S, Dv).
    Bias (B, Hq, L, S) float, optional; broadcast dims have stride 0.
    Mask (B, Hq, L, S) int8 (1 = attend), optional; broadcast dims have stride 0.
    Sinks (Hq,) float32, optional: one extra logit per query head that only joins the denominator.
    Alibi float32 slopes, optional (ALIBI): (Hq,) or (B, Hq) through a batch stride (0 for (Hq,)).
    Out (B, Hq, L, Dv) in Q's dtype; Lse (B, Hq, L) float32 contiguous, natural-log LSE.

Algorithm: one program per (query block of BLOCK_M rows, batch * query head). It streams the key
blocks that the positional rule (causal / sliding window, top-left or bottom-right aligned through
``diag_offset``) can make visible, in three stages: a masked stage at the left edge, an unmasked
stage of key blocks that every row of the query block sees entirely, and a masked stage at the
right edge (the diagonal). Key blocks outside the rule are never loaded. The softmax is online, in
fp32, in the log2 domain (exp2 with log2(e) folded into the scale): running max ``m_i``, running
sum ``l_i``, and an fp32 accumulator. A sink starts the recurrence as ``m_i = sink``,
``l_i = 1``. A row that sees nothing (and has no sink) yields out = 0 and lse = -inf.

Precision: Q·K^T and P·V run in the input dtype with fp32 accumulation; for float32 inputs the dots
use ``input_precision="tf32x3"`` (close to fp32 accuracy on tensor cores; exact under the
interpreter).
"""

import triton
import triton.language as tl

from .flash_common_triton import dropout_keep, load_seed, tanh_f32
from .flash_plan import fwd_block_sizes, head_block, next_power_of_2  # noqa: F401 (re-exported)


@triton.jit
def _fwd_block(
    acc, l_i, m_i, q, qseg, start_n,
    k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr,
    stride_kn, stride_vn, stride_bn, stride_mn,
    offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi, S,
    scale, softcap,
    seed, drop_row0, drop_rows, k_off, S_mem, dropout_p, alibi_pos, slope2,
    MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI: tl.constexpr,
):
    """Accumulates the key block starting at start_n into (acc, l_i, m_i); see `_fwd_stage`."""
    cols = start_n + offs_n
    if MASKED:
        col_valid = cols < S
        kt = tl.load(k_ptrs + start_n * stride_kn, mask=d_mask[:, None] & col_valid[None, :],
                     other=0.0)
        rc_mask = row_valid[:, None] & col_valid[None, :]
    else:
        kt = tl.load(k_ptrs + start_n * stride_kn, mask=d_mask[:, None], other=0.0)
        rc_mask = row_valid[:, None]
    if q.dtype == tl.float32:
        qk = tl.dot(q, kt, input_precision="tf32x3")
    else:
        qk = tl.dot(q, kt)
    # Scores in the log2 domain: s2 = log2(e) * s.
    if SOFTCAP:
        s = softcap * tanh_f32(qk * (scale / softcap), FAST_TANH)
        if HAS_BIAS:
            bias = tl.load(bias_ptrs + cols[None, :] * stride_bn, mask=rc_mask, other=0.0)
            s += bias.to(tl.float32)
        s2 = s * 1.4426950408889634
    elif HAS_BIAS:
        bias = tl.load(bias_ptrs + cols[None, :] * stride_bn, mask=rc_mask, other=0.0)
        s2 = (qk * scale + bias.to(tl.float32)) * 1.4426950408889634
    else:
        s2 = qk * (scale * 1.4426950408889634)
    if ALIBI:  # slope2 = log2(e) * slope; alibi_pos = i + S - L (flash-attn's bottom-right distance)
        s2 -= slope2 * tl.abs(alibi_pos[:, None] - cols[None, :]).to(tl.float32)
    if MASKED:
        visible = (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None])
        if HAS_MASK:
            mvals = tl.load(mask_ptrs + cols[None, :] * stride_mn, mask=rc_mask, other=0)
            visible = visible & (mvals != 0)
        if HAS_SEGMENTS:
            kseg = tl.load(kseg_ptr + cols, mask=col_valid, other=0)
            visible = visible & (qseg[:, None] == kseg[None, :])
        s2 = tl.where(visible, s2, float("-inf"))
    elif HAS_MASK or HAS_SEGMENTS:
        visible = rc_mask
        if HAS_MASK:
            mvals = tl.load(mask_ptrs + cols[None, :] * stride_mn, mask=rc_mask, other=0)
            visible = visible & (mvals != 0)
        if HAS_SEGMENTS:
            kseg = tl.load(kseg_ptr + cols)
            visible = visible & (qseg[:, None] == kseg[None, :])
        s2 = tl.where(visible, s2, float("-inf"))
    # Online softmax; a row whose running max is still -inf uses 0 as its reference so that
    # exp2(-inf - ref) = 0 instead of NaN.
    m_new = tl.maximum(m_i, tl.max(s2, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s2 - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        keep = dropout_keep(seed, drop_row0, drop_rows, k_off + cols, S_mem, dropout_p)
        p = tl.where(keep, p, 0.0)
    if MASKED:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=col_valid[:, None] & dv_mask[None, :],
                    other=0.0)
    else:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=dv_mask[None, :], other=0.0)
    if v.dtype == tl.float32:
        acc = tl.dot(p, v, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _fwd_stage(
    acc, l_i, m_i, q, qseg,
    k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
    stride_kn, stride_vn, stride_bn, stride_mn,
    offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
    start, end, S,
    scale, softcap,
    seed, drop_row0, drop_rows, k_off, S_mem, dropout_p, alibi_pos, slope2,
    MASKED: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    HAS_SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SKIP: tl.constexpr, ALIBI: tl.constexpr,
):
    """Accumulates key blocks [start, end) (start a multiple of BLOCK_N) into (acc, l_i, m_i).

    MASKED: apply the positional rule (row_lo <= j < row_hi, which also implies j < S); otherwise
    every key of every block is known visible and inside [0, S). Bool masks and segment ids are
    applied in both cases. With DROPOUT, l_i sums every probability but only kept ones reach acc.
    BLOCK_SKIP: vis_ptr points at this query block's row of the skip table: n_blocks + 1 prefix counts
    of live key blocks, then the live key blocks in ascending order. Dead blocks (every element
    masked by the bool mask or a -inf bias) are neither loaded nor computed. Skipping them is exact:
    they would add exp(-inf) = 0.
    """
    # Blocks [start, end) (start is a multiple of BLOCK_N), or with BLOCK_SKIP only the live ones:
    # entries [count[start / BLOCK_N], count[cdiv(end, BLOCK_N)]) of this row's ascending list of
    # live blocks. Both are plain loops (the list is read by index), so both pipeline.
    first = start // BLOCK_N
    last = tl.maximum((end + BLOCK_N - 1) // BLOCK_N, first)
    if BLOCK_SKIP:
        first = tl.load(vis_ptr + first)
        last = tl.load(vis_ptr + last)
    for i in range(first, last):
        if BLOCK_SKIP:
            start_n = tl.load(vis_ptr + n_blocks + 1 + i) * BLOCK_N
        else:
            start_n = i * BLOCK_N
        start_n = tl.multiple_of(start_n, BLOCK_N)
        acc, l_i, m_i = _fwd_block(
            acc, l_i, m_i, q, qseg, start_n, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr,
            stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid,
            row_lo, row_hi, S, scale, softcap, seed, drop_row0, drop_rows, k_off, S_mem, dropout_p,
            alibi_pos, slope2, MASKED, HAS_BIAS, HAS_MASK, HAS_SEGMENTS, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N,
            ALIBI)
    return acc, l_i, m_i


@triton.jit
def _fwd_stages(
    acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
    stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
    lo, mid_lo, mid_hi, hi, S, scale, softcap, seed, drop_row0, drop_rows, k_off, S_mem, dropout_p,
    alibi_pos, slope2,
    HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SEG_CHECK: tl.constexpr, DROPOUT: tl.constexpr,
    SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SKIP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """Key blocks [lo, mid_lo) masked | [mid_lo, mid_hi) fully visible | [mid_hi, hi) masked.

    SEG_CHECK compares segment ids element by element in every stage.
    """
    acc, l_i, m_i = _fwd_stage(
        acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
        stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
        lo, tl.minimum(mid_lo, hi), S, scale, softcap, seed, drop_row0, drop_rows, k_off, S_mem, dropout_p,
        alibi_pos, slope2, True, HAS_BIAS, HAS_MASK, SEG_CHECK, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N, BLOCK_SKIP,
        ALIBI)
    acc, l_i, m_i = _fwd_stage(
        acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
        stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
        tl.maximum(mid_lo, lo), tl.minimum(mid_hi, hi), S, scale, softcap, seed, drop_row0, drop_rows, k_off,
        S_mem, dropout_p, alibi_pos, slope2, False, HAS_BIAS, HAS_MASK, SEG_CHECK, DROPOUT, SOFTCAP, FAST_TANH,
        BLOCK_N, BLOCK_SKIP, ALIBI)
    acc, l_i, m_i = _fwd_stage(
        acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
        stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
        tl.maximum(mid_hi, lo), hi, S, scale, softcap, seed, drop_row0, drop_rows, k_off, S_mem, dropout_p,
        alibi_pos, slope2, True, HAS_BIAS, HAS_MASK, SEG_CHECK, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N, BLOCK_SKIP,
        ALIBI)
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, Bias, Mask, Sinks, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, Hk, L, S, D, Dv,
    scale, softcap, window_left, window_right, diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SegQ=None, SegK=None, CuQ=None, CuK=None, Seed=None, dropout_p=0.0,
    HAS_SEGMENTS: tl.constexpr = False, VARLEN: tl.constexpr = False,
    VARLEN_BOTTOM_RIGHT: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    FAST_TANH: tl.constexpr = False,
    Skip=None, stride_tb=0, stride_th=0, stride_tr=0, BLOCK_SKIP: tl.constexpr = False,
    Alibi=None, stride_ab=0, ALIBI: tl.constexpr = False,
):
    """Flash-attention forward; grid (cdiv(L, BLOCK_M), B * Hq). See FLASH_CONTRACT.md.

    With BLOCK_SKIP, Skip is the int32 skip table (B|1, Hq|1, cdiv(L, BLOCK_M), 2 * C + 1) with
    C = cdiv(S, BLOCK_N) (`flash_jax_triton.skip_table`): per query block, C + 1 prefix counts of
    live key blocks, then the live key blocks in ascending order; a block is dead when the bool mask
    or a -inf bias masks all of its tile. Dead tiles are skipped.

    With VARLEN the grid is (cdiv(max_seqlen_q, BLOCK_M), N * Hq) for N packed sequences and the
    memory batch is 1; L and S are then the packed lengths.

    With ALIBI, Alibi holds float32 slopes, element (b, h) at b * stride_ab + h (stride_ab = 0 for
    one slope per head; b is the sequence with VARLEN): -slope * |i + S - L - j| joins every logit,
    with positions and lengths of the sequence.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    kvh = h // (Hq // Hk)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    m0 = pid_m * BLOCK_M

    # Per-sequence view: rows [q_off, q_off + seq_l) of Q, keys [k_off, k_off + seq_s) of K / V.
    seq_l = L
    seq_s = S
    diag = diag_offset
    q_off = 0
    k_off = 0
    row0 = pid_bh.to(tl.int64) * L  # first Lse row of this (batch, head)
    if VARLEN:
        q_off = tl.load(CuQ + b)
        k_off = tl.load(CuK + b)
        seq_l = tl.load(CuQ + b + 1) - q_off
        seq_s = tl.load(CuK + b + 1) - k_off
        if VARLEN_BOTTOM_RIGHT:
            diag = seq_s - seq_l
        else:
            diag = 0
        row0 = h64 * L + q_off
        b64 = b64 * 0
        if m0 >= seq_l:
            return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_valid = offs_m < seq_l
    d_mask = offs_d < D
    dv_mask = offs_dv < Dv

    q_ptrs = (Q + b64 * stride_qb + h64 * stride_qh + (q_off + offs_m)[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    # K is read transposed: a (BLOCK_D, BLOCK_N) tile.
    k_ptrs = (K + b64 * stride_kb + kvh64 * stride_kh + (k_off + offs_n)[None, :] * stride_kn
              + offs_d[:, None] * stride_kd)
    v_ptrs = (V + b64 * stride_vb + kvh64 * stride_vh + (k_off + offs_n)[:, None] * stride_vn
              + offs_dv[None, :] * stride_vd)
    bias_ptrs = Bias + b64 * stride_bb + h64 * stride_bh + offs_m.to(tl.int64)[:, None] * stride_bm
    mask_ptrs = Mask + b64 * stride_mb + h64 * stride_mh + offs_m.to(tl.int64)[:, None] * stride_mm

    # Positional rule: row i sees keys row_lo(i) <= j < row_hi(i); both bounds are
    # non-decreasing in i. Window sizes are clamped to S + L (equivalent to unbounded, since
    # -L <= diag <= S) to keep the int32 arithmetic from overflowing.
    wl = tl.minimum(window_left, seq_s + seq_l)
    wr = tl.minimum(window_right, seq_s + seq_l)
    pos = offs_m + diag
    row_lo = tl.where(window_left >= 0, pos - wl, 0)
    row_hi = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_s
    if CAUSAL:
        row_hi = tl.minimum(row_hi, pos + 1)
    row_hi = tl.where(window_right >= 0, tl.minimum(row_hi, pos + wr + 1), row_hi)

    # Segment ids: SegQ (B, 4, L) holds each query's id, the span [k_lo, k_hi) of keys with that id
    # and whether those keys fill the span. Keys outside the union of the block's spans are skipped;
    # when the block has one id whose keys form a contiguous run, the span acts like a window and
    # no id is compared element by element (SEG_CHECK below).
    qseg = offs_m
    kseg_ptr = SegK
    seg_lo = 0
    seg_hi = seq_s
    simple = True
    if HAS_SEGMENTS:
        segq_b = SegQ + b64 * 4 * L
        qseg = tl.load(segq_b + offs_m, mask=row_valid, other=0)
        seg_lo = tl.min(tl.load(segq_b + L + offs_m, mask=row_valid, other=seq_s), 0)
        seg_hi = tl.max(tl.load(segq_b + 2 * L + offs_m, mask=row_valid, other=0), 0)
        runs = tl.min(tl.load(segq_b + 3 * L + offs_m, mask=row_valid, other=1), 0)
        same = tl.min(tl.where(row_valid, qseg, 2147483647), 0) == tl.max(tl.where(row_valid, qseg, -2147483647), 0)
        simple = same & (runs == 1)
        kseg_ptr = SegK + b64 * 4 * S
        row_lo = tl.maximum(row_lo, seg_lo)
        row_hi = tl.minimum(row_hi, seg_hi)

    # The same bounds for the first and the last valid row of this query block (scalars).
    m_last = tl.minimum(m0 + BLOCK_M, seq_l) - 1
    p_first = m0 + diag
    p_last = m_last + diag
    lo_first = tl.where(window_left >= 0, tl.maximum(p_first - wl, 0), 0)
    lo_last = tl.where(window_left >= 0, tl.maximum(p_last - wl, 0), 0)
    hi_first = seq_s
    hi_last = seq_s
    if CAUSAL:
        hi_first = tl.minimum(hi_first, p_first + 1)
        hi_last = tl.minimum(hi_last, p_last + 1)
    hi_first = tl.where(window_right >= 0, tl.minimum(hi_first, p_first + wr + 1), hi_first)
    hi_last = tl.where(window_right >= 0, tl.minimum(hi_last, p_last + wr + 1), hi_last)
    if HAS_SEGMENTS:
        lo_first = tl.maximum(lo_first, seg_lo)
        lo_last = tl.maximum(lo_last, seg_lo)
        hi_first = tl.minimum(hi_first, seg_hi)
        hi_last = tl.minimum(hi_last, seg_hi)

    # Key blocks: [lo, mid_lo) masked | [mid_lo, mid_hi) fully visible | [mid_hi, hi) masked.
    lo = (lo_first // BLOCK_N) * BLOCK_N
    hi = hi_last
    mid_lo = tl.maximum(((lo_last + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo)
    mid_hi = tl.maximum((tl.maximum(hi_first, 0) // BLOCK_N) * BLOCK_N, mid_lo)

    seed = 0
    if DROPOUT:
        seed = load_seed(Seed)
    vis_ptr = Skip
    n_blocks = (S + BLOCK_N - 1) // BLOCK_N
    if BLOCK_SKIP:
        vis_ptr = Skip + b64 * stride_tb + h64 * stride_th + pid_m * stride_tr

    alibi_pos = offs_m
    slope2 = 0.0
    if ALIBI:
        slope2 = tl.load(Alibi + b.to(tl.int64) * stride_ab + h).to(tl.float32) * 1.4426950408889634
        alibi_pos = offs_m + (seq_s - seq_l)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if HAS_SINKS:
        sink2 = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink2
        l_i = tl.where(m_i == float("-inf"), 0.0, 1.0)
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    if HAS_SEGMENTS:
        if simple:
            acc, l_i, m_i = _fwd_stages(
                acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
                stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
                lo, mid_lo, mid_hi, hi, seq_s, scale, softcap, seed, row0 - q_off, q_off + offs_m, k_off, S,
                dropout_p, alibi_pos, slope2, HAS_BIAS, HAS_MASK, False, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N,
                BLOCK_SKIP, ALIBI)
        else:
            acc, l_i, m_i = _fwd_stages(
                acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
                stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
                lo, mid_lo, mid_hi, hi, seq_s, scale, softcap, seed, row0 - q_off, q_off + offs_m, k_off, S,
                dropout_p, alibi_pos, slope2, HAS_BIAS, HAS_MASK, True, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N,
                BLOCK_SKIP, ALIBI)
    else:
        acc, l_i, m_i = _fwd_stages(
            acc, l_i, m_i, q, qseg, k_ptrs, v_ptrs, bias_ptrs, mask_ptrs, kseg_ptr, vis_ptr, n_blocks,
            stride_kn, stride_vn, stride_bn, stride_mn, offs_n, d_mask, dv_mask, row_valid, row_lo, row_hi,
            lo, mid_lo, mid_hi, hi, seq_s, scale, softcap, seed, row0 - q_off, q_off + offs_m, k_off, S,
            dropout_p, alibi_pos, slope2, HAS_BIAS, HAS_MASK, False, DROPOUT, SOFTCAP, FAST_TANH, BLOCK_N,
            BLOCK_SKIP, ALIBI)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    inv = 1.0 / l_safe
    if DROPOUT:
        inv = inv * (1.0 / (1.0 - dropout_p))
    out = acc * inv[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)

    o_ptrs = (Out + b64 * stride_ob + h64 * stride_oh + (q_off + offs_m)[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_valid[:, None] & dv_mask[None, :])
    tl.store(Lse + row0 + offs_m, lse, mask=row_valid)
