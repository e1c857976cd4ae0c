"""`AttentionImpl`: the base every attention implementation derives from.

An implementation declares what it supports (`capabilities`, and `extra_reasons` for rules beyond
them) and how it computes: `compute(call, arrays)` on an `AttentionCall` and its `CallArrays`,
branching on `call.backend` where the platforms differ. `__call__` builds the call from its
keywords, checks the arrays (`validation.check_call`) and support, then runs `compute`.

The EasyDeL-style entry points stay: `forward_native` and the per-platform methods

    tpu -> forward_tpu      gpu/cuda -> forward_cuda      gpu/rocm -> forward_rocm      cpu -> forward_cpu

take the keywords of `__call__` and run `compute` for that backend. A subclass may implement them
instead of `compute` (`forward_native`, and any platform's variant): `__call__` then runs the
platform's method it overrides (the defaults delegate to `forward_native`).

Tensors use the (B, T, H, D) layout ("BTHD"); bias and masks are broadcastable to (B, Hq, T, S).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Literal, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from .call import AttentionCall, CallArrays, Layout, build_call
from .capabilities import AttentionInputs, Capabilities, CausalAlignment
from .masks import alibi_bias
from .metadata import AttentionMetadata, Mode, backend_of, platform_of
from .validation import as_int32, check_call

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
        """Whether the kernels that run `inputs` apply ALiBi slopes themselves (then `compute` gets
        them in `arrays.alibi_slopes`, an overriding `forward_*` as `alibi_slopes=`). Otherwise `run`
        adds the ALiBi bias (`masks.alibi_bias`) to the bias, so the call needs the "bias" feature
        instead of "alibi"."""
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
        call, arrays = build_call(
            query, key, value, metadata=self.metadata, backend=None, bias=bias, mask=mask, causal=causal,
            causal_alignment=causal_alignment, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            softmax_aux=softmax_aux, dropout_rng=dropout_rng, return_weights=return_weights, return_lse=return_lse,
            layout=layout, segment_ids=segment_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            alibi_slopes=alibi_slopes,
        )
        check_call(call, arrays)
        return self.run(call.replace(backend=self._call_backend(arrays)), arrays)

    def _call_backend(self, arrays: CallArrays) -> str:
        """The backend a call on `arrays` runs on: `metadata.backend`, else that of the platform
        (`metadata.platform`, else where the arrays live)."""
        platform = self.metadata.platform or platform_of(*arrays.qkv)
        return self.metadata.backend or backend_of(platform)

    def run(self, call: AttentionCall, arrays: CallArrays, inputs: Optional[AttentionInputs] = None) -> AttentionOutput:
        """Runs a call whose arrays `validation.check_call` accepted.

        `inputs`: the call's signature when its support was already decided (`attention()` selected
        this implementation for it); None: derived here, and a call this implementation cannot run
        raises ValueError with every reason. Calls in a layout this implementation does not take
        run transposed to (B, T, H, D).
        """
        if call.layout not in self.layouts:
            out = self.run(call.replace(layout="BTHD"), arrays.swapped(), inputs)
            return out.replace(attention_outputs=jnp.swapaxes(out.attention_outputs, 1, 2))
        if inputs is None:
            platform = self.metadata.platform or platform_of(*arrays.qkv)
            inputs = call.inputs(arrays, platform, call.backend or backend_of(platform))
            reasons = self.not_supported_reasons(inputs, self.metadata)
            if reasons:
                raise ValueError(f"implementation {self.canonical_name()!r} cannot run this call: " + "; ".join(reasons))
        arrays = self._prepared(call, arrays, inputs)
        forward = self._overriding_forward(call.backend, inputs.platform)
        if forward is not None:  # an EasyDeL-style subclass that implements a forward_* method
            out = forward(*arrays.qkv, **call.forward_keywords(
                arrays, layout=len(self.layouts) > 1, alibi=arrays.alibi_slopes is not None))
        else:
            out = self.compute(call, arrays)
        return out if call.return_lse else out.replace(lse=None)

    def _prepared(self, call: AttentionCall, arrays: CallArrays, inputs: AttentionInputs) -> CallArrays:
        """The arrays as implementations take them: int32 packing, no dropout key without dropout,
        and ALiBi as an additive bias where this implementation's kernels lack it."""
        arrays = arrays.replace(
            segment_ids=as_int32(arrays.segment_ids), cu_seqlens=as_int32(arrays.cu_seqlens),
            dropout_rng=arrays.dropout_rng if call.dropout_prob > 0 else None,
        )
        if arrays.alibi_slopes is None or self.takes_alibi_slopes(inputs):
            return arrays
        t, s = arrays.query.shape[call.seq_axis], arrays.key.shape[call.seq_axis]
        alibi = alibi_bias(arrays.alibi_slopes, t, s, arrays.cu_seqlens)
        return arrays.replace(bias=alibi if arrays.bias is None else arrays.bias + alibi, alibi_slopes=None)

    def _overriding_forward(self, backend: Optional[str], platform: str) -> Optional[Callable[..., AttentionOutput]]:
        """The `forward_*` method a subclass overrides for `backend` (following the defaults' delegation:
        forward_gpu -> forward_cuda -> forward_native, the others -> forward_native), or None when
        the call goes straight to `compute`."""
        first = _FORWARD_OF_BACKEND.get(backend, "forward_gpu" if platform == "gpu" else "forward_native")
        chain = ("forward_gpu", "forward_cuda") if first == "forward_gpu" else (first,)
        for name in dict.fromkeys(chain + ("forward_native",)):
            if getattr(type(self), name) is not getattr(AttentionImpl, name):
                return getattr(self, name)
        return None

    # --- computing ------------------------------------------------------------
    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        """Attention for a checked `call` on `arrays` (in `call.layout`, one of `layouts`), on the
        kernels of `call.backend` (None: the platform-independent path).

        `arrays` come as `run` prepares them: segment ids and cu_seqlens int32, a dropout key only
        with dropout, ALiBi slopes only where `takes_alibi_slopes` (else folded into the bias).
        Implementations override this; an EasyDeL-style subclass may override `forward_native`
        (or a platform's `forward_*`) instead.
        """
        if type(self).forward_native is AttentionImpl.forward_native:
            raise NotImplementedError(f"{type(self).__name__} implements neither compute nor forward_native.")
        return self.forward_native(*arrays.qkv, **call.forward_keywords(
            arrays, layout=len(self.layouts) > 1, alibi=arrays.alibi_slopes is not None))

    # --- the EasyDeL-style per-platform entry points ---------------------------
    def _forward(self, backend: Optional[str], query, key, value, keywords: dict[str, Any]) -> AttentionOutput:
        """A `forward_*` default: delegates to an overriding `forward_native`, else builds the call from
        the keywords (`call.build_call`, which rejects unknown ones) and runs `compute` for `backend`.
        The arrays are taken as given (not checked); the LSE is returned when computed."""
        if backend is not None and type(self).forward_native is not AttentionImpl.forward_native:
            return self.forward_native(query, key, value, **keywords)
        call, arrays = build_call(query, key, value, metadata=self.metadata, backend=backend, return_lse=True,
                                  **keywords)
        return self.compute(call, arrays)

    def forward_native(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        """Platform-independent forward; keywords as in `__call__` (bias, mask, causal, ...,
        alibi_slopes), without return_lse and init_bias."""
        return self._forward(None, query, key, value, keywords)

    def forward_cpu(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        return self._forward("cpu", query, key, value, keywords)

    def forward_tpu(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        return self._forward("tpu", query, key, value, keywords)

    def forward_gpu(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        return self.forward_cuda(query, key, value, **keywords)

    def forward_cuda(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        return self._forward("cuda", query, key, value, keywords)

    def forward_rocm(self, query: jax.Array, key: jax.Array, value: jax.Array, **keywords: Any) -> AttentionOutput:
        return self._forward("rocm", query, key, value, keywords)


_FORWARD_OF_BACKEND = {"tpu": "forward_tpu", "cuda": "forward_cuda", "rocm": "forward_rocm", "cpu": "forward_cpu"}


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
