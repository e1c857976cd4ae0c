"""Blockwise attention in XLA: a scan over query and key chunks with an online softmax.

Memory is O(chunk): no (T, S) logits matrix exists, only (query chunk, key chunk) tiles.

Two layers:

* `blockwise_attn(query, key, value, ...)`: the classic blockwise-parallel attention API. The
  chunk bodies are wrapped in `jax.checkpoint`, so the backward recomputes each tile instead of
  storing it (rematerialised backward; `policy` chooses what may be saved).
* `block_forward` / `block_backward`: one query block against one key/value block, returning the
  normalised output and the log-sum-exp (forward), or the gradients given the *global* output
  statistics (backward, flash-attention style: P = exp(s - lse), dS = P * (dP - Delta)). Ring
  attention runs these on each K/V block that reaches a device and merges the partial results.

ALiBi in `block_forward` / `block_backward` (`BlockAlibi`) comes with the tokens' positions, so a
block of a longer sequence (a ring step) adds -slope * |q_pos - k_pos| of its global positions.

Visibility inside a block is a `Band`: query row i sees key column j iff lo <= j - i <= hi (either
bound may be None = unbounded), intersected with segment ids (equal ids only) and, for padded
inputs, a key-count limit. `Visibility.band` gives it from a causal flag, alignment and window
(causal top-left is Band(None, 0); a window (left, right) around the diagonal is Band(-left, right)).

Shape legend: B batch, T query length, S key length, Hq query heads, Hk key/value heads
(Hq % Hk == 0, G = Hq // Hk query heads per key/value head), D q/k head dim, Dv value head dim.
Arrays are (B, T, H, D) ("BTHD"); the LSE is (B, Hq, T).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from .masks import alibi_from_positions
from .visibility import FULL, Band, Visibility


class BlockAlibi(NamedTuple):
    """ALiBi of one block: -slopes * |q_pos[i] - k_pos[j]| joins each logit after scale and soft cap.

    Attributes:
        slopes: (1|B, Hq) float slopes (no gradient).
        q_pos: (T,) integer positions of the block's queries (plus S - T for flash-attn's
            bottom-right distance); k_pos: (S,) integer positions of its keys.
    """

    slopes: jax.Array
    q_pos: jax.Array
    k_pos: jax.Array


class Carry(NamedTuple):
    """Online-softmax state of one query chunk, in the (B, Hk, G, rows) layout, float32 (or wider).

    Attributes:
        numerator: (B, Hk, G, cq, Dv) running sum of exp(s - max_so_far) @ V.
        denominator: (B, Hk, G, cq) running sum of exp(s - max_so_far).
        max_so_far: (B, Hk, G, cq) running row maximum of the visible logits (-inf before any).
    """

    numerator: jax.Array
    denominator: jax.Array
    max_so_far: jax.Array


def _groups(x: jax.Array, hk: int) -> jax.Array:
    """(B, T, Hq, D) -> (B, T, Hk, G, D)."""
    b, t, hq, d = x.shape
    return x.reshape(b, t, hk, hq // hk, d)


def _scores(qc, kc, scale, softcap, precision):
    """(B, cq, Hk, G, D) x (B, ck, Hk, D) -> (B, Hk, G, cq, ck) scaled (and soft-capped) logits."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qc, kc, precision=precision) * jnp.asarray(scale, qc.dtype)
    if softcap is not None:
        cap = jnp.asarray(softcap, s.dtype)
        s = cap * jnp.tanh(s / cap)
    return s


def _alibi_tile(alibi: Optional[BlockAlibi], q_start, cq: int, k_start, ck: int, hk: int, dtype):
    """(1|B, Hk, G, cq, ck) ALiBi of a tile of the padded block, or None."""
    if alibi is None:
        return None
    qp = jax.lax.dynamic_slice_in_dim(alibi.q_pos, q_start, cq)
    kp = jax.lax.dynamic_slice_in_dim(alibi.k_pos, k_start, ck)
    bias = alibi_from_positions(alibi.slopes, qp, kp, dtype)
    return bias.reshape(bias.shape[0], hk, bias.shape[1] // hk, cq, ck)


def _padded_alibi(alibi: Optional[BlockAlibi], tq: int, tk: int) -> Optional[BlockAlibi]:
    """Positions padded to the chunked lengths (padded rows and keys are never visible)."""
    if alibi is None:
        return None
    return alibi._replace(q_pos=_pad_to(alibi.q_pos, 0, tq), k_pos=_pad_to(alibi.k_pos, 0, tk))


def _visible(q_idx, k_idx, band: Band, q_seg, k_seg, kv_len):
    """(B|1, 1, 1, cq, ck) bool visibility of a tile, or None when everything is visible.

    q_idx (cq,), k_idx (ck,) are row / column indices in block coordinates; q_seg (B, cq) and
    k_seg (B, ck) segment ids or None; kv_len a key count (columns >= kv_len are padding) or None.
    """
    vis = None

    def add(m):
        nonlocal vis
        vis = m if vis is None else vis & m

    diff = k_idx[None, :] - q_idx[:, None]
    if band.lo is not None:
        add(diff >= band.lo)
    if band.hi is not None:
        add(diff <= band.hi)
    if kv_len is not None:
        add(jnp.broadcast_to(k_idx[None, :] < kv_len, diff.shape))
    if vis is not None:
        vis = vis[None, None, None]
    if q_seg is not None:
        add((q_seg[:, :, None] == k_seg[:, None, :])[:, None, None])
    return vis


def tile_may_be_visible(q_start, cq: int, k_start, ck: int, band: Band):
    """Whether the band leaves any (row, column) of a cq x ck tile at (q_start, k_start) visible
    (True for bands that don't exclude it; a traced bool for traced starts)."""
    ok = True
    if band.hi is not None:  # smallest j - i is k_start - (q_start + cq - 1)
        ok = ok & (k_start - q_start - (cq - 1) <= band.hi)
    if band.lo is not None:  # largest j - i is k_start + ck - 1 - q_start
        ok = ok & (k_start + ck - 1 - q_start >= band.lo)
    return ok


def _pad_to(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _chunk(size: int, requested: int) -> int:
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
        raise ValueError(f"chunk size {requested!r}: expected a positive int.")
    return min(size, requested)


def _online_update(carry: Carry, s, vis, vc, dropout_keep=None, dropout_scale=1.0, precision=None) -> Carry:
    """Folds one (B, Hk, G, cq, ck) logit tile and its (B, ck, Hk, Dv) values into `carry`."""
    if vis is not None:
        s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(carry.max_so_far, jnp.max(s, axis=-1))
    # The maximum is only a shift; stopping its gradient keeps autodiff exact and NaN-free.
    m_new = jax.lax.stop_gradient(m_new)
    m_ref = jnp.where(jnp.isfinite(m_new), m_new, 0)  # rows with nothing visible yet: exp(-inf) = 0
    correction = jnp.exp(carry.max_so_far - m_ref)
    p = jnp.exp(s - m_ref[..., None])
    denominator = carry.denominator * correction + jnp.sum(p, axis=-1)
    pv = p if dropout_keep is None else jnp.where(dropout_keep, p * dropout_scale, 0)
    numerator = carry.numerator * correction[..., None] + jnp.einsum(
        "bhgqk,bkhd->bhgqd", pv, vc.astype(pv.dtype), precision=precision)
    return Carry(numerator, denominator, m_new)


def _finish(carry: Carry):
    """(normalised output (B, Hk, G, cq, Dv), lse (B, Hk, G, cq); -inf and 0 for empty rows)."""
    den = carry.denominator
    empty = den == 0
    out = carry.numerator / jnp.where(empty, 1, den)[..., None]
    m_ref = jnp.where(jnp.isfinite(carry.max_so_far), carry.max_so_far, 0)
    lse = jnp.where(empty, -jnp.inf, m_ref + jnp.log(jnp.where(empty, 1, den)))
    return out, lse


def _init_carry(b, hk, g, cq, dv, dtype) -> Carry:
    return Carry(
        jnp.zeros((b, hk, g, cq, dv), dtype), jnp.zeros((b, hk, g, cq), dtype),
        jnp.full((b, hk, g, cq), -jnp.inf, dtype),
    )


def _ungroup_rows(x: jax.Array) -> jax.Array:
    """(n, B, Hk, G, cq, ...) per-chunk results -> (B, Hk * G, n * cq, ...)."""
    n, b, hk, g, cq = x.shape[:5]
    x = jnp.moveaxis(x, 0, 3)  # (B, Hk, G, n, cq, ...)
    return x.reshape(b, hk * g, n * cq, *x.shape[5:])


def block_forward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float,
    band: Band = FULL,
    softcap: Optional[float] = None,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    kv_len: Optional[int] = None,
    chunk_q: int = 512,
    chunk_k: int = 512,
    compute_dtype: Any = jnp.float32,
    precision: Any = None,
    alibi: Optional[BlockAlibi] = None,
) -> tuple[jax.Array, jax.Array]:
    """Attention of a query block against one key/value block, chunk by chunk.

    Args:
        query: (B, T, Hq, D). key: (B, S, Hk, D). value: (B, S, Hk, Dv).
        scale: multiplier of q.k.
        band: visible j - i range in block coordinates (`Band`).
        softcap: c in c * tanh(s / c), or None.
        segment_ids: (q_ids (B, T), kv_ids (B, S)) int arrays, or None.
        kv_len: keys at index >= kv_len are invisible (padding), or None.
        chunk_q, chunk_k: tile sizes (clamped to T and S; lengths are padded up to multiples).
        compute_dtype: dtype of logits, softmax and accumulators (float32, or float64).
        precision: `jax.lax.Precision` of the products.
        alibi: ALiBi slopes and the block's token positions (`BlockAlibi`), or None.

    Returns:
        (out (B, T, Hq, Dv) in compute_dtype, lse (B, Hq, T) in compute_dtype; 0 / -inf for rows
        that see nothing).
    """
    b, t, hq, d = query.shape
    s, hk, dv = key.shape[1], key.shape[2], value.shape[-1]
    g = hq // hk
    cq, ck = _chunk(t, chunk_q), _chunk(s, chunk_k)
    nq, nk = -(-t // cq), -(-s // ck)
    if nk * ck != s:
        kv_len = s if kv_len is None else min(kv_len, s)
    q = _pad_to(_groups(query, hk).astype(compute_dtype), 1, nq * cq)
    k = _pad_to(key.astype(compute_dtype), 1, nk * ck)
    v = _pad_to(value.astype(compute_dtype), 1, nk * ck)
    q_seg = k_seg = None
    if segment_ids is not None:
        q_seg = _pad_to(segment_ids[0], 1, nq * cq)
        k_seg = _pad_to(segment_ids[1], 1, nk * ck)
    alibi = _padded_alibi(alibi, nq * cq, nk * ck)

    def q_chunk(qi):
        q_start = qi * cq
        qc = jax.lax.dynamic_slice_in_dim(q, q_start, cq, axis=1)
        qs = None if q_seg is None else jax.lax.dynamic_slice_in_dim(q_seg, q_start, cq, axis=1)
        q_idx = q_start + jnp.arange(cq)

        def k_step(carry, ki):
            k_start = ki * ck

            def compute(carry):
                kc = jax.lax.dynamic_slice_in_dim(k, k_start, ck, axis=1)
                vc = jax.lax.dynamic_slice_in_dim(v, k_start, ck, axis=1)
                ks = None if k_seg is None else jax.lax.dynamic_slice_in_dim(k_seg, k_start, ck, axis=1)
                sc = _scores(qc, kc, scale, softcap, precision)
                bias = _alibi_tile(alibi, q_start, cq, k_start, ck, hk, compute_dtype)
                if bias is not None:
                    sc = sc + bias
                vis = _visible(q_idx, k_start + jnp.arange(ck), band, qs, ks, kv_len)
                return _online_update(carry, sc, vis, vc, precision=precision)

            live = tile_may_be_visible(q_start, cq, k_start, ck, band)
            if live is True:
                return compute(carry), None
            return jax.lax.cond(live, compute, lambda c: c, carry), None

        carry, _ = jax.lax.scan(k_step, _init_carry(b, hk, g, cq, dv, compute_dtype), jnp.arange(nk))
        return _finish(carry)

    out, lse = jax.lax.map(q_chunk, jnp.arange(nq))
    out = jnp.swapaxes(_ungroup_rows(out), 1, 2)[:, :t]  # (B, T, Hq, Dv)
    return out, _ungroup_rows(lse)[:, :, :t]


def block_backward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    dout: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    scale: float,
    band: Band = FULL,
    softcap: Optional[float] = None,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    kv_len: Optional[int] = None,
    chunk_q: int = 512,
    chunk_k: int = 512,
    compute_dtype: Any = jnp.float32,
    precision: Any = None,
    alibi: Optional[BlockAlibi] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of one query block against one key/value block, given global row statistics.

    With the global `lse` and Delta = rowsum(dO * O) - dLSE of the full attention, the tile
    gradients are P = exp(s - lse), dP = dO V^T, dS = P * (dP - Delta) (times the soft cap's
    derivative), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO; summing them over all key
    blocks gives the exact gradients of the full attention.

    Args:
        query, key, value: as in `block_forward`.
        dout: (B, T, Hq, Dv) output cotangent.
        lse: (B, Hq, T) log-sum-exp of the full attention rows (-inf for rows that see nothing).
        delta: (B, Hq, T) rowsum(dout * out) minus the LSE cotangent.
        scale, band, softcap, segment_ids, kv_len, chunk_q, chunk_k, compute_dtype, precision,
            alibi: as in `block_forward`.

    Returns:
        (dq (B, T, Hq, D), dk (B, S, Hk, D), dv (B, S, Hk, Dv)) in compute_dtype.
    """
    b, t, hq, d = query.shape
    s, hk, dv_dim = key.shape[1], key.shape[2], value.shape[-1]
    g = hq // hk
    cq, ck = _chunk(t, chunk_q), _chunk(s, chunk_k)
    nq, nk = -(-t // cq), -(-s // ck)
    if nk * ck != s:
        kv_len = s if kv_len is None else min(kv_len, s)
    q = _pad_to(_groups(query, hk).astype(compute_dtype), 1, nq * cq)
    do = _pad_to(_groups(dout, hk).astype(compute_dtype), 1, nq * cq)
    k = _pad_to(key.astype(compute_dtype), 1, nk * ck)
    v = _pad_to(value.astype(compute_dtype), 1, nk * ck)
    rows = lambda x: _pad_to(x.astype(compute_dtype).reshape(b, hk, g, t), 3, nq * cq, -jnp.inf)  # noqa: E731
    lse_p, delta_p = rows(lse), jnp.nan_to_num(rows(delta), neginf=0.0)
    q_seg = k_seg = None
    if segment_ids is not None:
        q_seg = _pad_to(segment_ids[0], 1, nq * cq)
        k_seg = _pad_to(segment_ids[1], 1, nk * ck)
    alibi = _padded_alibi(alibi, nq * cq, nk * ck)

    def q_step(dkv, qi):
        q_start = qi * cq
        qc = jax.lax.dynamic_slice_in_dim(q, q_start, cq, axis=1)
        doc = jax.lax.dynamic_slice_in_dim(do, q_start, cq, axis=1)
        lc = jax.lax.dynamic_slice_in_dim(lse_p, q_start, cq, axis=3)
        dc = jax.lax.dynamic_slice_in_dim(delta_p, q_start, cq, axis=3)
        qs = None if q_seg is None else jax.lax.dynamic_slice_in_dim(q_seg, q_start, cq, axis=1)
        q_idx = q_start + jnp.arange(cq)

        def k_step(state, ki):
            k_start = ki * ck

            def compute(state):
                dq_c, dk_all, dv_all = state
                kc = jax.lax.dynamic_slice_in_dim(k, k_start, ck, axis=1)
                vc = jax.lax.dynamic_slice_in_dim(v, k_start, ck, axis=1)
                ks = None if k_seg is None else jax.lax.dynamic_slice_in_dim(k_seg, k_start, ck, axis=1)
                sc = _scores(qc, kc, scale, softcap, precision)
                bias = _alibi_tile(alibi, q_start, cq, k_start, ck, hk, compute_dtype)
                logits = sc if bias is None else sc + bias  # the soft cap's derivative needs sc alone
                vis = _visible(q_idx, k_start + jnp.arange(ck), band, qs, ks, kv_len)
                live = jnp.isfinite(lc)[..., None]
                if vis is not None:
                    live = live & vis
                p = jnp.where(live, jnp.exp(logits - jnp.where(jnp.isfinite(lc), lc, 0)[..., None]), 0)
                dp = jnp.einsum("bqhgd,bkhd->bhgqk", doc, vc, precision=precision)
                ds = p * (dp - dc[..., None])
                if softcap is not None:
                    ds = ds * (1 - jnp.square(sc / jnp.asarray(softcap, sc.dtype)))
                ds = ds * jnp.asarray(scale, ds.dtype)
                dq_c = dq_c + jnp.einsum("bhgqk,bkhd->bqhgd", ds, kc, precision=precision)
                dk_c = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qc, precision=precision)
                dv_c = jnp.einsum("bhgqk,bqhgd->bkhd", p, doc, precision=precision)
                dk_all = jax.lax.dynamic_update_slice_in_dim(
                    dk_all, jax.lax.dynamic_slice_in_dim(dk_all, k_start, ck, axis=1) + dk_c, k_start, axis=1)
                dv_all = jax.lax.dynamic_update_slice_in_dim(
                    dv_all, jax.lax.dynamic_slice_in_dim(dv_all, k_start, ck, axis=1) + dv_c, k_start, axis=1)
                return dq_c, dk_all, dv_all

            live = tile_may_be_visible(q_start, cq, k_start, ck, band)
            if live is True:
                return compute(state), None
            return jax.lax.cond(live, compute, lambda st: st, state), None

        dq0 = jnp.zeros((b, cq, hk, g, d), compute_dtype)
        (dq_c, dk_all, dv_all), _ = jax.lax.scan(k_step, (dq0, *dkv), jnp.arange(nk))
        return (dk_all, dv_all), dq_c

    dkv0 = (jnp.zeros((b, nk * ck, hk, d), compute_dtype), jnp.zeros((b, nk * ck, hk, dv_dim), compute_dtype))
    (dk, dv), dq = jax.lax.scan(q_step, dkv0, jnp.arange(nq))
    dq = jnp.moveaxis(dq, 0, 1).reshape(b, nq * cq, hq, d)[:, :t]
    return dq, dk[:, :s], dv[:, :s]


def blockwise_attn(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    deterministic: bool = True,
    dropout_rng: Optional[jax.Array] = None,
    attn_pdrop: float = 0.0,
    causal: bool = True,
    query_chunk_size: int = 2048,
    key_chunk_size: int = 2048,
    dtype: Any = jnp.float32,
    policy: Any = None,
    precision: Any = None,
    float32_logits: bool = True,
    prevent_cse: bool = True,
) -> jax.Array:
    """Blockwise attention: scans over query chunks and, inside, key chunks, with an online softmax.

    No (T, S) matrix is formed; tiles wholly hidden by the causal mask are skipped. Each query
    chunk and each key step is a `jax.checkpoint`, so the backward recomputes tiles (memory stays
    O(chunk) plus one carry per key step of the query chunk being differentiated).

    Args:
        query: (B, T, Hq, D).
        key: (B, S, Hk, D); Hq % Hk == 0 (grouped-query attention without repeating K/V).
        value: (B, S, Hk, Dv).
        bias: None, or an additive float bias broadcastable to (B, Hq, T, S); sliced per tile.
        deterministic: True disables dropout.
        dropout_rng: PRNG key, required when `deterministic` is False and `attn_pdrop` > 0.
        attn_pdrop: probability of dropping an attention weight.
        causal: top-left causal mask (query i sees keys j <= i).
        query_chunk_size, key_chunk_size: tile sizes (clamped to T and S; lengths that are not
            multiples are padded internally, padded keys are invisible).
        dtype: dtype of the output, promoted with the query dtype (float32 by default, so bf16
            inputs give a float32 result and float64 inputs stay float64).
        policy: `jax.checkpoint` policy for the tiles (None: save nothing, recompute all).
        precision: `jax.lax.Precision` of the products.
        float32_logits: compute logits and softmax in float32 (or wider); False uses the
            promoted input dtype.
        prevent_cse: passed to `jax.checkpoint`.

    Returns:
        (B, T, Hq, Dv) attention output.

    Raises:
        ValueError: malformed shapes, chunk sizes, dropout settings or bias.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ValueError(f"{name}: expected a 4-D (B, T, H, D) array, got shape {tuple(x.shape)}.")
    b, t, hq, d = query.shape
    s, hk, dv = key.shape[1], key.shape[2], value.shape[-1]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[3] != d:
        raise ValueError(f"shapes disagree: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}; expected (B, T, Hq, D), (B, S, Hk, D), (B, S, Hk, Dv).")
    if hq % hk:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={hk}.")
    use_dropout = not deterministic and attn_pdrop > 0
    if not 0.0 <= attn_pdrop < 1.0:
        raise ValueError(f"attn_pdrop={attn_pdrop!r}: expected a probability in [0, 1).")
    if use_dropout and dropout_rng is None:
        raise ValueError(f"dropout_rng: required when deterministic=False and attn_pdrop={attn_pdrop} > 0.")
    if bias is not None:
        full = (b, hq, t, s)
        if bias.ndim > 4 or any(a not in (1, f) for a, f in zip(bias.shape[::-1], full[::-1])):
            raise ValueError(f"bias: shape {tuple(bias.shape)} is not broadcastable to (B, Hq, T, S)={full}.")
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    g = hq // hk
    cq, ck = _chunk(t, query_chunk_size), _chunk(s, key_chunk_size)
    nq, nk = -(-t // cq), -(-s // ck)
    in_dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)
    out_dtype = jnp.promote_types(dtype, in_dtype)
    ld = jnp.promote_types(jnp.float32, in_dtype) if float32_logits else out_dtype
    kv_len = s if nk * ck != s else None
    band = Visibility(causal=bool(causal)).band(t, s)
    scale = 1.0 / math.sqrt(d)
    q = _pad_to(_groups(query, hk).astype(ld), 1, nq * cq)
    k = _pad_to(key.astype(ld), 1, nk * ck)
    v = _pad_to(value.astype(ld), 1, nk * ck)
    if bias is not None:
        bias = _pad_to(_pad_to(bias, 2, nq * cq if bias.shape[2] != 1 else 1), 3, nk * ck if bias.shape[3] != 1 else 1)
    checkpoint = lambda f: jax.checkpoint(f, prevent_cse=prevent_cse, policy=policy)  # noqa: E731

    @checkpoint
    def q_chunk(qi):
        q_start = qi * cq
        qc = jax.lax.dynamic_slice_in_dim(q, q_start, cq, axis=1)
        q_idx = q_start + jnp.arange(cq)

        @checkpoint
        def tile(carry, ki):
            k_start = ki * ck
            kc = jax.lax.dynamic_slice_in_dim(k, k_start, ck, axis=1)
            vc = jax.lax.dynamic_slice_in_dim(v, k_start, ck, axis=1)
            sc = _scores(qc, kc, scale, None, precision)
            if bias is not None:
                bt = bias
                if bt.shape[2] != 1:
                    bt = jax.lax.dynamic_slice_in_dim(bt, q_start, cq, axis=2)
                if bt.shape[3] != 1:
                    bt = jax.lax.dynamic_slice_in_dim(bt, k_start, ck, axis=3)
                h = bt.shape[1]
                sc = sc + bt.astype(ld).reshape(bt.shape[0], hk if h != 1 else 1, g if h != 1 else 1, *bt.shape[2:])
            vis = _visible(q_idx, k_start + jnp.arange(ck), band, None, None, kv_len)
            keep = None
            if use_dropout:
                rng = jax.random.fold_in(jax.random.fold_in(dropout_rng, qi), ki)
                keep = jax.random.bernoulli(rng, 1.0 - attn_pdrop, sc.shape)
            return _online_update(carry, sc, vis, vc, keep, 1.0 / (1.0 - attn_pdrop), precision)

        def k_step(carry, ki):
            live = tile_may_be_visible(q_start, cq, ki * ck, ck, band)
            if live is True:
                return tile(carry, ki), None
            return jax.lax.cond(live, tile, lambda c, _: c, carry, ki), None

        carry, _ = jax.lax.scan(k_step, _init_carry(b, hk, g, cq, dv, ld), jnp.arange(nk))
        return _finish(carry)[0]

    out = jax.lax.map(q_chunk, jnp.arange(nq))
    return jnp.swapaxes(_ungroup_rows(out), 1, 2)[:, :t].astype(out_dtype)
