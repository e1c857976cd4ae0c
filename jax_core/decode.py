"""`decode` (alias `autoregressive_decodeattn`): attention of a few new queries against a KV cache.

The generation phase: each sequence brings T new queries (T = 1, or up to 16 for speculative
decoding) and attends to its KV cache, whose valid region differs per sequence.

Caches (read in place; only the positions some query can see are read by the kernels):
    contiguous "BSHD": key (B, S_max, Hkv, D), value (B, S_max, Hkv, Dv)
    contiguous "BHSD": key (B, Hkv, S_max, D), value (B, Hkv, S_max, Dv) (torch SDPA's layout)
    "paged": key pages (P, PS, Hkv, D), value pages (P, PS, Hkv, Dv) and a block table
        (B, max_pages): position j of sequence b is slot j % PS of page block_table[b, j // PS]
        (vLLM's layout); the capacity is S = max_pages * PS.

Semantics (`decode_attention`):
    * lengths[b] = number of valid positions (exclusive end, <= S); starts[b] = first valid
      position (default 0). Only positions in [start, length) are attended.
    * The T queries are the LAST T positions of their sequence: query t sits at position
      length - T + t and sees positions j <= its own (causal among themselves, bottom-right);
      with causal=False every query sees the whole valid region.
    * A window w (sliding_window=w, flash-attn's left window) keeps positions j >= pos - w: each
      query sees at most w + 1 positions, itself included.
    * Soft cap c: logits -> c * tanh(logits / c). Sinks (softmax_aux, (Hq,) or (Hq, n)): extra
      logits that join each row's softmax denominator only.
    * ALiBi (alibi_slopes, float (Hq,) or (B, Hq), flash-attn's convention): the logit of query t
      and position j gets -slope * |length - T + t - j|, after scale and soft cap. The distance is
      taken from the query's bottom-right position whether or not the call is causal (through
      `attention()` with top-left alignment too, as flash-attn's ALiBi). The slopes get no gradient.
    * A query that sees nothing (length 0, start >= length, or a position before start) outputs
      zeros; its LSE is -inf (or the sinks' log-sum-exp).
    * GQA natively: query head h reads KV head h // (Hq // Hkv); K/V are never repeated.

Kernels: GPU - Triton split-K flash-decoding through jax-triton, with a stream-K schedule: a fixed
number of programs share all the batch's key blocks (`kernels/decode_stream_triton.py`);
TPU - a Pallas kernel (`kernels/decode_pallas_tpu.py`, tested in interpret mode only); CPU - XLA
(masks the padded cache; reads all of it). Every kernel is forward-only: under differentiation the
tangents come from the XLA formulation (a custom JVP), so gradients are correct but not fast.
Decode is meant for inference.

Through `attention()` (the generic interface) the whole key/value array is the valid cache
(lengths = S) and any causal alignment / window is honoured; automatic selection tries `decode`
first on GPU when `base.mode_for(T, S)` says "__autoregressive__" (T <= 16 new queries against a
longer cache).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional, Union

import jax
import jax.numpy as jnp

from .base import DECODE_MAX_QUERY_LEN, AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .capabilities import ALL_FLOAT_DTYPES, AttentionInputs, Capabilities, missing_gpu_packages
from .metadata import AttentionMetadata, backend_of, platform_of
from .registry import AttentionRegistry
from .vanilla import reference_attention
from .visibility import Visibility, cache_positions

Kernel = Literal["triton", "pallas", "xla"]
CacheLayout = Literal["BSHD", "BHSD", "paged"]
_KERNEL_OF_PLATFORM = {"gpu": "triton", "tpu": "pallas", "cpu": "xla"}
#: The kernel of a call's backend (`AttentionCall.backend`; None, the platform-independent path: "xla").
_KERNEL_OF_BACKEND = {"cuda": "triton", "rocm": "triton", "tpu": "pallas"}
_FEATURES = frozenset({"causal", "causal_bottom_right", "gqa", "sliding_window", "softcap", "sinks", "alibi", "lse",
                       "backward"})


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one decode computation (hashable)."""

    kernel: str
    scale: float
    causal: bool
    window: tuple[int, int]
    pos_shift: int
    softcap: Optional[float]
    q_layout: str
    cache_layout: str
    softmax_dtype: str
    fast_tanh: bool = False


# --- the XLA formulation (CPU path, and the tangents of every kernel) -----------------------------


def _swap(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)


def visibility(lengths, starts, t: int, s: int, *, causal: bool, window: tuple[int, int], pos_shift: int = 0):
    """(B, T, S) bool: query t of sequence b sees position j; and (B, S): j in [start, length).

    Query t sits at position lengths[b] - T + t + pos_shift; lengths are clamped to S, starts to 0
    (`Visibility.cache_dense`).
    """
    rule = Visibility(causal=bool(causal), alignment="bottom_right", window=window)
    return rule.cache_dense(lengths, starts, t, s, pos_shift=pos_shift)


def alibi_logits(slopes: jax.Array, lengths: jax.Array, t: int, s: int) -> jax.Array:
    """(B|1, Hq, T, S) float32 ALiBi term -slope * |length - T + t - j| (module docstring) from
    (Hq,) or (B, Hq) slopes; lengths are clamped to S, as in `visibility`. No gradient flows to the
    slopes."""
    slopes = jax.lax.stop_gradient(slopes.astype(jnp.float32))
    slopes = slopes[None] if slopes.ndim == 1 else slopes
    pos = cache_positions(lengths, t, s)[:, :, None]
    distance = jnp.abs(pos - jnp.arange(s, dtype=jnp.int32)[None, None, :]).astype(jnp.float32)
    return -slopes[:, :, None, None] * distance[:, None]


def gather_pages(pages: jax.Array, block_table: jax.Array) -> jax.Array:
    """(P, PS, Hkv, D) pages -> (B, max_pages * PS, Hkv, D) per-sequence caches (a copy)."""
    table = jnp.clip(block_table.astype(jnp.int32), 0, pages.shape[0] - 1)
    gathered = pages[table]
    return gathered.reshape(table.shape[0], -1, *pages.shape[2:])


def _xla_decode(q, k, v, lengths, starts, block_table, sinks, alibi, spec: _Spec):
    # Full-precision float32 dots (no TF32 on GPUs): this path also gives the kernels' gradients.
    with jax.default_matmul_precision("highest"):
        return _xla_decode_body(q, k, v, lengths, starts, block_table, sinks, alibi, spec)


def _xla_decode_body(q, k, v, lengths, starts, block_table, sinks, alibi, spec: _Spec):
    if spec.q_layout == "BHTD":
        q = _swap(q)
    if spec.cache_layout == "paged":
        k, v = gather_pages(k, block_table), gather_pages(v, block_table)
    elif spec.cache_layout == "BHSD":
        k, v = _swap(k), _swap(v)
    visible, written = visibility(lengths, starts, q.shape[1], k.shape[1], causal=spec.causal, window=spec.window,
                                  pos_shift=spec.pos_shift)
    # Unwritten cache slots may hold anything (NaN included): zero them so 0-weights stay 0.
    k = jnp.where(written[:, :, None, None], k, jnp.zeros((), k.dtype))
    v = jnp.where(written[:, :, None, None], v, jnp.zeros((), v.dtype))
    bias = None if alibi is None else alibi_logits(alibi, lengths, q.shape[1], k.shape[1])
    out, _, lse = reference_attention(
        q, k, v, scale=spec.scale, softmax_dtype=jnp.dtype(spec.softmax_dtype), mask=visible[:, None],
        logits_soft_cap=spec.softcap, softmax_aux=sinks, bias=bias,
    )
    return (_swap(out) if spec.q_layout == "BHTD" else out), lse


def _triton_decode(q, k, v, lengths, starts, block_table, sinks, alibi, spec: _Spec):
    from .kernels.decode_jax_triton import DecodeConfig, decode_attention_triton

    cfg = DecodeConfig(scale=spec.scale, causal=spec.causal, window=spec.window, pos_shift=spec.pos_shift,
                       softcap=spec.softcap, q_layout=spec.q_layout, cache_layout=spec.cache_layout,
                       fast_tanh=spec.fast_tanh)
    return decode_attention_triton(q, k, v, lengths, starts, block_table, sinks, cfg,
                                   None if alibi is None else jax.lax.stop_gradient(alibi).astype(jnp.float32))


def _pallas_decode(q, k, v, lengths, starts, block_table, sinks, alibi, spec: _Spec):
    from .kernels.decode_pallas_tpu import decode_attention_pallas

    if spec.q_layout == "BHTD":
        q = _swap(q)
    if spec.cache_layout == "BHSD":  # the TPU kernel reads (B, S, Hkv, D) blocks: a transposed copy
        k, v = _swap(k), _swap(v)
    out, lse = decode_attention_pallas(
        q, k, v, lengths, starts, block_table if spec.cache_layout == "paged" else None, sinks, scale=spec.scale,
        causal=spec.causal, window=spec.window, pos_shift=spec.pos_shift, softcap=spec.softcap,
        alibi_slopes=None if alibi is None else jax.lax.stop_gradient(alibi).astype(jnp.float32),
    )
    return (_swap(out) if spec.q_layout == "BHTD" else out), lse


_KERNELS = {"triton": _triton_decode, "pallas": _pallas_decode}


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def _kernel_decode(q, k, v, lengths, starts, block_table, sinks, alibi, spec: _Spec):
    """A forward-only kernel whose JVP is that of the XLA formulation (ALiBi slopes get none)."""
    return _KERNELS[spec.kernel](q, k, v, lengths, starts, block_table, sinks, alibi, spec)


@_kernel_decode.defjvp
def _kernel_decode_jvp(spec, primals, tangents):
    q, k, v, lengths, starts, block_table, sinks, alibi = primals
    out = _kernel_decode(*primals, spec)
    dq, dk, dv = tangents[:3]

    def xla(q, k, v, *maybe_sinks):
        return _xla_decode(q, k, v, lengths, starts, block_table, maybe_sinks[0] if maybe_sinks else None, alibi,
                           spec)

    if sinks is None:
        _, tangent = jax.jvp(xla, (q, k, v), (dq, dk, dv))
    else:
        _, tangent = jax.jvp(xla, (q, k, v, sinks), (dq, dk, dv, tangents[6]))
    return out, (tangent[0].astype(out[0].dtype), tangent[1].astype(out[1].dtype))


def _sink_logits(softmax_aux: Optional[jax.Array], dtype) -> Optional[jax.Array]:
    """(Hq,) sink logits; several sinks per head merge into one by log-sum-exp."""
    if softmax_aux is None:
        return None
    aux = softmax_aux.astype(dtype)
    return aux if aux.ndim == 1 else jax.nn.logsumexp(aux, axis=-1)


# --- argument checks --------------------------------------------------------------------------------


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}, dtype {x.dtype}" if hasattr(x, "shape") else f"a {type(x).__name__}"


def _int_vector(name: str, x, batch: int) -> None:
    if not hasattr(x, "shape") or not jnp.issubdtype(x.dtype, jnp.integer) or tuple(x.shape) != (batch,):
        raise ValueError(f"{name}: expected an integer array of shape (B,) = ({batch},), got {_describe(x)}.")


def normalize_window(sliding_window) -> tuple[int, int]:
    """None -> (-1, -1); w -> (w, -1); (left, right) kept. Raises on anything else."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, int) and not isinstance(sliding_window, bool):
        if sliding_window < 0:
            raise ValueError(f"sliding_window={sliding_window!r}: expected an int >= 0 (positions visible before "
                             "each query's own) or None for no window.")
        return (sliding_window, -1)
    if (isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in sliding_window)):
        return (int(sliding_window[0]), int(sliding_window[1]))
    raise ValueError(f"sliding_window={sliding_window!r}: expected None, an int >= 0 (left window), or a "
                     "(left, right) pair of ints >= -1 (-1: unbounded).")


def check_decode_args(query, key_cache, value_cache, lengths, starts, block_table, softmax_aux, *,
                      cache_layout: str, query_layout: str, alibi_slopes=None) -> tuple[int, int, int, int]:
    """Validates a decode call; returns (B, T, Hq, Hkv). Raises ValueError naming the argument."""
    if query_layout not in ("BTHD", "BHTD"):
        raise ValueError(f"query_layout={query_layout!r}: expected 'BTHD' (B, T, Hq, D) or 'BHTD' (B, Hq, T, D).")
    if cache_layout not in ("BSHD", "BHSD", "paged"):
        raise ValueError(f"cache_layout={cache_layout!r}: expected 'BSHD', 'BHSD' or 'paged'.")
    for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name}: expected a 4-D array, got {_describe(x)}.")
    if not (query.dtype == key_cache.dtype == value_cache.dtype):
        raise ValueError(f"query, key_cache and value_cache must share a dtype, got {query.dtype}, {key_cache.dtype}, "
                         f"{value_cache.dtype} (cast the query to the cache dtype).")
    b, t, hq, d = query.shape if query_layout == "BTHD" else (query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    if t > DECODE_MAX_QUERY_LEN:
        raise ValueError(f"query: {t} queries per sequence (shape {tuple(query.shape)}); decode takes at most "
                         f"{DECODE_MAX_QUERY_LEN} (use 'flash' with causal_alignment='bottom_right' for prefill).")
    kv_dims = {"BSHD": "(B, S_max, Hkv, D)", "BHSD": "(B, Hkv, S_max, D)", "paged": "(num_pages, page_size, Hkv, D)"}
    head_axis = 1 if cache_layout == "BHSD" else 2
    hkv = key_cache.shape[head_axis]
    k_rest = tuple(s for i, s in enumerate(key_cache.shape) if i != 3)
    v_rest = tuple(s for i, s in enumerate(value_cache.shape) if i != 3)
    if k_rest != v_rest:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must agree on "
                         f"all but the last dim ({kv_dims[cache_layout]}).")
    if key_cache.shape[3] != d:
        raise ValueError(f"key_cache: head dim {key_cache.shape[3]} != query head dim {d} "
                         f"(key_cache {tuple(key_cache.shape)}, query {tuple(query.shape)}).")
    if hq % hkv:
        raise ValueError(f"query: {hq} heads is not a multiple of the cache's {hkv} KV heads "
                         f"(key_cache {tuple(key_cache.shape)} read as {kv_dims[cache_layout]}).")
    if cache_layout == "paged":
        if block_table is None:
            raise ValueError("block_table: required with cache_layout='paged' ((B, max_pages) page indices).")
        if (not hasattr(block_table, "shape") or not jnp.issubdtype(block_table.dtype, jnp.integer)
                or len(block_table.shape) != 2 or block_table.shape[0] != b):
            raise ValueError(f"block_table: expected an integer array of shape (B, max_pages) with B={b}, got "
                             f"{_describe(block_table)}.")
    else:
        if block_table is not None:
            raise ValueError(f"block_table ({_describe(block_table)}) was given with cache_layout={cache_layout!r}; "
                             "pass cache_layout='paged' (or leave it None) for a paged cache.")
        if key_cache.shape[0] != b:
            raise ValueError(f"key_cache: batch {key_cache.shape[0]} != query batch {b} "
                             f"(key_cache {tuple(key_cache.shape)} read as {kv_dims[cache_layout]}).")
    _int_vector("lengths", lengths, b)
    if starts is not None:
        _int_vector("starts", starts, b)
    if softmax_aux is not None and (len(softmax_aux.shape) not in (1, 2) or softmax_aux.shape[0] != hq):
        raise ValueError(f"softmax_aux: expected shape (Hq,) or (Hq, n) with Hq={hq}, got {tuple(softmax_aux.shape)}.")
    if alibi_slopes is not None and (not hasattr(alibi_slopes, "shape")
                                     or not jnp.issubdtype(alibi_slopes.dtype, jnp.floating)
                                     or tuple(alibi_slopes.shape) not in ((hq,), (b, hq))):
        raise ValueError(f"alibi_slopes: expected a float array of shape (Hq,)=({hq},) or (B, Hq)=({b}, {hq}) "
                         f"(one ALiBi slope per query head, optionally per sequence), got {_describe(alibi_slopes)}.")
    return b, t, hq, hkv


# --- the implementation -----------------------------------------------------------------------------


@AttentionRegistry.register
class DecodeAttn(AttentionImpl):
    """Decode attention against a KV cache; see the module docstring.

    `decode(...)` takes ragged caches (lengths, starts, pages); `__call__` (through `attention()`)
    treats the whole key/value array as the cache.
    """

    capabilities = Capabilities(
        platforms=frozenset({"cpu", "gpu", "tpu"}),
        dtypes=ALL_FLOAT_DTYPES,
        features=_FEATURES,
        max_head_dim=256,
    )
    layouts = frozenset({"BTHD", "BHTD"})

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("decode", "autoregressive_decodeattn")

    @classmethod
    def takes_alibi_slopes(cls, inputs: AttentionInputs) -> bool:
        """Every decode kernel (XLA, Triton, Pallas) applies ALiBi slopes itself."""
        return True

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        reasons = []
        if inputs.q_len > DECODE_MAX_QUERY_LEN:
            reasons.append(f"q_len={inputs.q_len} > {DECODE_MAX_QUERY_LEN}: decode takes one new token or a few "
                           "(speculative decoding)")
        if metadata.mesh is not None:
            reasons.append("decode does not run under a mesh yet (use 'vanilla')")
        reasons += kernel_reasons(_KERNEL_OF_PLATFORM.get(inputs.platform, "xla"), inputs.platform, inputs.dtype)
        return reasons

    # --- the cache interface ----------------------------------------------------------------------
    def decode(
        self,
        query: jax.Array,
        key_cache: jax.Array,
        value_cache: jax.Array,
        lengths: jax.Array,
        *,
        starts: Optional[jax.Array] = None,
        block_table: Optional[jax.Array] = None,
        sliding_window: Union[None, int, tuple[int, int]] = None,
        logits_soft_cap: Optional[float] = None,
        softmax_aux: Optional[jax.Array] = None,
        cache_layout: Optional[CacheLayout] = None,
        query_layout: Literal["BTHD", "BHTD"] = "BTHD",
        kernel: Optional[Kernel] = None,
        return_lse: bool = False,
        causal: bool = True,
        alibi_slopes: Optional[jax.Array] = None,
    ) -> AttentionOutput:
        """Decode attention; arguments as `decode_attention` (scale and dtypes from the metadata)."""
        cache_layout = cache_layout or ("paged" if block_table is not None else "BSHD")
        b, t, hq, hkv = check_decode_args(query, key_cache, value_cache, lengths, starts, block_table, softmax_aux,
                                          cache_layout=cache_layout, query_layout=query_layout,
                                          alibi_slopes=alibi_slopes)
        window = normalize_window(sliding_window)
        if not isinstance(causal, bool):
            raise ValueError(f"causal={causal!r}: expected a bool (True: each query sees positions up to its own).")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap={logits_soft_cap!r}: expected a positive float or None.")
        platform = self.metadata.platform or platform_of(query, key_cache, value_cache)
        kernel = kernel or _KERNEL_OF_PLATFORM.get(platform, "xla")
        if kernel not in ("triton", "pallas", "xla"):
            raise ValueError(f"kernel={kernel!r}: expected 'triton', 'pallas', 'xla' or None (by platform).")
        reasons = kernel_reasons(kernel, platform, jnp.dtype(query.dtype).name)
        if reasons:
            raise ValueError(f"decode cannot run this call with kernel={kernel!r}: " + "; ".join(reasons) + ".")
        return self._run(query, key_cache, value_cache, lengths, starts, block_table, softmax_aux, kernel=kernel,
                         causal=causal, window=window, pos_shift=0, softcap=logits_soft_cap, q_layout=query_layout,
                         cache_layout=cache_layout, return_lse=return_lse, alibi=alibi_slopes)

    def _run(self, query, key, value, lengths, starts, block_table, softmax_aux, *, kernel, causal, window,
             pos_shift, softcap, q_layout, cache_layout, return_lse, alibi=None, scale=None) -> AttentionOutput:
        """`scale`: the call's softmax scale; None: the metadata's (`scale_for`)."""
        md = self.metadata
        if md.runtime_dtype:
            query, key, value = (x.astype(md.runtime_dtype) for x in (query, key, value))
        d = query.shape[-1]
        platform = md.platform or platform_of(query, key, value)
        spec = _Spec(
            kernel=kernel, scale=md.scale_for(d) if scale is None else float(scale), causal=bool(causal), window=tuple(window), pos_shift=int(pos_shift),
            softcap=None if softcap is None else float(softcap), q_layout=q_layout, cache_layout=cache_layout,
            softmax_dtype=md.softmax_dtype_for(query.dtype).name,
            fast_tanh=kernel == "triton" and (md.backend or backend_of(platform)) == "cuda",
        )
        sinks = _sink_logits(softmax_aux, jnp.float32 if kernel != "xla" else spec.softmax_dtype)
        lengths = lengths.astype(jnp.int32)
        starts = None if starts is None else starts.astype(jnp.int32)
        block_table = None if block_table is None else block_table.astype(jnp.int32)
        if kernel == "xla":
            out, lse = _xla_decode(query, key, value, lengths, starts, block_table, sinks, alibi, spec)
        else:
            out, lse = _kernel_decode(query, key, value, lengths, starts, block_table, sinks, alibi, spec)
        return AttentionOutput(attention_outputs=out, lse=lse if return_lse else None)

    # --- the generic interface: the whole key/value array is the cache ----------------------------
    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        unsupported = {"bias": arrays.bias, "mask": arrays.mask, "dropout_rng": arrays.dropout_rng,
                       "segment_ids": arrays.segment_ids, "cu_seqlens": arrays.cu_seqlens, "max_seqlen": call.max_seqlen}
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given or call.return_weights:
            raise NotImplementedError(f"decode does not take {given + (['return_weights'] if call.return_weights else [])}; "
                                      "use 'vanilla' or 'flash'.")
        query, key, value = arrays.qkv
        b, t, s = query.shape[0], query.shape[call.seq_axis], key.shape[call.seq_axis]
        lengths = jnp.full((b,), s, jnp.int32)
        rule = call.visibility
        return self._run(query, key, value, lengths, None, None, arrays.softmax_aux,
                         kernel=_KERNEL_OF_BACKEND.get(call.backend, "xla"), causal=rule.causal, window=rule.window,
                         pos_shift=rule.cache_pos_shift(t, s), softcap=call.logits_soft_cap, q_layout=call.layout,
                         cache_layout="BSHD" if call.layout == "BTHD" else "BHSD", return_lse=True,
                         alibi=arrays.alibi_slopes, scale=call.scale_for(query.shape[-1]))


def kernel_reasons(kernel: str, platform: str, dtype: str) -> list[str]:
    """Why `kernel` cannot run on `platform` with `dtype` inputs (empty when it can)."""
    reasons = []
    if kernel == "triton":
        if platform != "gpu":
            reasons.append(f"the Triton kernel runs on gpu, not {platform} (kernel='xla' runs anywhere)")
        reasons += missing_gpu_packages()
    if kernel == "pallas" and platform != "tpu":
        reasons.append(f"the Pallas kernel runs on tpu, not {platform} (kernel='xla' runs anywhere)")
    if kernel != "xla" and dtype == "float64":
        reasons.append(f"dtype float64 is not supported by the {kernel} kernel (use kernel='xla')")
    return reasons


def decode_attention(
    query: jax.Array,
    key_cache: jax.Array,
    value_cache: jax.Array,
    lengths: jax.Array,
    *,
    starts: Optional[jax.Array] = None,
    block_table: Optional[jax.Array] = None,
    sliding_window: Union[None, int, tuple[int, int]] = None,
    logits_soft_cap: Optional[float] = None,
    softmax_aux: Optional[jax.Array] = None,
    cache_layout: Optional[CacheLayout] = None,
    query_layout: Literal["BTHD", "BHTD"] = "BTHD",
    kernel: Optional[Kernel] = None,
    return_lse: bool = False,
    metadata: Optional[AttentionMetadata] = None,
    causal: bool = True,
    alibi_slopes: Optional[jax.Array] = None,
) -> AttentionOutput:
    """Attention of T <= 16 new queries per sequence against a ragged KV cache (module docstring).

    Args:
        query: (B, T, Hq, D), or (B, Hq, T, D) with query_layout="BHTD".
        key_cache: (B, S_max, Hkv, D) "BSHD", (B, Hkv, S_max, D) "BHSD", or pages (P, PS, Hkv, D).
        value_cache: the same layout with head dim Dv.
        lengths: (B,) integer valid lengths (exclusive end of the valid region), at most S.
        starts: (B,) integer first valid positions, or None for 0.
        block_table: (B, max_pages) integer page indices (paged caches only).
        sliding_window: w (each query sees positions >= its own - w), or (left, right) as in
            `attention()` (right is moot under causality), or None.
        logits_soft_cap: c in c * tanh(logits / c), or None.
        softmax_aux: (Hq,) or (Hq, n) sink logits, or None.
        cache_layout: "BSHD", "BHSD" or "paged"; None: "paged" with a block table, else "BSHD".
        query_layout: "BTHD" or "BHTD"; the output has the same layout.
        kernel: "triton" (GPU), "pallas" (TPU), "xla" (anywhere), or None for the platform's.
        return_lse: also return the (B, Hq, T) float32 log-sum-exp of each query's logits.
        metadata: scale (`softmax_scale`), runtime dtype, platform; default `AttentionMetadata()`.
        causal: True: each query sees positions up to its own. False: every query sees the whole
            valid region [start, length) (the window, when given, still applies around each
            query's position, on both sides).
        alibi_slopes: float (Hq,) or (B, Hq) ALiBi slopes, or None: -slope * |pos - j| joins the
            logit of the query at position pos = length - T + t and position j, after scale and
            soft cap (flash-attn's convention); computed in float32, no gradient.

    Returns:
        AttentionOutput with `attention_outputs` (B, T, Hq, Dv) (or (B, Hq, T, Dv)) in the query's
        dtype, and `lse` when asked.

    Raises:
        ValueError: malformed arguments (naming the argument and the expected shape), or a kernel
            that cannot run here (with the reasons).
    """
    metadata = metadata if metadata is not None else AttentionMetadata()
    return _instance(metadata).decode(
        query, key_cache, value_cache, lengths, starts=starts, block_table=block_table,
        sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux,
        cache_layout=cache_layout, query_layout=query_layout, kernel=kernel, return_lse=return_lse, causal=causal,
        alibi_slopes=alibi_slopes,
    )


@functools.lru_cache(maxsize=64)
def _instance(metadata: AttentionMetadata) -> DecodeAttn:
    return DecodeAttn(metadata)
