"""The per-call fast path of `jax_op`: everything that depends only on a call's signature, resolved once.

A `PreparedCall` belongs to one signature: per tensor argument its type, shape, strides, dtype, device,
requires_grad and leafness, the static keyword arguments, and torch's grad mode. It holds the
narrowing of broadcast dims, the call's `CallSpec` (a value: no string is built or read per call),
the executable's cache key and the JAX device,
so a call with that signature costs a dict lookup and then:

  * eager, on CPU or CUDA, with no torch.compile tracing, dispatch or function mode, or functorch
    transform active: the tensors are imported (one CUDA stream handshake), the compiled
    executable runs and its outputs are exported, with no torch custom-op dispatch; when inputs
    require grad this runs inside a `torch.autograd.Function` whose backward runs the cached
    backward executable on the forward's own JAX arrays (no re-import);
  * under a functorch transform (torch.func.grad, vjp, vmap): `functorch.FunctorchCall`;
  * otherwise: the `jaxattn::jax_call` custom op, as torch.compile and opcheck see it.

Both ways share the executables (same cache keys) and count hits and misses the same way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import jax
import torch
from torch.autograd import forward_ad

from . import custom_ops  # noqa: F401  (registers torch.ops.jaxattn.jax_call, which this module calls)
from .compile_hints import assume_constant_result
from .call_spec import intern
from .devices import to_jax_device
from . import dlpack
from .dlpack import cuda_handshake, export_arrays, import_tensors, narrow_broadcast
from . import fork_guard as _fork_guard
from .fork_guard import check_not_forked
from .forward_ad import refuse_forward_ad
from .functorch import functorch_call
from .higher_order import differentiable_grads
from .registry import Op
from .symbolic import has_symbolic_dims, symbolic_sizes_traced
from .traces import backward_call, forward_trace, signature

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class NotPlain(Exception):
    """An argument is not a plain tensor or None: the call takes the general path."""


def arg_key(a) -> Optional[tuple]:
    """The signature of one positional argument (raises NotPlain for anything but a plain tensor)."""
    if a is None:
        return None
    t = type(a)
    if t is not torch.Tensor and t is not torch.nn.Parameter:
        raise NotPlain
    return (t, a.shape, a.stride(), a.dtype, a.device, a.requires_grad, a.is_leaf)


def static_key(value) -> Any:
    """A key for a static argument that tells 1, 1.0 and True apart (they hash alike)."""
    if type(value) is tuple:
        return tuple(static_key(v) for v in value)
    return (type(value), value)


def _eager_possible() -> bool:
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._are_functorch_transforms_active()
        or torch._C._get_tracing_state() is not None  # torch.jit.trace records the custom op
    )


def _saved_tensor_hooks_active() -> bool:
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError):  # pragma: no cover - a torch without this query
        return True


def prepare_arguments(op: Op, args: Sequence[Optional[torch.Tensor]], static: dict):
    """Checks a call's arguments and narrows broadcast dims (the part torch.compile traces).

    Returns:
        (tensors for the custom op, per tensor the narrowed dims or None, the values of the call's
        `CallSpec`: number of arguments, positions of the tensors, per tensor the broadcast shape
        it was narrowed from or None, sorted static arguments, whether the forward computes a vjp:
        never with symbolic sizes, where the backward recomputes it).
    """
    tensors, present, fulls, narrow = [], [], [], []
    # Symbolic sizes (torch.compile(dynamic=True)): broadcast dims stay as they are (narrowing them
    # would guard every stride), and the forward computes no vjp residuals, whose sizes the fake
    # could not express; the backward recomputes them (`custom_ops._backward`).
    symbolic = has_symbolic_dims([a for a in args if isinstance(a, torch.Tensor)]) or (
        torch.compiler.is_compiling() and symbolic_sizes_traced())
    for pos, arg in enumerate(args):
        if arg is None:
            continue
        if not isinstance(arg, torch.Tensor):
            raise TypeError(
                f"{op.name}: positional argument {pos} is a {type(arg).__name__}; positional arguments "
                "must be tensors or None (pass Python constants as keyword arguments)."
            )
        # An expanded leaf that requires grad needs per-element gradients: it is copied instead.
        narrowed, full = (arg, None) if symbolic or arg.is_leaf and arg.requires_grad else narrow_broadcast(arg)
        tensors.append(narrowed)
        present.append(pos)
        fulls.append(full)
        narrow.append(None if full is None else tuple(i for i, (a, b) in enumerate(zip(narrowed.shape, full)) if a != b))
    if not tensors:
        raise ValueError(f"{op.name}: at least one positional argument must be a tensor.")
    device = tensors[0].device
    for pos, t in zip(present, tensors):
        if t.device != device:
            raise ValueError(
                f"{op.name}: argument {pos} is on {t.device} but argument {present[0]} is on {device}; "
                "move all tensors to one device."
            )
    with_vjp = not symbolic and torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    # Sorted by name (torch.compile sorts strings, not (name, value) pairs).
    if torch.compiler.is_compiling():
        ordered = tuple((name, _specialized(static[name])) for name in sorted(static))
    else:
        ordered = tuple((name, static[name]) for name in sorted(static))
    return tensors, narrow, (len(args), tuple(present), tuple(fulls), ordered, with_vjp)


def _specialized(value):
    """A static argument as a Python constant while torch.compile traces. With dynamic=True it makes
    ints and floats symbolic, a function's default values included; a static argument is part of
    the executable's key, so it is guarded on its value instead (a new value compiles again)."""
    if type(value) is tuple:
        return tuple(_specialized(v) for v in value)
    if isinstance(value, (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import guard_scalar

        return guard_scalar(value)
    return value


@assume_constant_result
def spec_key(n_args: int, present: tuple, fulls: tuple, static: tuple, with_vjp: bool) -> str:
    """The key of the `CallSpec` of these values, for the custom op: torch.compile runs this once,
    while it traces, and keeps the string in its graph."""
    return intern(n_args, present, fulls, static, with_vjp).key


class PreparedCall:
    """Runs calls of one `JaxOp` with one signature (see the module docstring).

    Args:
        op: the JaxOp.
        args: example positional arguments (tensors or None) of the signature.
        static: the static keyword arguments.

    Raises:
        TypeError / ValueError: as `JaxOp.__call__` for malformed arguments.
    """

    def __init__(self, op: Op, args: Sequence[Optional[torch.Tensor]], static: dict):
        check_not_forked(op.name)
        tensors, narrow, spec_values = prepare_arguments(op, args, static)
        device = tensors[0].device
        self.op_name = op.name
        self.n_out = op.num_outputs
        self.spec = intern(*spec_values)
        self.with_vjp = self.spec.with_vjp
        self.present = present = self.spec.present
        self.gather = len(present) != len(args)
        self.narrow = tuple(narrow) if any(d is not None for d in narrow) else None
        self.shapes_dtypes = signature(tensors)
        self.floating = tuple(t.dtype.is_floating_point for t in tensors)
        self.device = device
        self.cuda = device.type == "cuda"
        self.direct = device.type in ("cpu", "cuda") and all(type(a) in _PLAIN_TENSORS for a in args if a is not None)
        self.jax_device = to_jax_device(device) if device.type in ("cpu", "cuda") else None
        self._op = op

    # -- the hot path -------------------------------------------------------------------------------

    def __call__(self, *args: Optional[torch.Tensor]):
        """Runs a call whose arguments have this prepared's signature."""
        if _fork_guard._forked_after_runtime:
            check_not_forked(self.op_name)
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            refuse_forward_ad(self.op_name, [a for a in args if a is not None])
            if torch._C._are_functorch_transforms_active():  # torch.func.grad / vjp / vmap
                return functorch_call(self._op, args, self.spec.kwargs)
        tensors = [args[i] for i in self.present] if self.gather else list(args)
        if self.narrow is not None:
            tensors = [t if d is None else _narrow(t, d) for t, d in zip(tensors, self.narrow)]
        if self.direct and _eager_possible():
            if self.with_vjp:
                outs = _EagerCall.apply(self, *tensors)
            else:
                outs = self.run(tensors, keep=False)[0]
        else:
            outs = torch.ops.jaxattn.jax_call(tensors, self.op_name, self.spec.key)
        return outs[0] if self.n_out == 1 else tuple(outs[: self.n_out])

    def trace(self):
        return forward_trace(self._op, self.spec, self.shapes_dtypes, self.jax_device)

    def run(self, tensors: Sequence[torch.Tensor], keep: bool):
        """Imports `tensors`, runs the forward executable and exports its outputs.

        Returns:
            (outputs as torch tensors, JAX input arrays, all JAX results, torch stream pointer,
            the trace); residuals stay JAX arrays; with `keep=False`: (outputs,).
        """
        trace = self.trace()
        with jax.enable_x64(True) if trace.x64 else contextlib.nullcontext():
            tensors = [dlpack.importable(t) for t in tensors]
            if self.cuda:
                jax_stream, torch_stream = cuda_handshake(self.device, self.jax_device)
            else:
                jax_stream = torch_stream = None
            arrays = import_tensors(tensors, self.jax_device, jax_stream)
            results = trace.call(*arrays)
            outs = export_arrays(results[: trace.n_out], torch_stream)
        return (outs, arrays, results, torch_stream, trace) if keep else (outs,)


def _narrow(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    for i in dims:
        t = t.narrow(i, 0, 1)
    return t


class _EagerCall(torch.autograd.Function):
    """The differentiable eager call: forward and backward executables without custom-op dispatch."""

    @staticmethod
    def forward(ctx, prepared: PreparedCall, *tensors: torch.Tensor):
        outs, arrays, results, torch_stream, trace = prepared.run(tensors, keep=True)
        n_out = len(outs)
        ctx.prepared, ctx.trace = prepared, trace
        ctx.set_materialize_grads(False)
        if _saved_tensor_hooks_active():
            # Hooks (checkpointing, offloading) must see every saved tensor: hand the residuals
            # to torch and import them again in backward.
            residuals = export_arrays(results[n_out:], torch_stream)
            ctx.save_for_backward(*tensors, *outs, *residuals)
            ctx.arrays = None
        else:
            # Saved for the version-counter check; backward computes from the JAX arrays.
            ctx.save_for_backward(*tensors, *outs)
            ctx.arrays = list(arrays) + list(results)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        prepared: PreparedCall = ctx.prepared
        n_in = len(prepared.floating)
        needed = tuple(i for i in range(n_in) if ctx.needs_input_grad[i + 1] and prepared.floating[i])
        result: list[Optional[torch.Tensor]] = [None] * (n_in + 1)
        if not needed:
            return tuple(result)
        saved = ctx.saved_tensors  # raises if a saved tensor was modified in place
        trace = ctx.trace
        if torch.is_grad_enabled():  # create_graph=True: gradients torch can differentiate again
            computed = differentiable_grads(prepared._op, prepared.spec, saved[:n_in], grads, needed, trace.out_sig)
            for i, g in zip(needed, computed):
                result[i + 1] = g
            return tuple(result)
        present = tuple(j for j, g in enumerate(grads) if g is not None)
        cotangents = []
        for j in present:
            shape, dtype = trace.out_sig[j]
            g = grads[j]
            if tuple(g.shape) != shape or g.dtype != dtype:
                g = g.to(dtype).expand(shape)
            cotangents.append(dlpack.importable(g))
        sig = prepared.shapes_dtypes + trace.out_sig + tuple(trace.out_sig[j] for j in present)
        call = backward_call(prepared.op_name, prepared.spec, (present, needed), trace, n_in, sig, prepared.jax_device)
        with jax.enable_x64(True) if trace.x64 else contextlib.nullcontext():
            if prepared.cuda:
                jax_stream, torch_stream = cuda_handshake(prepared.device, prepared.jax_device)
            else:
                jax_stream = torch_stream = None
            if ctx.arrays is not None:
                base = ctx.arrays
            else:
                base = import_tensors([dlpack.importable(t) for t in saved], prepared.jax_device, jax_stream)
            cots = import_tensors(cotangents, prepared.jax_device, jax_stream)
            computed = export_arrays(call(*base, *cots), torch_stream)
        if not _keeps_graph():
            ctx.arrays = None  # as torch frees saved tensors after a backward that keeps no graph
        for i, g in zip(needed, computed):
            result[i + 1] = g
        return tuple(result)


def _keeps_graph() -> bool:
    try:
        return torch._C._autograd._get_current_graph_task_keep_graph()
    except (AttributeError, RuntimeError):  # pragma: no cover - a torch without this query
        return True
