"""Zero-copy torch <-> JAX through the DLPack protocol.

torch -> JAX: `jax.dlpack.from_dlpack(tensor)`. On CUDA, DLPack's stream argument makes JAX's
stream wait on an event recorded on torch's current stream (no host synchronisation). `to_jax`
converts several tensors with one such handshake: the first tensor carries it, the others are
exported with stream=-1 ("already ordered").

JAX -> torch: `torch.from_dlpack(array)`; JAX makes torch's current stream wait until the array is
ready.

Tensors JAX cannot import as they are:
  * broadcast (stride-0) dimensions are narrowed to size 1 (`narrow_broadcast`), and the caller
    re-broadcasts in JAX;
  * other non-contiguous tensors and buffers not aligned to 16 bytes are copied once;
  * tensors that require grad are detached (autograd is the caller's business).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.dlpack
import torch

_ALIGNMENT = 16


def narrow_broadcast(tensor: torch.Tensor) -> tuple[torch.Tensor, Optional[tuple[int, ...]]]:
    """Narrows broadcast (stride-0) dims to size 1: (view, full shape to re-broadcast to, or None)."""
    broadcast = [i for i, (n, s) in enumerate(zip(tensor.shape, tensor.stride())) if s == 0 and n > 1]
    if not broadcast:
        return tensor, None
    narrowed = tensor
    for i in broadcast:
        narrowed = narrowed.narrow(i, 0, 1)
    return narrowed, tuple(tensor.shape)


def importable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as JAX can import it without a copy: detached, dense row-major, 16-byte aligned.

    Contiguous aligned tensors are returned as views of the same memory; others are copied once.
    """
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    elif tensor.numel() and tensor.data_ptr() % _ALIGNMENT:
        tensor = tensor.clone()
    canonical = _contiguous_strides(tensor.shape)
    if tensor.stride() != canonical:
        # Size-1 dims may carry any stride in torch; DLPack consumers read strides as a layout.
        tensor = tensor.as_strided(tensor.shape, canonical)
    return tensor


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


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
    """Imports tensors into JAX (zero-copy where `importable` allows), one stream handshake per device."""
    out, handshaken = [], set()
    for t in map(importable, tensors):
        if t.device.type == "cuda" and t.device in handshaken:
            out.append(jax.dlpack.from_dlpack(_Ordered(t)))
        else:
            out.append(jax.dlpack.from_dlpack(t))
            handshaken.add(t.device)
    return out


def to_torch(arrays: Sequence[jax.Array]) -> list[torch.Tensor]:
    """Exports JAX arrays to torch, zero-copy; torch's current stream waits for them."""
    return [torch.from_dlpack(a) for a in arrays]
