"""The `flash` TPU path (JAX's Pallas TPU flash kernel) in Pallas TPU interpret mode on the CPU,
against the float64 oracle of tests/attention_reference.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

from attention_reference import from_bthd, reference, to_bthd  # noqa: E402
from thorough_grid import grid  # noqa: E402

from jaxattn.jax_core import AttentionMetadata, attention  # noqa: E402

TPU = AttentionMetadata(platform="tpu", backend="tpu")


def _oracle(q, k, v, *, bias=None, segment_ids=None, causal):
    """The float64 oracle's output and its gradients of sum(out * cos(out)) (the tests' loss), as
    (B, T, H, D) NumPy arrays."""
    leaves = [from_bthd(x).requires_grad_(True) for x in (q, k, v)]
    out, _ = reference(*leaves, causal=causal,
                       bias=None if bias is None else torch.from_numpy(np.asarray(bias, np.float64)),
                       segment_ids=None if segment_ids is None else tuple(torch.from_numpy(np.array(x))
                                                                          for x in segment_ids))
    grads = torch.autograd.grad((out * torch.cos(out)).sum(), leaves)
    return to_bthd(out), [to_bthd(g) for g in grads]


def _inputs(seed, t=128, s=128, h=2, d=64):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (1, s, h, d), jnp.float32)
    v = jax.random.normal(ks[2], (1, s, h, d), jnp.float32)
    bias = jax.random.normal(ks[3], (1, h, t, s), jnp.float32)
    return q, k, v, bias


@pytest.mark.parametrize("causal,with_bias", grid([False, True], [False, True], keep=[(True, True)]))
def test_pallas_tpu_flash_matches_reference(causal, with_bias):
    q, k, v, bias = _inputs(int(causal) * 2 + int(with_bias))
    bias = bias if with_bias else None

    def loss(impl, md):
        def f(q, k, v):
            out = attention(q, k, v, causal=causal, bias=bias, implementation=impl, metadata=md).attention_outputs
            return jnp.sum(out * jnp.cos(out))  # a non-trivial cotangent
        return f

    with pltpu.force_tpu_interpret_mode():
        out = attention(q, k, v, causal=causal, bias=bias, implementation="flash", metadata=TPU).attention_outputs
        grads = jax.grad(loss("flash", TPU), argnums=(0, 1, 2))(q, k, v)
    ref, ref_grads = _oracle(q, k, v, bias=bias, causal=causal)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=5e-5, rtol=5e-5)


def test_tpu_reasons_for_unsupported_features():
    q, k, v, _ = _inputs(0)
    with pytest.raises(NotImplementedError, match="softcap.*TPU|TPU.*softcap"):
        attention(q, k, v, logits_soft_cap=3.0, implementation="flash", metadata=TPU)
    # The kernel does not return its log-sum-exp: asking for it is refused, never answered with None.
    with pytest.raises(NotImplementedError, match="lse.*TPU|TPU.*lse"):
        attention(q, k, v, return_lse=True, implementation="flash", metadata=TPU)
    q_short = q[:, :100]
    with pytest.raises(ValueError, match="multiples of 128"):
        attention(q_short, k, v, implementation="flash", metadata=TPU)


def _segment_ids(t=256):
    """(2, t) query and key ids: 3 packed segments of unequal lengths, different boundaries for the
    keys, unsorted and non-contiguous ids, and rows with no visible key (an id no key has; under
    causal, a segment whose first key comes after the query)."""
    q0 = np.array([0] * 100 + [1] * 90 + [2] * 56 + [7] * 10)
    k0 = np.array([1] * 40 + [0] * 80 + [1] * 70 + [2] * 66)
    q1 = np.array([5] * 30 + [-2] * 130 + [3] * 96)
    k1 = np.array([-2] * 64 + [5] * 64 + [3] * 64 + [-2] * 64)
    return jnp.asarray(np.stack([q0, q1]), jnp.int32), jnp.asarray(np.stack([k0, k1]), jnp.int32)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.thorough), pytest.param(True, marks=pytest.mark.thorough)])
def test_pallas_tpu_segment_ids_match_reference(causal):
    ks = jax.random.split(jax.random.key(11 + causal), 3)
    q, k, v = (jax.random.normal(key, (2, 256, 1, 64), jnp.float32) for key in ks)
    ids = _segment_ids()

    def loss(impl, md):
        def f(q, k, v):
            out = attention(q, k, v, causal=causal, segment_ids=ids, implementation=impl, metadata=md).attention_outputs
            return jnp.sum(out * jnp.cos(out))
        return f

    with pltpu.force_tpu_interpret_mode():
        out = attention(q, k, v, causal=causal, segment_ids=ids, implementation="flash", metadata=TPU).attention_outputs
        grads = jax.grad(loss("flash", TPU), argnums=(0, 1, 2))(q, k, v)
    ref, ref_grads = _oracle(q, k, v, segment_ids=ids, causal=causal)
    dead = np.all(ref == 0, axis=(2, 3))
    assert dead.sum() == (80 if causal else 10)  # the rows with no visible key are exercised
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=5e-5, rtol=5e-5)


def test_rows_with_visible_key_matches_loops():
    from jaxattn.jax_core.flash import _rows_with_visible_key

    rng = np.random.default_rng(0)
    q_ids, kv_ids = rng.integers(-3, 4, (3, 40)), rng.integers(-3, 3, (3, 50))
    for causal in (False, True):
        want = [[any(q_ids[b, i] == kv_ids[b, j] and (j <= i or not causal) for j in range(50)) for i in range(40)]
                for b in range(3)]
        np.testing.assert_array_equal(_rows_with_visible_key(jnp.asarray(q_ids), jnp.asarray(kv_ids), causal), want)


def test_tpu_reasons_for_varlen_and_dropout():
    q, k, v, _ = _inputs(0)
    cu = jnp.array([0, 100, 128], jnp.int32)
    with pytest.raises(NotImplementedError, match="'varlen' not supported by the TPU kernel"):
        attention(q, k, v, cu_seqlens=(cu, cu), implementation="flash", metadata=TPU)
    with pytest.raises(NotImplementedError, match="'dropout' not supported by the TPU kernel"):
        attention(q, k, v, dropout_rng=jax.random.key(0), implementation="flash", metadata=TPU.replace(dropout_prob=0.1))
