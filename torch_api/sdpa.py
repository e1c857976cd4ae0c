"""Drop-in `scaled_dot_product_attention` with torch's semantics, computed by jitted JAX.

Shape legend:
    N: batch dims (any number, including none)   Hq / Hk: query / key-value heads
    L: query length   S: key/value length   E: q/k head dim   Ev: value head dim

Causal alignment (`is_causal=True`, as torch: top-left, query i sees keys j <= i):

    L=3, S=5      k: 0 1 2 3 4
              q0     x . . . .
              q1     x x . . .
              q2     x x x . .
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import torch

from ..bridge import jax_op
from ..jax_core import AttentionMetadata, attention
from .selection import current_implementation, normalize_choice
from .validation import check_finite, check_mask_shape, check_options, check_qkv


@jax_op(name="jaxattn.sdpa")
def _sdpa_jax(query, key, value, attn_mask, seed, *, is_causal, scale, dropout_p, implementation, platform):
    """(B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev) torch-layout arrays -> (B, Hq, L, Ev)."""
    is_bool = attn_mask is not None and attn_mask.dtype == jnp.bool_
    rng = None if seed is None else jax.random.fold_in(jax.random.key(seed[0]), seed[1])
    metadata = AttentionMetadata(softmax_scale=scale, dropout_prob=dropout_p, platform=platform)
    out = attention(
        query, key, value, bias=None if is_bool else attn_mask, mask=attn_mask if is_bool else None,
        causal=is_causal, dropout_rng=rng, implementation=implementation, metadata=metadata, layout="BHTD",
    )
    return out.attention_outputs


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    implementation: Union[None, str, Sequence[str]] = None,
) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`, computed by a JAX implementation.

    Args:
        query: (N, ..., Hq, L, E).
        key: (N, ..., Hk, S, E); leading dims equal to query's or 1.
        value: (N, ..., Hk, S, Ev).
        attn_mask: broadcastable to (N, ..., Hq, L, S); bool (True = attend) or additive float of the
            query's dtype (differentiable). Rows with no visible key give 0.
        dropout_p: dropout probability on the attention weights; the randomness comes from torch's
            RNG on the query's device, so `torch.manual_seed` reproduces it, and backward reuses
            the forward's mask.
        is_causal: top-left causal mask (see the module docstring); exclusive with attn_mask.
        scale: softmax scale; default 1/sqrt(E).
        enable_gqa: allow Hk < Hq with Hq % Hk == 0 (K/V are not repeated in memory).
        implementation: a registered JAX implementation name ("vanilla", "sdpa", ...), a list of
            names tried in order, or None for the `sdpa_implementation` context's choice or
            automatic selection.

    Returns:
        (N, ..., Hq, L, Ev) tensor of the query's dtype on the query's device.

    Raises:
        AttentionInputError (a ValueError and RuntimeError): malformed arguments.
        TypeError: arguments of the wrong type.
        ValueError / NotImplementedError: no implementation can run the call (with reasons).
    """
    check_qkv(query, key, value, enable_gqa)
    check_options(attn_mask, dropout_p, is_causal, scale, query)
    choice = normalize_choice(implementation) if implementation is not None else current_implementation()
    check_finite({"query": query, "key": key, "value": value, "attn_mask": attn_mask})

    if query.dim() == 2:  # (L, E): one sequence, one head
        out = scaled_dot_product_attention(
            query[None], key[None], value[None], attn_mask, dropout_p, is_causal, scale, enable_gqa,
            implementation=choice,
        )
        return out[0]
    *batch, hq, seq_q, _ = query.shape
    hk, seq_k = key.shape[-3], key.shape[-2]
    if attn_mask is not None:
        check_mask_shape(attn_mask, (*batch, hq, seq_q, seq_k))

    # A stride-0 leaf that requires grad needs a gradient per element; the bridge would merge its
    # broadcast dims, so it gets its own memory first.
    query, key, value = map(_dense_if_broadcast_leaf, (query, key, value))
    if attn_mask is not None:
        attn_mask = _dense_if_broadcast_leaf(attn_mask)
    # Fold the N, ... dims into one batch dim; key/value batch dims of size 1 broadcast (zero-copy).
    lead = tuple(batch)
    flat = math.prod(lead)
    q4 = query.reshape(flat, hq, seq_q, query.shape[-1])
    k4 = key.expand(*lead, hk, seq_k, key.shape[-1]).reshape(flat, hk, seq_k, key.shape[-1])
    v4 = value.expand(*lead, hk, seq_k, value.shape[-1]).reshape(flat, hk, seq_k, value.shape[-1])
    mask4 = None
    if attn_mask is not None:
        mask4 = attn_mask.expand(*lead, hq, seq_q, seq_k).reshape(flat, hq, seq_q, seq_k)

    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32, device=query.device)
    out = _sdpa_jax(
        q4, k4, v4, mask4, seed, is_causal=is_causal, scale=None if scale is None else float(scale),
        dropout_p=float(dropout_p), implementation=choice,
        platform="cpu" if query.device.type == "cpu" else "gpu",
    )
    return out.reshape(*lead, hq, seq_q, value.shape[-1])


def _dense_if_broadcast_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.is_leaf and t.requires_grad and 0 in t.stride() else t
