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

    def _attend(self, query, key, value, bias, mask, causal, sliding_window, implementation):
        md = self.metadata
        dtype = jnp.dtype(md.runtime_dtype) if md.runtime_dtype else query.dtype
        query, key, value = (x.astype(dtype) for x in (query, key, value))
        scale = md.scale_for(query.shape[-1])
        t, s = query.shape[1], key.shape[1]
        if sliding_window is not None:
            # Windows go in as an explicit mask so alignment matches `jax_core.masks` exactly.
            mask = combine_masks(mask, positional_mask(t, s, causal=causal, sliding_window=sliding_window))
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

    def forward_native(self, query, key, value, *, bias, mask, causal, causal_alignment, sliding_window,
                       logits_soft_cap, softmax_aux, dropout_rng, return_weights, layout="BTHD",
                       segment_ids=None, cu_seqlens=None, max_seqlen=None) -> AttentionOutput:
        _no_packing(segment_ids, cu_seqlens)
        b, hq, s = query.shape[0], query.shape[2 if layout == "BTHD" else 1], key.shape[1 if layout == "BTHD" else 2]
        if query.dtype == jnp.bfloat16 and b * hq * query.shape[1 if layout == "BTHD" else 2] * s == 1:
            # A single logit makes XLA:CPU emit the bf16 dot elementally, which it cannot do for
            # jax.nn's bf16 x bf16 -> f32 algorithm: compute in float32 (the inputs are exact there).
            out = self.forward_native(*(x.astype(jnp.float32) for x in (query, key, value)), bias=bias, mask=mask,
                                      causal=causal, causal_alignment=causal_alignment, sliding_window=sliding_window,
                                      logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, dropout_rng=dropout_rng,
                                      return_weights=return_weights, layout=layout)
            return out.replace(attention_outputs=out.attention_outputs.astype(jnp.bfloat16))
        if layout == "BHTD":
            return _swap_out(self._attend(*map(_swap, (query, key, value)), bias, mask, causal, sliding_window, "xla"))
        return self._attend(query, key, value, bias, mask, causal, sliding_window, "xla")

    def forward_cuda(self, query, key, value, *, bias, mask, causal, causal_alignment, sliding_window,
                     logits_soft_cap, softmax_aux, dropout_rng, return_weights, layout="BTHD",
                     segment_ids=None, cu_seqlens=None, max_seqlen=None) -> AttentionOutput:
        _no_packing(segment_ids, cu_seqlens)
        btgd = (query, key, value) if layout == "BTHD" else tuple(map(_swap, (query, key, value)))
        inputs = AttentionInputs.from_arrays(*btgd, platform="gpu", backend="cuda")
        if not cudnn_reasons(inputs):
            if layout == "BHTD" and bias is None and mask is None and sliding_window is None and self.metadata.mesh is None:
                out = _cudnn_bhtd(query, key, value, causal, self.metadata)
                if out is not None:
                    return AttentionOutput(attention_outputs=out)
            try:
                out = self._attend(*btgd, bias, mask, causal, sliding_window, "cudnn")
                return out if layout == "BTHD" else _swap_out(out)
            except (NotImplementedError, ValueError):
                pass  # a shape or mask cuDNN rejects at trace time: XLA below
        out = self._attend(*btgd, bias, mask, causal, sliding_window, "xla")
        return out if layout == "BTHD" else _swap_out(out)


def _no_packing(segment_ids, cu_seqlens) -> None:
    """jax.nn has no segment ids or varlen; `__call__` never passes them (capabilities), direct calls fail."""
    if segment_ids is not None or cu_seqlens is not None:
        raise NotImplementedError("sdpa supports neither segment_ids nor cu_seqlens (use 'vanilla' or 'flash').")


def _swap(x):
    return jnp.swapaxes(x, 1, 2)


def _swap_out(out: AttentionOutput) -> AttentionOutput:
    return out.replace(attention_outputs=_swap(out.attention_outputs))


def _cudnn_bhtd(query, key, value, causal, metadata) -> Optional[jax.Array]:
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
            query, key, value, scale=metadata.scale_for(query.shape[-1]),
            mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK, qkv_layout="BNTH",
        )
    except (NotImplementedError, ValueError, TypeError, AttributeError):
        return None
