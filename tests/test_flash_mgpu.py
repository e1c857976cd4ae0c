"""The Pallas Mosaic GPU flash forward (jax_core/kernels/flash_fwd_mgpu.py) against the float64 oracle of
tests/attention_reference.py.

Where JAX runs on a Hopper GPU the kernel is compiled and run as is. Elsewhere it runs in Mosaic GPU's
interpret mode on the CPU: the three warpgroups as threads, TMA copies into the shared-memory ring,
every barrier wait and arrival, the causal block ranges, the online softmax and the epilogue run as
written; the interpreter has no wgmma on a transposed or register operand and no layouts, so there the
two matmuls are plain dots on the same shared-memory slots (see the kernel's `_scores`,
`_accumulate_pv`). A GPU without sm90 skips.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle is written in torch")
jax = pytest.importorskip("jax")
try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401 (the kernel needs it importable)
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except Exception as exc:  # pragma: no cover - depends on the environment (Mosaic GPU needs absl-py)
    pytest.skip(f"Pallas Mosaic GPU or its interpreter cannot be imported ({exc!r})", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402

from attention_reference import assert_close_finite, assert_dtype_rule, from_bthd, reference  # noqa: E402

from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu  # noqa: E402


def _mode():
    if jax.default_backend() == "cpu":
        return "interpret"
    device = jax.devices()[0]
    if getattr(device, "compute_capability", "") == "9.0":
        return "gpu"
    return None


MODE = _mode()
pytestmark = pytest.mark.skipif(MODE is None, reason="Mosaic GPU's wgmma kernel needs an sm90 (Hopper) GPU")


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """A failed interpreted kernel leaves the interpreter's shared state behind; start each test clean."""
    if MODE == "interpret":
        gpu_callbacks.reset_gpu_interpret_mode_state()
    yield


def _run(q, k, v, **kw):
    interpret = InterpretGPUParams() if MODE == "interpret" else None
    out, lse = flash_forward_mgpu(q, k, v, interpret=interpret, **kw)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def _inputs(rng, b, l, s, hq, hk, d, dtype):
    shapes = ((b, l, hq, d), (b, s, hk, d), (b, s, hk, d))
    return [jnp.asarray(rng.standard_normal(sh, np.float32), dtype) for sh in shapes]


# (B, L, S, Hq, Hk, D, causal, alignment, block_kv, stages, dtype)
CASES = [
    pytest.param(1, 128, 128, 1, 1, 64, False, "top_left", 64, 2, jnp.float16, id="full-128"),
    pytest.param(2, 256, 256, 4, 2, 64, True, "top_left", 64, 2, jnp.float16, id="causal-256-gqa"),
    pytest.param(1, 128, 256, 2, 1, 64, True, "bottom_right", 64, 3, jnp.bfloat16, id="causal-br-l<s-bf16"),
    pytest.param(1, 256, 128, 2, 2, 64, True, "bottom_right", 64, 2, jnp.float16, id="causal-br-l>s-empty"),
    pytest.param(1, 256, 384, 2, 2, 64, False, "top_left", 128, 2, jnp.float16, id="full-l<s-bkv128"),
    pytest.param(1, 128, 512, 4, 1, 128, True, "bottom_right", 128, 2, jnp.float16, id="causal-br-d128-mqa"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, d, causal, alignment, block_kv, stages, dtype", CASES)
def test_against_float64_oracle(b, l, s, hq, hk, d, causal, alignment, block_kv, stages, dtype):
    rng = np.random.default_rng()  # fresh inputs each run
    q, k, v = _inputs(rng, b, l, s, hq, hk, d, dtype)
    scale = 0.7 / d ** 0.5  # not the default: the in-kernel scale must be the one given
    diag_offset = s - l if alignment == "bottom_right" else 0
    out, lse = _run(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, block_kv=block_kv,
                    stages=stages)
    tq, tk, tv = (from_bthd(np.asarray(x.astype(jnp.float32))) for x in (q, k, v))
    want, want_lse = reference(tq, tk, tv, causal=causal, alignment=alignment, scale=scale)
    torch_dtype = torch.float16 if dtype == jnp.float16 else torch.bfloat16
    low, _ = reference(tq, tk, tv, causal=causal, alignment=alignment, scale=scale, dtype=torch_dtype)
    got = from_bthd(out)
    assert_dtype_rule("out", got, want, low, floor=4e-3 if dtype == jnp.bfloat16 else 1e-3)
    assert_close_finite("lse", torch.from_numpy(np.array(lse)).double(), want_lse, tol=1e-5)
    if alignment == "bottom_right" and l > s:  # rows i < L - S see no key
        assert np.all(out[:, : l - s] == 0) and np.all(np.isneginf(lse[:, :, : l - s]))


@pytest.mark.parametrize("kw, match", [
    (dict(l=192), r"query length L=192: expected a multiple of 2 \* block_q = 128"),
    (dict(s=160), r"key length S=160: expected a multiple of block_kv=128"),
    (dict(d=80), r"head_dim=80: expected 64 or 128"),
    (dict(hk=3, hq=4), r"query heads 4, KV heads 3"),
    (dict(dtype=jnp.float32), r"q.dtype=float32: expected bfloat16 or float16"),
    (dict(stages=1), r"stages=1: expected at least 2"),
    (dict(stages=3, d=128), r"stages=3, block_kv=128, head_dim=128: 229376 bytes of shared-memory buffers"),
    (dict(scale=-1.0), r"scale=-1.0: expected a positive"),
])
def test_rejects_bad_arguments(kw, match):
    shape = dict(b=1, l=128, s=256, hq=2, hk=2, d=64, dtype=jnp.float16) | {
        key: kw[key] for key in ("l", "s", "hq", "hk", "d", "dtype") if key in kw}
    q, k, v = _inputs(np.random.default_rng(0), **shape)
    with pytest.raises(ValueError, match=match):
        flash_forward_mgpu(q, k, v, scale=kw.get("scale", 0.125), causal=True, stages=kw.get("stages", 2))
