"""Configuration shared by every attention implementation.

`AttentionMetadata` is an immutable record: numerics (dtypes, scale, dropout), blocking hints for
kernels, and the distributed context (mesh, axis names). Instances are hashable so implementations
and compiled functions can be cached by metadata.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

Mode = Literal["__train__", "__prefill__", "__autoregressive__", "__insert__"]
Platform = Literal["cpu", "gpu", "tpu"]
Backend = Literal["cpu", "cuda", "rocm", "tpu"]

_PLATFORMS = ("cpu", "gpu", "tpu")
_BACKENDS = ("cpu", "cuda", "rocm", "tpu")


@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Mesh axis names used to shard attention tensors.

    Attributes:
        batch_axis: Mesh axis (or tuple of axes) the batch dimension is split over.
        head_axis: Mesh axis the head dimension is split over (tensor parallelism).
        query_sequence_axis: Mesh axis the query sequence is split over in train/prefill mode.
        key_sequence_axis: Mesh axis the key/value sequence is split over.
    """

    batch_axis: Optional[str | tuple[str, ...]] = "dp"
    head_axis: Optional[str] = "tp"
    query_sequence_axis: Optional[str] = None
    key_sequence_axis: Optional[str] = None


def _dtype_name(dtype: Any) -> Optional[str]:
    return None if dtype is None else jnp.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Numerics, blocking and distribution settings for an attention call.

    Attributes:
        runtime_dtype: dtype inputs are cast to before the computation; None keeps the inputs'
            dtype (never downcasts silently).
        runtime_softmax_dtype: dtype of the logits and softmax; None means float32, or float64
            for float64 inputs.
        softmax_scale: multiplier of q·k; None means 1/sqrt(head_dim).
        dropout_prob: probability of dropping an attention weight (training only).
        blocksize_q: query block size hint for blockwise kernels.
        blocksize_k: key block size hint for blockwise kernels.
        blocksize_b: batch block size hint.
        mesh: device mesh; when set, implementations run under `shard_map` over it.
        sequence_axis_name: mesh axis name used by sequence-parallel (ring) attention.
        platform: "cpu", "gpu" or "tpu"; None means: where the inputs live.
        backend: "cpu", "cuda", "rocm" or "tpu"; None means: derived from the platform.
        partition_axis: names of the mesh axes for batch, heads and sequence.
    """

    runtime_dtype: Optional[str] = None
    runtime_softmax_dtype: Optional[str] = None
    softmax_scale: Optional[float] = None
    dropout_prob: float = 0.0
    blocksize_q: int = 128
    blocksize_k: int = 128
    blocksize_b: int = 1
    mesh: Optional[Mesh] = None
    sequence_axis_name: str = "sp"
    platform: Optional[Platform] = None
    backend: Optional[Backend] = None
    partition_axis: PartitionAxis = PartitionAxis()

    def __post_init__(self):
        object.__setattr__(self, "runtime_dtype", _dtype_name(self.runtime_dtype))
        object.__setattr__(self, "runtime_softmax_dtype", _dtype_name(self.runtime_softmax_dtype))
        if not 0.0 <= float(self.dropout_prob) < 1.0:
            raise ValueError(f"dropout_prob={self.dropout_prob!r}: expected a probability in [0, 1).")
        if self.platform is not None and self.platform not in _PLATFORMS:
            raise ValueError(f"platform={self.platform!r}: expected one of {_PLATFORMS} or None.")
        if self.backend is not None and self.backend not in _BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {_BACKENDS} or None.")
        for name in ("blocksize_q", "blocksize_k", "blocksize_b"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive int.")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh={self.mesh!r}: expected a jax.sharding.Mesh or None.")

    def replace(self, **changes: Any) -> "AttentionMetadata":
        """Returns a copy with the given fields replaced."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(
        cls, config: Any, softmax_scale: Optional[float], dropout_prob: float = 0.0
    ) -> "AttentionMetadata":
        """Builds metadata from any model config object (duck-typed).

        Reads, when present: `attn_dtype` or `dtype`, `attn_softmax_dtype`, `blocksize_q`,
        `blocksize_k`, `blocksize_b`, `mesh`, `sequence_axis_name`, `platform`, `backend`,
        `partition_axis`. Missing attributes keep their defaults.
        """
        fields = {}
        lookups = {
            "runtime_dtype": ("attn_dtype", "dtype"),
            "runtime_softmax_dtype": ("attn_softmax_dtype",),
            "blocksize_q": ("blocksize_q",),
            "blocksize_k": ("blocksize_k",),
            "blocksize_b": ("blocksize_b",),
            "mesh": ("mesh",),
            "sequence_axis_name": ("sequence_axis_name",),
            "platform": ("platform",),
            "backend": ("backend",),
            "partition_axis": ("partition_axis",),
        }
        for field, names in lookups.items():
            for name in names:
                value = getattr(config, name, None)
                if value is not None:
                    fields[field] = value
                    break
        return cls(softmax_scale=softmax_scale, dropout_prob=dropout_prob, **fields)

    # --- serialisation (the mesh is runtime state and is not serialised) ---
    def to_dict(self) -> dict[str, Any]:
        """Serialisable fields as a dict; `mesh` is omitted (it is process state)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mesh"}
        out["partition_axis"] = dataclasses.asdict(self.partition_axis)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionMetadata":
        data = dict(data)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"from_dict: unknown AttentionMetadata fields {sorted(unknown)}.")
        if isinstance(data.get("partition_axis"), dict):
            axis = {k: tuple(v) if isinstance(v, list) else v for k, v in data["partition_axis"].items()}
            data["partition_axis"] = PartitionAxis(**axis)
        return cls(**data)

    def to_json(self, **json_kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_json(cls, text: str) -> "AttentionMetadata":
        return cls.from_dict(json.loads(text))

    # --- derived values ---
    def scale_for(self, head_dim: int) -> float:
        """The softmax scale to use for a given head dimension."""
        return float(self.softmax_scale) if self.softmax_scale is not None else head_dim**-0.5

    def softmax_dtype_for(self, input_dtype: Any) -> jnp.dtype:
        """float32 by default; float64 when the inputs are float64 (no silent downcast)."""
        if self.runtime_softmax_dtype is not None:
            return jnp.dtype(self.runtime_softmax_dtype)
        return jnp.dtype(jnp.float64) if jnp.dtype(input_dtype) == jnp.float64 else jnp.dtype(jnp.float32)

    def get_shardings(
        self, mode: Mode, BTHD: bool = True
    ) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec, PartitionSpec, PartitionSpec, PartitionSpec]:
        """PartitionSpecs for (query, key, value, bias, mask, output).

        Axes not present in `self.mesh` (when a mesh is set) are replaced by None. In
        autoregressive mode the query sequence axis is never split.

        Args:
            mode: runtime mode, see `AttentionImpl.get_mode`.
            BTHD: True for (batch, time, heads, dim) tensors, False for (batch, heads, time, dim).
        """
        pa = self.partition_axis
        names = set(self.mesh.axis_names) if self.mesh is not None else None

        def keep(axis):
            if axis is None or names is None:
                return axis
            if isinstance(axis, tuple):
                kept = tuple(a for a in axis if a in names)
                return kept if kept else None
            return axis if axis in names else None

        batch, head = keep(pa.batch_axis), keep(pa.head_axis)
        q_seq = None if mode == "__autoregressive__" else keep(pa.query_sequence_axis)
        k_seq = keep(pa.key_sequence_axis)

        def layout(seq):
            return PartitionSpec(batch, seq, head, None) if BTHD else PartitionSpec(batch, head, seq, None)

        bias = PartitionSpec(batch, head, q_seq, k_seq)
        mask = PartitionSpec(batch, None, q_seq, k_seq)
        return layout(q_seq), layout(k_seq), layout(k_seq), bias, mask, layout(q_seq)


def platform_of(*arrays: Any) -> Platform:
    """The platform the given arrays live on; falls back to `jax.default_backend()` for tracers."""
    for array in arrays:
        if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
            platform = next(iter(array.devices())).platform
            return "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def backend_of(platform: Platform) -> Backend:
    """The concrete backend behind a platform ("gpu" -> "cuda" or "rocm")."""
    if platform != "gpu":
        return platform
    try:
        version = jax.devices("gpu")[0].client.platform_version.lower()
    except RuntimeError:
        return "cuda"
    return "rocm" if "rocm" in version or "hip" in version else "cuda"
