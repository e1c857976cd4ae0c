"""Sequence-length bucketing of the drop-in SDPA: padded L and S, masked padding, sliced output.

Oracles: torch's math SDPA in float64 (outputs and gradients of q, k, v and a float mask) and the
unbucketed call (equal up to floating-point summation order: padding adds exact zeros to the
softmax sums, in a different order). Compile counts come from the executable cache's counters.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_reference import assert_dtype_rule

import jaxattn.bridge as bridge
from jaxattn.torch_api import (
    current_sequence_buckets,
    scaled_dot_product_attention,
    sequence_buckets,
    set_sequence_buckets,
)
from jaxattn.torch_api.bucketing import bucket_length

BUCKETS = (16, 32, 64)


def _math(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _run(fn, q, k, v, mask, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    m = None
    if mask is not None:
        m = mask.detach().clone()
        if m.dtype.is_floating_point:
            m.requires_grad_()
    out = fn(*leaves, attn_mask=m, **kwargs)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves] + ([m.grad] if m is not None and m.requires_grad else [])


def _check(q, k, v, mask=None, seed=0, **kwargs):
    """Bucketed vs float64 torch math (tight) and vs the unbucketed call (summation order only)."""
    g = torch.Generator().manual_seed(seed)
    ref_out = _math(q.double(), k.double(), v.double(), attn_mask=None if mask is None else (
        mask if mask.dtype == torch.bool else mask.double()), **kwargs)
    dout = torch.randn(ref_out.shape, generator=g, dtype=torch.float64)
    ref = _run(_math, q.double(), k.double(), v.double(),
               None if mask is None else (mask if mask.dtype == torch.bool else mask.double()), dout, **kwargs)
    plain = _run(scaled_dot_product_attention, q, k, v, mask, dout.to(q.dtype), **kwargs)
    with sequence_buckets(BUCKETS):
        bucketed = _run(scaled_dot_product_attention, q, k, v, mask, dout.to(q.dtype), **kwargs)
    tol = 1e-10 if q.dtype == torch.float64 else 3e-5
    for name, b, p, r in zip(("out", "dq", "dk", "dv", "dmask"), bucketed, plain, ref):
        assert b.shape == r.shape and b.dtype == q.dtype, name
        assert torch.isfinite(b).all(), name
        scale = max(1.0, r.abs().max().item())
        assert (b.double() - r).abs().max().item() <= tol * scale, name
        assert (b - p).abs().max().item() <= (1e-12 if q.dtype == torch.float64 else 2e-6) * scale, name
    return bucketed


def _qkv(g, lead, hq, hk, l, s, e=8, ev=None, dtype=torch.float32):
    ev = ev or e
    return (torch.randn(*lead, hq, l, e, generator=g, dtype=dtype), torch.randn(*lead, hk, s, e, generator=g, dtype=dtype),
            torch.randn(*lead, hk, s, ev, generator=g, dtype=dtype))


# --- settings ------------------------------------------------------------------------------------


def test_bucket_length():
    assert [bucket_length(n, (16, 32, 64)) for n in (1, 16, 17, 33, 64, 65, 128, 129)] == [16, 16, 32, 64, 64, 128, 128, 192]


def test_settings_context_nesting_and_errors():
    assert current_sequence_buckets() is None
    with sequence_buckets([64, 16, 32, 16]):
        assert current_sequence_buckets() == (16, 32, 64)
        with sequence_buckets(None):
            assert current_sequence_buckets() is None
        assert current_sequence_buckets() == (16, 32, 64)
    with pytest.raises(RuntimeError):
        with sequence_buckets([8]):
            raise RuntimeError("boom")
    assert current_sequence_buckets() is None
    set_sequence_buckets((128,))
    try:
        assert current_sequence_buckets() == (128,)
    finally:
        set_sequence_buckets(None)
    for bad in ([], [0], [-4], [True], [1.5], "64"):
        with pytest.raises((TypeError, ValueError), match="buckets="):
            sequence_buckets(bad).__enter__()
    with pytest.raises(TypeError, match="iterable of positive ints"):
        set_sequence_buckets(64)
    assert current_sequence_buckets() is None


# --- exact results ---------------------------------------------------------------------------------


@pytest.mark.parametrize("l, s, dtype", [
    (13, 21, torch.float64),
    pytest.param(21, 13, torch.float32, marks=pytest.mark.thorough),
    (1, 40, torch.float32),
    pytest.param(33, 33, torch.float32, marks=pytest.mark.thorough),
    pytest.param(70, 9, torch.float64, marks=pytest.mark.thorough),
])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_reference_and_unbucketed(dtype, l, s, is_causal):
    g = torch.Generator().manual_seed(l * 100 + s)
    q, k, v = _qkv(g, (2,), 4, 4, l, s, dtype=dtype)
    _check(q, k, v, is_causal=is_causal, seed=l + s)


def test_causal_top_left_when_queries_outnumber_keys():
    # L > S: query i >= S sees every key; padded keys must stay hidden from those rows too
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(g, (1,), 2, 2, 30, 7, dtype=torch.float64)
    out = _check(q, k, v, is_causal=True)[0]
    torch.testing.assert_close(out[..., 7:, :], _math(q[..., 7:, :], k, v), rtol=0, atol=1e-12)


@pytest.mark.parametrize("mask_shape", [(13, 21), (2, 1, 13, 21),
                                        pytest.param((1, 1, 1, 21), marks=pytest.mark.thorough),
                                        pytest.param((2, 4, 1, 1), marks=pytest.mark.thorough), (21,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_of_every_broadcast_shape(mask_shape, kind):
    g = torch.Generator().manual_seed(len(mask_shape) * 7 + (kind == "bool"))
    q, k, v = _qkv(g, (2,), 4, 4, 13, 21)
    if kind == "bool":
        mask = torch.rand(*mask_shape, generator=g) > 0.3
        mask[..., 0] = True  # every row keeps a key (fully hidden rows are tested below)
    else:
        mask = torch.randn(*mask_shape, generator=g)
    _check(q, k, v, mask)


def test_expanded_mask_and_fully_hidden_rows():
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(g, (2,), 4, 4, 13, 21)
    mask = (torch.rand(1, 1, 13, 21, generator=g) > 0.3).expand(2, 4, 13, 21)
    hidden = mask.clone()
    hidden[:, :, 2] = False
    with sequence_buckets(BUCKETS):
        out = scaled_dot_product_attention(q, k, v, attn_mask=hidden)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    _check(q, k, v, mask)


def test_gqa_batch_dims_and_value_head_dim():
    g = torch.Generator().manual_seed(6)
    q, k, v = _qkv(g, (2, 3), 4, 2, 11, 19, e=8, ev=12)
    k, v = k[:, :1], v[:, :1]  # key/value batch dim 1 broadcasts
    _check(q, k, v, enable_gqa=True, is_causal=True)


def test_two_dim_inputs():
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(9, 8, generator=g), torch.randn(20, 8, generator=g), torch.randn(20, 8, generator=g)
    _check(q, k, v)


def test_no_padding_needed_is_left_alone():
    g = torch.Generator().manual_seed(8)
    q, k, v = _qkv(g, (1,), 2, 2, 32, 64)
    with sequence_buckets(BUCKETS):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.is_contiguous()
    torch.testing.assert_close(out, _math(q, k, v, is_causal=True))


# --- fewer compilations ------------------------------------------------------------------------------


def test_lengths_in_one_bucket_share_one_executable():
    g = torch.Generator().manual_seed(9)
    with sequence_buckets([48]):
        q, k, v = _qkv(g, (1,), 2, 2, 37, 37)
        scaled_dot_product_attention(q, k, v, is_causal=True)
        misses = bridge.cache_info().misses
        for n in (38, 41, 45, 48, 40):
            q, k, v = _qkv(g, (1,), 2, 2, n, n)
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.testing.assert_close(out, _math(q, k, v, is_causal=True), atol=2e-5, rtol=1e-5)
    assert bridge.cache_info().misses == misses
    before = bridge.cache_info().misses
    for n in (38, 41):  # without buckets: one executable per length
        q, k, v = _qkv(g, (1,), 2, 2, n, n)
        scaled_dot_product_attention(q, k, v, is_causal=True)
    assert bridge.cache_info().misses == before + 2


def test_dropout_under_buckets_is_seeded_and_shaped():
    g = torch.Generator().manual_seed(10)
    q, k, v = _qkv(g, (2,), 2, 2, 13, 21)
    with sequence_buckets(BUCKETS):
        torch.manual_seed(3)
        a = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
        torch.manual_seed(3)
        b = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
        c = scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert a.shape == (2, 2, 13, 8) and torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isfinite(a).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_bf16_bucketed_within_twice_torch_error(is_causal):
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 4, n, 64, generator=gen, device="cuda") for n in (97, 130, 130))
    dout = torch.randn(2, 4, 97, 64, generator=gen, device="cuda")
    ref = _run(_math, q, k, v, None, dout, is_causal=is_causal)
    low = [t.to(torch.bfloat16) for t in (q, k, v)]
    torch_bf16 = _run(_math, *low, None, dout.bfloat16(), is_causal=is_causal)
    with sequence_buckets([64, 128, 256]):
        ours = _run(scaled_dot_product_attention, *low, None, dout.bfloat16(), is_causal=is_causal)
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, torch_bf16, ref):
        assert o.shape == r.shape, name
        assert_dtype_rule(name, o, r, t, floor=1e-4)
