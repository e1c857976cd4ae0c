"""Which implementation and launcher `scaled_dot_product_attention` would use for a call, and why.

`explain_sdpa` asks the same two decisions a real call makes, in the same order: the launcher's
(`launch.native_decision`: the native Triton launch on CUDA, or the XLA bridge) and, on the XLA
bridge, jax_core's selection (`dispatch.explain_shapes`). `jaxattn doctor` prints it for a
typical prefill and decoding call.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..jax_core import AttentionMetadata
from ..jax_core.dispatch import explain_shapes
from .launch import call_features, current_launcher, describe, native_decision
from .selection import current_implementation, normalize_choice


@dataclasses.dataclass(frozen=True)
class Choice:
    """implementation: canonical name; launcher: "native" or "xla"; reason: why both were chosen."""

    implementation: str
    launcher: str
    reason: str


def explain_sdpa(q_shape, k_shape, dtype: torch.dtype, device, *, is_causal: bool = False,
                 implementation=None) -> Choice:
    """The choice for `scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=...)` on
    (B, Hq, L, E) / (B, Hk, S, E) tensors of `dtype` on `device` (no mask, no dropout), under the
    current `sdpa_implementation` and `sdpa_launcher` contexts.

    Raises:
        ValueError / NotImplementedError: as the call would (a forced implementation that cannot run it).
    """
    for name, shape in (("q_shape", q_shape), ("k_shape", k_shape)):
        if len(tuple(shape)) != 4 or any(int(n) < 1 for n in shape):
            raise ValueError(f"{name}={tuple(shape)!r}: expected 4 positive sizes (B, H, L, E).")
    device = torch.device(device)
    choice = normalize_choice(implementation) if implementation is not None else current_implementation()
    l, s = q_shape[2], k_shape[2]
    inputs = describe(q_shape, k_shape, k_shape[3], dtype, call_features(l, s, causal=is_causal))
    native, why = native_decision(inputs, device, choice, current_launcher())
    if native:
        return Choice("flash", "native", why)
    platform = "cpu" if device.type == "cpu" else "gpu"  # as torch_api/sdpa.py passes it to the bridge
    name, selected = explain_shapes(q_shape, k_shape, str(dtype).removeprefix("torch."), causal=is_causal,
                                    implementation=choice, layout="BHTD", metadata=AttentionMetadata(platform=platform))
    return Choice(name, "xla", f"{why}; {selected}")


def typical_calls(device_type: str) -> list[tuple[str, tuple, tuple, torch.dtype, bool]]:
    """(label, q shape, k shape, dtype, causal) of a prefill and a decoding call, as `jaxattn doctor`
    explains them: bf16 on CUDA, float32 elsewhere."""
    dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
    return [("prefill", (1, 8, 512, 64), (1, 8, 512, 64), dtype, True),
            ("decode", (1, 8, 1, 64), (1, 8, 512, 64), dtype, False)]


def describe_call(q_shape, k_shape, dtype: torch.dtype, causal: bool, device_type: Optional[str] = None) -> str:
    b, h, l, e = q_shape
    kind = "causal" if causal else "one query" if l == 1 else "full"
    where = f" {device_type}" if device_type else ""
    return f"B{b} H{h} L{l} S{k_shape[2]} D{e} {kind} {str(dtype).removeprefix('torch.')}{where}"
