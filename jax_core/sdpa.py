"""`sdpa` (aliases `cudnn`, `cuda_flash_attn2`): `jax.nn.dot_product_attention`.

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
from .capabilities import ALL_FLOAT_DTYPES, AttentionInputs, Capabilities
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
        dtypes=ALL_FLOAT_DTYPES,
        features=frozenset({"causal", "bias", "bool_mask", "gqa", "sliding_window", "backward"}),
    )

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("sdpa", "cudnn", "cuda_flash_attn2")

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        if inputs.value_head_dim != inputs.head_dim:
            return [f"value_head_dim={inputs.value_head_dim} != head_dim={inputs.head_dim}"]
        return []

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

        def body(q, k, v, bias, mask, _aux, _rng):
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
                       logits_soft_cap, softmax_aux, dropout_rng, return_weights) -> AttentionOutput:
        return self._attend(query, key, value, bias, mask, causal, sliding_window, "xla")

    def forward_cuda(self, query, key, value, *, bias, mask, causal, causal_alignment, sliding_window,
                     logits_soft_cap, softmax_aux, dropout_rng, return_weights) -> AttentionOutput:
        inputs = AttentionInputs.from_arrays(query, key, value, platform="gpu", backend="cuda")
        implementation = "xla" if cudnn_reasons(inputs) else "cudnn"
        if implementation == "cudnn":
            try:
                return self._attend(query, key, value, bias, mask, causal, sliding_window, "cudnn")
            except (NotImplementedError, ValueError):
                implementation = "xla"  # a layout or mask cuDNN rejects at trace time
        return self._attend(query, key, value, bias, mask, causal, sliding_window, implementation)
