"""Traced and compiled JAX executables of `jax_op` functions, in one bounded LRU cache.

A forward executable runs the function (under `jax.vjp` when gradients are wanted) and returns its
outputs followed by the vjp residuals; `Trace.vjp_leaves` says how to rebuild the vjp from inputs,
outputs and residuals, so the backward executable needs nothing else. Keys hold the function's
name, its `CallSpec`, the inputs' shapes and dtypes and the JAX device.

64-bit dtypes need JAX's x64 mode. It is on around calls with 64-bit inputs, and around every
call of a function that asks for a 64-bit dtype itself (`x.astype(jnp.float64)`, `dtype=jnp.int64`):
JAX would silently truncate that request to 32 bits (it only warns, at trace time), where torch
returns what was asked for. The warning is what shows the request: a trace that raises it is
traced again with x64 on, and the function keeps x64 from then on.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import torch

from .cache import LRUCache
from .call_spec import CallSpec
from .devices import to_jax_device
from .dtypes import X64_DTYPES, to_jax_dtype, to_torch_dtype
from .registry import Op

CACHE = LRUCache(maxsize=256)


@dataclasses.dataclass
class Trace:
    """One traced forward: its executable and how its residuals map back into a vjp."""

    call: Callable[..., Any]  # compiled executable (None for a shape-only trace)
    out_info: list  # ShapeDtypeStructs of outputs followed by residuals
    n_out: int
    vjp_leaves: list  # per vjp leaf: ("in", i) | ("out", j) | ("res", r) | ("const", value)
    treedef: Any
    diff: tuple  # indices (into the op's tensor inputs) that are differentiated
    out_type: Optional[type]  # tuple or list when the function returned a sequence, else None
    out_sig: tuple = ()  # ((shape, torch dtype), ...) of out_info, as `signature` writes them
    x64: bool = False  # whether it was traced, and must run, with JAX's x64 mode on


def needs_x64(dtypes: Sequence[torch.dtype]) -> bool:
    return any(d in X64_DTYPES for d in dtypes)


def signature(tensors: Sequence[torch.Tensor]) -> tuple:
    """((shape, dtype), ...) of tensors: the shape part of cache keys."""
    return tuple((tuple(int(n) for n in t.shape), t.dtype) for t in tensors)


def jax_device_of(tensors: Sequence[torch.Tensor]) -> Optional[jax.Device]:
    """The JAX device of the first tensor, or None for devices JAX does not hold (meta)."""
    return to_jax_device(tensors[0].device) if tensors and tensors[0].device.type in ("cpu", "cuda") else None


def _avals(shapes_dtypes, device: Optional[jax.Device]):
    sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
    return [jax.ShapeDtypeStruct(s, to_jax_dtype(d), sharding=sharding) for s, d in shapes_dtypes]


def call_with(fn, inputs, diff, diff_values, n_args, present, fulls, static: dict):
    """`fn` on a call's arguments: the tensor inputs (at positions `present` of `n_args`, the rest
    None), those at indices `diff` replaced by `diff_values`, narrowed ones broadcast to `fulls`."""
    values = list(inputs)
    for i, v in zip(diff, diff_values):
        values[i] = v
    args = [None] * n_args
    for pos, v, full in zip(present, values, fulls):
        args[pos] = v if full is None else jnp.broadcast_to(v, full)
    return fn(*args, **static)


def _build_forward(op: Op, spec: CallSpec, avals: list, x64: bool) -> Trace:
    n_args, present, fulls, static, with_vjp = spec.n_args, spec.present, spec.fulls, spec.kwargs, spec.with_vjp
    info: dict[str, Any] = {}

    def forward(*inputs):
        diff = tuple(i for i, a in enumerate(inputs) if jnp.issubdtype(a.dtype, jnp.floating)) if with_vjp else ()

        def apply(*diff_values):
            return call_with(op.fn, inputs, diff, diff_values, n_args, present, fulls, static)

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
        vjp_leaves, residuals = [], []
        for leaf in leaves:
            if not isinstance(leaf, jax.Array):
                vjp_leaves.append(("const", leaf))
            elif any(leaf is x for x in inputs):
                vjp_leaves.append(("in", next(i for i, x in enumerate(inputs) if leaf is x)))
            elif any(leaf is x for x in outs):
                vjp_leaves.append(("out", next(i for i, x in enumerate(outs) if leaf is x)))
            elif any(leaf is x for x in residuals):
                vjp_leaves.append(("res", next(i for i, x in enumerate(residuals) if leaf is x)))
            else:
                vjp_leaves.append(("res", len(residuals)))
                residuals.append(leaf)
        out_type = None if isinstance(out, jax.Array) else (list if isinstance(out, list) else tuple)
        info.update(vjp_leaves=vjp_leaves, treedef=treedef, diff=diff, n_out=len(outs), out_type=out_type)
        return outs + residuals

    x64 = x64 or op.name in _X64_OPS
    if x64:
        with jax.enable_x64(True):
            traced = jax.jit(forward).trace(*avals)
    else:
        traced, asked = _trace_noting_x64_requests(forward, avals)
        if asked:  # the function asked for a 64-bit dtype: trace it as it asked
            _X64_OPS.add(op.name)
            x64 = True
            with jax.enable_x64(True):
                traced = jax.jit(forward).trace(*avals)
    with jax.enable_x64(x64):
        call = traced.lower().compile() if avals and avals[0].sharding is not None else None
    out_info = list(traced.out_info)
    out_sig = tuple((tuple(o.shape), to_torch_dtype(o.dtype)) for o in out_info)
    return Trace(
        call, out_info, info["n_out"], info["vjp_leaves"], info["treedef"], info["diff"], info["out_type"], out_sig, x64
    )


#: Names of ops whose function asked for a 64-bit dtype: traced and run with x64 on from then on
#: (a nested `jax.jit` traced before would not warn again).
_X64_OPS: set[str] = set()
_TRUNCATION_WARNING = "Explicitly requested dtype"
# warnings.catch_warnings swaps process-wide state: one trace at a time looks at the warnings.
_WARNINGS_LOCK = threading.RLock()


def _trace_noting_x64_requests(fn: Callable, avals: list):
    """(`jax.jit(fn).trace(*avals)` with x64 off, whether `fn` asked for a 64-bit dtype that JAX
    truncated); the trace's other warnings are issued again as they came."""
    caught: list = []
    try:
        with _WARNINGS_LOCK, warnings.catch_warnings(record=True) as caught, jax.enable_x64(False):
            warnings.simplefilter("always")
            traced = jax.jit(fn).trace(*avals)
    finally:
        for w in caught:
            if not _is_truncation(w):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return traced, any(_is_truncation(w) for w in caught)


def _is_truncation(w: warnings.WarningMessage) -> bool:
    return issubclass(w.category, UserWarning) and str(w.message).startswith(_TRUNCATION_WARNING)


def forward_key(name: str, spec: CallSpec, shapes_dtypes: tuple, device: Optional[jax.Device]) -> tuple:
    return ("fwd", name, spec, shapes_dtypes, device)


def forward_trace(op: Op, spec: CallSpec, shapes_dtypes: tuple, device: Optional[jax.Device]) -> Trace:
    """The cached forward trace (compiled when `device` is given; shapes only when None)."""
    def build():
        x64 = needs_x64([d for _, d in shapes_dtypes])
        with jax.enable_x64(x64):
            avals = _avals(shapes_dtypes, device)
        return _build_forward(op, spec, avals, x64)

    return CACHE.get_or_build(forward_key(op.name, spec, shapes_dtypes, device), build)


def _build_backward(trace: Trace, grad_spec: tuple, n_in: int, avals: list) -> Callable:
    ct_present, needed = grad_spec
    n_out, n_res = trace.n_out, len(trace.out_info) - trace.n_out

    def backward(*arrays):
        inputs, outs = arrays[:n_in], arrays[n_in : n_in + n_out]
        residuals, given = arrays[n_in + n_out : n_in + n_out + n_res], arrays[n_in + n_out + n_res :]
        sources = {"in": inputs, "out": outs, "res": residuals}
        leaves = [value if kind == "const" else sources[kind][value] for kind, value in trace.vjp_leaves]
        vjp = jax.tree_util.tree_unflatten(trace.treedef, leaves)
        cts = [jnp.zeros(o.shape, o.dtype) for o in trace.out_info[:n_out]]
        for j, g in zip(ct_present, given):
            cts[j] = g
        grads = vjp(cts[0] if trace.out_type is None else trace.out_type(cts))
        return [grads[trace.diff.index(i)] for i in needed]

    return jax.jit(backward).trace(*avals).lower().compile()


def backward_call(
    name: str, spec: CallSpec, grad_spec: tuple, trace: Trace, n_in: int, sig: tuple, device: jax.Device
) -> Callable:
    """The cached backward executable for inputs + outputs + residuals + cotangents of `sig`.

    `grad_spec` is (indices of the outputs that have a cotangent, indices of the inputs whose
    gradient is wanted), both tuples of ints.
    """
    def build():
        with jax.enable_x64(trace.x64 or needs_x64([d for _, d in sig])):
            return _build_backward(trace, grad_spec, n_in, _avals(sig, device))

    return CACHE.get_or_build(("bwd", name, spec, grad_spec, sig, device), build)
