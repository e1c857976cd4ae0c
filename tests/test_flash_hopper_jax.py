"""`flash_hopper` (jax_core/flash_hopper.py): the Hopper Mosaic GPU kernels as a differentiable JAX
function and a registered implementation.

The function's out, LSE and gradients (q, k, v, sinks; an LSE cotangent included) are checked against
the float64 oracle of tests/attention_reference.py: compiled on an sm90 GPU, in Mosaic GPU's interpret
mode on a CPU (tests/mosaic_gpu_mode.py). The jitted value-and-gradient lowers to the two Mosaic GPU
kernels for CUDA without a GPU. The registry tests check names, refusals and that automatic selection
never picks it.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle is written in torch")
jax = pytest.importorskip("jax")
# jaxattn before mosaic_gpu_mode, which starts JAX's backends (jaxattn sets its memory options first)
from jaxattn.jax_core import (  # noqa: E402
    MODE_PRIORITIES, PRIORITIES, AttentionInputs, AttentionMetadata, AttentionRegistry, attention)
from jaxattn.jax_core import flash_hopper as flash_hopper_module  # noqa: E402
from jaxattn.jax_core.flash_hopper import flash_hopper_attention  # noqa: E402

from mosaic_gpu_mode import MODE, fresh_interpreter, interpret_params, pytestmark  # noqa: E402,F401

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from attention_reference import assert_close_finite, assert_dtype_rule, from_bthd, reference  # noqa: E402

TORCH_DTYPES = {jnp.float16: torch.float16, jnp.bfloat16: torch.bfloat16}


def _oracle(q, k, v, do, dlse, sinks, dtype, **kw):
    """(out, lse, grads (dq, dk, dv, dsinks or None)) of loss = sum(out * do) + sum(lse * dlse) by the
    reference in `dtype` (float64: the oracle; a low precision: torch's own same-dtype error)."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    extra = [] if sinks is None else [sinks.detach().to(dtype).requires_grad_(True)]
    out, lse = reference(*leaves, dtype=dtype, sinks=extra[0] if extra else None, **kw)
    loss = (out * do.to(dtype)).sum() + (lse * dlse.to(dtype)).sum()
    grads = torch.autograd.grad(loss, leaves + extra)
    return out.detach(), lse.detach(), (*grads[:3], grads[3] if extra else None)


def _inputs(gen, b, l, s, hq, hk, d, dtype):
    """Fresh float64 (B, H, T, D) q, k, v, do exactly representable in `dtype`, and an LSE cotangent."""
    q, do = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dlse = torch.randn(b, hq, l, generator=gen, dtype=torch.float64)
    return [x.to(TORCH_DTYPES[dtype]).double() for x in (q, k, v, do)] + [dlse]


def _jax(t, dtype):
    """A (B, H, T, D) torch tensor as a (B, T, H, D) JAX array of `dtype`."""
    return jnp.asarray(t.transpose(1, 2).float().numpy(), dtype)


def _numpy(x):
    return np.array(jnp.asarray(x, jnp.float32))  # a writable copy, for torch.from_numpy


def _check(got_out, got_lse, got_grads, want, low, dtype, softcap, l):
    """The kernels' out (B, T, H, D), lse, and grads (BTHD dq, dk, dv, then dsinks) against the oracle."""
    # On the GPU the soft cap's tanh is tanh.approx.f32 (relative error < 2**-10.9); the interpreter's is exact.
    slack = softcap * 2.0 ** -10 if softcap is not None and MODE == "gpu" else 0.0
    floor = 4e-3 if dtype == jnp.bfloat16 else 1e-3
    assert_dtype_rule("out", from_bthd(_numpy(got_out)), want[0], low[0].double(), floor=floor + 10 * slack)
    assert_close_finite("lse", torch.from_numpy(_numpy(got_lse)).double(), want[1], tol=1e-5 + slack)
    floor = (2e-2 if dtype == jnp.bfloat16 else 4e-3) * (2 if slack else 1)
    for name, ours, oracle, theirs in zip(("dq", "dk", "dv"), got_grads, want[2], low[2]):
        assert ours.dtype == dtype, f"{name}: dtype {ours.dtype}, expected the inputs' {dtype}"
        assert_dtype_rule(name, from_bthd(_numpy(ours)), oracle, theirs.double(), floor=floor)
    if want[2][3] is not None:
        dsinks = torch.from_numpy(np.array(got_grads[3], np.float64))
        assert_dtype_rule("dsinks", dsinks, want[2][3], low[2][3].double(), floor=floor)


# (B, L, S, Hq, Hk, D, keywords, dtype): awkward lengths (L = 97, S = 130: no whole tile), L != S.
CASES = [
    pytest.param(1, 97, 130, 4, 2, 64, dict(causal=True), jnp.float16, id="causal-top-left-gqa"),
    pytest.param(1, 97, 130, 2, 2, 64, dict(causal=True, alignment="bottom_right"), jnp.bfloat16,
                 id="causal-bottom-right-l<s-bf16"),
    pytest.param(1, 97, 130, 2, 1, 64, dict(window=(20, 8), alignment="bottom_right"), jnp.float16,
                 id="window-two-sided-br-gqa"),
    pytest.param(1, 97, 130, 2, 2, 128, dict(softcap=4.0, causal=True), jnp.bfloat16, id="softcap-causal-d128-bf16"),
    pytest.param(2, 97, 130, 4, 2, 64, dict(window=(30, -1), sinks=True), jnp.float16, id="sinks-window-gqa"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, d, kw, dtype", CASES)
def test_value_and_gradients_against_float64_oracle(b, l, s, hq, hk, d, kw, dtype):
    kw = dict(kw)
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))  # fresh each run
    q, k, v, do, dlse = _inputs(gen, b, l, s, hq, hk, d, dtype)
    with_sinks = kw.pop("sinks", False)
    sinks = (torch.rand(hq, generator=gen, dtype=torch.float64) * 4 - 1).float().double() if with_sinks else None
    scale = 0.8 / d ** 0.5  # not the default: the scale given must be the one used
    alignment = kw.pop("alignment", "top_left")
    oracle_kw = dict(kw, alignment=alignment, scale=scale)
    want = _oracle(q, k, v, do, dlse, sinks, torch.float64, **oracle_kw)
    low = _oracle(q, k, v, do, dlse, sinks, TORCH_DTYPES[dtype], **oracle_kw)

    settings = dict(scale=scale, causal=kw.get("causal", False), diag_offset=s - l if alignment == "bottom_right" else 0,
                    window=kw.get("window"), softcap=kw.get("softcap"), interpret=interpret_params())
    fn = functools.partial(flash_hopper_attention, **settings)
    jsinks = None if sinks is None else jnp.asarray(sinks.numpy(), jnp.float32)
    (out, lse), vjp = jax.vjp(fn, _jax(q, dtype), _jax(k, dtype), _jax(v, dtype), jsinks)
    grads = vjp((_jax(do, dtype), jnp.asarray(dlse.numpy(), jnp.float32)))
    assert out.shape == (b, l, hq, d) and out.dtype == dtype and lse.shape == (b, hq, l) and lse.dtype == jnp.float32
    _check(out, lse, grads, want, low, dtype, kw.get("softcap"), l)


def test_head_dim_256_against_float64_oracle():
    """Head dim 256 (the backward whose warpgroups share an item's keys and split its columns): out,
    LSE and the gradients of q, k, v match the oracle."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    b, l, s, hq, hk, d, dtype = 1, 97, 130, 2, 1, 256, jnp.bfloat16
    q, k, v, do, dlse = _inputs(gen, b, l, s, hq, hk, d, dtype)
    oracle_kw = dict(causal=True, alignment="bottom_right", scale=0.05)
    want = _oracle(q, k, v, do, dlse, None, torch.float64, **oracle_kw)
    low = _oracle(q, k, v, do, dlse, None, TORCH_DTYPES[dtype], **oracle_kw)
    fn = functools.partial(flash_hopper_attention, scale=0.05, causal=True, diag_offset=s - l,
                           interpret=interpret_params())
    out, lse = fn(_jax(q, dtype), _jax(k, dtype), _jax(v, dtype))
    assert_dtype_rule("out", from_bthd(_numpy(out)), want[0], low[0].double(), floor=4e-3)
    assert_close_finite("lse", torch.from_numpy(_numpy(lse)).double(), want[1], tol=1e-5)
    _, vjp = jax.vjp(fn, _jax(q, dtype), _jax(k, dtype), _jax(v, dtype))
    grads = vjp((_jax(do, dtype), jnp.asarray(dlse.numpy(), jnp.float32)))
    for name, got, ref, theirs in zip(("dq", "dk", "dv"), grads, want[2][:3], low[2][:3]):
        assert_dtype_rule(name, from_bthd(_numpy(got)), ref, theirs.double(), floor=2e-2)


def test_registered_implementation_runs_the_kernels(monkeypatch):
    """`attention(..., implementation="flash_hopper")` on a (B, H, T, D) call: the call's scale,
    bottom-right window and sinks reach the kernels (interpreted here; `compute` compiles for the GPU),
    out comes back in the call's layout, the LSE on request, gradients through `jax.vjp`."""
    kernels = flash_hopper_module.flash_hopper_attention
    monkeypatch.setattr(flash_hopper_module, "flash_hopper_attention",
                        lambda *a, interpret, **kw: kernels(*a, interpret=interpret_params(), **kw))
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    b, l, s, hq, hk, d, dtype = 1, 97, 130, 4, 2, 64, jnp.float16
    q, k, v, do, dlse = _inputs(gen, b, l, s, hq, hk, d, dtype)
    sinks = (torch.rand(hq, generator=gen, dtype=torch.float64) * 4 - 1).float().double()
    oracle_kw = dict(causal=True, window=(40, -1), alignment="bottom_right", scale=0.1)
    want = _oracle(q, k, v, do, dlse, sinks, torch.float64, **oracle_kw)
    low = _oracle(q, k, v, do, dlse, sinks, torch.float16, **oracle_kw)
    md = AttentionMetadata(platform="gpu", backend="cuda", softmax_scale=0.1)

    def run(q, k, v, sinks):
        res = attention(q, k, v, softmax_aux=sinks, causal=True, causal_alignment="bottom_right",
                        sliding_window=(40, -1), return_lse=True, layout="BHTD", implementation="flash_hopper",
                        metadata=md)
        return res.attention_outputs, res.lse

    bhtd = [jnp.asarray(x.float().numpy(), dtype) for x in (q, k, v)]
    (out, lse), vjp = jax.vjp(run, *bhtd, jnp.asarray(sinks.numpy(), jnp.float32))
    grads = vjp((jnp.asarray(do.float().numpy(), dtype), jnp.asarray(dlse.numpy(), jnp.float32)))
    assert out.shape == (b, hq, l, d)  # the call's layout
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  (_check takes (B, T, H, D))
    _check(swap(out), lse, [swap(g) for g in grads[:3]] + [grads[3]], want, low, dtype, None, l)


@pytest.mark.parametrize("d", [64, 128])
def test_value_and_grad_lowers_for_cuda(d):
    """The jitted value and gradient lower (no GPU needed) to exactly two Mosaic GPU kernels, the
    forward and the backward, with the tuned tiles at both head dims and every feature compiled in."""
    q = jax.ShapeDtypeStruct((1, 97, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 130, 2, d), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32)

    def loss(q, k, v, sinks):
        out, lse = flash_hopper_attention(q, k, v, sinks, scale=0.1, causal=True, diag_offset=33, window=(40, -1),
                                          softcap=5.0)
        return out.astype(jnp.float32).sum() + lse.sum()

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    text = step.trace(q, k, k, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 2


# ----------------------------------------------------------------------------------------------
# the registry
# ----------------------------------------------------------------------------------------------


def _inputs_of(platform="gpu", backend="cuda", d=128, dtype=jnp.bfloat16, **features):
    shape = jax.ShapeDtypeStruct
    return AttentionInputs.from_arrays(shape((2, 256, 8, d), dtype), shape((2, 256, 2, d), dtype),
                                       shape((2, 256, 2, d), dtype), platform=platform, backend=backend, **features)


def test_name_and_alias_resolve():
    impl = AttentionRegistry.get("flash_hopper")
    assert AttentionRegistry.get("flash_mgpu") is impl and impl.canonical_name() == "flash_hopper"
    assert "flash_hopper" in AttentionRegistry.canonical_names()


def test_supported_call_has_no_reasons_here():
    """A bf16 head-dim-128 CUDA call with every declared feature, and one at head dim 256: nothing
    against them on this machine (a CPU, where no device check applies, or a Hopper GPU)."""
    features = dict(causal=True, causal_alignment="bottom_right", sliding_window=(64, -1), logits_soft_cap=3.0,
                    softmax_aux=object(), return_lse=True, backward=True)
    assert AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of(**features)) == []
    assert AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of(d=256, **features)) == []


@pytest.mark.parametrize("inputs, names", [
    (dict(platform="cpu", backend="cpu"), ["platform 'cpu'", "backend 'cpu'"]),
    (dict(backend="rocm"), ["backend 'rocm'"]),
    (dict(d=80), ["head_dim=80"]),
    (dict(dtype=jnp.float32), ["dtype float32"]),
    (dict(mask=object()), ["feature 'bool_mask'"]),
    (dict(bias=object(), dropout=True), ["feature 'bias'", "feature 'dropout'"]),
])
def test_refusals_name_what_is_wrong(inputs, names):
    reasons = AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of(**inputs))
    for name in names:
        assert any(name in r for r in reasons), f"{name!r} not in {reasons}"


def test_refuses_another_gpu_generation_and_a_mesh(monkeypatch):
    mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
    reasons = AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of(), AttentionMetadata(mesh=mesh))
    assert any("mesh" in r for r in reasons), reasons

    class Ampere:
        compute_capability = "8.0"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [Ampere()])
    reasons = AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of())
    assert any("compute capability '8.0'" in r and "'9.0'" in r for r in reasons), reasons


def test_refuses_without_mosaic_gpu(monkeypatch):
    monkeypatch.setattr(flash_hopper_module, "_mosaic_gpu_import_error", lambda: "ImportError: no absl")
    reasons = AttentionRegistry.get("flash_hopper").not_supported_reasons(_inputs_of())
    assert any("Mosaic GPU cannot be imported (ImportError: no absl)" in r for r in reasons), reasons


def test_several_sinks_per_head_are_refused_with_a_hint():
    q = jnp.zeros((1, 97, 2, 64), jnp.float16)
    k = jnp.zeros((1, 130, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"softmax_aux of shape \(2, 3\).*shape \(Hq,\); hint"):
        attention(q, k, k, softmax_aux=jnp.zeros((2, 3)), implementation="flash_mgpu",
                  metadata=AttentionMetadata(platform="gpu", backend="cuda"))


@pytest.mark.parametrize("inputs", [
    dict(),
    dict(causal=True, backward=True),
    dict(causal=True, causal_alignment="bottom_right", sliding_window=(64, -1), logits_soft_cap=3.0,
         softmax_aux=object(), return_lse=True),
])
def test_automatic_selection_never_picks_it(inputs):
    """Not in any selection order: even a call it could run (on a Hopper GPU) goes elsewhere."""
    assert all("flash_hopper" not in order and "flash_mgpu" not in order for order in PRIORITIES.values())
    assert all("flash_hopper" not in order for modes in MODE_PRIORITIES.values() for order in modes.values())
    impl, why = AttentionRegistry.select_with_reason(_inputs_of(**inputs))
    assert impl.canonical_name() != "flash_hopper" and "flash_hopper" not in why, why
