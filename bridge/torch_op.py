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
    devices, broadcasts) in a bounded LRU cache; `cache_info()` reports hits and misses.
  * Broadcast (stride-0) tensor dimensions are narrowed to size 1 before the op and re-broadcast
    inside JAX, so an expanded mask is never materialised; torch's autograd sums their gradients.

Positional arguments are tensors (or None); keyword arguments are static (hashable Python
constants: bool, int, float, str, None, tuples of those) and part of the cache key.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import torch

from .cache import LRUCache
from .devices import to_jax_device
from .dlpack import narrow_broadcast, to_jax, to_torch
from .dtypes import X64_DTYPES, to_jax_dtype, to_torch_dtype

_OPS: dict[str, "JaxOp"] = {}
_CACHE = LRUCache(maxsize=256)


def cache_info():
    """Hits, misses, size and capacity of the compiled-executable cache."""
    return _CACHE.info()


def clear_cache() -> None:
    _CACHE.clear()


def set_cache_size(maxsize: int) -> None:
    _CACHE.resize(maxsize)


@dataclasses.dataclass
class _Trace:
    """One traced forward: its executable and how its residuals map back into a vjp."""

    call: Callable[..., Any]  # compiled executable (or jitted function for shape-only use)
    out_info: list  # ShapeDtypeStructs of outputs followed by residuals
    n_out: int
    plan: list  # per vjp leaf: ("in", i) | ("out", j) | ("res", r) | ("const", value)
    treedef: Any
    diff: tuple  # indices (into the op's tensor inputs) that are differentiated
    out_type: Optional[type]  # tuple or list when the function returned a sequence, else None


class _NonFinite(ast.NodeTransformer):
    """repr() writes non-finite floats as the names inf and nan; read them back as floats."""

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in ("inf", "nan"):
            return ast.copy_location(ast.Constant(float(node.id)), node)
        return node


@functools.lru_cache(maxsize=1024)
def _parse(spec: str) -> tuple:
    return ast.literal_eval(_NonFinite().visit(ast.parse(spec, mode="eval")))


def _x64(dtypes: Sequence[torch.dtype]) -> bool:
    return any(d in X64_DTYPES for d in dtypes)


def _avals(shapes_dtypes, device: Optional[jax.Device]):
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(s, to_jax_dtype(d), sharding=sharding) for s, d in shapes_dtypes]


def _build_forward(op: "JaxOp", spec: str, avals: list) -> _Trace:
    n_args, present, fulls, static, with_vjp = _parse(spec)
    static = dict(static)
    info: dict[str, Any] = {}

    def forward(*inputs):
        diff = tuple(i for i, a in enumerate(inputs) if jnp.issubdtype(a.dtype, jnp.floating)) if with_vjp else ()

        def apply(*diff_values):
            values = list(inputs)
            for i, v in zip(diff, diff_values):
                values[i] = v
            args = [None] * n_args
            for pos, v, full in zip(present, values, fulls):
                args[pos] = v if full is None else jnp.broadcast_to(v, full)
            return op.fn(*args, **static)

        if with_vjp:
            out, vjp = jax.vjp(apply, *(inputs[i] for i in diff))
        else:  # inference: no residuals to compute or hand over
            out, vjp = apply(), None
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if len(outs) != op.num_outputs or not all(isinstance(o, jax.Array) for o in outs):
            raise TypeError(
                f"jax_op {op.name!r}: the function returned {type(out).__name__} with {len(outs)} value(s); "
                f"num_outputs={op.num_outputs} arrays were declared."
            )
        # An output that is an input would alias it in torch; give it its own buffer.
        outs = [jnp.copy(o) if any(o is i for i in inputs) else o for o in outs]
        leaves, treedef = jax.tree_util.tree_flatten(vjp)
        plan, residuals = [], []
        for leaf in leaves:
            if not isinstance(leaf, jax.Array):
                plan.append(("const", leaf))
            elif any(leaf is x for x in inputs):
                plan.append(("in", next(i for i, x in enumerate(inputs) if leaf is x)))
            elif any(leaf is x for x in outs):
                plan.append(("out", next(i for i, x in enumerate(outs) if leaf is x)))
            elif any(leaf is x for x in residuals):
                plan.append(("res", next(i for i, x in enumerate(residuals) if leaf is x)))
            else:
                plan.append(("res", len(residuals)))
                residuals.append(leaf)
        out_type = None if isinstance(out, jax.Array) else (list if isinstance(out, list) else tuple)
        info.update(plan=plan, treedef=treedef, diff=diff, n_out=len(outs), out_type=out_type)
        return outs + residuals

    traced = jax.jit(forward).trace(*avals)
    device_bound = avals and avals[0].sharding is not None
    call = traced.lower().compile() if device_bound else None
    return _Trace(
        call, list(traced.out_info), info["n_out"], info["plan"], info["treedef"], info["diff"], info["out_type"]
    )


def _forward_trace(op: "JaxOp", spec: str, shapes_dtypes: tuple, device: Optional[jax.Device]) -> _Trace:
    key = ("fwd", op.name, spec, shapes_dtypes, device)
    with jax.enable_x64(_x64([d for _, d in shapes_dtypes])):
        return _CACHE.get_or_build(key, lambda: _build_forward(op, spec, _avals(shapes_dtypes, device)))


def _signature(tensors: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tensors)


def _device(tensors: Sequence[torch.Tensor]) -> Optional[jax.Device]:
    return to_jax_device(tensors[0].device) if tensors and tensors[0].device.type in ("cpu", "cuda") else None


def _run(call: Callable, tensors: Sequence[torch.Tensor], x64: bool) -> list[torch.Tensor]:
    with jax.enable_x64(x64):
        arrays = to_jax(tensors)
        return to_torch(call(*arrays))


# --- the custom ops ------------------------------------------------------------------------------


@torch.library.custom_op("jaxattn::jax_call", mutates_args=())
def _jax_call(inputs: list[torch.Tensor], op: str, spec: str) -> list[torch.Tensor]:
    sig = _signature(inputs)
    trace = _forward_trace(_OPS[op], spec, sig, _device(inputs))
    return _run(trace.call, inputs, _x64([d for _, d in sig]))


@_jax_call.register_fake
def _jax_call_fake(inputs, op, spec):
    trace = _forward_trace(_OPS[op], spec, _signature(inputs), None)
    device = inputs[0].device
    return [torch.empty(o.shape, dtype=to_torch_dtype(o.dtype), device=device) for o in trace.out_info]


def _build_backward(trace: _Trace, grad_spec: str, n_in: int, avals: list) -> Callable:
    ct_present, needed = _parse(grad_spec)
    n_out, n_res = trace.n_out, len(trace.out_info) - trace.n_out

    def backward(*arrays):
        inputs, outs = arrays[:n_in], arrays[n_in : n_in + n_out]
        residuals, given = arrays[n_in + n_out : n_in + n_out + n_res], arrays[n_in + n_out + n_res :]
        sources = {"in": inputs, "out": outs, "res": residuals}
        leaves = [value if kind == "const" else sources[kind][value] for kind, value in trace.plan]
        vjp = jax.tree_util.tree_unflatten(trace.treedef, leaves)
        cts = [jnp.zeros(o.shape, o.dtype) for o in trace.out_info[:n_out]]
        for j, g in zip(ct_present, given):
            cts[j] = g
        grads = vjp(cts[0] if trace.out_type is None else trace.out_type(cts))
        return [grads[trace.diff.index(i)] for i in needed]

    return jax.jit(backward).trace(*avals).lower().compile()


@torch.library.custom_op("jaxattn::jax_call_backward", mutates_args=())
def _jax_call_backward(
    saved: list[torch.Tensor], cotangents: list[torch.Tensor], op: str, spec: str, grad_spec: str, n_in: int
) -> list[torch.Tensor]:
    inputs = saved[:n_in]
    sig_in = _signature(inputs)
    device = _device(inputs)
    trace = _forward_trace(_OPS[op], spec, sig_in, device)
    tensors = list(saved) + list(cotangents)
    sig = _signature(tensors)
    x64 = _x64([d for _, d in sig])
    key = ("bwd", op, spec, grad_spec, sig, device)
    with jax.enable_x64(x64):
        call = _CACHE.get_or_build(key, lambda: _build_backward(trace, grad_spec, n_in, _avals(sig, device)))
    return _run(call, tensors, x64)


@_jax_call_backward.register_fake
def _jax_call_backward_fake(saved, cotangents, op, spec, grad_spec, n_in):
    _, needed = _parse(grad_spec)
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
    computed = torch.ops.jaxattn.jax_call_backward(
        saved, [grads[j] for j in present], ctx.op, ctx.spec, grad_spec, ctx.n_in
    )
    out: list[Optional[torch.Tensor]] = [None] * ctx.n_in
    for i, g in zip(needed, computed):
        out[i] = g
    return out, None, None


_jax_call.register_autograd(_backward, setup_context=_setup_context)


# --- public API ------------------------------------------------------------------------------------


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
        if not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs={num_outputs!r}: expected an int >= 1.")
        self.fn, self.name, self.num_outputs = fn, name, num_outputs
        functools.update_wrapper(self, fn)
        _OPS[name] = self

    def __call__(self, *args: Optional[torch.Tensor], **static: Any):
        tensors, present, fulls = [], [], []
        for pos, arg in enumerate(args):
            if arg is None:
                continue
            if not isinstance(arg, torch.Tensor):
                raise TypeError(
                    f"{self.name}: positional argument {pos} is a {type(arg).__name__}; positional arguments "
                    "must be tensors or None (pass Python constants as keyword arguments)."
                )
            # An expanded leaf that requires grad needs per-element gradients: it is copied instead.
            narrowed, full = (arg, None) if arg.is_leaf and arg.requires_grad else narrow_broadcast(arg)
            tensors.append(narrowed)
            present.append(pos)
            fulls.append(full)
        if not tensors:
            raise ValueError(f"{self.name}: at least one positional argument must be a tensor.")
        device = tensors[0].device
        for pos, t in zip(present, tensors):
            if t.device != device:
                raise ValueError(
                    f"{self.name}: argument {pos} is on {t.device} but argument {present[0]} is on {device}; "
                    "move all tensors to one device."
                )
        with_vjp = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        spec = repr((len(args), tuple(present), tuple(fulls), tuple(sorted(static.items())), with_vjp))
        result = torch.ops.jaxattn.jax_call(tensors, self.name, spec)
        return result[0] if self.num_outputs == 1 else tuple(result[: self.num_outputs])


def jax_op(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None, num_outputs: int = 1):
    """Decorator form of `JaxOp`; `name` defaults to the function's qualified module path."""

    def wrap(f):
        return JaxOp(f, name=name or f"{f.__module__}.{f.__qualname__}", num_outputs=num_outputs)

    return wrap(fn) if fn is not None else wrap
