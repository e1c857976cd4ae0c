"""The checks of one attention call's arrays against its spec, in one place.

`check_call(call, arrays)` runs once per call: `attention()` runs it before selecting, and
`AttentionImpl.__call__` runs it when called directly; implementations receive checked calls.
Errors are ValueErrors that name the argument, what it was and what was expected. The static
arguments (layout, alignment, window) are checked when the call is built (`call.build_call`).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from .call import AttentionCall, CallArrays


def check_call(call: AttentionCall, arrays: CallArrays) -> None:
    """Raises ValueError for malformed arrays of `call` (shapes, dtypes, packing, ALiBi slopes)."""
    check_rank(arrays, call.layout)
    query, key, value = arrays.bthd_shapes(call.layout)
    check_shapes(query, key, value, arrays.bias, arrays.mask, arrays.softmax_aux)
    check_packing(query, key, arrays.segment_ids, arrays.cu_seqlens, call.max_seqlen)
    check_alibi(arrays.alibi_slopes, query, arrays.cu_seqlens)


def check_rank(arrays: CallArrays, layout: str) -> None:
    for name, x in zip(("query", "key", "value"), arrays.qkv):
        if len(x.shape) != 4:
            raise ValueError(f"{name}: expected a 4-D ({layout}) array, got shape {tuple(x.shape)}.")


def check_shapes(query, key, value, bias, mask, softmax_aux) -> None:
    """(B, T, Hq, D) query, (B, S, Hk, D) key, (B, S, Hk, Dv) value, and what broadcasts against them."""
    b, t, hq, d = query.shape
    if key.shape[0] != b or value.shape[0] != b:
        raise ValueError(f"batch sizes differ: query {b}, key {key.shape[0]}, value {value.shape[0]}.")
    if key.shape[1] != value.shape[1] or key.shape[2] != value.shape[2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} disagree on (S, Hk).")
    if key.shape[3] != d:
        raise ValueError(f"key head dim {key.shape[3]} != query head dim {d}.")
    if hq % key.shape[2]:
        raise ValueError(f"num_q_heads={hq} is not a multiple of num_kv_heads={key.shape[2]}.")
    full = (b, hq, t, key.shape[1])
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        if x.ndim > 4 or any(a not in (1, f) for a, f in zip(x.shape[::-1], full[::-1])):
            raise ValueError(f"{name}: shape {tuple(x.shape)} is not broadcastable to (B, Hq, T, S)={full}.")
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(f"mask: expected dtype bool, got {mask.dtype}; pass float masks as `bias`.")
    if softmax_aux is not None and (softmax_aux.ndim not in (1, 2) or softmax_aux.shape[0] != hq):
        raise ValueError(f"softmax_aux: expected shape (Hq,) or (Hq, n) with Hq={hq}, got {tuple(softmax_aux.shape)}.")


def check_alibi(slopes, query, cu_seqlens) -> None:
    """ALiBi slopes: a float (Hq,) or (B, Hq) array, B the batch or, with cu_seqlens, the sequences."""
    if slopes is None:
        return
    hq = query.shape[2]
    b = query.shape[0] if cu_seqlens is None else cu_seqlens[0].shape[0] - 1
    shape = tuple(getattr(slopes, "shape", ()))
    if not hasattr(slopes, "dtype") or not jnp.issubdtype(slopes.dtype, jnp.floating) or shape not in ((hq,), (b, hq)):
        what = "sequences" if cu_seqlens is not None else "batch"
        raise ValueError(f"alibi_slopes: shape {shape} and dtype {getattr(slopes, 'dtype', type(slopes).__name__)}; "
                         f"expected a float array of shape (Hq,)=({hq},) or (B, Hq)=({b}, {hq}) (B: the {what}).")


def _shape_of(x: Any) -> Any:
    return tuple(x.shape) if hasattr(x, "shape") else type(x).__name__


def _is_int_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.integer)


def _as_pair(name: str, value: Any, what: str) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name}: expected a pair {what}, got {type(value).__name__} {value!r:.80}.")
    return tuple(value)


def check_packing(query, key, segment_ids, cu_seqlens, max_seqlen) -> None:
    """Checks segment ids, cu_seqlens and max_seqlen against (B, T, ...) query and (B, S, ...) key."""
    b, t, s = query.shape[0], query.shape[1], key.shape[1]
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("segment_ids and cu_seqlens were both given; pass one (segments within a batch row, "
                         "or varlen sequences packed in a batch of 1).")
    if segment_ids is not None:
        ids = _as_pair("segment_ids", segment_ids, "(q_segment_ids (B, T), kv_segment_ids (B, S))")
        for name, x, want in (("q_segment_ids", ids[0], (b, t)), ("kv_segment_ids", ids[1], (b, s))):
            if not _is_int_array(x) or tuple(x.shape) != want:
                raise ValueError(
                    f"segment_ids: {name} has shape {_shape_of(x)} and dtype {getattr(x, 'dtype', None)}; "
                    f"expected an integer array of shape {want} (B, {'T' if name[0] == 'q' else 'S'})."
                )
    if cu_seqlens is not None:
        cu = _as_pair("cu_seqlens", cu_seqlens, "(cu_seqlens_q (N + 1,), cu_seqlens_k (N + 1,))")
        for name, x in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
            if not _is_int_array(x) or x.ndim != 1 or x.shape[0] < 2:
                raise ValueError(
                    f"cu_seqlens: {name} has shape {_shape_of(x)} and dtype {getattr(x, 'dtype', None)}; "
                    "expected a 1-D integer array of N + 1 >= 2 cumulative lengths."
                )
        if cu[0].shape != cu[1].shape:
            raise ValueError(f"cu_seqlens: cu_seqlens_q {tuple(cu[0].shape)} and cu_seqlens_k "
                             f"{tuple(cu[1].shape)} must have the same length N + 1.")
        if b != 1:
            raise ValueError(f"cu_seqlens: needs a batch of 1 holding the packed sequences, got batch={b} "
                             "(reshape to (1, total, H, D)).")
    if max_seqlen is not None:
        pair = _as_pair("max_seqlen", max_seqlen, "(max_seqlen_q, max_seqlen_k) of ints")
        if cu_seqlens is None:
            raise ValueError(f"max_seqlen={max_seqlen!r}: only meaningful with cu_seqlens.")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in pair):
            raise ValueError(f"max_seqlen={max_seqlen!r}: expected (max_seqlen_q, max_seqlen_k) Python ints >= 1.")


def as_int32(pair: Optional[tuple[Any, Any]]) -> Optional[tuple[jax.Array, jax.Array]]:
    """A pair of integer arrays (segment ids, cu_seqlens) as int32 arrays, as implementations take them."""
    return None if pair is None else tuple(jnp.asarray(x).astype(jnp.int32) for x in pair)
