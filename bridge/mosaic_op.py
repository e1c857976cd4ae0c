"""A differentiable torch custom op whose forward and backward launch Mosaic GPU kernels, for torch.compile.

    >>> op = MosaicOp("mylib::my_kernel", forward, backward, num_outputs=1, spec_types=[MySpec])
    >>> out, = op(spec, x, y)      # one opaque graph node under torch.compile; out.backward() runs `backward`

`forward(spec, *inputs) -> outputs` returns the op's outputs followed by residuals the backward needs
(tensors, not differentiable); `backward(spec, inputs, outputs, grads) -> grads` gets the saved
inputs and all outputs and the gradients of the first `num_outputs` (zeros where unused), and returns
one gradient per input. Both are torch code around `MosaicKernel` calls (and may launch
`KernelLaunch` Triton kernels too). `spec` is a frozen dataclass of plain values, passed to the ops as
JSON (`triton_autograd.SpecCodec`).

The ops are `<name>` and `<name>_backward` (`torch.library.custom_op`, functional: a kernel input
that JAX updates in place, such as an accumulator, must be allocated inside the body). Inductor
cannot see into a Mosaic kernel as it sees a Triton one, so the ops are opaque nodes whose real
implementation runs the bodies as they run eagerly. Their fake implementation runs the same bodies
with `MosaicKernel` inside `shapes_only()` (empty contiguous outputs, as the launch allocates them)
and Triton launches skipped on fake tensors, so shapes, dtypes and strides are the eager ones.

The ops carry the `cudagraph_unsafe` tag: a first launch of a kernel loads its module, which CUDA
graph capture forbids, so `torch.compile(mode="reduce-overhead")` leaves them out of its graphs.
Registering costs milliseconds and imports nothing: the ops are registered at construction.
"""

from __future__ import annotations

from typing import Any, Callable, List, Sequence

import torch
from torch.autograd import forward_ad

from .forward_ad import refuse_forward_ad
from .mosaic_launch import shapes_only
from .triton_autograd import SpecCodec
from .triton_launch import wrapped_launches


class MosaicOp:
    """See the module docstring.

    Args:
        name: "namespace::name" of the forward op; the backward op is "<name>_backward".
        forward: (spec, *inputs) -> tuple of tensors (outputs, then residuals).
        backward: (spec, inputs, outputs, grads) -> one gradient per input.
        num_outputs: how many leading tensors of `forward`'s result are the op's outputs.
        spec_types: the dataclasses a spec may contain (for decoding its JSON).
        second_order_hint: appended to the error a backward with `create_graph=True` raises (the
            kernels' gradients are not differentiable again): where a differentiable path is.
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, num_outputs: int,
                 spec_types: Sequence[type], second_order_hint: str = ""):
        self.name, self.num_outputs, self.second_order_hint = name, num_outputs, second_order_hint
        self.codec = codec = SpecCodec(spec_types)
        tags = (torch.Tag.cudagraph_unsafe,)

        @torch.library.custom_op(name, mutates_args=(), tags=tags)
        def fwd_op(inputs: List[torch.Tensor], spec: str) -> List[torch.Tensor]:
            return list(forward(codec.decode(spec), *inputs))

        @fwd_op.register_fake
        def _(inputs, spec):
            with shapes_only(), wrapped_launches():
                return list(forward(codec.decode(spec), *_specialised(inputs)))

        @torch.library.custom_op(name + "_backward", mutates_args=(), tags=tags)
        def bwd_op(inputs: List[torch.Tensor], outputs: List[torch.Tensor], grads: List[torch.Tensor],
                   spec: str) -> List[torch.Tensor]:
            return list(backward(codec.decode(spec), inputs, outputs, grads))

        @bwd_op.register_fake
        def _(inputs, outputs, grads, spec):
            with shapes_only(), wrapped_launches():
                return list(backward(codec.decode(spec), *(_specialised(x) for x in (inputs, outputs, grads))))

        def setup_context(ctx, inputs, output):
            tensors, spec = inputs
            ctx.spec, ctx.n_in = spec, len(tensors)
            ctx.mark_non_differentiable(*output[num_outputs:])
            ctx.save_for_backward(*tensors, *output)

        def backward_formula(ctx, grads):
            if torch.is_grad_enabled():
                raise NotImplementedError(self.second_order_message())
            saved = list(ctx.saved_tensors)
            return bwd_op(saved[: ctx.n_in], saved[ctx.n_in:], list(grads[:num_outputs]), ctx.spec), None

        fwd_op.register_autograd(backward_formula, setup_context=setup_context)
        self.forward_op, self.backward_op = fwd_op, bwd_op

    def __call__(self, spec: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            refuse_forward_ad(self.name, inputs)
        return tuple(self.forward_op(list(inputs), self.codec.encode(spec))[: self.num_outputs])

    def second_order_message(self) -> str:
        return (f"{self.name}: second-order gradients (a backward with create_graph=True) are not implemented "
                f"by these Mosaic GPU kernels. {self.second_order_hint}".rstrip())


def _specialised(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fake tensors with symbolic sizes or strides (torch.compile with dynamic shapes) as fake tensors of
    the same layout in plain ints, which guards the graph on them: a Mosaic kernel is compiled for
    fixed shapes, and the bodies compute tiles and paddings from the sizes in Python."""
    out = []
    for t in tensors:
        if any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride())):
            t = torch.empty_strided([int(n) for n in t.shape], [int(n) for n in t.stride()], dtype=t.dtype,
                                    device=t.device)
        out.append(t)
    return out
