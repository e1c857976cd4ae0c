"""`attention()`: one functional entry point that picks an implementation and runs it."""

from __future__ import annotations

import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput, Layout
from .capabilities import AttentionInputs, CausalAlignment
from .metadata import AttentionMetadata, backend_of, platform_of
from .registry import AttentionRegistry

Implementation = Literal["vanilla", "sdpa", "cudnn", "flash", "flash_attn2", "ring", "decode"]


@functools.lru_cache(maxsize=256)
def _instance(impl_cls: type[AttentionImpl], metadata: AttentionMetadata) -> AttentionImpl:
    return impl_cls(metadata)


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_aux: Optional[jax.Array] = None,
    dropout_rng: Optional[jax.Array] = None,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: Optional[Implementation | str | tuple[str, ...]] = None,
    metadata: Optional[AttentionMetadata] = None,
    layout: Layout = "BTHD",
    segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
    cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
    max_seqlen: Optional[tuple[int, int]] = None,
    alibi_slopes: Optional[jax.Array] = None,
) -> AttentionOutput:
    """Attention on (B, T, Hq, D) / (B, S, Hk, D) / (B, S, Hk, Dv) arrays by a registered implementation.

    Arguments are those of `AttentionImpl.__call__`, plus:
        implementation: a registered name to force, a tuple of names to choose among, or None to
            choose automatically by the platform's priority list (`registry.PRIORITIES`).
        metadata: settings; defaults to `AttentionMetadata()` (scale 1/sqrt(D), no dropout).
        layout: "BTHD", or "BHTD" for (B, H, T, D) query/key/value and output (implementations
            that take it natively avoid the transposes).

    Packing (see `AttentionImpl.__call__` for the full rules):
        segment_ids: (q_segment_ids (B, T), kv_segment_ids (B, S)) integer arrays; query i of batch
            b sees key j only where the ids are equal.
        cu_seqlens: (cu_seqlens_q (N + 1,), cu_seqlens_k (N + 1,)) integer arrays; N sequences
            packed in a batch of 1, causality and windows local to each sequence.
        max_seqlen: static (max_seqlen_q, max_seqlen_k) ints bounding the per-sequence lengths, or
            None; only with `cu_seqlens`.

    alibi_slopes: float (Hq,) or (B, Hq) ALiBi slopes (see `AttentionImpl.__call__`); an
        implementation whose kernels lack ALiBi gets it as an additive bias.

    Returns:
        AttentionOutput; `attention_outputs` has shape (B, T, Hq, Dv).

    Raises:
        ValueError: unknown or unusable forced implementation (with reasons), malformed inputs.
        NotImplementedError: automatic selection found no implementation (with every reason).
    """
    inputs, metadata = call_inputs(
        query, key, value, bias=bias, mask=mask, causal=causal, causal_alignment=causal_alignment,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
        dropout_rng=dropout_rng, return_weights=return_weights, return_lse=return_lse, metadata=metadata,
        layout=layout, segment_ids=segment_ids, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes,
    )
    impl_cls = AttentionRegistry.select(inputs, metadata, implementation)
    return _instance(impl_cls, metadata)(
        query, key, value, bias=bias, mask=mask, causal=causal, causal_alignment=causal_alignment,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
        dropout_rng=dropout_rng, return_weights=return_weights, return_lse=return_lse, layout=layout,
        segment_ids=segment_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, alibi_slopes=alibi_slopes,
    )


def call_inputs(query, key, value, *, bias=None, mask=None, causal: bool = False,
                causal_alignment: CausalAlignment = "top_left", sliding_window=None, logits_soft_cap=None,
                softmax_aux=None, dropout_rng=None, return_weights: bool = False, return_lse: bool = False,
                metadata: Optional[AttentionMetadata] = None, layout: Layout = "BTHD", segment_ids=None,
                cu_seqlens=None, alibi_slopes=None) -> tuple[AttentionInputs, AttentionMetadata]:
    """The signature `attention` selects on, and the metadata with its platform and backend filled in.

    The arrays may be `jax.ShapeDtypeStruct`s (only shapes and dtypes are read) when
    `metadata.platform` is set.
    """
    metadata = metadata if metadata is not None else AttentionMetadata()
    platform = metadata.platform or platform_of(query, key, value)
    backend = metadata.backend or backend_of(platform)
    metadata = metadata.replace(platform=platform, backend=backend)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise ValueError(f"{name}: expected a 4-D ({layout}) array, got shape {tuple(x.shape)}.")
    q_, k_, v_ = query, key, value
    if layout == "BHTD":
        q_, k_, v_ = (jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype) for x in (query, key, value))
    inputs = AttentionInputs.from_arrays(
        q_, k_, v_, platform=platform, backend=backend, bias=bias, mask=mask, causal=causal,
        causal_alignment=causal_alignment, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux, dropout=dropout_rng is not None and metadata.dropout_prob > 0,
        return_weights=return_weights, return_lse=return_lse, segment_ids=segment_ids is not None,
        varlen=cu_seqlens is not None, alibi=alibi_slopes is not None,
    )
    return inputs, metadata


def explain_selection(query, key, value, *, implementation=None, **call) -> tuple[str, str]:
    """(canonical name, reason) of the implementation `attention(query, key, value, implementation=...,
    **call)` would run, by the same selection (`AttentionRegistry.select_with_reason`)."""
    inputs, metadata = call_inputs(query, key, value, **call)
    impl_cls, reason = AttentionRegistry.select_with_reason(inputs, metadata, implementation)
    return impl_cls.canonical_name(), reason


def explain_shapes(q_shape, k_shape, dtype: str, *, implementation=None, **call) -> tuple[str, str]:
    """`explain_selection` for arrays described by their shapes (query `q_shape`, key and value
    `k_shape`) and dtype name ("bfloat16", ...), without creating them."""
    q = jax.ShapeDtypeStruct(tuple(q_shape), jnp.dtype(dtype))
    k = jax.ShapeDtypeStruct(tuple(k_shape), jnp.dtype(dtype))
    return explain_selection(q, k, k, implementation=implementation, **call)
