"""`vanilla`: the XLA einsum reference implementation, with every feature.

It materialises the (B, Hq, T, S) logits, so it is the correctness reference rather than the fast
path. GQA is native: queries are grouped over each KV head, K/V are never repeated.
Rows whose keys are all masked give 0 (as torch's math backend does).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .capabilities import ALL_FLOAT_DTYPES, FEATURES, Capabilities, CausalAlignment
from .masks import combine_masks, positional_mask, segment_mask, varlen_mask, varlen_rows
from .registry import AttentionRegistry
from .sharding import run_sharded


def reference_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    scale: float,
    softmax_dtype: jnp.dtype,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_aux: Optional[jax.Array] = None,
    dropout_rng: Optional[jax.Array] = None,
    dropout_prob: float = 0.0,
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Plain attention; returns the (B, T, Hq, Dv) output, the (B, Hq, T, S) probabilities before
    dropout and the (B, Hq, T) log-sum-exp of the logits (sinks included, -inf for empty rows).

    Arguments as in `AttentionImpl.__call__`; `scale` multiplies q·k, logits and softmax are computed
    in `softmax_dtype`. With `cu_seqlens` the causal/window rule applies per packed sequence
    (`masks.varlen_mask`) instead of over the whole (T, S) grid, and padding rows (outside
    [cu_q[0], cu_q[N])) have LSE -inf even with sinks.
    """
    b, t, hq, d = query.shape
    s, hk = key.shape[1], key.shape[2]
    groups = hq // hk
    # Products are taken in the softmax dtype: exact for bf16/fp16 operands, and runnable on every
    # backend (XLA:CPU has no bf16 x bf16 -> f32 dot).
    q = query.reshape(b, t, hk, groups, d).astype(softmax_dtype)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key.astype(softmax_dtype))
    logits = logits.reshape(b, hq, t, s) * jnp.asarray(scale, softmax_dtype)
    if logits_soft_cap is not None:
        cap = jnp.asarray(logits_soft_cap, softmax_dtype)
        logits = cap * jnp.tanh(logits / cap)
    if bias is not None:
        logits = logits + bias.astype(softmax_dtype)
    visible = combine_masks(
        mask, _packing_or_positional_mask(t, s, causal, causal_alignment, sliding_window, segment_ids, cu_seqlens)
    )
    if visible is not None:
        logits = jnp.where(visible, logits, -jnp.inf)

    row_max = jnp.max(logits, axis=-1, keepdims=True)
    if softmax_aux is not None:
        sinks = softmax_aux.astype(softmax_dtype).reshape(1, hq, 1, -1)
        row_max = jnp.maximum(row_max, jnp.max(sinks, axis=-1, keepdims=True))
    # Rows with nothing visible have max -inf: shift by 0 instead so they give exp(-inf) = 0.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    exp = jnp.exp(logits - row_max)
    denom = jnp.sum(exp, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denom = denom + jnp.sum(jnp.exp(sinks - row_max), axis=-1, keepdims=True)
    probs = exp / jnp.where(denom == 0, 1, denom)
    lse = (jnp.log(denom) + row_max)[..., 0]  # log(0) = -inf for rows with nothing visible
    if cu_seqlens is not None:  # padding rows belong to no sequence: no sink either
        lse = jnp.where(varlen_rows(cu_seqlens[0], t), lse, -jnp.inf)

    weights = probs
    if dropout_rng is not None and dropout_prob > 0:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_prob, probs.shape)
        weights = jnp.where(keep, probs / (1.0 - dropout_prob), 0)
    weights = weights.reshape(b, hk, groups, t, s)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, value.astype(softmax_dtype))
    return out.reshape(b, t, hq, value.shape[-1]).astype(query.dtype), probs, lse


def _packing_or_positional_mask(t, s, causal, causal_alignment, sliding_window, segment_ids, cu_seqlens):
    """The visibility rule from positions, combined with segment ids, or per varlen sequence."""
    if cu_seqlens is not None:
        return varlen_mask(*cu_seqlens, t, s, causal=causal, causal_alignment=causal_alignment,
                           sliding_window=sliding_window)
    positional = positional_mask(t, s, causal=causal, causal_alignment=causal_alignment, sliding_window=sliding_window)
    return combine_masks(positional, None if segment_ids is None else segment_mask(*segment_ids))


@AttentionRegistry.register
class VanillaAttn(AttentionImpl):
    """Reference attention on every platform, with every feature (segment ids and varlen included)."""

    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu", "tpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        features=FEATURES,
    )

    @classmethod
    def get_impl_name(cls) -> str:
        return "vanilla"

    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        # The reference materialises every (T, S) logit: no grid for max_seqlen to bound.
        md = self.metadata
        dtype = jnp.dtype(md.runtime_dtype) if md.runtime_dtype else arrays.query.dtype
        query, key, value = (x.astype(dtype) for x in arrays.qkv)
        rule = call.visibility

        def attend(q, k, v, bias, mask, softmax_aux, dropout_rng, segment_ids, cu_seqlens):
            return reference_attention(
                q, k, v, scale=call.scale_for(q.shape[-1]), softmax_dtype=md.softmax_dtype_for(q.dtype),
                bias=bias, mask=mask, causal=rule.causal, causal_alignment=rule.alignment,
                sliding_window=call.sliding_window, logits_soft_cap=call.logits_soft_cap, softmax_aux=softmax_aux,
                dropout_rng=dropout_rng, dropout_prob=call.dropout_prob, segment_ids=segment_ids,
                cu_seqlens=cu_seqlens,
            )

        out, probs, lse = run_sharded(
            attend, md, query, key, value, bias=arrays.bias, mask=arrays.mask, softmax_aux=arrays.softmax_aux,
            dropout_rng=arrays.dropout_rng, segment_ids=arrays.segment_ids, cu_seqlens=arrays.cu_seqlens,
            with_weights=True,
        )
        return AttentionOutput(attention_outputs=out, attention_weights=probs if call.return_weights else None, lse=lse)
