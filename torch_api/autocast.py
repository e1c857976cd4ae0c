"""torch's autocast policy for attention, applied to jaxattn's torch API.

torch lists `scaled_dot_product_attention` among the ops autocast runs in the lower precision, on
CUDA and on CPU: inside `torch.autocast(device_type, dtype)`, every floating-point tensor argument
on that device type except float64 ones (query, key, value and an additive float mask alike) is
cast to the autocast dtype; bool masks and integer tensors are left alone. jaxattn's entry points
apply the same casts, then run with autocast off so their internal torch ops are not cast again.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


def autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype autocast casts attention arguments to on `device`, or None when it is off there."""
    kind = device.type
    try:
        if not torch.is_autocast_enabled(kind):
            return None
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know
        return None
    return torch.get_autocast_dtype(kind)


def cast(dtype: torch.dtype, device_type: str, t):
    """`t` as autocast would pass it to SDPA: cast when a floating tensor on `device_type` other than
    float64, unchanged otherwise (None, bool/integer tensors, float64, other devices)."""
    if (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            and t.dtype != dtype and t.device.type == device_type):
        return t.to(dtype)
    return t


def autocast_off(device_type: str):
    """A context with autocast disabled on `device_type` (the casts are already applied)."""
    return torch.autocast(device_type, enabled=False) if device_type in ("cuda", "cpu") else contextlib.nullcontext()
