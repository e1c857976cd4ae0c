"""The Pallas Mosaic GPU flash backward (jax_core/kernels/flash_bwd_mgpu.py) against float64 gradients
(tests/attention_reference.py).

Where JAX runs on a Hopper GPU the kernel is compiled and run as is (dQ then accumulates by TMA
reduce-adds). Elsewhere it runs in Mosaic GPU's interpret mode on the CPU: the three warpgroups, the
TMA ring of Q/dO/LSE/delta blocks, every barrier, the causal query-block ranges, the dS^T exchange
between the compute warpgroups and the epilogue run as written; the products are plain dots on the
same shared-memory slots and each warpgroup adds its dQ share by read-modify-write (the interpreter
has no wgmma on transposed or register operands and no TMA reduction). A GPU without sm90 skips.

The residuals the kernel reads (out, lse) come from the float64 reference, so a failure points at the
backward alone.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle is written in torch")
jax = pytest.importorskip("jax")
from mosaic_gpu_mode import fresh_interpreter, interpret_params, pytestmark  # noqa: E402,F401

import jax.numpy as jnp  # noqa: E402

from attention_reference import assert_dtype_rule, from_bthd, reference, reference_grads  # noqa: E402

from jaxattn.jax_core.kernels.flash_bwd_mgpu import backward_operands, flash_backward_mgpu  # noqa: E402


def _low_grads(q, k, v, cot, dtype, **kw):
    """torch's own gradients computed in `dtype` (the same-dtype error the 2x rule allows)."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    out, _ = reference(*leaves, dtype=dtype, **kw)
    return torch.autograd.grad((out * cot.to(dtype)).sum(), leaves)


def _jax(t, dtype):
    """A (B, H, T, D) torch tensor as a (B, T, H, D) JAX array of `dtype`."""
    return jnp.asarray(t.transpose(1, 2).float().numpy(), dtype)


# (B, L, S, Hq, Hk, D, causal, alignment, stages, dtype): head dim 64 takes the per-warpgroup dQ
# path, head dim 128 the one whose warpgroups split dQ's columns.
CASES = [
    pytest.param(1, 128, 128, 2, 1, 64, False, "top_left", 2, jnp.float16, id="full-d64-gqa"),
    pytest.param(1, 192, 256, 2, 2, 64, True, "bottom_right", 3, jnp.bfloat16, id="causal-br-l<s-d64-bf16"),
    pytest.param(1, 128, 128, 4, 2, 128, True, "top_left", 2, jnp.float16, id="causal-d128-gqa"),
    pytest.param(1, 256, 128, 2, 1, 128, True, "bottom_right", 2, jnp.float16, id="causal-br-l>s-empty-rows"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, d, causal, alignment, stages, dtype", CASES)
def test_gradients_against_float64_oracle(b, l, s, hq, hk, d, causal, alignment, stages, dtype):
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))  # fresh each run
    q, do = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    torch_dtype = torch.float16 if dtype == jnp.float16 else torch.bfloat16
    q, k, v, do = (x.to(torch_dtype).double() for x in (q, k, v, do))  # exactly representable inputs
    scale = 0.7 / d ** 0.5  # not the default: the in-kernel scale must be the one given
    kw = dict(causal=causal, alignment=alignment, scale=scale)
    out, lse, (dq, dk, dv, _, _) = reference_grads(q, k, v, do, **kw)
    low = _low_grads(q, k, v, do, torch_dtype, **kw)

    lse_bhl = jnp.asarray(lse.float().numpy())
    lse_log2, delta = backward_operands(_jax(out, dtype), _jax(do, dtype), lse_bhl)
    interpret = interpret_params()
    got = flash_backward_mgpu(
        _jax(q, dtype), _jax(k, dtype), _jax(v, dtype), _jax(do, dtype), lse_log2, delta,
        jnp.zeros((b, l, hq, d), jnp.float32), scale=scale, causal=causal,
        diag_offset=s - l if alignment == "bottom_right" else 0, stages=stages, interpret=interpret)
    floor = 2e-2 if dtype == jnp.bfloat16 else 4e-3
    for name, ours, want, theirs in zip(("dq", "dk", "dv"), got, (dq, dk, dv), low):
        assert_dtype_rule(name, from_bthd(np.asarray(ours.astype(jnp.float32))), want, theirs.double(), floor=floor)
    if alignment == "bottom_right" and l > s:  # rows i < L - S see no key: no gradient reaches them
        assert np.all(np.asarray(got[0])[:, : l - s] == 0)


def test_backward_operands_mark_rows_without_keys():
    """A row that saw no key (lse -inf) gets lse_log2 = +inf, so that its probabilities are exp2(s - inf)
    = 0 in the kernel rather than NaN; delta is rowsum(dO * O) in float32."""
    out = jnp.asarray(np.random.default_rng().standard_normal((1, 3, 2, 8)), jnp.bfloat16)
    do = jnp.asarray(np.random.default_rng().standard_normal((1, 3, 2, 8)), jnp.bfloat16)
    lse = jnp.asarray([[[0.5, -jnp.inf, 2.0], [1.0, 1.0, -jnp.inf]]], jnp.float32)
    lse_log2, delta = backward_operands(out, do, lse)
    want = np.where(np.isneginf(lse), np.inf, np.asarray(lse) * np.log2(np.e))
    np.testing.assert_allclose(np.asarray(lse_log2), want, rtol=1e-6)
    want_delta = np.einsum("blhd,blhd->bhl", np.asarray(out, np.float32), np.asarray(do, np.float32))
    np.testing.assert_allclose(np.asarray(delta), want_delta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(l=96), r"query length L=96: expected a multiple of block_q=64"),
    (dict(s=192), r"key length S=192: expected a multiple of 2 \* block_kv = 128"),
    (dict(d=80), r"head_dim=80: expected 64 or 128"),
    (dict(hk=3, hq=4), r"query heads 4, KV heads 3"),
    (dict(dtype=jnp.float32), r"q.dtype=float32: expected bfloat16 or float16"),
    (dict(stages=1), r"stages=1: expected at least 2"),
    (dict(stages=3, d=128), r"stages=3, block_q=64, block_kv=64, head_dim=128: \d+ bytes of shared-memory"),
    (dict(lse_shape=(1, 2, 64)), r"lse_log2: shape \(1, 2, 64\)"),
    (dict(scale=-1.0), r"scale=-1.0: expected a positive"),
])
def test_rejects_bad_arguments(kw, match):
    b, l, s, d = 1, kw.get("l", 128), kw.get("s", 256), kw.get("d", 64)
    hq, hk, dtype = kw.get("hq", 2), kw.get("hk", 2), kw.get("dtype", jnp.float16)
    q = jnp.zeros((b, l, hq, d), dtype)
    k = jnp.zeros((b, s, hk, d), dtype)
    lse = jnp.zeros(kw.get("lse_shape", (b, hq, l)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_backward_mgpu(q, k, k, q, lse, jnp.zeros((b, hq, l), jnp.float32), jnp.zeros(q.shape, jnp.float32),
                            scale=kw.get("scale", 0.125), causal=True, stages=kw.get("stages", 2))
