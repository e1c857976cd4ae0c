"""`flash` (alias `flash_attn2`): flash attention with our own kernels.

GPU (CUDA; ROCm goes the same Triton path, untested): Triton forward and backward kernels
(`kernels/flash_fwd_triton.py`, `kernels/flash_bwd_triton.py`) launched by jax-triton, with a
custom VJP: online softmax in fp32, the log-sum-exp saved for the backward, never an L x S matrix.
Features there: both causal alignments, native GQA/MQA, additive bias and bool masks (broadcast
dims read with stride 0), sliding windows, logits soft cap (hardware tanh for 16-bit inputs),
attention sinks, segment ids (key blocks outside a query block's segments are skipped), varlen
packing (`cu_seqlens`, one program per sequence and block, no padding), dropout (Philox from a seed,
regenerated in the backward), ALiBi slopes (computed in the kernels, no bias matrix), head dims up
to 256, returning the LSE.

TPU: JAX's Pallas TPU flash kernel (`jax.experimental.pallas.ops.tpu.flash_attention`): top-left
causal or none, bias, segment ids, equal head counts; no varlen, no dropout.

CPU: no flash kernel; forcing `flash` raises with the reasons, automatic selection skips it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .capabilities import AttentionInputs, Capabilities, missing_gpu_packages
from .metadata import AttentionMetadata
from .registry import AttentionRegistry

_GPU_FEATURES = frozenset(
    {"causal", "causal_bottom_right", "bias", "bool_mask", "gqa", "sliding_window", "softcap", "sinks", "lse",
     "backward", "segment_ids", "varlen", "dropout", "alibi"}
)
# The Pallas TPU kernel keeps its log-sum-exp internal: "lse" is not among these.
_TPU_FEATURES = frozenset({"causal", "bias", "segment_ids", "backward"})


@AttentionRegistry.register
class FlashAttn(AttentionImpl):
    """Flash attention: Triton kernels on GPU, Pallas on TPU; see the module docstring."""

    capabilities = Capabilities(
        platforms=frozenset({"gpu", "tpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        # Either platform's features; `extra_reasons` narrows them to the platform of the call.
        features=_GPU_FEATURES | _TPU_FEATURES,
        max_head_dim=256,
    )
    layouts = frozenset({"BTHD", "BHTD"})

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("flash", "flash_attn2")

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        reasons = []
        if inputs.platform == "cpu":
            reasons.append("no flash kernel on cpu (use 'sdpa' or 'vanilla')")
        if inputs.platform == "gpu":
            reasons += missing_gpu_packages()
            reasons += cls.triton_kernel_reasons(inputs)
        if inputs.platform == "tpu":
            for feature in sorted(inputs.features - _TPU_FEATURES):
                reasons.append(f"feature {feature!r} not supported by the TPU kernel")
            if inputs.value_head_dim != inputs.head_dim:
                reasons.append("value_head_dim != head_dim on TPU")
            if inputs.q_len % 128 or inputs.kv_len % 128:
                reasons.append(f"TPU kernel needs sequence lengths that are multiples of 128, got {inputs.q_len} and {inputs.kv_len}")
        if metadata.mesh is not None:
            reasons.append("flash does not run under a mesh yet (use 'sdpa' or 'vanilla')")
        return reasons

    @classmethod
    def takes_alibi_slopes(cls, inputs: AttentionInputs) -> bool:
        """The Triton kernels compute ALiBi; on TPU it is a bias for the Pallas kernel."""
        return inputs.platform == "gpu"

    @classmethod
    def triton_kernel_reasons(cls, inputs: AttentionInputs) -> list[str]:
        """Why the Triton kernels cannot run `inputs` (described as a GPU call), whoever launches them."""
        gpu = dataclasses.replace(inputs, platform="gpu", backend="cuda")
        reasons = cls.capabilities.reasons(gpu)
        for feature in sorted(inputs.features - _GPU_FEATURES):
            reasons.append(f"feature {feature!r} not supported by the Triton kernels")
        if "varlen" in inputs.features:
            for feature in sorted(inputs.features & {"bias", "bool_mask", "segment_ids"}):
                reasons.append(f"feature {feature!r} cannot be combined with varlen packing on GPU")
        return list(dict.fromkeys(reasons))

    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        if call.backend in ("cuda", "rocm"):
            # The same Triton kernels on ROCm (untested there); `flash_config` keeps the hardware tanh to CUDA.
            return self._forward_triton(call, arrays)
        if call.backend == "tpu":
            return self._forward_pallas(call, arrays)
        raise NotImplementedError("flash has no platform-independent kernel; it runs on GPU (Triton) and TPU (Pallas).")

    def _forward_triton(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        """The Triton kernels through jax-triton, with the settings of `call.flash_config`.

        Dropout draws its Philox seed from the dropout key (no key: no dropout); varlen grids cover
        `call.max_seqlen` (or the packed lengths when None).
        """
        from .kernels.flash_jax_triton import FlashExtras, flash_attention_triton

        dtype = jnp.dtype(self.metadata.runtime_dtype) if self.metadata.runtime_dtype else arrays.query.dtype
        query, key, value = (x.astype(dtype) for x in arrays.qkv)
        l, s = query.shape[call.seq_axis], key.shape[call.seq_axis]
        seed = None
        if arrays.dropout_rng is not None and call.dropout_prob > 0:
            seed = jax.lax.bitcast_convert_type(jax.random.bits(arrays.dropout_rng, (2,), jnp.uint32), jnp.int32)
        settings = call if seed is not None else call.replace(dropout_prob=0.0)
        cfg = settings.flash_config(l, s, query.shape[-1], packed=arrays.cu_seqlens is not None)
        extras = FlashExtras(
            segment_ids=None if arrays.segment_ids is None else tuple(arrays.segment_ids),
            cu_seqlens=None if arrays.cu_seqlens is None else tuple(arrays.cu_seqlens),
            seed=seed,
            alibi_slopes=arrays.alibi_slopes,
        )
        mask, aux = arrays.mask, arrays.softmax_aux
        out, lse = flash_attention_triton(
            query, key, value, _four_d(arrays.bias), None if mask is None else _four_d(mask).astype(jnp.int8),
            None if aux is None else _sink_logits(aux), extras, cfg,
        )
        return AttentionOutput(attention_outputs=out, lse=lse)

    def _forward_pallas(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        """JAX's Pallas TPU flash kernel on (B, H, T, D) arrays."""
        from jax.experimental.pallas.ops.tpu.flash_attention import SegmentIds
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention as pallas_flash

        swap = call.layout == "BTHD"
        q, k, v = (jnp.swapaxes(x, 1, 2) if swap else x for x in arrays.qkv)
        scale = call.scale_for(q.shape[-1])
        ab = None
        if arrays.bias is not None:  # the Pallas kernel adds `ab` before scaling the logits
            full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            ab = jnp.broadcast_to(_four_d(arrays.bias).astype(jnp.float32) / scale, full)
        segment_ids = arrays.segment_ids
        segments = None if segment_ids is None else SegmentIds(q=segment_ids[0], kv=segment_ids[1])
        out = pallas_flash(q, k, v, ab=ab, segment_ids=segments, causal=call.causal, sm_scale=scale)
        if segment_ids is not None:  # the kernel averages V over a row with no visible key; we give 0
            out = jnp.where(_rows_with_visible_key(*segment_ids, call.causal)[:, None, :, None], out, 0)
        return AttentionOutput(attention_outputs=jnp.swapaxes(out, 1, 2) if swap else out)


def _four_d(x: Optional[jax.Array]) -> Optional[jax.Array]:
    return None if x is None else x.reshape((1,) * (4 - x.ndim) + x.shape)


def _rows_with_visible_key(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, causal: bool) -> jax.Array:
    """(B, T) bool: query i has a key of its own segment (at a position j <= i with `causal`).

    Found by sorting the (B, S) key ids, O((T + S) log S) instead of comparing every (i, j) pair.
    """
    order = jnp.argsort(kv_segment_ids, axis=-1, stable=True)  # equal ids keep their order of position
    ids = jnp.take_along_axis(kv_segment_ids, order, axis=-1)
    first = jax.vmap(lambda row, q: jnp.searchsorted(row, q, side="left"))(ids, q_segment_ids)
    first = jnp.minimum(first, ids.shape[-1] - 1)
    found = jnp.take_along_axis(ids, first, axis=-1) == q_segment_ids
    if causal:  # the first key of the segment (smallest position) must not be in the future
        found &= jnp.take_along_axis(order, first, axis=-1) <= jnp.arange(q_segment_ids.shape[-1])
    return found


def _sink_logits(softmax_aux: jax.Array) -> jax.Array:
    """(Hq,) float32 sink logits; several sinks per head merge into one by log-sum-exp."""
    aux = softmax_aux.astype(jnp.float32)
    return aux if aux.ndim == 1 else jax.nn.logsumexp(aux, axis=-1)
