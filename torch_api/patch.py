"""Route `torch.nn.functional.scaled_dot_product_attention` to jaxattn, for code that calls torch's function.

    >>> import torch.nn.functional as F
    >>> from jaxattn.torch_api import patch_sdpa
    >>> with patch_sdpa():                      # within the block, F.scaled_dot_product_attention is jaxattn's
    ...     out = model(x)
    >>> with patch_sdpa(implementation="vanilla"):
    ...     out = model(x)

    >>> from jaxattn.torch_api import install_sdpa_patch, uninstall_sdpa_patch
    >>> install_sdpa_patch()                    # for the rest of the program (or until uninstall)
    >>> uninstall_sdpa_patch()                  # torch's function is back

The patch replaces the attribute `torch.nn.functional.scaled_dot_product_attention`. Code that
looked the function up before the patch (`from torch.nn.functional import
scaled_dot_product_attention` at import time) keeps torch's. Patches nest: the innermost
implementation choice applies, and torch's function is restored when the outermost ends. While
jaxattn itself runs, calls reaching the patched attribute go to torch's original function, so the
patch can never call itself.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, Iterator, Sequence, Union

import torch
import torch.nn.functional as F

from .sdpa import scaled_dot_product_attention
from .selection import Choice, normalize_choice

#: torch's own function, kept before any patch is installed.
TORCH_SDPA: Callable = F.scaled_dot_product_attention

_stack: list[Choice] = []  # one entry per active install, innermost last
_active = threading.local()  # depth of jaxattn calls made by the patch on this thread


@functools.wraps(TORCH_SDPA)
def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    """torch's signature; computed by `jaxattn.torch_api.scaled_dot_product_attention`."""
    if getattr(_active, "depth", 0) or not _stack:
        return TORCH_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                          scale=scale, enable_gqa=enable_gqa)
    _active.depth = getattr(_active, "depth", 0) + 1
    try:
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                            implementation=_stack[-1])
    finally:
        _active.depth -= 1


# `functools.wraps` copied torch's module and qualified name; pickle finds functions by those, and a
# module that stored the patched function must pickle (torch.save) as a reference to this one (which
# runs torch's function again wherever no patch is active).
_patched_sdpa.__module__, _patched_sdpa.__qualname__ = __name__, "_patched_sdpa"
_patched_sdpa.__doc__ = (
    "torch.nn.functional.scaled_dot_product_attention, routed to jaxattn by jaxattn.torch_api.patch_sdpa "
    "(torch's original: jaxattn.torch_api.patch.TORCH_SDPA)."
)


def is_sdpa_patched() -> bool:
    """Whether `torch.nn.functional.scaled_dot_product_attention` currently routes to jaxattn."""
    return F.scaled_dot_product_attention is _patched_sdpa


def install_sdpa_patch(implementation: Union[None, str, Sequence[str]] = None) -> None:
    """Routes `torch.nn.functional.scaled_dot_product_attention` to jaxattn until `uninstall_sdpa_patch`.

    Args:
        implementation: JAX implementation name(s) to run (see `scaled_dot_product_attention`);
            None: the `sdpa_implementation` context's choice, else automatic selection. Installing
            again while installed stacks the new choice; each install needs its own uninstall.

    Raises:
        RuntimeError: someone else replaced `F.scaled_dot_product_attention` (jaxattn will not
            overwrite a patch it did not make).
        ValueError / TypeError: unknown implementation.
    """
    choice = normalize_choice(implementation)
    current = F.scaled_dot_product_attention
    if current is not _patched_sdpa and current is not TORCH_SDPA:
        raise RuntimeError(
            f"torch.nn.functional.scaled_dot_product_attention is already replaced by {current!r}; jaxattn "
            "will not overwrite it. Restore torch's function first."
        )
    _stack.append(choice)
    F.scaled_dot_product_attention = _patched_sdpa


def uninstall_sdpa_patch() -> None:
    """Undoes the innermost `install_sdpa_patch`; after the last one torch's function is back.

    Raises:
        RuntimeError: no patch is installed, or `F.scaled_dot_product_attention` was replaced by
            someone else since (then it is left as it is).
    """
    if not _stack:
        raise RuntimeError("uninstall_sdpa_patch: no jaxattn patch of F.scaled_dot_product_attention is installed.")
    if F.scaled_dot_product_attention is not _patched_sdpa:
        raise RuntimeError(
            "uninstall_sdpa_patch: F.scaled_dot_product_attention was replaced by "
            f"{F.scaled_dot_product_attention!r} after jaxattn patched it; restore that change first."
        )
    _stack.pop()
    if not _stack:
        F.scaled_dot_product_attention = TORCH_SDPA


@contextlib.contextmanager
def patch_sdpa(implementation: Union[None, str, Sequence[str]] = None) -> Iterator[None]:
    """Within the block, `torch.nn.functional.scaled_dot_product_attention` is jaxattn's drop-in.

    Args:
        implementation: as for `install_sdpa_patch`.

    Torch's function is restored on exit, also when the block raises.
    """
    install_sdpa_patch(implementation)
    try:
        yield
    finally:
        uninstall_sdpa_patch()

