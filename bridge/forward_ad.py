"""Forward-mode AD (dual tensors, `torch.func.jvp`) is refused with a clear error.

jaxattn's ops define reverse-mode gradients only. Without this check a tangent would be dropped
on the way through a call, and `torch.func.jvp` or `forward_ad.unpack_dual(...).tangent` would
read zero or None: a silently wrong result.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch.autograd import forward_ad


def _jvp_transform_active() -> bool:
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType

    get_stack = getattr(torch._C._functorch, "get_interpreter_stack", None)
    stack = get_stack() if get_stack is not None else [torch._C._functorch.peek_interpreter_stack()]
    return any(i is not None and i.key() == TransformType.Jvp for i in stack or ())


def refuse_forward_ad(name: str, tensors: Iterable[Optional[torch.Tensor]]) -> None:
    """Raises NotImplementedError when a call of op `name` would need forward-mode AD."""
    dual = forward_ad._current_level >= 0 and any(
        t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)
    if dual or _jvp_transform_active():
        raise NotImplementedError(
            f"{name}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad dual tensors) is not "
            "implemented; a tangent would be dropped. Use reverse mode (torch.autograd.grad, torch.func.vjp, "
            "jacrev) instead.")
