"""`attention()`: one functional entry point that picks an implementation and runs it."""

from __future__ import annotations

import functools
from typing import Literal, Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput, Layout
from .call import AttentionCall, CallArrays, build_call
from .capabilities import AttentionInputs, CausalAlignment
from .metadata import AttentionMetadata, backend_of, platform_of
from .registry import AttentionRegistry
from .validation import check_call, check_rank

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
    metadata = _resolved(metadata, query, key, value)
    call, arrays = build_call(
        query, key, value, metadata=metadata, backend=metadata.backend, bias=bias, mask=mask, causal=causal,
        causal_alignment=causal_alignment, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux, dropout_rng=dropout_rng, return_weights=return_weights, return_lse=return_lse,
        layout=layout, segment_ids=segment_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        alibi_slopes=alibi_slopes,
    )
    return run_call(call, arrays, metadata, implementation)


def run_call(call: AttentionCall, arrays: CallArrays, metadata: Optional[AttentionMetadata] = None,
             implementation: Optional[Implementation | str | tuple[str, ...]] = None) -> AttentionOutput:
    """`attention()` on a built call: checks the arrays once, selects, and runs the selected
    implementation on the checked call. The call's scale and dropout probability are the ones
    used; `metadata` gives the rest (platform, dtypes, mesh, block sizes). A call without a backend
    runs on that of `metadata`, else of the platform the arrays live on."""
    metadata = _resolved(metadata, *arrays.qkv)
    call = call if call.backend is not None else call.replace(backend=metadata.backend)
    check_call(call, arrays)
    inputs = call.inputs(arrays, metadata.platform, metadata.backend)
    impl_cls = AttentionRegistry.select(inputs, metadata, implementation)
    return _instance(impl_cls, metadata).run(call, arrays, inputs)


def _resolved(metadata: Optional[AttentionMetadata], *arrays) -> AttentionMetadata:
    """`metadata` (default `AttentionMetadata()`) with its platform and backend filled in."""
    metadata = metadata if metadata is not None else AttentionMetadata()
    if metadata.platform is not None and metadata.backend is not None:
        return metadata
    platform = metadata.platform or platform_of(*arrays)
    return metadata.replace(platform=platform, backend=metadata.backend or backend_of(platform))


def call_inputs(query, key, value, *, metadata: Optional[AttentionMetadata] = None, **call_keywords
                ) -> tuple[AttentionInputs, AttentionMetadata]:
    """The signature `attention` selects on, and the metadata with its platform and backend filled in.

    `call_keywords` are `attention()`'s (bias, mask, causal, ..., layout, alibi_slopes; unknown names
    raise). The arrays may be `jax.ShapeDtypeStruct`s (only shapes and dtypes are read) when
    `metadata.platform` is set.
    """
    metadata = _resolved(metadata, query, key, value)
    call, arrays = build_call(query, key, value, metadata=metadata, backend=metadata.backend, **call_keywords)
    check_rank(arrays, call.layout)
    return call.inputs(arrays, metadata.platform, metadata.backend), metadata


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
