"""Packed varlen sequences with gap sequences: stretches of keys that no query reads, and of
queries that read no key.

`flash_attention`'s varlen layout has no notion of rows to skip inside a sequence's range. A
stretch of keys is skipped by making it a sequence of its own without queries: it adds nothing to
any output and its keys get zero gradients. A stretch of queries is skipped the same way, as a
sequence without keys: its rows see nothing (output 0) and send no gradient to any key. Each real
sequence n, with queries [q_starts[n], q_ends[n]) and keys [k_starts[n], k_ends[n]), gets up to
two gap sequences in front, in this order, holding the rows between the previous real sequence's
end and its own start:

    key gap:    no queries, the keys [k_ends[n - 1], k_starts[n])
    query gap:  the queries [q_ends[n - 1], q_starts[n]), no keys

    keys:      [ . k k . | k k k . ]         k_starts (1, 4), k_ends (3, 7)
    queries:   [ q q . | q . . ]             q_starts (0, 3), q_ends (2, 4)
    packed sequences:  kgap | qgap | seq 0 | kgap | qgap | seq 1
    cu_k = [0, 1, 1, 3, 4, 4, 7]   cu_q = [0, 0, 0, 2, 2, 3, 4]

A layout with key gaps only (queries back to back) or query gaps only (keys back to back) leaves
the other kind out: `stride` (1 + number of gap kinds) packed sequences per real one, the real
sequence last. Rows after the last real sequence's end lie outside every packed sequence.
Everything here runs on the device (no host read). Users: `padded_keys` (per-sequence key
tensors) and `seqused` (flash-attn's `seqused_q` / `seqused_k`).
"""

from __future__ import annotations

from typing import Optional

import torch


def gap_boundaries(q_starts: torch.Tensor, q_ends: torch.Tensor, k_starts: torch.Tensor, k_ends: torch.Tensor, *,
                   key_gaps: bool, query_gaps: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_q, cu_k) of stride * N + 1 int32 entries (module docstring) for N real sequences whose
    queries are the packed rows [q_starts[n], q_ends[n]) and keys [k_starts[n], k_ends[n]) ((N,)
    tensors, each start at or after the previous end). Without `key_gaps` the keys must be back to
    back (k_starts[n] == k_ends[n - 1]), without `query_gaps` the queries."""
    q_starts, q_ends, k_starts, k_ends = (t.to(torch.int32) for t in (q_starts, q_ends, k_starts, k_ends))
    # the first key gap holds the keys before k_starts[0] but no query: it ends at q_starts[0]
    previous_q_ends = torch.cat((q_starts[:1], q_ends[:-1]))
    q_columns = [previous_q_ends] * key_gaps + [q_starts] * query_gaps + [q_ends]
    k_columns = [k_starts] * key_gaps + [k_starts] * query_gaps + [k_ends]
    cu_q = torch.cat((q_starts[:1], torch.stack(q_columns, 1).flatten()))
    cu_k = torch.cat((torch.zeros_like(k_starts[:1]), torch.stack(k_columns, 1).flatten()))
    return cu_q, cu_k


def gap_alibi(alibi_slopes: Optional[torch.Tensor], stride: int = 2) -> Optional[torch.Tensor]:
    """ALiBi slopes for a gap layout of `stride` packed sequences per real one: per-sequence (N, Hq)
    slopes become (stride * N, Hq) with zero rows for the gaps (whose rows never meet a key, so
    their slopes never act); (Hq,) slopes serve as they are."""
    if alibi_slopes is None or alibi_slopes.dim() != 2:
        return alibi_slopes
    gaps = [torch.zeros_like(alibi_slopes)] * (stride - 1)
    return torch.stack((*gaps, alibi_slopes), 1).flatten(0, 1)
