"""jaxattn.testing: the parity kit on its own (planted errors, tolerances, reports, callables)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxattn.testing import (
    TOLERANCES, assert_close, compare, compare_callables, compare_to_reference, rounding_floor, to_numpy,
)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_torch_vs_jax_same_values_pass():
    t = _randn(3, 5, 7)
    report = compare(t, jnp.asarray(t.numpy()))
    assert report.passed and report.max_abs_error == 0.0 and report.dtype == "float32"
    assert report.shape == (3, 5, 7)


def test_planted_error_is_located_and_measured():
    expected = _randn(4, 6, 8)
    actual = expected.clone()
    actual[2, 3, 5] += 0.25
    actual[0, 0, 0] += 1e-7  # below tolerance
    report = compare(jnp.asarray(actual.numpy()), expected)
    assert not report.passed and report.num_failing == 1
    assert report.worst_index == (2, 3, 5)
    assert report.max_abs_error == pytest.approx(0.25, rel=1e-6)
    assert report.actual_at_worst == pytest.approx(float(actual[2, 3, 5]))
    assert report.expected_at_worst == pytest.approx(float(expected[2, 3, 5]))
    want_mean = (actual.double() - expected.double()).abs().mean().item()
    assert report.mean_abs_error == pytest.approx(want_mean, rel=1e-6)
    atol, rtol = TOLERANCES["float32"]
    assert report.worst_ratio == pytest.approx(0.25 / (atol + rtol * abs(float(expected[2, 3, 5]))), rel=1e-4)
    text = str(report)
    assert "FAIL" in text and "(2, 3, 5)" in text and "1 of 192 elements" in text


def test_tolerance_follows_the_lower_precision():
    x = _randn(64)
    bf = x.to(torch.bfloat16)
    report = compare(bf, x)  # bfloat16 rounding only: passes at bfloat16's tolerance
    assert report.passed and report.dtype == "bfloat16"
    assert (report.atol, report.rtol) == TOLERANCES["bfloat16"]
    assert report.eps_at_scale <= 0.5 + 1e-9  # rounding to nearest: at most half an eps
    strict = compare(bf, x, dtype="float32")
    assert not strict.passed
    assert compare(bf, x, atol=0.0, rtol=0.0).num_failing == int((bf.double() != x.double()).sum())


def test_float16_jax_vs_torch():
    x = _randn(10, 10)
    report = compare(jnp.asarray(x.numpy()).astype(jnp.float16), x.half())
    assert report.passed and report.dtype == "float16" and report.max_abs_error == 0.0


def test_nonfinite_values():
    e = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    assert compare(e.clone(), e).passed  # NaN == NaN and inf == inf at the same places
    a = e.clone()
    a[3] = float("nan")
    a[2] = -float("inf")
    report = compare(a, e)
    assert not report.passed and report.nonfinite_mismatches == 2
    assert "NaN/inf on one side" in str(report)


def test_shape_mismatch_and_unknown_dtype_raise():
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*shape \(3, 2\)"):
        compare(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="no default tolerance"):
        compare(np.ones(3), np.ones(3), dtype="int8")
    with pytest.raises(TypeError, match="complex"):
        to_numpy(torch.ones(2, dtype=torch.complex64))


def test_assert_close_raises_with_the_report():
    expected = _randn(8)
    assert_close(expected + 1e-7, expected)
    with pytest.raises(AssertionError, match=r"FAIL.*\n.*max \|error\| 1\.00e-01"):
        assert_close(expected + 0.1, expected, name="output")


def test_rounding_floor_matches_the_torch_arithmetic():
    """The same rule computed with torch's own bfloat16/float16 arithmetic (flash-attn's fwd_atol)."""
    ref = _randn(32, 32) * 0.5
    for dtype in (torch.bfloat16, torch.float16):
        rounded = ref.to(dtype)
        want = 2 * (rounded + 0.3 - 0.3 - rounded).abs().max().item()
        assert rounding_floor(ref, str(dtype).replace("torch.", "")) == pytest.approx(want, rel=1e-6)


def test_compare_to_reference_rule():
    ref = _randn(16, 16).double()
    baseline = ref.to(torch.bfloat16)
    good = compare_to_reference(baseline, baseline, ref)
    assert good.passed and good.candidate_error == good.baseline_error and good.dtype == "bfloat16"
    bad_candidate = baseline.clone()
    bad_candidate[3, 4] += 0.5
    bad = compare_to_reference(bad_candidate, baseline, ref)
    assert not bad.passed and bad.worst_index == (3, 4)
    assert bad.bound == pytest.approx(2 * bad.baseline_error + bad.floor)
    assert "FAIL" in str(bad)
    with pytest.raises(AssertionError):
        bad.assert_ok()
    nan_candidate = baseline.clone()
    nan_candidate[0, 0] = float("nan")
    assert compare_to_reference(nan_candidate, baseline, ref).nonfinite == 1


def test_compare_callables_forward_and_gradients_pass():
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    suite = compare_callables(lambda x, w: torch.tanh(x @ w), lambda x, w: jnp.tanh(x @ w), x, w, names=("x", "w"))
    assert [r.name for r in suite] == ["output", "grad x", "grad w"]
    suite.assert_ok()


def test_compare_callables_catches_a_wrong_gradient_only():
    @jax.custom_vjp
    def bad_tanh(x):
        return jnp.tanh(x)

    bad_tanh.defvjp(lambda x: (jnp.tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2) * 1.01,))
    x = _randn(7, 3)
    suite = compare_callables(torch.tanh, bad_tanh, x)
    assert suite["output"].passed
    assert not suite["grad 0"].passed
    with pytest.raises(AssertionError, match="parity failed for grad 0"):
        suite.assert_ok()


def test_compare_callables_several_outputs_masks_and_float64():
    g = np.random.default_rng(2)
    a = g.standard_normal((4, 4))  # float64: JAX's x64 mode is on only for this comparison
    keep = g.random((4, 4)) < 0.5

    def t_fn(a, keep):
        return torch.where(keep, a, 0.0), a.sum(-1)

    def j_fn(a, keep):
        return jnp.where(keep, a, 0.0), a.sum(-1)

    suite = compare_callables(t_fn, j_fn, a, keep)
    assert [r.name for r in suite] == ["output[0]", "output[1]", "grad 0"]
    assert all(r.dtype == "float64" for r in suite)
    suite.assert_ok()
    assert jnp.ones(2).dtype == jnp.float32  # x64 mode was switched off again


def test_compare_callables_bfloat16_inputs():
    x = _randn(6, 6).to(torch.bfloat16)
    suite = compare_callables(lambda x: torch.softmax(x.float(), -1), lambda x: jax.nn.softmax(x.astype(jnp.float32)),
                              x)
    assert suite["output"].dtype == "float32"
    suite.assert_ok()
