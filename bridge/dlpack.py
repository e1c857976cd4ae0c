"""Zero-copy torch <-> JAX through the DLPack protocol, with one CUDA stream handshake per call.

torch -> JAX (`to_jax`, `import_tensors`): each tensor is exported as a DLPack capsule and imported
by jaxlib's `dlpack_managed_tensor_to_buffer` (the function `jax.dlpack.from_dlpack` ends in, minus
its per-tensor Python work), given JAX's stream for external ready events. On CUDA one handshake
per call orders that stream after torch's current stream (an event recorded on torch's stream,
waited for on JAX's; no host synchronisation); every imported buffer's definition event is then
recorded on JAX's stream after the wait. Where jaxlib lacks the known signature the public
`jax.dlpack.from_dlpack` is used instead (`FAST_DLPACK` says which).

JAX -> torch (`to_torch`, `export_arrays`): jaxlib's `buffer_to_dlpack_managed_tensor`, given
torch's current stream, makes that stream wait for the array's ready event; `torch._C._from_dlpack`
wraps the capsule. On CPU the export waits for the array (there is no stream to wait on).

Tensors JAX cannot import as they are:
  * broadcast (stride-0) dimensions are narrowed to size 1 (`narrow_broadcast`), and the caller
    re-broadcasts in JAX;
  * other non-contiguous tensors and buffers not aligned to 16 bytes are copied once;
  * size-1 dimensions with arbitrary strides get canonical strides (a view, no copy).
Tensors that require grad are exported without their autograd history.
"""

from __future__ import annotations

import functools
import threading
from typing import Optional, Sequence

import jax
import jax.dlpack
import torch

from .devices import to_jax_device
from .dtypes import X64_DTYPES

ALIGNMENT = 16
_DL_CPU, _DL_CUDA = 1, 2

try:  # jaxlib >= 0.7 (extension version 467): the five-argument importer
    from jax._src.lib import _jax as _jaxlib
    from jax._src.lib import jaxlib_extension_version as _EXT

    _import_capsule = _jaxlib.dlpack_managed_tensor_to_buffer
    _export_capsule = _jaxlib.buffer_to_dlpack_managed_tensor
    _FAST_AVAILABLE = _EXT >= 467
except (ImportError, AttributeError):  # pragma: no cover - older jaxlib
    _FAST_AVAILABLE = False
FAST_DLPACK = _FAST_AVAILABLE


def set_fast_dlpack(enabled: bool) -> bool:
    """Turns the jaxlib-level import/export on or off (off: the public DLPack functions); returns
    the previous setting. Meant for tests and for ruling the fast path out when debugging."""
    global FAST_DLPACK
    previous = FAST_DLPACK
    if enabled and not _FAST_AVAILABLE:
        raise RuntimeError(
            f"jax {jax.__version__}: jaxlib lacks the known dlpack_managed_tensor_to_buffer signature; "
            "only the public jax.dlpack path is available."
        )
    FAST_DLPACK = bool(enabled)
    return previous


def narrow_broadcast(tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple[int, ...]]]:
    """Narrows broadcast (stride-0) dims to size 1: (view, full shape to re-broadcast to, or None)."""
    broadcast = [i for i, (n, s) in enumerate(zip(tensor.shape, tensor.stride())) if s == 0 and n > 1]
    if not broadcast:
        return tensor, None
    narrowed = tensor
    for i in broadcast:
        narrowed = narrowed.narrow(i, 0, 1)
    return narrowed, tuple(tensor.shape)


@functools.lru_cache(maxsize=1024)
def contiguous_strides(shape) -> tuple[int, ...]:
    """Row-major strides of `shape` (size-1 and size-0 dims counted as 1)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def importable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as JAX can import it without a copy: detached, dense row-major, 16-byte aligned.

    Contiguous aligned tensors are returned as views of the same memory (the tensor itself when it
    needs no change); others are copied once.
    """
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    elif tensor.data_ptr() % ALIGNMENT and tensor.numel():
        tensor = tensor.clone()
    canonical = contiguous_strides(tensor.shape)
    if tensor.stride() != canonical:
        # Size-1 dims may carry any stride in torch; DLPack consumers read strides as a layout.
        tensor = tensor.as_strided(tensor.shape, canonical)
    return tensor


# --- CUDA stream handshake ---------------------------------------------------------------------

_external_streams: dict[int, torch.cuda.ExternalStream] = {}
_local = threading.local()


def cuda_handshake(device: torch.device, jax_device: jax.Device) -> tuple[int, int]:
    """Orders JAX's external-ready-events stream after torch's current stream on `device`.

    Raises RuntimeError while torch's current stream is capturing a CUDA graph (JAX's work would
    not be part of the graph; CUDA would invalidate the capture with an opaque error).

    Returns:
        (JAX stream pointer for `import_tensors`, torch stream pointer for `export_arrays`; 1
        stands for CUDA's legacy default stream, as DLPack spells it).
    """
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "jaxattn.bridge: a JAX computation cannot be captured in a CUDA graph (torch.cuda.graph, "
            "torch.compile's mode='reduce-overhead'): JAX launches its kernels on its own streams, outside "
            "the capture. Run this call outside the captured region (capture the code around it), or use "
            "torch.compile(mode='max-autotune-no-cudagraphs')."
        )
    jax_stream = jax_device.get_stream_for_external_ready_events()
    external = _external_streams.get(jax_stream)
    if external is None:
        if len(_external_streams) >= 64:  # JAX hands out one stream per device; stay bounded regardless
            _external_streams.clear()
        external = _external_streams.setdefault(jax_stream, torch.cuda.ExternalStream(jax_stream, device=device))
    current = torch.cuda.current_stream(device)
    # One event per thread and device: recording it again is safe, since a wait binds to the
    # record that precedes it; threads must not share one (a record between another thread's
    # record and wait would redirect that wait).
    events = getattr(_local, "events", None)
    if events is None:
        events = _local.events = {}
    event = events.get(device)
    if event is None:
        event = events[device] = torch.cuda.Event()
    event.record(current)
    external.wait_event(event)
    return jax_stream, current.cuda_stream or 1


def torch_stream(device: torch.device) -> int:
    """DLPack pointer of torch's current stream on a CUDA device (1: the legacy default stream)."""
    return torch.cuda.current_stream(device).cuda_stream or 1


# --- import and export ---------------------------------------------------------------------------


def import_tensors(tensors: Sequence[torch.Tensor], jax_device: jax.Device, stream: Optional[int]) -> list[jax.Array]:
    """Imports `importable` tensors onto `jax_device` without copies.

    Args:
        tensors: dense row-major, 16-byte aligned tensors on the device of `jax_device`.
        jax_device: the JAX device holding their memory.
        stream: on CUDA, JAX's stream from `cuda_handshake` (already ordered after torch's);
            None on CPU.
    """
    if FAST_DLPACK:
        kind = _DL_CPU if stream is None else _DL_CUDA
        return [_import_capsule(torch._C._to_dlpack(t), jax_device, stream, None, kind) for t in tensors]
    return [jax.dlpack.from_dlpack(t.detach() if stream is None else _Ordered(t.detach())) for t in tensors]


def export_arrays(arrays: Sequence[jax.Array], stream: Optional[int]) -> list[torch.Tensor]:
    """Exports JAX arrays to torch without copies; on CUDA torch's stream `stream` waits for them."""
    if FAST_DLPACK:
        return [torch._C._from_dlpack(_export_capsule(a, stream=stream)) for a in arrays]
    return [torch.from_dlpack(a) for a in arrays]


class _Ordered:
    """Exports a CUDA tensor with stream=-1: the call already ordered JAX after torch's stream."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return self.tensor.__dlpack__(stream=-1, max_version=max_version, dl_device=dl_device, copy=copy)


def to_jax(tensors: Sequence[torch.Tensor]) -> list[jax.Array]:
    """Imports tensors into JAX (zero-copy where `importable` allows), one stream handshake per device.

    64-bit tensors become 32-bit arrays unless JAX's x64 mode is on (as `jax.dlpack.from_dlpack`).

    Raises:
        TypeError: `tensors` is not a list or tuple of torch tensors.
    """
    _check_sequence("to_jax", "tensors", tensors, torch.Tensor, "torch.Tensor")
    tensors = [importable(t) for t in tensors]
    out: list[Optional[jax.Array]] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        jax_device = to_jax_device(device)
        stream = cuda_handshake(device, jax_device)[0] if device.type == "cuda" else None
        for i, a in zip(idx, import_tensors([tensors[i] for i in idx], jax_device, stream)):
            out[i] = _canonical(a) if tensors[i].dtype in X64_DTYPES else a
    return out


def _canonical(a: jax.Array) -> jax.Array:
    dtype = jax.dtypes.canonicalize_dtype(a.dtype)
    return a if dtype == a.dtype else a.astype(dtype)


def to_torch(arrays: Sequence[jax.Array]) -> list[torch.Tensor]:
    """Exports JAX arrays to torch, zero-copy; torch's current stream waits for them.

    Raises:
        TypeError: `arrays` is not a list or tuple of JAX arrays.
    """
    _check_sequence("to_torch", "arrays", arrays, jax.Array, "jax.Array")
    out = []
    for a in arrays:
        (device,) = a.devices()
        stream = torch_stream(torch.device("cuda", device.local_hardware_id)) if device.platform in ("gpu", "cuda") else None
        out.extend(export_arrays([a], stream))
    return out


def _check_sequence(function: str, argument: str, values, kind: type, kind_name: str) -> None:
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{function}: {argument} must be a list or tuple of {kind_name}, got a {type(values).__name__} "
                        f"(wrap a single one: {function}([x])).")
    for i, value in enumerate(values):
        if not isinstance(value, kind):
            raise TypeError(f"{function}: {argument}[{i}] is a {type(value).__name__}; expected a {kind_name}.")
