"""Packed varlen keys with gap sequences: stretches of keys that no query reads.

`flash_attention`'s varlen layout has no notion of keys to skip inside a sequence's range. A
stretch of keys is skipped by making it a sequence of its own without queries: it adds nothing to
any output and its keys get zero gradients. Each real sequence n, with queries [cu_q[n],
cu_q[n + 1]) and keys [key_starts[n], key_ends[n]), gets such a gap sequence in front, holding the
keys between the previous sequence's end and its start:

    keys:              [ . k k . | k k k . ]   key_starts (1, 4), key_ends (3, 7)
    packed sequences:  gap | seq 0 | gap | seq 1      cu_k = [0, 1, 3, 4, 7]
    queries:           none| cu_q[0]:cu_q[1] | none | cu_q[1]:cu_q[2]

Keys after the last sequence's end lie outside every packed sequence. Everything here runs on the
device (no host read). Users: `padded_keys` (per-sequence key tensors) and `seqused_keys`
(flash-attn's `seqused_k`).
"""

from __future__ import annotations

from typing import Optional

import torch


def gap_boundaries(cu_seqlens_q: torch.Tensor, key_starts: torch.Tensor,
                   key_ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k) of 2N + 1 int32 entries for N real sequences whose keys are the packed rows
    [key_starts[n], key_ends[n]) (non-decreasing, each start at or after the previous end), each
    preceded by a gap sequence without queries."""
    zero = torch.zeros(1, dtype=torch.int32, device=key_starts.device)
    cu_k = torch.cat((zero, torch.stack((key_starts, key_ends), 1).flatten().to(torch.int32)))
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_q = torch.cat((cu_q[:1], torch.stack((cu_q[:-1], cu_q[1:]), 1).flatten()))
    return cu_q, cu_k


def gap_alibi(alibi_slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """ALiBi slopes for the gap layout: per-sequence (N, Hq) slopes become (2N, Hq) with zero rows
    for the gaps (which have no queries, so their slopes never act); (Hq,) slopes serve as they are."""
    if alibi_slopes is None or alibi_slopes.dim() != 2:
        return alibi_slopes
    return torch.stack((torch.zeros_like(alibi_slopes), alibi_slopes), 1).flatten(0, 1)
