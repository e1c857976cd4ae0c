"""`flash_attn_with_kvcache`: flash-attn 2's kvcache call (signature, defaults, semantics) on
`kvcache_attention`.

Differences from flash-attn, all supersets or documented conventions:
    * The LSE of a query that sees no key is -inf (flash-attn gives +inf), as everywhere in jaxattn.
    * cache_leftpad works with paged caches too; page sizes, head dims and rotary_dim need no
      particular multiple.
    * Bad arguments raise AttentionInputError / TypeError naming the argument.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .kvcache_call import kvcache_attention
from .validation import AttentionInputError


def _window(window_size, capacity: int) -> tuple[int, int]:
    """flash-attn's window after its normalisation: sides of `capacity` or more are unbounded (-1)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        raise AttentionInputError(f"window_size={window_size!r}: expected a (left, right) pair of ints >= -1 "
                                  "((-1, -1): no window).")
    return tuple(-1 if w >= capacity else int(w) for w in window_size)


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """flash-attn's `flash_attn_with_kvcache`: append k / v into the cache in place, rotate, attend.

    Args (flash-attn's; shapes in `kvcache_call`'s legend):
        q: (B, T, Hq, D).
        k_cache, v_cache: (Bc, S_max, Hk, D|Dv), or pages (P, PS, Hk, D|Dv) with block_table.
        k, v: (B, T_new, Hk, D|Dv) new keys/values written in place at cache_seqlens + i.
        rotary_cos, rotary_sin: (S_rot, R / 2) with S_rot >= capacity; new key i is rotated at
            position cache_seqlens + i; queries likewise when causal or windowed, else all at
            cache_seqlens. Needs k / v.
        cache_seqlens: (B,) int32 tensor or an int: positions already cached (the end, left
            padding included). None: every sequence fills the whole capacity (not with k / v).
        cache_batch_idx: (B,) int32 cache rows (contiguous caches only).
        cache_leftpad: (B,) int32 first valid position per sequence.
        block_table: (B, max_pages) int32 (a paged cache).
        softmax_scale: default 1 / sqrt(D).
        causal: bottom-right causal mask (query i at position cache_seqlens + T_new - T + i).
        window_size: (left, right) around each query's position, -1 unbounded.
        softcap: > 0 soft-caps the logits (c * tanh(logits / c)); 0 (or less) turns it off.
        rotary_interleaved: True: GPT-J pairs (0, 1), (2, 3), ...; False: GPT-NeoX (i, i + R / 2).
        alibi_slopes: float32 (Hq,) or (B, Hq): -slope * |pos_q - pos_k| added to the logits.
        num_splits: flash-attn's split-K count, a scheduling choice: accepted and ignored. Splitting
            the keys only changes how partial softmaxes are merged, never the result, and the
            kernels here choose their own schedule.
        return_softmax_lse: also return the (B, Hq, T) float32 LSE.

    Returns:
        out (B, T, Hq, Dv); (out, softmax_lse) with return_softmax_lse. As flash-attn's, the
        result carries no autograd history (an inference call).
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise AttentionInputError(f"num_splits={num_splits!r}: expected an int >= 0 (0: automatic).")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap={softcap!r}: expected a float (0.0: off), got {type(softcap).__name__}.")
    if not isinstance(causal, bool):
        raise TypeError(f"causal={causal!r}: expected a bool, got {type(causal).__name__}.")
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        raise AttentionInputError(f"k_cache: expected a 4-D tensor (Bc, S_max, Hk, D) or pages (P, PS, Hk, D), got "
                                  f"{k_cache!r:.80}.")
    paged = isinstance(block_table, torch.Tensor)
    capacity = block_table.shape[-1] * k_cache.shape[1] if paged else k_cache.shape[1]
    window = _window(window_size, capacity)
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise AttentionInputError("cache_seqlens: required with k / v (the positions where the new keys go).")
        cache_seqlens = capacity
    # flash-attn rotates every query at cache_seqlens unless the call is causal or windowed.
    shared_q_position = not causal and window == (-1, -1)
    with torch.no_grad():
        return kvcache_attention(
            q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, cache_batch_idx=cache_batch_idx,
            cache_starts=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
            rotary_interleaved=rotary_interleaved, rotary_shared_q_position=shared_q_position, causal=causal,
            window=window, softcap=float(softcap) if softcap > 0 else None, alibi_slopes=alibi_slopes,
            scale=softmax_scale, return_lse=return_softmax_lse)
