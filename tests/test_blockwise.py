"""blockwise_attn and the per-block kernels of ring attention (jax_core/blockwise.py) against a
float64 torch oracle (tests/attention_reference.py), at several chunk sizes and awkward lengths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from attention_reference import assert_dtype_rule, reference, reference_grads, visibility
from thorough_grid import grid

from jaxattn.jax_core.blockwise import Band, block_backward, block_forward, blockwise_attn


def _rand(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _j(t):
    """torch (B, H, T, D) float64 -> jax (B, T, H, D) float32."""
    return jnp.asarray(t.transpose(1, 2).numpy().astype(np.float32))


def _t(x):
    """jax (B, T, H, D) -> torch (B, H, T, D) float64."""
    return torch.from_numpy(np.asarray(x, dtype=np.float64)).transpose(1, 2)


def _close(got, want, tol):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("causal,chunks", grid([False, True], [(16, 32), (32, 16), (128, 128), (7, 1024)],
                                              keep=[(True, (16, 32)), (False, (7, 1024))]))
def test_blockwise_attn_matches_reference(causal, chunks):
    gen = torch.Generator().manual_seed(10 + int(causal) + chunks[0])
    b, hq, hk, t, s, d = 2, 4, 2, 97, 97, 16
    q, k, v = _rand(gen, b, hq, t, d), _rand(gen, b, hk, s, d), _rand(gen, b, hk, s, d)
    cot = _rand(gen, b, hq, t, d)
    bias = _rand(gen, 1, hq, t, s)
    out_ref, _, grads_ref = reference_grads(q, k, v, cot, causal=causal, bias=bias)

    def f(q_, k_, v_):
        return blockwise_attn(q_, k_, v_, bias=jnp.asarray(bias.numpy(), jnp.float32), causal=causal,
                              query_chunk_size=chunks[0], key_chunk_size=chunks[1])

    qj, kj, vj = _j(q), _j(k), _j(v)
    out = f(qj, kj, vj)
    assert out.dtype == jnp.float32 and out.shape == (b, t, hq, d)
    _close(_t(out), out_ref, 2e-5)
    grads = jax.grad(lambda *a: jnp.sum(f(*a) * _j(cot)), argnums=(0, 1, 2))(qj, kj, vj)
    for g, gr in zip(grads, grads_ref[:3]):
        _close(_t(g), gr, 5e-5)


def test_blockwise_attn_cross_lengths_policy_and_dtypes():
    gen = torch.Generator().manual_seed(3)
    q, k, v = _rand(gen, 1, 2, 33, 80), _rand(gen, 1, 2, 70, 80), _rand(gen, 1, 2, 70, 80)
    out_ref, _ = reference(q, k, v)
    policy = jax.checkpoint_policies.dots_saveable
    out = blockwise_attn(_j(q), _j(k), _j(v), causal=False, query_chunk_size=8, key_chunk_size=32, policy=policy,
                         prevent_cse=False)
    _close(_t(out), out_ref, 2e-5)
    # bf16 in, bf16 out: error within twice torch's own bf16 error against the fp32 result
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    torch_bf16 = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
    exact, _ = reference(qb, kb, vb)
    ours = blockwise_attn(*(jnp.asarray(x.float().transpose(1, 2).numpy(), jnp.bfloat16) for x in (qb, kb, vb)),
                          causal=False, dtype=jnp.bfloat16, query_chunk_size=16, key_chunk_size=16)
    assert ours.dtype == jnp.bfloat16
    assert_dtype_rule("out", _t(ours.astype(jnp.float32)), exact, torch_bf16, floor=1e-6)


def test_blockwise_attn_dropout():
    gen = torch.Generator().manual_seed(4)
    q, k = _rand(gen, 1, 2, 64, 8), _rand(gen, 1, 2, 256, 8)
    v = jnp.ones((1, 256, 2, 4), jnp.float32)
    args = dict(causal=False, query_chunk_size=16, key_chunk_size=64)
    rng = jax.random.key(0)
    dropped = blockwise_attn(_j(q), _j(k), v, deterministic=False, dropout_rng=rng, attn_pdrop=0.3, **args)
    again = blockwise_attn(_j(q), _j(k), v, deterministic=False, dropout_rng=rng, attn_pdrop=0.3, **args)
    np.testing.assert_array_equal(dropped, again)  # a key fixes the mask
    # With V = 1 an undropped row gives exactly 1; kept weights are rescaled by 1 / (1 - p).
    assert float(jnp.max(jnp.abs(dropped - 1))) > 0.05
    assert abs(float(jnp.mean(dropped)) - 1.0) < 0.05
    plain = blockwise_attn(_j(q), _j(k), v, deterministic=True, dropout_rng=rng, attn_pdrop=0.3, **args)
    _close(plain, np.ones(plain.shape), 1e-5)


def test_blockwise_attn_errors():
    q = jnp.ones((1, 8, 2, 4))
    with pytest.raises(ValueError, match="dropout_rng"):
        blockwise_attn(q, q, q, deterministic=False, attn_pdrop=0.1)
    with pytest.raises(ValueError, match="chunk size 0"):
        blockwise_attn(q, q, q, query_chunk_size=0)
    with pytest.raises(ValueError, match="query: expected a 4-D"):
        blockwise_attn(q[0], q, q)
    with pytest.raises(ValueError, match="num_q_heads=2 is not a multiple of num_kv_heads=3"):
        blockwise_attn(q, jnp.ones((1, 8, 3, 4)), jnp.ones((1, 8, 3, 4)))
    with pytest.raises(ValueError, match="bias: shape"):
        blockwise_attn(q, q, q, bias=jnp.ones((1, 2, 8, 9)))


def _segment_ids(gen, b, t, s):
    q_ids = torch.randint(0, 3, (b, t), generator=gen)
    kv_ids = torch.randint(0, 3, (b, s), generator=gen)
    return q_ids, kv_ids


@pytest.mark.parametrize("band,causal,window", [
    (Band(None, 0), True, None),
    (Band(-6, 3), False, (6, 3)),
    (Band(-9, None), False, (9, -1)),
    (Band(None, None), False, None),
])
def test_block_kernels_with_global_statistics(band, causal, window):
    """block_forward gives (out, lse) of the block; block_backward, given the rows' lse and Delta,
    gives the exact gradients (here the block is the whole attention)."""
    gen = torch.Generator().manual_seed(20)
    b, hq, hk, t, d = 2, 6, 2, 45, 24
    q, k, v = _rand(gen, b, hq, t, d), _rand(gen, b, hk, t, d), _rand(gen, b, hk, t, d)
    cot = _rand(gen, b, hq, t, d)
    q_ids, kv_ids = _segment_ids(gen, b, t, t)
    kw = dict(causal=causal, window=window, softcap=2.5, segment_ids=(q_ids, kv_ids))
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, cot, **kw)
    seg = (jnp.asarray(q_ids.numpy(), jnp.int32), jnp.asarray(kv_ids.numpy(), jnp.int32))
    common = dict(scale=d ** -0.5, band=band, softcap=2.5, segment_ids=seg, chunk_q=16, chunk_k=8)
    out, lse = block_forward(_j(q), _j(k), _j(v), **common)
    _close(_t(out), out_ref, 2e-5)
    finite = torch.isfinite(lse_ref)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite.numpy())
    _close(np.where(finite.numpy(), np.asarray(lse), 0), torch.where(finite, lse_ref, 0), 2e-5)
    delta = jnp.swapaxes(jnp.sum(out * _j(cot), axis=-1), 1, 2)
    grads = block_backward(_j(q), _j(k), _j(v), _j(cot), lse, delta, **common)
    for g, gr in zip(grads, grads_ref[:3]):
        _close(_t(g), gr, 5e-5)


def test_block_forward_key_limit_and_empty_rows():
    """kv_len hides trailing keys; a band that leaves a row nothing gives 0 and LSE -inf."""
    gen = torch.Generator().manual_seed(21)
    q, k, v = _rand(gen, 1, 2, 10, 8), _rand(gen, 1, 2, 12, 8), _rand(gen, 1, 2, 12, 8)
    out, lse = block_forward(_j(q), _j(k), _j(v), scale=8 ** -0.5, band=Band(None, -2), kv_len=9, chunk_q=4,
                             chunk_k=5)
    visible = visibility(10, 12, causal=True, offset=-2) & (torch.arange(12) < 9)  # keys j <= i - 2, j < 9
    out_ref, lse_ref = reference(q, k, v, mask=visible)
    _close(_t(out), out_ref, 2e-5)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, :2])) and np.all(np.asarray(out)[:, :2] == 0)
    _close(np.asarray(lse)[:, :, 2:], lse_ref[:, :, 2:], 2e-5)
