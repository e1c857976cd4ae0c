"""The Pallas Mosaic GPU flash backward (jax_core/kernels/flash_bwd_mgpu.py) against float64 gradients
(tests/attention_reference.py).

Where JAX runs on a Hopper GPU the kernel is compiled and run as is (dQ then accumulates by TMA
reduce-adds). Elsewhere it runs in Mosaic GPU's interpret mode on the CPU: the three warpgroups, the
TMA ring of Q/dO/LSE/delta blocks, every barrier, the query-block ranges of causal masks and windows,
the dS^T exchange between the compute warpgroups and the epilogue run as written; the products are
plain dots on the same shared-memory slots and each warpgroup adds its dQ share by read-modify-write
(the interpreter has no wgmma on transposed or register operands and no TMA reduction). A GPU without
sm90 skips.

The residuals the kernel reads (out, lse) come from the float64 reference, so a failure points at the
backward alone; one test feeds it the Mosaic forward's instead. Features and edge tiles (any L, S;
windows in both alignments; soft cap; sinks' gradient; GQA; their combinations; rows that see no key)
have their own oracle tests; `test_lowers_for_hopper` lowers every feature's kernel to Mosaic GPU at
head dims 64, 128 and 256 (no GPU needed), which the interpreter does not.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle is written in torch")
jax = pytest.importorskip("jax")
from mosaic_gpu_mode import (MODE, InterpretGPUParams, feature_grid, fresh_interpreter,  # noqa: E402,F401
                             interpret_params, pytestmark)

import jax.numpy as jnp  # noqa: E402

from attention_reference import (  # noqa: E402
    assert_dtype_rule, from_bthd, reference, reference_grads, visibility)

from jaxattn.jax_core.kernels.flash_bwd_mgpu import (  # noqa: E402
    backward_operands, flash_backward_mgpu, flash_backward_mgpu_tiles, padded_lengths, sinks_gradient)
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu  # noqa: E402
from jaxattn.jax_core.kernels import persistent_waves  # noqa: E402


def _low_grads(q, k, v, cot, dtype, sinks=None, **kw):
    """torch's own gradients (dq, dk, dv, dsinks) computed in `dtype` (the same-dtype error the 2x rule
    allows); dsinks None without sinks."""
    leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    extra = [] if sinks is None else [sinks.detach().to(dtype).requires_grad_(True)]
    out, _ = reference(*leaves, dtype=dtype, sinks=extra[0] if extra else None, **kw)
    grads = torch.autograd.grad((out * cot.to(dtype)).sum(), leaves + extra)
    return (*grads[:3], grads[3] if extra else None)


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
    for name, ours, want, theirs in zip(("dq", "dk", "dv"), got, (dq, dk, dv), low[:3]):
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


def _inputs(gen, b, l, s, hq, hk, d, torch_dtype):
    """Fresh float64 q, k, v, do, exactly representable in `torch_dtype`, (B, H, T, D)."""
    q, do = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return [x.to(torch_dtype).double() for x in (q, k, v, do)]


def _feature_case(b, l, s, hq, hk, *, causal=False, alignment="top_left", window=None, softcap=None, sinks=False,
                  d=64, stages=2, dtype=jnp.float16, inputs=None, residuals="reference", head_splits=1, block_q=64,
                  programs=None, block_kv=None, cluster=1):
    """Runs the backward with the features given on fresh inputs (or `inputs`: q, k, v, do as (B, H, T, D)
    float64) and checks dq, dk, dv (and the sinks' gradient) against the float64 oracle's under the 2x
    rule; rows that see no key get dq exactly 0. `residuals`: whose out and lse the backward reads, the
    oracle's or the Mosaic forward's ("forward"). Returns those rows."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))  # fresh each run
    torch_dtype = torch.float16 if dtype == jnp.float16 else torch.bfloat16
    q, k, v, do = _inputs(gen, b, l, s, hq, hk, d, torch_dtype) if inputs is None else inputs
    tsinks = (torch.rand(hq, generator=gen, dtype=torch.float64) * 4 - 1).float().double() if sinks else None
    scale = 0.8 / d ** 0.5
    diag_offset = s - l if alignment == "bottom_right" else 0
    kw = dict(causal=causal, alignment=alignment, window=window, softcap=softcap, scale=scale)
    out, lse, (dq, dk, dv, _, dsinks) = reference_grads(q, k, v, do, sinks=tsinks, **kw)
    low = _low_grads(q, k, v, do, torch_dtype, sinks=tsinks, **kw)
    jq, jk, jv, jdo = (_jax(x, dtype) for x in (q, k, v, do))
    jsinks = None if tsinks is None else jnp.asarray(tsinks.numpy(), jnp.float32)
    interpret = interpret_params()
    if residuals == "forward":
        jout, jlse = flash_forward_mgpu(jq, jk, jv, scale=scale, causal=causal, diag_offset=diag_offset, window=window,
                                        softcap=softcap, sinks=jsinks, block_kv=64, interpret=interpret)
    else:
        jout, jlse = _jax(out, dtype), jnp.asarray(lse.float().numpy())
    lse_log2, delta = backward_operands(jout, jdo, jlse)
    got = flash_backward_mgpu(jq, jk, jv, jdo, lse_log2, delta, jnp.zeros(jq.shape, jnp.float32), scale=scale,
                              causal=causal, diag_offset=diag_offset, window=window, softcap=softcap, stages=stages,
                              head_splits=head_splits, block_q=block_q, programs=programs, interpret=interpret,
                              block_kv=block_kv or (32 if d == 256 else 64), cluster=cluster)
    assert [x.shape for x in got] == [jq.shape, jk.shape, jv.shape]
    assert [x.dtype for x in got] == [jnp.float32, jk.dtype, jv.dtype]
    # On the GPU the soft cap's tanh is tanh.approx.f32 (relative error below 2**-10.9): dS's factor
    # 1 - tanh^2 and P are off by about 2**-10 relative, as is every gradient.
    floor = (2e-2 if dtype == jnp.bfloat16 else 4e-3) * (2 if softcap is not None and MODE == "gpu" else 1)
    for name, ours, want, theirs in zip(("dq", "dk", "dv"), got, (dq, dk, dv), low[:3]):
        assert_dtype_rule(name, from_bthd(np.asarray(ours.astype(jnp.float32))), want, theirs.double(), floor=floor)
    if sinks:
        dsinks_got = torch.from_numpy(np.array(sinks_gradient(jsinks, jlse, delta), np.float64))
        assert_dtype_rule("dsinks", dsinks_got, dsinks, low[3].double(), floor=floor * l)
    empty = ~visibility(l, s, causal=causal, alignment=alignment, window=window).any(-1).numpy()
    assert np.all(np.asarray(got[0])[:, empty] == 0)
    return empty


# (B, L, S, Hq, Hk, keywords of _feature_case); lengths up to ~300 keep the interpreter quick. The
# kernel's tiles: block_q = 64 rows, programs of 2 * block_kv = 128 keys.
FEATURE_CASES = [
    # edge tiles: L not a multiple of 64, S not of 128, L != S both ways
    pytest.param(1, 97, 130, 4, 2, {}, id="edge-97x130-gqa"),
    pytest.param(1, 1, 1, 2, 1, dict(causal=True), id="edge-1x1-causal"),
    pytest.param(1, 130, 1, 1, 1, {}, id="edge-130x1"),
    pytest.param(1, 1, 300, 2, 2, dict(causal=True, alignment="bottom_right", dtype=jnp.bfloat16),
                 id="edge-1x300-causal-br-bf16"),
    pytest.param(2, 200, 70, 2, 2, dict(causal=True, alignment="bottom_right"), id="edge-200x70-causal-br-empty"),
    pytest.param(1, 97, 130, 4, 2, dict(causal=True, d=128), id="edge-97x130-causal-d128-gqa"),
    # sliding windows, one- and two-sided, both alignments, left 0
    pytest.param(1, 130, 200, 2, 2, dict(window=(32, -1)), id="window-left-only"),
    pytest.param(1, 97, 150, 2, 1, dict(window=(-1, 16), alignment="bottom_right"), id="window-right-only-br"),
    pytest.param(1, 97, 260, 4, 2, dict(window=(20, 40), alignment="bottom_right"), id="window-two-sided-br-gqa"),
    pytest.param(1, 128, 128, 2, 2, dict(window=(0, 16)), id="window-left0"),
    pytest.param(1, 130, 130, 1, 1, dict(window=(0, 0)), id="window-diagonal-only"),
    pytest.param(1, 150, 300, 2, 2, dict(window=(48, -1), causal=True, alignment="bottom_right",
                                          dtype=jnp.bfloat16), id="window-causal-br-bf16"),
    pytest.param(1, 200, 70, 2, 2, dict(window=(5, 5), alignment="bottom_right"), id="window-br-l>s-empty"),
    pytest.param(1, 300, 200, 2, 1, dict(window=(30, 50), d=128), id="window-two-sided-d128-empty"),
    pytest.param(1, 320, 130, 2, 2, dict(window=(0, 0)), id="window-l>s-empty"),
    # an edge one row short of a 64-row block boundary, the other side open (so that some blocks are
    # unmasked): an off-by-one in the unmasked range shows
    pytest.param(1, 200, 260, 2, 1, dict(window=(62, -1)), id="window-left-62"),
    pytest.param(1, 200, 200, 2, 1, dict(window=(-1, 62), alignment="bottom_right"), id="window-right-62"),
    # soft cap, sinks, combinations
    pytest.param(1, 97, 130, 2, 2, dict(softcap=5.0), id="softcap"),
    pytest.param(1, 256, 256, 2, 1, dict(softcap=2.0, causal=True, dtype=jnp.bfloat16, d=128),
                 id="softcap-causal-d128-bf16"),
    pytest.param(1, 130, 97, 4, 2, dict(sinks=True), id="sinks-gqa"),
    pytest.param(1, 200, 70, 2, 2, dict(sinks=True, window=(5, 5), alignment="bottom_right"),
                 id="sinks-window-br-empty"),
    pytest.param(1, 150, 230, 4, 2, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True,
                                          alignment="bottom_right", dtype=jnp.bfloat16), id="all-features-gqa-bf16"),
    pytest.param(1, 150, 230, 2, 1, dict(window=(40, 70), softcap=3.0, sinks=True, d=128),
                 id="all-features-d128"),
    # a GQA group split across programs (head_splits): each walks some of its query heads, and their
    # float32 partial dK, dV are summed
    pytest.param(1, 97, 130, 4, 1, dict(causal=True, head_splits=2), id="head-splits-2-of-4-causal"),
    pytest.param(2, 150, 230, 4, 1, dict(window=(24, 8), softcap=4.0, sinks=True, d=128, head_splits=4,
                                          alignment="bottom_right", dtype=jnp.bfloat16),
                 id="head-splits-4-of-4-all-features-d128-bf16"),
    pytest.param(1, 200, 70, 4, 2, dict(causal=True, alignment="bottom_right", head_splits=2, d=128),
                 id="head-splits-causal-br-d128-empty"),
    # head dim 64 with 128-row query blocks: the warpgroups split dQ's rows (each 64, over both
    # warpgroups' keys)
    pytest.param(1, 97, 130, 4, 2, dict(causal=True, block_q=128), id="dq-rows-edge-97x130-causal-gqa"),
    pytest.param(1, 300, 200, 2, 2, dict(window=(30, 50), alignment="bottom_right", block_q=128,
                                          dtype=jnp.bfloat16), id="dq-rows-window-br-bf16-empty"),
    pytest.param(1, 150, 230, 4, 2, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True, block_q=128),
                 id="dq-rows-all-features-gqa"),
    pytest.param(2, 200, 260, 4, 1, dict(causal=True, head_splits=2, block_q=128), id="dq-rows-head-splits-causal"),
    # a persistent grid (`programs`): 3 programs walk 2-6 items each (2 * 64 keys of a KV head and
    # split), the query-block ring and the dS^T exchange running on from item to item. Without GQA
    # some items walk an odd number of query blocks, so ring slots and dS^T buffers change parity
    # between items.
    pytest.param(1, 150, 390, 4, 4, dict(causal=True, alignment="bottom_right", programs=3),
                 id="persistent-causal-br"),
    pytest.param(2, 150, 230, 2, 2, dict(causal=True, d=128, programs=3), id="persistent-causal-d128-dq-columns"),
    pytest.param(2, 150, 230, 4, 1, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True, block_q=128,
                                          head_splits=2, programs=3), id="persistent-dq-rows-head-splits-all-features"),
    # keys 128 and up are outside every row's window: their items walk no query block and write zeros
    pytest.param(1, 70, 400, 2, 2, dict(window=(5, 5), programs=3), id="persistent-items-no-row-sees"),
    # head dim 256: the two warpgroups share an item's 64 keys, each taking 32 rows of a query block's
    # scores and 128 columns of the gradients (flash_bwd_mgpu_wide.py)
    pytest.param(1, 97, 130, 4, 2, dict(causal=True, d=256), id="d256-edge-97x130-causal-gqa"),
    pytest.param(2, 200, 70, 2, 2, dict(causal=True, alignment="bottom_right", d=256, dtype=jnp.bfloat16),
                 id="d256-causal-br-bf16-empty"),
    pytest.param(1, 150, 230, 4, 2, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True, d=256,
                                          alignment="bottom_right", dtype=jnp.bfloat16), id="d256-all-features-gqa-bf16"),
    pytest.param(1, 200, 260, 2, 1, dict(window=(62, -1), d=256), id="d256-window-left-62"),
    pytest.param(2, 150, 230, 4, 1, dict(window=(24, 8), softcap=4.0, head_splits=4, d=256),
                 id="d256-head-splits-4-of-4"),
    pytest.param(1, 300, 200, 4, 2, dict(causal=True, d=256, programs=3), id="d256-persistent-causal-gqa"),
    # clusters of two programs on adjacent key blocks (`cluster=2`), stepping through the union of
    # their walks: under a causal or windowed band one of them skips the query blocks only the other's
    # keys see (on the GPU each step's Q and dO arrive by one multicast load)
    pytest.param(1, 256, 256, 2, 2, dict(causal=True, programs=2, cluster=2), id="cluster-persistent-causal"),
    pytest.param(1, 200, 450, 4, 2, dict(causal=True, alignment="bottom_right", cluster=2),
                 id="cluster-causal-br-gqa"),
    pytest.param(2, 150, 230, 2, 2, dict(window=(40, 10), softcap=4.0, sinks=True, d=128, programs=4, cluster=2),
                 id="cluster-persistent-all-features-d128"),
    pytest.param(1, 97, 300, 2, 2, dict(window=(5, 5), programs=2, cluster=2), id="cluster-persistent-window-items-no-row-sees"),
    pytest.param(2, 200, 260, 4, 1, dict(causal=True, head_splits=2, block_q=128, programs=6, cluster=2),
                 id="cluster-persistent-dq-rows-head-splits"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, kw", FEATURE_CASES)
def test_features_against_float64_oracle(b, l, s, hq, hk, kw, request):
    empty = _feature_case(b, l, s, hq, hk, **kw)
    assert empty.any() == request.node.callspec.id.endswith("-empty")  # the empty-row cases have some


def test_groups_over_l2s_bytes_against_float64_oracle(monkeypatch):
    """A GQA backward whose wave-filling group of KV heads shares more than L2_GROUP_BYTES takes fewer
    heads a group (the bound lowered to 0 here, so that a small case does): at (2, 2 KV heads) with
    4 items a head and 5 programs, 1 head a group instead of 2, a program idle in each group's wave."""
    monkeypatch.setattr(persistent_waves, "L2_GROUP_BYTES", 0)
    persistent_waves.l2_group.cache_clear()
    try:
        assert persistent_waves.waves(16, 5, columns=4, column_bytes=1).group == 1
        _feature_case(2, 150, 390, 4, 2, causal=True, alignment="bottom_right", programs=5)
    finally:
        persistent_waves.l2_group.cache_clear()


def _fold(x):
    """(B, H, T, D) torch -> (B * H, T, 1, D) JAX: (batch, head) pairs folded into the batch."""
    b, h, t, d = x.shape
    return jnp.asarray(x.reshape(b * h, t, 1, d).float().numpy(), jnp.float16)


@pytest.mark.parametrize("d, block_q, head_splits, programs", [
    pytest.param(64, 64, 1, None, id="d64"),
    pytest.param(64, 128, 2, 3, id="d64-dq-rows-splits-persistent"),
    pytest.param(128, 64, 4, 3, id="d128-dq-columns-splits-persistent"),
])
def test_gqa_folded_into_the_batch_against_float64_oracle(d, block_q, head_splits, programs):
    """(batch, head) pairs folded into the batch with GQA (the torch launcher's contiguous (B, H, T, D)
    memory): q, do (B * Hq, L, 1, D), k, v (B * Hk, S, 1, D); query pair b * Hq + h reads KV pair
    b * Hk + h // (Hq / Hk), and head splits share a KV pair's query pairs."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    b, l, s, hq, hk = 2, 150, 230, 4, 1
    q, k, v, do = _inputs(gen, b, l, s, hq, hk, d, torch.float16)
    scale = 0.8 / d ** 0.5
    kw = dict(causal=True, alignment="bottom_right", scale=scale)
    out, lse, (dq, dk, dv, _, _) = reference_grads(q, k, v, do, **kw)
    low = _low_grads(q, k, v, do, torch.float16, **kw)
    lse_log2, delta = backward_operands(_fold(out), _fold(do), jnp.asarray(lse.float().numpy()).reshape(b * hq, 1, l))
    got = flash_backward_mgpu(_fold(q), _fold(k), _fold(v), _fold(do), lse_log2, delta,
                              jnp.zeros((b * hq, l, 1, d), jnp.float32), scale=scale, causal=True, diag_offset=s - l,
                              block_q=block_q, head_splits=head_splits, programs=programs, interpret=interpret_params())
    for name, ours, want, theirs, heads in zip(("dq", "dk", "dv"), got, (dq, dk, dv), low[:3], (hq, hk, hk)):
        ours = torch.from_numpy(np.array(ours.astype(jnp.float32), np.float64)).reshape(b, heads, -1, d)
        assert_dtype_rule(name, ours, want, theirs.double(), floor=4e-3)


@pytest.mark.parametrize("keys, kw, match", [
    (128, dict(head_splits=3), r"head_splits=3: expected a positive divisor of the query heads per KV head "
                               r"\(Hq / Hk = 4, times query batches per KV batch 1\); hint: 1 walks"),
    # split partial dK, dV leave through the dQ staging tile, (64, 64) here: 128-key blocks do not fit
    (256, dict(head_splits=2, block_kv=128), r"head_splits=2 with block_q=64, block_kv=128, head dim 64: expected a "
                                             r"dQ staging tile of block_kv rows \(it has 64;.*hint: block_q == block_kv"),
])
def test_head_splits_are_checked(keys, kw, match):
    q = jnp.zeros((1, 64, 4, 64), jnp.float16)
    k = jnp.zeros((1, keys, 1, 64), jnp.float16)
    rows = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_backward_mgpu(q, k, k, q, rows, rows, jnp.zeros(q.shape, jnp.float32), scale=0.1, causal=False,
                            interpret=interpret_params(), **kw)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(window=(24, 8), softcap=4.0, sinks=True, causal=True, alignment="bottom_right"), id="all-d64"),
    pytest.param(dict(window=(-1, 20), softcap=3.0, sinks=True, d=128), id="right-only-d128"),
])
def test_with_the_mosaic_forwards_residuals(kw):
    """The forward kernel's out and lse (the soft cap and the sinks included) are what the backward
    expects: their gradients match the oracle's."""
    _feature_case(1, 97, 230, 4, 2, residuals="forward", **kw)


@pytest.mark.thorough
@pytest.mark.parametrize("l, s, alignment, window, causal", feature_grid())
@pytest.mark.parametrize("extras", [{}, dict(softcap=3.0, sinks=True, d=128)], ids=["plain", "softcap-sinks-d128"])
def test_feature_grid_against_float64_oracle(l, s, alignment, window, causal, extras):
    _feature_case(1, l, s, 2, 1, causal=causal, alignment=alignment, window=window, **extras)


def test_padded_keys_stay_masked_when_every_logit_is_very_negative():
    """Every true logit near -400 (q ~ +5, k ~ -5): lse ~ -400, so a zero padding key, whose logit is
    0, would get P = exp(0 - lse) = inf and NaN gradients if it were not masked."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    b, l, s, h, d = 1, 97, 130, 2, 64
    q, k, v, do = _inputs(gen, b, l, s, h, h, d, torch.float16)
    q, k = ((sign * 5 + 0.1 * x).half().double() for sign, x in ((1, q), (-1, k)))
    empty = _feature_case(b, l, s, h, h, inputs=(q, k, v, do))
    assert not empty.any()


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_blocks_outside_every_band_are_never_read(alignment):
    """Window (0, 0): whole query blocks (64 rows) and key programs (128 keys) that no pair of the band
    reaches hold NaN (q, do, k and v); a program that walked such a query block, or such a key program
    that walked any block, would return NaN (even masked: 0 * NaN). L = 320 > S = 130 top-left leaves
    rows 192.. in unseen blocks, bottom-right rows ..127; L = 128 < S = 320 top-left leaves keys 128..,
    bottom-right keys ..127."""
    for l, s in ((320, 130), (128, 320)):
        gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
        q, k, v, do = _inputs(gen, 1, l, s, 2, 1, 64, torch.float16)
        diag_offset = s - l if alignment == "bottom_right" else 0
        seen = visibility(l, s, window=(0, 0), alignment=alignment)
        def unseen_tiles(seen_at, tile):  # positions whose whole tile no pair of the band reaches
            tiles = torch.nn.functional.pad(seen_at, (0, -len(seen_at) % tile)).view(-1, tile).any(1)
            return ~tiles.repeat_interleave(tile)[:len(seen_at)]
        rows_unseen, keys_unseen = unseen_tiles(seen.any(1), 64), unseen_tiles(seen.any(0), 128)
        assert rows_unseen.any() if l > s else keys_unseen.any()
        scale = 0.125
        out, lse, (dq, dk, dv, _, _) = reference_grads(q, k, v, do, window=(0, 0), alignment=alignment, scale=scale)
        low = _low_grads(q, k, v, do, torch.float16, window=(0, 0), alignment=alignment, scale=scale)
        lse_log2, delta = backward_operands(_jax(out, jnp.float16), _jax(do, jnp.float16),
                                            jnp.asarray(lse.float().numpy()))
        poison = [x.clone() for x in (q, k, v, do)]
        for x, unseen in zip(poison, (rows_unseen, keys_unseen, keys_unseen, rows_unseen)):
            x[:, :, unseen] = float("nan")
        got = flash_backward_mgpu(*(_jax(x, jnp.float16) for x in poison[:3]), _jax(poison[3], jnp.float16), lse_log2,
                                  delta, jnp.zeros((1, l, 2, 64), jnp.float32), scale=scale, causal=False,
                                  diag_offset=diag_offset, window=(0, 0), interpret=interpret_params())
        for name, ours, want, theirs in zip(("dq", "dk", "dv"), got, (dq, dk, dv), low[:3]):
            assert np.isfinite(np.asarray(ours.astype(jnp.float32))).all(), (name, l, s)
            assert_dtype_rule(name, from_bthd(np.asarray(ours.astype(jnp.float32))), want, theirs.double(), floor=4e-3)


def test_tiles_kernel_masks_keys_past_kv_len():
    """The bare kernel on whole tiles with kv_len < S: keys from kv_len on (large finite padding here,
    which would dominate every row that reached it) are masked; padded query rows (lse_log2 +inf,
    delta 0) add nothing to dK, dV."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    l_true, kv_len, l, s, h, d = 100, 150, 128, 256, 2, 64
    q, k, v, do = _inputs(gen, 1, l_true, kv_len, h, h, d, torch.float16)
    kw = dict(window=(40, -1), alignment="bottom_right", scale=0.125)
    out, lse, (dq, dk, dv, _, _) = reference_grads(q, k, v, do, **kw)
    low = _low_grads(q, k, v, do, torch.float16, **kw)
    lse_log2, delta = backward_operands(_jax(out, jnp.float16), _jax(do, jnp.float16), jnp.asarray(lse.float().numpy()))
    lse_log2 = jnp.pad(lse_log2, ((0, 0), (0, 0), (0, l - l_true)), constant_values=jnp.inf)
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, l - l_true)))
    rows = ((0, 0), (0, l - l_true), (0, 0), (0, 0))
    jq, jdo = (jnp.pad(_jax(x, jnp.float16), rows, constant_values=3.0) for x in (q, do))  # any finite rows
    keys = ((0, 0), (0, s - kv_len), (0, 0), (0, 0))
    jk = jnp.pad(_jax(k, jnp.float16), keys, constant_values=30.0)
    jv = jnp.pad(_jax(v, jnp.float16), keys, constant_values=1000.0)
    got = flash_backward_mgpu_tiles(jq, jk, jv, jdo, lse_log2, delta, jnp.zeros(jq.shape, jnp.float32), scale=0.125,
                                    causal=False, kv_len=kv_len, diag_offset=kv_len - l_true, window=(40, -1),
                                    interpret=interpret_params())
    cut = (got[0][:, :l_true], got[1][:, :kv_len], got[2][:, :kv_len])
    for name, ours, want, theirs in zip(("dq", "dk", "dv"), cut, (dq, dk, dv), low[:3]):
        assert_dtype_rule(name, from_bthd(np.asarray(ours.astype(jnp.float32))), want, theirs.double(), floor=4e-3)


def test_sinks_gradient_against_float64_oracle():
    """sinks_gradient from the oracle's lse and the delta of its output: the sinks' gradient, with a
    -inf sink on a row that sees no key (lse -inf) contributing 0 rather than NaN."""
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    b, l, s, hq, hk, d = 2, 40, 30, 3, 1, 16
    q, k, v, do = _inputs(gen, b, l, s, hq, hk, d, torch.float16)
    sinks = torch.tensor([0.5, -2.0, float("-inf")], dtype=torch.float64)
    kw = dict(causal=True, alignment="bottom_right", sinks=sinks)  # rows i < 10 see no key
    out, lse, (*_, dsinks) = reference_grads(q, k, v, do, **kw)
    _, delta = backward_operands(_jax(out, jnp.float32), _jax(do, jnp.float32), jnp.asarray(lse.numpy(), jnp.float32))
    got = np.asarray(sinks_gradient(jnp.asarray(sinks.numpy(), jnp.float32), jnp.asarray(lse.numpy(), jnp.float32),
                                    delta))
    assert np.isneginf(np.asarray(lse[:, 2, :10])).all() and np.isfinite(got).all()
    np.testing.assert_allclose(got, dsinks.numpy(), rtol=1e-4, atol=1e-5)
    assert got[2] == 0 and abs(got[0]) > 1e-3


def test_whole_tiles_take_no_copy():
    """With whole tiles the public function is the kernel call and nothing else (no pad, no slice),
    which `plgpu.as_torch_kernel` needs; otherwise it pads and slices around that one call."""
    def primitives(l, s):
        q = jax.ShapeDtypeStruct((1, l, 2, 64), jnp.float16)
        kv = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.float16)
        rows = jax.ShapeDtypeStruct((1, 2, l), jnp.float32)
        acc = jax.ShapeDtypeStruct(q.shape, jnp.float32)

        def backward(q, k, v, do, lse, delta, acc):
            return flash_backward_mgpu(q, k, v, do, lse, delta, acc, scale=0.1, causal=True, window=(30, -1))
        jaxpr = jax.make_jaxpr(backward)(q, kv, kv, q, rows, rows, acc)
        return [str(e.primitive) for e in jaxpr.jaxpr.eqns]
    # The kernel call (a Pallas `mpmd_map` here), with dq_accum as a mutable ref around it.
    assert primitives(192, 256) == ["new_ref", "mpmd_map", "get"]
    padded = primitives(97, 130)
    assert padded.count("mpmd_map") == 1 and "jit" in padded and "slice" in padded  # jnp.pad is a jit
    assert padded_lengths(97, 130) == (128, 256)
    assert padded_lengths(128, 256, block_q=64, block_kv=128) == (128, 256)


LOWERING_CASES = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=False), id="full"),
    pytest.param(dict(causal=False, window=(20, 5)), id="window-two-sided"),
    pytest.param(dict(causal=True, window=(3, -1), diag_offset=33), id="window-causal-offset"),
    pytest.param(dict(causal=False, window=(-1, 7)), id="window-right-only"),
    pytest.param(dict(causal=False, window=(40, -1)), id="window-left-only"),
    pytest.param(dict(causal=False, softcap=5.0), id="softcap"),
    pytest.param(dict(causal=True, softcap=3.0, window=(9, 2)), id="all"),
]


@pytest.mark.parametrize("kw", LOWERING_CASES)
# the three dQ paths: each warpgroup its own (64), rows split (64 with 128-row blocks), columns split (128)
@pytest.mark.parametrize("d, block_q", [(64, 64), (64, 128), (128, 64), (256, 64)],
                         ids=["d64", "d64-dq-rows", "d128", "d256-wide"])
@pytest.mark.parametrize("lengths", [(256, 384), (97, 130)], ids=["whole-tiles", "edge-tiles"])
def test_lowers_for_hopper(kw, d, block_q, lengths):
    """Every feature lowers to one Mosaic GPU kernel on the GPU path (layouts, masks, tanh, the ragged
    last program, every dQ path), which the interpreter never exercises; lowering needs no GPU."""
    l, s = lengths
    q = jax.ShapeDtypeStruct((1, l, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, 4, l), jnp.float32)
    acc = jax.ShapeDtypeStruct(q.shape, jnp.float32)

    def backward(q, k, v, do, lse, delta, acc):
        return flash_backward_mgpu(q, k, v, do, lse, delta, acc, scale=0.1, block_q=block_q,
                                   block_kv=32 if d == 256 else 64, **kw)
    text = jax.jit(backward).trace(q, k, k, q, rows, rows, acc).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    # Launched with programmatic dependent launch (jax >= 0.11), it waits for the kernel before it on
    # the stream before touching memory, and lets the next one start early.
    assert "griddepcontrol.wait;" in text and "griddepcontrol.launch_dependents;" in text


@pytest.mark.parametrize("layout", ["heads", "folded"])
@pytest.mark.parametrize("d, block_q", [(64, 64), (64, 128), (128, 64)], ids=["d64", "d64-dq-rows", "d128"])
def test_persistent_grid_lowers_for_hopper(d, block_q, layout):
    """The persistent grid (`programs`) lowers too, with every feature, on every dQ path, with GQA in
    the heads or folded into the batch (q (B * Hq, L, 1, D), k (B * Hk, S, 1, D)), head splits included."""
    if layout == "heads":
        q, k = jax.ShapeDtypeStruct((2, 256, 4, d), jnp.bfloat16), jax.ShapeDtypeStruct((2, 384, 2, d), jnp.bfloat16)
    else:
        q, k = jax.ShapeDtypeStruct((8, 256, 1, d), jnp.bfloat16), jax.ShapeDtypeStruct((4, 384, 1, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], 256), jnp.float32)

    def backward(q, k, v, do, lse, delta, acc):
        return flash_backward_mgpu(q, k, v, do, lse, delta, acc, scale=0.1, block_q=block_q, causal=True,
                                   softcap=3.0, window=(9, 2), programs=132, head_splits=2)
    text = jax.jit(backward).trace(q, k, k, q, rows, rows, jax.ShapeDtypeStruct(q.shape, jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("kw, match", [
    (dict(d=80), r"head_dim=80: expected one of \(64, 128, 256\); hint: use the Triton flash kernel"),
    (dict(d=256), r"block_q=64, block_kv=64 at head dim 256: expected 64 and 32"),
    # head dim 256 fits two Q slots and one dO slot (213,760 bytes), not a third Q slot
    (dict(d=256, block_kv=32, stages=3), r"stages=3, block_q=64, block_kv=32, head_dim=256: 246784 bytes of shared"),
    (dict(hk=3, hq=4), r"query heads 4, KV heads 3"),
    (dict(dtype=jnp.float32), r"q.dtype=float32: expected bfloat16 or float16"),
    (dict(l=0), r"query length L=0, key length S=256: expected both at least 1"),
    (dict(stages=1), r"stages=1: expected at least 2"),
    (dict(block_kv=96), r"block_q=64, block_kv=96: expected positive multiples of 64"),
    (dict(stages=3, d=128), r"stages=3, block_q=64, block_kv=64, head_dim=128: \d+ bytes of shared-memory"),
    (dict(lse_shape=(1, 2, 64)),
     r"lse_log2: shape \(1, 2, 64\) dtype float32, expected float32 \(B, Hq, L'\)=\(1, 2, 128\)"),
    (dict(do_dtype=jnp.bfloat16), r"do: shape \(1, 128, 2, 64\) dtype bfloat16, expected q's shape"),
    (dict(acc_dtype=jnp.float16), r"dq_accum: shape \(1, 128, 2, 64\) dtype float16, expected float32"),
    (dict(scale=-1.0), r"scale=-1.0: expected a positive"),
    (dict(diag_offset=1.5), r"diag_offset=1.5: expected a Python int"),
    (dict(window=(4,)), r"window=\(4,\): expected None or \(left, right\), two ints >= -1"),
    (dict(window=(-2, 0)), r"window=\(-2, 0\): expected None or \(left, right\)"),
    (dict(softcap=0.0), r"softcap=0.0: expected None or a positive finite Python float"),
    (dict(programs=0), r"programs=0: expected None \(one program per item of work\) or a positive int"),
    (dict(cluster=3), r"cluster=3: expected 1 or 2 \(programs per cluster\); hint: cluster=1"),
    (dict(cluster=2, programs=3), r"cluster=2: programs=3: a persistent grid of clusters of two needs an even size"),
    (dict(cluster=2, d=256, block_kv=32), r"cluster=2: head dim 256: clusters are for head dims 64 and 128"),
])
def test_rejects_bad_arguments(kw, match):
    kw = dict(kw)
    b, l, s, d = 1, kw.pop("l", 128), kw.pop("s", 256), kw.pop("d", 64)
    hq, hk, dtype = kw.pop("hq", 2), kw.pop("hk", 2), kw.pop("dtype", jnp.float16)
    q = jnp.zeros((b, l, hq, d), dtype)
    k = jnp.zeros((b, s, hk, d), dtype)
    do = jnp.zeros(q.shape, kw.pop("do_dtype", dtype))
    lse = jnp.zeros(kw.pop("lse_shape", (b, hq, l)), jnp.float32)
    acc = jnp.zeros(q.shape, kw.pop("acc_dtype", jnp.float32))
    kw = dict(scale=0.125, causal=True) | kw
    with pytest.raises(ValueError, match=match):
        flash_backward_mgpu(q, k, k, do, lse, jnp.zeros((b, hq, l), jnp.float32), acc, **kw)


@pytest.mark.parametrize("l, s, kw, match", [
    (96, 256, {}, r"query length L=96: expected a multiple of block_q=64; hint: flash_backward_mgpu pads"),
    (128, 192, {}, r"key length S=192: expected a multiple of 2 \* block_kv = 128; hint: flash_backward_mgpu"),
    (128, 256, dict(kv_len=128), r"kv_len=128: expected an int in \(128, 256\]"),
    (128, 256, dict(kv_len=257), r"kv_len=257: expected an int in \(128, 256\]"),
    (128, 256, dict(kv_len=200.0), r"kv_len=200.0: expected an int"),
    # tma_edges: lengths in whole 8-row TMA tiles, on the GPU only
    (100, 136, dict(tma_edges=True), r"query length L=100, key length S=136 with tma_edges=True: expected "
                                     r"multiples of 8"),
    (104, 130, dict(tma_edges=True), r"L=104, key length S=130 with tma_edges=True: expected multiples of 8 .*hint: "
                                     r"tma_edges=False"),
    (104, 136, dict(tma_edges=True, interpret=True), r"tma_edges=True with interpret-mode parameters: expected a GPU"),
    (128, 384, dict(cluster=2), r"cluster=2: S=384: expected a multiple of cluster \* 2 \* block_kv = 256"),
    # the row vectors keep whole query blocks' rows
    (104, 136, dict(tma_edges=True, lse_rows=104), r"lse_log2: shape \(1, 2, 104\) dtype float32, expected float32 "
                                                   r"\(B, Hq, L'\)=\(1, 2, 128\) \(L rounded up to whole 64-row"),
])
def test_tiles_kernel_rejects_partial_tiles(l, s, kw, match):
    kw = dict(kw, interpret=InterpretGPUParams() if kw.get("interpret") else None)
    q = jnp.zeros((1, l, 2, 64), jnp.float16)
    k = jnp.zeros((1, s, 2, 64), jnp.float16)
    rows = jnp.zeros((1, 2, kw.pop("lse_rows", -(-l // 64) * 64)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        flash_backward_mgpu_tiles(q, k, k, q, rows, rows, jnp.zeros(q.shape, jnp.float32), scale=0.125, causal=True,
                                  **kw)


@pytest.mark.parametrize("kw", [pytest.param(dict(causal=True), id="causal"),
                                pytest.param(dict(causal=True, softcap=3.0, window=(9, 2)), id="all"),
                                pytest.param(dict(causal=True, programs=132, head_splits=2), id="persistent-splits")])
@pytest.mark.parametrize("d, block_q", [(64, 128), (128, 64)], ids=["d64-dq-rows", "d128"])
@pytest.mark.parametrize("layout", ["heads", "folded"])
def test_tma_edges_lower_for_hopper(kw, d, block_q, layout):
    """With `tma_edges` the kernel takes lengths in 8-row tiles in place (L = 104, S = 136: its last
    query and key tiles run past them) and still lowers to one Mosaic GPU kernel; Mosaic GPU refuses
    such copies below whole 8-row tiles (`TMA_ROWS`). Running it needs the GPU (the interpreter
    refuses copies past an array's end): `test_gpu_hopper.py`. lse_log2 and delta keep whole query
    blocks' rows."""
    b, hq, hk = (1, 4, 2) if layout == "heads" else (8, 1, 1)
    q = jax.ShapeDtypeStruct((b, 104, hq, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b // 2 if layout == "folded" else b, 136, hk, d), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((b, hq, 128), jnp.float32)

    def backward(q, k, v, do, lse, delta, acc):
        return flash_backward_mgpu_tiles(q, k, v, do, lse, delta, acc, scale=0.1, block_q=block_q, tma_edges=True,
                                         **kw)
    text = jax.jit(backward).trace(q, k, k, q, rows, rows, jax.ShapeDtypeStruct(q.shape, jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1

