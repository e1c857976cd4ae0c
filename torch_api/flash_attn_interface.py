"""flash-attn 2's public functions, computed by jaxattn: switch with one import.

    from jaxattn.flash_attn_interface import flash_attn_func   # was: from flash_attn import flash_attn_func

Functions (flash-attn's names, argument names, defaults, layouts and return values):
    flash_attn_func(q, k, v, ...)                        q (B, L, Hq, D), k / v (B, S, Hk, D)
    flash_attn_kvpacked_func(q, kv, ...)                 kv (B, S, 2, Hk, D)
    flash_attn_qkvpacked_func(qkv, ...)                  qkv (B, L, 3, H, D)
    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
                                                         q (total_q, Hq, D), k / v (total_k, Hk, D)
    flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)
                                                         kv (total_k, 2, Hk, D)
    flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, ...)
                                                         qkv (total, 3, H, D)
    flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, ...)
                                                         new queries against a KV cache (append, rotary,
                                                         paged; `flash_attn_kvcache`)

Each one translates its arguments for `jaxattn.torch_api.flash_attention` (which chooses how the
call runs) and nothing more. The conventions, as flash-attn documents them:

* GQA / MQA: Hq must be a multiple of Hk; query head h uses key/value head h // (Hq // Hk).
* causal=True is aligned to the bottom-right corner: query i sees keys j <= i + S - L (L=2, S=5:
  rows 1 1 1 1 0 / 1 1 1 1 1; L=5, S=2: the first three rows see nothing and give 0).
* window_size=(left, right) keeps keys in [i + S - L - left, i + S - L + right], -1 meaning
  unbounded on that side; with causal=True the right side is 0 whatever is given. As flash-attn's
  kernels do, a side >= S (varlen: >= max_seqlen_k) counts as unbounded.
* softcap=0.0 is off; c > 0 caps the scaled logits to c * tanh(logits / c).
* softmax_scale=None is 1 / sqrt(D).
* alibi_slopes: float32 (Hq,) or (B, Hq) ((N, Hq) for varlen); -slope * |i + S - L - j| is added to
  the logit of query i and key j; the slopes get no gradient.
* dropout_p draws its mask from torch's RNG on q's device (torch.manual_seed reproduces it).
* deterministic=True: on CUDA it selects jaxattn's Triton flash kernels, whose backward writes each
  gradient from one program (no floating-point atomics); on CPU every path is deterministic.

Where the results differ from flash-attn's:

* softmax_lse of a query row that sees no key is -inf (the log of an empty sum; flash-attn: +inf).
* With causal=True and ALiBi, flash-attn's kernel adds slope * j instead of -slope * (i + S - L - j):
  the same output and gradients, but its softmax_lse is larger by slope * (i + S - L) in each row.
  jaxattn's softmax_lse is the log-sum-exp of the logits with the bias as documented above.
* return_attn_probs=True returns (out, softmax_lse, S_dmask). flash-attn fills S_dmask only when
  dropout_p > 0 (an empty tensor otherwise), to expose its dropout pattern to its tests; jaxattn's
  dropout pattern is not exposed, so S_dmask is the same empty (0,) tensor at dropout_p=0 and
  return_attn_probs=True with dropout_p > 0 raises NotImplementedError.
* Varlen `block_table` (paged K/V, `flash_attn_paged`): the pages each table row names are
  gathered into per-sequence copies (the whole row, max_num_blocks_per_seq pages, whatever the
  sequence's length), not read in place; gradients reach the paged k / v. With dropout the
  pattern differs from a non-paged call's (a different packing), not its distribution.
* `seqused_q` / `seqused_k` (sequence n uses only the first seqused_q[n] queries / seqused_k[n]
  keys of its range) are keyword-only extras of `flash_attn_varlen_func`: flash-attn 2's public
  function lacks them, flash-attn 3's has them. Unused query rows give 0 and softmax_lse -inf. With
  dropout the pattern differs from that of the same used rows packed without gaps.
* Inputs may also be float32, and float64 on CPU (softmax_lse is then float64 too); head dims need
  not be multiples of 8.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .flash import flash_attention
from .flash_attn_paged import paged_varlen_attention
from .flash_attn_kvcache import flash_attn_with_kvcache
from .transformers_kwargs import deterministic_choice
from .validation import AttentionInputError

__all__ = [
    "flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

Output = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _window(window_size, causal, seqlen_k) -> Optional[tuple[int, int]]:
    """flash-attn's window_size as jaxattn's `window` (None: unbounded both sides). Sides >= seqlen_k
    become unbounded, as flash-attn's kernels make them. With causal, flash-attn's right side is 0:
    `flash_attention` intersects its causal mask with the window, so the right side is left unbounded
    here (and a window (-1, any) is plain causal)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) and w >= -1 for w in window_size)):
        raise AttentionInputError(f"window_size={window_size!r}: expected a pair (left, right) of ints >= -1 "
                                  "(-1: unbounded on that side; (-1, -1): no window).")
    left, right = window_size
    if _is_int(seqlen_k):
        left, right = (-1 if w >= seqlen_k else w for w in (left, right))
    if causal is True:
        right = -1
    return None if (left, right) == (-1, -1) else (left, right)


def _options(softmax_scale, softcap, deterministic, return_attn_probs, dropout_p, device) -> dict:
    """The keyword arguments of `flash_attention` that do not depend on the layout."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
                                      or not math.isfinite(softmax_scale)):
        raise AttentionInputError(f"softmax_scale={softmax_scale!r}: expected None (1 / sqrt(headdim)) or a "
                                  "finite float.")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise AttentionInputError(f"softcap={softcap!r}: expected 0.0 (off) or a positive finite float (the cap c "
                                  "in c * tanh(logits / c)).")
    for name, flag in (("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r}: expected a bool, got {type(flag).__name__}.")
    # (a dropout_p that is no probability at all is flash_attention's to refuse, by name)
    if return_attn_probs and isinstance(dropout_p, (int, float)) and dropout_p > 0:
        raise NotImplementedError(
            f"return_attn_probs=True with dropout_p={dropout_p!r}: flash-attn returns its dropout pattern in "
            "S_dmask there, which jaxattn does not expose; use dropout_p=0.0 (S_dmask is then empty, as in "
            "flash-attn) or return_attn_probs=False.")
    return dict(scale=None if softmax_scale is None else float(softmax_scale),
                softcap=float(softcap) if softcap > 0 else None, dropout_p=dropout_p, return_lse=return_attn_probs,
                implementation=deterministic_choice(None, device) if deterministic else None)


def _check_dims(tensors: dict, layout: str) -> None:
    for name, (t, dims) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor of shape {layout}, got {type(t).__name__}.")
        if t.dim() != dims:
            raise AttentionInputError(f"{name}: expected shape {layout} ({dims} dims), got {tuple(t.shape)}.")


def _unpack(name: str, packed: torch.Tensor, n: int, dim: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The n tensors stacked along `dim` of a packed qkv / kv tensor (views; gradients flow back)."""
    _check_dims({name: (packed, dim + 3)}, layout)
    if packed.shape[dim] != n:
        raise AttentionInputError(f"{name}: expected shape {layout} with {n} at dim {dim}, got {tuple(packed.shape)}.")
    return packed.unbind(dim)


def _finish(result, return_attn_probs: bool, q: torch.Tensor, to_blhd: bool) -> Output:
    out, lse = result if return_attn_probs else (result, None)
    if to_blhd:  # (B, H, L, D) -> flash-attn's (B, L, H, D), contiguous as flash-attn's output is
        out = out.transpose(1, 2).contiguous()
    if not return_attn_probs:
        return out
    return out, lse, torch.empty((0,), dtype=q.dtype, device=q.device)  # flash-attn's S_dmask at dropout_p=0


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False) -> Output:
    """Attention on flash-attn's (B, L, H, D) layout.

    Args:
        q: (B, L, Hq, D).
        k: (B, S, Hk, D), Hq a multiple of Hk (GQA / MQA).
        v: (B, S, Hk, Dv).
        dropout_p: probability in [0, 1) of dropping an attention weight (0.0 for evaluation).
        softmax_scale: scale of q k^T; None is 1 / sqrt(D).
        causal: bottom-right aligned causal mask (query i sees keys j <= i + S - L).
        window_size: (left, right) sliding window around i + S - L, -1 unbounded.
        softcap: 0.0 off, c > 0 caps the logits at c * tanh(logits / c).
        alibi_slopes: float32 (Hq,) or (B, Hq); -slope * |i + S - L - j| joins each logit.
        deterministic: True selects deterministic kernels on CUDA (always so on CPU).
        return_attn_probs: also return softmax_lse and S_dmask (see the module docstring).

    Returns:
        out (B, L, Hq, Dv); with return_attn_probs, (out, softmax_lse (B, Hq, L) float32, S_dmask (0,)).
    """
    _check_dims({"q": (q, 4), "k": (k, 4), "v": (v, 4)}, "(batch, seqlen, nheads, headdim)")
    opts = _options(softmax_scale, softcap, deterministic, return_attn_probs, dropout_p, q.device)
    result = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                             causal_alignment="bottom_right", window=_window(window_size, causal, k.shape[1]),
                             alibi_slopes=alibi_slopes, **opts)
    return _finish(result, return_attn_probs, q, to_blhd=True)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False) -> Output:
    """`flash_attn_func` with k and v stacked: q (B, L, Hq, D), kv (B, S, 2, Hk, D) (kv[:, :, 0] the keys,
    kv[:, :, 1] the values). Returns out (B, L, Hq, D), or (out, softmax_lse (B, Hq, L), S_dmask)."""
    k, v = _unpack("kv", kv, 2, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False) -> Output:
    """`flash_attn_func` with q, k and v stacked: qkv (B, L, 3, H, D) (self-attention, L == S, no GQA).
    Returns out (B, L, H, D), or (out, softmax_lse (B, H, L), S_dmask)."""
    q, k, v = _unpack("qkv", qkv, 3, 2, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           seqused_q=None, seqused_k=None) -> Output:
    """Attention over N sequences packed back to back (flash-attn's varlen layout).

    Sequence n has queries [cu_seqlens_q[n], cu_seqlens_q[n + 1]) and keys [cu_seqlens_k[n],
    cu_seqlens_k[n + 1]); causality, windows and ALiBi use its own lengths L_n, S_n and positions.

    Args:
        q: (total_q, Hq, D).
        k: (total_k, Hk, D), Hq a multiple of Hk.
        v: (total_k, Hk, Dv).
        cu_seqlens_q: (N + 1,) int32 cumulative query lengths, starting at 0.
        cu_seqlens_k: (N + 1,) int32 cumulative key lengths, starting at 0.
        max_seqlen_q: int, the longest query sequence.
        max_seqlen_k: int, the longest key sequence.
        dropout_p, softmax_scale, causal, window_size, softcap, deterministic, return_attn_probs: as in
            `flash_attn_func` (window sides >= max_seqlen_k count as unbounded).
        alibi_slopes: float32 (Hq,) or (N, Hq).
        block_table: None, or (N, max_num_blocks_per_seq) int32 (or int64) page indices: k and v are
            then paged caches (num_blocks, page_block_size, Hk, D|Dv), and sequence n's keys are the
            first cu_seqlens_k[n + 1] - cu_seqlens_k[n] positions of the pages block_table[n] lists,
            in order (entries past its last page are not read). The pages of every row are gathered
            into an (N, max_num_blocks_per_seq * page_block_size, Hk, D) copy (`flash_attn_paged`);
            results and gradients (to q and to the paged k / v) are those of the same keys packed.
        seqused_q: keyword-only, None or (N,) int32 (or int64) (flash-attn 3's name): sequence n
            uses only the first seqused_q[n] of its cu_seqlens_q queries; causality, windows and
            ALiBi align to that used length. The unused rows may hold anything: their output is 0,
            their softmax_lse -inf, their gradient 0 (their output gradient is not read).
        seqused_k: keyword-only, None or (N,) int32 (or int64) (flash-attn 3's name): sequence n
            uses only the first seqused_k[n] of its cu_seqlens_k keys (with block_table, of its
            pages); the rest are ignored as if absent (causality, windows and ALiBi align to the
            used length; they may hold anything and get zero gradients). flash-attn 2 reads it in
            its internal varlen forward but its public function does not take it; flash-attn 3's
            takes both after max_seqlen_k (seqused_q, then seqused_k), hence keyword-only here.

    Returns:
        out (total_q, Hq, Dv); with return_attn_probs, (out, softmax_lse (Hq, total_q) float32, S_dmask (0,)).
    """
    if block_table is not None:
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q: expected a torch.Tensor (total_q, nheads, headdim), got {type(q).__name__}.")
        opts = _options(softmax_scale, softcap, deterministic, return_attn_probs, dropout_p, q.device)
        result = paged_varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, causal=causal,
            window=_window(window_size, causal, max_seqlen_k), alibi_slopes=alibi_slopes, softcap=opts["softcap"],
            scale=opts["scale"], dropout_p=opts["dropout_p"], return_lse=opts["return_lse"],
            implementation=opts["implementation"], seqused_k=seqused_k, seqused_q=seqused_q)
        return _finish(result, return_attn_probs, q, to_blhd=False)
    _check_dims({"q": (q, 3), "k": (k, 3), "v": (v, 3)}, "(total, nheads, headdim)")
    opts = _options(softmax_scale, softcap, deterministic, return_attn_probs, dropout_p, q.device)
    result = flash_attention(q, k, v, causal=causal, causal_alignment="bottom_right",
                             window=_window(window_size, causal, max_seqlen_k), alibi_slopes=alibi_slopes,
                             cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                             max_seqlen_k=max_seqlen_k, seqused_k=seqused_k, seqused_q=seqused_q, **opts)
    return _finish(result, return_attn_probs, q, to_blhd=False)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False) -> Output:
    """`flash_attn_varlen_func` with k and v stacked: q (total_q, Hq, D), kv (total_k, 2, Hk, D).
    Returns out (total_q, Hq, D), or (out, softmax_lse (Hq, total_q), S_dmask)."""
    k, v = _unpack("kv", kv, 2, 1, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False) -> Output:
    """`flash_attn_varlen_func` with q, k and v stacked: qkv (total, 3, H, D), one (N + 1,) `cu_seqlens`
    and one `max_seqlen` for queries and keys. Returns out (total, H, D), or (out, softmax_lse (H, total),
    S_dmask)."""
    q, k, v = _unpack("qkv", qkv, 3, 1, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
