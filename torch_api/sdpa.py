"""Drop-in `scaled_dot_product_attention` with torch's semantics, computed by jitted JAX.

Shape legend:
    N: batch dims (any number, including none)   Hq / Hk: query / key-value heads
    L: query length   S: key/value length   E: q/k head dim   Ev: value head dim

Causal alignment (`is_causal=True`, as torch: top-left, query i sees keys j <= i):

    L=3, S=5      k: 0 1 2 3 4
              q0     x . . . .
              q1     x x . . .
              q2     x x x . .

Per call, everything that depends only on the call's signature (argument checks, the choice of
implementation, reshapes, bucketing, the bridge's prepared call) is looked up in a memo keyed by the
tensors' types, shapes, strides, dtypes, devices and grad flags and the other arguments; only
the NaN check (value-dependent, CPU by default) runs every time. Under torch.compile the plain
path below runs instead, so the graph sees the checks and the custom op.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

from ..bridge import jax_op
from ..bridge.prepared_call import NotPlain, arg_key, static_key
from ..bridge.dlpack import narrow_broadcast
from ..jax_core import calls
from .autocast import autocast_dtype, autocast_off, cast
from .bucketing import bucket_length, current_sequence_buckets
from .launch import NATIVE_DECODE_MAX_KEYS, current_launcher, native_config
from .native_flash import NativeFlash
from .selection import current_implementation, normalize_choice
from .validation import check_finite, check_mask_shape, check_options, check_qkv, finite_check_applies

#: Prepared calls kept before the memo is emptied (each holds keys and small mask tensors).
MAX_PREPARED = 4096
_prepared: dict[tuple, "_PreparedSdpa"] = {}


#: torch's SDPA on the XLA path: (B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev), mask, seed -> (B, Hq, L, Ev).
_sdpa_jax = jax_op(calls.sdpa, name="jaxattn.sdpa", module=__name__)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    implementation: Union[None, str, Sequence[str]] = None,
) -> torch.Tensor:
    """`torch.nn.functional.scaled_dot_product_attention`, computed by a JAX implementation.

    Args:
        query: (N, ..., Hq, L, E).
        key: (N, ..., Hk, S, E); leading dims equal to query's or 1.
        value: (N, ..., Hk, S, Ev).
        attn_mask: broadcastable to (N, ..., Hq, L, S); bool (True = attend) or additive float of the
            query's dtype (differentiable). Rows with no visible key give 0.
        dropout_p: dropout probability on the attention weights; the randomness comes from torch's
            RNG on the query's device, so `torch.manual_seed` reproduces it, and backward reuses
            the forward's mask.
        is_causal: top-left causal mask (see the module docstring); exclusive with attn_mask.
        scale: softmax scale; default 1/sqrt(E).
        enable_gqa: allow Hk < Hq with Hq % Hk == 0 (K/V are not repeated in memory).
        implementation: a registered JAX implementation name ("vanilla", "sdpa", ...), a list of
            names tried in order, or None for the `sdpa_implementation` context's choice or
            automatic selection.

    Returns:
        (N, ..., Hq, L, Ev) tensor of the query's dtype on the query's device (under
        `torch.autocast`, torch's SDPA policy applies first: floating arguments other than float64
        are cast to the autocast dtype). Under `sequence_buckets` it may be a view of a longer
        (padded) result.

    Raises:
        AttentionInputError (a ValueError and RuntimeError): malformed arguments.
        TypeError: arguments of the wrong type.
        ValueError / NotImplementedError: no implementation can run the call (with reasons).
    """
    if scale is not None and type(scale) is not float and (
            isinstance(scale, torch.Tensor) and scale.dim() == 0
            or isinstance(scale, numbers.Real) and not isinstance(scale, (bool, int))):
        scale = float(scale)  # a 0-d tensor or a numpy scalar, as torch accepts
    # A signature seen before was checked and prepared then (a prepared call exists only for plain, non-empty
    # calls outside autocast): the memo comes first, the rare cases below only on a miss.
    sig = None
    # Under torch.func transforms every call takes the plain path: a call prepared outside them may
    # hold a native launch, which implements none of functorch's rules.
    if not torch.compiler.is_compiling() and not torch._C._are_functorch_transforms_active():
        try:
            sig = (
                arg_key(query), arg_key(key), arg_key(value), arg_key(attn_mask), static_key(dropout_p),
                static_key(is_causal), static_key(scale), static_key(enable_gqa),
                static_key(tuple(implementation) if type(implementation) is list else implementation),
                current_implementation(), current_sequence_buckets(), torch.is_grad_enabled(), current_launcher(),
            )
            prepared = _prepared.get(sig)
            if prepared is None and attn_mask is None:
                prepared = _grown_prepared(sig, query, key, value)
        except (NotPlain, AttributeError, TypeError):  # unusual arguments: the plain path checks them
            sig = prepared = None
        if sig is not None:
            if prepared is not None and autocast_dtype(query.device) is None:
                if finite_check_applies(query.device):
                    check_finite({"query": query, "key": key, "value": value, "attn_mask": attn_mask})
                return prepared(query, key, value, attn_mask)
    amp = autocast_dtype(query.device) if isinstance(query, torch.Tensor) else None
    if amp is not None:  # torch's autocast policy for SDPA (see autocast.py)
        kind = query.device.type
        with autocast_off(kind):
            return scaled_dot_product_attention(
                *(cast(amp, kind, t) for t in (query, key, value, attn_mask)), dropout_p=dropout_p,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, implementation=implementation)
    if dropout_p == 1.0 and not isinstance(dropout_p, bool):
        # torch drops every weight: the output and every gradient are zero.
        return scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa,
                                            implementation=implementation) * 0
    if (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor)
            and query.dim() >= 2 and key.dim() >= 2 and query.shape[-1] > 0
            and (0 in query.shape[:-1] or key.shape[-2] == 0 or value.shape[-1] == 0)):
        return _empty(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if sig is not None:
        prepared = _PreparedSdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, implementation)
        if len(_prepared) >= MAX_PREPARED:
            _prepared.clear()
        _prepared[sig] = prepared
        _remember_decoding(sig, prepared, query, key, value, attn_mask)
        if finite_check_applies(query.device):
            check_finite({"query": query, "key": key, "value": value, "attn_mask": attn_mask})
        return prepared(query, key, value, attn_mask)
    return _plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, implementation)


#: Prepared native decoding calls by their signature without the keys' length and strides: a growing
#: KV cache meets a new length every step, whose prepared call is the last one's with its own launch (the checks, the
#: choice and the kernels' settings do not depend on the length in this range; see `native_config`).
_prepared_decoding: dict[tuple, "_PreparedSdpa"] = {}


def _grown_prepared(sig: tuple, query, key, value) -> Optional["_PreparedSdpa"]:
    """The prepared call of a decoding call (L <= 16 < S, no mask) whose signature differs from a
    prepared one's only in the keys' length and strides (kept in the memo), else None."""
    if not (query.dim() == key.dim() == value.dim() == 4 and query.shape[2] <= 16 < key.shape[2]
            <= NATIVE_DECODE_MAX_KEYS and key.shape[2] == value.shape[2]):
        return None
    family = (sig[0], _lengthless(key), _lengthless(value), *sig[3:])
    prepared = _prepared_decoding.get(family)
    if prepared is None:
        return None
    grown = copy.copy(prepared)
    grown.seq_k = key.shape[2]
    grown.native_call = NativeFlash(prepared.native)
    if len(_prepared) >= MAX_PREPARED:
        _prepared.clear()
    _prepared[sig] = grown
    return grown


def _lengthless(t: torch.Tensor) -> tuple:
    """A (B, H, S, D) tensor's signature without S and its strides (whether one is 0 stays: a
    broadcast leaf that needs a gradient does not launch directly)."""
    return (type(t), t.shape[:2], t.shape[3], t.dtype, t.device, t.requires_grad, t.is_leaf, 0 in t.stride())


def _remember_decoding(sig: tuple, prepared: "_PreparedSdpa", query, key, value, attn_mask) -> None:
    if prepared.direct and attn_mask is None and query.shape[2] <= 16 < key.shape[2] <= NATIVE_DECODE_MAX_KEYS:
        if len(_prepared_decoding) >= MAX_PREPARED:
            _prepared_decoding.clear()
        _prepared_decoding[(sig[0], _lengthless(key), _lengthless(value), *sig[3:])] = prepared


def _empty(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """A call with a size-0 batch, query, key or value-head dim, answered as torch does: an empty
    output (B = 0, L = 0, Ev = 0) or, with no keys (S = 0), zeros; the gradients are zeros of the
    inputs' shapes. (A size-0 query/key head dim stays an error.)"""
    check_qkv(query, key, value, enable_gqa, allow_empty=True)
    check_options(attn_mask, dropout_p, is_causal, scale, query)
    out = query.new_zeros((*query.shape[:-1], value.shape[-1]))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        out = out + (query.sum() + key.sum() + value.sum()) * 0
    return out


def _plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, implementation):
    """The call without memo (torch.compile traces this)."""
    check_qkv(query, key, value, enable_gqa)
    check_options(attn_mask, dropout_p, is_causal, scale, query)
    choice = normalize_choice(implementation) if implementation is not None else current_implementation()
    check_finite({"query": query, "key": key, "value": value, "attn_mask": attn_mask})
    return _PreparedSdpa.checked(query, key, value, attn_mask, dropout_p, is_causal, scale, choice)(
        query, key, value, attn_mask, use_prepared_call=False
    )


class _PreparedSdpa:
    """One signature's call, prepared: checks done, implementation chosen, reshapes and padding worked out."""

    def __init__(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, implementation):
        check_qkv(query, key, value, enable_gqa)
        check_options(attn_mask, dropout_p, is_causal, scale, query)
        choice = normalize_choice(implementation) if implementation is not None else current_implementation()
        self._setup(query, key, value, attn_mask, dropout_p, is_causal, scale, choice, current_sequence_buckets())
        if self.native is not None:
            return
        q4, k4, v4, mask4, seed = self._operands(query, key, value, attn_mask, draw_seed=False)
        self.call = _sdpa_jax.prepare(q4, k4, v4, mask4, seed, **self.static)

    @classmethod
    def checked(cls, query, key, value, attn_mask, dropout_p, is_causal, scale, choice) -> "_PreparedSdpa":
        """A prepared call for already checked arguments, without the bridge's prepared call (torch.compile's path)."""
        prepared = cls.__new__(cls)
        prepared._setup(query, key, value, attn_mask, dropout_p, is_causal, scale, choice, current_sequence_buckets())
        return prepared

    def _setup(self, query, key, value, attn_mask, dropout_p, is_causal, scale, choice, buckets):
        self.squeeze = query.dim() == 2  # (L, E): one sequence, one head
        if self.squeeze:
            query, key, value = query[None], key[None], value[None]
        *batch, hq, seq_q, e = query.shape
        hk, seq_k, ev = key.shape[-3], key.shape[-2], value.shape[-1]
        if attn_mask is not None:
            check_mask_shape(attn_mask, (*batch, hq, seq_q, seq_k))
        self.lead, self.flat = tuple(batch), math.prod(batch)
        self.hq, self.hk, self.e, self.ev = hq, hk, e, ev
        # A prepared call's signature holds grad mode and requires_grad, so it knows whether it needs
        # gradients; a compiled one may be replayed either way.
        grad = None if torch.compiler.is_compiling() else (
            torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
        self.native = native_config(
            (self.flat, hq, seq_q, e), (self.flat, hk, seq_k, e), ev, query.dtype, query.device, choice,
            causal=is_causal, mask=None if attn_mask is None else attn_mask.dtype, dropout_p=dropout_p, scale=scale,
            grad=grad)
        self.native_call = None if self.native is None else NativeFlash(self.native)
        if self.native is not None:
            buckets = None  # the native launch compiles once for every length: nothing to bucket
        self.seq_q, self.seq_k = seq_q, seq_k
        self.pad_q = self.pad_k = 0
        self.key_mask: Optional[torch.Tensor] = None
        self.is_causal = is_causal
        if buckets is not None:
            self.pad_q = bucket_length(seq_q, buckets) - seq_q
            self.pad_k = bucket_length(seq_k, buckets) - seq_k
            if self.pad_k and attn_mask is None and not (is_causal and seq_q <= seq_k):
                # Padded keys must get no weight. A causal call with L <= S needs no mask: real
                # query i sees keys j <= i < S only; otherwise the mask carries causality too.
                lq, lk = seq_q + self.pad_q, seq_k + self.pad_k
                cols = torch.arange(lk, device=query.device)
                valid = cols < seq_k
                if is_causal:
                    valid = valid & (cols[None, :] <= torch.arange(lq, device=query.device)[:, None])
                self.key_mask = valid
                self.is_causal = False
        self.static = dict(
            is_causal=self.is_causal, scale=None if scale is None else float(scale), dropout_p=float(dropout_p),
            implementation=choice, platform="cpu" if query.device.type == "cpu" else "gpu",
        )
        self.dropout = dropout_p > 0
        # The call's tensors go to the native launch as they are: 4-D, one batch dim of the same size,
        # no padding, mask or dropout, and no stride-0 leaf that needs its own gradient memory.
        self.direct = (
            self.native_call is not None and not self.squeeze and self.lead == (self.flat,) and attn_mask is None
            and not (self.pad_q or self.pad_k or self.dropout) and self.key_mask is None
            and all(t.dim() == 4 and t.shape[0] == self.flat for t in (key, value))
            and not any(t.is_leaf and t.requires_grad and 0 in t.stride() for t in (query, key, value))
        )

    # -- per call -----------------------------------------------------------------------------------

    def __call__(self, query, key, value, attn_mask, use_prepared_call: bool = True):
        if self.direct:
            return self.native_call(query, key, value)
        q4, k4, v4, mask4, seed = self._operands(query, key, value, attn_mask)
        if self.native is not None:
            is_bool = mask4 is not None and mask4.dtype == torch.bool
            out = self.native_call(q4, k4, v4, bias=None if is_bool else mask4, mask=mask4 if is_bool else None,
                                   seed=seed)
        elif use_prepared_call:
            out = self.call(q4, k4, v4, mask4, seed)
        else:
            out = _sdpa_jax(q4, k4, v4, mask4, seed, **self.static)
        if self.pad_q:
            out = out[:, :, : self.seq_q]
        if self.lead != (self.flat,):
            out = out.reshape(*self.lead, self.hq, self.seq_q, self.ev)
        return out[0] if self.squeeze else out

    def _operands(self, query, key, value, attn_mask, draw_seed: bool = True):
        """(B, Hq, L', E), (B, Hk, S', E), (B, Hk, S', Ev), mask (B, Hq, L', S') or None, seed.

        `draw_seed=False` gives a placeholder seed of the same signature without touching torch's RNG.
        """
        if self.squeeze:
            query, key, value = query[None], key[None], value[None]
        # A stride-0 leaf that requires grad needs a gradient per element; the bridge would merge
        # its broadcast dims, so it gets its own memory first.
        query, key, value = map(_dense_if_broadcast_leaf, (query, key, value))
        if attn_mask is not None:
            attn_mask = _dense_if_broadcast_leaf(attn_mask)
        lead, flat = self.lead, self.flat
        lq, lk = self.seq_q + self.pad_q, self.seq_k + self.pad_k
        if self.pad_q:
            query = F.pad(query, (0, 0, 0, self.pad_q))
        if self.pad_k:
            key, value = F.pad(key, (0, 0, 0, self.pad_k)), F.pad(value, (0, 0, 0, self.pad_k))
            if attn_mask is not None:
                attn_mask = _pad_mask(attn_mask, self.seq_q, self.seq_k, self.pad_q, self.pad_k)
        elif self.pad_q and attn_mask is not None:
            attn_mask = _pad_mask(attn_mask, self.seq_q, self.seq_k, self.pad_q, 0)
        if self.key_mask is not None:
            attn_mask = self.key_mask
        # Fold the N, ... dims into one batch dim; key/value batch dims of size 1 broadcast (zero-copy).
        q4 = query if query.dim() == 4 and lead == (flat,) else query.reshape(flat, self.hq, lq, self.e)
        k4 = _fold(key, lead, flat, (self.hk, lk, self.e))
        v4 = _fold(value, lead, flat, (self.hk, lk, self.ev))
        mask4 = None if attn_mask is None else _fold(attn_mask, lead, flat, (self.hq, lq, lk))
        seed = None
        if self.dropout:
            seed = (torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32, device=query.device) if draw_seed
                    else torch.zeros(2, dtype=torch.int32, device=query.device))
        return q4, k4, v4, mask4, seed


def _fold(t: torch.Tensor, lead: tuple, flat: int, tail: tuple) -> torch.Tensor:
    """`t` broadcast to (*lead, *tail) and reshaped to (flat, *tail), zero-copy where possible."""
    if t.dim() == 4 and lead == (flat,) and tuple(t.shape) == (flat, *tail):
        return t
    return t.expand(*lead, *tail).reshape(flat, *tail)


def _pad_mask(mask: torch.Tensor, seq_q: int, seq_k: int, pad_q: int, pad_k: int) -> torch.Tensor:
    """Pads a mask broadcastable to (..., L, S) to one broadcastable to (..., L + pad_q, S + pad_k).

    Padded keys are hidden (False / -inf); padded query rows see every real key (their output is
    dropped). Broadcast dims stay broadcast: only the narrowed mask is padded.
    """
    if mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    narrowed, full = narrow_broadcast(mask)
    full = tuple(mask.shape) if full is None else full
    hide, show = (False, True) if mask.dtype == torch.bool else (float("-inf"), 0.0)
    if pad_k:
        if narrowed.shape[-1] != seq_k:  # broadcast over keys: it must now tell real from padded keys
            narrowed = narrowed.expand(*narrowed.shape[:-1], seq_k)
        narrowed = F.pad(narrowed, (0, pad_k), value=hide)
    if pad_q and narrowed.shape[-2] > 1:  # real rows (a single row broadcasts to the padded ones)
        narrowed = F.pad(narrowed, (0, 0, 0, pad_q), value=show)
    rows = 1 if full[-2] == 1 else seq_q + pad_q
    return narrowed.expand(*full[:-2], rows, seq_k + pad_k)


def _dense_if_broadcast_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous() if t.is_leaf and t.requires_grad and 0 in t.stride() else t
