"""Flash-attention forward for Hopper (sm90) in Triton: a prototype using TMA tensor descriptors.

Not wired into dispatch: it exists to measure a design (`benchmarks/flash_hopper_gpu.py`) against
the portable kernel, `flash_fwd_triton.py`. It imports only `triton` / `triton.language`, uses APIs
present in Triton 3.6 and 3.9, and runs under Triton's interpreter (``TRITON_INTERPRET=1``) too.

Tensors, in (B, H, T, D) order, any strides with a unit head-dim stride (`flash_tma_plan.py`
checks what TMA needs):
    Q (B, Hq, L, D), K and V (B, Hk, S, D); query head h reads KV head h // (Hq // Hk) (GQA).
    Out (B, Hq, L, D) in Q's dtype; Lse (B, Hq, L) float32 contiguous, natural-log LSE.
D is 64 or 128: one descriptor block spans the whole head.

Design:
    * Loads and the output store go through device-side descriptors, `tl.make_tensor_descriptor`,
      one 2-D (length, head dim) descriptor per (batch, head) and operand: it takes any batch and
      head strides, and TMA zero-fills rows past the end of a head (and drops stored ones), so no
      load needs a mask. On a GPU, Triton needs scratch memory for them: the launcher calls
      `triton.set_allocator` first. (Host-side descriptors would not work with warp
      specialization on Hopper in Triton 3.6; device-side ones do, and the interpreter runs both.)
    * The key loops are `tl.range(..., num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE)`.
    * Causal: key blocks that every row of the query block sees run without a mask, the blocks
      crossing the diagonal (or the end of the keys) with one, and blocks above it are never loaded.
      The diagonal is j <= i + diag_offset (0: top-left, S - L: bottom-right).
    * Softmax online in the log2 domain: exp2 with scale * log2(e) folded into one multiply.
    * The query-block index is reversed, so the longest causal rows start first.

A row that sees nothing gives out = 0 and lse = -inf (bottom-right alignment with L > S).
Float32 inputs use exact fp32 dots (slow; for checking the math); 16-bit inputs use tensor cores
with fp32 accumulation.
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, acc=None):
    """a @ b (+ acc) in fp32: exact fp32 products for float32 inputs, tensor cores for 16-bit ones."""
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _key_loop(acc, l_i, m_i, q, k_desc, v_desc, rows, start, end, S, diag, qk_scale2,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Accumulates key blocks [start, end) (start a multiple of BLOCK_N) into (acc, l_i, m_i).

    MASKED: hide keys j >= S and, with CAUSAL, keys j > row + diag; otherwise every key of every
    block is visible to every row, and no mask or empty-row guard is computed.
    """
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([start_n, 0])
        s2 = _dot(q, k.T) * qk_scale2
        if MASKED:
            cols = start_n + offs_n
            visible = cols[None, :] < S
            if CAUSAL:
                visible = visible & (cols[None, :] <= rows[:, None] + diag)
            s2 = tl.where(visible, s2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            # A row that has seen nothing yet keeps m = -inf; 0 as its reference makes
            # exp2(-inf - 0) = 0 instead of NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s2 - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([start_n, 0])
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_tma_kernel(
    Q, K, V, Out, Lse,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
    Hq, Hk, L, S, scale, diag_offset,
    CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, HEADS_FASTEST: tl.constexpr,
):
    """Grid (B * Hq, cdiv(L, BLOCK_M)) with HEADS_FASTEST, else (cdiv(L, BLOCK_M), B * Hq); the
    arguments are `flash_tma_plan.fwd_tma_launch`'s (strides are element strides of the batch,
    head and sequence dims)."""
    if HEADS_FASTEST:
        pid_bh = tl.program_id(0)
        pid_m = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        pid_bh = tl.program_id(1)
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    kvh = (h // (Hq // Hk)).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M

    q_desc = tl.make_tensor_descriptor(Q + b * sqb + h * sqh, shape=[L, HEAD_DIM], strides=[sqm, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + b * skb + kvh * skh, shape=[S, HEAD_DIM], strides=[skn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + b * svb + kvh * svh, shape=[S, HEAD_DIM], strides=[svn, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(Out + b * sob + h * soh, shape=[L, HEAD_DIM], strides=[som, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])

    rows = m0 + tl.arange(0, BLOCK_M)
    # Keys [0, mid) are visible to every row of the block: the unmasked loop. Keys [mid, hi) cross
    # the diagonal or the end of the keys: the masked loop. Keys >= hi are hidden from every row.
    if CAUSAL:
        last_row = tl.minimum(m0 + BLOCK_M, L) - 1
        hi = tl.minimum(S, last_row + diag_offset + 1)
        seen_by_all = tl.minimum(S, m0 + diag_offset + 1)
        mid = (tl.maximum(seen_by_all, 0) // BLOCK_N) * BLOCK_N
    else:
        hi = S
        mid = (S // BLOCK_N) * BLOCK_N

    q = q_desc.load([m0, 0])
    qk_scale2 = scale * 1.4426950408889634  # log2(e): scores in the log2 domain
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + float("-inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, l_i, m_i = _key_loop(acc, l_i, m_i, q, k_desc, v_desc, rows, 0, mid, S, diag_offset, qk_scale2,
                              False, CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE)
    acc, l_i, m_i = _key_loop(acc, l_i, m_i, q, k_desc, v_desc, rows, mid, hi, S, diag_offset, qk_scale2,
                              True, CAUSAL, BLOCK_M, BLOCK_N, NUM_STAGES, WARP_SPECIALIZE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # ln(2): back to natural log
    o_desc.store([m0, 0], out.to(Out.dtype.element_ty))
    tl.store(Lse + pid_bh.to(tl.int64) * L + rows, lse, mask=rows < L)
