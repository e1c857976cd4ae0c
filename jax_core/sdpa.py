"""`sdpa` (alias `cudnn`): `jax.nn.dot_product_attention`.

On CUDA it asks for implementation="cudnn" when cuDNN's fused attention takes the call (fp16/bf16,
head dims cuDNN accepts) and uses "xla" otherwise; every other platform uses "xla".

jax.nn gives fully masked rows an average (bool mask) or NaN (-inf bias); torch gives 0. This
implementation detects such rows, feeds the kernel a harmless row instead and zeroes the output,
so forward and gradients match torch.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .capabilities import AttentionInputs, Capabilities
from .masks import combine_masks, positional_mask
from .metadata import AttentionMetadata
from .registry import AttentionRegistry
from .sharding import run_sharded

_CUDNN_DTYPES = ("float16", "bfloat16")


def cudnn_reasons(inputs: AttentionInputs) -> list[str]:
    """Why cuDNN's fused attention (through jax.nn) would not take this call."""
    reasons = []
    if inputs.backend != "cuda":
        reasons.append(f"backend {inputs.backend!r} is not cuda")
    if inputs.dtype not in _CUDNN_DTYPES:
        reasons.append(f"dtype {inputs.dtype} not in {_CUDNN_DTYPES}")
    if inputs.head_dim % 8 or inputs.head_dim > 128:
        reasons.append(f"head_dim={inputs.head_dim} is not a multiple of 8 up to 128")
    return reasons


@AttentionRegistry.register
class ScaledDotProductAttn(AttentionImpl):
    """`jax.nn.dot_product_attention` with cuDNN on CUDA and XLA elsewhere."""

    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu", "tpu"}),
        # jax.nn computes the softmax in float32 whatever the input: float64 would be downcast.
        dtypes=frozenset({"float16", "bfloat16", "float32"}),
        features=frozenset({"causal", "bias", "bool_mask", "gqa", "sliding_window", "backward"}),
    )

    layouts = frozenset({"BTHD", "BHTD"})

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("sdpa", "cudnn")

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        reasons = []
        if inputs.value_head_dim != inputs.head_dim:
            reasons.append(f"value_head_dim={inputs.value_head_dim} != head_dim={inputs.head_dim}")
        if inputs.platform == "cpu" and inputs.dtype == "float16":
            reasons.append("float16 on cpu: XLA:CPU cannot run jax.nn's float16 dot precision")
        return reasons

    def _attend(self, call: AttentionCall, query, key, value, bias, mask, implementation):
        """jax.nn on (B, T, H, D) arrays."""
        md = self.metadata
        dtype = jnp.dtype(md.runtime_dtype) if md.runtime_dtype else query.dtype
        query, key, value = (x.astype(dtype) for x in (query, key, value))
        scale = call.scale_for(query.shape[-1])
        t, s = query.shape[1], key.shape[1]
        causal = call.causal
        if call.sliding_window is not None:
            # Windows go in as an explicit mask so alignment matches `jax_core.masks` exactly.
            mask = combine_masks(mask, positional_mask(t, s, causal=causal, sliding_window=call.sliding_window))
            causal = False

        def body(q, k, v, bias, mask, _aux, _rng, _segment_ids, _cu_seqlens):
            dead = None
            if bias is not None or mask is not None:
                visible = combine_masks(
                    mask, None if bias is None else bias > -jnp.inf, positional_mask(t, s, causal=causal)
                )
                dead = ~jnp.any(visible, axis=-1, keepdims=True)  # (.., T, 1): rows with no visible key
                mask = None if mask is None else mask | dead
                bias = None if bias is None else jnp.where(dead, 0, bias)
            out = jax.nn.dot_product_attention(
                q, k, v, bias=bias, mask=mask, scale=scale, is_causal=causal, implementation=implementation
            )
            if dead is not None:
                out = jnp.where(jnp.swapaxes(dead, 1, 2), 0, out)  # (B|1, T, H|1, 1) against (B, T, H, D)
            return out

        return AttentionOutput(attention_outputs=run_sharded(body, md, query, key, value, bias=bias, mask=mask))

    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        """XLA everywhere; on CUDA cuDNN first where it takes the call."""
        _no_packing(arrays.segment_ids, arrays.cu_seqlens)
        query, key, value = arrays.qkv
        b, hq, t, s = query.shape[0], query.shape[3 - call.seq_axis], query.shape[call.seq_axis], key.shape[call.seq_axis]
        if call.backend != "cuda" and query.dtype == jnp.bfloat16 and b * hq * t * s == 1:
            # A single logit makes XLA:CPU emit the bf16 dot elementally, which it cannot do for
            # jax.nn's bf16 x bf16 -> f32 algorithm: compute in float32 (the inputs are exact there).
            out = self.compute(call, arrays.replace(query=query.astype(jnp.float32), key=key.astype(jnp.float32),
                                                    value=value.astype(jnp.float32)))
            return out.replace(attention_outputs=out.attention_outputs.astype(jnp.bfloat16))
        bthd = arrays.qkv if call.layout == "BTHD" else tuple(map(_swap, arrays.qkv))
        out = self._cudnn(call, arrays, bthd) if call.backend == "cuda" else None
        if out is None:
            out = self._attend(call, *bthd, arrays.bias, arrays.mask, "xla")
            out = out if call.layout == "BTHD" else _swap_out(out)
        return out

    def _cudnn(self, call: AttentionCall, arrays: CallArrays, bthd) -> Optional[AttentionOutput]:
        """cuDNN's fused attention when it takes the call, else None (XLA then)."""
        if cudnn_reasons(AttentionInputs.from_arrays(*bthd, platform="gpu", backend="cuda")):
            return None
        plain = arrays.bias is None and arrays.mask is None and call.sliding_window is None
        if call.layout == "BHTD" and plain and self.metadata.mesh is None:
            out = _cudnn_bhtd(*arrays.qkv, call.causal, call.scale_for(arrays.query.shape[-1]), self.metadata)
            if out is not None:
                return AttentionOutput(attention_outputs=out)
        try:
            out = self._attend(call, *bthd, arrays.bias, arrays.mask, "cudnn")
            return out if call.layout == "BTHD" else _swap_out(out)
        except (NotImplementedError, ValueError):
            return None  # a shape or mask cuDNN rejects at trace time


def _no_packing(segment_ids, cu_seqlens) -> None:
    """jax.nn has no segment ids or varlen; `__call__` never passes them (capabilities), direct calls fail."""
    if segment_ids is not None or cu_seqlens is not None:
        raise NotImplementedError("sdpa supports neither segment_ids nor cu_seqlens (use 'vanilla' or 'flash').")


def _swap(x):
    return jnp.swapaxes(x, 1, 2)


def _swap_out(out: AttentionOutput) -> AttentionOutput:
    return out.replace(attention_outputs=_swap(out.attention_outputs))


def _cudnn_bhtd(query, key, value, causal, scale, metadata) -> Optional[jax.Array]:
    """cuDNN fused attention on (B, H, T, D) arrays without transposes, or None if unavailable.

    Uses JAX's cuDNN attention entry point with qkv_layout="BNTH" (what jax.nn calls with "BTNH").
    """
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError:
        return None
    dtype = jnp.dtype(metadata.runtime_dtype) if metadata.runtime_dtype else query.dtype
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    try:
        return cudnn.dot_product_attention(
            query, key, value, scale=scale,
            mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK, qkv_layout="BNTH",
        )
    except (NotImplementedError, ValueError, TypeError, AttributeError):
        return None
