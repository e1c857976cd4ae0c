"""`torch.func` transforms over a `jax_op`: `grad`, `vjp`, `jacrev` and `vmap` (forward mode, `jvp`
and `jacfwd`, stays refused by `forward_ad.py`).

Under a functorch transform a call goes through `FunctorchCall`, an autograd.Function in the
setup_context style that functorch requires (the eager `_EagerCall` and the custom op's autograd
formula are not). Its forward calls the op again one transform level lower, ending in the ordinary
eager path; its backward is `higher_order.differentiable_grads`, itself a `jax_op` call, so it
composes with further transforms (`hessian`, `vmap(grad(...))`). Its vmap rule calls a derived
`jax_op`, `<name>.vmap[<axes>]`, whose function is `jax.vmap` of the op's function over the batched
arguments' leading dim.

`underlying` and `is_batched` let callers that must read values (input checks) do so under a
transform: vmap refuses data-dependent control flow on a batched tensor, but the plain tensor
beneath the wrappers holds every sample's values and can be read.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import torch

from .call_spec import intern
from .higher_order import differentiable_grads
from .registry import OPS, Op


def underlying(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor beneath every functorch wrapper of `t` (vmap's batched tensors, grad's
    wrappers): the values of all of `t`'s samples, with the vmapped dims among its own (in no
    promised order). `t` itself when it is not wrapped."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        t = functorch.get_unwrapped(t)
    return t


def is_batched(t: torch.Tensor) -> bool:
    """Whether `t` has a vmapped dim at any level (a value read of it would be refused)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def functorch_call(op: Op, args: Sequence[Optional[torch.Tensor]], static: dict):
    """Runs `op(*args, **static)` while a functorch transform is active."""
    return FunctorchCall.apply(op, static, *args)


class FunctorchCall(torch.autograd.Function):
    """One `jax_op` call as functorch sees it (see the module docstring)."""

    @staticmethod
    def forward(op: Op, static: dict, *args: Optional[torch.Tensor]):
        return op(*args, **static)

    @staticmethod
    def setup_context(ctx, inputs, output):
        op, static, *args = inputs
        present = tuple(i for i, a in enumerate(args) if a is not None)
        outs = output if op.num_outputs > 1 else (output,)
        ctx.op, ctx.present = op, present
        # Inputs as given (no broadcast narrowed), gradients wanted: the vjp op's call structure.
        ctx.spec = intern(len(args), present, (None,) * len(present), tuple(sorted(static.items())), True)
        ctx.out_sig = tuple((tuple(o.shape), o.dtype) for o in outs)
        ctx.save_for_backward(*(args[i] for i in present))

    @staticmethod
    def backward(ctx, *grads: Optional[torch.Tensor]):
        tensors = ctx.saved_tensors
        n_args = ctx.spec.n_args
        result: list[Optional[torch.Tensor]] = [None] * (2 + n_args)
        needed = tuple(i for i, (pos, t) in enumerate(zip(ctx.present, tensors))
                       if ctx.needs_input_grad[2 + pos] and t.is_floating_point())
        if needed:
            computed = differentiable_grads(ctx.op, ctx.spec, tensors, grads, needed, ctx.out_sig)
            for i, g in zip(needed, computed):
                result[2 + ctx.present[i]] = g
        return tuple(result)

    @staticmethod
    def vmap(info, in_dims, op: Op, static: dict, *args: Optional[torch.Tensor]):
        dims = in_dims[2:]
        axes = tuple(None if d is None else 0 for d in dims)
        moved = [a if d is None else a.movedim(d, 0) for a, d in zip(args, dims)]
        out = batched_op(op, axes)(*moved, **static)
        return out, (0 if op.num_outputs == 1 else (0,) * op.num_outputs)


def batched_op(op: Op, axes: tuple) -> Op:
    """The `jax_op` that maps `op` over the leading dim of the arguments whose axis is 0 (made once,
    of `op`'s own class)."""
    name = f"{op.name}.vmap[{','.join('0' if a == 0 else '-' for a in axes)}]"
    found = OPS.get(name)
    if found is not None:
        return found
    fn = op.fn

    def batched(*arrays, **static):
        return jax.vmap(lambda *xs: fn(*xs, **static), in_axes=axes)(*arrays)

    return type(op)(batched, name=name, num_outputs=op.num_outputs)
