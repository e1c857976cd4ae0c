"""torch device <-> JAX device mapping (cuda:N is the JAX GPU with local hardware id N), and device facts."""

from __future__ import annotations

import functools

import jax
import torch


def to_jax_device(device: torch.device) -> jax.Device:
    """This process's JAX device holding tensors of a torch device ("cpu" or "cuda:N").

    "cuda" without an index means the current CUDA device at the time of the call. Only local
    devices count: with several processes (`jax.distributed`), every process has a GPU with local
    hardware id 0 and its own first CPU device.
    """
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _jax_device_of(device)


@functools.lru_cache(maxsize=64)
def _jax_device_of(device: torch.device) -> jax.Device:
    if device.type == "cpu":
        return jax.local_devices(backend="cpu")[0]
    if device.type == "cuda":
        index = device.index
        for d in jax.local_devices(backend="gpu"):
            if d.local_hardware_id == index:
                return d
        raise RuntimeError(f"device {device}: JAX sees no GPU with local hardware id {index}.")
    raise TypeError(f"device {device}: only cpu and cuda tensors can cross into JAX.")


def to_torch_device(device: jax.Device) -> torch.device:
    """The torch device of a JAX device."""
    if device.platform == "cpu":
        return torch.device("cpu")
    if device.platform in ("gpu", "cuda", "rocm"):
        return torch.device("cuda", device.local_hardware_id)
    raise TypeError(f"JAX device {device} ({device.platform}) has no torch equivalent.")


@functools.lru_cache(maxsize=None)  # asked per launch; a device's multiprocessors are fixed
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device, default: int) -> int:
    """Multiprocessors (SMs) of a CUDA device; `default` off CUDA (kernels under an interpreter)."""
    if device.type != "cuda":
        return default
    return _cuda_multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
