"""Sequence-length bucketing: variable-length calls share a handful of compiled executables.

    >>> from jaxattn.torch_api import sequence_buckets, scaled_dot_product_attention
    >>> with sequence_buckets([128, 256, 512, 1024]):
    ...     out = scaled_dot_product_attention(q, k, v, is_causal=True)   # L=300 runs as L=512

Inside the block (or after `set_sequence_buckets(...)`), `scaled_dot_product_attention` pads the
query length L and the key/value length S up to the smallest bucket that holds them (beyond the
largest bucket: up to a multiple of it), masks the padded keys, runs, and slices the output back
to L rows. Results equal the unbucketed call's (padded keys get zero weight; padded query rows
are dropped and receive no gradient). Off by default: padding costs copies and compute.
With dropout_p > 0 the dropout draws differ from an unbucketed call's (they depend on the shape).

`set_sequence_buckets` sets the process-wide default; a `sequence_buckets` block applies to the
thread that entered it only.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterable, Iterator, Optional

Buckets = Optional[tuple[int, ...]]

_default: list[Buckets] = [None]  # process-wide, set by set_sequence_buckets


class _ThreadBlocks(threading.local):
    """Each thread's stack of active `sequence_buckets` blocks (empty: the process default)."""

    def __init__(self) -> None:
        self.stack: list[Buckets] = []


_blocks = _ThreadBlocks()


def _normalize(buckets: Optional[Iterable[int]], argument: str) -> Buckets:
    if buckets is None:
        return None
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"{argument}={buckets!r}: expected None or an iterable of positive ints, e.g. [128, 256, 512].")
    values = tuple(buckets)
    if not values or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in values):
        raise ValueError(
            f"{argument}={buckets!r}: expected a non-empty iterable of positive ints, e.g. [128, 256, 512]."
        )
    return tuple(sorted(set(values)))


def set_sequence_buckets(buckets: Optional[Iterable[int]]) -> None:
    """Sets the buckets used outside any `sequence_buckets` block; None turns bucketing off."""
    _default[0] = _normalize(buckets, "buckets")


def current_sequence_buckets() -> Buckets:
    """The active buckets (sorted), or None when bucketing is off."""
    stack = _blocks.stack
    return stack[-1] if stack else _default[0]


@contextlib.contextmanager
def sequence_buckets(buckets: Optional[Iterable[int]]) -> Iterator[None]:
    """Within the block, attention calls pad L and S up to `buckets` (None: no bucketing).

    Args:
        buckets: positive ints, e.g. [128, 256, 512, 1024]; lengths above the largest are
            padded to a multiple of it.
    """
    stack = _blocks.stack
    stack.append(_normalize(buckets, "buckets"))
    try:
        yield
    finally:
        stack.pop()


def bucket_length(n: int, buckets: tuple[int, ...]) -> int:
    """The padded length of a sequence of `n` under sorted `buckets`."""
    for b in buckets:
        if n <= b:
            return b
    top = buckets[-1]
    return math.ceil(n / top) * top
