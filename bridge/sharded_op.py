"""Make a JAX function over a 1-D device mesh a differentiable torch op on sharded tensors.

    >>> op = ShardedJaxOp(fn, backward=fn_backward, name="mylib.f", num_outputs=2, in_dims=(2, 1),
    ...                   out_dims=(2, 2))
    >>> y, aux = op(x, ids, mesh=((0, 1, 2, 3), "sp"), alpha=0.5)        # whole tensors
    >>> ys, auxs = op([x0, x1], [i0, i1], mesh=((0, 1), "sp"), alpha=0.5)  # this process's shards

Each positional argument is None or a floating-point or integer tensor, given in one of two forms
(the same for every argument of a call):
  * a whole tensor: it is split over the mesh for the call (replicated when its split dimension is
    not a multiple of the mesh size), and each output comes back whole on the first tensor's device;
  * a list of this process's shards, one per local device of the mesh in mesh order (several
    processes each pass their own): they are assembled zero-copy into one global array, and each
    output comes back as a list of shards on the same devices.
Argument i is split along dimension `in_dims[i]`, output j along `out_dims[j]`. An `in_dims` entry
None makes that argument replicated: every device gets all of it (in shard form, pass one copy per
local device), and it gets no gradient (the backward returns none for it).

`mesh` is static: (the JAX device ids of the mesh in order, the mesh axis name). The JAX functions
receive the `jax.sharding.Mesh` built from it as their `mesh` keyword argument, and the other
static keyword arguments (hashable constants, as for `jax_op`):
    fn(*arrays, mesh=..., **static) -> `num_outputs` global arrays
    backward(*arrays, *outputs, *output_cotangents, mesh=..., **static) -> one gradient per
        floating-point tensor argument that is not replicated, in order (missing output cotangents
        are zeros)

Both run jitted on global arrays (JAX's collectives move data between devices and processes).
Two custom ops carry every such function, by name, and the call, by its `CallSpec` key, with fake
implementations (shapes from `jax.eval_shape`) and an autograd formula, so torch.compile traces
through them. Second-order gradients are refused.
"""

from __future__ import annotations

import functools
import importlib
import pickle
from typing import Any, Callable, Optional, Sequence, Union

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .compile_hints import assume_constant_result
from .call_spec import CallSpec, check_static, intern, lookup
from .devices import to_jax_device
from .distributed import global_from_shards, torch_shards
from .dlpack import to_jax
from .dtypes import to_jax_dtype, to_torch_dtype

#: Jitted (forward, backward) pairs kept, per op and call spec (jax.jit caches executables by shape).
MAX_FUNCTIONS = 64

_OPS: dict[str, "ShardedJaxOp"] = {}

Tensors = Union[None, torch.Tensor, Sequence[torch.Tensor]]


def _registered(name: str, module: Optional[str] = None) -> "ShardedJaxOp":
    if name not in _OPS and module:
        importlib.import_module(module)
    if name not in _OPS:
        raise KeyError(f"sharded jax op {name!r} is not registered in this process; import the module that defines "
                       "it first (a compiled graph replayed from torch.compile's caches refers to ops by name).")
    return _OPS[name]


def _unpickle(name: str, module: Optional[str]) -> "ShardedJaxOp":
    try:
        return _registered(name, module)
    except KeyError as err:
        raise pickle.UnpicklingError(str(err)) from None


class ShardedJaxOp:
    """A JAX function over a device mesh, callable on whole or sharded torch tensors (module docstring).

    Args:
        fn: forward JAX function.
        backward: its gradient function (see the module docstring).
        name: unique name; identifies the function inside the custom ops.
        num_outputs: number of arrays `fn` returns (a tuple when > 1).
        in_dims: per positional argument, the dimension split over the mesh, or None: replicated
            (no gradient).
        out_dims: per output, the dimension split over the mesh.
        module: the module that creates the op, imported by a process unpickling it (default:
            `fn`'s module).
    """

    def __init__(self, fn: Callable[..., Any], *, backward: Callable[..., Any], name: str, num_outputs: int,
                 in_dims: Sequence[int], out_dims: Sequence[int], module: Optional[str] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: expected a non-empty str.")
        if name in _OPS and _OPS[name].fn is not fn:
            raise ValueError(f"name={name!r} is already registered to {_OPS[name].fn!r}; choose another name.")
        if len(out_dims) != num_outputs:
            raise ValueError(f"out_dims={out_dims!r}: expected one dimension per output ({num_outputs}).")
        self.fn, self.backward, self.name, self.num_outputs = fn, backward, name, num_outputs
        self.in_dims, self.out_dims = tuple(in_dims), tuple(out_dims)
        self.module = module if module is not None else getattr(fn, "__module__", None)
        _OPS[name] = self

    # One named function per process: copies are the op itself, pickles refer to it by name.
    def __copy__(self) -> "ShardedJaxOp":
        return self

    def __deepcopy__(self, memo: dict) -> "ShardedJaxOp":
        return self

    def __reduce__(self):
        return _unpickle, (self.name, self.module)

    def __call__(self, *args: Tensors, mesh: tuple, **static: Any):
        """The outputs, whole tensors or lists of shards as the arguments were (a tuple when
        `num_outputs` > 1)."""
        if len(args) != len(self.in_dims):
            raise TypeError(f"{self.name}: {len(args)} positional arguments, expected {len(self.in_dims)}.")
        present = tuple(i for i, a in enumerate(args) if a is not None)
        whole = [isinstance(args[i], torch.Tensor) for i in present]
        if not present or (any(whole) and not all(whole)):
            raise TypeError(f"{self.name}: expected tensors, or lists of shards, in every non-None argument.")
        groups = [[args[i]] if whole[0] else list(args[i]) for i in present]
        if any(len(g) != len(groups[0]) or not g or not all(isinstance(t, torch.Tensor) for t in g) for g in groups):
            raise TypeError(f"{self.name}: every argument needs the same number of shards (torch tensors).")
        static = dict(static, mesh=mesh)
        if not torch.compiler.is_compiling():  # torch.compile keeps the statics as constants of its graph
            check_static(self.name, static)
        key = _spec_key(len(args), present, tuple(sorted(static.items())))
        shards = 0 if whole[0] else len(groups[0])
        result = torch.ops.jaxattn.sharded_call([t for g in groups for t in g], self.name, key, shards)
        per = max(shards, 1)
        outs = [result[j * per:(j + 1) * per] for j in range(self.num_outputs)]
        outs = [o[0] if shards == 0 else list(o) for o in outs]
        return outs[0] if self.num_outputs == 1 else tuple(outs)


@assume_constant_result
def _spec_key(n_args: int, present: tuple, static: tuple) -> str:
    """The call's `CallSpec` key: torch.compile evaluates it once, while it traces, and keeps the string."""
    return intern(n_args, present, (), static, False).key


# --- JAX side --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=MAX_FUNCTIONS)
def _functions(name: str, spec: CallSpec) -> tuple[Mesh, Callable, Callable]:
    """(mesh, jitted forward, jitted backward) of one op and call spec."""
    op = _registered(name)
    static = dict(spec.kwargs)
    device_ids, axis = static.pop("mesh")
    by_id = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.array([by_id[i] for i in device_ids]), (axis,))
    forward = jax.jit(functools.partial(op.fn, mesh=mesh, **static))
    backward = jax.jit(functools.partial(op.backward, mesh=mesh, **static))
    return mesh, forward, backward


def _split(tensors: Sequence[torch.Tensor], shards: int, count: int) -> list[list[torch.Tensor]]:
    per = max(shards, 1)
    return [list(tensors[i * per:(i + 1) * per]) for i in range(count)]


def _partition(ndim: int, dim: int, axis: str) -> P:
    return P(*(axis if i == dim else None for i in range(ndim)))


def _import(groups, dims, shards: int, mesh: Mesh) -> list[jax.Array]:
    """Torch tensors (one whole tensor, or this process's shards, per group) -> global JAX arrays
    (dim None: replicated, from one whole tensor or one copy per local device)."""
    axis = mesh.axis_names[0]
    arrays = []
    for group, dim in zip(groups, dims):
        if dim is None:
            if shards == 0:
                (x,) = to_jax([group[0]])
                arrays.append(jax.device_put(x, NamedSharding(mesh, P())))
            else:
                arrays.append(global_from_shards(group, mesh, P(), None))
            continue
        spec = _partition(group[0].dim(), dim, axis)
        if shards == 0:
            (x,) = to_jax([group[0]])
            split = group[0].shape[dim] % mesh.shape[axis] == 0
            arrays.append(jax.device_put(x, NamedSharding(mesh, spec if split else P())))
        else:
            arrays.append(global_from_shards(group, mesh, spec, dim))
    return arrays


def _export(arrays, dims, shards: int, device: torch.device) -> list[torch.Tensor]:
    """Global JAX arrays -> each one whole on `device`, or this process's shards of each in order."""
    result = []
    for x, dim in zip(arrays, dims):
        if shards == 0:
            result.append(torch.from_dlpack(jax.device_put(x, to_jax_device(device))))
        else:
            result.extend(torch_shards(x, dim))
    return result


def _gets_grad(op: "ShardedJaxOp", spec: CallSpec, tensors: Sequence[torch.Tensor], shards: int) -> list[bool]:
    """Per input tensor of a call (flat, shards of one argument together): whether it gets a
    gradient (floating point and not replicated)."""
    per = max(shards, 1)
    return [t.dtype.is_floating_point and op.in_dims[pos] is not None
            for g, pos in enumerate(spec.present) for t in tensors[g * per:(g + 1) * per]]


def _arguments(spec: CallSpec, arrays: list) -> list:
    args: list = [None] * spec.n_args
    for pos, x in zip(spec.present, arrays):
        args[pos] = x
    return args


# --- torch custom ops ------------------------------------------------------------------------------


@torch.library.custom_op("jaxattn::sharded_call", mutates_args=())
def _sharded_call(tensors: list[torch.Tensor], op: str, spec: str, shards: int) -> list[torch.Tensor]:
    jop, call_spec = _registered(op), lookup(spec)
    mesh, forward, _ = _functions(op, call_spec)
    dims = [jop.in_dims[i] for i in call_spec.present]
    inputs = _import(_split(tensors, shards, len(dims)), dims, shards, mesh)
    outs = forward(*_arguments(call_spec, inputs))
    outs = (outs,) if jop.num_outputs == 1 else tuple(outs)
    return _export(outs, jop.out_dims, shards, tensors[0].device)


@_sharded_call.register_fake
def _sharded_call_fake(tensors, op, spec, shards):
    jop, call_spec = _registered(op), lookup(spec)
    mesh, forward, _ = _functions(op, call_spec)
    size = mesh.size
    groups = _split(tensors, shards, len(call_spec.present))
    structs = []
    for pos, group in zip(call_spec.present, groups):
        shape = list(group[0].shape)
        if shards and jop.in_dims[pos] is not None:
            shape[jop.in_dims[pos]] *= size
        structs.append(jax.ShapeDtypeStruct(tuple(shape), to_jax_dtype(group[0].dtype)))
    outs = jax.eval_shape(forward, *_arguments(call_spec, structs))
    outs = (outs,) if jop.num_outputs == 1 else tuple(outs)
    result = []
    for o, dim in zip(outs, jop.out_dims):
        shape = list(o.shape)
        if shards:
            shape[dim] //= size
        result += [torch.empty(shape, dtype=to_torch_dtype(o.dtype), device=t.device) for t in groups[0]]
    return result


@torch.library.custom_op("jaxattn::sharded_call_backward", mutates_args=())
def _sharded_call_backward(tensors: list[torch.Tensor], op: str, spec: str, shards: int) -> list[torch.Tensor]:
    """Inputs, outputs and output cotangents -> the gradients of the floating-point inputs."""
    jop, call_spec = _registered(op), lookup(spec)
    mesh, _, backward = _functions(op, call_spec)
    n_args, n_out = len(call_spec.present), jop.num_outputs
    groups = _split(tensors, shards, n_args + 2 * n_out)
    in_dims = [jop.in_dims[i] for i in call_spec.present]
    arrays = _import(groups, in_dims + list(jop.out_dims) * 2, shards, mesh)
    grads = backward(*_arguments(call_spec, arrays[:n_args]), *arrays[n_args:])
    grad_dims = [d for d, g in zip(in_dims, groups) if g[0].dtype.is_floating_point and d is not None]
    return _export(grads, grad_dims, shards, tensors[0].device)


@_sharded_call_backward.register_fake
def _sharded_call_backward_fake(tensors, op, spec, shards):
    call_spec = lookup(spec)
    inputs = tensors[:len(call_spec.present) * max(shards, 1)]
    return [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t, grad in zip(inputs, _gets_grad(_registered(op), call_spec, inputs, shards)) if grad]


def _setup_context(ctx, inputs, output):
    tensors, op, spec, shards = inputs
    ctx.op, ctx.spec, ctx.shards, ctx.n_in = op, spec, shards, len(tensors)
    grads = _gets_grad(_registered(op), lookup(spec), tensors, shards)
    ctx.differentiable = [i for i, grad in enumerate(grads) if grad]
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, *output)


def _backward(ctx, grads):
    if torch.is_grad_enabled():  # create_graph=True: these gradients would not be differentiable again
        raise NotImplementedError(
            f"{ctx.op}: second-order gradients (a backward with create_graph=True) are not implemented; its "
            "gradients cannot be differentiated again.")
    saved = list(ctx.saved_tensors)
    inputs, outputs = saved[:ctx.n_in], saved[ctx.n_in:]
    cotangents = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads, outputs)]
    computed = torch.ops.jaxattn.sharded_call_backward(inputs + outputs + cotangents, ctx.op, ctx.spec, ctx.shards)
    result: list[Optional[torch.Tensor]] = [None] * ctx.n_in
    for i, g in zip(ctx.differentiable, computed):
        result[i] = g
    return result, None, None, None


_sharded_call.register_autograd(_backward, setup_context=_setup_context)


__all__ = ["ShardedJaxOp"]
