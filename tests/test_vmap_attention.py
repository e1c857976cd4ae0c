"""`torch.func.vmap` over the drop-in SDPA and `flash_attention` (alone, nested, over `grad`), against
torch's own SDPA (math backend) under the same transforms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from jaxattn.torch_api import flash_attention, scaled_dot_product_attention, sdpa_launcher
from jaxattn.torch_api.validation import AttentionInputError

# V vmapped samples of (B, Hq, L, E) queries against (B, Hk, S, E) keys: GQA, L != S, head dim 80.
V, B, HQ, HK, L, S, E, EV = 3, 2, 4, 2, 17, 33, 80, 24
DTYPES = [torch.float64, torch.float32]


def _tol(dtype):
    return dict(atol=1e-10, rtol=1e-8) if dtype == torch.float64 else dict(atol=2e-5, rtol=2e-4)


def _data(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=dtype) for s in ((V, B, HQ, L, E), (V, B, HK, S, E), (V, B, HK, S, EV)))
    return g, q, k, v


def _torch_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def _close(ours, theirs, dtype):
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["none", "causal", "bool_per_sample", "float_broadcast", "float_per_sample"])
def test_vmap_of_the_drop_in(dtype, mask):
    g, q, k, v = _data(dtype, seed=1)
    if mask == "bool_per_sample":
        m = torch.rand(V, 1, L, S, generator=g) > 0.4
        m[..., 0] = True  # every row sees a key (an empty row is 0 in jaxattn and NaN in torch's math)
        in_dims = (0, 0, 0, 0)
    elif mask.startswith("float"):
        m = torch.randn(*((V,) if mask == "float_per_sample" else ()), HQ, L, S, generator=g, dtype=dtype)
        in_dims = (0, 0, 0, 0 if mask == "float_per_sample" else None)
    else:
        m, in_dims = None, (0, 0, 0, None)

    def call(sdpa):
        return vmap(lambda a, b, c, mm: sdpa(a, b, c, mm, is_causal=mask == "causal", enable_gqa=True), in_dims=in_dims)

    _close(call(scaled_dot_product_attention)(q, k, v, m), call(_torch_sdpa)(q, k, v, m), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_sample_gradients_with_a_shared_float_mask(dtype):
    g, q, k, v = _data(dtype, seed=2)
    bias = torch.randn(L, S, generator=g, dtype=dtype)

    def per_sample(sdpa):
        loss = lambda a, b, c, m: sdpa(a, b, c, m, enable_gqa=True).square().sum()  # noqa: E731
        return vmap(grad(loss, argnums=(0, 1, 2, 3)), in_dims=(0, 0, 0, None))(q, k, v, bias)

    _close(per_sample(scaled_dot_product_attention), per_sample(_torch_sdpa), dtype)


def test_nested_vmap_over_grad_and_other_in_dims():
    dtype = torch.float64
    _, q, k, v = _data(dtype, seed=3)
    # Per-sample (Hq, L, E): the outer vmap maps over dim 1 (B), the inner one over dim 0 (V); the
    # inner one shares the value across its samples.
    inner = lambda sdpa: vmap(  # noqa: E731
        grad(lambda a, b, c: sdpa(a, b, c, is_causal=True, enable_gqa=True).sum()), in_dims=(0, 0, None))

    def call(sdpa):
        return vmap(inner(sdpa), in_dims=(1, 1, 0), out_dims=1)(q, k, v[0])

    _close(call(scaled_dot_product_attention), call(_torch_sdpa), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vmap_of_flash_attention_and_its_gradients(dtype):
    _, q, k, v = _data(dtype, seed=4)
    ours = vmap(lambda a, b, c: flash_attention(a, b, c, causal=True))(q, k, v)
    _close(ours, vmap(lambda a, b, c: _torch_sdpa(a, b, c, is_causal=True, enable_gqa=True))(q, k, v), dtype)

    def per_sample(loss):
        return vmap(grad(lambda a, b, c: loss(a, b, c).square().sum(), argnums=(0, 1, 2)))(q, k, v)

    _close(per_sample(lambda a, b, c: flash_attention(a, b, c, causal=True)),
           per_sample(lambda a, b, c: _torch_sdpa(a, b, c, is_causal=True, enable_gqa=True)), dtype)


def test_a_nan_in_one_sample_is_still_refused():
    _, q, k, v = _data(torch.float64, seed=5)
    k[1, 0, 1, 7, 3] = float("nan")
    with pytest.raises(AttentionInputError, match="key: contains NaN or inf"):
        vmap(lambda a, b, c: scaled_dot_product_attention(a, b, c, enable_gqa=True))(q, k, v)
    with pytest.raises(AttentionInputError, match="k: contains NaN or inf"):
        vmap(lambda a, b, c: flash_attention(a, b, c))(q, k, v)


def test_dropout_follows_vmaps_randomness_flag():
    _, q, k, v = _data(torch.float32, seed=6)
    q, k, v = (t[:1].expand(V, *t.shape[1:]) for t in (q, k, v))  # V identical samples
    run = lambda randomness: vmap(  # noqa: E731
        lambda a, b, c: scaled_dot_product_attention(a, b, c, dropout_p=0.5, enable_gqa=True), randomness=randomness)
    with pytest.raises(RuntimeError, match="randomness"):
        run("error")(q, k, v)
    same, different = run("same")(q, k, v), run("different")(q, k, v)
    torch.testing.assert_close(same[1], same[0])
    assert not torch.allclose(different[1], different[0])


def test_the_native_launcher_refuses_transforms_by_name():
    _, q, k, v = _data(torch.float32, seed=7)
    with sdpa_launcher("native"), pytest.raises(ValueError, match="torch.func transform"):
        vmap(lambda a, b, c: scaled_dot_product_attention(a, b, c, enable_gqa=True))(q, k, v)


def test_per_sample_varlen_lengths_are_refused():
    q, k, v = (torch.randn(V, 12, 2, 16) for _ in range(3))
    cu = torch.tensor([[0, 5, 12]] * V, dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="cu_seqlens_q: vmapped under torch.func.vmap"):
        vmap(lambda a, b, c, cq, ck: flash_attention(a, b, c, cu_seqlens_q=cq, cu_seqlens_k=ck))(q, k, v, cu, cu)
    shared = vmap(lambda a, b, c: flash_attention(a, b, c, cu_seqlens_q=cu[0], cu_seqlens_k=cu[0]))(q, k, v)
    for i in range(V):  # unbatched lengths are fine: each sample as its own call
        torch.testing.assert_close(shared[i], flash_attention(q[i], k[i], v[i], cu_seqlens_q=cu[0], cu_seqlens_k=cu[0]))
