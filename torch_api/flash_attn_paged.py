"""Paged K/V in flash-attn's varlen layout: `flash_attn_varlen_func(..., block_table=...)`.

k / v are page pools (num_blocks, page_block_size, Hk, D); row n of block_table (N, max_num_blocks)
lists sequence n's pages in order, and its keys are the first cu_seqlens_k[n + 1] - cu_seqlens_k[n]
positions of those pages (position j: slot j % page_block_size of page block_table[n, j //
page_block_size]). Table entries past a sequence's last page are never read and may hold anything.
With `seqused_k` (N,), sequence n's keys are only its first seqused_k[n] positions; with
`seqused_q` (N,), its queries only the first seqused_q[n] rows of its cu_seqlens_q range (`seqused`).

How it runs: the pages each table row names are gathered into (N, max_num_blocks *
page_block_size, Hk, D) copies (one indexing op, so the pool's gradient is the sum over the
sequences that use each page), the slots past each sequence's length are zeroed, and the copies
are attended as padded per-sequence keys (`padded_keys`) with the queries packed as given. No
value is read on the host for CUDA tensors; the table's values are checked on CPU only.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .decode import check_pages
from .flash import _check_cu_seqlens, _check_cu_values, _max_seqlen
from .padded_keys import attend_padded_keys, zero_outside
from .seqused import check_seqused, used_rows, zero_unused
from .validation import AttentionInputError, check_alibi, check_finite, describe, finite_check_reads

_POOL = "(num_blocks, page_block_size, nheads_k, headdim)"


def _check_pools(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}.")
    if q.dim() != 3:
        raise AttentionInputError(f"q: expected shape (total_q, nheads, headdim), got {tuple(q.shape)}.")
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    for name, t in (("k", k), ("v", v)):
        if t.dim() != 4:
            raise AttentionInputError(f"{name}: with block_table, expected the paged cache {_POOL}, got shape "
                                      f"{tuple(t.shape)} (without block_table it is packed (total_k, nheads_k, "
                                      "headdim)).")
        if t.dtype != q.dtype or t.device != q.device:
            raise AttentionInputError(f"{name}: {t.dtype} on {t.device}, but q is {q.dtype} on {q.device}; expected "
                                      f"q's dtype and device (e.g. {name}.to(q)).")
    if k.shape[:3] != v.shape[:3] or k.shape[3] != q.shape[2] or k.shape[2] == 0 or q.shape[1] % k.shape[2]:
        raise AttentionInputError(f"k and v: expected pages {_POOL} sharing (num_blocks, page_block_size, nheads_k), "
                                  f"k's headdim equal to q's and nheads a multiple of nheads_k; got {shapes}.")


def _check_block_table(block_table, q, num_seqs: int) -> torch.Tensor:
    want = f"an int32 tensor (batch_size, max_num_blocks_per_seq) with batch_size={num_seqs} on {q.device}"
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: expected {want}, got {type(block_table).__name__}.")
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 or block_table.shape[1] == 0:
        raise AttentionInputError(f"block_table: got {describe(block_table)}; expected {want} (each row lists one "
                                  "sequence's page indices in order).")
    if block_table.shape[0] != num_seqs:
        raise AttentionInputError(f"block_table: {block_table.shape[0]} rows, but cu_seqlens_k holds {num_seqs} "
                                  f"sequences (len(cu_seqlens_k) - 1); expected one row per sequence.")
    if block_table.device != q.device:
        raise AttentionInputError(f"block_table: on {block_table.device} but q is on {q.device} (move it with "
                                  ".to(q.device)).")
    return block_table


def _check_lengths(lengths: torch.Tensor, block_table: torch.Tensor, page_size: int) -> None:
    """On CPU: every sequence fits in its table row (on CUDA that check would cost a host sync)."""
    if lengths.device.type != "cpu" or torch.compiler.is_compiling():
        return
    capacity = block_table.shape[1] * page_size
    over = (lengths > capacity).nonzero()
    if over.numel():
        n = int(over[0, 0])
        raise AttentionInputError(
            f"block_table: sequence {n} has {int(lengths[n])} keys (cu_seqlens_k), more than the "
            f"{block_table.shape[1]} pages of its row hold ({block_table.shape[1]} * page_block_size {page_size} = "
            f"{capacity}); expected max_num_blocks_per_seq * page_block_size >= every sequence's key length.")


def paged_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    block_table: torch.Tensor,
    *,
    causal: bool,
    window: Optional[tuple[int, int]],
    alibi_slopes: Optional[torch.Tensor],
    softcap: Optional[float],
    scale: Optional[float],
    dropout_p: float,
    return_lse: bool,
    implementation: Union[None, str, Sequence[str]],
    seqused_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
):
    """Packed q (total_q, Hq, D) with cu_seqlens_q against the paged k (P, PS, Hk, D) / v (P, PS, Hk,
    Dv) through block_table (N, max_pages) (module docstring); `flash_attention`'s keyword options,
    alignment bottom-right per sequence. Returns (total_q, Hq, Dv), with (Hq, total_q) LSE if
    `return_lse`. Differentiable in q, k and v. `seqused_k` (N,): sequence n's keys are only the first
    seqused_k[n] positions of its pages, `seqused_q` (N,): its queries only the first seqused_q[n] rows
    of its range (`seqused`)."""
    _check_pools(q, k, v)
    _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
    num_seqs = cu_seqlens_k.numel() - 1
    block_table = _check_block_table(block_table, q, num_seqs)
    check_alibi(alibi_slopes, q.shape[1], num_seqs, q.device, "N sequences")
    num_pages, page_size = k.shape[0], k.shape[1]
    capacity = block_table.shape[1] * page_size
    lengths = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
    _check_lengths(lengths, block_table, page_size)
    bounds = None
    if max_seqlen_q is not None or max_seqlen_k is not None:
        bounds = (_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0]),
                  _max_seqlen("max_seqlen_k", max_seqlen_k, capacity))
    _check_cu_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], num_seqs * capacity, (max_seqlen_q, max_seqlen_k), bounds)
    used = "the sequence's length (cu_seqlens_k)"
    if seqused_k is not None:  # fewer keys than cu_seqlens_k gives: only their pages are read
        check_seqused("seqused_k", seqused_k, cu_seqlens_k, q)
        lengths, used = seqused_k.to(torch.int32), "the sequence's used length (seqused_k)"
    if seqused_q is not None:
        check_seqused("seqused_q", seqused_q, cu_seqlens_q, q)
    check_pages(block_table, lengths, None, page_size, num_pages, used, "k")
    # Unchecked on CUDA: clamping keeps the gather in bounds whatever the lengths and the table hold
    # (entries past a sequence's last page may be anything).
    lengths = lengths.clamp(0, capacity)
    pages = block_table.clamp(0, num_pages - 1).long()
    kd, vd = (zero_outside(pool[pages].flatten(1, 2), torch.zeros_like(lengths), lengths) for pool in (k, v))
    checked_q = q
    if seqused_q is not None and finite_check_reads(q):  # unused query rows may hold anything
        checked_q = zero_unused(q, used_rows(cu_seqlens_q, seqused_q, q.shape[0]))
    check_finite({"q": checked_q, "k": kd, "v": vd, "alibi_slopes": alibi_slopes})  # the rows in use only
    return attend_padded_keys(q, cu_seqlens_q, max_seqlen_q, kd, vd, None, lengths, zeroed=True, causal=causal,
                              window=window, softcap=softcap, scale=scale, alibi_slopes=alibi_slopes,
                              dropout_p=dropout_p, return_lse=return_lse, implementation=implementation,
                              seqused_q=seqused_q)
