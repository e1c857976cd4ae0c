"""`flash_attention`: flash-attention features for torch tensors in torch's (B, H, L, E) layout.

Shape legend: B batch, Hq / Hk query / key-value heads (Hq % Hk == 0), L query length, S key
length, E q/k head dim, Ev value head dim.

Causal alignment (L=3, S=5):

    causal_alignment="top_left" (torch)     causal_alignment="bottom_right" (KV cache)
        k: 0 1 2 3 4                            k: 0 1 2 3 4
    q0     x . . . .                        q0     x x x . .
    q1     x x . . .                        q1     x x x x .
    q2     x x x . .                        q2     x x x x x

A window (left, right) keeps keys within `left` before and `right` after each query's diagonal
position (-1: unbounded), following the same alignment.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

import torch

from ..bridge import jax_op
from ..jax_core import AttentionMetadata, attention
from .selection import normalize_choice
from .validation import AttentionInputError, check_finite, check_qkv

_DEFAULT_ORDER = ("flash", "sdpa", "vanilla")


def _flash_body(query, key, value, sinks, *, causal, causal_alignment, window, softcap, scale, return_lse,
                implementation, platform):
    out = attention(
        query, key, value, causal=causal, causal_alignment=causal_alignment, sliding_window=window,
        logits_soft_cap=softcap, softmax_aux=sinks, return_lse=return_lse, implementation=implementation,
        metadata=AttentionMetadata(softmax_scale=scale, platform=platform), layout="BHTD",
    )
    return (out.attention_outputs, out.lse) if return_lse else out.attention_outputs


@jax_op(name="jaxattn.flash")
def _flash_jax(query, key, value, sinks, *, causal, causal_alignment, window, softcap, scale, implementation, platform):
    return _flash_body(query, key, value, sinks, causal=causal, causal_alignment=causal_alignment, window=window,
                       softcap=softcap, scale=scale, return_lse=False, implementation=implementation, platform=platform)


@jax_op(name="jaxattn.flash_lse", num_outputs=2)
def _flash_lse_jax(query, key, value, sinks, *, causal, causal_alignment, window, softcap, scale, implementation,
                   platform):
    return _flash_body(query, key, value, sinks, causal=causal, causal_alignment=causal_alignment, window=window,
                       softcap=softcap, scale=scale, return_lse=True, implementation=implementation, platform=platform)


def _not_yet(name: str, value) -> None:
    if value is not None:
        raise NotImplementedError(
            f"{name}={value!r}: not supported by jaxattn's flash kernels yet; pad the batch and pass a "
            "bool attn_mask to scaled_dot_product_attention instead."
        )


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    segment_ids: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    implementation: Union[None, str, Sequence[str]] = None,
):
    """Attention with flash-attention features, differentiable and torch.compile-traceable.

    Args:
        q: (B, Hq, L, E).
        k: (B, Hk, S, E); K/V heads are never repeated in memory.
        v: (B, Hk, S, Ev).
        causal: apply a causal mask aligned by `causal_alignment` (see the module docstring).
        causal_alignment: "top_left" (torch's is_causal) or "bottom_right".
        window: (left, right) sliding window, -1 = unbounded on that side.
        softcap: c in c * tanh(logits / c).
        sinks: (Hq,) or (Hq, n) float attention-sink logits (gpt-oss style); differentiable.
        segment_ids, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: varlen packing and
            segments; not supported yet (raise NotImplementedError).
        dropout_p: must be 0 here for now; `scaled_dot_product_attention` has dropout.
        scale: softmax scale, default 1/sqrt(E).
        return_lse: also return the (B, Hq, L) float32 log-sum-exp (sinks included).
        implementation: None tries "flash", then "sdpa", then "vanilla" (the first that supports the
            call; on CPU that is the reference); a name forces one.

    Returns:
        (B, Hq, L, Ev) output, or (output, lse) with `return_lse`.
    """
    check_qkv(q, k, v, enable_gqa=True)
    if q.dim() != 4:
        raise AttentionInputError(f"q: expected (B, Hq, L, E), got shape {tuple(q.shape)}.")
    for name, value in (("segment_ids", segment_ids), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                        ("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _not_yet(name, value)
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"dropout_p={dropout_p!r}: the flash path has no dropout yet; use scaled_dot_product_attention(dropout_p=...)."
        )
    if causal_alignment not in ("top_left", "bottom_right"):
        raise AttentionInputError(f"causal_alignment={causal_alignment!r}: expected 'top_left' or 'bottom_right'.")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(isinstance(w, int) and w >= -1 for w in window):
            raise AttentionInputError(f"window={window!r}: expected (left, right) ints >= -1.")
        window = tuple(window)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise AttentionInputError(f"softcap={softcap!r}: expected a positive float or None.")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != q.shape[1]:
            raise AttentionInputError(
                f"sinks: expected a (Hq,) or (Hq, n) tensor with Hq={q.shape[1]}, got "
                f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}."
            )
        if not sinks.dtype.is_floating_point or sinks.device != q.device:
            raise AttentionInputError(f"sinks: expected a float tensor on {q.device}, got {sinks.dtype} on {sinks.device}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale={scale!r}: expected None or a float.")
    choice = normalize_choice(implementation) if implementation is not None else _DEFAULT_ORDER
    check_finite({"q": q, "k": k, "v": v})
    static = dict(
        causal=bool(causal), causal_alignment=causal_alignment, window=window,
        softcap=None if softcap is None else float(softcap), scale=None if scale is None else float(scale),
        implementation=choice, platform="cpu" if q.device.type == "cpu" else "gpu",
    )
    if return_lse:
        return _flash_lse_jax(q, k, v, sinks, **static)
    return _flash_jax(q, k, v, sinks, **static)
