"""`jax_core.visibility.Visibility` against a brute-force definition written here in plain Python.

The oracle loops over every (query, key) pair and states the rule directly: a key is visible iff it
is not after the query's diagonal position (causal), and within `left` before / `right` after it.
"""

from __future__ import annotations

import itertools
import random

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.jax_core.capabilities import FEATURES
from jaxattn.jax_core.visibility import Band, Visibility, band_flash_settings

WINDOWS = [(-1, -1), (5, -1), (-1, 3), (4, 2), (0, 0)]
SIZES = [(97, 130), (97, 40), (33, 33), (1, 130)]


def sees(i_pos: int, j: int, causal: bool, window: tuple[int, int]) -> bool:
    """Whether a query at diagonal position i_pos sees key j."""
    left, right = window
    if causal and j > i_pos:
        return False
    if left != -1 and j < i_pos - left:
        return False
    if right != -1 and j > i_pos + right:
        return False
    return True


def brute_dense(t: int, s: int, causal: bool, alignment: str, window) -> np.ndarray:
    out = np.zeros((t, s), bool)
    for i in range(t):
        i_pos = i + (s - t if alignment == "bottom_right" else 0)
        for j in range(s):
            out[i, j] = sees(i_pos, j, causal, window)
    return out


def brute_varlen(lens_q, lens_k, t: int, s: int, causal, alignment, window) -> np.ndarray:
    """Packed sequences with local positions; rows/columns past the last sequence see nothing."""
    out = np.zeros((t, s), bool)
    q0 = k0 = 0
    for lq, lk in zip(lens_q, lens_k):
        for i in range(lq):
            i_pos = i + (lk - lq if alignment == "bottom_right" else 0)
            for j in range(lk):
                out[q0 + i, k0 + j] = sees(i_pos, j, causal, window)
        q0, k0 = q0 + lq, k0 + lk
    return out


def brute_cache(lengths, starts, t: int, s: int, causal, alignment, window) -> np.ndarray:
    """Decode's convention: query q at length - T + q (bottom-right) or length - S + q (top-left)."""
    out = np.zeros((len(lengths), t, s), bool)
    for b, (length, start) in enumerate(zip(lengths, starts)):
        length, start = min(length, s), max(start, 0)
        for q in range(t):
            pos = length - t + q if alignment == "bottom_right" else length - s + q
            for j in range(start, length):
                out[b, q, j] = sees(pos, j, causal, window)
    return out


RULES = list(itertools.product([False, True], ["top_left", "bottom_right"], WINDOWS))


@pytest.mark.parametrize("t,s", SIZES)
def test_dense_matches_brute_force(t, s):
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        got = np.asarray(rule.dense(t, s))
        np.testing.assert_array_equal(got, brute_dense(t, s, causal, alignment, window),
                                      err_msg=f"{rule} T={t} S={s}")


@pytest.mark.parametrize("t,s", SIZES)
def test_band_and_flash_settings_agree_with_dense(t, s):
    """A key is visible iff j - i lies in the band; the flash kernels' (causal, diag_offset, window)
    rule, evaluated as the kernel contract states it, keeps exactly the same keys."""
    i = np.arange(t)[:, None]
    j = np.arange(s)[None, :]
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        dense = brute_dense(t, s, causal, alignment, window)
        lo, hi = rule.band(t, s)
        in_band = np.ones((t, s), bool)
        if lo is not None:
            in_band &= j - i >= lo
        if hi is not None:
            in_band &= j - i <= hi
        np.testing.assert_array_equal(in_band, dense, err_msg=f"band {lo, hi} of {rule}")
        settings = rule.flash_settings(t, s)
        kernel = np.array([[sees(a + settings["diag_offset"], b, settings["causal"], settings["window"])
                            for b in range(s)] for a in range(t)])
        np.testing.assert_array_equal(kernel, dense, err_msg=f"flash settings {settings} of {rule}")
        # ...and the band expressed back in kernel terms (ring attention's block kernels) keeps it too.
        causal_k, diag, win = band_flash_settings(Band(lo, hi))
        again = np.array([[sees(a + diag, b, causal_k, win) for b in range(s)] for a in range(t)])
        np.testing.assert_array_equal(again, dense, err_msg=f"band_flash_settings({lo, hi}) of {rule}")


def test_varlen_matches_brute_force():
    rng = random.Random(7)
    lens_q = [rng.randint(0, 30) for _ in range(5)] + [1, 13]
    lens_k = [rng.randint(0, 45) for _ in range(5)] + [40, 2]
    t, s = sum(lens_q) + 3, sum(lens_k) + 5  # padding rows and columns past the last sequence
    cu_q, cu_k = (jnp.asarray(np.concatenate([[0], np.cumsum(x)]), jnp.int32) for x in (lens_q, lens_k))
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        got = np.asarray(rule.varlen_dense(cu_q, cu_k, t, s))
        np.testing.assert_array_equal(got, brute_varlen(lens_q, lens_k, t, s, causal, alignment, window),
                                      err_msg=str(rule))
        if rule.restricts:  # packed sequences may each have T != S: bottom-right matters even when Tq == Tk
            for packed in ((t, s), (t, t)):
                names = rule.features(*packed, varlen=True)
                assert ("causal_bottom_right" in names) == (alignment == "bottom_right"), (rule, packed)


@pytest.mark.parametrize("t,s", [(1, 130), (5, 97), (16, 40)])
def test_cache_matches_brute_force(t, s):
    rng = np.random.default_rng(t * 1000 + s)
    lengths = np.concatenate([rng.integers(0, s + 1, 5), [s, 0, s + 7, t - 1]])
    starts = np.concatenate([rng.integers(0, s // 2, 5), [0, 0, 3, -2]])
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        visible, written = rule.cache_dense(jnp.asarray(lengths), jnp.asarray(starts), t, s)
        want = brute_cache(lengths, starts, t, s, causal, alignment, window)
        np.testing.assert_array_equal(np.asarray(visible), want, err_msg=str(rule))
        want_written = np.array([[max(st, 0) <= j < min(n, s) for j in range(s)] for n, st in zip(lengths, starts)])
        np.testing.assert_array_equal(np.asarray(written), want_written)
        # the explicit kernel shift gives the same thing
        shifted, _ = rule.cache_dense(jnp.asarray(lengths), jnp.asarray(starts), t, s,
                                      pos_shift=rule.cache_pos_shift(t, s))
        np.testing.assert_array_equal(np.asarray(shifted), want)
    # a full cache (lengths = S) is the plain (T, S) rule for either alignment
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        full, _ = rule.cache_dense(jnp.full((2,), s), None, t, s)
        np.testing.assert_array_equal(np.asarray(full[1]), brute_dense(t, s, causal, alignment, window))


def test_features():
    for causal, alignment, window in RULES:
        rule = Visibility(causal, alignment, window)
        for t, s in ((4, 9), (9, 9)):
            names = rule.features(t, s)
            assert names <= FEATURES
            assert ("sliding_window" in names) == (window != (-1, -1))
            shifted = alignment == "bottom_right" and t != s
            positional = "causal_bottom_right" if shifted else "causal"
            assert (positional in names) == (causal or (shifted and window != (-1, -1)))
            # the name asks exactly for what differs from top-left: the band moves when T != S
            if not shifted and rule.restricts:
                assert rule.band(t, s) == Visibility(causal, "top_left", window).band(t, s)


def test_value_is_hashable_and_validated():
    assert Visibility.of(True, "bottom_right", [3, -1]) == Visibility(True, "bottom_right", (3, -1))
    assert len({Visibility(), Visibility.of(False, "top_left", None), Visibility(window=(-1, -1))}) == 1
    with pytest.raises(ValueError, match=r"causal_alignment='diagonal'.*'top_left' or 'bottom_right'"):
        Visibility.of(True, "diagonal")
    with pytest.raises(ValueError, match=r"sliding_window=\(-2, 0\).*ints >= -1"):
        Visibility.of(False, "top_left", (-2, 0))
    with pytest.raises(ValueError, match=r"window=\(1, 2, 3\)"):
        Visibility(window=(1, 2, 3))
    with pytest.raises(ValueError, match=r"window=\(1.5, 0\)"):
        Visibility(window=(1.5, 0))
    with pytest.raises(ValueError, match="causal=1"):
        Visibility(causal=1)
