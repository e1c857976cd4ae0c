"""`seqused_q` / `seqused_k` on `flash_attention`'s varlen path: sequence n uses only the first
seqused_q[n] queries of its range [cu_seqlens_q[n], cu_seqlens_q[n + 1]) and the first seqused_k[n]
keys of its range [cu_seqlens_k[n], cu_seqlens_k[n + 1]).

flash-attn 3's convention (its varlen kernels take the used counts as the sequence's lengths): the
unused rows are ignored as if absent, so causality, windows and ALiBi align to the used lengths.
They may hold anything (NaN included). Unused keys get zero gradients; unused query rows give
output 0 and LSE -inf (as rows outside every sequence, sinks or not), their gradients are 0 and
the output gradient given for them is not read.

How it runs, with no host read: the used rows of each sequence become a packed sequence of their
own and each unused tail a gap sequence (`varlen_gaps`): unused keys without queries, unused
queries without keys.

    keys (cu_k = [0, 5, 8, 12], seqused_k = [3, 2, 1]):   [ k k k . . | k k . | k . . . ]
    packed sequences:   gap | seq 0 | gap | seq 1 | gap | seq 2      cu_k = [0, 0, 3, 5, 7, 8, 9]

With seqused_q the unused query tails become gaps without keys the same way; with both, each real
sequence has a key gap and a query gap in front (3N packed sequences). The tail of the last
sequence (and any row after cu[N]) lies outside every packed sequence.
The XLA path multiplies every query, key and value by a weight, zero or not, so it gets copies with
the unused rows zeroed; the native kernels never read those rows. Both paths' outputs pass through
`hide_unused_queries`, which fixes the unused rows' output and LSE (a query gap row would get the
sinks' LSE) and keeps their output gradient out of the backward pass.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..bridge.functorch import is_batched
from .validation import AttentionInputError, describe
from .varlen_gaps import gap_alibi, gap_boundaries

#: per argument: (its rows, singular and plural; the cumulative lengths it refines)
_SIDES = {"seqused_q": ("query", "queries", "cu_seqlens_q"), "seqused_k": ("key", "keys", "cu_seqlens_k")}


def check_seqused(name: str, seqused, cu_seqlens: torch.Tensor, q: torch.Tensor) -> None:
    """`seqused_q` or `seqused_k` (`name`): (N,) int32 (or int64) on q's device; on CPU also
    0 <= seqused[n] <= the length of sequence n in `cu_seqlens` (on CUDA that check would cost a
    host sync)."""
    side, sides, cu_name = _SIDES[name]
    num_seqs = cu_seqlens.numel() - 1
    want = (f"a 1-D int32 tensor of N={num_seqs} used {side} lengths (one per sequence of {cu_name}) on "
            f"{q.device}, e.g. torch.tensor([3, 0, 7], dtype=torch.int32, device=q.device)")
    if not isinstance(seqused, torch.Tensor):
        raise TypeError(f"{name}: expected {want}, got {type(seqused).__name__}.")
    if seqused.dtype not in (torch.int32, torch.int64) or tuple(seqused.shape) != (num_seqs,):
        raise AttentionInputError(f"{name}: got {describe(seqused)}; expected {want}.")
    if seqused.device != q.device:
        raise AttentionInputError(f"{name}: on {seqused.device} but q is on {q.device} (move it with "
                                  ".to(q.device)).")
    if torch._C._are_functorch_transforms_active() and is_batched(seqused):
        raise AttentionInputError(f"{name}: vmapped under torch.func.vmap (one set of used lengths per sample), "
                                  "which is not supported; pass it unbatched (in_dims=None).")
    if seqused.device.type != "cpu" or torch.compiler.is_compiling():
        return
    used, lengths = seqused.tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    for n, (u, length) in enumerate(zip(used, lengths)):
        if not 0 <= u <= length:
            raise AttentionInputError(
                f"{name}: values {used}, but sequence {n} uses {u} {sides} where {cu_name} gives it {length}; "
                f"expected 0 <= {name}[n] <= {cu_name}[n + 1] - {cu_name}[n] (lengths {lengths}).")


def used_packing(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_q: Optional[torch.Tensor],
                 seqused_k: Optional[torch.Tensor], alibi_slopes):
    """(cu_q, cu_k, alibi_slopes) of the gap layout (module docstring) for the given used lengths
    (at least one of them): 2N packed sequences, 3N with both, the real ones last in each group."""
    q_starts, k_starts = cu_seqlens_q[:-1].to(torch.int32), cu_seqlens_k[:-1].to(torch.int32)
    q_ends = cu_seqlens_q[1:] if seqused_q is None else q_starts + seqused_q.to(torch.int32)
    k_ends = cu_seqlens_k[1:] if seqused_k is None else k_starts + seqused_k.to(torch.int32)
    key_gaps, query_gaps = seqused_k is not None, seqused_q is not None
    cu_q, cu_k = gap_boundaries(q_starts, q_ends, k_starts, k_ends, key_gaps=key_gaps, query_gaps=query_gaps)
    return cu_q, cu_k, gap_alibi(alibi_slopes, 1 + key_gaps + query_gaps)


def used_rows(cu_seqlens: torch.Tensor, seqused: torch.Tensor, total: int) -> torch.Tensor:
    """(total,) bool: whether each packed row is among the first seqused[n] of its sequence n
    (rows after cu_seqlens[N] are in none)."""
    rows = torch.arange(total, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    # the sequence holding each row: the last one starting at or before it (so empty ones are
    # skipped); rows from cu_seqlens[N] on get index N
    seq = torch.searchsorted(cu_seqlens, rows, right=True) - 1
    num_seqs = cu_seqlens.numel() - 1
    inside = seq.clamp(max=num_seqs - 1)
    return (seq < num_seqs) & (rows - cu_seqlens[inside] < seqused.to(cu_seqlens.dtype)[inside])


def zero_unused(x: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """A copy of packed (total, ...) `x` keeping only the rows where `used` (total,) is True;
    gradients flow to the kept rows only."""
    keep = used.view(-1, *(1,) * (x.dim() - 1))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def hide_unused_queries(result, used: torch.Tensor, return_lse: bool):
    """`flash_attention`'s varlen result, out (total_q, Hq, Ev) and LSE (Hq, total_q) if
    `return_lse`, with output 0 and LSE -inf in the rows where `used` is False. The selection also
    gives those rows' output gradient zero weight: a NaN there reaches no other gradient."""
    out, lse = result if return_lse else (result, None)
    out = zero_unused(out, used)
    if not return_lse:
        return out
    return out, torch.where(used, lse, torch.full((), -math.inf, dtype=lse.dtype, device=lse.device))
