"""Arguments torch's SDPA accepts at the edges (numpy / 0-d tensor scale, dropout_p=1, size-0
dims), and forward-mode AD refused clearly; the oracle is torch's own SDPA (math backend)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torch.autograd.forward_ad as fwAD
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.torch_api import flash_attention, scaled_dot_product_attention


def _qkv(l=5, s=7, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(grad)  # noqa: E731
    return make(2, 2, l, 8), make(2, 2, s, 8), make(2, 2, s, 6)


def _torch(*args, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kw)


@pytest.mark.parametrize("scale", [np.float32(0.3), np.float64(0.3), torch.tensor(0.3, dtype=torch.float64)])
def test_scale_numpy_scalar_or_0d_tensor(scale):
    q, k, v = _qkv()
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, scale=scale), _torch(q, k, v, scale=float(scale)))


def test_dropout_one_gives_zero_output_and_gradients():
    q, k, v = _qkv(grad=True)
    out = scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    ref = _torch(q, k, v, dropout_p=1.0)
    torch.testing.assert_close(out, ref)
    grads = torch.autograd.grad(out.sum(), [q, k, v])
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("shape", [(0, 5, 7), (2, 0, 7), (2, 5, 0)], ids=["B=0", "L=0", "S=0"])
def test_empty_dims_as_torch(shape):
    b, l, s = shape
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, 2, l, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, 2, s, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, 2, s, 6, generator=g, dtype=torch.float64, requires_grad=True)
    out, ref = scaled_dot_product_attention(q, k, v), _torch(q, k, v)
    assert out.shape == ref.shape == (b, 2, l, 6)
    torch.testing.assert_close(out, ref)
    ours = torch.autograd.grad(out.sum(), [q, k, v])
    theirs = torch.autograd.grad(ref.sum(), [q, k, v])
    for a, c in zip(ours, theirs):
        torch.testing.assert_close(a, c)


def test_forward_ad_dual_tensors_raise():
    q, k, v = _qkv()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, torch.ones_like(q))
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            scaled_dot_product_attention(dual, k, v)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            flash_attention(dual, k, v)


def test_func_jvp_raises():
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="forward-mode AD"):
        torch.func.jvp(lambda a: scaled_dot_product_attention(a, k, v), (q,), (torch.ones_like(q),))
