"""The test suite's one oracle: attention computed by plain torch ops (float64 by default), written from
the documented math (jax_core/kernels/FLASH_CONTRACT.md, the README) and never from jaxattn's code, so
that no product function helps build an expected value.

What is here:

* `visibility`, `segment_visibility`, `varlen_visibility`, `decode_visibility`: which keys a query sees
  (causal with top-left or bottom-right alignment, sliding windows, segment ids, packed sequences,
  ragged decode caches), as bool tensors; `alibi_bias`, `varlen_alibi_bias`: the ALiBi bias;
* `reference`: attention on (B, H, L, D) tensors with GQA / MQA, a bool mask and an additive bias, the
  positional rules above, a logits soft cap, attention sinks, segment ids and a given dropout keep
  mask; returns the output and the log-sum-exp (and the weights on request);
* `reference_grads`, `varlen_reference`, `seqused_reference`, `decode_reference`: the same math with
  gradients, for packed sequences (all their rows, or only the first used ones of each) and for
  ragged (possibly NaN-padded) decode caches;
* `decode_alibi`: flash-attn's ALiBi term for ragged decode caches, as an additive bias;
* `assert_close_finite` and the low-precision rule `assert_dtype_rule` (bf16 / fp16 results: error
  against a high-precision reference at most twice torch's own error in the same dtype, plus a floor).

Conventions (the documented ones): logits = scale * q k^T (scale 1/sqrt(D) by default), then the soft
cap c * tanh(logits / c), then the additive bias; a key is hidden by the positional rule, a False mask
entry, differing segment ids or a -inf bias. Query i sits at position p = i (top-left) or
p = i + S - L (bottom-right); causal shows keys j <= p, a window (left, right) keys
p - left <= j <= p + right (a negative side is unbounded). Sinks are extra logits of each head (shape
(H,) or (H, n)) that join the softmax's normaliser and carry no value. A row that sees nothing gives
output 0 and LSE -inf (LSE = the sinks' log-sum-exp when there are sinks). Every result is finite
where the math is, and autograd through it never produces NaN for hidden keys or empty rows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

NEG_INF = float("-inf")
ALIGNMENTS = ("top_left", "bottom_right")


# ----------------------------------------------------------------------------------------------
# visibility
# ----------------------------------------------------------------------------------------------


def visibility(l: int, s: int, *, causal: bool = False, alignment: str = "top_left",
               window: Optional[tuple[int, int]] = None, offset=None, device=None) -> torch.Tensor:
    """Whether query i may see key j by the positional rules: (L, S) bool.

    Query i sits at position p = i + offset; `offset` defaults to S - L for bottom-right alignment and
    0 for top-left. A (B,) tensor `offset` (one per sequence) gives a (B, 1, L, S) result."""
    if alignment not in ALIGNMENTS:
        raise ValueError(f"alignment={alignment!r}: expected one of {ALIGNMENTS}")
    if offset is None:
        offset = s - l if alignment == "bottom_right" else 0
    i = torch.arange(l, device=device)[:, None]
    pos = i + (offset.to(device).long().view(-1, 1, 1, 1) if torch.is_tensor(offset) else offset)
    j = torch.arange(s, device=device)
    vis = torch.ones(pos.shape[:-1] + (s,), dtype=torch.bool, device=device)
    if causal:
        vis = vis & (j <= pos)
    if window is not None:
        left, right = window
        if left >= 0:
            vis = vis & (j >= pos - left)
        if right >= 0:
            vis = vis & (j <= pos + right)
    return vis


def segment_visibility(q_ids: torch.Tensor, kv_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, S) bool from (B, L) query and (B, S) key segment ids: equal ids see each other."""
    q_ids, kv_ids = torch.as_tensor(q_ids), torch.as_tensor(kv_ids)
    return q_ids[:, None, :, None] == kv_ids.to(q_ids.device)[:, None, None, :]


def _ints(cu) -> list[int]:
    return [int(x) for x in (cu.tolist() if hasattr(cu, "tolist") else cu)]


def varlen_visibility(cu_q, cu_k, t_total: int, s_total: int, *, causal: bool = False,
                      alignment: str = "top_left", window=None, device=None) -> torch.Tensor:
    """(1, 1, T, S) bool for packed sequences: sequence n holds queries [cu_q[n], cu_q[n+1]) and keys
    [cu_k[n], cu_k[n+1]), sees only its own keys, with the positional rules applied inside it (its own
    L_n and S_n for the alignment). Rows and columns past the last sequence see nothing."""
    cu_q, cu_k = _ints(cu_q), _ints(cu_k)
    vis = torch.zeros(1, 1, t_total, s_total, dtype=torch.bool, device=device)
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        vis[0, 0, q0:q1, k0:k1] = visibility(q1 - q0, k1 - k0, causal=causal, alignment=alignment, window=window,
                                             device=device)
    return vis


def decode_visibility(lengths, starts, t: int, s: int, window=None, causal: bool = True) -> torch.Tensor:
    """(B, 1, T, S) bool for T queries against a ragged cache of S slots: the queries of sequence b are
    its last T positions (lengths[b] - T + i); each sees the slots [starts[b], lengths[b]) up to its
    own position (all of them with causal=False), and with a window w only the w positions before it
    (a (left, right) window: the positions within left before and right after it, -1 unbounded)."""
    lengths = torch.as_tensor(lengths).long()
    starts = torch.zeros_like(lengths) if starts is None else torch.as_tensor(starts).long().to(lengths.device)
    if window is not None and not isinstance(window, (tuple, list)):
        window = (window, -1)
    vis = visibility(t, s, causal=causal, window=window, offset=lengths - t, device=lengths.device)
    j = torch.arange(s, device=lengths.device)
    return vis & (j >= starts.view(-1, 1, 1, 1)) & (j < lengths.view(-1, 1, 1, 1))


def alibi_bias(slopes, l: int, s: int, *, offset=None, device=None) -> torch.Tensor:
    """The ALiBi bias -slope * |p - j| as float64 (B|1, Hq, L, S), query i at position p = i + offset
    (`offset` defaults to S - L: flash-attn's bottom-right diagonal, whatever the causal alignment).
    `slopes` is (Hq,) (one per head) or (B, Hq) (one per sequence and head)."""
    slopes = torch.as_tensor(slopes)
    offset = s - l if offset is None else offset
    device = torch.device("cpu") if device is None else device
    i = torch.arange(l, dtype=torch.float64, device=device)[:, None]
    j = torch.arange(s, dtype=torch.float64, device=device)[None, :]
    per_row = slopes.to(device=device, dtype=torch.float64).reshape(-1, slopes.shape[-1])  # (B|1, Hq)
    return -per_row[:, :, None, None] * (i + offset - j).abs()


def varlen_alibi_bias(slopes, cu_q, cu_k, t_total: int, s_total: int, device=None) -> torch.Tensor:
    """`alibi_bias` for packed sequences: (1, Hq, T, S) float64, sequence n's block with its own L_n,
    S_n and slopes (row n of a (N, Hq) `slopes`, or the shared (Hq,) ones); 0 outside the blocks
    (those pairs are hidden anyway)."""
    slopes = torch.as_tensor(slopes)
    cu_q, cu_k = _ints(cu_q), _ints(cu_k)
    bias = torch.zeros(1, slopes.shape[-1], t_total, s_total, dtype=torch.float64, device=device)
    for n, (q0, q1, k0, k1) in enumerate(zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])):
        row = slopes[n] if slopes.dim() == 2 else slopes
        bias[0, :, q0:q1, k0:k1] = alibi_bias(row, q1 - q0, k1 - k0, device=device)[0]
    return bias


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def reference(q, k, v, *, causal=False, alignment="top_left", window=None, softcap=None, sinks=None, scale=None,
              bias=None, mask=None, segment_ids=None, dropout_keep=None, dropout_p=0.0, dtype=torch.float64,
              return_probs=False):
    """Attention by plain torch ops in `dtype` (float64: the oracle; a low precision: torch's own
    same-dtype result for `assert_dtype_rule`).

    Args:
        q, k, v: (B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv); Hq a multiple of Hk (GQA / MQA).
        causal, alignment, window: the positional rules (see `visibility`).
        softcap: logits soft cap, or None.
        sinks: (Hq,) or (Hq, n) sink logits, or None.
        scale: logits scale (default 1 / sqrt(D)).
        bias: additive bias broadcastable to (B, Hq, L, S); -inf hides a key.
        mask: bool (or 0 / 1) mask broadcastable to (B, Hq, L, S); False hides a key.
        segment_ids: a (q_ids (B, L), kv_ids (B, S)) pair, or None.
        dropout_keep: bool keep mask broadcastable to (B, Hq, L, S); kept weights are scaled by
            1 / (1 - dropout_p). The LSE is the undropped one.
        return_probs: also return the attention weights (after dropout).

    Returns:
        (out (B, Hq, L, Dv), lse (B, Hq, L)) in `dtype`, plus the weights (B, Hq, L, S) with
        `return_probs`.
    """
    q, k, v = (x.to(dtype) for x in (q, k, v))
    b, hq, l, _ = q.shape
    hk, s = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"{hq} query heads is not a multiple of {hk} key heads")
    k, v = (x.repeat_interleave(hq // hk, dim=1) for x in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if bias is not None:
        logits = logits + bias.to(q.device, dtype)
    visible = visibility(l, s, causal=causal, alignment=alignment, window=window, device=q.device)
    if mask is not None:
        visible = visible & mask.to(q.device).bool()
    if segment_ids is not None:
        visible = visible & segment_visibility(*segment_ids).to(q.device)
    visible = visible.expand(logits.shape)
    logits = logits.masked_fill(~visible, NEG_INF)  # a -inf bias hides its key the same way
    columns = logits
    if sinks is not None:
        sink = sinks.to(q.device, dtype).reshape(1, hq, 1, -1).expand(b, hq, l, -1)
        columns = torch.cat([logits, sink], dim=-1)
    # Rows with no finite column take finite stand-ins, so that autograd never meets -inf - -inf.
    live = (columns != NEG_INF).any(-1, keepdim=True)
    lse = torch.logsumexp(torch.where(live, columns, 0.0), dim=-1, keepdim=True)
    probs = torch.where(visible, torch.exp(logits - torch.where(live, lse, 0.0)), 0.0)
    lse = torch.where(live, lse, NEG_INF).squeeze(-1)
    if dropout_keep is not None:
        probs = probs * dropout_keep.to(q.device) / (1 - dropout_p)
    out = probs @ v
    return (out, lse, probs) if return_probs else (out, lse)


def reference_grads(q, k, v, cot, *, bias=None, sinks=None, cu_seqlens=None, **kw):
    """The float64 reference (`varlen_reference` when `cu_seqlens` = (cu_q, cu_k) is given) and its
    gradients of sum(out * cot).

    Returns:
        (out, lse, (dq, dk, dv, dbias, dsinks)), detached; dbias / dsinks are None when not given.
    """
    leaves = [x.detach().clone().double().requires_grad_(True) for x in (q, k, v)]
    extra = [None if x is None else x.detach().clone().double().requires_grad_(True) for x in (bias, sinks)]
    if cu_seqlens is not None:
        out, lse = varlen_reference(*leaves, *cu_seqlens, bias=extra[0], sinks=extra[1], **kw)
    else:
        out, lse = reference(*leaves, bias=extra[0], sinks=extra[1], **kw)
    wrt = leaves + [x for x in extra if x is not None]
    grads = iter(torch.autograd.grad((out * cot.to(out)).sum(), wrt))
    dq, dk, dv = next(grads), next(grads), next(grads)
    dbias, dsinks = (None if x is None else next(grads) for x in extra)
    return out.detach(), lse.detach(), (dq, dk, dv, dbias, dsinks)


def varlen_reference(q, k, v, cu_q, cu_k, *, causal=False, alignment="top_left", window=None, sinks=None, **kw):
    """`reference` for packed sequences on (1, Hq, T, D), (1, Hk, S, D), (1, Hk, S, Dv) tensors: each
    sequence on its own (see `varlen_visibility`); rows past the last sequence give 0 and LSE -inf
    (no sink either). Other keywords (soft cap, scale, dropout, dtype, ...) as for `reference`."""
    t_total, s_total = q.shape[2], k.shape[2]
    mask = varlen_visibility(cu_q, cu_k, t_total, s_total, causal=causal, alignment=alignment, window=window,
                             device=q.device)
    out, lse, *rest = reference(q, k, v, mask=mask, sinks=sinks, **kw)
    padding = torch.arange(t_total, device=q.device) >= _ints(cu_q)[-1]
    lse = torch.where(padding, NEG_INF, lse)
    return (out, lse, *rest)


def used_rows(cu, used, total: int) -> torch.Tensor:
    """Indices of the packed rows [cu[n], cu[n] + used[n]) of every sequence n, in order, out of
    `total` rows (used None: every row of every sequence)."""
    cu = _ints(cu)
    used = [b - a for a, b in zip(cu, cu[1:])] if used is None else _ints(used)
    rows = [r for start, u in zip(cu, used) for r in range(start, start + u)]
    assert all(0 <= r < total for r in rows)
    return torch.tensor(rows, dtype=torch.long)


def seqused_reference(q, k, v, cu_q, cu_k, used_q=None, used_k=None, **kw):
    """`varlen_reference` where sequence n uses only its first used_q[n] queries and used_k[n] keys
    (None: all) of its ranges: the sequences are computed on those rows only, packed without the
    others (so their lengths set the alignment), and the other query rows give 0 and LSE -inf (sinks
    or not). Unused rows are never read: NaN there reaches no result and no gradient. A `bias`
    keyword is over the used rows: (1, Hq, sum(used_q), sum(used_k))."""
    cu_q, cu_k = _ints(cu_q), _ints(cu_k)
    rows_q, rows_k = used_rows(cu_q, used_q, q.shape[2]), used_rows(cu_k, used_k, k.shape[2])
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])] if used_q is None else _ints(used_q)
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])] if used_k is None else _ints(used_k)
    packed_q, packed_k = np.cumsum([0] + lens_q).tolist(), np.cumsum([0] + lens_k).tolist()
    out, lse, *rest = varlen_reference(q[:, :, rows_q.to(q.device)], k[:, :, rows_k.to(k.device)],
                                       v[:, :, rows_k.to(v.device)], packed_q, packed_k, **kw)
    index = rows_q.to(q.device)
    full_out = out.new_zeros(out.shape[:2] + (q.shape[2],) + out.shape[3:]).index_copy(2, index, out)
    full_lse = lse.new_full(lse.shape[:2] + (q.shape[2],), NEG_INF).index_copy(2, index, lse)
    return (full_out, full_lse, *rest)


def decode_reference(q, k, v, lengths, starts, *, window=None, causal=True, **kw):
    """`reference` for T queries (B, Hq, T, D) against dense (B, S, Hkv, D|Dv) caches that hold data in
    [starts, lengths) (NaN or anything elsewhere: zeroed first, and hidden by `decode_visibility`, with
    its `window` and `causal`). Other keywords (soft cap, sinks, scale, bias, dtype, ...) as for
    `reference`."""
    mask = decode_visibility(torch.as_tensor(lengths).cpu(), None if starts is None else torch.as_tensor(starts).cpu(),
                             q.shape[2], k.shape[1], window, causal).to(q.device)
    kk, vv = (torch.nan_to_num(x, nan=0.0).transpose(1, 2) for x in (k, v))
    return reference(q, kk, vv, mask=mask, **kw)


def decode_alibi(slopes, lengths, t: int, s: int, dtype=torch.float64) -> torch.Tensor:
    """flash-attn's ALiBi for a ragged decode cache as a (B|1, Hq, T, S) additive bias: the query at
    position p = lengths[b] - T + i and slot j get -slope * |p - j| (slopes (Hq,) or (B, Hq)); add it
    after the soft cap (`reference(bias=...)`)."""
    slopes = torch.as_tensor(slopes).cpu().to(dtype)
    slopes = slopes[None] if slopes.dim() == 1 else slopes
    pos = torch.as_tensor(lengths).cpu().long()[:, None] - t + torch.arange(t)[None, :]  # (B, T)
    distance = (pos[:, :, None] - torch.arange(s)[None, None, :]).abs().to(dtype)  # (B, T, S)
    return -slopes[:, :, None, None] * distance[:, None]


# ----------------------------------------------------------------------------------------------
# layouts (JAX-side tests hold (B, T, H, D) arrays)
# ----------------------------------------------------------------------------------------------


def from_bthd(x):
    """A (B, T, H, D) NumPy / JAX array as a float64 torch (B, H, T, D) tensor (None stays None)."""
    return None if x is None else torch.from_numpy(np.array(x, np.float64)).transpose(1, 2)


def to_bthd(t):
    """A torch (B, H, T, D) tensor as a (B, T, H, D) NumPy array."""
    return t.detach().cpu().transpose(1, 2).numpy()


# ----------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------


def max_error(got, want) -> float:
    """max |got - want| over the elements where `want` is finite (0.0 when there is none)."""
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    return (got.detach().to(want.device).double()[finite] - want.double()[finite]).abs().max().item()


def _same_nonfinite(name, got, want):
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got).to(finite.device), finite), f"{name}: non-finite pattern differs"


def assert_close_finite(name, got, want, tol=2e-4):
    """`got` has the non-finite pattern of `want` and, elsewhere, a max error <= tol * max(1, |want|)."""
    _same_nonfinite(name, got, want)
    finite = torch.isfinite(want)
    err = max_error(got, want)
    size = want[finite].abs().max().item() if finite.any() else 0.0
    assert err <= tol * max(1.0, size), f"{name}: max error {err}"


def assert_dtype_rule(name, got, want, low, floor):
    """The project's rule for bfloat16 / float16 results (flash-attn's): `got`'s max error against the
    high-precision reference `want` (float32 or float64) is at most twice torch's own error in the same
    dtype (`low`: the same math computed by torch in got's dtype, e.g. `reference(..., dtype=bf16)`;
    or a list of such results, the worst counting), plus a rounding `floor`; non-finite values sit
    where `want` has them."""
    _same_nonfinite(name, got, want)
    lows = list(low) if isinstance(low, (list, tuple)) else [low]
    ours, theirs = max_error(got, want), max(max_error(x, want) for x in lows)
    assert ours <= 2 * theirs + floor, (
        f"{name}: max error {ours:.3e} > 2 x torch's same-dtype error {theirs:.3e} + {floor:.1e}")
