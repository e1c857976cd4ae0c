"""One attention call as two values: its static spec (`AttentionCall`) and its arrays (`CallArrays`).

`attention()` and `AttentionImpl.__call__` take a dozen keyword arguments; `build_call` turns them
into these two values once, and everything after (validation, selection, the implementations'
`compute`) reads them instead of re-spelling the keywords.

`AttentionCall` is frozen and hashable (when its soft cap is a Python number): equal specs are
equal values, so it can key caches and sit in traces. `CallArrays` is a pytree (None where an
array is absent), in the call's layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp

from .kernels.flash_plan import FlashConfig
from .metadata import AttentionMetadata
from .visibility import CausalAlignment, Visibility

Layout = Literal["BTHD", "BHTD"]
LAYOUTS = ("BTHD", "BHTD")
#: Backends a call can name; None: the platform-independent path (`forward_native`).
CALL_BACKENDS = (None, "cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The static spec of one attention call: everything but its arrays.

    Attributes:
        visibility: which keys each query sees from positions (causality, alignment, window).
        logits_soft_cap: c in c * tanh(logits / c), or None.
        scale: multiplier of q·k; None means 1/sqrt(D) (`scale_for`).
        dropout_prob: probability of dropping an attention weight (with a dropout key).
        return_lse: return the (B, Hq, T) log-sum-exp of each row.
        return_weights: return the (B, Hq, T, S) probabilities.
        layout: "BTHD" or "BHTD", the layout of the call's arrays and output.
        max_seqlen: (max_seqlen_q, max_seqlen_k) bounding packed sequences (with cu_seqlens), or None.
        backend: the backend whose kernels run the call ("cpu", "cuda", "rocm", "tpu"), or None for
            the platform-independent path. `attention()` and `AttentionImpl.__call__` set the
            backend of the platform the arrays live on (or `metadata.backend`).
    """

    # A factory, not a shared instance as the default: torch.compile (torch 2.11's Dynamo) cannot
    # wrap an instance held in the generated __init__'s defaults when it traces a construction.
    visibility: Visibility = dataclasses.field(default_factory=Visibility)
    logits_soft_cap: Optional[float] = None
    scale: Optional[float] = None
    dropout_prob: float = 0.0
    return_lse: bool = False
    return_weights: bool = False
    layout: Layout = "BTHD"
    max_seqlen: Optional[tuple[int, int]] = None
    backend: Optional[str] = None

    def __post_init__(self):
        if not isinstance(self.visibility, Visibility):
            raise TypeError(f"visibility={self.visibility!r}: expected a Visibility (Visibility.of(causal, ...)).")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}: expected 'BTHD' or 'BHTD'.")
        if not 0.0 <= self.dropout_prob < 1.0:
            raise ValueError(f"dropout_prob={self.dropout_prob!r}: expected a probability in [0, 1).")
        if self.backend not in CALL_BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {CALL_BACKENDS} (None: forward_native).")
        if isinstance(self.max_seqlen, list):  # a list from a config is the same pair, made hashable
            object.__setattr__(self, "max_seqlen", tuple(self.max_seqlen))

    def replace(self, **changes: Any) -> "AttentionCall":
        return dataclasses.replace(self, **changes)

    @property
    def causal(self) -> bool:
        return self.visibility.causal

    @property
    def causal_alignment(self) -> CausalAlignment:
        return self.visibility.alignment

    @property
    def sliding_window(self) -> Optional[tuple[int, int]]:
        """The window as `attention()` takes it: None when there is none."""
        return self.visibility.window if self.visibility.windowed else None

    def scale_for(self, head_dim: int) -> float:
        return float(self.scale) if self.scale is not None else head_dim**-0.5

    def flash_config(self, q_len, kv_len, head_dim, *, packed: bool = False) -> FlashConfig:
        """The flash kernels' settings for this call on L = q_len queries, S = kv_len keys and head
        dim D = head_dim: what both launchers (jax-triton and torch) give the kernels.

        Args:
            packed: the call packs sequences back to back (cu_seqlens). The kernels' grids then
                cover `max_seqlen`, or the packed lengths (q_len, kv_len) when it is None, and a
                bottom-right alignment applies per sequence.

        The dropout probability is the call's: a caller without the randomness for it (no dropout
        key) passes a call without dropout. The hardware tanh of the soft cap is PTX, so NVIDIA
        only (backend "cuda"; the kernels use it on 16-bit inputs only).
        """
        varlen = None
        if packed:
            bounds = self.max_seqlen if self.max_seqlen is not None else (q_len, kv_len)
            varlen = (int(bounds[0]), int(bounds[1]))
        cap = self.logits_soft_cap
        return FlashConfig(
            scale=self.scale_for(head_dim),
            **self.visibility.flash_settings(q_len, kv_len, varlen=packed),
            softcap=None if cap is None else float(cap),
            layout=self.layout,
            dropout_p=float(self.dropout_prob),
            varlen=varlen,
            fast_tanh=self.backend == "cuda",
        )

    @property
    def seq_axis(self) -> int:
        """The axis of T (and S) in the call's arrays."""
        return 1 if self.layout == "BTHD" else 2

    def inputs(self, arrays: "CallArrays", platform: str, backend: str, *, backward: bool = False):
        """The selection signature (`AttentionInputs`) of this call on `arrays`."""
        from .capabilities import AttentionInputs  # capabilities imports this module

        return AttentionInputs.from_call(self, arrays, platform=platform, backend=backend, backward=backward)

    def forward_keywords(self, arrays: "CallArrays", *, layout: bool, alibi: bool) -> dict[str, Any]:
        """The keyword arguments of a `forward_*` method for this call (an EasyDeL-style override):
        `layout=` only to an implementation that takes several layouts, `alibi_slopes=` only to one
        whose kernels take them (as `__call__` always passed them)."""
        keywords = dict(
            bias=arrays.bias, mask=arrays.mask, causal=self.causal, causal_alignment=self.causal_alignment,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, softmax_aux=arrays.softmax_aux,
            dropout_rng=arrays.dropout_rng, return_weights=self.return_weights, segment_ids=arrays.segment_ids,
            cu_seqlens=arrays.cu_seqlens, max_seqlen=self.max_seqlen,
        )
        if layout:
            keywords["layout"] = self.layout
        if alibi:
            keywords["alibi_slopes"] = arrays.alibi_slopes
        return keywords


def _swap(x: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if x is None else jnp.swapaxes(x, 1, 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CallArrays:
    """The arrays of one attention call (None where absent), in the call's layout.

    query (B, T, Hq, D), key (B, S, Hk, D), value (B, S, Hk, Dv) in "BTHD" ((B, H, T, D) in
    "BHTD"); bias / mask broadcastable to (B, Hq, T, S); softmax_aux (Hq,) or (Hq, n) sink logits;
    dropout_rng a PRNG key; segment_ids (q (B, T), kv (B, S)); cu_seqlens (cu_q, cu_k); alibi_slopes
    (Hq,) or (B, Hq). See `AttentionImpl.__call__` for their meaning.
    """

    query: Any
    key: Any
    value: Any
    bias: Any = None
    mask: Any = None
    softmax_aux: Any = None
    dropout_rng: Any = None
    segment_ids: Any = None
    cu_seqlens: Any = None
    alibi_slopes: Any = None

    def replace(self, **changes: Any) -> "CallArrays":
        return dataclasses.replace(self, **changes)

    @property
    def qkv(self) -> tuple[Any, Any, Any]:
        return self.query, self.key, self.value

    def swapped(self) -> "CallArrays":
        """query, key and value with their T and H axes swapped (the other layout); the rest as is."""
        return self.replace(query=_swap(self.query), key=_swap(self.key), value=_swap(self.value))

    def bthd_shapes(self, layout: Layout) -> tuple[Any, Any, Any]:
        """query, key and value described in (B, T, H, D) terms (`jax.ShapeDtypeStruct`s for "BHTD")."""
        if layout == "BTHD":
            return self.qkv
        return tuple(jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype)
                     for x in self.qkv)


def build_call(
    query: Any,
    key: Any,
    value: Any,
    *,
    metadata: AttentionMetadata,
    backend: Optional[str] = None,
    bias: Any = None,
    mask: Any = None,
    causal: bool = False,
    causal_alignment: CausalAlignment = "top_left",
    sliding_window: Optional[tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_aux: Any = None,
    dropout_rng: Any = None,
    return_weights: bool = False,
    return_lse: bool = False,
    layout: Layout = "BTHD",
    segment_ids: Any = None,
    cu_seqlens: Any = None,
    max_seqlen: Optional[tuple[int, int]] = None,
    alibi_slopes: Any = None,
) -> tuple[AttentionCall, CallArrays]:
    """(call, arrays) from `attention()`'s / `AttentionImpl.__call__`'s keyword arguments; scale and
    dropout probability from `metadata` (the scale resolved against the query's head dim).

    Checks the static arguments (layout, alignment, window: errors name them); the arrays are
    checked by `validation.check_call`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected 'BTHD' or 'BHTD'.")
    head_dim = query.shape[-1] if len(getattr(query, "shape", ())) else None
    call = AttentionCall(
        visibility=Visibility.of(causal, causal_alignment, sliding_window),
        logits_soft_cap=logits_soft_cap,
        scale=metadata.scale_for(head_dim) if head_dim else metadata.softmax_scale,
        dropout_prob=float(metadata.dropout_prob),
        return_lse=bool(return_lse),
        return_weights=bool(return_weights),
        layout=layout,
        max_seqlen=tuple(max_seqlen) if isinstance(max_seqlen, (tuple, list)) else max_seqlen,
        backend=backend,
    )
    arrays = CallArrays(query, key, value, bias=bias, mask=mask, softmax_aux=softmax_aux, dropout_rng=dropout_rng,
                        segment_ids=segment_ids, cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes)
    return call, arrays
