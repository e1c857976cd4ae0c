"""`kvcache_attention`: append new keys/values to a KV cache in place, rotate, attend, in one call.

Shape legend: B batch, T new queries per sequence (any number), T_new new keys per sequence,
Hq / Hk query / KV heads (Hq % Hk == 0), D q/k head dim, Dv value head dim, Bc cache rows,
S_max capacity, P pages, PS page size, S_rot rotary table rows, R rotary_dim.

Caches (flash-attn's kvcache layouts; the caller owns them):
    contiguous: k_cache (Bc, S_max, Hk, D), v_cache (Bc, S_max, Hk, Dv); sequence b lives in row
        b, or in row cache_batch_idx[b].
    paged: k_cache (P, PS, Hk, D), v_cache (P, PS, Hk, Dv) with block_table (B, max_pages):
        position j of sequence b is slot j % PS of page block_table[b, j // PS].

What one call does, per sequence b (L = cache_seqlens[b], s = cache_starts[b] or 0):
    1. rotary (rotary_cos / rotary_sin given): new key i is rotated at position L + i; query i at
       position L + i (or at L for every query with rotary_shared_q_position=True), flash-attn's
       rule, which matches the attention positions below when T == T_new. Positions are absolute
       cache positions (left padding included).
    2. append (k / v given): new key/value i is written into the cache at position L + i, in place
       (an index_put of the T_new new positions; the rest of the cache is not copied).
    3. attention of the T queries to the keys [s, L + T_new). The queries are the LAST T positions
       (query i at position L + T_new - T + i, flash-attn's bottom-right alignment):

    position:    0 1 2 3 4 5       L=4, s=1, T_new=T=2 (positions 4, 5 appended)
    causal  q0   . x x x x .       query i sees keys up to its own position,
            q1   . x x x x x
    !causal q0   . x x x x x       every query sees all the sequence's keys, new ones included
            q1   . x x x x x

    A window (left, right) keeps keys within `left` before and `right` after each query's
    position (-1: unbounded; `right` is moot with causal). ALiBi adds -slope * |pos_q - pos_k|.

How it runs: T <= 16 on the decode kernels (`decode_attention`'s, which read the cache in place and
compute ALiBi themselves; a contiguous cache with cache_batch_idx is read as pages of S_max
positions). Longer calls on the flash kernels' varlen path (`flash_attention` with cu_seqlens):
a contiguous cache without cache_batch_idx is read in place as packed keys (the stretches between
sequences' valid regions are sequences without queries) by the Triton kernels; a paged cache, or
cache_batch_idx, is first gathered into (B, capacity, Hk, D) per-sequence copies (the pages each
block-table row names). Where the XLA bridge runs the flash call (CPU, float64, ...), it gets
copies whose slots outside the valid regions are zeroed.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..jax_core.base import DECODE_MAX_QUERY_LEN
from .decode import run_decode
from .kvcache_checks import KVCacheCall, check_kvcache_call
from .padded_keys import attend_padded_keys
from .rotary import apply_rotary
from .validation import AttentionInputError, check_finite


def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: Union[int, torch.Tensor],
    *,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_starts: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    rotary_interleaved: bool = False,
    rotary_shared_q_position: bool = False,
    causal: bool = True,
    window: Union[None, int, tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Appends k / v to the cache in place, applies rotary, and attends q to each sequence's keys.

    See the module docstring for the positions, the masks and the kernels that run.

    Args:
        q: (B, T, Hq, D) new queries, any T; in the cache's dtype, on its device.
        k_cache: (Bc, S_max, Hk, D) contiguous, or pages (P, PS, Hk, D) with `block_table`.
            Written in place when k / v are given.
        v_cache: the same layout with head dim Dv.
        cache_seqlens: (B,) int32 (or int64) positions already in each sequence's cache (the
            exclusive end, left padding included), or one int for every sequence.
        k, v: (B, T_new, Hk, D) / (B, T_new, Hk, Dv) new keys and values to append at
            [cache_seqlens, cache_seqlens + T_new); both or neither. They are not modified.
        block_table: (B, max_pages) int32 page indices of a paged cache (capacity max_pages * PS).
        cache_batch_idx: (B,) int32 cache row of each sequence (contiguous caches only); with
            repeated rows and k / v, which sequence's new values land there is unspecified.
        cache_starts: (B,) int32 first valid position per sequence (left padding), <=
            cache_seqlens; None: 0.
        rotary_cos, rotary_sin: (S_rot, R / 2) float tables, S_rot >= capacity, R <= D; applied
            to q and the new keys (needs k / v). Computed in float32 (float64 for float64 inputs).
        rotary_interleaved: True: GPT-J pairs (dims 2i, 2i + 1); False: GPT-NeoX pairs (i, i + R/2).
        rotary_shared_q_position: True: every query is rotated at position cache_seqlens (flash-
            attn's convention for calls neither causal nor windowed); False: query i at
            cache_seqlens + i.
        causal: True: query i sees keys up to its own position; False: all the sequence's keys.
        window: (left, right) ints >= -1, an int w (= (w, -1)), or None (unbounded).
        softcap: c > 0: logits -> c * tanh(logits / c).
        alibi_slopes: float32 (Hq,) or (B, Hq): -slope * |pos_q - pos_k| added to the logits
            (after scale and soft cap).
        sinks: (Hq,) or (Hq, n) float attention-sink logits.
        scale: softmax scale, default 1 / sqrt(D).
        return_lse: also return the (B, Hq, T) float32 log-sum-exp of each query's logits.

    Returns:
        (B, T, Hq, Dv) in q's dtype; (out, lse) with `return_lse`. A query that sees no key gives
        zeros and LSE -inf.

    Not differentiable: an inference call (it writes the cache in place). Under grad mode with an
    input that requires grad it raises; use `flash_attention` to train.

    Raises:
        AttentionInputError (a ValueError and RuntimeError): malformed arguments, or inputs that
            require grad. Lengths, starts, batch indices and block tables are range-checked on CPU
            tensors (on CUDA that would cost a host synchronisation).
        TypeError: arguments of the wrong type.
    """
    call = check_kvcache_call(
        q, k_cache, v_cache, cache_seqlens, k=k, v=v, block_table=block_table, cache_batch_idx=cache_batch_idx,
        cache_starts=cache_starts, rotary_cos=rotary_cos, rotary_sin=rotary_sin, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, scale=scale,
        flags=dict(rotary_interleaved=rotary_interleaved, rotary_shared_q_position=rotary_shared_q_position,
                   causal=causal, return_lse=return_lse))
    inputs = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                  sinks=sinks, alibi_slopes=alibi_slopes)
    if torch.is_grad_enabled():
        grads = [name for name, t in inputs.items() if t is not None and t.requires_grad]
        if grads:
            raise AttentionInputError(f"kvcache_attention is not differentiable (it writes the cache in place), but "
                                      f"{', '.join(grads)} require grad; call it under torch.no_grad() or "
                                      "torch.inference_mode() (flash_attention trains).")
    check_finite({"q": q, "k": k, "v": v, "sinks": sinks, "alibi_slopes": alibi_slopes})
    if rotary_cos is not None:
        offsets = torch.arange(max(call.t, call.t_new), dtype=torch.int32, device=q.device)
        k_positions = call.lengths[:, None] + offsets[None, : call.t_new]
        q_positions = (call.lengths[:, None].expand(call.b, call.t) if rotary_shared_q_position
                       else call.lengths[:, None] + offsets[None, : call.t])
        k = apply_rotary(k, rotary_cos, rotary_sin, k_positions, interleaved=rotary_interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, q_positions, interleaved=rotary_interleaved)
    if k is not None:
        _append(call, k_cache, v_cache, k, v)
    ends = call.lengths + call.t_new
    if call.t <= DECODE_MAX_QUERY_LEN:
        out, lse = _on_decode_kernels(call, q, k_cache, v_cache, ends, sinks, alibi_slopes, causal=causal,
                                      softcap=softcap, scale=scale)
    else:
        out, lse = _on_flash_kernels(call, q, k_cache, v_cache, ends, sinks, alibi_slopes, causal=causal,
                                     softcap=softcap, scale=scale)
    return (out, lse) if return_lse else out


def _append(call: KVCacheCall, k_cache, v_cache, k, v) -> None:
    """Writes new position i of sequence b at cache position lengths[b] + i (in place)."""
    dev = k_cache.device
    positions = call.lengths[:, None].long() + torch.arange(call.t_new, device=dev)[None, :]  # (B, T_new)
    if call.paged:
        rows = torch.arange(call.b, device=dev)[:, None]
        page_size = k_cache.shape[1]
        pages = call.block_table[rows, positions // page_size].long()
        k_cache[pages, positions % page_size] = k
        v_cache[pages, positions % page_size] = v
    else:
        rows = (torch.arange(call.b, device=dev) if call.batch_idx is None else call.batch_idx.long())[:, None]
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v


def _on_decode_kernels(call: KVCacheCall, q, k_cache, v_cache, ends, sinks, alibi_slopes, *, causal, softcap, scale):
    """T <= 16: the decode kernels, which take the queries as the last T positions of `ends` (the
    positions ALiBi measures from, as here)."""
    block_table, layout = call.block_table, "paged" if call.paged else "BSHD"
    if call.batch_idx is not None:  # each cache row is one page of S_max positions: read in place
        block_table, layout = call.batch_idx[:, None], "paged"
    out, lse = run_decode(q.transpose(1, 2), k_cache, v_cache, ends, call.starts, block_table, sinks, causal=causal,
                          window=call.window, softcap=softcap, scale=scale, cache_layout=layout, return_lse=True,
                          kernel=None, alibi_slopes=alibi_slopes)
    return out.transpose(1, 2), lse


def _dense_caches(call: KVCacheCall, k_cache, v_cache):
    """(B, S, Hk, D|Dv) per-sequence caches: the caller's tensors, or gathered copies."""
    if call.paged:
        table = call.block_table.clamp(0, k_cache.shape[0] - 1).long()  # unused entries may hold anything
        return tuple(c[table].flatten(1, 2) for c in (k_cache, v_cache))
    if call.batch_idx is not None:
        rows = call.batch_idx.long()
        return k_cache[rows], v_cache[rows]
    return k_cache, v_cache


def _on_flash_kernels(call: KVCacheCall, q, k_cache, v_cache, ends, sinks, alibi_slopes, *, causal, softcap, scale):
    """The varlen flash path over (B, S, Hk, D) per-sequence caches (`padded_keys`): a contiguous
    cache is read in place, without a copy."""
    kd, vd = _dense_caches(call, k_cache, v_cache)
    b, s, t = call.b, kd.shape[1], call.t
    ends = ends.clamp(max=s)
    starts = None if call.starts is None else torch.minimum(call.starts, ends)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    out, lse = attend_padded_keys(
        q.reshape(b * t, call.hq, q.shape[3]), cu_q, t, kd, vd, starts, ends, zeroed=False, causal=causal,
        window=None if call.window == (-1, -1) else call.window, softcap=softcap, scale=scale,
        alibi_slopes=alibi_slopes, sinks=sinks, return_lse=True)
    return out.view(b, t, call.hq, -1), lse.view(call.hq, b, t).permute(1, 0, 2)
