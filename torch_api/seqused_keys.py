"""`seqused_k` on `flash_attention`'s varlen path: sequence n uses only the first seqused_k[n] keys
of its range [cu_seqlens_k[n], cu_seqlens_k[n + 1]).

flash-attn's convention (its varlen kernels take seqused_k[n] as the sequence's key length): the
unused keys are ignored as if absent, so causality, windows and ALiBi align to the used length.
They may hold anything (NaN included) and get zero gradients.

How it runs, with no host read: the used keys of each sequence become a packed sequence of their
own and each unused tail a gap sequence without queries (`key_gaps`):

    keys (cu_k = [0, 5, 8, 12], seqused_k = [3, 2, 1]):   [ k k k . . | k k . | k . . . ]
    packed sequences:   gap | seq 0 | gap | seq 1 | gap | seq 2      cu_k = [0, 0, 3, 5, 7, 8, 9]

The tail of the last sequence (and any row after cu_k[N]) lies outside every packed sequence.
The XLA path multiplies every key and value by its attention weight, zero or not, so it gets
copies with the unused rows zeroed; the native kernels never read those rows.
"""

from __future__ import annotations

import torch

from ..bridge.functorch import is_batched
from .key_gaps import gap_alibi, gap_boundaries
from .validation import AttentionInputError, describe


def check_seqused_k(seqused_k, cu_seqlens_k: torch.Tensor, q: torch.Tensor) -> None:
    """(N,) int32 (or int64) on q's device; on CPU also 0 <= seqused_k[n] <= the length of sequence
    n in cu_seqlens_k (on CUDA that check would cost a host sync)."""
    num_seqs = cu_seqlens_k.numel() - 1
    want = (f"a 1-D int32 tensor of N={num_seqs} used key lengths (one per sequence of cu_seqlens_k) on "
            f"{q.device}, e.g. torch.tensor([3, 0, 7], dtype=torch.int32, device=q.device)")
    if not isinstance(seqused_k, torch.Tensor):
        raise TypeError(f"seqused_k: expected {want}, got {type(seqused_k).__name__}.")
    if seqused_k.dtype not in (torch.int32, torch.int64) or tuple(seqused_k.shape) != (num_seqs,):
        raise AttentionInputError(f"seqused_k: got {describe(seqused_k)}; expected {want}.")
    if seqused_k.device != q.device:
        raise AttentionInputError(f"seqused_k: on {seqused_k.device} but q is on {q.device} (move it with "
                                  ".to(q.device)).")
    if torch._C._are_functorch_transforms_active() and is_batched(seqused_k):
        raise AttentionInputError("seqused_k: vmapped under torch.func.vmap (one set of used lengths per sample), "
                                  "which is not supported; pass it unbatched (in_dims=None).")
    if seqused_k.device.type != "cpu" or torch.compiler.is_compiling():
        return
    used, lengths = seqused_k.tolist(), (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
    for n, (u, length) in enumerate(zip(used, lengths)):
        if not 0 <= u <= length:
            raise AttentionInputError(
                f"seqused_k: values {used}, but sequence {n} uses {u} keys where cu_seqlens_k gives it {length}; "
                f"expected 0 <= seqused_k[n] <= cu_seqlens_k[n + 1] - cu_seqlens_k[n] (lengths {lengths}).")


def used_key_packing(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, seqused_k: torch.Tensor,
                     alibi_slopes):
    """(cu_q, cu_k, alibi_slopes) of the gap layout (module docstring): 2N packed sequences, the odd
    ones the real sequences with their used keys only."""
    starts = cu_seqlens_k[:-1].to(torch.int32)
    return (*gap_boundaries(cu_seqlens_q, starts, starts + seqused_k.to(torch.int32)), gap_alibi(alibi_slopes))


def zero_unused(x: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """A copy of packed (total_k, ...) `x` keeping only the rows of the real (odd) sequences of the
    gap layout's `cu_k`; gradients flow to the kept rows only."""
    rows = torch.arange(x.shape[0], dtype=cu_k.dtype, device=x.device)
    # the packed sequence holding each row: the last one starting at or before it (so empty ones are
    # skipped); rows from cu_k[-1] on get index 2N, even as the gaps'
    seq = torch.searchsorted(cu_k, rows, right=True) - 1
    keep = seq % 2 == 1
    keep = keep.view(-1, *(1,) * (x.dim() - 1))
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
