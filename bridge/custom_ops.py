"""The torch custom ops every `jax_op` runs through when torch.compile, opcheck, a dispatch mode
or a functorch transform sees the call: `jaxattn::jax_call` and `jaxattn::jax_call_backward`.

They name the function by its registered name and the call by its `CallSpec` key (strings, as a
schema needs), have fake implementations (shapes from a JAX trace without a device) and an
autograd formula, so `torch.compile(fullgraph=True)` traces straight through them.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import jax
import torch

from . import dlpack
from .call_spec import lookup
from .dlpack import cuda_handshake, export_arrays, import_tensors
from .dtypes import to_torch_dtype
from .higher_order import differentiable_grads
from .registry import registered
from .symbolic import has_symbolic_dims, symbolic_outputs
from .traces import backward_call, forward_trace, jax_device_of, signature


def _run(call: Callable, tensors: Sequence[torch.Tensor], x64: bool) -> list[torch.Tensor]:
    """Imports `tensors` (one stream handshake), runs `call`, exports its results."""
    device = tensors[0].device
    jax_device = jax_device_of(tensors)
    with jax.enable_x64(True) if x64 else contextlib.nullcontext():
        tensors = [dlpack.importable(t) for t in tensors]
        jax_stream, torch_stream = cuda_handshake(device, jax_device) if device.type == "cuda" else (None, None)
        return export_arrays(call(*import_tensors(tensors, jax_device, jax_stream)), torch_stream)


@torch.library.custom_op("jaxattn::jax_call", mutates_args=())
def _jax_call(inputs: list[torch.Tensor], op: str, spec: str) -> list[torch.Tensor]:
    trace = forward_trace(registered(op), lookup(spec), signature(inputs), jax_device_of(inputs))
    return _run(trace.call, inputs, trace.x64)


@_jax_call.register_fake
def _jax_call_fake(inputs, op, spec):
    device = inputs[0].device
    call_spec = lookup(spec)
    # Sizes in the inputs' symbols: one graph for every length. A spec that re-broadcasts narrowed
    # inputs holds concrete sizes itself (recorded where sizes were static): those sizes are fixed.
    if has_symbolic_dims(inputs) and all(full is None for full in call_spec.fulls):
        return [torch.empty(shape, dtype=dtype, device=device)
                for shape, dtype in symbolic_outputs(registered(op), call_spec, inputs)]
    trace = forward_trace(registered(op), call_spec, signature(inputs), None)
    return [torch.empty(o.shape, dtype=to_torch_dtype(o.dtype), device=device) for o in trace.out_info]


@torch.library.custom_op("jaxattn::jax_call_backward", mutates_args=())
def _jax_call_backward(
    saved: list[torch.Tensor], cotangents: list[torch.Tensor], op: str, spec: str, ct_present: list[int],
    needed: list[int], n_in: int
) -> list[torch.Tensor]:
    inputs = saved[:n_in]
    device = jax_device_of(inputs)
    call_spec = lookup(spec)
    trace = forward_trace(registered(op), call_spec, signature(inputs), device)
    tensors = list(saved) + list(cotangents)
    call = backward_call(op, call_spec, (tuple(ct_present), tuple(needed)), trace, n_in, signature(tensors), device)
    return _run(call, tensors, trace.x64)


@_jax_call_backward.register_fake
def _jax_call_backward_fake(saved, cotangents, op, spec, ct_present, needed, n_in):
    return [torch.empty_like(saved[i], memory_format=torch.contiguous_format) for i in needed]


def _setup_context(ctx, inputs, output):
    tensors, op, spec = inputs
    jop = registered(op)
    ctx.op, ctx.spec, ctx.n_in = op, spec, len(tensors)
    ctx.needs = tuple(t.requires_grad and t.dtype.is_floating_point for t in tensors)
    ctx.n_out = jop.num_outputs
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(*output[jop.num_outputs :])
    ctx.save_for_backward(*tensors, *output)


def _backward(ctx, grads):
    needed = [i for i, need in enumerate(ctx.needs) if need]
    if not needed:
        return [None] * ctx.n_in, None, None
    present = [j for j in range(ctx.n_out) if grads[j] is not None]
    saved = list(ctx.saved_tensors)
    # create_graph=True needs gradients torch can differentiate again; a forward without residuals
    # (symbolic sizes, see `prepared_call.prepare_arguments`) needs the vjp recomputed from the inputs:
    # both run the vjp as a jax_op of its own.
    if torch.is_grad_enabled() or not lookup(ctx.spec).with_vjp:
        out_sig = [(tuple(o.shape), o.dtype) for o in saved[ctx.n_in: ctx.n_in + ctx.n_out]]
        computed = differentiable_grads(registered(ctx.op), lookup(ctx.spec), saved[: ctx.n_in], grads[: ctx.n_out],
                                        tuple(needed), out_sig)
    else:
        computed = torch.ops.jaxattn.jax_call_backward(
            saved, [grads[j] for j in present], ctx.op, ctx.spec, present, needed, ctx.n_in
        )
    out: list[Optional[torch.Tensor]] = [None] * ctx.n_in
    for i, g in zip(needed, computed):
        out[i] = g
    return out, None, None


_jax_call.register_autograd(_backward, setup_context=_setup_context)
