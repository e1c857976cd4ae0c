"""`flash_attention`: flash-attention features for torch tensors in torch's (B, H, L, E) layout.

Shape legend: B batch, Hq / Hk query / key-value heads (Hq % Hk == 0), L query length, S key
length, E q/k head dim, Ev value head dim.

Causal alignment (L=3, S=5):

    causal_alignment="top_left" (torch)     causal_alignment="bottom_right" (KV cache)
        k: 0 1 2 3 4                            k: 0 1 2 3 4
    q0     x . . . .                        q0     x x x . .
    q1     x x . . .                        q1     x x x x .
    q2     x x x . .                        q2     x x x x x

A window (left, right) keeps keys within `left` before and `right` after each query's diagonal
position (-1: unbounded), following the same alignment.

Segment ids (B, L) / (B, S): query i of batch b sees key j only where their ids are equal (on top of
causality and the window, whose positions stay global).

Varlen packing (flash-attn's layout): with `cu_seqlens_q` / `cu_seqlens_k` (N + 1,), q is
(total_q, Hq, E) and k/v are (total_k, Hk, E|Ev), holding N sequences back to back; sequence n has
queries [cu_q[n], cu_q[n + 1]) and keys [cu_k[n], cu_k[n + 1]). Causality and windows use positions
local to each sequence (bottom-right: offset len_k(n) - len_q(n)). Query rows from cu_q[N] on
(padding) give 0 and LSE -inf. With `seqused_k` (N,), sequence n uses only the first seqused_k[n]
keys of its range and len_k(n) is that used length; with `seqused_q` (N,), only the first
seqused_q[n] queries and len_q(n) is that used length, the unused query rows giving 0 and LSE -inf
as padding rows do (flash-attn 3's `seqused_k` / `seqused_q`; `seqused`).

ALiBi (`alibi_slopes`, flash-attn's convention): the logit of query i and key j gets
-slope * |i + S - L - j|, a distance aligned bottom-right whatever the causal alignment (L=3, S=5:
query 2 is at distance 0 from key 4); with varlen, positions and lengths of each sequence.

LSE of a row that sees no key (fully masked, outside every varlen sequence, no sink): -inf, the log
of an empty sum, on every path (flash-attn returns +inf there). Its output row is 0.
"""

from __future__ import annotations

import math
from typing import Literal, Optional, Sequence, Union

import torch

from ..bridge import jax_op
from ..bridge.functorch import is_batched
from ..jax_core import calls
from .autocast import autocast_dtype, autocast_off, cast
from .launch import native_config
from .native_flash import flash_forward, reverse_grad
from .selection import normalize_choice
from .seqused import check_seqused, hide_unused_queries, used_packing, used_rows, zero_unused
from .validation import AttentionInputError, check_alibi, check_finite, check_qkv, describe, finite_check_reads

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


_flash_jax = jax_op(calls.flash, name="jaxattn.flash", module=__name__)
_flash_lse_jax = jax_op(calls.flash_with_lse, name="jaxattn.flash_lse", num_outputs=2, module=__name__)


def _check_varlen_qkv(q, k, v) -> None:
    """Packed q (total_q, Hq, E), k (total_k, Hk, E), v (total_k, Hk, Ev)."""
    for name, t, want in (("q", q, "(total_q, Hq, E)"), ("k", k, "(total_k, Hk, E)"), ("v", v, "(total_k, Hk, Ev)")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}.")
        if t.dim() != 3:
            raise AttentionInputError(
                f"{name}: with cu_seqlens_q the inputs are packed {want}, got shape {tuple(t.shape)} "
                "(drop cu_seqlens_q/cu_seqlens_k for the (B, H, L, E) layout)."
            )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if k.shape[:2] != v.shape[:2]:
        raise AttentionInputError(f"k and v: (total_k, Hk) differ ({shapes}); they hold the same packed keys.")
    if k.shape[2] != q.shape[2]:
        raise AttentionInputError(f"k: head dim {k.shape[2]} != q head dim {q.shape[2]} ({shapes}).")
    if q.shape[1] % k.shape[1]:
        raise AttentionInputError(f"q: {q.shape[1]} heads is not a multiple of k's {k.shape[1]} heads ({shapes}).")
    # dtypes, devices, empty tensors: the (H, total, E) views are checked like (H, L, E) tensors
    check_qkv(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), enable_gqa=True, names=("q", "k", "v"), gqa_flag=False)


def _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q) -> None:
    """(N + 1,) int32/int64 tensors on q's device; their values are not read (no host sync)."""
    if cu_seqlens_k is None:
        raise AttentionInputError("cu_seqlens_k: required with cu_seqlens_q (the (N + 1,) cumulative key lengths).")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64) or t.numel() < 2:
            raise AttentionInputError(
                f"{name}: expected a 1-D int32 tensor of N + 1 >= 2 cumulative lengths, got {describe(t)} "
                "(e.g. torch.tensor([0, 5, 12], dtype=torch.int32, device=q.device))."
            )
        if t.device != q.device:
            raise AttentionInputError(f"{name}: on {t.device} but q is on {q.device} (move it with .to(q.device)).")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise AttentionInputError(
            f"cu_seqlens_q and cu_seqlens_k: lengths {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()} differ; "
            "both hold N + 1 boundaries of the same N sequences."
        )


def _check_cu_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlens, max_seqlen) -> None:
    """Value checks of CPU cu_seqlens (on CUDA they would cost a host sync): 0 first, non-decreasing,
    last entry within the packed length, longest sequence within the given max_seqlen, rounded. Skipped
    while torch.compile traces (the values are data-dependent there)."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if torch._C._are_functorch_transforms_active() and is_batched(cu):
            raise AttentionInputError(
                f"{name}: vmapped under torch.func.vmap (one set of cumulative lengths per sample), which is not "
                "supported; pass it unbatched (in_dims=None), or pack the samples' sequences into one varlen call.")
    if cu_seqlens_q.device.type != "cpu" or torch.compiler.is_compiling():
        return
    bounds = (None, None) if max_seqlen is None else max_seqlen
    for name, cu, total, side, given, bound in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, "q", max_seqlens[0], bounds[0]),
            ("cu_seqlens_k", cu_seqlens_k, total_k, "k", max_seqlens[1], bounds[1])):
        values = cu.tolist()
        steps = [b - a for a, b in zip(values, values[1:])]
        if values[0] != 0 or min(steps) < 0:
            raise AttentionInputError(f"{name}: values {values} must start at 0 and never decrease (cumulative "
                                      f"sequence lengths, e.g. [0, 5, 12]).")
        if values[-1] > total:
            raise AttentionInputError(f"{name}: last value {values[-1]} exceeds the {total} packed rows of {side} "
                                      f"(shape[0]); expected cumulative lengths ending at most at {total}.")
        if given is not None and max(steps) > bound:
            raise AttentionInputError(f"max_seqlen_{side}={given!r}: the longest sequence in {name} {values} is "
                                      f"{max(steps)} (> {bound}, the bound rounded up to a power of two); expected "
                                      f"None or an int >= {max(steps)}.")


def _max_seqlen(name: str, value, total: int) -> int:
    """A per-sequence length bound as a static argument, rounded up to a power of two (at most `total`)."""
    if value is None:
        return total
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AttentionInputError(f"{name}={value!r}: expected None or a Python int >= 1 (the longest sequence).")
    return min(1 << (value - 1).bit_length(), total)


def _segment_pair(segment_ids, q, b: int, l: int, s: int):
    """(q_ids (B, L), kv_ids (B, S) or None when one tensor serves both) from the `segment_ids` argument."""
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise AttentionInputError(f"segment_ids: expected a (q_ids, kv_ids) pair, got {len(segment_ids)} items.")
        pairs = (("q_ids", segment_ids[0], (b, l)), ("kv_ids", segment_ids[1], (b, s)))
    else:
        if l != s:
            raise AttentionInputError(
                f"segment_ids: one tensor ({describe(segment_ids)}) serves queries and keys, so it needs L == S, "
                f"but L={l} and S={s}; pass a pair (q_ids (B, L)=({b}, {l}), kv_ids (B, S)=({b}, {s}))."
            )
        pairs = (("segment_ids", segment_ids, (b, l)),)
    for name, t, want in pairs:
        if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES or tuple(t.shape) != want:
            raise AttentionInputError(
                f"segment_ids: {name} has {describe(t)}; expected an integer tensor of shape (B, "
                f"{'S' if name == 'kv_ids' else 'L'}) = {want}."
            )
        if t.device != q.device:
            raise AttentionInputError(f"segment_ids: {name} is on {t.device} but q is on {q.device} (move it with "
                                      ".to(q.device)).")
    return pairs[0][1], (pairs[1][1] if len(pairs) == 2 else None)


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise AttentionInputError(f"dropout_p={dropout_p!r}: expected a float in [0, 1) (0 disables dropout).")
    return float(dropout_p)


def _check_options(causal_alignment, window, softcap, sinks, scale, hq: int, device) -> Optional[tuple[int, int]]:
    if causal_alignment not in ("top_left", "bottom_right"):
        raise AttentionInputError(f"causal_alignment={causal_alignment!r}: expected 'top_left' or 'bottom_right'.")
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or not all(
                isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window):
            raise AttentionInputError(f"window={window!r}: expected (left, right) ints >= -1.")
        window = tuple(window)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not 0 < softcap < math.inf):
        raise AttentionInputError(f"softcap={softcap!r}: expected a positive finite float or None.")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != hq:
            raise AttentionInputError(
                f"sinks: expected a (Hq,) or (Hq, n) tensor with Hq={hq}, got "
                f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}."
            )
        if not sinks.dtype.is_floating_point or sinks.device != device:
            raise AttentionInputError(f"sinks: expected a float tensor on {device}, got {sinks.dtype} on {sinks.device}.")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale={scale!r}: expected None or a finite float, got {type(scale).__name__}.")
    if scale is not None and not math.isfinite(scale):
        raise AttentionInputError(f"scale={scale!r}: expected None or a finite float.")
    return window


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: expected a bool, got {type(value).__name__}.")


def check_same_batch(q: torch.Tensor, k: torch.Tensor) -> None:
    """q and k/v must share the batch dim (check_qkv lets a key batch of 1 broadcast, as torch's SDPA does)."""
    if k.shape[0] != q.shape[0]:
        raise AttentionInputError(f"k: batch {k.shape[0]} != q batch {q.shape[0]} (q {tuple(q.shape)}, "
                                  f"k {tuple(k.shape)}); expected equal batch dims (this API does not broadcast "
                                  "them: expand k and v).")


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    segment_ids: Union[None, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    dropout_p: float = 0.0,
    scale: Optional[float] = None,
    return_lse: bool = False,
    implementation: Union[None, str, Sequence[str]] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
    seqused_q: Optional[torch.Tensor] = None,
):
    """Attention with flash-attention features, differentiable and torch.compile-traceable.

    Two layouts: padded (B, H, L, E) tensors, or, with `cu_seqlens_q`, flash-attn's varlen layout
    of packed (total, H, E) tensors (see the module docstring).

    Args:
        q: (B, Hq, L, E), or (total_q, Hq, E) with cu_seqlens.
        k: (B, Hk, S, E), or (total_k, Hk, E); K/V heads are never repeated in memory.
        v: (B, Hk, S, Ev), or (total_k, Hk, Ev).
        causal: apply a causal mask aligned by `causal_alignment` (see the module docstring); with
            cu_seqlens, per sequence.
        causal_alignment: "top_left" (torch's is_causal) or "bottom_right".
        window: (left, right) sliding window, -1 = unbounded on that side.
        softcap: c in c * tanh(logits / c).
        sinks: (Hq,) or (Hq, n) float attention-sink logits (gpt-oss style); differentiable.
        segment_ids: (B, L) integer tensor used for queries and keys (then L must equal S), or a
            pair (q_ids (B, L), kv_ids (B, S)); query i sees key j only where the ids are equal.
            Any integer dtype (converted to int32 inside JAX); not with cu_seqlens.
        cu_seqlens_q: (N + 1,) int32 (or int64) tensor on q's device: cumulative query lengths of
            the N packed sequences, cu_seqlens_q[0] == 0, non-decreasing, at most total_q (values
            are checked on CPU only: on CUDA a check would cost a host sync).
        cu_seqlens_k: (N + 1,) cumulative key lengths; required with cu_seqlens_q.
        max_seqlen_q: Python int bounding the longest packed query sequence, or None (unknown: the
            packed length bounds it); only with cu_seqlens. GPU kernels size their grid by it. It is
            rounded up to a power of two (at most total_q) before it becomes a static argument of
            the compiled op, so batches with varying longest sequences reuse a few compilations
            instead of compiling once per distinct value.
        max_seqlen_k: the same for keys.
        dropout_p: probability in [0, 1) of dropping an attention weight. The randomness comes from
            torch's RNG on q's device (`torch.manual_seed` reproduces it); backward reuses the
            forward's mask.
        scale: softmax scale, default 1/sqrt(E).
        return_lse: also return the float32 log-sum-exp (sinks included; -inf for rows that see no
            key, where flash-attn returns +inf): (B, Hq, L), or (Hq, total_q) with cu_seqlens
            (flash-attn's varlen convention).
        implementation: None selects automatically (`jax_core.registry.platform_order`): on CUDA
            cuDNN for long sequences with head dims <= 128 when it supports the call, else our flash
            kernels; on CPU "sdpa", then the "vanilla" reference. A name forces one; a tuple of names
            tries them in order.
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes on q's device (with cu_seqlens, B is
            the number of sequences), flash-attn's convention: -slope * |i + S - L - j| is added to
            the logit of query i and key j after scale and soft cap, the distance aligned
            bottom-right whatever `causal_alignment` (with cu_seqlens, positions and lengths of
            each sequence); the slope is per query head (GQA too). The slopes get no gradient.
            The LSE includes the bias as written; flash-attn's causal kernel adds slope * j instead
            (the same output and gradients, an LSE larger by slope * (i + S - L)).
        seqused_k: (N,) int32 (or int64) tensor on q's device, only with cu_seqlens (flash-attn's
            `seqused_k`): sequence n uses only the keys [cu_seqlens_k[n], cu_seqlens_k[n] +
            seqused_k[n]); the rest of its range is ignored as if absent (causality, windows and
            ALiBi align to the used length; those keys may hold anything and get zero gradients).
            Values 0 <= seqused_k[n] <= the sequence's length are checked on CPU only. Read on the
            device (no host sync); with dropout the pattern differs from a call without it.
        seqused_q: (N,) int32 (or int64) tensor on q's device, only with cu_seqlens (flash-attn 3's
            `seqused_q`): sequence n uses only the queries [cu_seqlens_q[n], cu_seqlens_q[n] +
            seqused_q[n]); causality, windows and ALiBi align to that used length. The unused
            query rows may hold anything: their output is 0, their LSE -inf (sinks or not), their
            gradient 0, and the output gradient given for them is not read. Checked and read as
            `seqused_k` is; combines with it.

    Returns:
        (B, Hq, L, Ev) output, or (total_q, Hq, Ev) with cu_seqlens; (output, lse) with `return_lse`.

    Raises:
        AttentionInputError (a ValueError and RuntimeError): malformed arguments.
        TypeError: arguments of the wrong type.
        ValueError / NotImplementedError: no implementation can run the call (with reasons).
    """
    amp = autocast_dtype(q.device) if isinstance(q, torch.Tensor) else None
    if amp is not None:  # as torch's SDPA under autocast: q, k, v in the autocast dtype (autocast.py)
        kind = q.device.type
        with autocast_off(kind):
            return flash_attention(
                *(cast(amp, kind, t) for t in (q, k, v)), causal=causal, causal_alignment=causal_alignment,
                window=window, softcap=softcap, sinks=sinks, segment_ids=segment_ids, cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                scale=scale, return_lse=return_lse, implementation=implementation, alibi_slopes=alibi_slopes,
                seqused_k=seqused_k, seqused_q=seqused_q)
    varlen = cu_seqlens_q is not None
    if varlen:
        _check_varlen_qkv(q, k, v)
        _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q)
        if segment_ids is not None:
            raise AttentionInputError("segment_ids: not with cu_seqlens_q/cu_seqlens_k; pass one packing or the other.")
    else:
        check_qkv(q, k, v, enable_gqa=True, names=("q", "k", "v"), gqa_flag=False)
        if q.dim() != 4:
            raise AttentionInputError(f"q: expected (B, Hq, L, E), got shape {tuple(q.shape)}.")
        check_same_batch(q, k)
        for name, value in (("cu_seqlens_k", cu_seqlens_k), ("max_seqlen_q", max_seqlen_q),
                            ("max_seqlen_k", max_seqlen_k), ("seqused_k", seqused_k), ("seqused_q", seqused_q)):
            if value is not None:
                shown = describe(value) if isinstance(value, torch.Tensor) else repr(value)
                raise AttentionInputError(f"{name} ({shown}): only used with cu_seqlens_q (the varlen layout); pass "
                                          "both cu_seqlens_q and cu_seqlens_k, or drop it.")
    window = _check_options(causal_alignment, window, softcap, sinks, scale, q.shape[1], q.device)
    check_alibi(alibi_slopes, q.shape[1], cu_seqlens_q.numel() - 1 if varlen else q.shape[0], q.device,
                "N sequences" if varlen else "B")
    _check_flag("causal", causal)
    _check_flag("return_lse", return_lse)
    dropout_p = _check_dropout(dropout_p)
    q_ids = kv_ids = None
    if segment_ids is not None:
        q_ids, kv_ids = _segment_pair(segment_ids, q, q.shape[0], q.shape[2], k.shape[2])
    max_seqlen = None
    if varlen and (max_seqlen_q is not None or max_seqlen_k is not None):
        max_seqlen = (_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0]),
                      _max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0]))
    if varlen:
        _check_cu_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], (max_seqlen_q, max_seqlen_k), max_seqlen)
    given_cu_k, used_q = cu_seqlens_k, None  # used_q: (total_q,) bool, the query rows in use
    if seqused_q is not None or seqused_k is not None:  # the same call with the unused rows as gap sequences
        if seqused_q is not None:
            check_seqused("seqused_q", seqused_q, cu_seqlens_q, q)
            used_q = used_rows(cu_seqlens_q, seqused_q, q.shape[0])
        if seqused_k is not None:
            check_seqused("seqused_k", seqused_k, cu_seqlens_k, q)
        cu_seqlens_q, cu_seqlens_k, alibi_slopes = used_packing(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                                                alibi_slopes)
    choice = normalize_choice(implementation) if implementation is not None else None
    # unused rows may hold anything: they are checked (and, for the XLA path, zeroed) below
    check_finite({"q": q if seqused_q is None else None, "k": k if seqused_k is None else None,
                  "v": v if seqused_k is None else None, "sinks": sinks, "alibi_slopes": alibi_slopes})
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32, device=q.device)
    # Packed (total, H, E) tensors are (1, H, total, E) views for the kernels.
    nq, nk, nv = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)) if varlen else (q, k, v)
    native = native_config(tuple(nq.shape), tuple(nk.shape), nv.shape[3], q.dtype, q.device, choice, causal=causal,
                           bottom_right=causal_alignment == "bottom_right", window=window, softcap=softcap,
                           sinks=sinks is not None, dropout_p=dropout_p, lse=return_lse, scale=scale,
                           segments=q_ids is not None,
                           varlen=(max_seqlen or (q.shape[0], k.shape[0])) if varlen else None,
                           alibi=alibi_slopes is not None, grad=reverse_grad(q, k, v, sinks))
    if seqused_k is not None and (native is None or finite_check_reads(k)):
        used_k = used_rows(given_cu_k, seqused_k, k.shape[0])
        zeroed_k, zeroed_v = zero_unused(k, used_k), zero_unused(v, used_k)
        check_finite({"k": zeroed_k, "v": zeroed_v})
        if native is None:
            k, v = zeroed_k, zeroed_v
    if seqused_q is not None and (native is None or finite_check_reads(q)):
        zeroed_q = zero_unused(q, used_q)
        check_finite({"q": zeroed_q})
        if native is None:
            q = zeroed_q
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach()  # no gradient, as flash-attn
    if native is not None:
        out, lse = flash_forward(nq, nk, nv, native, sinks=sinks, seed=seed,
                                 segment_ids=None if q_ids is None else (q_ids, q_ids if kv_ids is None else kv_ids),
                                 cu_seqlens=(cu_seqlens_q, cu_seqlens_k) if varlen else None,
                                 alibi_slopes=alibi_slopes, need_lse=return_lse)
        if varlen:  # (1, Hq, total_q, Ev) view of (1, total_q, Hq, Ev) memory -> (total_q, Hq, Ev)
            out, lse = out.transpose(1, 2)[0], lse[0]
        result = (out, lse) if return_lse else out
        return result if used_q is None else hide_unused_queries(result, used_q, return_lse)
    static = dict(
        causal=bool(causal), causal_alignment=causal_alignment, window=window,
        softcap=None if softcap is None else float(softcap), scale=None if scale is None else float(scale),
        dropout_p=dropout_p, max_seqlen=max_seqlen, implementation=choice,
        platform="cpu" if q.device.type == "cpu" else "gpu",
    )
    op = _flash_lse_jax if return_lse else _flash_jax
    result = op(q, k, v, sinks, q_ids, kv_ids, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, **static)
    return result if used_q is None else hide_unused_queries(result, used_q, return_lse)

