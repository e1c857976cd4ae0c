"""`AttentionImpl`: the base every attention implementation derives from.

An implementation declares `capabilities` (and may add `extra_reasons`), provides
`forward_native` and optionally per-platform variants. `__call__` checks support, then dispatches by
the platform the inputs live on:

    tpu -> forward_tpu      gpu/cuda -> forward_cuda      gpu/rocm -> forward_rocm      cpu -> forward_cpu

The defaults of the per-platform methods delegate to `forward_native`.

Tensors use the (B, T, H, D) layout ("BTHD"); bias and masks are broadcastable to (B, Hq, T, S).
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Callable, ClassVar, Literal, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .capabilities import AttentionInputs, Capabilities, CausalAlignment
from .masks import alibi_bias
from .metadata import AttentionMetadata, Mode, backend_of, platform_of
from .visibility import Visibility

Layout = Literal["BTHD", "BHTD"]

#: The most new queries per sequence that count as decoding (one token, or a few drafted tokens of
#: speculative decoding) when they attend to a longer key/value cache.
DECODE_MAX_QUERY_LEN = 16


def mode_for(q_len: int, kv_len: Optional[int] = None) -> Mode:
    """"__autoregressive__" for one query, or for 2..DECODE_MAX_QUERY_LEN queries against a longer
    key/value cache (when `kv_len` is given); "__train__" otherwise."""
    if q_len == 1 or (kv_len is not None and q_len <= DECODE_MAX_QUERY_LEN and kv_len > q_len):
        return "__autoregressive__"
    return "__train__"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionOutput:
    """Result of an attention call.

    Attributes:
        attention_outputs: (B, T, Hq, Dv) attention result.
        attention_weights: (B, Hq, T, S) probabilities, when requested and supported.
        lse: (B, Hq, T) log-sum-exp of each row's logits, when requested and supported.
    """

    attention_outputs: Optional[jax.Array] = None
    attention_weights: Optional[jax.Array] = None
    lse: Optional[jax.Array] = None

    def replace(self, **changes: Any) -> "AttentionOutput":
        return dataclasses.replace(self, **changes)


class AttentionImpl(abc.ABC):
    """Base class of attention implementations; see the module docstring."""

    capabilities: ClassVar[Capabilities]
    #: Layouts `forward_*` accept natively; others are transposed to (B, T, H, D) around the call.
    layouts: ClassVar[frozenset] = frozenset({"BTHD"})

    def __init__(self, metadata: AttentionMetadata):
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata={metadata!r}: expected an AttentionMetadata.")
        self.metadata = metadata

    # --- identity -------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def get_impl_name(cls) -> str | tuple[str, ...]:
        """The registered name, or a tuple of aliases (the first is canonical)."""

    def get_impl_metadata(self) -> AttentionMetadata:
        return self.metadata

    @classmethod
    def canonical_name(cls) -> str:
        name = cls.get_impl_name()
        return name if isinstance(name, str) else name[0]

    # --- support --------------------------------------------------------------
    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        """Reasons beyond the declared capabilities (override for implementation rules)."""
        return []

    @classmethod
    def takes_alibi_slopes(cls, inputs: AttentionInputs) -> bool:
        """Whether the kernels that run `inputs` apply ALiBi slopes themselves (then `forward_*` gets
        `alibi_slopes=`). Otherwise `__call__` adds the ALiBi bias (`masks.alibi_bias`) to `bias`,
        so the call needs the "bias" feature instead of "alibi"."""
        return False

    @classmethod
    def _alibi_as_bias(cls, inputs: AttentionInputs) -> tuple[AttentionInputs, list[str]]:
        """`inputs` as this implementation runs them (ALiBi as a bias where its kernels lack it), and
        the reason it cannot run ALiBi at all (no bias either)."""
        if "alibi" not in inputs.features or cls.takes_alibi_slopes(inputs):
            return inputs, []
        features = inputs.features - {"alibi"}
        if "bias" not in cls.capabilities.features:
            return dataclasses.replace(inputs, features=features), [
                "feature 'alibi' not supported (its kernels take no ALiBi slopes and no additive bias to carry them)"]
        return dataclasses.replace(inputs, features=features | {"bias"}), []

    @classmethod
    def not_supported_reasons(
        cls, inputs: AttentionInputs, metadata: Optional[AttentionMetadata] = None
    ) -> list[str]:
        """Every reason this implementation cannot run `inputs` (empty when it can)."""
        metadata = metadata if metadata is not None else AttentionMetadata()
        inputs, reasons = cls._alibi_as_bias(inputs)
        reasons = reasons + cls.capabilities.reasons(inputs)
        if inputs.num_q_heads % inputs.num_kv_heads:
            reasons.append(f"num_q_heads={inputs.num_q_heads} is not a multiple of num_kv_heads={inputs.num_kv_heads}")
        if metadata.mesh is not None:
            reasons += _mesh_reasons(inputs, metadata)
        return reasons + cls.extra_reasons(inputs, metadata)

    # --- helpers --------------------------------------------------------------
    def current_backend(self) -> Literal["tpu", "gpu", "cpu"]:
        """The JAX default backend, as "tpu", "gpu" or "cpu"."""
        backend = jax.default_backend()
        return "gpu" if backend in ("gpu", "cuda", "rocm") else backend

    def get_mode(self, q: jax.Array, BTHD: bool = True, kv_len: Optional[int] = None) -> Mode:
        """"__autoregressive__" when the query length is 1 (or, given the key/value length, a few
        queries against a longer cache: `mode_for`), else "__train__"."""
        q_len = q.shape[1] if BTHD else q.shape[2]
        return mode_for(q_len, kv_len)

    @staticmethod
    def repeat_kv_heads(k: jax.Array, v: jax.Array, num_reps: int) -> tuple[jax.Array, jax.Array]:
        """Repeats (B, S, Hk, D) key/value heads `num_reps` times along the head axis."""
        return jnp.repeat(k, num_reps, axis=2), jnp.repeat(v, num_reps, axis=2)

    @staticmethod
    def create_stable_sharding(
        state_ps: Optional[PartitionSpec] = None,
        preserved_indices: Optional[list[int]] = None,
        clone_ps: Optional[PartitionSpec] = None,
        dep: Any = True,
        tensor: Optional[jax.Array] = None,
    ) -> Optional[PartitionSpec]:
        """A PartitionSpec keeping only `preserved_indices` of `state_ps` (or of `clone_ps`).

        Returns None when `dep` is None or `state_ps` is None; `state_ps` itself when no indices
        are given. With `tensor`, axes of size 1 are never partitioned.
        """
        if dep is None or state_ps is None:
            return None
        if preserved_indices is None:
            return state_ps
        source = clone_ps if clone_ps is not None else state_ps
        spec = [None] * len(state_ps)
        for i in preserved_indices:
            if tensor is None or tensor.shape[i] != 1:
                spec[i] = source[i]
        return PartitionSpec(*spec)

    # --- dispatch -------------------------------------------------------------
    def __call__(
        self,
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
        init_bias: Optional[Callable[[], jax.Array]] = None,
        layout: Layout = "BTHD",
        segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
        cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
        max_seqlen: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[jax.Array] = None,
    ) -> AttentionOutput:
        """Runs attention on (B, T, Hq, D) query, (B, S, Hk, D) key and (B, S, Hk, Dv) value.

        Args:
            query: (B, T, Hq, D).
            key: (B, S, Hk, D).
            value: (B, S, Hk, Dv).
            bias: additive float bias broadcastable to (B, Hq, T, S).
            mask: bool mask broadcastable to (B, Hq, T, S); True = attend.
            causal: apply a causal mask.
            causal_alignment: "top_left" (query i sees keys j <= i, torch's `is_causal`) or
                "bottom_right" (query i sees keys j <= i + S - T, KV-cache style).
            sliding_window: (left, right) keys visible around each query's diagonal position;
                -1 means unbounded on that side.
            logits_soft_cap: c in c * tanh(logits / c), applied to the scaled logits.
            softmax_aux: attention sink logits, shape (Hq,) or (Hq, n_sinks).
            dropout_rng: PRNG key; with `metadata.dropout_prob > 0` enables dropout.
            return_weights: also return the (B, Hq, T, S) attention probabilities.
            return_lse: also return the (B, Hq, T) float32 log-sum-exp of each row's logits
                (sinks included; -inf for a row with nothing visible).
            init_bias: called for a bias when neither `bias` nor `mask` is given.
            layout: "BTHD" as above, or "BHTD" for (B, H, T, D) query/key/value and output.
            segment_ids: (q_segment_ids (B, T), kv_segment_ids (B, S)) integer arrays: query i of
                batch b sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j], on top of
                causality, window and mask (positions stay global). Any integers, not necessarily
                sorted or contiguous; implementations receive them as int32.
            cu_seqlens: (cu_seqlens_q (N + 1,), cu_seqlens_k (N + 1,)) integer cumulative lengths of
                N sequences packed back to back in a batch of 1 (query (1, Tq, Hq, D), key/value
                (1, Tk, Hk, D|Dv)): sequence n holds queries [cu_q[n], cu_q[n + 1]) and keys
                [cu_k[n], cu_k[n + 1]), and a query sees only keys of its own sequence. Causality
                and windows use positions local to each sequence; "bottom_right" uses the diagonal
                offset len_k(n) - len_q(n) of each sequence. Query rows at or beyond cu_q[N]
                output 0 (LSE -inf). Implementations receive them as int32. Exclusive with
                `segment_ids`.
            max_seqlen: (max_seqlen_q, max_seqlen_k) static Python ints >= 1 bounding the
                per-sequence lengths (kernels size their grids by them); None: unknown (Tq, Tk
                bound them). Only with `cu_seqlens`.
            alibi_slopes: float (Hq,) or (B, Hq) ALiBi slopes (B = the number of sequences with
                `cu_seqlens`), flash-attn's convention: -slope * |i + S - T - j| is added to the
                logit of query i and key j after scale and soft cap, the distance aligned
                bottom-right whatever `causal_alignment` (positions and lengths of each sequence
                with `cu_seqlens`). No gradient flows to the slopes. See `masks.alibi_bias`.

        Returns:
            AttentionOutput with `attention_outputs` of shape (B, T, Hq, Dv).

        Raises:
            ValueError: when this implementation cannot run the call (lists every reason), or the
                inputs are malformed.
        """
        if bias is None and mask is None and init_bias is not None:
            bias = init_bias()
        if layout not in ("BTHD", "BHTD"):
            raise ValueError(f"layout={layout!r}: expected 'BTHD' or 'BHTD'.")
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.ndim != 4:
                raise ValueError(f"{name}: expected a 4-D ({layout}) array, got shape {tuple(x.shape)}.")
        if layout != "BTHD" and layout not in self.layouts:
            swap = functools.partial(jnp.swapaxes, axis1=1, axis2=2)
            out = self(
                swap(query), swap(key), swap(value), bias=bias, mask=mask, causal=causal,
                causal_alignment=causal_alignment, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                softmax_aux=softmax_aux, dropout_rng=dropout_rng, return_weights=return_weights,
                return_lse=return_lse, segment_ids=segment_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                alibi_slopes=alibi_slopes,
            )
            return out.replace(attention_outputs=swap(out.attention_outputs))
        native = (query, key, value)
        if layout == "BHTD":  # describe the call in (B, T, H, D) terms
            query, key, value = (jax.ShapeDtypeStruct((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), x.dtype) for x in native)
        _check_shapes(query, key, value, bias, mask, softmax_aux, causal_alignment, sliding_window)
        _check_packing(query, key, segment_ids, cu_seqlens, max_seqlen)
        _check_alibi(alibi_slopes, query, cu_seqlens)
        segment_ids, cu_seqlens = _as_int32(segment_ids), _as_int32(cu_seqlens)
        platform = self.metadata.platform or platform_of(query, key, value)
        backend = self.metadata.backend or backend_of(platform)
        inputs = AttentionInputs.from_arrays(
            query, key, value, platform=platform, backend=backend, bias=bias, mask=mask, causal=causal,
            causal_alignment=causal_alignment, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
            dropout=dropout_rng is not None and self.metadata.dropout_prob > 0, return_weights=return_weights,
            return_lse=return_lse, segment_ids=segment_ids is not None, varlen=cu_seqlens is not None,
            alibi=alibi_slopes is not None,
        )
        reasons = self.not_supported_reasons(inputs, self.metadata)
        if reasons:
            raise ValueError(
                f"implementation {self.canonical_name()!r} cannot run this call: " + "; ".join(reasons)
            )
        extra = {}
        if alibi_slopes is not None and self.takes_alibi_slopes(inputs):
            extra["alibi_slopes"] = alibi_slopes
        elif alibi_slopes is not None:
            alibi = alibi_bias(alibi_slopes, query.shape[1], key.shape[1], cu_seqlens)
            bias = alibi if bias is None else bias + alibi
        forward = {
            "tpu": self.forward_tpu,
            "cuda": self.forward_cuda,
            "rocm": self.forward_rocm,
            "cpu": self.forward_cpu,
        }.get(backend, self.forward_gpu if platform == "gpu" else self.forward_native)
        out = forward(
            *native, bias=bias, mask=mask, causal=causal, causal_alignment=causal_alignment,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
            dropout_rng=dropout_rng if self.metadata.dropout_prob > 0 else None,
            return_weights=return_weights, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
            max_seqlen=None if max_seqlen is None else tuple(max_seqlen),
            **({"layout": layout} if len(self.layouts) > 1 else {}), **extra,
        )
        return out if return_lse else out.replace(lse=None)

    @abc.abstractmethod
    def forward_native(
        self,
        query: jax.Array,
        key: jax.Array,
        value: jax.Array,
        *,
        bias: Optional[jax.Array],
        mask: Optional[jax.Array],
        causal: bool,
        causal_alignment: CausalAlignment,
        sliding_window: Optional[tuple[int, int]],
        logits_soft_cap: Optional[float],
        softmax_aux: Optional[jax.Array],
        dropout_rng: Optional[jax.Array],
        return_weights: bool,
        segment_ids: Optional[tuple[jax.Array, jax.Array]] = None,
        cu_seqlens: Optional[tuple[jax.Array, jax.Array]] = None,
        max_seqlen: Optional[tuple[int, int]] = None,
    ) -> AttentionOutput:
        """Platform-independent forward; arguments as in `__call__` (segment ids and cu_seqlens
        as int32 arrays, given only when the capabilities declare "segment_ids" / "varlen")."""

    def forward_cpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_tpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_gpu(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_cuda(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)

    def forward_rocm(self, *args: Any, **kwargs: Any) -> AttentionOutput:
        return self.forward_native(*args, **kwargs)


def _mesh_reasons(inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
    mesh, pa = metadata.mesh, metadata.partition_axis
    reasons = []

    def size(axis):
        axes = axis if isinstance(axis, tuple) else (axis,)
        n = 1
        for a in axes:
            if a is not None and a in mesh.shape:
                n *= mesh.shape[a]
        return n

    nb, nh = size(pa.batch_axis), size(pa.head_axis)
    if inputs.batch % nb:
        reasons.append(f"batch={inputs.batch} is not divisible by mesh batch axis size {nb}")
    if inputs.num_kv_heads % nh:
        reasons.append(f"num_kv_heads={inputs.num_kv_heads} is not divisible by mesh head axis size {nh}")
    return reasons


def _check_shapes(query, key, value, bias, mask, softmax_aux, causal_alignment, sliding_window):
    b, t, hq, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {b}, key {key.shape[0]}, value {value.shape[0]}.")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on (S, Hk).")
    if key.shape[3] != d:
        raise ValueError(f"key head dim {key.shape[3]} != query head dim {d}.")
    if hq % key.shape[2]:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={key.shape[2]}.")
    full = (b, hq, t, key.shape[1])
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        if x.ndim > 4 or any(a not in (1, f) for a, f in zip(x.shape[::-1], full[::-1])):
            raise ValueError(f"{name}: shape {tuple(x.shape)} is not broadcastable to (B, Hq, T, S)={full}.")
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask: expected dtype bool, got {mask.dtype}; pass float masks as `bias`.")
    if softmax_aux is not None and (softmax_aux.ndim not in (1, 2) or softmax_aux.shape[0] != hq):
        raise ValueError(f"softmax_aux: expected shape (Hq,) or (Hq, n) with Hq={hq}, got {tuple(softmax_aux.shape)}.")
    Visibility.of(False, causal_alignment, sliding_window)  # raises naming the bad argument


def _check_alibi(slopes, query, cu_seqlens) -> None:
    """ALiBi slopes: a float (Hq,) or (B, Hq) array, B the batch or, with cu_seqlens, the sequences."""
    if slopes is None:
        return
    hq = query.shape[2]
    b = query.shape[0] if cu_seqlens is None else cu_seqlens[0].shape[0] - 1
    shape = tuple(getattr(slopes, "shape", ()))
    if not hasattr(slopes, "dtype") or not jnp.issubdtype(slopes.dtype, jnp.floating) or shape not in ((hq,), (b, hq)):
        what = "sequences" if cu_seqlens is not None else "batch"
        raise ValueError(f"alibi_slopes: shape {shape} and dtype {getattr(slopes, 'dtype', type(slopes).__name__)}; "
                         f"expected a float array of shape (Hq,)=({hq},) or (B, Hq)=({b}, {hq}) (B: the {what}).")


def _shape_of(x: Any) -> Any:
    return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


def _is_int_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)


def _as_pair(name: str, value: Any, what: str) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name}: expected a pair {what}, got {type(value).__name__} {value!r:.80}.")
    return tuple(value)


def _check_packing(query, key, segment_ids, cu_seqlens, max_seqlen) -> None:
    """Checks segment ids, cu_seqlens and max_seqlen against (B, T, ...) query and (B, S, ...) key."""
    b, t, s = query.shape[0], query.shape[1], key.shape[1]
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("segment_ids and cu_seqlens were both given; pass one (segments within a batch row, "
                         "or varlen sequences packed in a batch of 1).")
    if segment_ids is not None:
        ids = _as_pair("segment_ids", segment_ids, "(q_segment_ids (B, T), kv_segment_ids (B, S))")
        for name, x, want in (("q_segment_ids", ids[0], (b, t)), ("kv_segment_ids", ids[1], (b, s))):
            if not _is_int_array(x) or tuple(x.shape) != want:
                raise ValueError(
                    f"segment_ids: {name} has shape {_shape_of(x)} and dtype {getattr(x, 'dtype', None)}; "
                    f"expected an integer array of shape {want} (B, {'T' if name[0] == 'q' else 'S'})."
                )
    if cu_seqlens is not None:
        cu = _as_pair("cu_seqlens", cu_seqlens, "(cu_seqlens_q (N + 1,), cu_seqlens_k (N + 1,))")
        for name, x in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
            if not _is_int_array(x) or x.ndim != 1 or x.shape[0] < 2:
                raise ValueError(
                    f"cu_seqlens: {name} has shape {_shape_of(x)} and dtype {getattr(x, 'dtype', None)}; "
                    "expected a 1-D integer array of N + 1 >= 2 cumulative lengths."
                )
        if cu[0].shape != cu[1].shape:
            raise ValueError(f"cu_seqlens: cu_seqlens_q {tuple(cu[0].shape)} and cu_seqlens_k "
                             f"{tuple(cu[1].shape)} must have the same length N + 1.")
        if b != 1:
            raise ValueError(f"cu_seqlens: needs a batch of 1 holding the packed sequences, got batch={b} "
                             "(reshape to (1, total, H, D)).")
    if max_seqlen is not None:
        pair = _as_pair("max_seqlen", max_seqlen, "(max_seqlen_q, max_seqlen_k) of ints")
        if cu_seqlens is None:
            raise ValueError(f"max_seqlen={max_seqlen!r}: only meaningful with cu_seqlens.")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in pair):
            raise ValueError(f"max_seqlen={max_seqlen!r}: expected (max_seqlen_q, max_seqlen_k) Python ints >= 1.")


def _as_int32(pair: Optional[tuple[Any, Any]]) -> Optional[tuple[jax.Array, jax.Array]]:
    return None if pair is None else tuple(jnp.asarray(x).astype(jnp.int32) for x in pair)
