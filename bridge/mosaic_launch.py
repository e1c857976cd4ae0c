"""Pallas Mosaic GPU kernels launched on torch tensors, with no XLA runtime on the call path.

    >>> kernel = MosaicKernel(my_jax_function)         # holds exactly one Mosaic GPU kernel call
    >>> out, = kernel(x, y, scale=0.5)                  # torch CUDA tensors in and out

`MosaicKernel` compiles the function once per static keyword settings and input shapes through
`jax.experimental.pallas.mosaic_gpu.as_torch_kernel`, which hands the kernel torch's buffers by
pointer: inputs must be contiguous (they are made so here). An input the function wraps in a mutable
JAX ref (`jax.new_ref`) is updated in place and comes back as an output.

`as_torch_kernel` launches on the device's default stream, not torch's current one, so
`mosaic_reasons` refuses a call made while another stream is current (a side stream, CUDA graph
capture): ordering with the caller's work would be lost there.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

#: Compute capability the Mosaic GPU kernels are written for (wgmma, TMA, setmaxnreg: Hopper).
MOSAIC_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def _mosaic_import_error() -> str:
    """Why Pallas Mosaic GPU's torch launcher cannot be imported ("" when it can)."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.as_torch_kernel  # noqa: B018 - present from jax 0.7
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available", with its reason
        return f"{type(exc).__name__}: {exc}"
    return ""


def mosaic_reasons(device: torch.device) -> list[str]:
    """Why a Mosaic GPU kernel cannot launch on `device` from here, now (empty when it can)."""
    if device.type != "cuda":
        return [f"Mosaic GPU kernels run on CUDA devices (device {device})"]
    reasons = []
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) != MOSAIC_CAPABILITY:
        reasons.append(f"Mosaic GPU kernels are written for sm90 (Hopper); device {device} is sm"
                       f"{capability[0]}{capability[1]}")
    if torch.cuda.current_stream(device) != torch.cuda.default_stream(device):
        reasons.append("a non-default CUDA stream is current (a side stream or CUDA graph capture), and "
                       "as_torch_kernel launches on the default stream")
    error = _mosaic_import_error()
    if error:
        reasons.append(f"Pallas Mosaic GPU's torch launcher cannot be imported ({error})")
    return reasons


class MosaicKernel:
    """A JAX function holding one Mosaic GPU kernel call, as a launcher on torch tensors.

    Args:
        fn: (*arrays, **static) -> arrays; `static` are hashable Python values compiled into the kernel.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._launchers: dict = {}
        self._lock = threading.Lock()

    def __call__(self, *tensors: torch.Tensor, **static: Any) -> Any:
        key = tuple(sorted(static.items()))
        launcher = self._launchers.get(key)
        if launcher is None:
            with self._lock:
                launcher = self._launchers.get(key)
                if launcher is None:
                    from jax.experimental.pallas import mosaic_gpu as plgpu

                    # as_torch_kernel caches its compilations per input shapes on the function object
                    # (weakly), so the partial is kept here for as long as this launcher lives.
                    launcher = self._launchers[key] = plgpu.as_torch_kernel(functools.partial(self.fn, **static))
        return launcher(*[t.contiguous() for t in tensors])
