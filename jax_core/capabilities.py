"""What an attention call asks for, and what an implementation declares it can do.

`AttentionInputs` describes a call by its signature only (shapes, dtypes, platform, features
asked for), so support can be decided once per signature, before any data is touched.
`Capabilities` is an implementation's declaration; `Capabilities.reasons(inputs)` lists every way
the call exceeds it.

Shape legend (used across jax_core):
    B: batch   T: query length   S: key/value length
    Hq: query heads   Hk: key/value heads (Hq % Hk == 0)   D: q/k head dim   Dv: value head dim
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .call import AttentionCall, CallArrays
from .visibility import CausalAlignment, Visibility

#: Feature vocabulary shared by all implementations.
FEATURES = frozenset(
    {
        "causal",  # causal mask aligned top-left (torch's is_causal)
        "causal_bottom_right",  # causal mask or window aligned bottom-right (KV-cache / flash-attn style)
        "bias",  # additive float bias broadcastable to (B, Hq, T, S)
        # ALiBi slopes (Hq,) or (B, Hq): -slope * |i + S - T - j| joins the logits. Implementations
        # without it in their kernels (`AttentionImpl.takes_alibi_slopes`) get it as a "bias".
        "alibi",
        "bool_mask",  # boolean mask (True = attend) broadcastable to (B, Hq, T, S)
        "dropout",
        "gqa",  # Hk < Hq without repeating K/V in memory
        "sliding_window",
        "softcap",  # logits soft cap: cap * tanh(s / cap)
        "sinks",  # per-head attention sink logits (softmax_aux)
        "segment_ids",  # (q_ids, kv_ids): queries see only keys with the same id
        "varlen",  # several sequences packed along T and S (cu_seqlens)
        "lse",  # return the log-sum-exp of each row
        "weights",  # return the attention probabilities
        "backward",  # differentiable
    }
)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """Signature of one attention call (no data).

    Attributes:
        batch, q_len, kv_len, num_q_heads, num_kv_heads, head_dim, value_head_dim: sizes.
        dtype: name of the query dtype.
        platform: "cpu", "gpu" or "tpu".
        backend: "cpu", "cuda", "rocm" or "tpu".
        features: feature names (from `FEATURES`) the call needs.
        window: (left, right) sliding window, -1 meaning unbounded on that side; None: no window.
    """

    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    dtype: str
    platform: str
    backend: str
    features: frozenset = frozenset()
    window: Optional[tuple[int, int]] = None

    def __post_init__(self):
        unknown = set(self.features) - FEATURES
        if unknown:
            raise ValueError(f"features: unknown names {sorted(unknown)}; known: {sorted(FEATURES)}.")
        object.__setattr__(self, "features", frozenset(self.features))

    @classmethod
    def from_call(cls, call: AttentionCall, arrays: CallArrays, *, platform: str, backend: str,
                  backward: bool = False) -> "AttentionInputs":
        """The signature of `call` on `arrays` (anything with `.shape` and `.dtype`, in the call's
        layout; described in (B, T, H, D) terms). `backward`: the call must be differentiable.

        The positional features come from `Visibility.features` (with varlen packing, a
        bottom-right alignment counts as "causal_bottom_right" even when T == S, since the packed
        sequences may each have L != S).
        """
        query, key, value = arrays.bthd_shapes(call.layout)
        varlen = arrays.cu_seqlens is not None
        flags = {
            "bias": arrays.bias is not None,
            "bool_mask": arrays.mask is not None,
            "softcap": call.logits_soft_cap is not None,
            "sinks": arrays.softmax_aux is not None,
            "dropout": arrays.dropout_rng is not None and call.dropout_prob > 0,
            "weights": call.return_weights,
            "lse": call.return_lse,
            "backward": backward,
            "segment_ids": arrays.segment_ids is not None,
            "varlen": varlen,
            "alibi": arrays.alibi_slopes is not None,
        }
        return cls._describe(query, key, value, call.visibility, flags, platform=platform, backend=backend)

    @classmethod
    def from_arrays(
        cls,
        query: Any,
        key: Any,
        value: Any,
        *,
        platform: str,
        backend: str,
        bias: Any = None,
        mask: Any = None,
        causal: bool = False,
        causal_alignment: CausalAlignment = "top_left",
        sliding_window: Optional[tuple[int, int]] = None,
        logits_soft_cap: Optional[float] = None,
        softmax_aux: Any = None,
        dropout: bool = False,
        return_weights: bool = False,
        return_lse: bool = False,
        backward: bool = False,
        segment_ids: bool = False,
        varlen: bool = False,
        alibi: bool = False,
    ) -> "AttentionInputs":
        """Describes a call on (B, T, H, D) arrays by keywords (`from_call` describes a built call).

        `dropout`, `segment_ids`, `varlen` and `alibi` say whether dropout runs / segment ids /
        cu_seqlens / ALiBi slopes are given.
        """
        flags = {"bias": bias is not None, "bool_mask": mask is not None, "softcap": logits_soft_cap is not None,
                 "sinks": softmax_aux is not None, "dropout": dropout, "weights": return_weights, "lse": return_lse,
                 "backward": backward, "segment_ids": segment_ids, "varlen": varlen, "alibi": alibi}
        visibility = Visibility.of(causal, causal_alignment, sliding_window)
        return cls._describe(query, key, value, visibility, flags, platform=platform, backend=backend)

    @classmethod
    def _describe(cls, query: Any, key: Any, value: Any, visibility: Visibility, flags: dict[str, bool], *,
                  platform: str, backend: str) -> "AttentionInputs":
        """The signature of (B, T, H, D) arrays with the positional rule `visibility` and the features
        named in `flags` that are True."""
        b, t, hq, d = query.shape
        _, s, hk, _ = key.shape
        features = set(visibility.features(t, s, varlen=flags["varlen"]))
        features.update(name for name, wanted in flags.items() if wanted)
        if hk != hq:
            features.add("gqa")
        return cls(batch=b, q_len=t, kv_len=s, num_q_heads=hq, num_kv_heads=hk, head_dim=d,
                   value_head_dim=value.shape[-1], dtype=jnp.dtype(query.dtype).name, platform=platform,
                   backend=backend, features=frozenset(features),
                   window=visibility.window if visibility.windowed else None)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """An implementation's declared support.

    Attributes:
        platforms: platforms it runs on ("cpu", "gpu", "tpu").
        dtypes: dtype names it accepts.
        features: names from `FEATURES` it supports.
        max_head_dim: largest q/k and v head dim, or None for no limit.
        head_dim_multiple: head dims must be multiples of this.
    """

    platforms: frozenset
    dtypes: frozenset
    features: frozenset
    max_head_dim: Optional[int] = None
    head_dim_multiple: int = 1

    def reasons(self, inputs: AttentionInputs) -> list[str]:
        """Every way `inputs` falls outside this declaration (empty when supported)."""
        out = []
        if inputs.platform not in self.platforms:
            out.append(f"platform {inputs.platform!r} not in {sorted(self.platforms)}")
        if inputs.dtype not in self.dtypes:
            out.append(f"dtype {inputs.dtype} not in {sorted(self.dtypes)}")
        for name, dim in (("head_dim", inputs.head_dim), ("value_head_dim", inputs.value_head_dim)):
            if self.max_head_dim is not None and dim > self.max_head_dim:
                out.append(f"{name}={dim} > max {self.max_head_dim}")
            if dim % self.head_dim_multiple:
                out.append(f"{name}={dim} is not a multiple of {self.head_dim_multiple}")
        for feature in sorted(inputs.features - self.features):
            out.append(f"feature {feature!r} not supported")
        return out


ALL_FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


# --- packages the GPU kernels need -----------------------------------------------------------------

#: How to install the GPU kernels' packages, the way the README installs jaxattn (from its checkout).
GPU_EXTRA_HINT = "the gpu extra: pip install -e '.[gpu]' in the jaxattn checkout"
#: (module imported, package name) of each package the Triton kernels need under JAX.
GPU_PACKAGES = (("triton", "triton"), ("jax_triton", "jax-triton"))


def has_module(name: str) -> bool:
    """Whether `name` can be imported here (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_gpu_packages() -> list[str]:
    """One reason per package of GPU_PACKAGES that is not installed, each with the install hint."""
    return [f"{package} is not installed ({GPU_EXTRA_HINT})" for module, package in GPU_PACKAGES
            if not has_module(module)]


def device_multiprocessors(default: int) -> int:
    """Multiprocessors (SMs) of JAX's first device; `default` where it does not say (a CPU, or no
    backend)."""
    try:
        return int(getattr(jax.devices()[0], "core_count", 0) or 0) or default
    except RuntimeError:
        return default
