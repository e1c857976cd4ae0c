"""The `flash` TPU path (JAX's Pallas TPU flash kernel) in Pallas TPU interpret mode on the CPU,
against the float64-checked `vanilla` reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pltpu = pytest.importorskip("jax.experimental.pallas.tpu")

from jaxattn.jax_core import AttentionMetadata, attention  # noqa: E402

TPU = AttentionMetadata(platform="tpu", backend="tpu")


def _inputs(seed, t=128, s=128, h=2, d=64):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (1, t, h, d), jnp.float32)
    k = jax.random.normal(ks[1], (1, s, h, d), jnp.float32)
    v = jax.random.normal(ks[2], (1, s, h, d), jnp.float32)
    bias = jax.random.normal(ks[3], (1, h, t, s), jnp.float32)
    return q, k, v, bias


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
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
    ref = attention(q, k, v, causal=causal, bias=bias, implementation="vanilla").attention_outputs
    ref_grads = jax.grad(loss("vanilla", None), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
    for g, rg in zip(grads, ref_grads):
        np.testing.assert_allclose(g, rg, atol=5e-5, rtol=5e-5)


def test_tpu_reasons_for_unsupported_features():
    q, k, v, _ = _inputs(0)
    with pytest.raises(NotImplementedError, match="softcap.*TPU|TPU.*softcap"):
        attention(q, k, v, logits_soft_cap=3.0, implementation="flash", metadata=TPU)
    q_short = q[:, :100]
    with pytest.raises(ValueError, match="multiples of 128"):
        attention(q_short, k, v, implementation="flash", metadata=TPU)
