"""`decode_attention`: the generation step for torch tensors, against a KV cache in torch memory.

Shape legend: B batch, Hq / Hkv query / KV heads (Hq % Hkv == 0), T new queries per sequence
(1..16), S_max cache capacity, D q/k head dim, Dv value head dim, P pages, PS page size.

Cache layouts (the cache tensors are read in place, zero-copy, when contiguous):
    cache_layout="BSHD" (default, flash-attn's kvcache layout): k_cache (B, S_max, Hkv, D),
        v_cache (B, S_max, Hkv, Dv).
    cache_layout="BHSD" (torch SDPA / Hugging Face layout): k_cache (B, Hkv, S_max, D), ...
    paged (with block_table, vLLM's layout): k_cache (P, PS, Hkv, D), v_cache (P, PS, Hkv, Dv),
        block_table (B, max_pages) int32; position j of sequence b lives in page
        block_table[b, j // PS], slot j % PS.

Which positions a query sees (B=1, T=2, cache_starts=1, cache_seqlens=5, window=None):

    position:   0 1 2 3 4        the T queries are the LAST T positions (3 and 4),
    q0 (pos 3)  . x x x .        causal among themselves (bottom-right aligned);
    q1 (pos 4)  . x x x x        positions before cache_starts / from cache_seqlens on are unused.

With window=w a query at position p sees positions >= p - w only (w + 1 positions at most). A
sequence with cache_seqlens == 0 (or cache_starts >= cache_seqlens) outputs zeros. ALiBi
(alibi_slopes, flash-attn's convention) adds -slope * |p - j| to the logit of the query at
position p and position j, after scale and soft cap (above, q0 at 3: -slope * (3 - j)).
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from ..bridge import jax_op
from ..jax_core import calls
from ..jax_core.base import DECODE_MAX_QUERY_LEN
from . import native_decode
from .validation import AttentionInputError, block_table_tensor, check_alibi, check_finite, describe, index_tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_decode_jax = jax_op(calls.decode, name="jaxattn.decode", module=__name__)
_decode_lse_jax = jax_op(calls.decode_with_lse, name="jaxattn.decode_lse", num_outputs=2, module=__name__)


def _check_tensors(q, k_cache, v_cache, cache_layout: str, paged: bool) -> tuple[int, int, int, int]:
    """(B, Hq, T, Hkv) after checking types, ranks, dtypes, devices and sizes."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}.")
        if t.dtype not in _FLOAT_DTYPES:
            raise AttentionInputError(f"{name}: dtype {t.dtype} is not a float dtype (float16, bfloat16, float32, float64).")
        if t.dim() != 4 or t.numel() == 0:
            want = "(B, Hq, T, D)" if name == "q" else _cache_shape(name, cache_layout, paged)
            raise AttentionInputError(f"{name}: expected a non-empty 4-D tensor {want}, got {describe(t)}.")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise AttentionInputError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                                  f"{v_cache.dtype} (cast q with q.to(k_cache.dtype)).")
    if not (q.device == k_cache.device == v_cache.device):
        raise AttentionInputError(f"q, k_cache and v_cache must be on one device, got {q.device}, {k_cache.device}, "
                                  f"{v_cache.device}.")
    b, hq, t, d = q.shape
    if t > DECODE_MAX_QUERY_LEN:
        raise AttentionInputError(f"q: {t} queries per sequence (shape {tuple(q.shape)}); decode takes at most "
                                  f"{DECODE_MAX_QUERY_LEN} (for a prefill use flash_attention(..., causal=True, "
                                  "causal_alignment='bottom_right')).")
    head_axis = 1 if cache_layout == "BHSD" else 2
    hkv = k_cache.shape[head_axis]
    shapes = f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise AttentionInputError(f"k_cache and v_cache must agree on all but the last dim ({shapes}); expected "
                                  f"{_cache_shape('k_cache', cache_layout, paged)} and the same with Dv.")
    if k_cache.shape[3] != d:
        raise AttentionInputError(f"k_cache: head dim {k_cache.shape[3]} != q head dim {d} (q {tuple(q.shape)}, {shapes}).")
    if hq % hkv:
        raise AttentionInputError(f"q: {hq} heads is not a multiple of the cache's {hkv} KV heads (q {tuple(q.shape)}, "
                                  f"{shapes} read as {_cache_shape('k_cache', cache_layout, paged)}).")
    if not paged and k_cache.shape[0] != b:
        raise AttentionInputError(f"k_cache: batch {k_cache.shape[0]} != q batch {b} ({shapes} read as "
                                  f"{_cache_shape('k_cache', cache_layout, paged)}).")
    return b, hq, t, hkv


def _cache_shape(name: str, cache_layout: str, paged: bool) -> str:
    d = "D" if name != "v_cache" else "Dv"
    if paged:
        return f"(num_pages, page_size, Hkv, {d})"
    return f"(B, S_max, Hkv, {d})" if cache_layout == "BSHD" else f"(B, Hkv, S_max, {d})"


def _check_values(lengths, starts, capacity: int) -> None:
    """Range checks of the lengths on CPU tensors (on CUDA they would cost a host sync)."""
    if lengths.device.type != "cpu":
        return
    if bool(((lengths < 0) | (lengths > capacity)).any()):
        raise AttentionInputError(f"cache_seqlens: values {lengths.tolist()} must lie in [0, {capacity}] (the cache "
                                  "capacity in positions).")
    if starts is not None and bool((starts < 0).any()):
        raise AttentionInputError(f"cache_starts: values {starts.tolist()} must be >= 0.")


def check_pages(block_table, lengths, starts, page_size: int, num_pages: int,
                 lengths_name: str = "cache_seqlens", pool_name: str = "k_cache") -> None:
    """On CPU: the block_table entries that hold positions in [cache_starts, lengths) name real pages
    (`lengths_name`, `pool_name`: the caller's names of the lengths and the pages, for the message)."""
    if block_table.device.type != "cpu" or torch.compiler.is_compiling():
        return
    slot = torch.arange(block_table.shape[1])[None, :]
    used = slot < (lengths[:, None].long() + page_size - 1) // page_size
    if starts is not None:
        used &= slot >= starts[:, None].long() // page_size
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, j = bad.nonzero()[0].tolist()
        raise AttentionInputError(f"block_table: entry [{b}, {j}] = {int(block_table[b, j])} is not a page of "
                                  f"{pool_name} ({num_pages} pages; {int(bad.sum())} bad entries in all); expected "
                                  f"page indices in [0, {num_pages - 1}] wherever a page holds positions below "
                                  f"{lengths_name}.")


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    *,
    cache_starts: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    cache_layout: Literal["BSHD", "BHSD"] = "BSHD",
    return_lse: bool = False,
    kernel: Optional[Literal["triton", "pallas", "xla"]] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
):
    """Attention of T new queries per sequence against a ragged KV cache (module docstring).

    Args:
        q: (B, Hq, T, D) with T <= 16, in the caches' dtype and on their device.
        k_cache: (B, S_max, Hkv, D) (cache_layout="BSHD"), (B, Hkv, S_max, D) ("BHSD"), or pages
            (P, PS, Hkv, D) with `block_table`. Read in place (contiguous tensors are not copied).
        v_cache: the same layout with head dim Dv.
        cache_seqlens: (B,) int32 (or int64) number of valid positions per sequence (exclusive end),
            at most the capacity (S_max, or max_pages * PS).
        cache_starts: (B,) int32 first valid position per sequence (e.g. left padding), or None (0).
        block_table: (B, max_pages) int32 page indices in [0, P): a paged cache (entries for pages
            past cache_seqlens are not read; on CPU the used entries are range-checked).
        window: w >= 0: each query sees positions >= its own - w; None: unbounded.
        softcap: c > 0: logits -> c * tanh(logits / c).
        sinks: (Hq,) or (Hq, n) float attention-sink logits (gpt-oss style).
        scale: softmax scale, default 1/sqrt(D).
        cache_layout: "BSHD" or "BHSD" for a contiguous cache (paged caches have one layout).
        return_lse: also return the (B, Hq, T) float32 log-sum-exp of each query's logits (sinks
            included; -inf for a query that sees no key and has no sink).
        kernel: "triton" (CUDA), "pallas" (TPU), "xla" (anywhere), or None for the device's.
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes on q's device: -slope * |p - j| joins
            the logit of the query at position p and position j, after scale and soft cap (module
            docstring). No gradient flows to them.

    Returns:
        (B, Hq, T, Dv) tensor in q's dtype; (out, lse) with `return_lse`.

    Launchers: with kernel None or "triton", the Triton kernels are launched from torch
    (`native_decode`: on torch's stream, no XLA executable, CUDA-graph and torch.compile safe)
    wherever they can run the call: on CUDA under `sdpa_launcher("auto")` (the default), and under
    `sdpa_launcher("native")` also on CPU tensors with TRITON_INTERPRET=1 (there "native" raises
    ValueError, with the reasons, for a call it cannot run). `sdpa_launcher("xla")`, other kernels,
    and calls that need gradients run through the XLA bridge (the same Triton kernels on CUDA,
    launched by jax-triton).

    Differentiable (gradients follow the XLA formulation, not the kernels: meant for inference).

    Raises:
        AttentionInputError (a ValueError and RuntimeError): malformed arguments.
        TypeError: arguments of the wrong type.
        ValueError: the kernel cannot run here, or `sdpa_launcher("native")` cannot run the call
            (with reasons).
    """
    paged = block_table is not None
    if cache_layout not in ("BSHD", "BHSD"):
        raise AttentionInputError(f"cache_layout={cache_layout!r}: expected 'BSHD' or 'BHSD' (paged caches need "
                                  "no layout: pass block_table).")
    if paged and cache_layout != "BSHD":
        raise AttentionInputError(f"cache_layout={cache_layout!r} with block_table: paged caches are "
                                  "(num_pages, page_size, Hkv, D); drop cache_layout.")
    b, hq, _, _ = _check_tensors(q, k_cache, v_cache, cache_layout, paged)
    lengths = index_tensor("cache_seqlens", cache_seqlens, (b,), "(B,)", q.device)
    starts = None if cache_starts is None else index_tensor("cache_starts", cache_starts, (b,), "(B,)", q.device)
    if paged:
        block_table = block_table_tensor(block_table, b, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[2 if cache_layout == "BHSD" else 1]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise AttentionInputError(f"window={window!r}: expected None or an int >= 0 (positions visible before each "
                                  "query's own).")
    for name, value in (("softcap", softcap), ("scale", scale)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name}={value!r}: expected None or a finite float, got {type(value).__name__}.")
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise AttentionInputError(f"softcap={softcap!r}: expected None or a positive finite float.")
    if scale is not None and not math.isfinite(scale):
        raise AttentionInputError(f"scale={scale!r}: expected None or a finite float.")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != hq:
            raise AttentionInputError(f"sinks: expected a (Hq,) or (Hq, n) float tensor with Hq={hq}, got {describe(sinks)}.")
        if not sinks.dtype.is_floating_point or sinks.device != q.device:
            raise AttentionInputError(f"sinks: expected a float tensor on {q.device}, got {describe(sinks)}.")
    if kernel not in (None, "triton", "pallas", "xla"):
        raise AttentionInputError(f"kernel={kernel!r}: expected None, 'triton', 'pallas' or 'xla'.")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse={return_lse!r}: expected a bool.")
    check_alibi(alibi_slopes, hq, b, q.device)
    _check_values(lengths, starts, capacity)
    if paged:
        check_pages(block_table, lengths, starts, k_cache.shape[1], k_cache.shape[0])
    check_finite({"q": q, "sinks": sinks, "alibi_slopes": alibi_slopes})
    return run_decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, causal=True,
                      window=(-1 if window is None else window, -1), softcap=softcap, scale=scale,
                      cache_layout="paged" if paged else cache_layout, return_lse=return_lse, kernel=kernel,
                      alibi_slopes=alibi_slopes)


def run_decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, *, causal: bool, window: tuple[int, int],
               softcap, scale, cache_layout: str, return_lse: bool, kernel, alibi_slopes=None):
    """A validated decode call: (B, Hq, T, D) queries, lengths / starts (B,) int32, `cache_layout`
    "BSHD", "BHSD" or "paged", `window` (left, right) around each query's position (-1: unbounded),
    `causal` False: every query sees the whole valid region, `alibi_slopes` float32 (Hq,) or (B, Hq)
    or None. Launched natively where it can be, else through the XLA bridge (`decode_attention`'s
    docstring)."""
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach()  # no gradient, as flash-attn
    native = native_decode.native_spec(q, k_cache, v_cache, sinks, window=window, softcap=softcap, scale=scale,
                                       cache_layout=cache_layout, kernel=kernel, causal=causal)
    if native is not None:
        return native_decode.decode_native(native, q, k_cache, v_cache, lengths, starts, block_table, sinks,
                                           return_lse, alibi_slopes)
    op = _decode_lse_jax if return_lse else _decode_jax
    return op(
        q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes, window=tuple(window),
        softcap=None if softcap is None else float(softcap), scale=None if scale is None else float(scale),
        cache_layout=cache_layout, kernel=kernel, causal=bool(causal),
        platform="cpu" if q.device.type == "cpu" else "gpu",
    )
