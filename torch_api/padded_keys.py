"""Packed queries against padded per-sequence keys, on `flash_attention`'s varlen path.

A (N, S, Hk, D) key tensor whose sequence n holds the keys k[n, starts[n]:ends[n]] is read, with
no copy, as packed (N * S, Hk, D) keys: sequence n's keys are rows [n * S + starts[n],
n * S + ends[n]), and each stretch between two sequences' keys becomes an extra sequence without
queries (`varlen_gaps`' layout: it adds nothing to any output; its keys get zero gradients). The
queries stay packed with their own cu_seqlens_q (N + 1,); each real sequence gets an empty query
range in front. With `seqused_q`, each unused query tail becomes a gap sequence without keys too
(`seqused`).

    keys (N=2, S=4):   [ . k k . | k k k . ]   starts (1, 0), ends (3, 3)
    packed sequences:  gap | seq 0 | gap | seq 1      cu_k = [0, 1, 3, 4, 7]
    queries:           none| cu_q[0]:cu_q[1] | none | cu_q[1]:cu_q[2]

Users: `kvcache_attention` (caches with per-sequence valid regions) and `flash_attn_varlen_func`
with a `block_table` (pages gathered into (N, max_pages * page_size, Hk, D) copies).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .flash import flash_attention
from .launch import native_config
from .selection import normalize_choice
from .seqused import hide_unused_queries, used_rows, zero_unused
from .varlen_gaps import gap_alibi, gap_boundaries
from .validation import finite_check_exempt


def zero_outside(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """A copy of (N, S, ...) `x` with zeros outside each row's [starts[n], ends[n]) (gradients flow to
    the kept slots only)."""
    j = torch.arange(x.shape[1], device=x.device)[None, :]
    keep = (j >= starts[:, None]) & (j < ends[:, None])
    keep = keep.view(*keep.shape, *(1,) * (x.dim() - 2))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def attend_padded_keys(
    q: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: Optional[int],
    k: torch.Tensor,
    v: torch.Tensor,
    starts: Optional[torch.Tensor],
    ends: torch.Tensor,
    *,
    zeroed: bool,
    causal: bool,
    window: Optional[tuple[int, int]],
    softcap: Optional[float],
    scale: Optional[float],
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    return_lse: bool = False,
    implementation: Union[None, str, Sequence[str]] = None,
    seqused_q: Optional[torch.Tensor] = None,
):
    """`flash_attention` (bottom-right alignment per sequence) of packed q (total_q, Hq, D) with
    `cu_seqlens_q` (N + 1,) against k (N, S, Hk, D), v (N, S, Hk, Dv), sequence n's keys being
    k[n, starts[n]:ends[n]] (int32 (N,) tensors with 0 <= starts <= ends <= S, not read on the host;
    starts None: 0).

    `zeroed`: k and v hold zeros (finite numbers) outside the valid regions. If not, and the XLA
    path runs the call (its formulation multiplies every key and value by its zero weight), zeroed
    copies are made; the native kernels never read those slots. Finiteness is the caller's to check:
    slots outside the valid regions may hold anything.
    alibi_slopes: (Hq,) or (N, Hq); the gap sequences get zero slopes.
    seqused_q: None or (N,) int32 (or int64), already checked: sequence n uses only its first
        seqused_q[n] queries (`seqused`); the other rows give 0, LSE -inf and zero gradients.

    Returns flash_attention's (total_q, Hq, Dv) output, with (Hq, total_q) LSE if `return_lse`.
    """
    n, s = k.shape[0], k.shape[1]
    hq, hk = q.shape[1], k.shape[2]
    # A gap runs from the end of one sequence to the start of the next: at most S keys when every
    # sequence starts at 0, else at most 2 S. (max_seqlen_k bounds every packed sequence.)
    max_seqlen_k = s if starts is None else 2 * s
    if starts is None:
        starts = torch.zeros_like(ends)
    used_q = None if seqused_q is None else used_rows(cu_seqlens_q, seqused_q, q.shape[0])
    if not zeroed or used_q is not None:
        choice = None if implementation is None else normalize_choice(implementation)
        native = native_config((1, hq, q.shape[0], q.shape[2]), (1, hk, n * s, k.shape[3]), v.shape[3], q.dtype,
                               q.device, choice, causal=causal, bottom_right=True, window=window, softcap=softcap,
                               sinks=sinks is not None, dropout_p=dropout_p, lse=return_lse, scale=scale,
                               varlen=(max_seqlen_q or q.shape[0], max_seqlen_k), alibi=alibi_slopes is not None)
        if native is None and not zeroed:
            k, v = zero_outside(k, starts, ends), zero_outside(v, starts, ends)
        if native is None and used_q is not None:
            q = zero_unused(q, used_q)
    base = torch.arange(n, dtype=ends.dtype, device=ends.device) * s  # row of k[n, 0] in the packed keys
    q_starts = cu_seqlens_q[:-1]
    q_ends = cu_seqlens_q[1:] if seqused_q is None else q_starts + seqused_q.to(q_starts.dtype)
    cu_q, cu_k = gap_boundaries(q_starts, q_ends, base + starts, base + ends, key_gaps=True,
                                query_gaps=seqused_q is not None)
    alibi_slopes = gap_alibi(alibi_slopes, 2 if seqused_q is None else 3)  # gaps get zero slopes
    with finite_check_exempt():
        result = flash_attention(
            q, k.reshape(n * s, hk, k.shape[3]), v.reshape(n * s, hk, v.shape[3]), causal=causal,
            causal_alignment="bottom_right", window=window, softcap=softcap, sinks=sinks, cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p, scale=scale,
            return_lse=return_lse, implementation=implementation, alibi_slopes=alibi_slopes)
    return result if used_q is None else hide_unused_queries(result, used_q, return_lse)
