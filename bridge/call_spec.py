"""The structure and static arguments of a `jax_op` call, as values under a stable string key.

A `CallSpec` holds what a call's executable depends on besides shapes and dtypes: how many
positional arguments there were, which held tensors, which tensors were narrowed from broadcast
shapes, the static keyword arguments and whether a vjp is wanted. The eager path keeps the object
itself. The custom ops (`jaxattn::jax_call`, as torch.compile and opcheck see them) need a
schema-typed argument, so they carry the spec's `key` and look the object up in a table.

The key is a canonical, type-exact encoding of the values (1, 1.0 and True differ; -0.0, inf and
nan survive), so the table is only a cache: a key it does not hold, as in a process that replays
a graph from torch.compile's on-disk caches, is decoded back into the same values. Keys from
another encoding (another jaxattn version) are refused with an error that says to clear those
caches.
"""

from __future__ import annotations

import threading
from typing import Any

#: Python types a static keyword argument may have (tuples of these too): exact types only, so that
#: a subclass with its own behaviour is not silently replaced by its base value.
CONSTANT_TYPES = (bool, int, float, str, type(None))

_VERSION = "jaxattn-call-1|"
#: Specs kept in the table; beyond it the table is emptied (a missing key is decoded again).
MAX_INTERNED = 8192


def is_constant(value) -> bool:
    """Whether `value` is a static argument the spec encodes exactly."""
    return type(value) in CONSTANT_TYPES or (type(value) is tuple and all(is_constant(v) for v in value))


def check_static(op_name: str, static: dict) -> None:
    """Raises TypeError naming the first static keyword argument that is not a constant."""
    for name, value in static.items():
        if not is_constant(value):
            raise TypeError(
                f"{op_name}: keyword argument {name}={value!r} is a {type(value).__name__}; expected a static "
                "Python constant (bool, int, float, str, None or a tuple of those); pass tensors positionally."
            )


class CallSpec:
    """One call structure (see the module docstring); equal and hashed by its key.

    Attributes:
        key: the stable string that names it (the custom ops' `spec` argument).
        n_args: how many positional arguments the call had.
        present: positions (of those) that held tensors.
        fulls: per tensor, the broadcast shape it was narrowed from, or None.
        static: the static keyword arguments, as sorted (name, value) pairs.
        with_vjp: whether the forward also computes the vjp residuals.
    """

    __slots__ = ("key", "n_args", "present", "fulls", "static", "with_vjp", "kwargs")

    def __init__(self, key: str, n_args: int, present: tuple, fulls: tuple, static: tuple, with_vjp: bool):
        self.key, self.n_args, self.present, self.fulls = key, n_args, present, fulls
        self.static, self.with_vjp = static, with_vjp
        self.kwargs = dict(static)  # read-only by convention: calls unpack it into a new dict

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is CallSpec and other.key == self.key)

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return (f"CallSpec(n_args={self.n_args}, present={self.present}, fulls={self.fulls}, "
                f"static={self.static}, with_vjp={self.with_vjp})")


_TABLE: dict[str, CallSpec] = {}
_LOCK = threading.Lock()


def intern(n_args: int, present: tuple, fulls: tuple, static: tuple, with_vjp: bool) -> CallSpec:
    """The spec of these values (all constants; `static` sorted (name, value) pairs), kept in the table.

    Runs once per call signature on the eager path; torch.compile evaluates it at trace time and
    keeps the key in the graph.
    """
    parts = [_VERSION]
    _encode((n_args, present, fulls, static, with_vjp), parts)
    key = "".join(parts)
    found = _TABLE.get(key)
    if found is not None:
        return found
    return _keep(CallSpec(key, n_args, present, fulls, static, with_vjp))


def lookup(key: str) -> CallSpec:
    """The spec named `key`: from the table, else decoded from the key itself.

    Raises:
        ValueError: `key` was not written by this encoding.
    """
    found = _TABLE.get(key)
    if found is not None:
        return found
    if not isinstance(key, str) or not key.startswith(_VERSION):
        raise ValueError(
            f"jaxattn: the call spec {key!r} was not written by this version of jaxattn (expected a key starting "
            f"with {_VERSION!r}); a graph from torch.compile's on-disk caches written by another version may have "
            "replayed it. Clear those caches (torch._inductor's cache directory, TORCHINDUCTOR_CACHE_DIR) and "
            "compile again.")
    try:
        value, end = _decode(key, len(_VERSION))
    except (ValueError, IndexError):
        value, end = None, -1
    if end != len(key) or type(value) is not tuple or tuple(map(type, value)) != (int, tuple, tuple, tuple, bool):
        raise ValueError(f"jaxattn: the call spec {key!r} is malformed; pass the key a jax_op call recorded.")
    return _keep(CallSpec(key, *value))


def _keep(spec: CallSpec) -> CallSpec:
    with _LOCK:
        if len(_TABLE) >= MAX_INTERNED:
            _TABLE.clear()
        return _TABLE.setdefault(spec.key, spec)


def forget_all() -> None:
    """Empties the table (as a fresh process has it); specs already held keep working."""
    with _LOCK:
        _TABLE.clear()


# --- the encoding: one tag character per value ------------------------------------------------------
# N: None, T / F: bools, i<decimal>; ints, f<float.hex()>; floats (exact, with inf and nan),
# s<length>:<text> strings, ( ... ) tuples.


def _encode(value: Any, out: list) -> None:
    t = type(value)
    if value is None:
        out.append("N")
    elif t is bool:
        out.append("T" if value else "F")
    elif t is int:
        out.append(f"i{value};")
    elif t is float:
        out.append(f"f{value.hex()};")
    elif t is str:
        out.append(f"s{len(value)}:")
        out.append(value)
    elif t is tuple:
        out.append("(")
        for v in value:
            _encode(v, out)
        out.append(")")
    else:
        raise TypeError(f"a call spec holds bool, int, float, str, None and tuples of those; got {t.__name__} "
                        f"{value!r}.")


def _decode(key: str, i: int) -> tuple[Any, int]:
    tag = key[i] if i < len(key) else ""
    if tag == "N":
        return None, i + 1
    if tag in ("T", "F"):
        return tag == "T", i + 1
    if tag in ("i", "f"):
        end = key.index(";", i)
        text = key[i + 1: end]
        return (int(text) if tag == "i" else float.fromhex(text)), end + 1
    if tag == "s":
        colon = key.index(":", i)
        start = colon + 1
        end = start + int(key[i + 1: colon])
        if end > len(key):
            raise ValueError("a string runs past the end")
        return key[start:end], end
    if tag == "(":
        items: list = []
        i += 1
        while i < len(key) and key[i] != ")":
            item, i = _decode(key, i)
            items.append(item)
        if i >= len(key):
            raise ValueError("a tuple is not closed")
        return tuple(items), i + 1
    raise ValueError(f"unexpected {tag!r} at {i}")


__all__ = ["CONSTANT_TYPES", "CallSpec", "check_static", "forget_all", "intern", "is_constant", "lookup"]
