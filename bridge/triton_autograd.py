"""A differentiable torch op whose forward and backward launch Triton kernels.

    >>> op = TritonOp("mylib::scaled_relu", forward, backward, num_outputs=1, spec_type=MySpec)
    >>> y, = op(spec, x, w)       # torch tensors in and out; y.backward() runs `backward`

`forward(spec, *inputs) -> outputs` returns the op's outputs followed by residuals the backward
needs (tensors, not differentiable); `backward(spec, inputs, outputs, grads, needs) -> grads` gets
the saved inputs and outputs, the gradients of the first `num_outputs` outputs (None where unused)
and which inputs need a gradient, and returns one gradient per input that needs one, in order.
Both launch kernels through `KernelLaunch`. `spec` is a frozen dataclass of plain values (ints,
floats, bools, strings, None, tuples, nested such dataclasses): everything static about the call.

Two routes, the same kernels:
* Eager: a `torch.autograd.Function` calling `forward` / `backward` directly: the shortest host path.
* Under `torch.compile` (and functorch transforms, dispatch modes): two `torch.library.triton_op`s,
  `<name>` and `<name>_backward`, with the spec as a JSON string, whose bodies launch through
  `wrap_triton` (so Inductor sees the kernels and CUDA graphs capture them); fake tensors come from
  running the same bodies on fake inputs (the launches do nothing there). They are registered
  while the first compiled call traces, so an eager-only program never imports the compiler.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import threading
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch.autograd import forward_ad

from .compile_hints import assume_constant_result
from .forward_ad import refuse_forward_ad
from .triton_launch import wrapped_launches


def _json(value: Any) -> str:
    """JSON text of a spec, built in plain Python (Dynamo traces this; it cannot trace `json.dumps`).

    Plain values are tested first: Dynamo cannot trace `dataclasses.is_dataclass(None)`.
    """
    if value is None:
        return "null"
    if torch.compiler.is_compiling() and isinstance(value, (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        # torch.compile(dynamic=True) makes sizes and floats symbolic (and answers isinstance as for
        # the plain type while it traces); a spec field is a setting the kernels are planned for, so
        # the compiled graph is guarded on its value instead.
        from torch.fx.experimental.symbolic_shapes import guard_scalar

        value = guard_scalar(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
        return repr(value)
    if isinstance(value, str) and '"' not in value and "\\" not in value:
        return '"' + value + '"'
    if isinstance(value, tuple):
        return '{"__tuple__": [' + ", ".join(_json(v) for v in value) + "]}"
    if dataclasses.is_dataclass(value):
        fields = "".join(f', "{f.name}": {_json(getattr(value, f.name))}' for f in dataclasses.fields(value))
        return '{"__type__": "' + type(value).__name__ + '"' + fields + "}"
    raise TypeError(f"spec field value {value!r}: expected a plain value, a tuple or a dataclass.")


def cached_hash(spec: Any, *fields: Any) -> int:
    """`hash(fields)`, computed once per frozen spec object and kept on it: a spec is part of every
    launch-cache key, and hashing a config's fields on each call costs more than the rest of the key."""
    found = spec.__dict__.get("_hash")
    if found is None:
        found = hash(fields)
        object.__setattr__(spec, "_hash", found)
    return found


#: Tensor inputs a TritonOp may take (its spec says how many: `spec.num_inputs`).
MAX_INPUTS = 12


class SpecCodec:
    """Frozen dataclasses of plain values <-> JSON strings (a triton_op takes strings, not objects)."""

    def __init__(self, types: Sequence[type]):
        self.types = {t.__name__: t for t in types}
        self.decode = functools.lru_cache(maxsize=1024)(self._decode)

    def encode(self, spec: Any) -> str:
        return _json(spec)

    def _decode(self, text: str) -> Any:
        return self._build(json.loads(text))

    def _build(self, value: Any) -> Any:
        if isinstance(value, dict):
            if "__tuple__" in value:
                return tuple(self._build(v) for v in value["__tuple__"])
            fields = {k: self._build(v) for k, v in value.items() if k != "__type__"}
            return self.types[value["__type__"]](**fields)
        return value


class TritonOp:
    """See the module docstring.

    Args:
        name: "namespace::name" of the two torch.library ops.
        forward: (spec, *inputs) -> tuple of tensors (outputs, then residuals).
        backward: (spec, inputs, outputs, grads, needs) -> list of tensors (one per needed input).
        num_outputs: how many leading tensors of `forward`'s result are the op's outputs.
        spec_types: the dataclasses a spec may contain (for decoding JSON under torch.compile).
        second_order_hint: appended to the error a backward with `create_graph=True` raises (the
            kernels' gradients are not differentiable again): where a differentiable path is.
    """

    def __init__(self, name: str, forward: Callable, backward: Callable, num_outputs: int,
                 spec_types: Sequence[type], second_order_hint: str = ""):
        self.name, self.forward, self.backward, self.num_outputs = name, forward, backward, num_outputs
        self.second_order_hint = second_order_hint
        self.codec = SpecCodec(spec_types)
        self._ops = None
        # Registered on the first compiled call, not here: registering looks for the kernels in the
        # bodies' source, which imports torch._inductor and torch._dynamo (about a second).
        _BY_NAME[name] = self

    def __call__(self, spec: Any, *inputs: Optional[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            refuse_forward_ad(self.name, inputs)
        if torch.compiler.is_compiling() or recorded():
            _register_while_tracing(self.name)
            fwd, _ = self._library_ops()
            padded = tuple(inputs) + (None,) * (MAX_INPUTS - len(inputs))
            outs = fwd(*padded, self.codec.encode(spec))
            return tuple(outs[: self.num_outputs])
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _eager_apply(self, spec, *inputs)[: self.num_outputs]
        return tuple(self.forward(spec, *inputs)[: self.num_outputs])

    def second_order_message(self) -> str:
        return (f"{self.name}: second-order gradients (a backward with create_graph=True, as in gradient "
                f"penalties, hvp or gradgradcheck) are not implemented by these Triton kernels. "
                f"{self.second_order_hint}".rstrip())

    def _refuse_second_order(self) -> None:
        """Raises in a backward run with `create_graph=True` (grad mode on): the kernels' gradients
        would come back without a graph, and a second derivative through them would read zero."""
        if torch.is_grad_enabled():
            raise NotImplementedError(self.second_order_message())

    # -- torch.compile route ------------------------------------------------------------------------

    def _library_ops(self):
        if self._ops is None:
            self._ops = self._register()
        return self._ops

    def _register(self):
        from torch.library import triton_op

        codec, forward, backward, n_out = self.codec, self.forward, self.backward, self.num_outputs
        # Inputs are separate optional tensor arguments (autograd tracks each; a Tensor?[] list it does
        # not), MAX_INPUTS of them, the unused ones None.
        def fwd_body(t0: Optional[torch.Tensor], t1: Optional[torch.Tensor], t2: Optional[torch.Tensor],
                     t3: Optional[torch.Tensor], t4: Optional[torch.Tensor], t5: Optional[torch.Tensor],
                     t6: Optional[torch.Tensor], t7: Optional[torch.Tensor], t8: Optional[torch.Tensor],
                     t9: Optional[torch.Tensor], t10: Optional[torch.Tensor], t11: Optional[torch.Tensor],
                     spec: str) -> List[torch.Tensor]:
            with wrapped_launches():
                decoded = codec.decode(spec)
                return list(forward(decoded, *_trim((t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11), decoded)))

        def bwd_body(inputs: List[Optional[torch.Tensor]], outputs: List[torch.Tensor],
                     grads: List[Optional[torch.Tensor]], needs: List[bool], spec: str) -> List[torch.Tensor]:
            with wrapped_launches():
                decoded = codec.decode(spec)
                return list(backward(decoded, _trim(tuple(inputs), decoded), outputs, grads,
                                     list(_trim(tuple(needs), decoded))))

        fwd_op = triton_op(self.name, fwd_body, mutates_args=())
        bwd_op = triton_op(self.name + "_backward", bwd_body, mutates_args=())

        def setup_context(ctx, inputs, output):
            *ins, spec = inputs
            ctx.spec = spec
            ctx.needs = [t is not None and t.requires_grad for t in ins]
            ctx.none = [t is None for t in ins]
            ctx.save_for_backward(*[t for t in ins if t is not None], *output)

        def backward_formula(ctx, grads):
            self._refuse_second_order()
            saved = list(ctx.saved_tensors)
            present = len(ctx.none) - sum(ctx.none)
            it = iter(saved[:present])
            ins = [None if none else next(it) for none in ctx.none]
            got = iter(bwd_op(ins, saved[present:], list(grads[:n_out]), ctx.needs, ctx.spec))
            return (*[next(got) if need else None for need in ctx.needs], None)

        fwd_op.register_autograd(backward_formula, setup_context=setup_context)
        return fwd_op, bwd_op


#: Every TritonOp by name (for `_register_while_tracing`, whose argument must be a constant).
_BY_NAME: dict = {}


def recorded() -> bool:
    """Whether calls are recorded rather than run eagerly: a dispatch mode is active (FakeTensorMode,
    torch.export's tracer) or torch.jit.trace is tracing. Such calls go through the library ops,
    whose fake implementation answers shapes and which a trace can hold."""
    return bool(torch._C._len_torch_dispatch_stack()) or torch._C._get_tracing_state() is not None


_REGISTERING = threading.Lock()


@assume_constant_result
def _register_while_tracing(name: str) -> str:
    """Registers the library ops of the TritonOp `name` and returns the name.

    Dynamo refuses to trace a call of `triton_op` itself, but runs a function marked
    assume_constant_result for real while it traces: so the ops exist before the traced
    `_library_ops` reads them, and an eager-only program never pays for registering them.
    """
    with _REGISTERING:  # two threads compiling at once: one registers, the other finds the ops
        _BY_NAME[name]._library_ops()
    return name


def _trim(padded: tuple, spec: Any) -> tuple:
    """The op's own inputs from the MAX_INPUTS padded ones (`spec.num_inputs` of them)."""
    return padded[: spec.num_inputs]


class _EagerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op: TritonOp, spec, *inputs):
        outs = tuple(op.forward(spec, *inputs))
        ctx.op, ctx.spec, ctx.n_in = op, spec, len(inputs)
        ctx.save_for_backward(*inputs, *outs)
        ctx.mark_non_differentiable(*outs[op.num_outputs:])
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.op._refuse_second_order()
        saved = ctx.saved_tensors
        ins, outs = saved[: ctx.n_in], saved[ctx.n_in:]
        needs = list(ctx.needs_input_grad[2:])
        got = iter(ctx.op.backward(ctx.spec, ins, outs, list(grads[: ctx.op.num_outputs]), needs))
        return (None, None, *[next(got) if need else None for need in needs])


class PreparedTritonCall:
    """A differentiable call of one fixed signature on the eager path, with nothing resolved per call.

    Subclasses implement `forward(*inputs) -> (outputs, saved)` and `backward(saved, grads) ->
    one gradient per input` (launching kernels through `KernelLaunch`), and `op`, the `TritonOp`
    whose semantics they share (its second-order refusal). `apply(*inputs)` enters autograd's C
    `apply` directly: no spec, no launch-cache lookup, no per-input bookkeeping. Callers use it only
    where `TritonOp.__call__` would take its eager autograd route (grad needed, no torch.compile,
    functorch transform or forward-mode AD) and keep everything the backward needs in the subclass
    (prepared once per signature).
    """

    op: TritonOp

    def forward(self, *inputs: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        raise NotImplementedError

    def backward(self, saved: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...]) -> tuple:
        raise NotImplementedError

    def apply(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if _PREPARED_APPLY is None:
            return _PreparedTritonFunction.apply(self, *inputs)
        return _PREPARED_APPLY(self, *[_UNWRAP_IF_DEAD(t) for t in inputs])


class _PreparedTritonFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: PreparedTritonCall, *inputs):
        outs, saved = call.forward(*inputs)
        ctx.call = call
        ctx.save_for_backward(*saved)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        call.op._refuse_second_order()
        return (None, *call.backward(ctx.saved_tensors, grads))


def _eager_apply(op: TritonOp, spec: Any, *inputs: Optional[torch.Tensor]):
    """`_EagerFunction.apply(op, spec, *inputs)` without `Function.apply`'s Python layer, which binds
    arguments for a `setup_context` this Function does not define and walks the arguments as a
    pytree to unwrap dead functorch wrappers (done here per tensor). Callers are outside functorch
    transforms, where that layer would do nothing else; about 10 µs less per call."""
    if _BASE_APPLY is None:
        return _EagerFunction.apply(op, spec, *inputs)
    return _BASE_APPLY(op, spec, *[t if t is None else _UNWRAP_IF_DEAD(t) for t in inputs])


try:  # the C implementation under Function.apply, bound to each Function (None: use Function.apply)
    _BASE_APPLY = super(torch.autograd.Function, _EagerFunction).apply
    _PREPARED_APPLY = super(torch.autograd.Function, _PreparedTritonFunction).apply
    _UNWRAP_IF_DEAD = torch._C._functorch.unwrap_if_dead
except AttributeError:  # pragma: no cover - a torch without these internals
    _BASE_APPLY = _PREPARED_APPLY = _UNWRAP_IF_DEAD = None
