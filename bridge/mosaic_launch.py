"""Pallas Mosaic GPU kernels launched on torch tensors, on torch's current stream, with no XLA runtime.

    >>> kernel = MosaicKernel(my_jax_function)         # holds exactly one Mosaic GPU kernel call
    >>> out, = kernel(x, y, scale=0.5)                  # torch CUDA tensors in and out

`MosaicKernel` lowers the function once per static keyword settings and input shapes, as
`jax.experimental.pallas.mosaic_gpu.as_torch_kernel` does, and keeps the compiled kernel with what a
call needs precomputed: a call allocates the outputs, writes the buffers' pointers and launches on
torch's current stream (about 10 us of host time; `as_torch_kernel`'s own wrapper spends about
100 us per call and launches on the default stream). The kernel reads buffers by pointer: inputs are
made contiguous here. An input the function wraps in a mutable JAX ref (`jax.new_ref`) is updated in
place and comes back as an output.

Inside `shapes_only()` (the fake implementation of a `mosaic_op.MosaicOp`: fake tensors, no memory)
a call launches nothing and returns empty contiguous outputs of the shapes and dtypes `jax.eval_shape`
gives, as the launch allocates them.

`MosaicKernel.host_launch` describes a compiled kernel's launch for `triton_program`, whose C++
programs then call its compiled host program themselves (no Python on the call's path).

The launch goes through entry points of JAX's Mosaic GPU torch interop that are not public API
(`_find_mgpu_call_in_module`, `_compile_as_torch_gpu_kernel`); `mosaic_reasons` reports a JAX
without them, and the caller then runs other kernels.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
from typing import Any, Callable, Optional

import torch

from .triton_program import HostProgramLaunch

#: Compute capability the Mosaic GPU kernels are written for (wgmma, TMA, setmaxnreg: Hopper).
MOSAIC_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def _mosaic_import_error() -> str:
    """Why the Mosaic GPU torch launch entry points cannot be imported ("" when they can)."""
    try:
        from jax._src.pallas.mosaic_gpu import torch as mgpu_torch
        from jax.experimental.mosaic.gpu import core as mgpu_core

        mgpu_torch._find_mgpu_call_in_module  # noqa: B018
        mgpu_core._compile_as_torch_gpu_kernel  # noqa: B018
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available", with its reason
        return f"{type(exc).__name__}: {exc}"
    return ""


def mosaic_reasons(device: torch.device) -> list[str]:
    """Why a Mosaic GPU kernel cannot launch on `device` from here, now (empty when it can)."""
    if device.type != "cuda":
        return [f"Mosaic GPU kernels run on CUDA devices (device {device})"]
    reasons = []
    capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if tuple(capability) != MOSAIC_CAPABILITY:
        reasons.append(f"Mosaic GPU kernels are written for sm90 (Hopper); device {device} is sm"
                       f"{capability[0]}{capability[1]}")
    if torch.cuda.is_current_stream_capturing():
        reasons.append("a CUDA graph is being captured (a first launch loads its module, which capture forbids)")
    error = _mosaic_import_error()
    if error:
        reasons.append(f"JAX's Mosaic GPU torch launch entry points cannot be imported ({error})")
    return reasons


@functools.lru_cache(maxsize=None)  # asked on every launch decision; a device's capability is fixed
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


class _Compiled:
    """One lowered and compiled kernel for fixed input shapes, launched on torch tensors."""

    def __init__(self, fn: Callable[..., Any], tensors: tuple[torch.Tensor, ...]):
        import jax
        from jax._src.lib.mlir import passmanager
        from jax._src.pallas.mosaic_gpu import torch as mgpu_torch
        import jax.experimental.mosaic.gpu as mgpu
        from jax.experimental.mosaic.gpu import core as mgpu_core

        structs = [jax.ShapeDtypeStruct(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
        traced = jax.jit(fn).trace(*structs)
        module = traced.lower().compiler_ir()
        with module.context:  # jax.jit outlines its body: inline it, as as_torch_kernel does
            mgpu.dialect.register_inliner_extensions(module.context)
            passmanager.PassManager.parse("builtin.module(inline{default-pipeline=})").run(module.operation)
            call, self.prepare_args, self.prepare_outputs, self.get_outputs = mgpu_torch._find_mgpu_call_in_module(
                module)
        # Kept for the life of the process: a launcher is made once per kernel and shapes.
        launch, _unload = mgpu_core._compile_as_torch_gpu_kernel(
            call.attributes["mhlo.backend_config"]["module"].value_bytes)
        # The compiled host program, from the launcher as_torch_kernel would use (which always takes
        # the default stream): `__call__` passes torch's current stream instead. jax 0.11 calls it
        # as program(function, stream, buffers); jax 0.10 with MLIR's packed C convention.
        cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__)))
        program = cells["launch_c"]
        self.host_program: Optional[HostProgramLaunch] = None
        if "function" in cells:
            function = cells["function"]
            self._launch = lambda stream, buffers: program(function, stream, buffers)
            self.host_program = HostProgramLaunch(ctypes.cast(program, ctypes.c_void_p).value, int(function))
        else:
            context = cells["ctx_ptr_ptr"]

            def packed_launch(stream, buffers):
                packed = (ctypes.POINTER(ctypes.c_void_p) * 3)()
                packed[0] = context
                packed[1] = ctypes.pointer(stream)
                packed[2] = ctypes.cast(ctypes.pointer(ctypes.pointer(buffers)), ctypes.POINTER(ctypes.c_void_p))
                program(packed)
            self._launch = packed_launch
        self.single = not isinstance(traced.out_info, tuple)

    def __call__(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        device = tensors[0].device
        args = self.prepare_args(*tensors, device=device)
        outs = self.prepare_outputs(*args, device=device)
        buffers = (ctypes.c_void_p * (len(args) + len(outs)))(*[t.data_ptr() for t in (*args, *outs)])
        # The raw handle of torch's current stream: what `torch.cuda.current_stream(device)` wraps, without
        # building a Stream object on every launch.
        self._launch(ctypes.c_void_p(torch._C._cuda_getCurrentRawStream(device.index)), buffers)
        results = self.get_outputs(*outs)
        return results[0] if self.single else tuple(results)


    def host_launch(self, tensors: tuple[torch.Tensor, ...]) -> Optional["HostLaunch"]:
        """How `triton_program` launches this kernel (see `HostLaunch`), or None where the kernel's
        buffers are not the function's own arguments and results (scratch buffers, constants)."""
        if self.host_program is None:
            return None
        device = tensors[0].device
        args = self.prepare_args(*tensors, device=device)
        if len(args) != len(tensors) or any(a is not t for a, t in zip(args, tensors)):
            return None
        outs = self.prepare_outputs(*args, device=device)
        results = self.get_outputs(*outs)
        returned = [next((i for i, o in enumerate(outs) if o is r), None) for r in results]
        if None in returned:
            return None
        aliases = [next((i for i, t in enumerate(tensors) if o is t), None) for o in outs]
        return HostLaunch(self.host_program, tuple((alias, tuple(o.shape), o.dtype) for alias, o in zip(aliases, outs)),
                          tuple(returned))


@dataclasses.dataclass(frozen=True)
class HostLaunch:
    """A compiled Mosaic GPU kernel as `triton_program` launches it: `program` takes the pointers of
    the function's arguments, then one per kernel output; `outputs` are those outputs, each
    (index of the argument it updates in place, or None where it is a new buffer; shape; dtype), and
    `returned[i]` is the output the function returns i-th. A new buffer is any memory of its shape's
    size (contiguous order: the kernel reads it by pointer)."""

    program: HostProgramLaunch
    outputs: tuple
    returned: tuple


class _ShapesState(threading.local):
    def __init__(self) -> None:
        self.on = False


_shapes = _ShapesState()


class shapes_only:
    """Context: `MosaicKernel` calls inside answer output shapes and launch nothing."""

    def __enter__(self):
        self._before, _shapes.on = _shapes.on, True

    def __exit__(self, *exc):
        _shapes.on = self._before


class MosaicKernel:
    """A JAX function holding one Mosaic GPU kernel call, as a launcher on torch CUDA tensors.

    Args:
        fn: (*arrays, **static) -> arrays; `static` are hashable Python values compiled into the kernel.
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._compiled: dict = {}
        self._shapes: dict = {}  # eval_shape results, for `empty_outputs`
        self._lock = threading.Lock()

    def __call__(self, *tensors: torch.Tensor, **static: Any) -> Any:
        if _shapes.on:
            return self.empty_outputs(tensors, static)
        return self.launch(tuple(t.contiguous() for t in tensors), static)

    def empty_outputs(self, tensors: tuple[torch.Tensor, ...], static: dict) -> Any:
        """Uninitialised outputs as a launch allocates them (contiguous), from `jax.eval_shape`. A
        symbolic size is specialised: a kernel is compiled for fixed shapes anyway."""
        import jax

        from .dtypes import to_torch_dtype

        key = (tuple(static.items()), tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tensors))
        found = self._shapes.get(key)
        if found is None:
            structs = [jax.ShapeDtypeStruct(shape, str(dtype).removeprefix("torch.")) for shape, dtype in key[1]]
            found = self._shapes[key] = jax.eval_shape(functools.partial(self.fn, **static), *structs)
        device = tensors[0].device
        empty = [torch.empty(o.shape, dtype=to_torch_dtype(o.dtype), device=device)
                 for o in jax.tree.leaves(found)]
        return tuple(empty) if isinstance(found, (tuple, list)) else empty[0]

    def launch(self, tensors: tuple[torch.Tensor, ...], static: dict) -> Any:
        """Runs the kernel on contiguous CUDA tensors (compiling it for new shapes or settings)."""
        return self._compiled_for(tensors, static)(tensors)

    def host_launch(self, tensors: tuple[torch.Tensor, ...], static: dict) -> Optional[HostLaunch]:
        """The launch of the kernel compiled for these tensors' shapes and `static` settings (compiling
        it if needed) as `triton_program` runs it, or None where it cannot (see `HostLaunch`; the
        packed calling convention of JAX before 0.11). The tensors are only looked at."""
        return self._compiled_for(tensors, static).host_launch(tensors)

    def _compiled_for(self, tensors: tuple[torch.Tensor, ...], static: dict) -> _Compiled:
        key = (tuple(static.items()), tuple((t.shape, t.dtype) for t in tensors))
        compiled = self._compiled.get(key)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(key)
                if compiled is None:
                    compiled = self._compiled[key] = _Compiled(functools.partial(self.fn, **static), tensors)
        return compiled
