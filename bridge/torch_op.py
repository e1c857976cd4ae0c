"""Make a JAX function a differentiable torch op.

    >>> import jax.numpy as jnp
    >>> from jaxattn.bridge import jax_op
    >>> @jax_op(name="scaled_tanh")
    ... def scaled_tanh(x, w, *, alpha):
    ...     return jnp.tanh(alpha * x) * w
    >>> y = scaled_tanh(torch_x, torch_w, alpha=0.5)   # a torch tensor; y.backward() works

How it works:
  * Two torch custom ops, `jaxattn::jax_call` and `jaxattn::jax_call_backward`, carry every
    registered function (named by a string argument), with fake implementations (shapes from
    `jax.eval_shape`-style tracing) and an autograd formula, so `torch.compile(fullgraph=True)`
    traces straight through them.
  * The forward runs `jax.vjp` inside one jitted executable and returns the outputs plus the vjp
    residuals; the residuals go to torch and are kept with `ctx.save_for_backward` (so an in-place
    change of an input after the forward is caught by torch's version counter). Residuals that are
    just inputs or outputs are not returned twice.
  * Executables are cached by signature (the function, its static arguments, input shapes, dtypes,
    devices, broadcasts) in a bounded LRU cache; `cache_info()` reports hits, misses, size and
    compile time.
  * Eager calls take a fast path (`call_plan`): per signature everything is resolved once, and the
    call runs the executable directly, without the custom op's dispatch (the custom op stays for
    torch.compile, dispatch modes and functorch transforms).
  * Broadcast (stride-0) tensor dimensions are narrowed to size 1 before the op and re-broadcast
    inside JAX, so an expanded mask is never materialised; torch's autograd sums their gradients.

Positional arguments are tensors (or None); keyword arguments are static (hashable Python
constants: bool, int, float, str, None, tuples of those) and part of the cache key.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pickle
from typing import Any, Callable, Optional, Sequence

import jax
import torch
from torch.autograd import forward_ad

from .fork_guard import check_not_forked
from .call_plan import CallPlan, NotPlain, arg_key, prepare_arguments, static_key
from . import dlpack
from .dlpack import cuda_handshake, export_arrays, import_tensors
from .dtypes import to_torch_dtype
from .forward_ad import refuse_forward_ad
from .higher_order import differentiable_grads
from .traces import CACHE, backward_call, forward_trace, jax_device_of, needs_x64, parse, signature

_OPS: dict[str, "JaxOp"] = {}
#: Call plans kept per op before the memo is emptied (they hold no executables, only keys).
MAX_PLANS = 4096


def cache_info():
    """Hits, misses, size, capacity and compile time of the compiled-executable cache."""
    return CACHE.info()


def clear_cache() -> None:
    """Drops every compiled executable and resets the counters."""
    CACHE.clear()
    for op in _OPS.values():
        op._plans.clear()


def set_cache_size(maxsize: int) -> None:
    """Sets how many executables the cache keeps (least recently used ones are dropped)."""
    CACHE.resize(maxsize)


def _run(call: Callable, tensors: Sequence[torch.Tensor], x64: bool) -> list[torch.Tensor]:
    """Imports `tensors` (one stream handshake), runs `call`, exports its results."""
    device = tensors[0].device
    jax_device = jax_device_of(tensors)
    with jax.enable_x64(True) if x64 else contextlib.nullcontext():
        tensors = [dlpack.importable(t) for t in tensors]
        jax_stream, torch_stream = cuda_handshake(device, jax_device) if device.type == "cuda" else (None, None)
        return export_arrays(call(*import_tensors(tensors, jax_device, jax_stream)), torch_stream)


# --- the custom ops ------------------------------------------------------------------------------


@torch.library.custom_op("jaxattn::jax_call", mutates_args=())
def _jax_call(inputs: list[torch.Tensor], op: str, spec: str) -> list[torch.Tensor]:
    sig = signature(inputs)
    trace = forward_trace(_OPS[op], spec, sig, jax_device_of(inputs))
    return _run(trace.call, inputs, needs_x64([d for _, d in sig]))


@_jax_call.register_fake
def _jax_call_fake(inputs, op, spec):
    trace = forward_trace(_OPS[op], spec, signature(inputs), None)
    device = inputs[0].device
    return [torch.empty(o.shape, dtype=to_torch_dtype(o.dtype), device=device) for o in trace.out_info]


@torch.library.custom_op("jaxattn::jax_call_backward", mutates_args=())
def _jax_call_backward(
    saved: list[torch.Tensor], cotangents: list[torch.Tensor], op: str, spec: str, grad_spec: str, n_in: int
) -> list[torch.Tensor]:
    inputs = saved[:n_in]
    device = jax_device_of(inputs)
    trace = forward_trace(_OPS[op], spec, signature(inputs), device)
    tensors = list(saved) + list(cotangents)
    sig = signature(tensors)
    call = backward_call(op, spec, grad_spec, trace, n_in, sig, device)
    return _run(call, tensors, needs_x64([d for _, d in sig]))


@_jax_call_backward.register_fake
def _jax_call_backward_fake(saved, cotangents, op, spec, grad_spec, n_in):
    _, needed = parse(grad_spec)
    return [torch.empty_like(saved[i], memory_format=torch.contiguous_format) for i in needed]


def _setup_context(ctx, inputs, output):
    tensors, op, spec = inputs
    jop = _OPS[op]
    ctx.op, ctx.spec, ctx.n_in = op, spec, len(tensors)
    ctx.needs = tuple(t.requires_grad and t.dtype.is_floating_point for t in tensors)
    ctx.n_out = jop.num_outputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[jop.num_outputs :])
    ctx.save_for_backward(*tensors, *output)


def _backward(ctx, grads):
    needed = tuple(i for i, need in enumerate(ctx.needs) if need)
    if not needed:
        return [None] * ctx.n_in, None, None
    present = tuple(j for j in range(ctx.n_out) if grads[j] is not None)
    grad_spec = repr((present, needed))
    saved = list(ctx.saved_tensors)
    if torch.is_grad_enabled():  # create_graph=True: gradients torch can differentiate again
        out_sig = [(tuple(o.shape), o.dtype) for o in saved[ctx.n_in: ctx.n_in + ctx.n_out]]
        computed = differentiable_grads(_OPS[ctx.op], ctx.spec, saved[: ctx.n_in], grads[: ctx.n_out], needed,
                                        out_sig)
    else:
        computed = torch.ops.jaxattn.jax_call_backward(
            saved, [grads[j] for j in present], ctx.op, ctx.spec, grad_spec, ctx.n_in
        )
    out: list[Optional[torch.Tensor]] = [None] * ctx.n_in
    for i, g in zip(needed, computed):
        out[i] = g
    return out, None, None


_jax_call.register_autograd(_backward, setup_context=_setup_context)


# --- public API ------------------------------------------------------------------------------------


def _registered_op(name: str, module: Optional[str]) -> "JaxOp":
    """The op registered under `name`, importing `module` (where it is defined) first if needed."""
    if name not in _OPS and module:
        importlib.import_module(module)
    if name not in _OPS:
        raise pickle.UnpicklingError(
            f"jax_op {name!r} is not registered in this process (defined in module {module!r}); import the module "
            "that defines it before unpickling.")
    return _OPS[name]


class JaxOp:
    """A JAX function callable on torch tensors, differentiable and traceable by torch.compile.

    Args:
        fn: JAX function. Positional parameters take arrays (or None); keyword-only parameters
            take static Python constants.
        name: unique name; identifies the function inside the custom op and the cache.
        num_outputs: number of arrays `fn` returns (1: a single array; >1: a tuple).

    Calling it returns a torch tensor (or a tuple when `num_outputs > 1`) on the inputs' device.
    Gradients flow to floating-point tensor arguments that require grad.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str, num_outputs: int = 1):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: expected a non-empty str.")
        if name in _OPS and _OPS[name].fn is not fn:
            raise ValueError(f"name={name!r} is already registered to {_OPS[name].fn!r}; choose another name.")
        if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs={num_outputs!r}: expected an int >= 1.")
        self.fn, self.name, self.num_outputs = fn, name, num_outputs
        self._plans: dict[tuple, CallPlan] = {}
        functools.update_wrapper(self, fn)
        _OPS[name] = self

    # An op is a named function, registered once per process: copies are the op itself, and pickles
    # refer to it by name (its executables, devices and plans are caches of this process).
    def __copy__(self) -> "JaxOp":
        return self

    def __deepcopy__(self, memo: dict) -> "JaxOp":
        return self

    def __reduce__(self):
        return _registered_op, (self.name, getattr(self.fn, "__module__", None))

    def __call__(self, *args: Optional[torch.Tensor], **static: Any):
        check_not_forked(self.name)
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            refuse_forward_ad(self.name, [a for a in args if isinstance(a, torch.Tensor)])
        if not torch.compiler.is_compiling():
            try:
                key = (tuple([arg_key(a) for a in args]), tuple([(k, static_key(v)) for k, v in static.items()]),
                       torch.is_grad_enabled())
                plan = self._plans.get(key)
            except (NotPlain, AttributeError, TypeError):  # not plain tensors, or unhashable statics
                key = plan = None
            if plan is None:  # a new signature: its static arguments were never checked
                _check_static(self.name, static)
            if key is not None:
                if plan is None:
                    plan = self._remember(key, CallPlan(self, args, static))
                return plan(*args)
        tensors, _, _, spec, _ = prepare_arguments(self, args, static)
        result = torch.ops.jaxattn.jax_call(tensors, self.name, spec)
        return result[0] if self.num_outputs == 1 else tuple(result[: self.num_outputs])

    def plan(self, *args: Optional[torch.Tensor], **static: Any) -> CallPlan:
        """Resolves a call's signature-only work once; the result runs calls with that signature.

        `plan(*args)` must then be called with tensors of the same types, shapes, strides, dtypes,
        devices, requires_grad and leafness as these, under the same grad mode; callers that
        cache plans key them by all of these.
        """
        _check_static(self.name, static)
        return CallPlan(self, args, static)

    def _remember(self, key: tuple, plan: CallPlan) -> CallPlan:
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan
        return plan


_CONSTANT_TYPES = (bool, int, float, str, type(None))


def _is_constant(value) -> bool:
    """Whether a static argument survives the spec string (repr, then ast.literal_eval) unchanged."""
    return type(value) in _CONSTANT_TYPES or (type(value) is tuple and all(_is_constant(v) for v in value))


def _check_static(op_name: str, static: dict) -> None:
    for name, value in static.items():
        if not _is_constant(value):
            raise TypeError(
                f"{op_name}: keyword argument {name}={value!r} is a {type(value).__name__}; expected a static "
                "Python constant (bool, int, float, str, None or a tuple of those); pass tensors positionally."
            )


def jax_op(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None, num_outputs: int = 1):
    """Decorator form of `JaxOp`; `name` defaults to the function's qualified module path."""

    def wrap(f):
        return JaxOp(f, name=name or f"{f.__module__}.{f.__qualname__}", num_outputs=num_outputs)

    return wrap(fn) if fn is not None else wrap


__all__ = ["JaxOp", "cache_info", "clear_cache", "jax_op", "set_cache_size"]
