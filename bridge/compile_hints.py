"""`torch.compiler.assume_constant_result` without importing torch._dynamo at import time.

torch's decorator imports torch._dynamo (about a second) only to set one attribute on the
function, which Dynamo reads when it traces a call. Dynamo is imported by then anyway (by
torch.compile), so marking the function the same way keeps its behaviour and leaves the import
to the first compiled call. tests/test_import_cost.py checks that the mark is the one torch sets.
"""

from __future__ import annotations

import sys
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

#: The attribute torch._dynamo.assume_constant_result sets (the test compares it with torch's).
MARK = "_dynamo_marked_constant"


def assume_constant_result(fn: F) -> F:
    """Marks `fn` as constant while torch.compile traces, as torch.compiler.assume_constant_result."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # already paid for: let torch mark it
        return dynamo.assume_constant_result(fn)
    setattr(fn, MARK, True)
    return fn


__all__ = ["assume_constant_result"]
