"""Tests of jaxattn.bridge: zero-copy DLPack, the generic differentiable `jax_op`, its cache,
torch.compile / opcheck of the custom ops, and the GPU memory policy at import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import jaxattn.bridge as bridge
from jaxattn.bridge import JaxOp, jax_op
from jaxattn import gpu_memory
from jaxattn.torch_api import scaled_dot_product_attention

# ----------------------------------------------------------------------------------------------
# JAX functions (no attention) turned into torch ops; names are unique to this module.
# ----------------------------------------------------------------------------------------------


@jax_op(name="tests.test_bridge.scaled_tanh")
def scaled_tanh(x, w, *, alpha):
    return jnp.tanh(alpha * x) * w


def scaled_tanh_torch(x, w, *, alpha):
    return torch.tanh(alpha * x) * w


@jax_op(name="tests.test_bridge.two_outputs", num_outputs=2)
def two_outputs(x, y):
    return jnp.sin(x) * y, jnp.exp(x) + y**2


@jax_op(name="tests.test_bridge.optional_bias")
def optional_bias(x, b, w, *, power=1):
    out = x**power * w
    return out if b is None else out + b


@jax_op(name="tests.test_bridge.gather_scale")
def gather_scale(x, idx, *, offset):
    return x[idx + offset] * 3.0


@jax_op(name="tests.test_bridge.clamp_min")
def clamp_min(x, *, lo):
    return jnp.maximum(x, lo)


_identity = JaxOp(lambda x: x, name="tests.test_bridge.identity")


def _cache_probe_fn(x, *, k):
    return x * k


_cache_probe = JaxOp(_cache_probe_fn, name="tests.test_bridge.cache_probe")


# ----------------------------------------------------------------------------------------------
# Zero-copy conversion
# ----------------------------------------------------------------------------------------------


def test_to_jax_is_zero_copy_for_contiguous_float32():
    t = torch.randn(6, 5)
    a = bridge.to_jax([t])[0]
    assert isinstance(a, jax.Array)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.dtype == jnp.float32 and a.shape == (6, 5)
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    # several tensors in one call, each zero-copy
    ts = [torch.randn(3), torch.randn(2, 2), torch.ones(4, 1, 3)]
    for t, a in zip(ts, bridge.to_jax(ts)):
        assert a.unsafe_buffer_pointer() == t.data_ptr()
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.bool, torch.int32, torch.uint8])
def test_dtype_roundtrip(dtype):
    base = torch.randn(7, 9) * 10
    t = (base > 0) if dtype == torch.bool else base.to(dtype)
    a = bridge.to_jax([t])[0]
    assert a.dtype == bridge.to_jax_dtype(dtype)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    back = bridge.to_torch([a])[0]
    assert back.dtype == dtype
    assert torch.equal(back, t)
    assert bridge.to_torch_dtype(a.dtype) == dtype


def test_float64_roundtrip_under_x64():
    t = torch.randn(4, 3, dtype=torch.float64)
    with jax.enable_x64(True):
        a = bridge.to_jax([t])[0]
        assert a.dtype == jnp.float64 and a.unsafe_buffer_pointer() == t.data_ptr()
        back = bridge.to_torch([a * 2])[0]
    assert back.dtype == torch.float64
    torch.testing.assert_close(back, t * 2, rtol=0, atol=0)


def test_to_torch_aliases_jax_buffer():
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 0.5
    t = bridge.to_torch([a])[0]
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert t.shape == (3, 4) and t.dtype == torch.float32 and t.device.type == "cpu"
    np.testing.assert_array_equal(t.numpy(), np.asarray(a))


def test_non_contiguous_tensor_is_copied_with_right_values():
    base = torch.randn(5, 7)
    t = base.t()
    assert not t.is_contiguous()
    a = bridge.to_jax([t])[0]
    assert a.shape == (7, 5)
    assert a.unsafe_buffer_pointer() != base.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    sliced = torch.randn(6, 8)[:, ::2]
    np.testing.assert_array_equal(np.asarray(bridge.to_jax([sliced])[0]), sliced.numpy())


def test_size_one_dims_with_odd_strides_stay_zero_copy():
    t = torch.randn(1, 5).t()  # shape (5, 1), strides (1, 5): contiguous, non-canonical strides
    assert t.is_contiguous() and t.stride() != (1, 1)
    a = bridge.to_jax([t])[0]
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert bridge.importable(t).stride() == (1, 1)


def test_expanded_tensor_narrow_broadcast():
    base = torch.randn(3, 1, 4)
    t = base.expand(2, 3, 5, 4)
    narrowed, full = bridge.narrow_broadcast(t)
    assert full == (2, 3, 5, 4)
    assert narrowed.shape == (1, 3, 1, 4)
    assert narrowed.data_ptr() == base.data_ptr()  # a view, nothing materialised
    torch.testing.assert_close(narrowed.expand(full), t)
    # a plain tensor is returned as is
    plain = torch.randn(2, 3)
    same, none = bridge.narrow_broadcast(plain)
    assert same is plain and none is None
    # size-1 dims with stride 0 are not "broadcast"
    one = torch.randn(4)[None].expand(1, 4)
    assert bridge.narrow_broadcast(one)[1] is None
    # converting the expanded tensor itself gives the full values
    np.testing.assert_array_equal(np.asarray(bridge.to_jax([t])[0]), t.numpy())


def test_requires_grad_tensor_converts_detached():
    t = torch.randn(4, 3, requires_grad=True)
    imp = bridge.importable(t)
    assert not imp.requires_grad and imp.data_ptr() == t.data_ptr()
    a = bridge.to_jax([t])[0]
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())
    y = (t * 2)[1:]  # non-leaf, non-contiguous-offset view with grad history
    np.testing.assert_array_equal(np.asarray(bridge.to_jax([y])[0]), y.detach().numpy())


def test_misaligned_storage_offset_is_converted():
    t = torch.randn(17)[1:]  # data pointer 4 bytes past a 16-byte boundary
    assert t.data_ptr() % 16 != 0
    a = bridge.to_jax([t])[0]
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert a.unsafe_buffer_pointer() % 16 == 0
    t2 = torch.randn(3, 9, dtype=torch.float16)[:, 1:].contiguous()[1:]
    np.testing.assert_array_equal(np.asarray(bridge.to_jax([t2])[0]).astype(np.float32), t2.float().numpy())


def test_dtype_and_device_maps():
    assert bridge.to_jax_dtype(torch.bfloat16) == jnp.bfloat16
    assert bridge.to_torch_dtype(jnp.float16) == torch.float16
    with pytest.raises(TypeError, match="no JAX equivalent"):
        bridge.to_jax_dtype(torch.complex64)
    with pytest.raises(TypeError, match="no torch equivalent"):
        bridge.to_torch_dtype(jnp.complex64)
    dev = bridge.to_jax_device(torch.device("cpu"))
    assert dev.platform == "cpu"
    assert bridge.to_torch_device(dev) == torch.device("cpu")
    with pytest.raises(TypeError, match="only cpu and cuda"):
        bridge.to_jax_device(torch.device("meta"))


# ----------------------------------------------------------------------------------------------
# jax_op: a generic differentiable op
# ----------------------------------------------------------------------------------------------


def test_jax_op_forward_and_grads_match_torch():
    x = torch.randn(5, 7, requires_grad=True)
    w = torch.randn(5, 7, requires_grad=True)
    out = scaled_tanh(x, w, alpha=0.7)
    assert isinstance(out, torch.Tensor) and out.shape == (5, 7) and out.dtype == torch.float32
    assert out.grad_fn is not None
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = scaled_tanh_torch(x2, w2, alpha=0.7)
    torch.testing.assert_close(out, ref)
    ct = torch.randn(5, 7)
    (out * ct).sum().backward()
    (ref * ct).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    # another static value is another function
    torch.testing.assert_close(scaled_tanh(x, w, alpha=2.0), scaled_tanh_torch(x, w, alpha=2.0))
    assert scaled_tanh.name == "tests.test_bridge.scaled_tanh" and scaled_tanh.__name__ == "scaled_tanh"


def test_jax_op_grad_only_for_inputs_that_require_it():
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4)
    scaled_tanh(x, w, alpha=1.5).sum().backward()
    torch.testing.assert_close(x.grad, (1 - torch.tanh(1.5 * x.detach()) ** 2) * 1.5 * w)
    assert w.grad is None


def test_jax_op_inference_has_no_graph():
    x = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        out = scaled_tanh(x, torch.ones(4), alpha=1.0)
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, torch.tanh(x.detach()))
    out = scaled_tanh(x.detach(), torch.ones(4), alpha=1.0)
    assert out.grad_fn is None


def test_jax_op_two_outputs():
    x = torch.randn(3, 4, requires_grad=True)
    y = torch.randn(3, 4, requires_grad=True)
    a, b = two_outputs(x, y)
    x2, y2 = x.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    ra, rb = torch.sin(x2) * y2, torch.exp(x2) + y2**2
    torch.testing.assert_close(a, ra)
    torch.testing.assert_close(b, rb)
    ca, cb = torch.randn(3, 4), torch.randn(3, 4)
    ((a * ca).sum() + (b * cb).sum()).backward()
    ((ra * ca).sum() + (rb * cb).sum()).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)
    # only the second output in the loss: the first one's cotangent is zero
    x.grad = y.grad = x2.grad = y2.grad = None
    two_outputs(x, y)[1].sum().backward()
    (torch.exp(x2) + y2**2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(y.grad, y2.grad)


def test_jax_op_none_positional_argument():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    out = optional_bias(x, None, w, power=2)
    torch.testing.assert_close(out, x.detach() ** 2 * w.detach())
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach() * w.detach())
    torch.testing.assert_close(w.grad, (x.detach() ** 2).sum(0))
    b = torch.randn(3, 1, requires_grad=True)
    out = optional_bias(x, b, w)
    torch.testing.assert_close(out, x.detach() * w.detach() + b.detach())
    out.sum().backward()
    torch.testing.assert_close(b.grad, torch.full((3, 1), 4.0))


def test_jax_op_broadcast_argument_grads_through_base():
    base = torch.randn(3, 1, requires_grad=True)
    w = torch.randn(3, 5, requires_grad=True)
    expanded = base.expand(3, 5)
    out = scaled_tanh(expanded, w, alpha=0.9)
    base2, w2 = base.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = scaled_tanh_torch(base2.expand(3, 5), w2, alpha=0.9)
    torch.testing.assert_close(out, ref)
    ct = torch.randn(3, 5)
    (out * ct).sum().backward()
    (ref * ct).sum().backward()
    torch.testing.assert_close(base.grad, base2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    # broadcast in both leading and trailing dims, through a multi-dim base
    base3 = torch.randn(1, 4, 1, requires_grad=True)
    w3 = torch.randn(2, 4, 3)
    scaled_tanh(base3.expand(2, 4, 3), w3, alpha=1.0).sum().backward()
    base4 = base3.detach().clone().requires_grad_()
    scaled_tanh_torch(base4.expand(2, 4, 3), w3, alpha=1.0).sum().backward()
    torch.testing.assert_close(base3.grad, base4.grad)


def test_jax_op_grad_of_expanded_leaf_matches_torch():
    base = torch.randn(3, 1)
    w = torch.randn(3, 4)
    leaf = base.expand(3, 4).requires_grad_()
    assert leaf.is_leaf and leaf.stride()[1] == 0
    scaled_tanh(leaf, w, alpha=1.0).sum().backward()
    leaf2 = base.expand(3, 4).requires_grad_()
    scaled_tanh_torch(leaf2, w, alpha=1.0).sum().backward()
    torch.testing.assert_close(leaf.grad, leaf2.grad)
    assert leaf.grad.shape == (3, 4)


def test_jax_op_float64_stays_float64():
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    out = scaled_tanh(x, w, alpha=0.3)
    assert out.dtype == torch.float64
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = scaled_tanh_torch(x2, w2, alpha=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.sum().backward()
    ref.sum().backward()
    assert x.grad.dtype == torch.float64
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=1e-12)
    assert not jax.config.jax_enable_x64  # x64 is switched on only around the call


def test_jax_op_gradcheck_float64():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, b, w: optional_bias(x, b, w, power=3), (x, b, w))
    assert torch.autograd.gradcheck(lambda x, y: two_outputs(x, y), (x, b))


def test_jax_op_integer_input_passes_through():
    x = torch.randn(10, requires_grad=True)
    idx = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    out = gather_scale(x, idx, offset=1)
    torch.testing.assert_close(out, x.detach()[idx.long() + 1] * 3.0)
    out.sum().backward()
    expected = torch.zeros(10)
    expected.index_add_(0, idx.long() + 1, torch.full((4,), 3.0))
    torch.testing.assert_close(x.grad, expected)
    assert idx.grad is None


def test_jax_op_positional_python_float_raises():
    with pytest.raises(TypeError, match="keyword"):
        scaled_tanh(torch.randn(3), 2.0, alpha=1.0)


@pytest.mark.parametrize("lo", [float("inf"), -float("inf"), 0.25])
def test_jax_op_static_non_finite_float(lo):
    x = torch.randn(4)
    torch.testing.assert_close(clamp_min(x, lo=lo), torch.clamp(x, min=lo))


def test_jax_op_wrong_num_outputs_raises():
    declared_two = JaxOp(lambda x: x * 2, name="tests.test_bridge.declared_two", num_outputs=2)
    with pytest.raises(TypeError, match="num_outputs=2"):
        declared_two(torch.randn(3))
    declared_one = JaxOp(lambda x: (x, x + 1), name="tests.test_bridge.declared_one")
    with pytest.raises(TypeError, match="num_outputs=1"):
        declared_one(torch.randn(3))


def test_jax_op_registration_errors():
    with pytest.raises(ValueError, match="already registered"):
        JaxOp(lambda x: x + 1, name="tests.test_bridge.scaled_tanh")
    # the same function under the same name again is fine
    again = JaxOp(scaled_tanh.fn, name="tests.test_bridge.scaled_tanh")
    torch.testing.assert_close(again(torch.ones(2), torch.ones(2), alpha=1.0), torch.tanh(torch.ones(2)))
    with pytest.raises(ValueError, match="name"):
        JaxOp(lambda x: x, name="")
    with pytest.raises(ValueError, match="num_outputs"):
        JaxOp(lambda x: x, name="tests.test_bridge.zero_outputs", num_outputs=0)
    with pytest.raises(ValueError, match="at least one positional argument must be a tensor"):
        optional_bias(None, None, None)


def test_jax_op_default_name_from_qualname():
    def local_fn(x):
        return x * 5

    op = jax_op(local_fn)
    assert op.name == f"{__name__}.test_jax_op_default_name_from_qualname.<locals>.local_fn"
    torch.testing.assert_close(op(torch.ones(3)), torch.full((3,), 5.0))


def test_jax_op_devices_must_agree():
    # only cpu exists here; a meta tensor stands in for "another device"
    with pytest.raises(ValueError, match="one device"):
        scaled_tanh(torch.randn(3), torch.randn(3, device="meta"), alpha=1.0)


def test_jax_op_output_does_not_alias_input():
    x = torch.randn(5)
    y = _identity(x)
    assert y.data_ptr() != x.data_ptr()
    y.add_(1)
    assert not torch.equal(x, y)
    x_grad = torch.randn(5, requires_grad=True)
    y = _identity(x_grad)
    assert y.data_ptr() != x_grad.data_ptr()
    y.backward(torch.arange(5.0))
    torch.testing.assert_close(x_grad.grad, torch.arange(5.0))


def test_inplace_mutation_after_forward_is_detected():
    x = torch.randn(6, requires_grad=True)
    y = x * 1
    out = scaled_tanh(y, torch.randn(6), alpha=1.0)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_output_buffers_are_safe_to_mutate_before_backward():
    # outputs are saved for backward: mutating them in place must be caught, not silently used
    x = torch.randn(6, requires_grad=True)
    out = _identity(x * 1.0)
    out.mul_(2)
    with pytest.raises(RuntimeError, match="inplace operation"):
        (out * x).sum().backward()


# ----------------------------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------------------------


def test_cache_hits_and_misses():
    x = torch.randn(11, 3)
    before = bridge.cache_info()
    _cache_probe(x, k=2.0)
    after_new = bridge.cache_info()
    assert after_new.misses == before.misses + 1
    _cache_probe(torch.randn(11, 3), k=2.0)
    after_repeat = bridge.cache_info()
    assert after_repeat.hits == after_new.hits + 1 and after_repeat.misses == after_new.misses
    _cache_probe(torch.randn(11, 4), k=2.0)  # new shape
    assert bridge.cache_info().misses == after_repeat.misses + 1
    _cache_probe(torch.randn(11, 4), k=3.0)  # new static value
    assert bridge.cache_info().misses == after_repeat.misses + 2
    assert bridge.cache_info().maxsize >= 1


def test_set_cache_size_evicts():
    info = bridge.cache_info()
    try:
        bridge.set_cache_size(1)
        assert bridge.cache_info().size <= 1 and bridge.cache_info().maxsize == 1
        a, b = torch.randn(13, 2), torch.randn(13, 5)
        _cache_probe(a, k=1.0)
        _cache_probe(b, k=1.0)
        m = bridge.cache_info().misses
        out = _cache_probe(a, k=1.0)  # evicted by b: rebuilt
        assert bridge.cache_info().misses == m + 1
        assert bridge.cache_info().size == 1
        torch.testing.assert_close(out, a)
        with pytest.raises(ValueError, match="maxsize"):
            bridge.set_cache_size(0)
    finally:
        bridge.set_cache_size(info.maxsize)
    assert bridge.cache_info().maxsize == info.maxsize


# ----------------------------------------------------------------------------------------------
# torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _TanhBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, w):
        h = scaled_tanh(self.lin(x), w, alpha=0.7)
        a, b = two_outputs(h, w)
        return (a + b).relu().sum(-1)


def test_torch_compile_fullgraph_jax_op(dynamo_reset):
    torch.manual_seed(0)
    module = _TanhBlock()
    compiled = torch.compile(module, fullgraph=True)
    x = torch.randn(5, 8)
    w = torch.randn(5, 8, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    out_c = compiled(x, w)
    out_e = module(x, w2)
    torch.testing.assert_close(out_c, out_e)
    out_c.sum().backward()
    grads_c = [p.grad.clone() for p in module.parameters()] + [w.grad]
    module.zero_grad()
    out_e.sum().backward()
    grads_e = [p.grad for p in module.parameters()] + [w2.grad]
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)
    with torch.no_grad():  # inference through the compiled module too
        torch.testing.assert_close(compiled(x, w), out_e.detach())


class _Attn(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal

    def forward(self, q, k, v, mask=None):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal, enable_gqa=True)


@pytest.mark.parametrize("case", ["causal", "float_mask"])
def test_torch_compile_fullgraph_sdpa(dynamo_reset, case):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k = torch.randn(2, 2, 11, 16, generator=g)
    v = torch.randn(2, 2, 11, 16, generator=g)
    mask = torch.randn(2, 1, 9, 11, generator=g) if case == "float_mask" else None
    module = _Attn(is_causal=case == "causal")
    compiled = torch.compile(module, fullgraph=True)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([mask.clone().requires_grad_()] if mask is not None else [])
        out = fn(*leaves[:3], *leaves[3:])
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return out.detach(), [t.grad for t in leaves]

    out_c, grads_c = run(compiled)
    out_e, grads_e = run(module)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=module.is_causal,
                                                           enable_gqa=True)
    torch.testing.assert_close(out_e, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_c, out_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


# ----------------------------------------------------------------------------------------------
# opcheck of the custom op
# ----------------------------------------------------------------------------------------------


class _RecordJaxCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.jaxattn.jax_call.default:
            self.calls.append((args, kwargs))
        return func(*args, **kwargs)


def _recorded_op_args(fn, *args, **kwargs):
    with _RecordJaxCalls() as rec:
        fn(*args, **kwargs)
    assert len(rec.calls) == 1
    (tensors, op, spec), _ = rec.calls[0]
    # fresh leaves that keep the requires_grad flags of the originals
    tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
    return tensors, op, spec


def test_opcheck_jax_op():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    b = torch.randn(3, 4)
    tensors, op, spec = _recorded_op_args(optional_bias, x, b, w, power=2)
    assert op == "tests.test_bridge.optional_bias" and len(tensors) == 3
    torch.testing.assert_close(torch.ops.jaxattn.jax_call(tensors, op, spec)[0], x.detach() ** 2 * w.detach() + b)
    torch.library.opcheck(torch.ops.jaxattn.jax_call.default, (tensors, op, spec))


def test_opcheck_jax_op_two_outputs_and_broadcast():
    x = torch.randn(3, 1, requires_grad=True).expand(3, 4)
    y = torch.randn(3, 4, requires_grad=True)
    tensors, op, spec = _recorded_op_args(two_outputs, x, y)
    assert tensors[0].shape == (3, 1)  # narrowed before the op
    torch.library.opcheck(torch.ops.jaxattn.jax_call.default, (tensors, op, spec))


@pytest.mark.parametrize("case", ["causal", "float_mask", "bool_mask_gqa"])
def test_opcheck_sdpa_op(case):
    g = torch.Generator().manual_seed(2)
    hk = 2 if case == "bool_mask_gqa" else 4
    q = torch.randn(2, 4, 9, 16, generator=g, requires_grad=True)
    k = torch.randn(2, hk, 11, 16, generator=g, requires_grad=True)
    v = torch.randn(2, hk, 11, 16, generator=g, requires_grad=True)
    mask = {"causal": None, "float_mask": torch.randn(2, 4, 9, 11, generator=g, requires_grad=True),
            "bool_mask_gqa": torch.rand(2, 4, 9, 11, generator=g) > 0.3}[case]
    tensors, op, spec = _recorded_op_args(
        scaled_dot_product_attention, q, k, v, attn_mask=mask, is_causal=case == "causal", enable_gqa=True
    )
    assert op == "jaxattn.sdpa"
    out = torch.ops.jaxattn.jax_call(tensors, op, spec)[0]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=case == "causal",
                                                           enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.library.opcheck(torch.ops.jaxattn.jax_call.default, (tensors, op, spec))


# ----------------------------------------------------------------------------------------------
# GPU memory policy at import
# ----------------------------------------------------------------------------------------------


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_") and k != "XLA_FLAGS"}
    env.update(extra)
    return env


def _run_py(code, env):
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip().splitlines()[-1]


_PRINT_AFTER_BRIDGE = """
    import os
    import jaxattn.bridge
    print(repr(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")))
"""


def test_import_bridge_turns_off_preallocation():
    assert _run_py(_PRINT_AFTER_BRIDGE, _clean_env()) == "'false'"


@pytest.mark.thorough  # another fresh process; the default run keeps the two around it
def test_import_bridge_respects_user_memory_settings():
    assert _run_py(_PRINT_AFTER_BRIDGE, _clean_env(XLA_PYTHON_CLIENT_MEM_FRACTION=".5")) == "None"


def test_import_jax_core_also_turns_off_preallocation():
    code = """
        import os, sys
        import jaxattn.jax_core
        assert "torch" not in sys.modules
        print(repr(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")))
    """
    assert _run_py(code, _clean_env()) == "'false'"
    assert _run_py(code, _clean_env(XLA_PYTHON_CLIENT_PREALLOCATE="true")) == "'true'"  # the user's choice stays


def test_configure_gpu_memory_in_process(monkeypatch):
    for name in gpu_memory._USER_VARS:
        monkeypatch.delenv(name, raising=False)
    jax.devices()  # backends are up in this process: the policy comes too late, and says so
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gpu_memory.configure_gpu_memory() is True
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert any("came too late" in str(w.message) for w in caught)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE")
    assert gpu_memory.configure_gpu_memory() is False
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
