"""Argument checks of `kvcache_attention`: shapes, dtypes, devices, and (on CPU tensors, where they
cost no host synchronisation) the values of lengths, starts, batch indices and block tables.

Shape legend as in `kvcache_call`: B batch, T new queries, T_new new keys, Hq / Hk query / KV
heads, D / Dv head dims, Bc cache rows, S_max capacity, P pages, PS page size, S_rot rotary rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from .decode import check_pages
from .validation import AttentionInputError, block_table_tensor, check_alibi, describe, index_tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class KVCacheCall(NamedTuple):
    """A validated call's sizes and normalised index tensors (int32, on q's device)."""

    b: int
    t: int
    t_new: int  # new keys appended (0 without k / v)
    hq: int
    hk: int
    capacity: int  # positions a sequence can hold: S_max, or max_pages * PS
    paged: bool
    lengths: torch.Tensor  # (B,) cache_seqlens before the append
    starts: Optional[torch.Tensor]  # (B,) first valid positions, or None (0)
    batch_idx: Optional[torch.Tensor]  # (B,) cache rows of a contiguous cache, or None (row b)
    block_table: Optional[torch.Tensor]  # (B, max_pages) (paged)
    window: tuple[int, int]  # (left, right), -1: unbounded


def _tensor(name: str, t, want: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {want}, got {type(t).__name__}.")


def _float_4d(name: str, t, want: str, q: Optional[torch.Tensor]) -> None:
    _tensor(name, t, want)
    if t.dtype not in _FLOAT_DTYPES or t.dim() != 4 or t.numel() == 0:
        raise AttentionInputError(f"{name}: expected a non-empty 4-D float tensor {want}, got {describe(t)}.")
    if q is not None and (t.dtype != q.dtype or t.device != q.device):
        raise AttentionInputError(f"{name}: {t.dtype} on {t.device}, but q is {q.dtype} on {q.device}; expected "
                                  f"q's dtype and device (e.g. {name}.to(q)).")


def _window(window) -> tuple[int, int]:
    if window is None:
        return (-1, -1)
    if isinstance(window, int) and not isinstance(window, bool) and window >= 0:
        return (window, -1)
    if (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        return (int(window[0]), int(window[1]))
    raise AttentionInputError(f"window={window!r}: expected None, an int w >= 0 (positions visible before each "
                              "query's own) or a (left, right) pair of ints >= -1 (-1: unbounded).")


def _scalars(softcap, scale) -> None:
    for name, value in (("softcap", softcap), ("scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name}={value!r}: expected None or a finite float, got {type(value).__name__}.")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise AttentionInputError(f"softcap={softcap!r}: expected None or a positive finite float (0 is spelled "
                                  "None here).")
    if scale is not None and not math.isfinite(scale):
        raise AttentionInputError(f"scale={scale!r}: expected None or a finite float.")


def _flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: expected a bool, got {type(value).__name__}.")


def _new_kv(k, v, q, b: int, hk: int, d: int, dv: int) -> int:
    """T_new after checking k (B, T_new, Hk, D) and v (B, T_new, Hk, Dv)."""
    if (k is None) != (v is None):
        raise AttentionInputError(f"k and v: pass both new keys and values or neither (got k "
                                  f"{'None' if k is None else 'a tensor'}, v {'None' if v is None else 'a tensor'}).")
    if k is None:
        return 0
    _float_4d("k", k, f"(B, T_new, Hk, D) = ({b}, T_new, {hk}, {d})", q)
    _float_4d("v", v, f"(B, T_new, Hk, Dv) = ({b}, T_new, {hk}, {dv})", q)
    t_new = k.shape[1]
    for name, x, dim in (("k", k, d), ("v", v, dv)):
        if tuple(x.shape) != (b, t_new, hk, dim):
            raise AttentionInputError(f"{name}: shape {tuple(x.shape)}, expected (B, T_new, Hk, {'Dv' if name == 'v' else 'D'}) "
                                      f"= ({b}, {t_new}, {hk}, {dim}) (the cache's heads and head dim, q's batch, "
                                      "k's T_new).")
    return t_new


def _rotary(rotary_cos, rotary_sin, q, k, d: int, capacity: int) -> None:
    if rotary_cos is None and rotary_sin is None:
        return
    if rotary_cos is None or rotary_sin is None:
        raise AttentionInputError("rotary_cos and rotary_sin: pass both tables or neither.")
    if k is None:
        raise AttentionInputError("rotary_cos / rotary_sin: rotary is applied to q and to the new keys as they are "
                                  "appended, so it needs k and v; rotate q yourself to attend without appending.")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        _tensor(name, t, "(S_rot, rotary_dim / 2)")
        if t.dim() != 2 or not t.dtype.is_floating_point or t.shape != rotary_cos.shape or t.shape[1] == 0:
            raise AttentionInputError(f"{name}: expected a float tensor (S_rot, rotary_dim / 2) shaped like "
                                      f"rotary_cos, got {describe(t)} (rotary_cos {describe(rotary_cos)}).")
        if t.device != q.device:
            raise AttentionInputError(f"{name}: on {t.device} but q is on {q.device} (move it with .to(q.device)).")
    if 2 * rotary_cos.shape[1] > d:
        raise AttentionInputError(f"rotary_cos: rotary_dim = 2 * {rotary_cos.shape[1]} = {2 * rotary_cos.shape[1]} "
                                  f"exceeds the head dim {d}; expected rotary_dim <= D.")
    if rotary_cos.shape[0] < capacity:
        raise AttentionInputError(f"rotary_cos: {rotary_cos.shape[0]} rows (positions), fewer than the cache capacity "
                                  f"{capacity}; expected S_rot >= capacity so that every position a new token can "
                                  "take has an angle.")


def _sinks(sinks, hq: int, device) -> None:
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != hq \
            or not sinks.dtype.is_floating_point or sinks.device != device:
        raise AttentionInputError(f"sinks: expected a float tensor (Hq,) or (Hq, n) with Hq={hq} on {device}, got "
                                  f"{describe(sinks)}.")


def _values(call: KVCacheCall, rows: int, num_pages: int, page_size: int) -> None:
    """Value checks on CPU index tensors (on CUDA they would cost a host sync; skipped while
    torch.compile traces)."""
    if call.lengths.device.type != "cpu" or torch.compiler.is_compiling():
        return
    lengths = call.lengths
    if bool(((lengths < 0) | (lengths + call.t_new > call.capacity)).any()):
        raise AttentionInputError(f"cache_seqlens: values {lengths.tolist()} plus the {call.t_new} appended positions "
                                  f"must lie in [0, {call.capacity}] (the cache capacity); build a larger cache or "
                                  "append fewer positions.")
    if call.starts is not None and bool(((call.starts < 0) | (call.starts > lengths)).any()):
        raise AttentionInputError(f"cache_starts: values {call.starts.tolist()} must lie in [0, cache_seqlens] = "
                                  f"[0, {lengths.tolist()}] (the first valid position of each sequence).")
    if call.batch_idx is not None and bool(((call.batch_idx < 0) | (call.batch_idx >= rows)).any()):
        raise AttentionInputError(f"cache_batch_idx: values {call.batch_idx.tolist()} must be rows of k_cache, in "
                                  f"[0, {rows - 1}].")
    if call.paged:
        check_pages(call.block_table, lengths + call.t_new, call.starts, page_size, num_pages)


def check_kvcache_call(q, k_cache, v_cache, cache_seqlens: Union[int, torch.Tensor], *, k, v, block_table,
                       cache_batch_idx, cache_starts, rotary_cos, rotary_sin, window, softcap, alibi_slopes, sinks,
                       scale, flags: dict) -> KVCacheCall:
    """Validates a `kvcache_attention` call (every argument named in its error); see its docstring."""
    _float_4d("q", q, "(B, T, Hq, D)", None)
    paged = block_table is not None
    cache_shape = "(P, PS, Hk, D)" if paged else "(Bc, S_max, Hk, D)"
    _float_4d("k_cache", k_cache, cache_shape, q)
    _float_4d("v_cache", v_cache, cache_shape.replace("D)", "Dv)"), q)
    b, t, hq, d = q.shape
    hk, dv = k_cache.shape[2], v_cache.shape[3]
    shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise AttentionInputError(f"k_cache and v_cache: expected {cache_shape} and the same with Dv, D = q's head "
                                  f"dim {d}; got {shapes}.")
    if hq % hk:
        raise AttentionInputError(f"q: {hq} heads is not a multiple of the cache's {hk} KV heads ({shapes}).")
    _flags(**flags)
    if paged:
        if cache_batch_idx is not None:
            raise AttentionInputError("cache_batch_idx: not with block_table (a paged cache has no rows to pick); "
                                      "index the block table instead: block_table[cache_batch_idx].")
        block_table = block_table_tensor(block_table, b, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] != b:
            raise AttentionInputError(f"k_cache: {k_cache.shape[0]} cache rows but q has batch {b} ({shapes}); "
                                      "expected equal, or pass cache_batch_idx (B,) naming each sequence's row.")
    batch_idx = None if cache_batch_idx is None else index_tensor("cache_batch_idx", cache_batch_idx, (b,), "(B,)", q.device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        lengths = torch.full((b,), cache_seqlens, dtype=torch.int32, device=q.device)
    else:
        lengths = index_tensor("cache_seqlens", cache_seqlens, (b,), "(B,)", q.device)
    starts = None if cache_starts is None else index_tensor("cache_starts", cache_starts, (b,), "(B,)", q.device)
    t_new = _new_kv(k, v, q, b, hk, d, dv)
    _rotary(rotary_cos, rotary_sin, q, k, d, capacity)
    _scalars(softcap, scale)
    check_alibi(alibi_slopes, hq, b, q.device)
    _sinks(sinks, hq, q.device)
    call = KVCacheCall(b=b, t=t, t_new=t_new, hq=hq, hk=hk, capacity=capacity, paged=paged, lengths=lengths,
                       starts=starts, batch_idx=batch_idx, block_table=block_table, window=_window(window))
    _values(call, k_cache.shape[0], k_cache.shape[0], k_cache.shape[1])
    return call
