"""Make a JAX function a differentiable torch op.

    >>> import jax.numpy as jnp
    >>> from jaxattn.bridge import jax_op
    >>> @jax_op(name="scaled_tanh")
    ... def scaled_tanh(x, w, *, alpha):
    ...     return jnp.tanh(alpha * x) * w
    >>> y = scaled_tanh(torch_x, torch_w, alpha=0.5)   # a torch tensor; y.backward() works

How it works:
  * Two torch custom ops, `jaxattn::jax_call` and `jaxattn::jax_call_backward` (`custom_ops`),
    carry every registered function (named by a string argument) and call (a `CallSpec` key),
    with fake implementations (shapes from `jax.eval_shape`-style tracing) and an autograd
    formula, so `torch.compile(fullgraph=True)` traces straight through them.
  * The forward runs `jax.vjp` inside one jitted executable and returns the outputs plus the vjp
    residuals; the residuals go to torch and are kept with `ctx.save_for_backward` (so an in-place
    change of an input after the forward is caught by torch's version counter). Residuals that are
    just inputs or outputs are not returned twice.
  * Executables are cached by signature (the function, its `CallSpec`: static arguments and
    broadcasts, input shapes, dtypes, devices) in a bounded LRU cache; `cache_info()` reports
    hits, misses, size and compile time.
  * Under `torch.func` transforms (grad, vjp, jacrev, vmap) a call goes through `functorch`.
  * Eager calls take a fast path (`prepared_call`): per signature everything is resolved once, and the
    call runs the executable directly, without the custom op's dispatch (the custom op stays for
    torch.compile, dispatch modes and functorch transforms).
  * Broadcast (stride-0) tensor dimensions are narrowed to size 1 before the op and re-broadcast
    inside JAX, so an expanded mask is never materialised; torch's autograd sums their gradients.

Positional arguments are tensors (or None); keyword arguments are static (hashable Python
constants: bool, int, float, str, None, tuples of those) and part of the cache key.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import warnings
from typing import Any, Callable, Optional

import torch
from torch.autograd import forward_ad

from .prepared_call import PreparedCall, NotPlain, arg_key, prepare_arguments, spec_key, static_key
from .call_spec import check_static
from .fork_guard import check_not_forked
from .forward_ad import refuse_forward_ad
from .functorch import functorch_call
from .registry import OPS as _OPS
from .traces import CACHE

#: Prepared calls kept per op before the memo is emptied (they hold no executables, only keys).
MAX_PREPARED = 4096


def cache_info():
    """Hits, misses, size, capacity and compile time of the compiled-executable cache."""
    return CACHE.info()


def clear_cache() -> None:
    """Drops every compiled executable and resets the counters."""
    CACHE.clear()
    for op in _OPS.values():
        op._prepared.clear()


def set_cache_size(maxsize: int) -> None:
    """Sets how many executables the cache keeps (least recently used ones are dropped)."""
    CACHE.resize(maxsize)


# --- public API ------------------------------------------------------------------------------------


def _registered_op(name: str, module: Optional[str]) -> "JaxOp":
    """The op registered under `name`, importing `module` (where it is defined) first if needed."""
    if name not in _OPS and module:
        importlib.import_module(module)
    if name not in _OPS:
        raise pickle.UnpicklingError(
            f"jax_op {name!r} is not registered in this process (defined in module {module!r}); import the module "
            "that defines it before unpickling.")
    return _OPS[name]


class JaxOp:
    """A JAX function callable on torch tensors, differentiable and traceable by torch.compile.

    Args:
        fn: JAX function. Positional parameters take arrays (or None); keyword-only parameters
            take static Python constants.
        name: unique name; identifies the function inside the custom op and the cache.
        num_outputs: number of arrays `fn` returns (1: a single array; >1: a tuple).
        module: the module that creates the op, which a process unpickling the op imports to
            register it (default: `fn`'s module; give it when the op is made in another module
            than the one defining `fn`).

    Calling it returns a torch tensor (or a tuple when `num_outputs > 1`) on the inputs' device.
    Gradients flow to floating-point tensor arguments that require grad.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str, num_outputs: int = 1, module: Optional[str] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name={name!r}: expected a non-empty str.")
        if name in _OPS and _OPS[name].fn is not fn:
            raise ValueError(f"name={name!r} is already registered to {_OPS[name].fn!r}; choose another name.")
        if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs={num_outputs!r}: expected an int >= 1.")
        self.fn, self.name, self.num_outputs = fn, name, num_outputs
        self.module = module if module is not None else getattr(fn, "__module__", None)
        self._prepared: dict[tuple, PreparedCall] = {}
        functools.update_wrapper(self, fn)
        _OPS[name] = self

    # An op is a named function, registered once per process: copies are the op itself, and pickles
    # refer to it by name (its executables, devices and prepared calls are caches of this process).
    def __copy__(self) -> "JaxOp":
        return self

    def __deepcopy__(self, memo: dict) -> "JaxOp":
        return self

    def __reduce__(self):
        return _registered_op, (self.name, self.module)

    def __call__(self, *args: Optional[torch.Tensor], **static: Any):
        check_not_forked(self.name)
        if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
            refuse_forward_ad(self.name, [a for a in args if isinstance(a, torch.Tensor)])
            if torch._C._are_functorch_transforms_active():  # torch.func.grad / vjp / vmap
                check_static(self.name, static)
                return functorch_call(self, args, static)
        if not torch.compiler.is_compiling():
            try:
                key = (tuple([arg_key(a) for a in args]), tuple([(k, static_key(v)) for k, v in static.items()]),
                       torch.is_grad_enabled())
                prepared = self._prepared.get(key)
            except (NotPlain, AttributeError, TypeError):  # not plain tensors, or unhashable statics
                key = prepared = None
            if prepared is None:  # a new signature: its static arguments were never checked
                check_static(self.name, static)
            if key is not None:
                if prepared is None:
                    prepared = self._remember(key, PreparedCall(self, args, static))
                return prepared(*args)
        tensors, _, spec_values = prepare_arguments(self, args, static)
        result = torch.ops.jaxattn.jax_call(tensors, self.name, spec_key(*spec_values))
        return result[0] if self.num_outputs == 1 else tuple(result[: self.num_outputs])

    def prepare(self, *args: Optional[torch.Tensor], **static: Any) -> PreparedCall:
        """Resolves a call's signature-only work once; the result runs calls with that signature.

        `prepare(*args)` must then be called with tensors of the same types, shapes, strides, dtypes,
        devices, requires_grad and leafness as these, under the same grad mode; callers that
        cache prepared calls key them by all of these.
        """
        check_static(self.name, static)
        return PreparedCall(self, args, static)

    def plan(self, *args: Optional[torch.Tensor], **static: Any) -> PreparedCall:
        """Deprecated name of `prepare`."""
        warnings.warn(f"{type(self).__name__}.plan is deprecated: use .prepare (same arguments, same result).",
                      DeprecationWarning, stacklevel=2)
        return self.prepare(*args, **static)

    def _remember(self, key: tuple, prepared: PreparedCall) -> PreparedCall:
        if len(self._prepared) >= MAX_PREPARED:
            self._prepared.clear()
        self._prepared[key] = prepared
        return prepared


def jax_op(fn: Optional[Callable[..., Any]] = None, *, name: Optional[str] = None, num_outputs: int = 1,
           module: Optional[str] = None):
    """Decorator form of `JaxOp`; `name` defaults to the function's qualified module path.

    `jax_op(fn, name=..., module=__name__)` makes an op of a function defined elsewhere (see `JaxOp`).
    """

    def wrap(f):
        return JaxOp(f, name=name or f"{f.__module__}.{f.__qualname__}", num_outputs=num_outputs, module=module)

    return wrap(fn) if fn is not None else wrap


__all__ = ["JaxOp", "cache_info", "clear_cache", "jax_op", "set_cache_size"]
