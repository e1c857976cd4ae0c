"""Output shapes of a `jax_op` call whose input shapes are symbolic (torch.compile(dynamic=True)).

Under dynamic shapes the custom op's fake implementation sees sizes that are `torch.SymInt`s, and
must answer with output sizes expressed in them: a size read as an int would be specialised to the
example's value, and every new length would compile a new graph. JAX cannot trace a function at
symbolic sizes in general (functions compare sizes and compute floats from them), so the
function is traced, shapes only, at two concrete points instead: every symbol at its example
value, then every symbol at twice that. Scaling all symbols alike keeps the relations torch
already guarded between them (equal dims, a head count that divides another). An output dim that
is the same at both points is a constant; one that follows an input dim (its value at both points)
is that dim's expression. Anything else (a sum, a padded length, two candidates) cannot be told
apart from two points and raises, naming the op, the output and the fix, instead of guessing.

The executables that run the real call stay keyed by concrete shapes (`traces.forward_trace`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .call_spec import CallSpec
from .compile_hints import assume_constant_result
from .registry import Op
from .traces import forward_trace


def has_symbolic_dims(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether any size of `tensors` is a `torch.SymInt` (torch.compile with dynamic shapes).

    Dynamo answers False for the sizes it traces (it treats them as ints): while it traces, ask
    `symbolic_sizes_traced` instead."""
    return any(isinstance(n, torch.SymInt) for t in tensors for n in t.shape)


@assume_constant_result
def symbolic_sizes_traced() -> bool:
    """Whether the graph torch.compile is tracing has symbolic sizes (dynamic=True, or a recompile
    that made a size dynamic). Run once per trace, outside the graph: the answer belongs to it."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    shape_env = None if context is None or context.fake_mode is None else context.fake_mode.shape_env
    if shape_env is None:
        return False
    return bool(getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val)


def _value(dim, scale: int) -> int:
    """`dim` (an int or a SymInt) with every free symbol at `scale` times its example value."""
    if not isinstance(dim, torch.SymInt):
        return int(dim)
    node = dim.node
    shape_env = node.shape_env
    expr = node.expr
    values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    missing = [s for s in expr.free_symbols if s not in values]
    if missing:
        raise NotImplementedError(
            f"jaxattn: the size {expr} has no example value (data-dependent symbols {missing}); a jax_op needs "
            "sizes torch.compile can hint. Make the size a plain (backed) dim, or compile with dynamic=False.")
    return int(expr.xreplace({s: values[s] * scale for s in expr.free_symbols}))


def symbolic_outputs(op: Op, spec: CallSpec, tensors: Sequence[torch.Tensor]) -> list[tuple[tuple, torch.dtype]]:
    """(shape, dtype) of each result of `op` called on `tensors` as `spec` says (its outputs, then
    the vjp residuals where the spec asks for them), shapes in the inputs' symbols (see the module
    docstring).

    Raises:
        NotImplementedError: an output size is neither constant nor one of the inputs' sizes.
    """
    inputs = [(tuple(t.shape), t.dtype) for t in tensors]
    points = []
    for scale in (1, 2):
        sig = tuple((tuple(_value(n, scale) for n in shape), dtype) for shape, dtype in inputs)
        try:
            points.append(forward_trace(op, spec, sig, None).out_sig)  # outputs, then any vjp residuals
        except Exception as error:  # the probe at twice the sizes may break a rule the function checks
            if scale == 1:
                raise
            raise NotImplementedError(
                f"jaxattn: jax_op {op.name!r} could not be traced with its symbolic sizes doubled "
                f"({type(error).__name__}: {error}), so its output sizes cannot be expressed in them. Mark the "
                "dims static (torch._dynamo.mark_static) or compile with dynamic=False.") from error
    candidates = [n for shape, _ in inputs for n in shape if isinstance(n, torch.SymInt)]
    outputs = []
    for index, ((shape1, dtype), (shape2, _)) in enumerate(zip(*points)):
        shape = []
        for axis, (v1, v2) in enumerate(zip(shape1, shape2)):
            if v1 == v2:
                shape.append(v1)
                continue
            matches = [n for n in candidates if _value(n, 1) == v1 and _value(n, 2) == v2]
            exprs = {str(n.node.expr) for n in matches}
            if len(exprs) != 1:
                found = "none of the inputs' sizes" if not exprs else f"several input sizes ({', '.join(sorted(exprs))})"
                raise NotImplementedError(
                    f"jaxattn: jax_op {op.name!r}, output {index} dim {axis}: its size ({v1}, then {v2} with the "
                    f"symbolic sizes doubled) matches {found}, so it cannot be expressed symbolically. Mark the "
                    "dims static (torch._dynamo.mark_static) or compile with dynamic=False.")
            shape.append(matches[0])
        outputs.append((tuple(shape), dtype))
    return outputs


__all__ = ["has_symbolic_dims", "symbolic_outputs"]
