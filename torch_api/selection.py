"""Choosing JAX implementations for a block of code, like torch's `sdpa_kernel`.

    >>> from jaxattn.torch_api import sdpa_implementation, scaled_dot_product_attention
    >>> with sdpa_implementation("vanilla"):
    ...     out = scaled_dot_product_attention(q, k, v)          # runs `vanilla`
    >>> with sdpa_implementation(["sdpa", "vanilla"]):
    ...     out = scaled_dot_product_attention(q, k, v)          # first of these that can run

An explicit `implementation=` argument overrides the context. The previous choice is restored on
exit, also when the block raises. The choice is per thread: a block steers only the calls of the
thread that entered it (other threads keep their own, by default automatic, choice).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional, Sequence, Union

from ..jax_core import AttentionRegistry

Choice = Optional[Union[str, tuple[str, ...]]]


class _ThreadChoices(threading.local):
    """Each thread's stack of active choices (a thread starts with [None]: automatic).

    A module-level stack let one thread's block steer other threads' calls, and interleaved exits
    popped each other's entries. A `threading.local` (rather than a ContextVar) keeps
    torch.compile able to read the choice and guard on it.
    """

    def __init__(self) -> None:
        self.stack: list[Choice] = [None]


_current = _ThreadChoices()


def normalize_choice(implementation: Union[None, str, Sequence[str]], argument: str = "implementation") -> Choice:
    """Validates a name or a sequence of names; returns None, a name, or a tuple of names."""
    if implementation is None:
        return None
    if isinstance(implementation, str):
        implementation = AttentionRegistry.current_name(implementation)  # a deprecated name warns once, here
        AttentionRegistry.get(implementation)
        return implementation
    if isinstance(implementation, (list, tuple)) and implementation and all(isinstance(n, str) for n in implementation):
        names = tuple(AttentionRegistry.current_name(name) for name in implementation)
        for name in names:
            AttentionRegistry.get(name)
        return names
    raise TypeError(
        f"{argument}={implementation!r}: expected None, a registered name or a non-empty list of names; "
        f"registered: {AttentionRegistry.list_implementations()}."
    )


def current_implementation() -> Choice:
    """The choice made by the innermost active `sdpa_implementation` block (None: automatic)."""
    return _current.stack[-1]


@contextlib.contextmanager
def sdpa_implementation(implementations: Union[str, Sequence[str]]) -> Iterator[None]:
    """Within the block, `scaled_dot_product_attention` uses these implementations.

    Args:
        implementations: a registered name (forced), or a list of names tried in order.
    """
    choice = normalize_choice(implementations, "implementations")
    stack = _current.stack
    stack.append(choice)
    try:
        yield
    finally:
        stack.pop()
