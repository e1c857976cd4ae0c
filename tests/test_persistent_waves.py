"""How the Hopper kernels' persistent grids deal their items (`jax_core/kernels/persistent_waves.py`):
every item exactly once, the programs' causal totals level, and, taken a few heads at a time, the
items of one group of heads before the next one's (so the programs working at once share the data of
few heads in L2). Pure arithmetic: the kernels' oracle tests (`test_flash_mgpu.py`,
`test_flash_mgpu_bwd.py`, `persistent` cases) run the dealing through the kernels."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from jaxattn.jax_core.kernels.persistent_waves import GroupedWaves, Waves, l2_group, waves  # noqa: E402


def _dealt(dealing):
    """(item numbers, programs' item counts): numbers[p, j] for j < counts[p]."""
    p, j = np.meshgrid(np.arange(dealing.programs, dtype=np.int32), np.arange(dealing.per_program, dtype=np.int32),
                       indexing="ij")
    return dealing.item(p, j), dealing.count(np.arange(dealing.programs, dtype=np.int32))


# (columns, blocks, programs): the head-dim-128 forward and backward at (2, 16, 8192) and (1, 16,
# 16384), head dim 64 at (4, 16, 4096) and (16, 16, 1024), small grids, columns with few divisors.
SHAPES = [(32, 64, 132), (16, 128, 132), (64, 32, 132), (64, 16, 132), (256, 8, 132), (256, 4, 132),
          (6, 5, 3), (7, 9, 4), (12, 3, 5), (25, 64, 132), (8, 40, 16)]


@pytest.mark.parametrize("columns, blocks, programs", SHAPES)
def test_every_item_is_dealt_once(columns, blocks, programs):
    dealing = waves(columns * blocks, programs, columns=columns)
    numbers, counts = _dealt(dealing)
    assert counts.max() == dealing.per_program
    taken = np.concatenate([numbers[p, :counts[p]] for p in range(dealing.programs)])
    np.testing.assert_array_equal(np.sort(taken), np.arange(columns * blocks))


@pytest.mark.parametrize("columns, blocks, programs", SHAPES)
def test_causal_totals_stay_level(columns, blocks, programs):
    """An item of block b walks blocks - b blocks (the kernels number the longest causal walks
    first): the busiest program does at most 1% more than with the ungrouped waves, and on a
    grid of 132 (an H100's or H200's multiprocessors) at most 4% more than the mean."""
    dealing = waves(columns * blocks, programs, columns=columns)
    numbers, counts = _dealt(dealing)
    totals = [sum(blocks - numbers[p, j] // columns for j in range(counts[p])) for p in range(dealing.programs)]
    assert programs < 132 or max(totals) <= 1.04 * np.mean(totals), (max(totals), np.mean(totals))
    plain = Waves(total=columns * blocks, programs=dealing.programs)
    numbers, counts = _dealt(plain)
    level = max(sum(blocks - numbers[p, j] // columns for j in range(counts[p])) for p in range(plain.programs))
    assert max(totals) <= 1.01 * level, (type(dealing).__name__, max(totals), level)


@pytest.mark.parametrize("columns, blocks, programs", [(32, 64, 132), (25, 64, 132), (12, 3, 5)])
def test_the_kernels_traced_dealing_is_the_one_weighed_on_the_host(columns, blocks, programs):
    """The kernels deal with traced int32 scalars; `l2_group` weighs groupings on NumPy arrays."""
    for group in [g for g in range(1, columns + 1) if columns % g == 0]:
        dealing = GroupedWaves(columns=columns, blocks=blocks, programs=programs, group=group)
        numbers, counts = _dealt(dealing)
        traced = jax.jit(jax.vmap(jax.vmap(dealing.item, (None, 0)), (0, None)))
        got = np.asarray(traced(np.arange(programs, dtype=np.int32), np.arange(dealing.per_program, dtype=np.int32)))
        np.testing.assert_array_equal(got, numbers)
        np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(dealing.count))(np.arange(programs, dtype=np.int32))),
                                      counts)


@pytest.mark.parametrize("columns, blocks, programs", [s for s in SHAPES if l2_group(*s) < s[0]])
def test_a_group_of_heads_is_walked_before_the_next(columns, blocks, programs):
    dealing = waves(columns * blocks, programs, columns=columns)
    assert isinstance(dealing, GroupedWaves)
    numbers, counts = _dealt(dealing)
    for p in range(dealing.programs):
        groups = (numbers[p, :counts[p]] % columns) // dealing.group
        assert (np.diff(groups) >= 0).all(), (p, groups)
    # The first item of every program: the first group's heads only.
    assert set((numbers[counts > 0, 0] % columns).tolist()) <= set(range(dealing.group))


@pytest.mark.parametrize("columns, blocks, programs, want", [
    (32, 64, 132, 4),     # (2, 16, 8192, 128): 4 heads' 256 tiles fill a wave of 132
    (16, 128, 132, 2),    # (1, 16, 16384, 128)
    (256, 8, 132, 32),    # (16, 16, 1024, 64) forward: 17 would do, 32 is the least divisor
    (13, 64, 132, 13),    # a prime: no group smaller than all
    (25, 64, 132, 25),    # 5 heads fill a wave, but five groups leave some programs 5% more
    (8, 400, 132, 1),
])
def test_the_group_is_the_fewest_columns_that_fill_a_wave(columns, blocks, programs, want):
    assert l2_group(columns, blocks, programs) == want


MB = 1 << 20


@pytest.mark.parametrize("columns, blocks, programs, column_bytes, want", [
    (8, 64, 132, 16 * MB, 2),    # backward (1, 8192, 32/8 heads, 64): 4 KV heads fill a wave but share 64 MB
    (16, 32, 132, 8 * MB, 4),    # (2, 4096, 32/8, 64): 8 would share 64 MB
    (32, 64, 132, 8 * MB, 4),    # (2, 16, 8192, 128): 32 MB, as without the bytes
    (16, 128, 132, 16 * MB, 2),  # (1, 16, 16384, 128)
    (16, 32, 132, 64 * MB, 4),   # 4 is over the bytes too, but 2 or 1 (64 or 32 items a group) would deal
                                 # the longest walks to the same programs in every group
    (13, 64, 132, 64 * MB, 13),  # a prime
])
def test_a_group_sharing_more_than_l2_holds_is_the_fewest_level_columns(columns, blocks, programs, column_bytes,
                                                                         want):
    assert l2_group(columns, blocks, programs, column_bytes) == want
    dealing = waves(columns * blocks, programs, columns=columns, column_bytes=column_bytes)
    assert (dealing.group if isinstance(dealing, GroupedWaves) else columns) == want
    numbers, counts = _dealt(dealing)
    taken = np.concatenate([numbers[p, :counts[p]] for p in range(dealing.programs)])
    np.testing.assert_array_equal(np.sort(taken), np.arange(columns * blocks))
    totals = [sum(blocks - numbers[p, j] // columns for j in range(counts[p])) for p in range(dealing.programs)]
    assert max(totals) <= 1.04 * np.mean(totals), (max(totals), np.mean(totals))


def test_one_program_per_item_and_single_groups_deal_as_before():
    assert waves(32 * 64, None, columns=32) == Waves(total=2048, programs=2048)
    assert waves(13 * 64, 132, columns=13) == Waves(total=832, programs=132)


def test_columns_must_divide_the_items():
    with pytest.raises(ValueError, match=r"columns=5: expected a divisor of the 12 items"):
        waves(12, 4, columns=5)
