"""Second-order gradients (create_graph=True) on the XLA path and through `jax_op`, against torch.

The oracle is torch's own math SDPA in float64 (`gradgradcheck` checks the double backward against
finite differences of our own first-order backward, which is itself checked against torch).
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import jax.numpy as jnp

from jaxattn.bridge import jax_op
from jaxattn.torch_api import scaled_dot_product_attention, sdpa_launcher


def _rand(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(True)


def _torch_sdpa(*args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kw)


CASES = {
    "plain L!=S": dict(q=(1, 2, 3, 4), kv=(1, 2, 5, 4), kw={}),
    "causal gqa": dict(q=(2, 4, 5, 3), kv=(2, 2, 5, 3), kw=dict(is_causal=True, enable_gqa=True)),
    "float mask": dict(q=(1, 2, 4, 3), kv=(1, 2, 6, 3), kw={}, mask=(1, 1, 4, 6)),
}


# gradgradcheck differentiates numerically through every input element: seconds per case; the
# default run checks second order against torch's own (the gradient penalty and HVP tests below)
@pytest.mark.thorough
@pytest.mark.parametrize("case", CASES)
def test_gradgradcheck_drop_in(case):
    c = CASES[case]
    q, k, v = _rand(*c["q"], seed=1), _rand(*c["kv"], seed=2), _rand(*c["kv"], seed=3)
    inputs = [q, k, v] + ([_rand(*c["mask"], seed=4)] if "mask" in c else [])

    def f(q, k, v, *mask):
        return scaled_dot_product_attention(q, k, v, *mask, implementation="vanilla", **c["kw"])

    assert torch.autograd.gradgradcheck(f, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_gradient_penalty_matches_torch():
    q, k, v = _rand(1, 2, 7, 8, seed=5), _rand(1, 2, 9, 8, seed=6), _rand(1, 2, 9, 8, seed=7)

    def penalty(fn):
        out = fn(q, k, v, is_causal=True)
        (gq,) = torch.autograd.grad((out * out.detach()).sum(), [q], create_graph=True)
        return torch.autograd.grad((gq ** 2).sum(), [k, v], allow_unused=True)

    ours, ref = penalty(scaled_dot_product_attention), penalty(_torch_sdpa)
    for a, b in zip(ours, ref):
        assert a is not None and a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_hvp_matches_torch():
    q, k, v = _rand(1, 1, 5, 4, seed=8), _rand(1, 1, 6, 4, seed=9), _rand(1, 1, 6, 4, seed=10)
    vec = torch.randn(1, 1, 5, 4, dtype=torch.float64)

    def loss(fn):
        return lambda x: (fn(x, k.detach(), v.detach()) ** 2).sum()

    _, ours = torch.autograd.functional.hvp(loss(scaled_dot_product_attention), q.detach(), vec)
    _, ref = torch.autograd.functional.hvp(loss(_torch_sdpa), q.detach(), vec)
    assert ours.abs().sum() > 0
    torch.testing.assert_close(ours, ref, rtol=1e-7, atol=1e-9)


@jax_op(name="tests.higher_order.scaled_tanh")
def _scaled_tanh(x, w, *, alpha):
    return jnp.tanh(alpha * x) * w


def test_jax_op_third_order_matches_torch():
    """Derivatives to third order of a jax_op, including a broadcast (stride-0) argument."""
    x = _rand(3, 4, seed=11)
    w = _rand(1, 4, seed=12)

    def derivs(fn):
        y = fn(x, w.expand(3, 4)).sum()
        (g1,) = torch.autograd.grad(y, [x], create_graph=True)
        (g2,) = torch.autograd.grad(g1.sum(), [x], create_graph=True)
        return torch.autograd.grad(g2.sum(), [x, w])

    ours = derivs(lambda a, b: _scaled_tanh(a, b, alpha=0.7))
    ref = derivs(lambda a, b: torch.tanh(0.7 * a) * b)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


class _Passthrough(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_jax_op_double_backward_through_the_custom_op():
    """Under a function mode calls take the custom op (the route of dispatch modes and transforms)."""
    x = _rand(2, 3, seed=13)
    with _Passthrough():
        (g,) = torch.autograd.grad(_scaled_tanh(x, x, alpha=1.3).sum(), [x], create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), [x])
    xr = x.detach().requires_grad_(True)
    (gr,) = torch.autograd.grad((torch.tanh(1.3 * xr) * xr).sum(), [xr], create_graph=True)
    (ggr,) = torch.autograd.grad(gr.sum(), [xr])
    torch.testing.assert_close(gg, ggr, rtol=1e-9, atol=1e-12)


def test_vjp_ops_are_made_from_their_names():
    """A compiled backward replayed from torch.compile's caches calls `<op>.vjp<n>` by name in a process
    that never ran that backward: the registry makes it from the name, and it computes the gradients."""
    from jaxattn.bridge.registry import OPS, registered

    @jax_op(name="tests.higher_order.named_square")
    def named_square(a, b):
        return a * a * b

    for name in ("tests.higher_order.named_square.vjp2", "tests.higher_order.named_square.vjp2.vjp3"):
        OPS.pop(name, None)
    vjp = registered("tests.higher_order.named_square.vjp2")
    assert vjp.name == "tests.higher_order.named_square.vjp2" and vjp.num_outputs == 2
    assert registered("tests.higher_order.named_square.vjp2.vjp3").num_outputs == 3  # the vjp of the vjp
    x, w = _rand(2, 3, seed=21), _rand(2, 3, seed=22)
    gx, gw = torch.autograd.grad(named_square(x, w).sum(), [x, w])
    torch.testing.assert_close(gx, 2 * x * w)
    torch.testing.assert_close(gw, x * x)
    for bad in ("tests.higher_order.named_square.vjpx", "tests.higher_order.unknown.vjp2", ".vjp2"):
        with pytest.raises(KeyError, match="is not registered in this process"):
            registered(bad)
