"""torch device <-> JAX device mapping (cuda:N is the JAX GPU with local hardware id N)."""

from __future__ import annotations

import functools

import jax
import torch


@functools.lru_cache(maxsize=64)
def to_jax_device(device: torch.device) -> jax.Device:
    """The JAX device holding tensors of a torch device ("cpu" or "cuda:N")."""
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        for d in jax.devices("gpu"):
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
