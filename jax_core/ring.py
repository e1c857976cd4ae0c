"""`ring`: sequence-parallel (ring) attention over one mesh axis.

The sequence of query, key and value is sharded over the mesh axis `metadata.sequence_axis_name`
(n devices). Inside `shard_map`, each device keeps its query shard and, over n steps, sees every
key/value block once: at step t it holds the block of device (r - t) mod n, starts the `ppermute`
that passes the block on (so the transfer overlaps the step's compute), attends its queries to the
block in hand, and merges the partial result into its running (output, LSE) by log-sum-exp. The
backward is a ring too: each key/value block travels with float32 accumulators of its dK and dV,
which arrive home after n hops; dQ stays local. No device ever holds more than its own shard plus
one block in flight.

Per-step attention (a "block kernel"):
    GPU: the Triton flash kernels (`kernels/flash_jax_triton.py`: `flash_block_forward` /
         `flash_block_backward`, float32 partial outputs and gradients).
    CPU: blockwise XLA (`blockwise.block_forward` / `block_backward`, O(chunk) memory).
    TPU: not available yet (raises; use the XLA kernel with `kernel="xla"` in `ring_attention`).

Load balance under a causal mask (`ring_layout`): "zigzag" (default for causal) gives device d the
sequence chunks d and 2n - 1 - d, "striped" gives it every n-th token; both give every device the
same work. "contiguous" (default otherwise) keeps natural shards. The permutation into the layout
and back is applied inside the call (with collectives), unless `inputs_in_layout=True`.

Masks: causal (top-left; T == S) and sliding windows follow global positions; each step's kernel
calls come from a static plan (`ring_layout.plan_step`), one `lax.switch` branch per distinct
piece list, so kernels see static masks and fully masked blocks are skipped. GQA, the logits soft
cap, segment ids and attention sinks are carried through; bias, bool masks, dropout, varlen and
returning weights are not supported (they raise).

ALiBi (`alibi_slopes`, flash-attn's -slope * |i + S - T - j|) uses global positions too: each
device derives its queries' positions and those of the block in hand from the layout and its ring
index (`ring_layout.positions_of_device`), and the XLA block kernel adds the bias per tile
(`blockwise.BlockAlibi`). The Triton block kernels compute ALiBi only from positions local to
their call, so a ring with ALiBi runs the XLA block kernel (the default then, on GPU too).

Shape legend: B batch, T query length, S key length, Hq / Hk query / key-value heads, D head dim,
Dv value head dim. Arrays are (B, T, H, D).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import ring_layout as rl
from .base import AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .blockwise import Band, BlockAlibi, block_backward, block_forward
from .capabilities import ALL_FLOAT_DTYPES, AttentionInputs, Capabilities, missing_gpu_packages
from .metadata import AttentionMetadata
from .registry import AttentionRegistry
from .visibility import band_flash_settings

KERNELS = ("xla", "triton")


@dataclasses.dataclass(frozen=True)
class RingConfig:
    """Static settings of one ring call (hashable: part of the trace).

    Attributes:
        axis_name: mesh axis of the ring; n: its size.
        layout: "contiguous", "zigzag" or "striped" (the shards are already in it).
        rule: global visibility rule (`ring_layout.GlobalBand`).
        scale: softmax scale; softcap: logits soft cap or None.
        kernel: "xla" or "triton" block kernel.
        chunk_q, chunk_k: tile sizes of the XLA kernel.
        fast_tanh: hardware tanh for the soft cap (Triton, 16-bit inputs, NVIDIA).
        accumulation: dtype of the running output and the dQ / dK / dV accumulators ("float32",
            or "input": the inputs' dtype, see `ring_attention`).
        alibi_shift: None without ALiBi; else S - T of the unpadded lengths, added to each query's
            position (flash-attn's bottom-right ALiBi distance).
    """

    axis_name: str
    n: int
    layout: str
    rule: rl.GlobalBand
    scale: float
    softcap: Optional[float] = None
    kernel: str = "xla"
    chunk_q: int = 512
    chunk_k: int = 512
    fast_tanh: bool = False
    accumulation: str = "float32"
    alibi_shift: Optional[int] = None


ACCUMULATIONS = ("float32", "input")


# --- block kernels ---------------------------------------------------------------------------------


def _acc_dtype(dtype) -> jnp.dtype:
    return jnp.promote_types(jnp.float32, dtype)


def _partial_dtype(dtype, cfg: RingConfig) -> jnp.dtype:
    """Dtype of partial outputs and gradient accumulators: float32+ or, with accumulation="input",
    the inputs' own dtype."""
    return jnp.dtype(dtype) if cfg.accumulation == "input" else _acc_dtype(dtype)


def _triton_config(band: Band, cfg: RingConfig):
    """A FlashConfig whose causal / window / diagonal offset express `band` (see `blockwise.Band`).

    Not `AttentionCall.flash_config`: a piece's band comes from global positions in the ring's
    layout (its offset is neither 0 nor S - L of the piece), so no call's visibility over the
    piece's lengths expresses it; scale, soft cap and hardware tanh are the ring's own settings.
    """
    from .kernels.flash_jax_triton import FlashConfig

    causal, diag, window = band_flash_settings(band)
    return FlashConfig(scale=cfg.scale, causal=causal, diag_offset=diag, window=window, softcap=cfg.softcap,
                       layout="BTHD", fast_tanh=cfg.fast_tanh)


def _no_triton_alibi(alibi) -> None:
    if alibi is not None:  # `_prepare` picks the XLA kernel for ALiBi; this guards direct callers
        raise ValueError("ALiBi in ring attention needs kernel='xla' (the Triton block kernels measure ALiBi "
                         "distances from positions local to the block, not global ones).")


def _block_forward(q, k, v, q_seg, k_seg, alibi, band: Band, cfg: RingConfig):
    """(out (B, Tq, Hq, Dv) float32+, lse (B, Hq, Tq)) of one piece (`alibi`: a `BlockAlibi` or None)."""
    seg = None if q_seg is None else (q_seg, k_seg)
    if cfg.kernel == "triton":
        _no_triton_alibi(alibi)
        from .kernels.flash_jax_triton import FlashExtras, flash_block_forward

        return flash_block_forward(q, k, v, FlashExtras(segment_ids=seg), _triton_config(band, cfg),
                                   out_dtype=_partial_dtype(q.dtype, cfg))
    return block_forward(q, k, v, scale=cfg.scale, band=band, softcap=cfg.softcap, segment_ids=seg,
                         chunk_q=cfg.chunk_q, chunk_k=cfg.chunk_k, compute_dtype=_acc_dtype(q.dtype), alibi=alibi)


def _block_backward(q, k, v, do, lse, delta, q_seg, k_seg, alibi, band: Band, cfg: RingConfig):
    """(dq, dk, dv) of one piece, float32+ (given the rows' global lse and delta)."""
    seg = None if q_seg is None else (q_seg, k_seg)
    if cfg.kernel == "triton":
        _no_triton_alibi(alibi)
        from .kernels.flash_jax_triton import FlashExtras, flash_block_backward

        return flash_block_backward(q, k, v, do, lse, delta, FlashExtras(segment_ids=seg), _triton_config(band, cfg),
                                    grad_dtype=_partial_dtype(q.dtype, cfg))
    return block_backward(q, k, v, do, lse, delta, scale=cfg.scale, band=band, softcap=cfg.softcap, segment_ids=seg,
                          chunk_q=cfg.chunk_q, chunk_k=cfg.chunk_k, compute_dtype=_acc_dtype(q.dtype), alibi=alibi)


# --- merging partial results -----------------------------------------------------------------------


def merge_partials(out_a, lse_a, out_b, lse_b):
    """Combines two softmax-normalised partial results over disjoint key sets.

    out_*: (B, T, H, Dv); lse_*: (B, H, T), -inf for rows that saw nothing. Returns (out, lse) of
    the union: lse = logaddexp(lse_a, lse_b), out = sum_x exp(lse_x - lse) * out_x.
    """
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(jnp.isfinite(lse), lse, 0)
    w_a = jnp.swapaxes(jnp.exp(lse_a - ref), 1, 2)[..., None]
    w_b = jnp.swapaxes(jnp.exp(lse_b - ref), 1, 2)[..., None]
    # Weighted in the LSE's precision (fused, no float32 copy); the result keeps out_a's dtype.
    return (out_a.astype(lse.dtype) * w_a + out_b.astype(lse.dtype) * w_b).astype(out_a.dtype), lse


def _rows(x, start, length, axis):
    return jax.lax.slice_in_dim(x, start, start + length, axis=axis)


def _piece_alibi(alibi: Optional[BlockAlibi], p: rl.Piece) -> Optional[BlockAlibi]:
    """The positions of a piece's query rows and keys (the slopes are the whole call's)."""
    if alibi is None:
        return None
    return alibi._replace(q_pos=_rows(alibi.q_pos, p.q_start, p.q_len, 0),
                          k_pos=_rows(alibi.k_pos, p.k_start, p.k_len, 0))


def _forward_branch(pieces, acc_out, acc_lse, q, q_seg, alibi, k, v, k_seg, *, cfg):
    for p in pieces:
        qs = _rows(q, p.q_start, p.q_len, 1)
        ks, vs = _rows(k, p.k_start, p.k_len, 1), _rows(v, p.k_start, p.k_len, 1)
        qseg = None if q_seg is None else _rows(q_seg, p.q_start, p.q_len, 1)
        kseg = None if k_seg is None else _rows(k_seg, p.k_start, p.k_len, 1)
        o, l = _block_forward(qs, ks, vs, qseg, kseg, _piece_alibi(alibi, p), p.band, cfg)
        o_old, l_old = _rows(acc_out, p.q_start, p.q_len, 1), _rows(acc_lse, p.q_start, p.q_len, 2)
        o_new, l_new = merge_partials(o_old, l_old, o.astype(acc_out.dtype), l.astype(acc_lse.dtype))
        acc_out = jax.lax.dynamic_update_slice_in_dim(acc_out, o_new, p.q_start, axis=1)
        acc_lse = jax.lax.dynamic_update_slice_in_dim(acc_lse, l_new, p.q_start, axis=2)
    return acc_out, acc_lse


def _backward_branch(pieces, dq, dk, dv, q, q_seg, do, lse, delta, alibi, k, v, k_seg, *, cfg):
    for p in pieces:
        qs, dos = _rows(q, p.q_start, p.q_len, 1), _rows(do, p.q_start, p.q_len, 1)
        ls, ds = _rows(lse, p.q_start, p.q_len, 2), _rows(delta, p.q_start, p.q_len, 2)
        ks, vs = _rows(k, p.k_start, p.k_len, 1), _rows(v, p.k_start, p.k_len, 1)
        qseg = None if q_seg is None else _rows(q_seg, p.q_start, p.q_len, 1)
        kseg = None if k_seg is None else _rows(k_seg, p.k_start, p.k_len, 1)
        gq, gk, gv = _block_backward(qs, ks, vs, dos, ls, ds, qseg, kseg, _piece_alibi(alibi, p), p.band, cfg)
        dq = dq.at[:, p.q_start:p.q_start + p.q_len].add(gq.astype(dq.dtype))
        dk = dk.at[:, p.k_start:p.k_start + p.k_len].add(gk.astype(dk.dtype))
        dv = dv.at[:, p.k_start:p.k_start + p.k_len].add(gv.astype(dv.dtype))
    return dq, dk, dv


def _run_plan(plan: rl.StepPlan, make_branch, axis_name: str, *operands):
    branches = [functools.partial(make_branch, pieces) for pieces in plan.branches]
    if len(branches) == 1:
        return branches[0](*operands)
    index = jnp.asarray(plan.index, jnp.int32)[jax.lax.axis_index(axis_name)]
    return jax.lax.switch(index, branches, *operands)


def _next_hop(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _step_alibi(slopes, q_len: int, kv_len: int, step: int, cfg: RingConfig) -> Optional[BlockAlibi]:
    """ALiBi of ring step `step` on this device: the global positions of its queries (shifted by
    S - T) and of the key/value block in hand, that of device (r - step) mod n."""
    if slopes is None:
        return None
    r = jax.lax.axis_index(cfg.axis_name)
    q_pos = rl.positions_of_device(cfg.layout, cfg.n, q_len, r) + cfg.alibi_shift
    k_pos = rl.positions_of_device(cfg.layout, cfg.n, kv_len, (r - step) % cfg.n)
    return BlockAlibi(slopes, q_pos, k_pos)


def _ring_forward(q, k, v, q_seg, k_seg, slopes, cfg: RingConfig):
    b, t, hq, _ = q.shape
    acc = _acc_dtype(q.dtype)
    acc_out = jnp.zeros((b, t, hq, v.shape[-1]), _partial_dtype(q.dtype, cfg))
    acc_lse = jnp.full((b, hq, t), -jnp.inf, acc)
    block = (k, v, k_seg)
    branch = functools.partial(_forward_branch, cfg=cfg)
    for step in range(cfg.n):
        # Start passing the block on before computing with it: the transfer overlaps the step.
        following = jax.lax.ppermute(block, cfg.axis_name, _next_hop(cfg.n)) if step + 1 < cfg.n else None
        plan = rl.plan_step(step, cfg.n, cfg.layout, t, k.shape[1], cfg.rule)
        alibi = _step_alibi(slopes, t, k.shape[1], step, cfg)
        acc_out, acc_lse = _run_plan(plan, branch, cfg.axis_name, acc_out, acc_lse, q, q_seg, alibi, *block)
        block = following
    return acc_out.astype(q.dtype), acc_lse.astype(jnp.promote_types(jnp.float32, q.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def ring_core(q, k, v, q_seg, k_seg, slopes, cfg: RingConfig):
    """Ring attention on this device's shards (call inside `shard_map` over `cfg.axis_name`).

    Args:
        q: (B, T, Hq, D) local query shard. k: (B, S, Hk, D), v: (B, S, Hk, Dv) local key/value
            shards. All in `cfg.layout` order.
        q_seg, k_seg: (B, T) / (B, S) int32 segment ids of the shards, or None.
        slopes: (B|1, Hq) float32 ALiBi slopes (this device's batch rows and heads; with
            `cfg.alibi_shift` set), or None. They get a zero gradient.
        cfg: static settings.

    Returns:
        (out (B, T, Hq, Dv) in q's dtype, lse (B, Hq, T) float32; -inf for rows that see nothing).
    """
    return _ring_forward(q, k, v, q_seg, k_seg, slopes, cfg)


def _ring_vjp_fwd(q, k, v, q_seg, k_seg, slopes, cfg):
    out, lse = _ring_forward(q, k, v, q_seg, k_seg, slopes, cfg)
    return (out, lse), (q, k, v, q_seg, k_seg, slopes, out, lse)


def _ring_vjp_bwd(cfg, residuals, cotangents):
    q, k, v, q_seg, k_seg, slopes, out, lse = residuals
    do, dlse = cotangents
    acc = _acc_dtype(q.dtype)
    # Delta = rowsum(dO * O) minus the LSE cotangent (d lse / d logit = P), per row (B, Hq, T).
    delta = jnp.swapaxes(jnp.sum(do.astype(acc) * out.astype(acc), axis=-1), 1, 2) - dlse.astype(acc)
    if cfg.kernel == "triton":
        lse_k, delta_k = lse.astype(jnp.float32), delta.astype(jnp.float32)
    else:
        lse_k, delta_k = lse.astype(acc), delta
    grad = _partial_dtype(q.dtype, cfg)
    dq = jnp.zeros(q.shape, grad)
    dk, dv = jnp.zeros(k.shape, grad), jnp.zeros(v.shape, grad)
    block = (k, v, k_seg)
    branch = functools.partial(_backward_branch, cfg=cfg)
    for step in range(cfg.n):
        following = jax.lax.ppermute(block, cfg.axis_name, _next_hop(cfg.n)) if step + 1 < cfg.n else None
        plan = rl.plan_step(step, cfg.n, cfg.layout, q.shape[1], k.shape[1], cfg.rule)
        alibi = _step_alibi(slopes, q.shape[1], k.shape[1], step, cfg)
        dq, dk, dv = _run_plan(plan, branch, cfg.axis_name, dq, dk, dv, q, q_seg, do, lse_k, delta_k, alibi, *block)
        # dK / dV accumulators travel with their block; after n hops they are home.
        dk, dv = jax.lax.ppermute((dk, dv), cfg.axis_name, _next_hop(cfg.n))
        block = following
    dslopes = None if slopes is None else jnp.zeros_like(slopes)  # ALiBi slopes get no gradient
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dslopes


ring_core.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


# --- the global-array entry point ------------------------------------------------------------------


def _pad_seq(x, length, value=0):
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths, constant_values=value)


def _padding_segments(segment_ids, b, t, s, tp, sp):
    """Segment ids that hide padded keys from real queries: the caller's ids (or zeros), and for
    padded keys an id no real query has."""
    if segment_ids is None:
        q_ids = jnp.zeros((b, t), jnp.int32)
        kv_ids = jnp.zeros((b, s), jnp.int32)
        pad_id = jnp.int32(1)
    else:
        q_ids, kv_ids = (x.astype(jnp.int32) for x in segment_ids)
        top = jnp.max(q_ids)
        pad_id = jnp.where(top < jnp.iinfo(jnp.int32).max, top + 1, jnp.min(q_ids) - 1)
    return _pad_seq(q_ids, tp, pad_id), _pad_seq(kv_ids, sp, pad_id)


def _mesh_axis(mesh: Mesh, axis):
    """`axis` if every name in it is a mesh axis (for batch / head sharding), else None."""
    if axis is None:
        return None
    names = axis if isinstance(axis, tuple) else (axis,)
    kept = tuple(a for a in names if a in mesh.axis_names)
    if not kept:
        return None
    return kept if isinstance(axis, tuple) else kept[0]


def default_kernel(platform: str, alibi: bool = False) -> str:
    """"triton" on GPU (but "xla" for ALiBi, see the module docstring), "xla" on CPU; TPU has no
    ring kernel yet."""
    if platform == "gpu":
        return "xla" if alibi else "triton"
    if platform == "cpu":
        return "xla"
    raise NotImplementedError(f"ring attention has no block kernel for platform {platform!r} yet "
                              "(pass kernel='xla' to run the blockwise XLA kernel there).")


def ring_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    mesh: Mesh,
    axis_name: str = "sp",
    causal: bool = False,
    sliding_window: Optional[tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_aux: Optional[jax.Array] = None,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    scale: Optional[float] = None,
    layout: Optional[str] = None,
    inputs_in_layout: bool = False,
    kernel: Optional[str] = None,
    batch_axis: Any = None,
    head_axis: Optional[str] = None,
    chunk_q: int = 512,
    chunk_k: int = 512,
    return_lse: bool = False,
    accumulation: str = "float32",
    alibi_slopes: Optional[jax.Array] = None,
):
    """Ring attention of global (B, T, Hq, D) / (B, S, Hk, D) / (B, S, Hk, Dv) arrays.

    The arrays are sharded (by this call if they are not already) over `axis_name` along the
    sequence, and over `batch_axis` / `head_axis` when given; the result has the query's sharding.

    Args:
        query, key, value: global arrays in natural sequence order, or in `layout` order with
            `inputs_in_layout=True`.
        mesh: the device mesh; `axis_name` is its ring axis.
        causal: top-left causal mask (needs T == S).
        sliding_window: (left, right) keys visible around each query's position (-1: unbounded);
            needs T == S.
        logits_soft_cap: c in c * tanh(s / c).
        softmax_aux: attention sinks, (Hq,) or (Hq, n) logits that join each row's denominator.
        segment_ids: (q_ids (B, T), kv_ids (B, S)) integer arrays; equal ids attend.
        scale: softmax scale (default 1 / sqrt(D)).
        layout: "zigzag", "striped" or "contiguous"; None: zigzag for causal without a window,
            else contiguous (`ring_layout.default_layout`).
        inputs_in_layout: the inputs already are in `layout` order (e.g. from `ring_layout.to_layout`)
            and the output stays in it; no permutation, no padding (lengths must be multiples of
            `ring_layout.length_multiple`). Otherwise lengths are padded as needed, padded keys are
            masked, and the output is in natural order.
        kernel: "triton" (GPU) or "xla"; None picks by the arrays' platform (`default_kernel`).
        batch_axis, head_axis: optional mesh axes for the batch and head dims.
        chunk_q, chunk_k: tile sizes of the XLA kernel.
        return_lse: also return the (B, Hq, T) float32 log-sum-exp (sinks included).
        accumulation: "float32" (default) keeps the running output and the dQ / dK / dV
            accumulators (dK / dV travel round the ring with their block) in float32; "input"
            keeps them, and the block kernels' partial results, in the inputs' dtype: for 16-bit
            inputs about half the ring's accumulator memory and half its gradient traffic, at the
            price of one rounding to that dtype per ring step.
        alibi_slopes: float (Hq,) or (B, Hq) ALiBi slopes, flash-attn's convention: the logit of
            query i and key j gets -slope * |i + S - T - j| (global positions, after scale and
            soft cap). Replicated over the ring axis (split like the batch and heads when those are
            sharded). No gradient flows to them. Runs the XLA block kernel ("triton" is refused).

    Returns:
        (B, T, Hq, Dv) output, or (output, lse) with `return_lse`.

    Raises:
        ValueError: malformed shapes, an unknown layout or kernel, a mask that needs T == S,
            lengths that do not fit the layout with `inputs_in_layout`, or malformed ALiBi slopes.
    """
    prep = _prepare(query, key, value, mesh=mesh, axis_name=axis_name, causal=causal, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, segment_ids=segment_ids, scale=scale, layout=layout,
                    inputs_in_layout=inputs_in_layout, kernel=kernel, batch_axis=batch_axis, head_axis=head_axis,
                    chunk_q=chunk_q, chunk_k=chunk_k, accumulation=accumulation, alibi_slopes=alibi_slopes)
    t, tp, sp = query.shape[1], prep.tp, prep.sp
    out, lse = _sharded_ring(mesh, prep.cfg, prep.batch, prep.head, not inputs_in_layout)(
        _pad_seq(query, tp), _pad_seq(key, sp), _pad_seq(value, sp), prep.q_seg, prep.k_seg, prep.slopes)
    out, lse = out[:, :t], lse[:, :, :t]
    if softmax_aux is not None:
        out, lse = _with_sinks(out, lse, softmax_aux)
    return (out, lse) if return_lse else out


def ring_attention_backward(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    dout: jax.Array,
    dlse: Optional[jax.Array] = None,
    *,
    mesh: Mesh,
    axis_name: str = "sp",
    causal: bool = False,
    sliding_window: Optional[tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    scale: Optional[float] = None,
    layout: Optional[str] = None,
    inputs_in_layout: bool = False,
    kernel: Optional[str] = None,
    batch_axis: Any = None,
    head_axis: Optional[str] = None,
    chunk_q: int = 512,
    chunk_k: int = 512,
    accumulation: str = "float32",
    alibi_slopes: Optional[jax.Array] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Gradients of `ring_attention` from its saved output and LSE, without recomputing the forward.

    Args:
        query, key, value: the forward's inputs.
        out, lse: the forward's (B, T, Hq, Dv) output and (B, Hq, T) LSE (`return_lse=True`;
            without `softmax_aux`).
        dout: (B, T, Hq, Dv) output cotangent. dlse: (B, Hq, T) LSE cotangent, or None (zero).
        Other arguments: exactly as given to `ring_attention`.

    Returns:
        (dquery, dkey, dvalue) in the inputs' dtypes and shardings.
    """
    prep = _prepare(query, key, value, mesh=mesh, axis_name=axis_name, causal=causal, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, segment_ids=segment_ids, scale=scale, layout=layout,
                    inputs_in_layout=inputs_in_layout, kernel=kernel, batch_axis=batch_axis, head_axis=head_axis,
                    chunk_q=chunk_q, chunk_k=chunk_k, accumulation=accumulation, alibi_slopes=alibi_slopes)
    t, s, tp, sp = query.shape[1], key.shape[1], prep.tp, prep.sp
    if dlse is None:
        dlse = jnp.zeros(lse.shape, lse.dtype)
    # Padded query rows get lse = -inf and zero cotangents: they contribute nothing.
    pad_rows = lambda x, value=0: jnp.pad(x, [(0, 0), (0, 0), (0, tp - t)], constant_values=value)  # noqa: E731
    grads = _sharded_ring_backward(mesh, prep.cfg, prep.batch, prep.head, not inputs_in_layout)(
        _pad_seq(query, tp), _pad_seq(key, sp), _pad_seq(value, sp), prep.q_seg, prep.k_seg, prep.slopes,
        _pad_seq(out, tp), pad_rows(lse, -jnp.inf), _pad_seq(dout, tp), pad_rows(dlse))
    dq, dk, dv = grads
    return dq[:, :t], dk[:, :s], dv[:, :s]


class _Prepared(NamedTuple):
    cfg: RingConfig
    tp: int
    sp: int
    q_seg: Optional[jax.Array]
    k_seg: Optional[jax.Array]
    batch: Any
    head: Any
    slopes: Optional[jax.Array]  # (B, Hq) float32 ALiBi slopes, or None


def use_gspmd_on_gpu(platform: str) -> bool:
    """Switches this process from XLA's Shardy partitioner to GSPMD for a ring on GPU.

    With Shardy (JAX's default) the XLA GPU compiler crashed (segmentation fault in its shardy-xla
    pass) on every ring backward, with either block kernel; GSPMD compiles and runs the same
    program (jax 0.11.2, 2x H200, 2026-11-22; the one-off script `benchmarks/ring_gpu_diagnose.py`,
    removed from the tree, last in ba9d668). The switch is process-wide, so it warns once. Returns whether it switched.
    """
    if platform != "gpu" or not jax.config.jax_use_shardy_partitioner:
        return False
    warnings.warn("ring attention on GPU: switching this process to the GSPMD partitioner "
                  "(jax_use_shardy_partitioner=False); XLA's Shardy pass crashes compiling the ring's "
                  "backward. Set it yourself before the first call to silence this.", RuntimeWarning, stacklevel=3)
    jax.config.update("jax_use_shardy_partitioner", False)
    return True


def _alibi_slopes(alibi_slopes, b: int, hq: int) -> Optional[jax.Array]:
    """Checked ALiBi slopes as a (B, Hq) float32 array (one row per batch row, so they shard like the
    batch), or None."""
    if alibi_slopes is None:
        return None
    shape = tuple(getattr(alibi_slopes, "shape", ()))
    dtype = getattr(alibi_slopes, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or shape not in ((hq,), (b, hq)):
        raise ValueError(f"alibi_slopes: shape {shape} and dtype {dtype or type(alibi_slopes).__name__}; expected a "
                         f"float array of shape (Hq,)=({hq},) or (B, Hq)=({b}, {hq}), one slope per query head.")
    return jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (b, hq))


def _prepare(query, key, value, *, mesh, axis_name, causal, sliding_window, logits_soft_cap, segment_ids, scale,
             layout, inputs_in_layout, kernel, batch_axis, head_axis, chunk_q, chunk_k, accumulation,
             alibi_slopes=None) -> _Prepared:
    """Checks a ring call and derives its static config, padded lengths and segment ids."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r}: expected a jax.sharding.Mesh.")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh {dict(mesh.shape)}; "
                         "name the mesh axis the sequence is sharded over.")
    use_gspmd_on_gpu(mesh.devices.flat[0].platform)
    n = mesh.shape[axis_name]
    b, t, hq, d = query.shape
    s, hk = key.shape[1], key.shape[2]
    if key.shape[0] != b or value.shape[:3] != key.shape[:3] or key.shape[3] != d or hq % hk:
        raise ValueError(f"shapes disagree: query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}; expected (B, T, Hq, D), (B, S, Hk, D), (B, S, Hk, Dv) with Hq % Hk == 0.")
    rule = rl.rule_for(causal, sliding_window)
    if rule != rl.GlobalBand() and t != s:
        raise ValueError(f"causal / sliding_window need equal query and key lengths in ring attention, got T={t}, S={s}.")
    layout = layout if layout is not None else rl.default_layout(causal, sliding_window)
    if layout not in rl.LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {rl.LAYOUTS} or None.")
    slopes = _alibi_slopes(alibi_slopes, b, hq)
    if kernel is None:  # the mesh's devices run the blocks (a traced query knows none of its own)
        kernel = default_kernel(_platform(mesh.devices.flat[0]), alibi=slopes is not None)
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: expected one of {KERNELS} or None.")
    if kernel == "triton" and slopes is not None:
        raise ValueError("kernel='triton' with alibi_slopes: the Triton block kernels measure ALiBi distances from "
                         "positions local to each block; pass kernel='xla' (or None) for ALiBi in ring attention.")
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation={accumulation!r}: expected one of {ACCUMULATIONS}.")
    natural = not inputs_in_layout
    unit = rl.length_multiple(n, layout, natural)
    tp, sp = rl.padded_length(t, n, layout, natural), rl.padded_length(s, n, layout, natural)
    if inputs_in_layout and (tp != t or sp != s):
        raise ValueError(f"inputs_in_layout=True: T={t} and S={s} must be multiples of {unit} for layout={layout!r} "
                         f"on {n} devices (pad them, or pass natural-order inputs).")
    q_seg = k_seg = None
    if tp != t or sp != s:
        # Padded keys sit after every real position: a causal rule already hides them.
        hidden_by_rule = rule.hi is not None and rule.hi <= 0 and t == s
        if segment_ids is not None or not hidden_by_rule:
            q_seg, k_seg = _padding_segments(segment_ids, b, t, s, tp, sp)
    elif segment_ids is not None:
        q_seg, k_seg = (x.astype(jnp.int32) for x in segment_ids)
    cfg = RingConfig(
        axis_name=axis_name, n=n, layout=layout, rule=rule, scale=float(scale if scale is not None else d ** -0.5),
        softcap=None if logits_soft_cap is None else float(logits_soft_cap), kernel=kernel,
        chunk_q=chunk_q, chunk_k=chunk_k, fast_tanh=kernel == "triton" and jnp.dtype(query.dtype).itemsize < 4,
        accumulation=accumulation, alibi_shift=None if slopes is None else s - t,
    )
    return _Prepared(cfg, tp, sp, q_seg, k_seg, _mesh_axis(mesh, batch_axis), _mesh_axis(mesh, head_axis), slopes)



def _platform(x) -> str:
    """"gpu", "cpu" or "tpu": of a jax.Device, or of an array's first device (JAX's default backend
    for a traced array)."""
    try:
        platform = x.platform if isinstance(x, jax.Device) else next(iter(x.devices())).platform
    except (AttributeError, jax.errors.ConcretizationTypeError):
        platform = jax.default_backend()
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def _with_sinks(out, lse, softmax_aux):
    """Adds per-head sink logits to each row's denominator: out * exp(lse - lse_total)."""
    sinks = softmax_aux.astype(lse.dtype)
    sink_lse = sinks if sinks.ndim == 1 else jax.nn.logsumexp(sinks, axis=-1)
    total = jnp.logaddexp(lse, sink_lse[None, :, None])
    factor = jnp.where(jnp.isfinite(lse), jnp.exp(lse - total), 0)
    return (out * jnp.swapaxes(factor, 1, 2)[..., None].astype(out.dtype)).astype(out.dtype), total


@functools.lru_cache(maxsize=64)
def _sharded_ring(mesh: Mesh, cfg: RingConfig, batch, head, permute: bool):
    """The jitted shard_map of the ring over `mesh` (cached per static setting)."""
    n, layout, axis = cfg.n, cfg.layout, cfg.axis_name
    qkv_spec = P(batch, axis, head, None)
    seg_spec = P(batch, axis)

    def body(q, k, v, q_seg, k_seg, slopes):
        if permute:
            q, k, v = (rl.to_layout_sharded(x, axis, n, layout) for x in (q, k, v))
            if q_seg is not None:
                q_seg, k_seg = (rl.to_layout_sharded(x, axis, n, layout) for x in (q_seg, k_seg))
        out, lse = ring_core(q, k, v, q_seg, k_seg, slopes, cfg)
        if permute:
            out = rl.from_layout_sharded(out, axis, n, layout)
            lse = rl.from_layout_sharded(lse, axis, n, layout, axis=2)
        return out, lse

    def run(q, k, v, q_seg, k_seg, slopes):
        segs = (None, None) if q_seg is None else (seg_spec, seg_spec)
        slope_spec = None if slopes is None else P(batch, head)  # replicated over the ring axis
        fn = jax.shard_map(body, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, *segs, slope_spec),
                           out_specs=(qkv_spec, P(batch, head, axis)), check_vma=False)
        return fn(q, k, v, q_seg, k_seg, slopes)

    return jax.jit(run)


@functools.lru_cache(maxsize=64)
def _sharded_ring_backward(mesh: Mesh, cfg: RingConfig, batch, head, permute: bool):
    """The jitted shard_map of the ring backward from saved (out, lse) (cached per static setting)."""
    n, layout, axis = cfg.n, cfg.layout, cfg.axis_name
    qkv_spec, seg_spec, row_spec = P(batch, axis, head, None), P(batch, axis), P(batch, head, axis)

    def body(q, k, v, q_seg, k_seg, slopes, out, lse, do, dlse):
        to = functools.partial(rl.to_layout_sharded, axis_name=axis, n=n, layout=layout)
        back = functools.partial(rl.from_layout_sharded, axis_name=axis, n=n, layout=layout)
        if permute:
            q, k, v, out, do = (to(x) for x in (q, k, v, out, do))
            lse, dlse = (to(x, axis=2) for x in (lse, dlse))
            if q_seg is not None:
                q_seg, k_seg = (to(x) for x in (q_seg, k_seg))
        dq, dk, dv, _, _, _ = _ring_vjp_bwd(cfg, (q, k, v, q_seg, k_seg, slopes, out, lse), (do, dlse))
        if permute:
            dq, dk, dv = (back(x) for x in (dq, dk, dv))
        return dq, dk, dv

    def run(q, k, v, q_seg, k_seg, slopes, out, lse, do, dlse):
        segs = (None, None) if q_seg is None else (seg_spec, seg_spec)
        slope_spec = None if slopes is None else P(batch, head)
        fn = jax.shard_map(body, mesh=mesh,
                           in_specs=(qkv_spec,) * 3 + segs + (slope_spec, qkv_spec, row_spec, qkv_spec, row_spec),
                           out_specs=(qkv_spec,) * 3, check_vma=False)
        return fn(q, k, v, q_seg, k_seg, slopes, out, lse, do, dlse)

    return jax.jit(run)


# --- the registered implementation -----------------------------------------------------------------

_FEATURES = frozenset({"causal", "gqa", "sliding_window", "softcap", "sinks", "segment_ids", "lse", "backward",
                       "alibi"})


def sequence_axis_size(metadata: Optional[AttentionMetadata]) -> int:
    """Size of `metadata.sequence_axis_name` in `metadata.mesh` (0 without a mesh or that axis)."""
    if metadata is None or metadata.mesh is None:
        return 0
    return int(metadata.mesh.shape.get(metadata.sequence_axis_name, 0))


@AttentionRegistry.register
class RingAttn(AttentionImpl):
    """Sequence-parallel ring attention over `metadata.sequence_axis_name`; see the module docstring.

    Needs `metadata.mesh` with that axis. Batch and heads are also sharded over the
    `metadata.partition_axis` batch / head axes that the mesh has. The layout is chosen by
    `ring_layout.default_layout`; use `ring_attention` for explicit layouts and kernels.
    """

    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        features=_FEATURES,
        max_head_dim=None,
    )

    @classmethod
    def get_impl_name(cls) -> str:
        return "ring"

    @classmethod
    def takes_alibi_slopes(cls, inputs: AttentionInputs) -> bool:
        """The ring's XLA block kernel adds ALiBi from global positions (no bias matrix)."""
        return True

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        reasons = []
        if metadata.mesh is None:
            reasons.append("ring needs metadata.mesh with a sequence axis (metadata.sequence_axis_name)")
        elif metadata.sequence_axis_name not in metadata.mesh.axis_names:
            reasons.append(f"sequence_axis_name={metadata.sequence_axis_name!r} is not an axis of the mesh "
                           f"{dict(metadata.mesh.shape)}")
        positional = inputs.features & {"causal", "sliding_window"}
        if positional and inputs.q_len != inputs.kv_len:
            reasons.append(f"{'/'.join(sorted(positional))} needs q_len == kv_len in ring attention, got "
                           f"{inputs.q_len} and {inputs.kv_len}")
        if inputs.platform == "gpu" and "alibi" not in inputs.features:  # ALiBi runs the XLA block kernel
            reasons += missing_gpu_packages()
            if inputs.dtype == "float64":
                reasons.append("dtype float64 not supported by the GPU kernels")
            if max(inputs.head_dim, inputs.value_head_dim) > 256:
                reasons.append(f"head dims up to 256 on GPU, got {max(inputs.head_dim, inputs.value_head_dim)}")
        if metadata.runtime_dtype is not None:
            reasons.append("runtime_dtype is not supported by ring (cast the inputs)")
        return reasons

    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        # Bias, masks, alignment, dropout, weights and varlen are refused by the reasons.
        md = self.metadata
        pa = md.partition_axis
        out, lse = ring_attention(
            *arrays.qkv, mesh=md.mesh, axis_name=md.sequence_axis_name, causal=call.causal,
            sliding_window=call.sliding_window, logits_soft_cap=call.logits_soft_cap,
            softmax_aux=arrays.softmax_aux, segment_ids=arrays.segment_ids,
            scale=call.scale_for(arrays.query.shape[-1]), kernel=None,  # the mesh's devices choose (`default_kernel`)
            batch_axis=pa.batch_axis, head_axis=pa.head_axis, chunk_q=md.blocksize_q, chunk_k=md.blocksize_k,
            return_lse=True, alibi_slopes=arrays.alibi_slopes,
        )
        return AttentionOutput(attention_outputs=out, lse=lse)
