"""Triton kernels launched on torch tensors, on torch's current stream, with no other runtime.

    >>> launch = KernelLaunch(my_kernel, grid=(8, 4), num_warps=4, num_stages=2,
    ...                       tensors=("X", "Y"), scalars=dict(n=1024, BLOCK=128))
    >>> launch(x, y)              # my_kernel[(8, 4)](X=x, Y=y, n=1024, BLOCK=128) on torch's stream

A `KernelLaunch` fixes everything about a launch except the tensors (the kernel, grid, warps,
stages and scalar arguments), so it can be planned once per call signature and reused:

* Eager, on CUDA: the first call goes through Triton's `kernel[grid](...)`, which compiles (or
  finds the compiled kernel in its cache) and launches; the compiled kernel is kept, and later
  calls whose tensors have the same 16-byte alignment call its launcher directly, skipping
  Triton's argument binding and cache lookup (most of a Triton launch's host time).
* Under `torch.compile` (inside a `triton_op` body, see `differentiable.py`): through
  `torch.library.wrap_triton`, so Inductor sees the kernel and can put it in a CUDA graph.
* Under Triton's interpreter (`TRITON_INTERPRET=1`, torch CPU tensors): `kernel[grid](...)` runs
  it on the CPU, which is how the CPU test suite exercises this launcher.

Launches use the current CUDA stream of the tensors' device, so they order with the torch work
around them and can be captured in a CUDA graph.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional, Sequence

import torch


class _TraceState(threading.local):
    def __init__(self) -> None:
        self.wrapped = False


_trace = _TraceState()


class wrapped_launches:
    """Context: launches inside go through `torch.library.wrap_triton` (the body of a triton_op)."""

    def __enter__(self):
        self._before, _trace.wrapped = _trace.wrapped, True

    def __exit__(self, *exc):
        _trace.wrapped = self._before


def traced() -> bool:
    """Whether launches go through `wrap_triton` now (inside a triton_op body: sizes may be symbolic)."""
    return _trace.wrapped


def interpreted() -> bool:
    """Whether Triton runs kernels under its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_launch(device: torch.device) -> bool:
    """Whether Triton kernels can run on tensors of `device` here: CUDA with Triton, or any CPU
    tensor under the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return not interpreted()
    return device.type == "cpu" and interpreted()


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class KernelLaunch:
    """One kernel's launch with everything fixed but its tensors.

    Args:
        kernel: a `@triton.jit` function.
        grid: launch grid (1 to 3 ints).
        num_warps, num_stages: Triton launch options.
        tensors: the names of the kernel's tensor arguments, in the order `__call__` takes them.
        scalars: every other argument of the kernel (runtime ints/floats and constexprs) by name.
    """

    __slots__ = ("kernel", "grid", "num_warps", "num_stages", "tensors", "scalars", "_slots", "_compiled",
                 "_alignment")

    def __init__(self, kernel, grid: Sequence[int], num_warps: int, num_stages: int, tensors: Sequence[str],
                 scalars: dict[str, Any]):
        self.kernel = kernel
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.num_warps, self.num_stages = int(num_warps), int(num_stages)
        self.tensors = tuple(tensors)
        self.scalars = dict(scalars)
        names = list(getattr(kernel, "arg_names", ()))
        missing = [n for n in names if n not in self.scalars and n not in self.tensors]
        extra = [n for n in list(self.scalars) + list(self.tensors) if names and n not in names]
        if missing or extra:
            raise TypeError(f"{getattr(kernel, '__name__', kernel)}: arguments missing {missing}, unknown {extra}.")
        # Positional order of the kernel's signature: a tensor slot index, or the scalar value.
        self._slots = [(self.tensors.index(n), None) if n in self.tensors else (None, self.scalars[n]) for n in names]
        self._compiled = None
        self._alignment = None

    def _kwargs(self, tensors) -> dict:
        return dict(zip(self.tensors, tensors), **self.scalars)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if len(tensors) != len(self.tensors):
            raise TypeError(f"expected {len(self.tensors)} tensors ({', '.join(self.tensors)}), got {len(tensors)}.")
        if _trace.wrapped:
            from torch.library import wrap_triton

            wrap_triton(self.kernel)[self.grid](**self._kwargs(tensors), num_warps=self.num_warps,
                                                num_stages=self.num_stages)
            return
        device = tensors[0].device
        if device.type != "cuda":  # the interpreter
            self.kernel[self.grid](**self._kwargs(tensors))
            return
        alignment = tuple(_aligned(t) for t in tensors)
        if self._compiled is not None and alignment == self._alignment:
            self._fast(tensors, device)
            return
        with torch.cuda.device(device):
            compiled = self.kernel[self.grid](**self._kwargs(tensors), num_warps=self.num_warps,
                                              num_stages=self.num_stages)
        if self._compiled is None:
            self._compiled, self._alignment = compiled, alignment

    def _fast(self, tensors, device: torch.device) -> None:
        """Calls the compiled kernel's launcher directly (what Triton's run does after its lookup)."""
        from triton import knobs

        k = self._compiled
        args = [tensors[i] if i is not None else v for i, v in self._slots]
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = _raw_stream(index)
        hooks = knobs.runtime
        metadata = None if hooks.launch_enter_hook is None else k.launch_metadata(self.grid, stream, *args)
        g0, g1, g2 = self.grid
        if index == torch.cuda.current_device():
            k.run(g0, g1, g2, stream, k.function, k.packed_metadata, metadata, hooks.launch_enter_hook,
                  hooks.launch_exit_hook, *args)
            return
        with torch.cuda.device(index):
            k.run(g0, g1, g2, stream, k.function, k.packed_metadata, metadata, hooks.launch_enter_hook,
                  hooks.launch_exit_hook, *args)


def _raw_stream(index: int) -> int:
    """The handle of torch's current CUDA stream on device `index` (the capture stream while a CUDA
    graph is being captured)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return get(index) if get is not None else torch.cuda.current_stream(index).cuda_stream


_PLACEHOLDERS: dict = {}


def empty_placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-element tensor for a pointer argument the kernel does not read (a feature switched off).

    Eager calls share one per (dtype, device), allocated once (an allocation per unused pointer would
    cost more host time than the launch); traced calls allocate theirs, since a kept real tensor must
    not enter a fake-tensor trace.
    """
    if _trace.wrapped:
        return torch.empty(1, dtype=dtype, device=device)
    key = (dtype, device)
    found = _PLACEHOLDERS.get(key)
    if found is None:
        found = _PLACEHOLDERS[key] = torch.empty(1, dtype=dtype, device=device)
    return found


def optional(t: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`t`, or a placeholder when it is None."""
    return t if t is not None else empty_placeholder(dtype, device)
