"""Gradients of a `jax_op` that are themselves differentiable (double backward, Hessian products).

A backward run with `create_graph=True` (gradient penalties, `torch.autograd.functional.hvp`,
`gradgradcheck`) must return gradients that torch can differentiate again. The first-order
backward executable returns plain tensors, so under `create_graph` the gradients come instead from
a second `jax_op`, `<name>.vjp<n>` (n: how many gradients), whose function is the JAX vjp of the original: torch records it
like any differentiable op, and its own backward (the vjp of the vjp) is derived the same way, to
any order.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import torch

from .call_spec import CallSpec
from .registry import OPS, Op
from .traces import call_with


def _vjp_function(op):
    """The JAX function (inputs..., cotangents...) -> gradients of the needed inputs, for `op`."""

    def vjp(*arrays, n_args, present, fulls, static, needed, ct_present):
        inputs, given = arrays[: len(present)], arrays[len(present):]

        def apply(*diff_values):
            return call_with(op.fn, inputs, needed, diff_values, n_args, present, fulls, dict(static))

        out, pullback = jax.vjp(apply, *(inputs[i] for i in needed))
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        cts = [jnp.zeros(o.shape, o.dtype) for o in outs]
        for j, g in zip(ct_present, given):
            cts[j] = g.astype(outs[j].dtype)
        grads = pullback(cts[0] if isinstance(out, jax.Array) else type(out)(cts))
        return tuple(grads) if len(grads) > 1 else grads[0]

    return vjp


def vjp_op(op: Op, num_grads: int) -> Op:
    """The `jax_op` computing `num_grads` of `op`'s input gradients differentiably (made once, of
    `op`'s own class, so that this module needs no class of its own)."""
    name = f"{op.name}.vjp{num_grads}"
    found = OPS.get(name)
    return found if found is not None else type(op)(_vjp_function(op), name=name, num_outputs=num_grads)


def differentiable_grads(op: Op, spec: CallSpec, inputs: Sequence[torch.Tensor],
                         grads: Sequence[Optional[torch.Tensor]], needed: tuple,
                         out_sig: Sequence[tuple]) -> list[torch.Tensor]:
    """The gradients of `op`'s inputs at positions `needed` (of its tensor inputs, as the call's
    `spec` lists them) for output gradients `grads` (None: zero), as a differentiable torch call.

    Args:
        op: the JaxOp.
        spec: the call's structure and static arguments.
        inputs: the call's tensor inputs, as passed to its executable (broadcast dims narrowed).
        grads: one gradient or None per output.
        needed: which inputs need a gradient.
        out_sig: (shape, dtype) per output, to shape the given gradients.
    """
    ct_present = tuple(j for j, g in enumerate(grads) if g is not None)
    cotangents = []
    for j in ct_present:
        shape, dtype = out_sig[j]
        g = grads[j]
        cotangents.append(g if tuple(g.shape) == tuple(shape) and g.dtype == dtype else g.to(dtype).expand(shape))
    result = vjp_op(op, len(needed))(*inputs, *cotangents, n_args=spec.n_args, present=spec.present,
                                     fulls=spec.fulls, static=spec.static, needed=tuple(needed), ct_present=ct_present)
    return list(result) if isinstance(result, tuple) else [result]
