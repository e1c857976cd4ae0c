"""The `jax_op` functions of this process by name, and what the rest of the bridge needs of one.

The custom ops carry a function by its name (a string in their schema); this table maps names
back to ops. It sits below everything that runs ops, so that none of them imports the `JaxOp`
class (which itself builds on them).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class Op(Protocol):
    """What the bridge reads of a `JaxOp`: its JAX function, unique name and number of outputs."""

    fn: Callable[..., Any]
    name: str
    num_outputs: int

    def __call__(self, *args: Any, **static: Any) -> Any: ...


OPS: dict[str, Op] = {}


def registered(name: str) -> Op:
    """The op registered under `name`, or the vjp op `<base>.vjp<n>` of a registered op, made now.

    Raises:
        KeyError: none is (in a process that replays a compiled graph, the module defining the op
            must be imported first).
    """
    found = OPS.get(name)
    if found is None:
        found = _derived(name)
    if found is None:
        raise KeyError(
            f"jax_op {name!r} is not registered in this process; import the module that defines it before "
            "calling it (a compiled graph replayed from torch.compile's caches refers to ops by name)."
        )
    return found


def _derived(name: str):
    """The vjp op named `name` (`<base>.vjp<n>`) of a registered op, or None. A process makes a vjp op
    when it first runs that backward; a compiled backward replayed from torch.compile's caches names
    it in a process that has not, so it is made here on demand (the same function, by construction)."""
    base, sep, count = name.rpartition(".vjp")
    if not sep or not base or not count.isdigit():
        return None
    parent = OPS.get(base) or _derived(base)
    if parent is None:
        return None
    from .higher_order import vjp_op  # higher_order builds on this module

    return vjp_op(parent, int(count))
