"""The Pallas Mosaic GPU flash forward (jax_core/kernels/flash_fwd_mgpu.py) against the float64 oracle of
tests/attention_reference.py.

Where JAX runs on a Hopper GPU the kernel is compiled and run as is. Elsewhere it runs in Mosaic GPU's
interpret mode on the CPU: the three warpgroups as threads, TMA copies into the shared-memory ring,
every barrier wait and arrival, the causal block ranges, the online softmax and the epilogue run as
written; the interpreter has no wgmma on a transposed or register operand and no layouts, so there the
two matmuls are plain dots on the same shared-memory slots (see the kernel's `_scores`,
`_accumulate_pv`). A GPU without sm90 skips.

Features and edge tiles (any L, S; windows in both alignments; soft cap; sinks; GQA; their
combinations; rows that see no key) have their own oracle tests; `test_lowers_for_hopper` lowers
every feature's kernel to Mosaic GPU (no GPU needed), which the interpreter does not.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the oracle is written in torch")
jax = pytest.importorskip("jax")
from mosaic_gpu_mode import (MODE, InterpretGPUParams, feature_grid, fresh_interpreter,  # noqa: E402,F401
                             interpret_params, pytestmark)

import jax.numpy as jnp  # noqa: E402

from attention_reference import (  # noqa: E402
    assert_close_finite, assert_dtype_rule, from_bthd, reference, visibility)

from jaxattn.jax_core.kernels.flash_fwd_mgpu import (  # noqa: E402
    SCORES_FIRST_MIN_KEYS, flash_forward_mgpu, flash_forward_mgpu_tiles, padded_lengths, scores_first_default)


def _run(q, k, v, *, fn=flash_forward_mgpu, **kw):
    interpret = interpret_params()
    out, lse = fn(q, k, v, interpret=interpret, **kw)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def _inputs(rng, b, l, s, hq, hk, d, dtype):
    shapes = ((b, l, hq, d), (b, s, hk, d), (b, s, hk, d))
    return [jnp.asarray(rng.standard_normal(sh, np.float32), dtype) for sh in shapes]


# On the GPU the soft cap's tanh is tanh.approx.f32 (approx_math): relative error below 2**-10.9,
# so a capped logit is off by up to softcap * 2**-10; the LSE (1-Lipschitz in the logits) by at most
# that much, and each output (a convex mix of V rows, |V| < ~5 here) by at most 10 times that.
# The interpreter computes tanh exactly.
def _softcap_slack(softcap):
    return softcap * 2.0 ** -10 if softcap is not None and MODE == "gpu" else 0.0


def _check(q, k, v, out, lse, *, scale, causal=False, alignment="top_left", window=None, softcap=None,
           sinks=None):
    """out, lse (kernel layouts) against the float64 oracle on the same inputs; rows that see no
    key give out exactly 0 and lse exactly -inf (the sink's logit with sinks)."""
    dtype = q.dtype
    tq, tk, tv = (from_bthd(np.asarray(x.astype(jnp.float32))) for x in (q, k, v))
    tsinks = None if sinks is None else torch.tensor(np.asarray(sinks), dtype=torch.float64)
    kw = dict(causal=causal, alignment=alignment, window=window, softcap=softcap, sinks=tsinks, scale=scale)
    want, want_lse = reference(tq, tk, tv, **kw)
    low, _ = reference(tq, tk, tv, dtype=torch.float16 if dtype == jnp.float16 else torch.bfloat16, **kw)
    got = from_bthd(out)
    floor = (4e-3 if dtype == jnp.bfloat16 else 1e-3) + 10 * _softcap_slack(softcap)
    assert_dtype_rule("out", got, want, low, floor=floor)
    assert_close_finite("lse", torch.from_numpy(np.array(lse)).double(), want_lse, tol=1e-5 + _softcap_slack(softcap))
    l, s = q.shape[1], k.shape[1]
    empty = ~visibility(l, s, causal=causal, alignment=alignment, window=window).any(-1).numpy()
    assert np.all(out[:, empty] == 0)
    if sinks is None:
        assert np.all(lse[:, :, empty] == -np.inf)
    else:  # the sink alone: m = sink * log2(e), l = 1, lse = m * ln 2
        want_sink = np.broadcast_to(np.asarray(sinks)[None, :, None], lse[:, :, empty].shape)
        np.testing.assert_allclose(lse[:, :, empty], want_sink, rtol=1e-6, atol=1e-6)
    return empty


# (B, L, S, Hq, Hk, D, causal, alignment, block_kv, stages, dtype)
CASES = [
    pytest.param(1, 128, 128, 1, 1, 64, False, "top_left", 64, 2, jnp.float16, id="full-128"),
    pytest.param(2, 256, 256, 4, 2, 64, True, "top_left", 64, 2, jnp.float16, id="causal-256-gqa"),
    pytest.param(1, 128, 256, 2, 1, 64, True, "bottom_right", 64, 3, jnp.bfloat16, id="causal-br-l<s-bf16"),
    pytest.param(1, 256, 128, 2, 2, 64, True, "bottom_right", 64, 2, jnp.float16, id="causal-br-l>s-empty"),
    pytest.param(1, 256, 384, 2, 2, 64, False, "top_left", 128, 2, jnp.float16, id="full-l<s-bkv128"),
    pytest.param(1, 128, 512, 4, 1, 128, True, "bottom_right", 128, 2, jnp.float16, id="causal-br-d128-mqa"),
    pytest.param(1, 256, 320, 2, 1, 256, True, "bottom_right", 64, 2, jnp.bfloat16, id="causal-br-d256-gqa"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, d, causal, alignment, block_kv, stages, dtype", CASES)
def test_against_float64_oracle(b, l, s, hq, hk, d, causal, alignment, block_kv, stages, dtype):
    rng = np.random.default_rng()  # fresh inputs each run
    q, k, v = _inputs(rng, b, l, s, hq, hk, d, dtype)
    scale = 0.7 / d ** 0.5  # not the default: the in-kernel scale must be the one given
    diag_offset = s - l if alignment == "bottom_right" else 0
    out, lse = _run(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, block_kv=block_kv,
                    stages=stages)
    empty = _check(q, k, v, out, lse, scale=scale, causal=causal, alignment=alignment)
    assert empty.any() == (alignment == "bottom_right" and l > s)


def _feature_case(b, l, s, hq, hk, *, causal=False, alignment="top_left", window=None, softcap=None, sinks=False,
                  block_kv=64, stages=2, dtype=jnp.float16, d=64, programs=None, compute_wgs=2, scores_first=None):
    """Runs the kernel on fresh inputs with the features given and checks it against the oracle;
    returns the rows that see no key."""
    rng = np.random.default_rng()
    q, k, v = _inputs(rng, b, l, s, hq, hk, d, dtype)
    sink_logits = jnp.asarray(rng.uniform(-1.0, 3.0, hq), jnp.float32) if sinks else None
    scale = 0.8 / d ** 0.5
    diag_offset = s - l if alignment == "bottom_right" else 0
    out, lse = _run(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, window=window, softcap=softcap,
                    sinks=sink_logits, block_kv=block_kv, stages=stages, programs=programs, compute_wgs=compute_wgs,
                    scores_first=scores_first)
    assert out.shape == (b, l, hq, d) and lse.shape == (b, hq, l)
    return _check(q, k, v, out, lse, scale=scale, causal=causal, alignment=alignment, window=window,
                  softcap=softcap, sinks=sink_logits)


# (B, L, S, Hq, Hk, keywords of _feature_case); block_kv 64 and L, S up to ~300 keep the interpreter quick.
FEATURE_CASES = [
    # edge tiles: L, S not multiples of 2 * block_q = 128 and block_kv = 64, L != S both ways
    pytest.param(1, 97, 130, 4, 2, {}, id="edge-97x130-gqa"),
    pytest.param(1, 1, 1, 2, 1, dict(causal=True), id="edge-1x1-causal"),
    pytest.param(1, 130, 1, 1, 1, {}, id="edge-130x1"),
    pytest.param(1, 1, 300, 2, 2, dict(causal=True, alignment="bottom_right", dtype=jnp.bfloat16),
                 id="edge-1x300-causal-br-bf16"),
    pytest.param(2, 200, 70, 2, 2, dict(causal=True, alignment="bottom_right"), id="edge-200x70-causal-br-empty"),
    pytest.param(1, 97, 130, 2, 1, dict(causal=True, block_kv=128, stages=3), id="edge-97x130-causal-bkv128"),
    pytest.param(1, 70, 200, 2, 2, dict(causal=True, compute_wgs=3), id="edge-70x200-three-wgs-two-idle"),
    pytest.param(1, 200, 70, 2, 2, dict(causal=True, alignment="bottom_right", compute_wgs=3),
                 id="edge-200x70-three-wgs-causal-br-empty"),
    # 128-key blocks: a warpgroup whose last block it sees only the first half of walks that half
    pytest.param(1, 256, 256, 2, 1, dict(causal=True, block_kv=128), id="causal-bkv128-halves"),
    pytest.param(1, 200, 330, 2, 2, dict(window=(90, 20), alignment="bottom_right", softcap=3.0, sinks=True,
                                          block_kv=128, dtype=jnp.bfloat16), id="window-br-bkv128-halves"),
    # sliding windows, one- and two-sided, both alignments, left 0
    pytest.param(1, 130, 200, 2, 2, dict(window=(32, -1)), id="window-left-only"),
    pytest.param(1, 97, 150, 2, 1, dict(window=(-1, 16), alignment="bottom_right"), id="window-right-only-br"),
    # rows 100..127 are padding: the tile's key blocks end where row 99's do, so no warpgroup may walk
    # further for its padded rows (the memory warpgroup never loads those blocks)
    pytest.param(1, 100, 300, 2, 1, dict(window=(-1, 20)), id="window-right-only-padded-rows"),
    pytest.param(1, 97, 260, 4, 2, dict(window=(20, 40), alignment="bottom_right"), id="window-two-sided-br-gqa"),
    pytest.param(1, 128, 128, 2, 2, dict(window=(0, 16)), id="window-left0"),
    pytest.param(1, 130, 130, 1, 1, dict(window=(0, 0)), id="window-diagonal-only"),
    pytest.param(1, 150, 300, 2, 2, dict(window=(48, -1), causal=True, alignment="bottom_right",
                                          dtype=jnp.bfloat16), id="window-causal-br-bf16"),
    pytest.param(1, 200, 70, 2, 2, dict(window=(5, 5), alignment="bottom_right"), id="window-br-l>s-empty"),
    # soft cap, sinks, combinations
    pytest.param(1, 97, 130, 2, 2, dict(softcap=5.0), id="softcap"),
    pytest.param(1, 256, 256, 2, 1, dict(softcap=2.0, causal=True, dtype=jnp.bfloat16), id="softcap-causal-bf16"),
    # a cap above FIXED_MAX_MOST_CAP_LOG2 / log2(e) (43.7): the running row maximum
    pytest.param(1, 97, 130, 2, 1, dict(softcap=50.0, causal=True, sinks=True), id="softcap-50-running-max"),
    pytest.param(1, 130, 97, 4, 2, dict(sinks=True), id="sinks-gqa"),
    pytest.param(1, 200, 70, 2, 2, dict(sinks=True, window=(5, 5), alignment="bottom_right"),
                 id="sinks-window-br-empty"),
    pytest.param(1, 150, 230, 4, 2, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True,
                                          alignment="bottom_right", dtype=jnp.bfloat16), id="all-features-gqa-bf16"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, kw", FEATURE_CASES)
def test_features_against_float64_oracle(b, l, s, hq, hk, kw, request):
    empty = _feature_case(b, l, s, hq, hk, **kw)
    assert empty.any() == request.node.callspec.id.endswith("-empty")  # the empty-row cases have some


# A persistent grid: fewer programs than tiles, each walking several in turn (the ring's slots and the
# two Q/O slots carried from tile to tile, tiles of different walk lengths, tiles with no key block).
PERSISTENT_CASES = [
    pytest.param(2, 256, 256, 4, 2, dict(causal=True, programs=3), id="causal-gqa-16-tiles-3-programs"),
    pytest.param(2, 200, 70, 2, 2, dict(causal=True, alignment="bottom_right", programs=1),
                 id="causal-br-8-tiles-1-program-empty"),
    pytest.param(1, 97, 130, 2, 1, dict(stages=3, programs=1), id="stages3-2-tiles-1-program"),
    pytest.param(1, 150, 230, 4, 2, dict(window=(24, 8), softcap=4.0, sinks=True, causal=True,
                                          alignment="bottom_right", dtype=jnp.bfloat16, programs=3),
                 id="all-features-8-tiles-3-programs"),
    pytest.param(2, 384, 384, 2, 1, dict(causal=True, block_kv=128, programs=2), id="causal-bkv128-halves-2-programs"),
    # Head dim 256: one Q/O slot per warpgroup (two do not fit beside the ring), freed at each tile's end.
    pytest.param(2, 200, 230, 2, 1, dict(d=256, causal=True, alignment="bottom_right", window=(60, -1), softcap=3.0,
                                          sinks=True, dtype=jnp.bfloat16, programs=3),
                 id="d256-one-q-slot-8-tiles-3-programs"),
    # Three compute warpgroups (192-row tiles, the turn passed round as a token): a tile whose last
    # warpgroups hold only padded rows walks nothing for them; 128-key blocks halve some last blocks.
    pytest.param(2, 200, 330, 4, 2, dict(compute_wgs=3, causal=True, alignment="bottom_right", block_kv=128,
                                          programs=3), id="three-wgs-causal-br-gqa-3-programs"),
    pytest.param(1, 400, 300, 2, 1, dict(compute_wgs=3, window=(60, 20), softcap=3.0, sinks=True, dtype=jnp.bfloat16,
                                          programs=2), id="three-wgs-all-features-2-programs-empty"),
]


@pytest.mark.parametrize("b, l, s, hq, hk, kw", PERSISTENT_CASES)
def test_persistent_grid_against_float64_oracle(b, l, s, hq, hk, kw, request):
    empty = _feature_case(b, l, s, hq, hk, **kw)
    assert empty.any() == request.node.callspec.id.endswith("-empty")


# The other order of a step (`scores_first`: a block's Q K^T issued before the last block's P V, whose P
# rides in the carry): walks whose first step is masked, unmasked or a lone half block, walks that end
# on half a block (its own P V) or a whole one (the P V after the loops), empty walks, tiles in turn.
SCORES_FIRST_CASES = [case for case in FEATURE_CASES + PERSISTENT_CASES if case.id in (
    "edge-97x130-gqa", "edge-1x1-causal", "edge-200x70-causal-br-empty", "edge-97x130-causal-bkv128",
    "causal-bkv128-halves", "window-br-bkv128-halves", "window-left-only", "window-right-only-padded-rows",
    "window-two-sided-br-gqa", "softcap-50-running-max", "sinks-window-br-empty", "all-features-gqa-bf16",
    "causal-br-8-tiles-1-program-empty", "all-features-8-tiles-3-programs", "causal-bkv128-halves-2-programs",
    "d256-one-q-slot-8-tiles-3-programs", "three-wgs-causal-br-gqa-3-programs")]


@pytest.mark.parametrize("b, l, s, hq, hk, kw", SCORES_FIRST_CASES)
def test_scores_first_against_float64_oracle(b, l, s, hq, hk, kw, request):
    empty = _feature_case(b, l, s, hq, hk, scores_first=True, **kw)
    assert empty.any() == request.node.callspec.id.endswith("-empty")


def test_scores_first_by_default_at_head_dim_128_on_walks_from_8192_keys():
    assert scores_first_default(128, SCORES_FIRST_MIN_KEYS) and scores_first_default(128, 16384)
    assert not scores_first_default(128, SCORES_FIRST_MIN_KEYS - 1)
    assert not scores_first_default(64, 16384) and not scores_first_default(256, 16384)
    # causal (right 0, left unbounded) walks up to every key; a window bounded on both sides does not
    assert scores_first_default(128, 16384, (-1, 0)) and scores_first_default(128, 16384, (None, 0))
    assert not scores_first_default(128, 16384, (1024, 0), tile_rows=128)
    assert scores_first_default(128, 16384, (8192, 0), tile_rows=128)
    assert not scores_first_default(128, 16384, (SCORES_FIRST_MIN_KEYS - 129, 0), tile_rows=128)


@pytest.mark.parametrize("softcap, dtype", [(30.0, jnp.bfloat16), (43.0, jnp.bfloat16), (50.0, jnp.bfloat16),
                                            (30.0, jnp.float16)], ids=["30-bf16", "43-bf16", "50-bf16", "30-fp16"])
def test_rows_capped_far_below_zero_against_float64_oracle(softcap, dtype):
    """Rows whose every score lies far below -softcap (tanh near -1). In bf16 up to a cap of 43.7 the
    softmax subtracts A = softcap * log2(e) instead of a running maximum (FIXED_MAX_MOST_CAP_LOG2), so
    these rows' exponentials are about 2^-2A: still normal floats (flushed to 0 on the GPU, and in
    float16, otherwise), the rows keep a positive sum and their output is an even mix of the V rows
    they see."""
    rng = np.random.default_rng()
    b, l, s, h, d = 1, 130, 200, 2, 64
    q, k, v = _inputs(rng, b, l, s, h, h, d, dtype)
    q = q.at[:, :64].set(20.0)  # rows 0-63: scale * q.k about -230 with every key below
    k = -jnp.abs(k) - 1.0
    scale = 0.8 / d ** 0.5
    out, lse = _run(q, k, v, scale=scale, causal=True, softcap=softcap)
    _check(q, k, v, out, lse, scale=scale, causal=True, softcap=softcap)
    assert np.all(np.isfinite(lse[:, :, :64])) and np.all(lse[:, :, :64] < -softcap + 10)


def _fold(x):
    """(B, T, H, D) -> (B * H, T, 1, D): (batch, head) pairs folded into the batch."""
    b, t, h, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b * h, t, 1, d)


@pytest.mark.parametrize("programs", [None, 3], ids=["per-tile", "persistent"])
def test_gqa_folded_into_the_batch_against_float64_oracle(programs):
    """(batch, head) pairs folded into the batch with GQA (as the torch launcher passes contiguous
    (B, H, T, D) memory): q (B * Hq, L, 1, D) reads k, v (B * Hk, S, 1, D), query pair b * Hq + h
    the KV pair b * Hk + h // (Hq / Hk)."""
    rng = np.random.default_rng()
    b, l, s, hq, hk, d = 2, 200, 260, 4, 2, 64
    q, k, v = _inputs(rng, b, l, s, hq, hk, d, jnp.float16)
    scale = 0.8 / d ** 0.5
    out, lse = _run(_fold(q), _fold(k), _fold(v), scale=scale, causal=True, diag_offset=s - l, window=(40, -1),
                    programs=programs)
    assert out.shape == (b * hq, l, 1, d) and lse.shape == (b * hq, 1, l)
    out = out.reshape(b, hq, l, d).transpose(0, 2, 1, 3)
    _check(q, k, v, out, lse.reshape(b, hq, l), scale=scale, causal=True, alignment="bottom_right", window=(40, -1))


@pytest.mark.thorough
@pytest.mark.parametrize("l, s, alignment, window, causal", feature_grid())
@pytest.mark.parametrize("extras", [{}, dict(softcap=3.0, sinks=True)], ids=["plain", "softcap-sinks"])
def test_feature_grid_against_float64_oracle(l, s, alignment, window, causal, extras):
    _feature_case(1, l, s, 2, 1, causal=causal, alignment=alignment, window=window, **extras)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_keys_outside_every_band_are_never_read(alignment):
    """Key blocks no query row sees hold NaN in K and V: a kernel that ran a block of them through
    its softmax (even masked: 0 * NaN) would return NaN. Window (0, 0) with L = 128 < S = 320 leaves
    keys 128.. (top-left) or ..191 (bottom-right) unseen, whole 64-key blocks of them."""
    l, s, rng = 128, 320, np.random.default_rng()
    q, k, v = _inputs(rng, 1, l, s, 2, 1, 64, jnp.float16)
    seen = slice(0, l) if alignment == "top_left" else slice(s - l, s)
    unseen = np.ones(s, bool)
    unseen[seen] = False
    poison = jnp.asarray(unseen)[None, :, None, None]
    kp, vp = (jnp.where(poison, jnp.asarray(np.nan, x.dtype), x) for x in (k, v))
    out, lse = _run(q, kp, vp, scale=0.125, causal=False, diag_offset=s - l if alignment == "bottom_right" else 0,
                    window=(0, 0), block_kv=64)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    clean = (jnp.where(poison, jnp.zeros((), x.dtype), x) for x in (k, v))  # same math: the oracle's inputs
    _check(q, *clean, out, lse, scale=0.125, alignment=alignment, window=(0, 0))


def test_tiles_kernel_masks_keys_past_kv_len():
    """The bare kernel on whole tiles with kv_len < S: keys from kv_len on (here large finite
    padding, which would dominate every row it reached) are masked; padded query rows are computed
    like the others and dropped by the caller."""
    l, s, kv_len, rng = 128, 192, 150, np.random.default_rng()
    q, k, v = _inputs(rng, 1, l, s, 2, 2, 64, jnp.float16)
    k = k.at[:, kv_len:].set(30.0)
    v = v.at[:, kv_len:].set(1000.0)
    # Bottom-right for 100 true query rows, and no right edge: every row would reach the padding.
    out, lse = _run(q, k, v, fn=flash_forward_mgpu_tiles, scale=0.125, causal=False, window=(40, -1),
                    kv_len=kv_len, diag_offset=kv_len - 100, block_kv=64)
    q_true = q[:, :100]  # rows 100.. are padding: computed, then dropped here
    _check(q_true, k[:, :kv_len], v[:, :kv_len], out[:, :100], lse[:, :, :100], scale=0.125, window=(40, -1),
           alignment="bottom_right")


def test_whole_tiles_take_no_copy():
    """With whole tiles the public function is the kernel call and nothing else (no pad, no slice),
    which `plgpu.as_torch_kernel` needs; otherwise it pads and slices around that one call."""
    def primitives(l, s):
        q = jax.ShapeDtypeStruct((1, l, 2, 64), jnp.float16)
        kv = jax.ShapeDtypeStruct((1, s, 2, 64), jnp.float16)
        jaxpr = jax.make_jaxpr(lambda q, k, v: flash_forward_mgpu(q, k, v, scale=0.1, causal=True))(q, kv, kv)
        return [str(e.primitive) for e in jaxpr.jaxpr.eqns]
    assert primitives(256, 384) == ["custom_vmap_call"]
    padded = primitives(97, 130)
    assert padded.count("custom_vmap_call") == 1 and "slice" in padded and len(padded) > 1
    assert padded_lengths(97, 130, block_q=64, block_kv=128) == (128, 256)
    assert padded_lengths(128, 256, block_q=64, block_kv=64) == (128, 256)


LOWERING_CASES = [
    pytest.param(dict(causal=True), id="causal"),
    pytest.param(dict(causal=False, window=(20, 5)), id="window-two-sided"),
    pytest.param(dict(causal=True, window=(3, -1), diag_offset=33), id="window-causal-offset"),
    pytest.param(dict(causal=False, window=(-1, 7)), id="window-right-only"),
    pytest.param(dict(causal=False, softcap=5.0), id="softcap"),
    pytest.param(dict(causal=False, sinks=True), id="sinks"),
    pytest.param(dict(causal=True, softcap=3.0, sinks=True, window=(9, 2)), id="all"),
    pytest.param(dict(causal=True, softcap=3.0, sinks=True, window=(9, 2), programs=3), id="all-persistent"),
    pytest.param(dict(causal=True, d=256, block_kv=64), id="d256"),
    pytest.param(dict(causal=True, softcap=3.0, sinks=True, window=(9, 2), programs=3, d=256, block_kv=64),
                 id="d256-all-persistent"),
    pytest.param(dict(causal=True, compute_wgs=3, block_kv=128, programs=3), id="three-wgs-persistent"),
    pytest.param(dict(causal=False, softcap=3.0, sinks=True, window=(9, 2), compute_wgs=3), id="three-wgs-all"),
    pytest.param(dict(causal=True, block_kv=128, scores_first=True), id="scores-first-causal-halves"),
    pytest.param(dict(causal=True, softcap=3.0, sinks=True, window=(9, 2), programs=3, scores_first=True),
                 id="scores-first-all-persistent"),
    pytest.param(dict(causal=True, d=256, block_kv=64, scores_first=True), id="scores-first-d256"),
    pytest.param(dict(causal=True, compute_wgs=3, block_kv=128, programs=3, scores_first=True),
                 id="scores-first-three-wgs-persistent"),
]


@pytest.mark.parametrize("kw", LOWERING_CASES)
@pytest.mark.parametrize("lengths", [(256, 384), (97, 130)], ids=["whole-tiles", "edge-tiles"])
def test_lowers_for_hopper(kw, lengths):
    """Every feature lowers to one Mosaic GPU kernel on the GPU path (layouts, masks, tanh, the sink's
    scalar load), which the interpreter never exercises; lowering needs no GPU."""
    kw = dict(kw)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32) if kw.pop("sinks", False) else None
    l, s = lengths
    d = kw.pop("d", 64)
    q = jax.ShapeDtypeStruct((1, l, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, s, 2, d), jnp.bfloat16)

    def forward(q, k, v, sinks):
        return flash_forward_mgpu(q, k, v, scale=0.1, sinks=sinks, **kw)
    text = jax.jit(forward).trace(q, k, k, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1
    # Launched with programmatic dependent launch (jax >= 0.11), it waits for the kernel before it on
    # the stream before touching memory, and lets the next one start early.
    assert "griddepcontrol.wait;" in text and "griddepcontrol.launch_dependents;" in text


@pytest.mark.parametrize("programs", [None, 132], ids=["per-tile", "persistent"])
def test_gqa_folded_into_the_batch_lowers_for_hopper(programs):
    """The folded batches (q (B * Hq, L, 1, D) reading k, v (B * Hk, S, 1, D)) lower too, sinks per query
    pair included (the torch launcher's whole-tile call)."""
    q = jax.ShapeDtypeStruct((8, 256, 1, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 384, 1, 128), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((8, 1), jnp.float32)

    def forward(q, k, v, sinks):
        return flash_forward_mgpu_tiles(q, k, v, scale=0.1, causal=True, window=(100, 0), sinks=sinks,
                                        programs=programs)
    text = jax.jit(forward).trace(q, k, k, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1


def test_a_kv_batch_that_does_not_divide_the_query_batch_is_rejected():
    q = jnp.zeros((3, 128, 2, 64), jnp.float16)
    k = jnp.zeros((2, 256, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match=r"k.shape=\(2, 256, 2, 64\), v.shape=\(2, 256, 2, 64\): expected both "
                                         r"\(Bk, S, Hk, D=64\) with Bk dividing q's batch B=3; hint"):
        flash_forward_mgpu(q, k, k, scale=0.1, causal=True)


@pytest.mark.parametrize("kw, match", [
    (dict(d=80), r"head_dim=80: expected one of \(64, 128, 256\); hint: use the Triton flash kernel"),
    (dict(hk=3, hq=4), r"query heads 4, KV heads 3"),
    (dict(dtype=jnp.float32), r"q.dtype=float32: expected bfloat16 or float16"),
    (dict(l=0), r"query length L=0, key length S=256: expected both at least 1"),
    (dict(stages=1), r"stages=1: expected at least 2"),
    (dict(stages=3, d=128), r"stages=3, block_kv=128, head_dim=128: 229376 bytes of shared-memory buffers"),
    # a program walking several tiles falls back to one Q/O slot where two do not fit, not to an error
    (dict(stages=3, d=128, programs=1), r"stages=3, block_kv=128, head_dim=128: 229376 bytes"),
    (dict(d=256, block_kv=128), r"stages=2, block_kv=128, head_dim=256: 327680 bytes .*hint: fewer stages or a "
                                r"smaller block_kv"),
    (dict(programs=0), r"programs=0: expected None \(one program per item of work\) or a positive int"),
    (dict(programs=2.0), r"programs=2.0: expected None"),
    (dict(scale=-1.0), r"scale=-1.0: expected a positive"),
    (dict(diag_offset=1.5), r"diag_offset=1.5: expected a Python int"),
    (dict(window=(4,)), r"window=\(4,\): expected None or \(left, right\), two ints >= -1"),
    (dict(window=(-2, 0)), r"window=\(-2, 0\): expected None or \(left, right\)"),
    (dict(window=(1.0, 2)), r"window=\(1.0, 2\): expected None"),
    (dict(softcap=0.0), r"softcap=0.0: expected None or a positive finite Python float"),
    (dict(softcap=float("inf")), r"softcap=inf: expected None or a positive"),
    (dict(sinks=np.zeros(3, np.float32)),
     r"sinks of shape \(3,\) and dtype float32: expected a float32 array of shape \(Hq,\) = \(2,\)"),
    (dict(sinks=np.zeros(2, np.float16)), r"sinks of shape \(2,\) and dtype float16: expected a float32"),
])
def test_rejects_bad_arguments(kw, match):
    kw = dict(kw)
    shape = dict(b=1, l=128, s=256, hq=2, hk=2, d=64, dtype=jnp.float16) | {
        key: kw.pop(key) for key in ("l", "s", "hq", "hk", "d", "dtype") if key in kw}
    q, k, v = _inputs(np.random.default_rng(0), **shape)
    kw = dict(scale=0.125, causal=True) | kw
    with pytest.raises(ValueError, match=match):
        flash_forward_mgpu(q, k, v, **kw)


@pytest.mark.parametrize("l, s, kw, match", [
    (192, 256, {}, r"query length L=192: expected a multiple of 2 \* block_q = 128; hint: flash_forward_mgpu pads"),
    (128, 160, {}, r"key length S=160: expected a multiple of block_kv=128"),
    (128, 256, dict(kv_len=128), r"kv_len=128: expected an int in \(128, 256\]"),
    (128, 256, dict(kv_len=257), r"kv_len=257: expected an int in \(128, 256\]"),
    (128, 256, dict(kv_len=200.0), r"kv_len=200.0: expected an int"),
    # tma_edges: lengths in whole 8-row TMA tiles, on the GPU only
    (100, 136, dict(tma_edges=True), r"query length L=100, key length S=136 with tma_edges=True: expected "
                                     r"multiples of 8"),
    (104, 130, dict(tma_edges=True), r"S=130 with tma_edges=True: expected multiples of 8 .*hint: tma_edges=False and "
                                     r"whole tiles, flash_forward_mgpu pads"),
    (104, 136, dict(tma_edges=True, interpret=True), r"tma_edges=True with interpret-mode parameters: expected a GPU"),
])
def test_tiles_kernel_rejects_partial_tiles(l, s, kw, match):
    kw = dict(kw, interpret=InterpretGPUParams() if kw.get("interpret") else None)
    q, k, v = _inputs(np.random.default_rng(0), 1, l, s, 2, 2, 64, jnp.float16)
    with pytest.raises(ValueError, match=match):
        flash_forward_mgpu_tiles(q, k, v, scale=0.125, causal=True, **kw)


@pytest.mark.parametrize("kw", [pytest.param(dict(causal=True), id="causal"),
                                pytest.param(dict(causal=True, softcap=3.0, window=(9, 2), sinks=True), id="all"),
                                pytest.param(dict(causal=True, programs=132), id="persistent"),
                                pytest.param(dict(causal=True, programs=132, compute_wgs=3), id="three-wgs")])
@pytest.mark.parametrize("d, block_kv", [(64, 128), (64, 256), (128, 128), (256, 64)])
def test_tma_edges_lower_for_hopper(kw, d, block_kv):
    """With `tma_edges` the kernel takes lengths in 8-row tiles in place (L = 104, S = 136: its last
    query and key tiles run past them) and still lowers to one Mosaic GPU kernel; Mosaic GPU refuses
    such copies below whole 8-row tiles (`TMA_ROWS`). Running it needs the GPU (the interpreter
    refuses copies past an array's end): `test_gpu_hopper.py`."""
    kw = dict(kw)
    sinks = jax.ShapeDtypeStruct((4,), jnp.float32) if kw.pop("sinks", False) else None
    q = jax.ShapeDtypeStruct((2, 104, 4, d), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 136, 2, d), jnp.bfloat16)

    def forward(q, k, v, sinks):
        return flash_forward_mgpu_tiles(q, k, v, scale=0.1, sinks=sinks, block_kv=block_kv, tma_edges=True, **kw)
    if kw.get("compute_wgs") == 3 and d != 64:  # three accumulators of wider heads do not fit in the registers
        with pytest.raises(ValueError, match=rf"compute_wgs=3 at head_dim={d}: expected 2, or 3 at head dims \(64,\)"):
            jax.jit(forward).trace(q, k, k, sinks)
        return
    text = jax.jit(forward).trace(q, k, k, sinks).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu") == 1

