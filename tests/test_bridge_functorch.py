"""`torch.func` reverse-mode transforms and `vmap` over a `jax_op` and the drop-in SDPA, against the
same transforms over torch's own functions (float64)."""

from __future__ import annotations

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.bridge import jax_op
from jaxattn.torch_api import scaled_dot_product_attention
from test_bridge import scaled_tanh, scaled_tanh_torch  # the bridge tests' op and its torch twin


@jax_op(name="tests.test_bridge_functorch.mix", num_outputs=2)
def mix(x, b, y):
    out = jnp.sin(x) * y
    return (out if b is None else out + b), jnp.exp(x).sum(-1)


def mix_torch(x, b, y):
    out = torch.sin(x) * y
    return (out if b is None else out + b), torch.exp(x).sum(-1)


def _data(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def _close(ours, theirs):
    for a, b in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)):
        torch.testing.assert_close(a, b)


def test_grad():
    x, w = _data((3, 4), (3, 4))
    ours = grad(lambda a, b: scaled_tanh(a, b, alpha=0.7).sum(), argnums=(0, 1))(x, w)
    theirs = grad(lambda a, b: scaled_tanh_torch(a, b, alpha=0.7).sum(), argnums=(0, 1))(x, w)
    _close(ours, theirs)


def test_vjp_two_outputs_with_a_none_argument():
    x, y, c0, c1 = _data((2, 5), (2, 5), (2, 5), (2,))
    out, pull = vjp(lambda a, b: mix(a, None, b), x, y)
    ref, pull_ref = vjp(lambda a, b: mix_torch(a, None, b), x, y)
    _close(out, ref)
    _close(pull((c0, c1)), pull_ref((c0, c1)))


def test_jacrev_of_jacrev():
    (x,), (w,) = _data((4,)), _data((4,), seed=1)
    second = lambda f: jacrev(jacrev(lambda a: f(a, w, alpha=1.3).sum()))(x)  # noqa: E731
    _close(second(scaled_tanh), second(scaled_tanh_torch))


@pytest.mark.parametrize("in_dims, shapes", [
    ((0, None), ((3, 4), (4,))), ((1, 0), ((4, 3), (3, 4))), ((None, 1), ((4,), (4, 3))),
])
def test_vmap(in_dims, shapes):
    x, w = _data(*shapes)
    ours = vmap(lambda a, b: scaled_tanh(a, b, alpha=0.4), in_dims=in_dims)(x, w)
    theirs = vmap(lambda a, b: scaled_tanh_torch(a, b, alpha=0.4), in_dims=in_dims)(x, w)
    assert ours.shape == theirs.shape
    _close(ours, theirs)


def test_vmap_two_outputs_nested():
    x, b, y = _data((2, 3, 4), (2, 3, 4), (4,))
    ours = vmap(vmap(mix, in_dims=(0, 0, None)), in_dims=(0, 0, None))(x, b, y)
    theirs = vmap(vmap(mix_torch, in_dims=(0, 0, None)), in_dims=(0, 0, None))(x, b, y)
    _close(ours, theirs)


def test_per_sample_gradients():
    x, w = _data((6, 4), (4,))
    per_sample = lambda f: vmap(grad(lambda a, b: f(a, b, alpha=0.9).sum(), argnums=1), in_dims=(0, None))  # noqa: E731
    _close(per_sample(scaled_tanh)(x, w), per_sample(scaled_tanh_torch)(x, w))


def test_grad_of_the_drop_in_sdpa():
    q, k, v = _data((2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6))

    def loss(sdpa):
        return lambda a, b, c: sdpa(a, b, c, is_causal=True).square().sum()

    with sdpa_kernel(SDPBackend.MATH):
        theirs = grad(loss(F.scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v)
    _close(grad(loss(scaled_dot_product_attention), argnums=(0, 1, 2))(q, k, v), theirs)


def test_forward_mode_transforms_stay_refused():
    x, w = _data((3,), (3,))
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jacfwd(lambda a: scaled_tanh(a, w, alpha=1.0))(x)
