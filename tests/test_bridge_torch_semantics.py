"""A generic `jax_op`'s outputs against plain torch ops: 64-bit dtypes the function asks for, resizing
an output, and CPU subnormals (pinned where XLA differs from torch, so a change is noticed)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jaxattn.bridge import jax_op


class _CustomOpRoute(TorchDispatchMode):
    """Any active dispatch mode sends calls through the custom op instead of the eager path."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# --- 64-bit dtypes asked for by the function ----------------------------------------------------------


@jax_op(name="tests.test_bridge_torch_semantics.to_double")
def to_double(x, w):
    return (jnp.sin(x) * w).astype(jnp.float64)


@jax_op(name="tests.test_bridge_torch_semantics.positions", num_outputs=2)
def positions(x):
    return jnp.arange(x.shape[0], dtype=jnp.int64), jnp.cumsum(x.astype(jnp.float64))


@pytest.mark.parametrize("route", ["eager", "custom_op"])
def test_astype_float64_returns_float64_as_torch(route):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g, requires_grad=True)
    w = torch.randn(5, 3, generator=g, requires_grad=True)
    x_ref, w_ref = (t.detach().clone().requires_grad_() for t in (x, w))
    if route == "eager":
        out = to_double(x, w)
    else:
        with _CustomOpRoute():
            out = to_double(x, w)
    ref = (torch.sin(x_ref) * w_ref).double()
    assert out.dtype == ref.dtype == torch.float64
    # float64 arithmetic on float32 values: JAX's sin in float32 differs from torch's by an ulp
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-7)
    cot = torch.linspace(-1, 1, 15, dtype=torch.float64).reshape(5, 3)
    out.backward(cot)
    ref.backward(cot)
    assert x.grad.dtype == x_ref.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    assert not jax.config.jax_enable_x64  # x64 is on only around the trace and the call


def test_int64_and_float64_requests_inside_the_function():
    x = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32)
    idx, total = positions(x)
    assert idx.dtype == torch.int64 and total.dtype == torch.float64
    torch.testing.assert_close(idx, torch.arange(3, dtype=torch.int64))
    torch.testing.assert_close(total, torch.cumsum(x.double(), 0))


@jax_op(name="tests.test_bridge_torch_semantics.warns")
def warns(x):
    warnings.warn("a warning of the function itself", RuntimeWarning)
    return x * 2


def test_other_warnings_of_a_trace_still_reach_the_user():
    with pytest.warns(RuntimeWarning, match="a warning of the function itself"):
        out = warns(torch.ones(2))
    torch.testing.assert_close(out, torch.full((2,), 2.0))


# --- resize_ of an output -------------------------------------------------------------------------


@jax_op(name="tests.test_bridge_torch_semantics.double")
def double(x):
    return x * 2


def test_resize_within_the_storage_as_torch():
    x = torch.arange(6.0)
    out, ref = double(x), x * 2
    for shape in [(2, 2), (6,), (3, 2)]:
        out.resize_(shape)
        ref.resize_(shape)
        torch.testing.assert_close(out, ref)


def test_resize_beyond_the_storage_raises_and_clone_grows_as_torch():
    """Pinned limit (docs/RELIABILITY.md): an output's memory belongs to JAX, so its storage
    cannot grow; a clone's can."""
    x = torch.arange(6.0)
    out, ref = double(x), x * 2
    with pytest.raises(RuntimeError, match="not resizable"):
        out.resize_(7)
    grown = out.clone().resize_(8)
    ref.resize_(8)
    torch.testing.assert_close(grown[:6], ref[:6])


# --- CPU subnormals -------------------------------------------------------------------------------


@jax_op(name="tests.test_bridge_torch_semantics.halve")
def halve(x):
    return x * 0.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_subnormal_results_are_flushed_to_zero_unlike_torch(dtype):
    """Pinned difference (docs/RELIABILITY.md): XLA on CPU flushes subnormal results to zero;
    torch keeps them. If this fails, XLA changed: update the documentation."""
    tiny = torch.finfo(dtype).tiny  # the smallest normal number; half of it is subnormal
    x = torch.tensor([tiny, 1.0, -tiny], dtype=dtype)
    ref = x * 0.5
    assert ref[0] != 0 and ref[0] < tiny  # torch keeps the subnormal
    out = halve(x)
    torch.testing.assert_close(out[1], ref[1])
    assert out[0] == 0 and out[2] == 0
