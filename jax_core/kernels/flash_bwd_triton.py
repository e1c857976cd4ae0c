"""Flash attention backward kernels in Triton (see FLASH_CONTRACT.md, the binding contract).

Three kernels, launched in this order by the caller:

1. `flash_bwd_preprocess_kernel`: Delta = rowsum(dOut * Out) in fp32 (the caller may instead
   compute Delta itself, e.g. with an LSE cotangent folded in: Delta - dLse).
2. `flash_bwd_dkdv_kernel`: one program per (key block, batch * KV head) accumulates dK and dV over
   the query heads of its GQA group and the query blocks that can see the key block. No atomics.
3. `flash_bwd_dq_kernel`: one program per (query block, batch * query head) accumulates dQ over the
   key blocks its rows can see and, with WRITE_DS, writes dS (the gradient w.r.t. the logit after
   softcap and bias, i.e. the bias gradient before any reduction over broadcast dims).

Both main kernels recompute P = exp(s - lse) from the forward's lse (natural log, sinks included),
so sinks need no special handling here; a row with lse = -inf (nothing visible, no sink) gets P = 0
and therefore zero gradients, never NaN.

Shape legend:
    B: batch.  Hq / Hk: query / KV heads (Hq % Hk == 0; query head h reads KV head h // (Hq // Hk)).
    L: query length.  S: key length.  D: q/k head dim.  Dv: v head dim.
    Q (B, Hq, L, D), K (B, Hk, S, D), V (B, Hk, S, Dv), Out / dOut (B, Hq, L, Dv),
    Bias / Mask / dS logically (B, Hq, L, S) (stride 0 on broadcast dims; dS is written in full),
    Lse / Delta (B, Hq, L) float32 contiguous: element (b, h, i) at (b * Hq + h) * L + i.
    dQ (B, Hq, L, D), dK (B, Hk, S, D), dV (B, Hk, S, Dv) in their buffers' dtypes.

Scalars (strides, sizes, scale, softcap, window, diag_offset) may be runtime values or constexprs:
the kernels can be launched directly or called from an entry kernel that makes them all constexpr.
Only APIs shared by Triton 3.6 and 3.9 are used.
"""

import triton
import triton.language as tl

from .flash_common_triton import dropout_keep, load_seed, tanh_f32


@triton.jit
def _dot(a, b, acc):
    """acc + a @ b with fp32 accumulation; float32 operands use tf32x3 (near-fp32 accuracy)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _key_range(m0, L, S, window_left, window_right, diag_offset,
               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key range [lo, hi) that query rows [m0, m0 + BLOCK_M) may see under the positional rule.

    Args:
        m0: first query row of the block (scalar tensor).
        L, S, window_left, window_right, diag_offset: as in the contract.

    Returns:
        (lo, hi): lo is a multiple of BLOCK_N in [0, S], hi in [lo, S]; key blocks starting in
        [lo, hi) are the only ones with a possibly visible element.
    """
    m_last = tl.minimum(m0 + BLOCK_M, L) - 1
    lo = m0 * 0
    hi = m0 * 0 + S
    if window_left >= 0:
        lo = tl.maximum(lo, m0 + diag_offset - window_left)
    if CAUSAL:
        hi = tl.minimum(hi, m_last + diag_offset + 1)
    if window_right >= 0:
        hi = tl.minimum(hi, m_last + diag_offset + window_right + 1)
    lo = (tl.minimum(lo, S) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit
def _query_range(n0, L, S, window_left, window_right, diag_offset,
                 CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query range [lo, hi) whose rows may see some key in [n0, n0 + BLOCK_N).

    Args:
        n0: first key of the block (scalar tensor).
        L, S, window_left, window_right, diag_offset: as in the contract.

    Returns:
        (lo, hi): lo is a multiple of BLOCK_M in [0, L], hi in [lo, L].
    """
    n_last = tl.minimum(n0 + BLOCK_N, S) - 1
    lo = n0 * 0
    hi = n0 * 0 + L
    if CAUSAL:  # j <= i + diag  <=>  i >= j - diag
        lo = tl.maximum(lo, n0 - diag_offset)
    if window_right >= 0:  # j <= i + diag + right  <=>  i >= j - diag - right
        lo = tl.maximum(lo, n0 - diag_offset - window_right)
    if window_left >= 0:  # j >= i + diag - left  <=>  i <= j - diag + left
        hi = tl.minimum(hi, n_last - diag_offset + window_left + 1)
    lo = (tl.minimum(lo, L) // BLOCK_M) * BLOCK_M
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit
def _block_grads(q, k, v, do, lse, delta, offs_m, offs_n, Bias_bh, Mask_bh,
                 stride_bm, stride_bn, stride_mm, stride_mn,
                 L, S, scale, softcap, window_left, window_right, diag_offset,
                 qseg, kseg, seed, row0, q_off, k_off, S_mem, dropout_p, slope,
                 CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
                 FAST_TANH: tl.constexpr, ALIBI: tl.constexpr):
    """Recomputed probabilities and logit gradients of one (query block, key block) tile.

    Args:
        q: (BLOCK_M, BLOCK_D) queries (zero-padded). k: (BLOCK_N, BLOCK_D) keys (zero-padded).
        v: (BLOCK_N, BLOCK_DV) values. do: (BLOCK_M, BLOCK_DV) output gradient.
        lse, delta: (BLOCK_M,) float32 per-row log-sum-exp and Delta.
        offs_m: (BLOCK_M,) query rows. offs_n: (BLOCK_N,) keys.
        Bias_bh, Mask_bh: Bias / Mask pointers already offset to this (batch, query head).
        L, S: this sequence's lengths (offs_m / offs_n are positions within it).
        qseg, kseg: (BLOCK_M,) / (BLOCK_N,) segment ids, used iff HAS_SEGMENTS.
        seed, row0, q_off, k_off, S_mem, dropout_p: dropout stream (see `dropout_keep`), used iff
            DROPOUT; q_off / k_off map positions to memory rows / keys.
        slope: this query head's ALiBi slope, used iff ALIBI (-slope * |i + S - L - j| joins the
            logit after softcap and bias, as in the forward).

    Returns:
        (p, ds_post, ds_pre), each (BLOCK_M, BLOCK_N) float32: P (times the kept-and-rescaled
        dropout mask with DROPOUT, i.e. what multiplies V); dS w.r.t. the logit after
        softcap and bias; dS w.r.t. s_raw = scale * q.k (equal to ds_post without SOFTCAP).
        Invisible and out-of-range elements are exactly 0.
    """
    in_bounds = (offs_m[:, None] < L) & (offs_n[None, :] < S)
    s = _dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], dtype=tl.float32)) * scale
    if SOFTCAP:
        t = tanh_f32(s / softcap, FAST_TANH)
        s = softcap * t
    if HAS_BIAS:
        bias = tl.load(Bias_bh + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                       mask=in_bounds, other=0.0)
        s = s + bias.to(tl.float32)
    if ALIBI:
        s = s - slope * tl.abs(offs_m[:, None] + (S - L) - offs_n[None, :]).to(tl.float32)
    vis = in_bounds
    pos = offs_m[:, None] + diag_offset
    if CAUSAL:
        vis = vis & (offs_n[None, :] <= pos)
    if window_left >= 0:
        vis = vis & (offs_n[None, :] >= pos - window_left)
    if window_right >= 0:
        vis = vis & (offs_n[None, :] <= pos + window_right)
    if HAS_MASK:
        keep = tl.load(Mask_bh + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn,
                       mask=in_bounds, other=0)
        vis = vis & (keep != 0)
    if HAS_SEGMENTS:
        vis = vis & (qseg[:, None] == kseg[None, :])
    # lse = -inf only where every logit of the row is -inf or invisible: exp(s - 0) is then 0.
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    p = tl.where(vis, tl.exp(s - lse_safe[:, None]), 0.0)
    dp = _dot(do, tl.trans(v), tl.zeros([do.shape[0], v.shape[0]], dtype=tl.float32))
    if DROPOUT:
        kept = dropout_keep(seed, row0, q_off + offs_m, k_off + offs_n, S_mem, dropout_p)
        rescale = 1.0 / (1.0 - dropout_p)
        dp = tl.where(kept, dp * rescale, 0.0)
    ds_post = p * (dp - delta[:, None])
    ds_pre = ds_post
    if SOFTCAP:
        ds_pre = ds_post * (1.0 - t * t)
    if DROPOUT:
        p = tl.where(kept, p * rescale, 0.0)
    return p, ds_post, ds_pre


@triton.jit
def _dkdv_block(acc_dk, acc_dv, k, v, start_m, offs_n, offs_d, offs_dv, d_ok, dv_ok, kseg,
                Q_bh, dO_bh, Lse, Delta, segq_b, Bias_bh, Mask_bh, row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_bm, stride_bn, stride_mm, stride_mn,
                seq_l, seq_s, q_off, k_off, S, scale, softcap, window_left, window_right, diag,
                seed, dropout_p, slope, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
                FAST_TANH: tl.constexpr, BLOCK_M: tl.constexpr, ALIBI: tl.constexpr):
    """Adds the query block starting at start_m to the (acc_dk, acc_dv) of one key block."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < seq_l
    rows_m = (q_off + offs_m)[:, None]
    q = tl.load(Q_bh + rows_m * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(dO_bh + rows_m * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(Lse + row0 + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + row0 + offs_m, mask=m_ok, other=0.0)
    qseg = offs_m
    if HAS_SEGMENTS:
        qseg = tl.load(segq_b + offs_m, mask=m_ok, other=0)
    p, ds_post, ds_pre = _block_grads(
        q, k, v, do, lse, delta, offs_m, offs_n, Bias_bh, Mask_bh,
        stride_bm, stride_bn, stride_mm, stride_mn,
        seq_l, seq_s, scale, softcap, window_left, window_right, diag,
        qseg, kseg, seed, row0 - q_off, q_off, k_off, S, dropout_p, slope,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, HAS_SEGMENTS, DROPOUT, FAST_TANH, ALIBI)
    acc_dv = _dot(tl.trans(p.to(do.dtype)), do, acc_dv)
    acc_dk = _dot(tl.trans(ds_pre.to(q.dtype)), q, acc_dk)
    return acc_dk, acc_dv


@triton.jit
def _dq_block(acc_dq, q, do, lse, delta, start_n, offs_m, offs_d, offs_dv, m_ok, d_ok, dv_ok, qseg,
              K_bh, V_bh, dS_bh, segk_b, Bias_bh, Mask_bh, row0,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
              stride_dsm, stride_dsn,
              seq_l, seq_s, q_off, k_off, S, scale, softcap, window_left, window_right, diag,
              seed, dropout_p, slope, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
              SOFTCAP: tl.constexpr, HAS_SEGMENTS: tl.constexpr, DROPOUT: tl.constexpr,
              FAST_TANH: tl.constexpr, WRITE_DS: tl.constexpr, BLOCK_N: tl.constexpr, ALIBI: tl.constexpr):
    """Adds the key block starting at start_n to acc_dq of one query block; writes its dS tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_s
    rows_n = (k_off + offs_n)[:, None]
    k = tl.load(K_bh + rows_n * stride_kn + offs_d[None, :] * stride_kd,
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V_bh + rows_n * stride_vn + offs_dv[None, :] * stride_vd,
                mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    kseg = offs_n
    if HAS_SEGMENTS:
        kseg = tl.load(segk_b + offs_n, mask=n_ok, other=0)
    p, ds_post, ds_pre = _block_grads(
        q, k, v, do, lse, delta, offs_m, offs_n, Bias_bh, Mask_bh,
        stride_bm, stride_bn, stride_mm, stride_mn,
        seq_l, seq_s, scale, softcap, window_left, window_right, diag,
        qseg, kseg, seed, row0 - q_off, q_off, k_off, S, dropout_p, slope,
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, HAS_SEGMENTS, DROPOUT, FAST_TANH, ALIBI)
    acc_dq = _dot(ds_pre.to(k.dtype), k, acc_dq)
    if WRITE_DS:
        tl.store(dS_bh + offs_m[:, None] * stride_dsm + offs_n[None, :] * stride_dsn, ds_post,
                 mask=m_ok[:, None] & n_ok[None, :])
    return acc_dq


@triton.jit
def flash_bwd_preprocess_kernel(
    Out, dOut, Delta,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    Hq, L, Dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """Delta = rowsum(dOut * Out) in fp32. Grid (cdiv(L, BLOCK_M), B * Hq).

    Args:
        Out: (B, Hq, L, Dv) forward output. dOut: (B, Hq, L, Dv) its gradient.
        Delta: (B, Hq, L) float32 contiguous, written.
        stride_*: element strides of Out and dOut in (B, H, L, Dv) order.
        Hq, L, Dv: sizes. BLOCK_M: rows per program. BLOCK_DV: next_power_of_2(Dv).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    delta = row_delta(Out, dOut, (pid_bh // Hq).to(tl.int64), (pid_bh % Hq).to(tl.int64), offs_m,
                      tl.arange(0, BLOCK_DV), L, Dv, stride_ob, stride_oh, stride_om, stride_od,
                      stride_dob, stride_doh, stride_dom, stride_dod)
    tl.store(Delta + pid_bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def row_delta(Out, dOut, b, h, offs_m, offs_d, L, Dv, sob, soh, som, sod, sdob, sdoh, sdom, sdod):
    """rowsum(dOut * Out) in fp32 for rows `offs_m` of (batch b, head h), 0 on rows L and after; strides
    in (B, H, L, Dv) order; `offs_d` covers Dv."""
    ok = (offs_m[:, None] < L) & (offs_d[None, :] < Dv)
    o = tl.load(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :] * sod, mask=ok, other=0.0)
    do = tl.load(dOut + b * sdob + h * sdoh + offs_m[:, None] * sdom + offs_d[None, :] * sdod, mask=ok, other=0.0)
    return tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dK, dV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Hq, Hk, L, S, D, Dv,
    scale, softcap, window_left, window_right, diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SegQ=None, SegK=None, CuQ=None, CuK=None, Seed=None, dropout_p=0.0,
    HAS_SEGMENTS: tl.constexpr = False, VARLEN: tl.constexpr = False,
    VARLEN_BOTTOM_RIGHT: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    FAST_TANH: tl.constexpr = False,
    Skip=None, stride_tb=0, stride_th=0, stride_tr=0, BLOCK_SKIP: tl.constexpr = False,
    Alibi=None, stride_ab=0, ALIBI: tl.constexpr = False,
):
    """dK and dV of one key block of one (batch, KV head). Grid (cdiv(S, BLOCK_N), B * Hk).

    Loops over the Hq // Hk query heads of the group and over the query blocks that the positional
    rule (causal / window with diag_offset) lets see this key block; accumulates in fp32:
    dV = sum P^T dOut, dK = scale * sum dS_pre^T Q. Every element of the block is written (zeros
    where no query sees a key).

    Args:
        Q: (B, Hq, L, D). K: (B, Hk, S, D). V: (B, Hk, S, Dv).
        Bias: float (B, Hq, L, S) logical, read iff HAS_BIAS. Mask: int8 (B, Hq, L, S) logical,
            1 = attend, read iff HAS_MASK. Unused pointers may be any valid tensor.
        dOut: (B, Hq, L, Dv). Lse, Delta: (B, Hq, L) float32 contiguous.
        dK: (B, Hk, S, D), dV: (B, Hk, S, Dv), written in their dtypes.
        stride_*: element strides (B, H, T, D-or-S order) of Q, K, V, Bias, Mask, dOut, dK, dV.
        Hq, Hk, L, S, D, Dv: sizes. scale: logit scale. softcap: cap (used iff SOFTCAP).
        window_left, window_right: window sides, -1 = unbounded. diag_offset: 0 (top-left) or
            S - L (bottom-right).
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP: feature switches.
        SegQ, SegK: int32 (B, 4, L) / (B, 4, S) segment tables, read iff HAS_SEGMENTS: row 0 the
            ids, rows 1-2 for each query (key) the span [lo, hi) of keys (queries) with its id, row 3
            whether those fill the span.
        CuQ, CuK: int32 (N + 1,) cumulative sequence lengths, read iff VARLEN (packed sequences,
            memory batch 1, grid over N sequences; VARLEN_BOTTOM_RIGHT aligns each one's diagonal
            bottom-right, else top-left; diag_offset is then ignored).
        Seed: two int32 words of the dropout seed, read iff DROPOUT; dropout_p: drop probability.
        FAST_TANH: hardware tanh for the soft cap (NVIDIA only).
        Skip, stride_t*: int32 skip table (B|1, Hq|1, cdiv(S, BLOCK_N), 2 * cdiv(L, BLOCK_M) + 1),
            read iff BLOCK_SKIP: per key block, prefix counts of the query blocks that see some
            element of it through the bool mask / -inf bias, then those query blocks in
            ascending order (`flash_jax_triton.skip_table`); the others are skipped.
        Alibi, stride_ab: float32 ALiBi slopes, read iff ALIBI: element (b, h) at b * stride_ab + h
            (stride_ab = 0 for one slope per head; b is the sequence with VARLEN). The slopes get
            no gradient.
        BLOCK_M, BLOCK_N: tile sizes. BLOCK_D, BLOCK_DV: next_power_of_2(D), next_power_of_2(Dv).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hk).to(tl.int64)
    hk = pid_bh % Hk
    group = Hq // Hk
    n0 = pid_n * BLOCK_N

    seq_l = L
    seq_s = S
    diag = diag_offset
    q_off = 0
    k_off = 0
    if VARLEN:
        q_off = tl.load(CuQ + b)
        k_off = tl.load(CuK + b)
        seq_l = tl.load(CuQ + b + 1) - q_off
        seq_s = tl.load(CuK + b + 1) - k_off
        if VARLEN_BOTTOM_RIGHT:
            diag = seq_s - seq_l
        else:
            diag = 0
        if n0 >= seq_s:
            return

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < seq_s
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    hk64 = hk.to(tl.int64)
    b_mem = b
    if VARLEN:
        b_mem = b * 0
    rows_n = (k_off + offs_n)[:, None]

    k = tl.load(K + b_mem * stride_kb + hk64 * stride_kh + rows_n * stride_kn
                + offs_d[None, :] * stride_kd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + b_mem * stride_vb + hk64 * stride_vh + rows_n * stride_vn
                + offs_dv[None, :] * stride_vd, mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
    acc_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    acc_dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    lo, hi = _query_range(n0, seq_l, seq_s, window_left, window_right, diag, CAUSAL, BLOCK_M, BLOCK_N)
    kseg = offs_n
    segq_b = SegQ
    if HAS_SEGMENTS:
        segk_b = SegK + b * 4 * S
        kseg = tl.load(segk_b + offs_n, mask=n_ok, other=0)
        span_lo = tl.min(tl.load(segk_b + S + offs_n, mask=n_ok, other=seq_l), 0)
        span_hi = tl.max(tl.load(segk_b + 2 * S + offs_n, mask=n_ok, other=0), 0)
        lo = tl.maximum(lo, (span_lo // BLOCK_M) * BLOCK_M)
        hi = tl.maximum(tl.minimum(hi, span_hi), lo)
        segq_b = SegQ + b * 4 * L
    seed = 0
    if DROPOUT:
        seed = load_seed(Seed)

    n_q = (L + BLOCK_M - 1) // BLOCK_M  # query blocks of the skip table's rows
    for g in range(0, group):
        h = (hk * group + g).to(tl.int64)
        Q_bh = Q + b_mem * stride_qb + h * stride_qh
        dO_bh = dOut + b_mem * stride_dob + h * stride_doh
        Bias_bh = Bias + b * stride_bb + h * stride_bh
        Mask_bh = Mask + b * stride_mb + h * stride_mh
        row0 = (b * Hq + h) * L
        if VARLEN:
            row0 = h * L + q_off
        slope = 0.0
        if ALIBI:
            slope = tl.load(Alibi + b * stride_ab + h).to(tl.float32)
        # Query blocks [lo, hi), or with BLOCK_SKIP only the live ones: this key block's row of the
        # skip table holds n_q + 1 prefix counts, then the live query blocks in ascending order.
        row = Skip
        first = lo // BLOCK_M
        last = tl.maximum((hi + BLOCK_M - 1) // BLOCK_M, first)
        if BLOCK_SKIP:
            row = Skip + b * stride_tb + h * stride_th + pid_n * stride_tr
            first = tl.load(row + first)
            last = tl.load(row + last)
        for i in range(first, last):
            if BLOCK_SKIP:
                start_m = tl.load(row + n_q + 1 + i) * BLOCK_M
            else:
                start_m = i * BLOCK_M
            acc_dk, acc_dv = _dkdv_block(
                acc_dk, acc_dv, k, v, start_m, offs_n, offs_d, offs_dv, d_ok, dv_ok, kseg,
                Q_bh, dO_bh, Lse, Delta, segq_b, Bias_bh, Mask_bh, row0,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_bm, stride_bn, stride_mm, stride_mn,
                seq_l, seq_s, q_off, k_off, S, scale, softcap, window_left, window_right, diag,
                seed, dropout_p, slope, CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, HAS_SEGMENTS, DROPOUT,
                FAST_TANH, BLOCK_M, ALIBI)

    acc_dk = acc_dk * scale
    tl.store(dK + b_mem * stride_dkb + hk64 * stride_dkh + rows_n * stride_dkn
             + offs_d[None, :] * stride_dkd, acc_dk.to(dK.dtype.element_ty),
             mask=n_ok[:, None] & d_ok[None, :])
    tl.store(dV + b_mem * stride_dvb + hk64 * stride_dvh + rows_n * stride_dvn
             + offs_dv[None, :] * stride_dvd, acc_dv.to(dV.dtype.element_ty),
             mask=n_ok[:, None] & dv_ok[None, :])


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, Bias, Mask, dOut, Lse, Delta, dQ, dS,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dsb, stride_dsh, stride_dsm, stride_dsn,
    Hq, Hk, L, S, D, Dv,
    scale, softcap, window_left, window_right, diag_offset,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, SOFTCAP: tl.constexpr,
    WRITE_DS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    SegQ=None, SegK=None, CuQ=None, CuK=None, Seed=None, dropout_p=0.0,
    HAS_SEGMENTS: tl.constexpr = False, VARLEN: tl.constexpr = False,
    VARLEN_BOTTOM_RIGHT: tl.constexpr = False, DROPOUT: tl.constexpr = False,
    FAST_TANH: tl.constexpr = False,
    Skip=None, stride_tb=0, stride_th=0, stride_tr=0, BLOCK_SKIP: tl.constexpr = False,
    Alibi=None, stride_ab=0, ALIBI: tl.constexpr = False,
):
    """dQ (and optionally dS) of one query block of one (batch, query head).

    Grid (cdiv(L, BLOCK_M), B * Hq). Loops over the key blocks the block's rows may see;
    dQ = scale * sum dS_pre K, accumulated in fp32. With WRITE_DS, writes every element of the
    block's dS rows (zeros for skipped and invisible keys): dS = P * (dP - Delta), the gradient
    w.r.t. the logit after softcap and bias.

    Args:
        Q: (B, Hq, L, D). K: (B, Hk, S, D). V: (B, Hk, S, Dv).
        Bias: float (B, Hq, L, S) logical, read iff HAS_BIAS. Mask: int8 (B, Hq, L, S) logical,
            1 = attend, read iff HAS_MASK. Unused pointers may be any valid tensor.
        dOut: (B, Hq, L, Dv). Lse, Delta: (B, Hq, L) float32 contiguous.
        dQ: (B, Hq, L, D), written in its dtype. dS: float32 (B, Hq, L, S), written iff WRITE_DS
            (else any valid tensor, never touched).
        stride_*: element strides of Q, K, V, Bias, Mask, dOut, dQ, dS.
        Hq, Hk, L, S, D, Dv: sizes. scale: logit scale. softcap: cap (used iff SOFTCAP).
        window_left, window_right: window sides, -1 = unbounded. diag_offset: 0 (top-left) or
            S - L (bottom-right).
        CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, WRITE_DS: feature switches.
        SegQ, SegK: int32 (B, 4, L) / (B, 4, S) segment tables, read iff HAS_SEGMENTS: row 0 the
            ids, rows 1-2 for each query (key) the span [lo, hi) of keys (queries) with its id, row 3
            whether those fill the span.
        CuQ, CuK: int32 (N + 1,) cumulative sequence lengths, read iff VARLEN (packed sequences,
            memory batch 1, grid over N sequences; VARLEN_BOTTOM_RIGHT aligns each one's diagonal
            bottom-right, else top-left; diag_offset is then ignored).
        Seed: two int32 words of the dropout seed, read iff DROPOUT; dropout_p: drop probability.
        FAST_TANH: hardware tanh for the soft cap (NVIDIA only).
        Skip, stride_t*: int32 skip table (B|1, Hq|1, cdiv(L, BLOCK_M), 2 * cdiv(S, BLOCK_N) + 1),
            read iff BLOCK_SKIP: per query block, prefix counts of the key blocks with some
            element visible through the bool mask / -inf bias, then those key blocks in
            ascending order (`flash_jax_triton.skip_table`); the others are skipped.
        Alibi, stride_ab: float32 ALiBi slopes, read iff ALIBI: element (b, h) at b * stride_ab + h
            (stride_ab = 0 for one slope per head; b is the sequence with VARLEN). The slopes get
            no gradient.
        BLOCK_M, BLOCK_N: tile sizes. BLOCK_D, BLOCK_DV: next_power_of_2(D), next_power_of_2(Dv).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h_i = pid_bh % Hq
    h = h_i.to(tl.int64)
    hk = (h_i // (Hq // Hk)).to(tl.int64)
    m0 = pid_m * BLOCK_M

    seq_l = L
    seq_s = S
    diag = diag_offset
    q_off = 0
    k_off = 0
    row0 = (b * Hq + h) * L
    b_mem = b
    if VARLEN:
        q_off = tl.load(CuQ + b)
        k_off = tl.load(CuK + b)
        seq_l = tl.load(CuQ + b + 1) - q_off
        seq_s = tl.load(CuK + b + 1) - k_off
        if VARLEN_BOTTOM_RIGHT:
            diag = seq_s - seq_l
        else:
            diag = 0
        row0 = h * L + q_off
        b_mem = b * 0
        if m0 >= seq_l:
            return

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < seq_l
    d_ok = offs_d < D
    dv_ok = offs_dv < Dv
    rows_m = (q_off + offs_m)[:, None]

    q = tl.load(Q + b_mem * stride_qb + h * stride_qh + rows_m * stride_qm
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(dOut + b_mem * stride_dob + h * stride_doh + rows_m * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
    lse = tl.load(Lse + row0 + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(Delta + row0 + offs_m, mask=m_ok, other=0.0)
    K_bh = K + b_mem * stride_kb + hk * stride_kh
    V_bh = V + b_mem * stride_vb + hk * stride_vh
    Bias_bh = Bias + b * stride_bb + h * stride_bh
    Mask_bh = Mask + b * stride_mb + h * stride_mh
    dS_bh = dS + b * stride_dsb + h * stride_dsh
    acc_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo, hi = _key_range(m0, seq_l, seq_s, window_left, window_right, diag, CAUSAL, BLOCK_M, BLOCK_N)
    qseg = offs_m
    segk_b = SegK
    if HAS_SEGMENTS:
        segq_b = SegQ + b * 4 * L
        qseg = tl.load(segq_b + offs_m, mask=m_ok, other=0)
        span_lo = tl.min(tl.load(segq_b + L + offs_m, mask=m_ok, other=seq_s), 0)
        span_hi = tl.max(tl.load(segq_b + 2 * L + offs_m, mask=m_ok, other=0), 0)
        lo = tl.maximum(lo, (span_lo // BLOCK_N) * BLOCK_N)
        hi = tl.maximum(tl.minimum(hi, span_hi), lo)
        segk_b = SegK + b * 4 * S
    seed = 0
    if DROPOUT:
        seed = load_seed(Seed)
    slope = 0.0
    if ALIBI:
        slope = tl.load(Alibi + b * stride_ab + h).to(tl.float32)

    # Key blocks [lo, hi), or with BLOCK_SKIP only the live ones (see the dK/dV kernel).
    row = Skip
    n_k = (S + BLOCK_N - 1) // BLOCK_N
    lo_blk = lo // BLOCK_N
    hi_blk = tl.maximum((hi + BLOCK_N - 1) // BLOCK_N, lo_blk)
    first = lo_blk
    last = hi_blk
    if BLOCK_SKIP:
        row = Skip + b * stride_tb + h * stride_th + pid_m * stride_tr
        first = tl.load(row + lo_blk)
        last = tl.load(row + hi_blk)
    for i in range(first, last):
        if BLOCK_SKIP:
            start_n = tl.load(row + n_k + 1 + i) * BLOCK_N
        else:
            start_n = i * BLOCK_N
        acc_dq = _dq_block(
            acc_dq, q, do, lse, delta, start_n, offs_m, offs_d, offs_dv, m_ok, d_ok, dv_ok, qseg,
            K_bh, V_bh, dS_bh, segk_b, Bias_bh, Mask_bh, row0,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, stride_mm, stride_mn,
            stride_dsm, stride_dsn, seq_l, seq_s, q_off, k_off, S, scale, softcap,
            window_left, window_right, diag, seed, dropout_p, slope,
            CAUSAL, HAS_BIAS, HAS_MASK, SOFTCAP, HAS_SEGMENTS, DROPOUT, FAST_TANH, WRITE_DS, BLOCK_N, ALIBI)
    if BLOCK_SKIP and WRITE_DS:  # dead tiles of [lo, hi) get zero dS
        for kb in range(lo_blk, hi_blk):
            if tl.load(row + kb + 1) == tl.load(row + kb):
                offs_n = kb * BLOCK_N + tl.arange(0, BLOCK_N)
                tl.store(dS_bh + offs_m[:, None] * stride_dsm + offs_n[None, :] * stride_dsn,
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                         mask=m_ok[:, None] & (offs_n[None, :] < S))

    if WRITE_DS:
        # Key blocks skipped by the loop bounds still get their (zero) gradient written.
        zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start_n in range(0, lo, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            tl.store(dS_bh + offs_m[:, None] * stride_dsm + offs_n[None, :] * stride_dsn, zeros,
                     mask=m_ok[:, None] & (offs_n[None, :] < S))
        done = lo + ((hi - lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
        for start_n in range(done, S, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            tl.store(dS_bh + offs_m[:, None] * stride_dsm + offs_n[None, :] * stride_dsn, zeros,
                     mask=m_ok[:, None] & (offs_n[None, :] < S))

    acc_dq = acc_dq * scale
    tl.store(dQ + b_mem * stride_dqb + h * stride_dqh + rows_m * stride_dqm
             + offs_d[None, :] * stride_dqd, acc_dq.to(dQ.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
