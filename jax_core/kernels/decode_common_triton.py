"""Building blocks of the decode (flash-decoding) kernels in Triton: a few queries per sequence
against a KV cache. The kernels themselves, and how key blocks are shared among programs, are in
`decode_stream_triton`.

The kernels import only `triton` / `triton.language` (and the soft-cap tanh of
`flash_common_triton`, which does the same), so jax-triton can launch them on a GPU and tests can
run them under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.

Shape legend:
    B: batch (sequences)   T: queries per sequence (1, or a few for speculative decoding)
    Hq: query heads   Hkv: key/value heads (G = Hq // Hkv query heads share one KV head)
    S: cache capacity in positions (contiguous: S_max; paged: max_pages * PAGE_SIZE)
    D: query/key head dim   Dv: value head dim (both <= 256; padded to BLOCK_D / BLOCK_DV)

Tensors (each a pointer plus element strides, so any layout works):
    Q (B, T, Hq, D).
    K, V: contiguous caches, element (b, j, h, d) at b * stride_kb + j * stride_ks + h * stride_kh
        + d * stride_kd (both (B, S, Hkv, D) and (B, Hkv, S, D) layouts); or pages (PAGED), element
        (page, slot, h, d) at page * stride_kb + slot * stride_ks + ..., position j of sequence b
        living in page BlockTable[b, j // PAGE_SIZE], slot j % PAGE_SIZE.
    Lengths (B,) int32: valid positions end (exclusive). Starts (B,) int32: first valid position.
    BlockTable (B, max_pages) int32 (PAGED only). Sinks (Hq,) float32 sink logits (HAS_SINKS).
    Alibi float32 ALiBi slopes (ALIBI only): element (b, h) at b * stride_ab + h, stride_ab = 0 for
        one slope per head (Hq,), Hq for (B, Hq).

Visibility of position j to query t of sequence b (pos = length - T + t + pos_shift is the query's
position; pos_shift = 0 puts the T queries at the end of the sequence):
    start <= j < length, and  j <= pos (CAUSAL),  j >= pos - window_left (if >= 0),
    j <= pos + window_right (if >= 0).
Only the positions that some query of the sequence can see are loaded: the rest of the cache is
never read. A query that sees nothing yields out = 0, lse = -inf (or the sink when HAS_SINKS).

ALiBi (ALIBI): the logit of query t and position j gets -slope * |length - T + t - j| after scale
and soft cap, as in the flash kernels. The distance is measured from the query's bottom-right
position, without pos_shift: flash-attn's ALiBi is aligned bottom-right whatever the causal
alignment, and pos_shift only moves the causal / window rule (top-left alignment through
`attention()`).

A program takes the G * T query rows of one KV head (rows r = g * T + t, query head kvh * G + g)
in BLOCK_M tiles (`query_rows`), so every K/V tile is loaded once for the whole group (GQA without
repeating K/V), and attends them to a range of key blocks (`attend_blocks`).
"""

import triton
import triton.language as tl

from .flash_common_triton import tanh_f32

# log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 are written out in the kernels:
# Triton kernels cannot read non-constexpr globals.


@triton.jit
def sequence_range(Lengths, Starts, b, T, capacity, window_left, window_right, pos_shift,
                   CAUSAL: tl.constexpr, HAS_STARTS: tl.constexpr):
    """(length, start, seq_lo, seq_hi) of sequence b: [seq_lo, seq_hi) are the positions that some
    of its T queries see (module docstring), length is clamped to the capacity."""
    length = tl.minimum(tl.load(Lengths + b), capacity)
    start = 0
    if HAS_STARTS:
        start = tl.maximum(tl.load(Starts + b), 0)
    # Windows are clamped to capacity + T (equivalent to unbounded) to keep int32 math in range.
    wl = tl.minimum(window_left, capacity + T)
    wr = tl.minimum(window_right, capacity + T)
    pos_first = length - T + pos_shift
    pos_last = length - 1 + pos_shift
    seq_lo = tl.maximum(tl.where(window_left >= 0, tl.maximum(start, pos_first - wl), start), 0)
    seq_hi = length
    if CAUSAL:
        seq_hi = tl.minimum(seq_hi, pos_last + 1)
    seq_hi = tl.where(window_right >= 0, tl.minimum(seq_hi, pos_last + wr + 1), seq_hi)
    return length, start, seq_lo, seq_hi


@triton.jit
def query_rows(Q, kvh, pid_m, length, start, stride_qt, stride_qh, stride_qd,
               window_left, window_right, pos_shift, capacity, T, G, D,
               CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The BLOCK_M query rows r = g * T + t of KV head kvh in row block pid_m (query head
    kvh * G + g, query t), with the key range [row_lo, row_hi) each row sees.

    Returns (q (BLOCK_M, BLOCK_D), t, head (int64), row_valid, row_lo, row_hi); Q is already
    offset to sequence b."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    g = offs_m // T
    t = offs_m % T
    row_valid = offs_m < G * T
    head = (kvh * G + g).to(tl.int64)
    wl = tl.minimum(window_left, capacity + T)
    wr = tl.minimum(window_right, capacity + T)
    pos = length - T + t + pos_shift
    row_lo = tl.where(window_left >= 0, tl.maximum(start, pos - wl), start)
    row_hi = tl.zeros([BLOCK_M], dtype=tl.int32) + length
    if CAUSAL:
        row_hi = tl.minimum(row_hi, pos + 1)
    row_hi = tl.where(window_right >= 0, tl.minimum(row_hi, pos + wr + 1), row_hi)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(Q + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_valid[:, None] & (offs_d[None, :] < D), other=0.0)
    return q, t, head, row_valid, row_lo, row_hi


@triton.jit
def alibi_rows(Alibi, b64, head, t, length, row_valid, stride_ab, T, BLOCK_M: tl.constexpr, ALIBI: tl.constexpr):
    """(slope2, alibi_pos) of the query rows: log2(e) * their heads' slopes and their ALiBi
    positions length - T + t (module docstring); zeros without ALIBI (then never read)."""
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    alibi_pos = length - T + t
    if ALIBI:
        slope2 = tl.load(Alibi + b64 * stride_ab + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
    return slope2, alibi_pos


@triton.jit
def attend_blocks(
    q, acc, m_i, l_i, blk_lo, blk_hi, seq_lo, seq_hi, row_valid, row_lo, row_hi,
    k_head, v_head, table_row, b64,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
    scale, softcap, D, Dv, slope2, alibi_pos,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, ALIBI: tl.constexpr,
):
    """Online softmax of the query rows over key blocks [blk_lo, blk_hi) (positions outside
    [seq_lo, seq_hi) and outside each row's [row_lo, row_hi) hidden); returns (acc, m_i, l_i) with
    m_i in the log2 domain. k_head / v_head point at the KV head's first element; table_row at
    sequence b's block-table row (PAGED); slope2 / alibi_pos from `alibi_rows` (ALIBI)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_mask = offs_d < D
    dv_mask = offs_dv < Dv
    for blk in range(blk_lo, blk_hi):
        cols = blk * BLOCK_N + offs_n
        col_ok = (cols >= seq_lo) & (cols < seq_hi)
        if PAGED:
            page = tl.load(table_row + cols // PAGE_SIZE, mask=col_ok, other=0).to(tl.int64)
            slot = (cols % PAGE_SIZE).to(tl.int64)
            k_rows = page * stride_kb + slot * stride_ks
            v_rows = page * stride_vb + slot * stride_vs
        else:
            k_rows = b64 * stride_kb + cols.to(tl.int64) * stride_ks
            v_rows = b64 * stride_vb + cols.to(tl.int64) * stride_vs
        # K is read transposed: a (BLOCK_D, BLOCK_N) tile.
        kt = tl.load(k_head + k_rows[None, :] + offs_d[:, None] * stride_kd,
                     mask=d_mask[:, None] & col_ok[None, :], other=0.0)
        if q.dtype == tl.float32:
            qk = tl.dot(q, kt, input_precision="tf32x3")
        else:
            qk = tl.dot(q, kt)
        if SOFTCAP:
            s2 = (softcap * 1.4426950408889634) * tanh_f32(qk * (scale / softcap), FAST_TANH)
        else:
            s2 = qk * (scale * 1.4426950408889634)
        if ALIBI:  # after the soft cap, as in the flash kernels
            s2 -= slope2[:, None] * tl.abs(alibi_pos[:, None] - cols[None, :]).to(tl.float32)
        visible = (col_ok[None, :] & row_valid[:, None]
                   & (cols[None, :] >= row_lo[:, None]) & (cols[None, :] < row_hi[:, None]))
        s2 = tl.where(visible, s2, float("-inf"))
        # Online softmax in the log2 domain; a row still at -inf uses 0 as its reference.
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + v_rows[:, None] + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & dv_mask[None, :], other=0.0)
        acc = acc * alpha[:, None]
        if v.dtype == tl.float32:
            acc = tl.dot(p, v, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def store_rows(acc, m_i, l_i, o_ptrs, lse_ptrs, row_valid, stride_od, Dv, BLOCK_DV: tl.constexpr):
    """Writes acc / l (in the output's dtype) and the natural-log LSE (-inf where nothing was
    seen) of BLOCK_M rows; o_ptrs is (BLOCK_M, 1) row pointers, lse_ptrs (BLOCK_M,)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
    tl.store(o_ptrs + offs_dv[None, :] * stride_od, out.to(o_ptrs.dtype.element_ty),
             mask=row_valid[:, None] & (offs_dv[None, :] < Dv))
    tl.store(lse_ptrs, lse, mask=row_valid)
