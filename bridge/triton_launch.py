"""Triton kernels launched on torch tensors, on torch's current stream, with no other runtime.

    >>> launch = KernelLaunch(my_kernel, grid=(8, 4), num_warps=4, num_stages=2,
    ...                       tensors=("X", "Y"), scalars=dict(n=1024, BLOCK=128))
    >>> launch(x, y)              # my_kernel[(8, 4)](X=x, Y=y, n=1024, BLOCK=128) on torch's stream

A `KernelLaunch` fixes everything about a launch except the tensors (the kernel, grid, warps,
stages and scalar arguments), so it can be planned once per call signature and reused:

* Eager, on CUDA: the first call goes through Triton's `kernel[grid](...)`, which compiles (or
  finds the compiled kernel in its cache) and launches. The compiled kernel is kept, shared by every
  launch of the same specialization (kernel, constexprs, pointer dtypes, and what Triton specialises
  runtime integers on), so later calls — and new launches that differ only in runtime sizes, such as
  a growing KV cache — call its launcher directly with the tensors' pointers, skipping Triton's
  argument binding and cache lookup (most of a Triton launch's host time).
* Under `torch.compile` (inside a `triton_op` body, see `triton_autograd.py`): through
  `torch.library.wrap_triton`, so Inductor sees the kernel and can put it in a CUDA graph.
* Under Triton's interpreter (`TRITON_INTERPRET=1`, torch CPU tensors): `kernel[grid](...)` runs
  it on the CPU, which is how the CPU test suite exercises this launcher.

Launches use the current CUDA stream of the tensors' device, so they order with the torch work
around them and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
from typing import Any, Optional, Sequence

import torch

try:
    from triton import knobs
except ImportError:  # no triton: nothing is launched (`can_launch` is False)
    knobs = None


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


class KernelLaunch:
    """One kernel's launch with everything fixed but its tensors.

    Args:
        kernel: a `@triton.jit` function.
        grid: launch grid (1 to 3 ints).
        num_warps, num_stages: Triton launch options.
        tensors: the names of the kernel's tensor arguments, in the order `__call__` takes them.
        scalars: every other argument of the kernel (runtime ints/floats and constexprs) by name.
        fixed: tensor arguments that are the same for every call (placeholders of unused features),
            by name; `__call__` does not take them.
    """

    __slots__ = ("kernel", "grid", "num_warps", "num_stages", "tensors", "scalars", "fixed", "_values", "_order",
                 "_single", "_slots", "_compiled", "_compiled_on")

    def __init__(self, kernel, grid: Sequence[int], num_warps: int, num_stages: int, tensors: Sequence[str],
                 scalars: dict[str, Any], fixed: Optional[dict[str, torch.Tensor]] = None):
        self.kernel = kernel
        # Symbolic sizes (torch.compile with dynamic shapes) stay symbolic: the graph computes the grid.
        self.grid = tuple(g if isinstance(g, torch.SymInt) else int(g) for g in grid) + (1,) * (3 - len(grid))
        self.num_warps, self.num_stages = int(num_warps), int(num_stages)
        self.tensors = tuple(tensors)
        self.scalars = scalars
        self.fixed = fixed or {}
        others, self._order, self._single = _layout(kernel, self.tensors, tuple(self.fixed), tuple(scalars))
        self._slots = _slots(kernel, self.tensors, tuple(self.fixed), tuple(scalars))
        self._values = [self.fixed[n] if n in self.fixed else scalars[n] for n in others]
        self._compiled = None
        self._compiled_on = None

    def rebind(self, **scalars: Any) -> "KernelLaunch":
        """This launch with some runtime scalars replaced (same kernel, grid, tensors and constexprs).

        A growing KV cache changes a few sizes and strides per step; the copy keeps this launch's
        compiled kernel when every replaced integer keeps the properties Triton specialises on, so
        a step costs no planning, no argument binding and no cache lookup.
        """
        new = object.__new__(KernelLaunch)
        new.kernel, new.grid, new.num_warps, new.num_stages = self.kernel, self.grid, self.num_warps, self.num_stages
        new.tensors, new.fixed, new._order, new._single, new._slots = (self.tensors, self.fixed, self._order,
                                                                        self._single, self._slots)
        new.scalars = dict(self.scalars)
        new._values = list(self._values)
        same = True
        constexprs = _constexpr_names(self.kernel)
        for name, value in scalars.items():
            old = self.scalars[name]
            if name in constexprs and value != old:
                raise ValueError(f"{name}: a constexpr cannot be rebound ({old!r} -> {value!r}); plan a new launch.")
            new.scalars[name] = value
            new._values[self._slots[name]] = value
            same = same and _int_class(value) == _int_class(old)
        new._compiled, new._compiled_on = (self._compiled, self._compiled_on) if same else (None, None)
        return new

    def _kwargs(self, tensors) -> dict:
        return dict(zip(self.tensors, tensors), **self.fixed, **self.scalars)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if len(tensors) != len(self.tensors):
            raise TypeError(f"expected {len(self.tensors)} tensors ({', '.join(self.tensors)}), got {len(tensors)}.")
        if _trace.wrapped:
            if _shapes_only(tensors[0]):
                return
            from torch.library import wrap_triton

            wrap_triton(self.kernel)[self.grid](**self._kwargs(tensors), num_warps=self.num_warps,
                                                num_stages=self.num_stages)
            return
        device = tensors[0].device
        if device.type != "cuda":  # the interpreter
            self.kernel[self.grid](**self._kwargs(tensors))
            return
        pointers = [t.data_ptr() for t in tensors]
        # Kept compilations assume every pointer 16-byte aligned (Triton specialises on it); an
        # unaligned one goes through Triton's own lookup, which picks or compiles the right variant.
        # Launch hooks (profilers) see the tensors only through Triton's own path.
        direct = not functools.reduce(operator.or_, pointers) & 15 and _no_launch_hooks()
        if direct and self._compiled_on == device.index:
            self._fast(pointers, device)
            return
        if direct and self._adopt(tensors, device.index):
            self._fast(pointers, device)
            return
        with torch.cuda.device(device):
            compiled = self.kernel[self.grid](**self._kwargs(tensors), num_warps=self.num_warps,
                                              num_stages=self.num_stages)
        fixed_aligned = not any(t.data_ptr() & 15 for t in self.fixed.values())
        if direct and fixed_aligned and self._compiled is None:
            _COMPILED[(self._specialization(tensors), device.index)] = compiled
            self._adopt(tensors, device.index)

    def _specialization(self, tensors) -> tuple:
        """What Triton's compilation of this launch depends on besides all-aligned pointers: the kernel,
        warps, stages, the pointers' dtypes, every constexpr's value and, per runtime scalar, each
        property Triton specialises on (its integer width, equality to 1, divisibility by 16). Launches
        of equal keys run one compiled kernel (a new KV-cache length reuses the last one's)."""
        constexprs = _constexpr_names(self.kernel)
        key = []
        for name, value in self.scalars.items():
            if name in constexprs or not isinstance(value, int) or isinstance(value, bool):
                key.append((name, type(value).__name__, value))
            else:
                key.append((name, *_int_class(value)))
        pointers = tuple((n, t.dtype) for n, t in zip(self.tensors, tensors)) + tuple(
            (n, t.dtype) for n, t in self.fixed.items())
        return self.kernel, self.num_warps, self.num_stages, pointers, tuple(key)

    def _adopt(self, tensors, device_index: int) -> bool:
        """Takes the shared compilation for this launch's specialization on `device_index`, if any
        (later calls of this launch have the same dtypes: its planner's key includes them)."""
        compiled = _COMPILED.get((self._specialization(tensors), device_index))
        if compiled is None:
            return False
        # Fixed tensors go as their pointers (they live as long as this launch).
        self._values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in self._values]
        self._compiled, self._compiled_on = compiled, device_index
        return True

    def _fast(self, pointers: list, device: torch.device) -> None:
        """Calls the compiled kernel's launcher directly (what Triton's run does after its lookup).

        Pointers go as ints: Triton's launcher then skips the per-tensor `data_ptr` call and driver
        query it does for tensor objects (most of its host time for a many-argument kernel).
        """
        k = self._compiled
        args = self._order(pointers + self._values)
        if self._single:
            args = (args,)
        index = device.index
        stream = _raw_stream(index)
        g0, g1, g2 = self.grid
        if index == torch._C._cuda_getDevice():
            k.run(g0, g1, g2, stream, k.function, k.packed_metadata, None, None, None, *args)
            return
        with torch.cuda.device(index):
            k.run(g0, g1, g2, stream, k.function, k.packed_metadata, None, None, None, *args)


#: Compiled kernels by (`KernelLaunch._specialization()`, device index), shared by every launch.
_COMPILED: dict = {}


@functools.lru_cache(maxsize=None)
def _layout(kernel, tensors: tuple, fixed: tuple, scalars: tuple):
    """(names of the non-tensor arguments in kernel order, picker of the positional arguments from
    (*pointers, *those values), whether the picker yields a single item) for one argument split."""
    names = list(getattr(kernel, "arg_names", ()))
    given = list(tensors) + list(fixed) + list(scalars)
    known = set(names)
    missing = [n for n in names if n not in set(given)]
    extra = [n for n in given if names and n not in known]
    if missing or extra or len(set(given)) != len(given):
        raise TypeError(f"{getattr(kernel, '__name__', kernel)}: arguments missing {missing}, unknown {extra} "
                        f"(each named once among tensors, fixed and scalars).")
    slot = {n: i for i, n in enumerate(tensors)}
    others = [n for n in names if n not in slot]
    other_slot = {n: len(tensors) + i for i, n in enumerate(others)}
    picks = [slot[n] if n in slot else other_slot[n] for n in names]
    return others, operator.itemgetter(*picks), len(picks) == 1


def _int_class(value) -> tuple:
    """What Triton specialises a runtime integer on: equality to 1, divisibility by 16, its width."""
    if not isinstance(value, int) or isinstance(value, bool):
        return (type(value).__name__, value)
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63


@functools.lru_cache(maxsize=None)
def _slots(kernel, tensors: tuple, fixed: tuple, scalars: tuple) -> dict:
    """Index of each scalar argument in a launch's `_values` (the non-tensor arguments in kernel order)."""
    others = _layout(kernel, tensors, fixed, scalars)[0]
    return {n: i for i, n in enumerate(others) if n in scalars}


@functools.lru_cache(maxsize=None)
def _constexpr_names(kernel) -> frozenset:
    if hasattr(kernel, "params"):  # a JITFunction
        return frozenset(p.name for p in kernel.params if p.is_constexpr)
    # Under the interpreter: the Python function's `tl.constexpr` annotations.
    import inspect

    import triton.language as tl

    fn = getattr(kernel, "fn", None)
    if fn is None:
        return frozenset()
    return frozenset(name for name, p in inspect.signature(fn).parameters.items()
                     if p.annotation is tl.constexpr or p.annotation == "tl.constexpr")


def _shapes_only(t: torch.Tensor) -> bool:
    """Whether a wrapped launch meets fake tensors with no graph being recorded (FakeTensorMode alone,
    answering an op's output shapes): there are no values to compute and no trace to record into.
    (The Triton interpreter would otherwise run the kernel on the fake tensors' missing memory.)"""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return isinstance(t, FakeTensor) and get_proxy_mode() is None


def _idle(hook) -> bool:
    """Whether a Triton launch hook does nothing: None, or a hook chain with no hooks in it."""
    return hook is None or getattr(hook, "calls", None) == []


def _no_launch_hooks() -> bool:
    runtime = knobs.runtime
    return _idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook)


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
