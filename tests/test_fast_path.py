"""The per-call fast path of jaxattn.bridge and the drop-in SDPA: eager calls run the compiled
executable directly (no custom-op dispatch), per-signature work is memoised, and none of it may
change a result, a gradient, an error, autograd's checks or the cache's bookkeeping.

Oracles: torch ops computing the same function, torch's math SDPA, and the custom-op path (the
general path torch.compile and opcheck use) for bit-equality of the two paths.
"""

from __future__ import annotations

import threading

import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

import jaxattn.bridge as bridge
from jaxattn.bridge import JaxOp, dlpack, jax_op, prepared_call
from jaxattn.torch_api import scaled_dot_product_attention, set_finite_check
from jaxattn.torch_api import sdpa as sdpa_module


@jax_op(name="tests.test_fast_path.mix")
def mix(x, b, w, *, alpha):
    out = jnp.tanh(alpha * x) * w
    return out if b is None else out + jnp.sin(b)


def mix_torch(x, b, w, *, alpha):
    out = torch.tanh(alpha * x) * w
    return out if b is None else out + torch.sin(b)


@jax_op(name="tests.test_fast_path.pair", num_outputs=2)
def pair(x, y):
    return x * jnp.exp(y), jnp.cos(x) - y


@jax_op(name="tests.test_fast_path.static_kind")
def static_kind(x, *, k):
    # the result tells which Python type k had: 1, 1.0 and True hash alike but must not share a prepared call
    marker = 3.0 if isinstance(k, bool) else 2.0 if isinstance(k, int) else 1.0
    return x * 0 + marker


@jax_op(name="tests.test_fast_path.residual_heavy")
def residual_heavy(x, w):
    return jnp.sum(jnp.exp(x[:, :, None] * w[None, :, :]), axis=1)


def residual_heavy_torch(x, w):
    return torch.exp(x[:, :, None] * w[None, :, :]).sum(1)


class _SeeJaxCalls(TorchDispatchMode):
    """Counts custom-op calls (an active dispatch mode also sends calls down the general path)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.jaxattn.jax_call.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _general(fn, *args, **kwargs):
    """Runs `fn` through the custom op (the path torch.compile and opcheck see)."""
    with _SeeJaxCalls() as seen:
        out = fn(*args, **kwargs)
    assert seen.calls >= 1
    return out


def _fresh(*tensors, grad=True):
    return [t.detach().clone().requires_grad_(grad and t.dtype.is_floating_point) for t in tensors]


@pytest.fixture
def count_direct(monkeypatch):
    """Counts executions of the direct (custom-op free) forward."""
    counter = {"n": 0}
    original = prepared_call.PreparedCall.run

    def run(self, tensors, keep):
        counter["n"] += 1
        return original(self, tensors, keep)

    monkeypatch.setattr(prepared_call.PreparedCall, "run", run)
    return counter


# --- the fast path is taken and agrees with the general path -------------------------------------


def test_prepare_runs_calls_of_its_signature_and_plan_is_its_deprecated_name():
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen)
    want = mix_torch(x, None, w, alpha=0.7)
    prepared = mix.prepare(x, None, w, alpha=0.7)
    assert isinstance(prepared, prepared_call.PreparedCall)
    torch.testing.assert_close(prepared(x, None, w), want)
    with pytest.warns(DeprecationWarning, match=r"JaxOp.plan is deprecated: use .prepare"):
        old = mix.plan(x, None, w, alpha=0.7)
    torch.testing.assert_close(old(x, None, w), want)



def test_eager_call_skips_custom_op_and_matches_torch(count_direct):
    g = torch.Generator().manual_seed(0)
    x, b, w = (torch.randn(6, 7, generator=g) for _ in range(3))
    out = mix(x, b, w, alpha=0.7)
    assert count_direct["n"] == 1
    torch.testing.assert_close(out, mix_torch(x, b, w, alpha=0.7))
    assert not out.requires_grad and out.grad_fn is None


@pytest.mark.parametrize("with_bias", [True, False])
def test_fast_and_general_paths_agree_bitwise_with_grads(with_bias):
    g = torch.Generator().manual_seed(1)
    x, b, w = (torch.randn(5, 9, generator=g) for _ in range(3))
    dout = torch.randn(5, 9, generator=g)
    results = []
    for run in (lambda *a, **k: mix(*a, **k), lambda *a, **k: _general(mix, *a, **k)):
        xs, bs, ws = _fresh(x, b, w)
        out = run(xs, bs if with_bias else None, ws, alpha=1.3)
        out.backward(dout)
        results.append([out.detach(), xs.grad, ws.grad] + ([bs.grad] if with_bias else []))
    fast, general = results
    for a, c in zip(fast, general):
        assert torch.equal(a, c)
    xs, bs, ws = _fresh(x, b, w)
    ref = mix_torch(xs, bs if with_bias else None, ws, alpha=1.3)
    ref.backward(dout)
    torch.testing.assert_close(fast[0], ref.detach())
    torch.testing.assert_close(fast[1], xs.grad)
    torch.testing.assert_close(fast[2], ws.grad)


def test_eager_autograd_node_is_the_direct_function():
    x, w = torch.randn(4, 3, requires_grad=True), torch.randn(4, 3)
    out = mix(x, None, w, alpha=0.5)
    assert type(out.grad_fn).__name__ == "_EagerCallBackward"
    out.sum().backward()
    torch.testing.assert_close(x.grad, 0.5 * (1 - torch.tanh(0.5 * x.detach()) ** 2) * w)


def test_two_outputs_partial_cotangent_and_broadcast_argument():
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3, 1, generator=g, requires_grad=True)
    x = base.expand(3, 4)  # broadcast: narrowed before the call, its gradient summed by autograd
    y = torch.randn(3, 4, generator=g, requires_grad=True)
    a, _ = pair(x, y)
    a.sum().backward()  # the second output gets no cotangent
    base_t, y_t = base.detach().clone().requires_grad_(), y.detach().clone().requires_grad_()
    (base_t.expand(3, 4) * torch.exp(y_t)).sum().backward()
    torch.testing.assert_close(base.grad, base_t.grad)
    torch.testing.assert_close(y.grad, y_t.grad)


def test_static_arguments_of_equal_hash_get_their_own_prepared_calls():
    x = torch.ones(3)
    for k, marker in ((1, 2.0), (1.0, 1.0), (True, 3.0), (1, 2.0), ((1, 2), 1.0)):
        torch.testing.assert_close(static_kind(x, k=k), torch.full((3,), marker))


def test_signature_changes_take_new_prepared_calls_with_right_results():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 8, generator=g)
    x = torch.randn(8, 8, generator=g)
    variants = [
        x,
        x.t(),  # same shape, other strides: copied before the import
        torch.randn(65, generator=g)[1:].reshape(8, 8),  # storage 4 bytes past 16-byte alignment
        x.double(),
        x.clone().requires_grad_(),
    ]
    for v in variants:
        out = mix(v, None, w.to(v.dtype), alpha=0.9)
        torch.testing.assert_close(out, mix_torch(v.detach(), None, w.to(v.dtype), alpha=0.9))
        assert out.dtype == v.dtype
    with torch.no_grad():
        out = mix(variants[-1], None, w, alpha=0.9)
    assert not out.requires_grad


def test_inference_mode_tensors():
    with torch.inference_mode():
        x, w = torch.randn(4, 4), torch.randn(4, 4)
        torch.testing.assert_close(mix(x, None, w, alpha=0.3), mix_torch(x, None, w, alpha=0.3))


def test_public_dlpack_fallback_gives_the_same_results():
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(5, 6, generator=g, requires_grad=True), torch.randn(5, 6, generator=g)
    fast = mix(x, None, w, alpha=0.4)
    (dx_fast,) = torch.autograd.grad(fast.sum(), x)
    previous = dlpack.set_fast_dlpack(False)
    try:
        slow = mix(x, None, w, alpha=0.4)
        (dx_slow,) = torch.autograd.grad(slow.sum(), x)
        (a,) = bridge.to_jax([x])
        assert a.unsafe_buffer_pointer() == x.data_ptr()
    finally:
        dlpack.set_fast_dlpack(previous)
    assert torch.equal(fast, slow) and torch.equal(dx_fast, dx_slow)


# --- autograd semantics --------------------------------------------------------------------------


def test_inplace_change_of_an_input_after_forward_is_caught():
    x = torch.randn(6, 3, requires_grad=True)
    h = x * 2
    out = mix(h, None, torch.randn(6, 3), alpha=1.0)
    h.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_retain_graph_and_second_backward():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 5, generator=g, requires_grad=True), torch.randn(5, 3, generator=g, requires_grad=True)
    out = residual_heavy(x, w)
    assert out.grad_fn.arrays is not None
    out.sum().backward(retain_graph=True)
    first = (x.grad.clone(), w.grad.clone())
    assert out.grad_fn.arrays is not None  # kept for the next backward
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first[0])
    torch.testing.assert_close(w.grad, 2 * first[1])
    assert out.grad_fn.arrays is None  # released, as torch frees saved tensors
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    residual_heavy_torch(xr, wr).sum().backward()
    torch.testing.assert_close(first[0], xr.grad)
    torch.testing.assert_close(first[1], wr.grad)


def test_double_backward_matches_torch_not_silently_zero():
    """create_graph=True on the fast path gives gradients torch can differentiate again, including
    through a gradient output that itself requires grad."""
    g = torch.Generator().manual_seed(9)
    x0, w = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    ct0 = torch.randn(3, 4, generator=g, dtype=torch.float64)
    results = []
    for fn in (mix, mix_torch):
        x, ct = x0.clone().requires_grad_(True), ct0.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(fn(x, None, w, alpha=1.5), x, ct, create_graph=True)
        results.append((gx,) + torch.autograd.grad((gx ** 2).sum(), [x, ct]))
    for ours, ref in zip(*results):
        assert ours.abs().sum() > 0
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)


def test_saved_tensor_hooks_see_every_saved_tensor():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(4, 5, generator=g, requires_grad=True), torch.randn(5, 3, generator=g, requires_grad=True)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t.clone()  # the backward must work from what the hook returns

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = residual_heavy(x, w)
    assert out.grad_fn.arrays is None
    assert len(packed) >= 3  # two inputs and the output, plus residuals
    out.sum().backward()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    residual_heavy_torch(xr, wr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


def test_activation_checkpointing():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 11, 8, generator=g, requires_grad=True) for _ in range(3))

    def block(q, k, v):
        return scaled_dot_product_attention(q * 1.5, k, v, is_causal=True).square()

    out = torch.utils.checkpoint.checkpoint(block, q, k, v, use_reentrant=False)
    out.sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(leaves[0] * 1.5, *leaves[1:], is_causal=True).square().sum().backward()
    for a, b in zip((q, k, v), leaves):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=1e-5)


# --- cache bookkeeping ----------------------------------------------------------------------------


def _probe(x, *, k):
    return x * k


_cache_probe = JaxOp(_probe, name="tests.test_fast_path.cache_probe")


def test_first_call_compiles_once_and_reports_time_then_hits():
    x = torch.randn(17, 3)
    before = bridge.cache_info()
    _cache_probe(x, k=2.0)
    first = bridge.cache_info()
    assert first.misses == before.misses + 1
    assert first.last_compile_time_s > 0 and first.compile_time_s >= before.compile_time_s + first.last_compile_time_s
    for _ in range(5):
        _cache_probe(torch.randn(17, 3), k=2.0)
    after = bridge.cache_info()
    assert after.misses == first.misses and after.hits == first.hits + 5
    assert after.compile_time_s == first.compile_time_s


def test_forward_and_backward_each_compile_once():
    x = torch.randn(19, 2, requires_grad=True)
    before = bridge.cache_info()
    for _ in range(3):
        _cache_probe(x, k=3.0).sum().backward()
    after = bridge.cache_info()
    assert after.misses == before.misses + 2  # one forward, one backward executable
    assert after.hits == before.hits + 4
    torch.testing.assert_close(x.grad, torch.full((19, 2), 9.0))


def test_cache_bound_holds_on_the_fast_path():
    info = bridge.cache_info()
    try:
        bridge.set_cache_size(1)
        a, b = torch.randn(23, 2), torch.randn(23, 5)
        _cache_probe(a, k=1.5)
        _cache_probe(b, k=1.5)
        misses = bridge.cache_info().misses
        out = _cache_probe(a, k=1.5)  # evicted by b's executable: rebuilt although its prepared call is memoised
        assert bridge.cache_info().misses == misses + 1 and bridge.cache_info().size == 1
        torch.testing.assert_close(out, a * 1.5)
    finally:
        bridge.set_cache_size(info.maxsize)


def test_clear_cache_resets_counters_and_prepared_calls():
    _cache_probe(torch.randn(29, 2), k=1.0)
    bridge.clear_cache()
    info = bridge.cache_info()
    assert (info.hits, info.misses, info.size, info.compile_time_s) == (0, 0, 0, 0.0)
    assert not _cache_probe._prepared
    torch.testing.assert_close(_cache_probe(torch.ones(29, 2), k=4.0), torch.full((29, 2), 4.0))
    assert bridge.cache_info().misses == 1


# --- the drop-in's per-signature memo ---------------------------------------------------------------


def _math(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def test_sdpa_memo_keeps_checks_and_results_per_signature():
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 4, 13, 8, generator=g) for _ in range(3))
    for _ in range(2):
        torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True), _math(q, k, v, is_causal=True))
    # same shapes, an argument of the wrong type: the memo must not let it through
    with pytest.raises(TypeError, match="is_causal=1"):
        scaled_dot_product_attention(q, k, v, is_causal=1)
    with pytest.raises(TypeError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=True)
    # a NaN in a tensor whose signature is memoised is still found (the check is per call on CPU)
    bad = q.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="query: contains NaN"):
        scaled_dot_product_attention(bad, k, v, is_causal=True)
    set_finite_check("off")
    try:
        scaled_dot_product_attention(bad, k, v, is_causal=True)
    finally:
        set_finite_check("cpu")


def test_finite_check_finds_every_kind_of_bad_value_in_one_pass():
    from jaxattn.torch_api.validation import AttentionInputError, check_finite

    g = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        q, k, v = (torch.randn(2, 3, 5, 4, generator=g).to(dtype) for _ in range(3))
        mask = torch.randn(5, 5, generator=g).to(dtype)
        mask[0, 1], mask[2, 2] = float("-inf"), float("inf")  # legal additive values
        check_finite({"query": q, "key": k, "value": v, "attn_mask": mask})
        for name, bad in (("value", float("-inf")), ("key", float("inf")), ("query", float("nan"))):
            tensors = {"query": q, "key": k, "value": v, "attn_mask": mask}
            t = tensors[name].clone()
            t[1, 2, 3, 0] = bad
            tensors[name] = t
            with pytest.raises(AttentionInputError, match=f"{name}: contains NaN or inf values at 1 position"):
                check_finite(tensors)
        mask[4, 4] = float("nan")
        with pytest.raises(AttentionInputError, match="attn_mask: contains NaN values at 1 position"):
            check_finite({"query": q, "key": k, "value": v, "attn_mask": mask})


def test_sdpa_memo_tells_views_and_grad_modes_apart():
    g = torch.Generator().manual_seed(9)
    base = torch.randn(2, 13, 4, 8, generator=g)
    q = base.transpose(1, 2)  # (2, 4, 13, 8) non-contiguous view
    k, v = (torch.randn(2, 4, 13, 8, generator=g) for _ in range(2))
    want = _math(q, k, v)
    torch.testing.assert_close(scaled_dot_product_attention(q.contiguous(), k, v), want)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v), want)
    qg = q.detach().clone().requires_grad_()
    out = scaled_dot_product_attention(qg, k, v)
    assert out.requires_grad
    with torch.no_grad():
        assert not scaled_dot_product_attention(qg, k, v).requires_grad
    mask = torch.rand(13, 13, generator=g) > 0.3
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, attn_mask=mask), _math(q, k, v, attn_mask=mask))
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None].expand(2, 4, 13, 13)),
        _math(q, k, v, attn_mask=mask),
    )


def test_sdpa_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(sdpa_module, "MAX_PREPARED", 2)
    sdpa_module._prepared.clear()
    g = torch.Generator().manual_seed(10)
    for n in (5, 6, 7, 5):
        q = torch.randn(1, 2, n, 8, generator=g)
        torch.testing.assert_close(scaled_dot_product_attention(q, q, q), _math(q, q, q))
        assert len(sdpa_module._prepared) <= 2


def test_sdpa_dispatch_mode_takes_the_custom_op():
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    out = _general(scaled_dot_product_attention, q, k, v, is_causal=True)
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, is_causal=True))


def test_threads_share_prepared_calls_safely():
    g = torch.Generator().manual_seed(12)
    inputs = [[torch.randn(2, 4, 21, 8, generator=g, requires_grad=True) for _ in range(3)] for _ in range(4)]
    results, errors = [None] * 4, []

    def work(i):
        try:
            q, k, v = inputs[i]
            for _ in range(5):
                out = scaled_dot_product_attention(q, k, v, is_causal=True)
                grads = torch.autograd.grad(out.sum(), (q, k, v))
            results[i] = (out.detach(), grads)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (q, k, v), (out, grads) in zip(inputs, results):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = _math(*leaves, is_causal=True)
        ref_grads = torch.autograd.grad(ref.sum(), leaves)
        torch.testing.assert_close(out, ref.detach(), atol=2e-5, rtol=1e-5)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


# --- CUDA: one handshake per call keeps stream order (skipped without a GPU) --------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_backward_on_a_side_stream_is_ordered():
    side = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = torch.zeros((), device="cuda")
    for _ in range(200):
        with torch.cuda.stream(side):
            q, k, v = (torch.randn(1, 4, 128, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            leaves = [(x * 1.25).requires_grad_() for x in (q, k, v)]
            out = scaled_dot_product_attention(*leaves, is_causal=True)
            dout = torch.randn_like(out) * 3  # written right before the backward reads it
            grads = torch.autograd.grad(out, leaves, dout)
            ref_leaves = [x.detach().requires_grad_() for x in leaves]
            ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=True)
            ref_grads = torch.autograd.grad(ref, ref_leaves, dout)
            for a, b in zip(grads, ref_grads):
                worst = torch.maximum(worst, (a.float() - b.float()).abs().max())
    torch.cuda.synchronize()
    assert worst.item() < 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_threads_with_their_own_streams():
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [[torch.randn(1, 4, 128, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for _ in range(4)]
    torch.cuda.synchronize()
    worst, errors = [0.0] * 4, []

    def work(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(100):
                    q, k, v = (x * 2 for x in data[i])
                    out = scaled_dot_product_attention(q, k, v, is_causal=True)
                    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    worst[i] = max(worst[i], (out.float() - ref.float()).abs().max().item())
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and max(worst) < 0.05


# --- JAX's persistent compilation cache ----------------------------------------------------------------

_PERSISTENT = """
import sys, jax, torch
import jaxattn.bridge as bridge
hits = []
jax.monitoring.register_event_listener(lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
bridge.enable_persistent_cache(sys.argv[1])
from jaxattn.torch_api import scaled_dot_product_attention
q = torch.randn(1, 2, 37, 8, generator=torch.Generator().manual_seed(0))
out = scaled_dot_product_attention(q, q, q, is_causal=True)
print(len(hits), repr(out.sum().item()))
"""


@pytest.mark.thorough  # two fresh processes, each importing jax and torch and compiling
def test_persistent_cache_is_reused_by_a_restarted_process(tmp_path):
    import subprocess
    import sys

    def run():
        res = subprocess.run([sys.executable, "-c", _PERSISTENT, str(tmp_path / "jax_cache")], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        hits, total = res.stdout.split()[-2:]
        return int(hits), total

    first_hits, first_total = run()
    assert first_hits == 0 and any((tmp_path / "jax_cache").iterdir())
    second_hits, second_total = run()
    assert second_hits >= 1 and second_total == first_total


def test_persistent_cache_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="min_compile_time_s=-1"):
        bridge.enable_persistent_cache(tmp_path, min_compile_time_s=-1)
