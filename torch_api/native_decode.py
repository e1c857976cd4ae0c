"""The decode kernels launched from torch: on torch's stream, on the tensors' own memory.

The same Triton kernels as `decode_attention`'s XLA path (`jax_core/kernels/decode_jax_triton.py`):
the segment table, the stream-K attention kernel and the merge, planned by the same
`decode_plan` and launched through the same all-constexpr entries, but by Triton itself on torch
tensors, so no XLA executable (and none of its per-call host cost) is on the call path. q and the
caches are read in place through their strides (BSHD, BHSD, paged; views included); the output is
written in q's memory order. Launches are planned once per call signature.

Forward only: a call that needs a gradient (grad mode on and an input requiring grad, forward-mode
AD, functorch transforms) keeps the XLA path, whose gradients come from the XLA formulation.

Shape legend: B batch, Hq / Hkv query / KV heads, T queries per sequence, S capacity, D / Dv head
dims, P pages, PS page size.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch
from torch.autograd import forward_ad

from ..bridge.devices import multiprocessors
from ..bridge.triton_autograd import TritonOp, cached_hash
from ..bridge.triton_launch import KernelLaunch, can_launch, optional, traced
from ..jax_core.kernels.decode_plan import (DEFAULT_SMS, DecodeCall, DecodeConfig, cache_dims, cache_order,
                                            plan_decode, query_order)
from .launch import FUNCTORCH_REASON, current_launcher

try:
    from ..jax_core.kernels.decode_entries_triton import stream_entry, stream_merge_entry
    from ..jax_core.kernels.decode_segments_triton import segment_offsets_entry
except ImportError:  # no triton: `can_launch` is False and nothing below is launched
    stream_entry = stream_merge_entry = segment_offsets_entry = None

#: The largest head dim the decode kernels take (`DecodeAttn.capabilities`).
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class NativeDecodeSpec:
    """Everything static about a native decode call besides the tensors' shapes and strides."""

    cfg: DecodeConfig
    num_inputs: int = 8  # q, k, v, lengths, starts, block_table, sinks, alibi_slopes

    def __hash__(self) -> int:
        return cached_hash(self, self.cfg, self.num_inputs)


# --- selection ------------------------------------------------------------------------------------


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call on `tensors` is differentiated (reverse mode, forward mode or a functorch
    transform): the XLA path serves those calls."""
    if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        return True
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def native_reasons(device: torch.device, dtype: torch.dtype, d: int, dv: int, kernel: Optional[str]) -> list[str]:
    """Why the native launcher cannot run a decode call (empty when it can)."""
    reasons = [FUNCTORCH_REASON] if torch._C._are_functorch_transforms_active() else []
    if kernel not in (None, "triton"):
        reasons.append(f"kernel={kernel!r} runs through JAX (the native launcher runs kernel=None or 'triton')")
    if not can_launch(device):
        where = "a CUDA device with Triton installed" if device.type != "cpu" else "TRITON_INTERPRET=1 on CPU"
        reasons.append(f"the native launcher needs {where} (device {device})")
    if dtype == torch.float64:
        reasons.append("dtype float64 is not supported by the Triton decode kernels (use sdpa_launcher('xla'))")
    if max(d, dv) > MAX_HEAD_DIM:
        reasons.append(f"head dims {d} / {dv}: the Triton decode kernels take at most {MAX_HEAD_DIM}")
    return reasons


def native_spec(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: Optional[torch.Tensor], *,
                window: tuple[int, int], softcap: Optional[float], scale: Optional[float], cache_layout: str,
                kernel: Optional[str], causal: bool = True) -> Optional[NativeDecodeSpec]:
    """The spec of a native launch of this (validated) `decode_attention` call, or None when the
    XLA path runs it: `sdpa_launcher("xla")`, a call that needs gradients, or under "auto" a call
    off CUDA or one the native launcher cannot run. `cache_layout` is "BSHD", "BHSD" or "paged";
    `window` is (left, right) around each query's position (-1: unbounded).

    Raises:
        ValueError: under `sdpa_launcher("native")`, a call the native launcher cannot run (with
            the reasons).
    """
    launcher = current_launcher()
    if launcher == "xla" or needs_grad(q, k_cache, v_cache, sinks):
        return None
    reasons = native_reasons(q.device, q.dtype, q.shape[3], v_cache.shape[3], kernel)
    if launcher == "native":
        if reasons:
            raise ValueError("sdpa_launcher('native') cannot run this decode_attention call: " + "; ".join(reasons)
                             + ".")
    elif reasons or q.device.type != "cuda":
        return None
    fast_tanh = q.device.type == "cuda" and torch.version.hip is None
    window = (int(window[0]), int(window[1]))
    key = (scale, window, causal, softcap, cache_layout, fast_tanh, q.shape[3])
    if not torch.compiler.is_compiling():
        found = _SPECS.get(key)
        if found is not None:
            return found
    cfg = DecodeConfig(scale=float(scale) if scale is not None else q.shape[3] ** -0.5, causal=bool(causal),
                       window=window, pos_shift=0,
                       softcap=None if softcap is None else float(softcap), q_layout="BHTD",
                       cache_layout=cache_layout, fast_tanh=fast_tanh)
    spec = NativeDecodeSpec(cfg)
    if not torch.compiler.is_compiling():
        if len(_SPECS) >= 1024:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


_SPECS: dict = {}


def decode_native(spec: NativeDecodeSpec, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  lengths: torch.Tensor, starts: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor], return_lse: bool, alibi_slopes: Optional[torch.Tensor] = None):
    """The native launch of a validated `decode_attention` call: out (B, Hq, T, Dv) in q's memory
    order, and the (B, Hq, T) float32 LSE with `return_lse`.

    lengths / starts are (B,) int32, block_table (B, max_pages) int32 (paged), sinks (Hq,) or
    (Hq, n) float (several sinks per head merge by log-sum-exp, as on the XLA path), alibi_slopes
    float32 (Hq,) or (B, Hq).
    """
    if sinks is not None:
        sinks = (sinks.float() if sinks.dim() == 1 else torch.logsumexp(sinks.float(), -1)).contiguous()
    if block_table is not None and block_table.stride(1) != 1:  # the kernel reads a row's entries in a run
        block_table = block_table.contiguous()
    if alibi_slopes is not None:  # the kernel reads a head's slopes at consecutive addresses
        alibi_slopes = alibi_slopes.detach().contiguous()
    out, lse = DECODE_OP(spec, q, k_cache, v_cache, lengths.contiguous(),
                         None if starts is None else starts.contiguous(), block_table, sinks, alibi_slopes)
    return (out, lse) if return_lse else out


# --- launches -------------------------------------------------------------------------------------


class _Launches(NamedTuple):
    segments: KernelLaunch
    stream: KernelLaunch
    merge: KernelLaunch
    num_segments: int
    part_shape: tuple[int, int, int, int, int]
    out_bthd: bool  # Out is (B, T, Hq, Dv) memory viewed as (B, Hq, T, Dv), as q is


def _ints(values) -> tuple[int, ...]:
    return tuple(int(n) for n in values)


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """Element strides, 0 on size-1 dims (where any stride reads the same element)."""
    return tuple(0 if n == 1 else st for n, st in zip(_ints(t.shape), _ints(t.stride())))


def _bthd_memory(q_shape, q_strides) -> bool:
    """Whether a (B, Hq, T, D) query is a view of (B, T, Hq, D) memory (heads inside positions)."""
    _, hq, t, _ = q_shape
    return hq > 1 and t > 1 and q_strides[1] < q_strides[2]


def _out_strides(b: int, hq: int, t: int, dv: int, bthd: bool) -> tuple[int, int, int, int]:
    """(b, h, t, d) strides of Out (`_out_buffer`)."""
    return (t * hq * dv, dv, hq * dv, 1) if bthd else (hq * t * dv, t * dv, dv, 1)


def _out_buffer(q: torch.Tensor, dv: int, bthd: bool) -> torch.Tensor:
    b, hq, t, _ = q.shape
    return torch.empty_strided((b, hq, t, dv), _out_strides(b, hq, t, dv, bthd), dtype=q.dtype, device=q.device)


def device_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (`DEFAULT_SMS` off CUDA: the interpreter)."""
    return multiprocessors(device, DEFAULT_SMS)


def _alibi_stride(alibi: Optional[torch.Tensor]) -> Optional[int]:
    """The slopes' batch stride (0 for one slope per head, or one batch row), None without ALiBi."""
    if alibi is None:
        return None
    return 0 if alibi.dim() == 1 or alibi.shape[0] == 1 else int(alibi.stride(0))


def _plan_launches(spec: NativeDecodeSpec, q, k, v, starts, block_table, sinks, alibi=None) -> _Launches:
    cfg = spec.cfg
    paged = cfg.cache_layout == "paged"
    b, hq, t, d = _ints(q.shape)
    dv = int(v.shape[3])
    hkv, capacity, page_size = cache_dims(_ints(k.shape), cfg.cache_layout,
                                          None if block_table is None else _ints(block_table.shape))
    q_strides = _strides(q)
    bthd = _bthd_memory((b, hq, t, d), q_strides)
    cache_layout = "BSHD" if paged else cfg.cache_layout
    call = DecodeCall(
        b=b, t=t, hq=hq, d=d, dv=dv, hkv=hkv, capacity=capacity, page_size=page_size,
        q_strides=query_order(q_strides, "BHTD"), k_strides=cache_order(_strides(k), cache_layout),
        v_strides=cache_order(_strides(v), cache_layout),
        out_strides=query_order(_out_strides(b, hq, t, dv, bthd), "BHTD"),
        table_stride=int(block_table.stride(0)) if paged else 0, dtype_bytes=q.element_size(),
        has_starts=starts is not None, has_sinks=sinks is not None, alibi_stride=_alibi_stride(alibi),
    )
    plan = plan_decode(call, cfg, device_sms(q.device))
    absent = {name for name, tensor in (("Starts", starts), ("BlockTable", block_table), ("Sinks", sinks),
                                        ("Alibi", alibi)) if tensor is None}
    dtypes = dict(Starts=torch.int32, BlockTable=torch.int32, Sinks=torch.float32, Alibi=torch.float32)

    def launch(kernel, planned, names) -> KernelLaunch:
        fixed = {n: optional(None, dtypes[n], q.device) for n in names if n in absent}
        return KernelLaunch(kernel, planned.grid, planned.num_warps, planned.num_stages,
                            [n for n in names if n not in absent], planned.args, fixed)

    return _Launches(
        segments=launch(segment_offsets_entry, plan.segments, ("Lengths", "Starts", "SegCum")),
        stream=launch(stream_entry, plan.stream, ("Q", "K", "V", "Lengths", "Starts", "BlockTable", "SegCum",
                                                  "Alibi", "Out", "Lse")),
        merge=launch(stream_merge_entry, plan.merge, ("OutPart", "LsePart", "SegCum", "Sinks", "Out", "Lse")),
        num_segments=plan.num_segments, part_shape=plan.part_shape, out_bthd=bthd,
    )


# Launches per call signature: planning costs more host time than launching.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 4096


def _launches(spec: NativeDecodeSpec, q, k, v, starts, block_table, sinks, alibi=None) -> _Launches:
    if traced():  # symbolic sizes are not hashable, and a traced call plans once anyway
        return _plan_launches(spec, q, k, v, starts, block_table, sinks, alibi)
    key = (spec, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), v.shape, v.stride(), starts is not None,
           None if block_table is None else (block_table.shape, block_table.stride(0)), sinks is not None,
           None if alibi is None else (alibi.shape, _alibi_stride(alibi)))
    found = _LAUNCHES.get(key)
    if found is None:
        if len(_LAUNCHES) >= _MAX_LAUNCHES:
            _LAUNCHES.clear()
        found = _LAUNCHES[key] = _plan_launches(spec, q, k, v, starts, block_table, sinks, alibi)
    return found


def _given(*tensors: Optional[torch.Tensor]) -> list:
    """The tensors a launch takes: those present (the absent ones are its fixed placeholders)."""
    return [t for t in tensors if t is not None]


def _forward(spec: NativeDecodeSpec, q, k, v, lengths, starts, block_table, sinks, alibi=None):
    """(out, lse): the segment table, the stream kernel's partial results, their merge."""
    launches = _launches(spec, q, k, v, starts, block_table, sinks, alibi)
    dev = q.device
    seg_cum = torch.empty(launches.num_segments + 1, dtype=torch.int32, device=dev)
    launches.segments(*_given(lengths, starts, seg_cum))
    out_part = torch.empty(launches.part_shape, dtype=torch.float32, device=dev)
    lse_part = torch.empty(launches.part_shape[:-1], dtype=torch.float32, device=dev)
    launches.stream(*_given(q, k, v, lengths, starts, block_table, seg_cum, alibi, out_part, lse_part))
    out = _out_buffer(q, v.shape[3], launches.out_bthd)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=dev)
    launches.merge(*_given(out_part, lse_part, seg_cum, sinks, out, lse))
    return out, lse


def _backward(spec, inputs, outputs, grads, needs):
    raise NotImplementedError(
        "jaxattn::native_decode is forward-only: decode_attention sends calls that need gradients to the XLA "
        "path (differentiable); this backward is never planned.")


DECODE_OP = TritonOp("jaxattn::native_decode", _forward, _backward, num_outputs=2,
                     spec_types=(NativeDecodeSpec, DecodeConfig))
