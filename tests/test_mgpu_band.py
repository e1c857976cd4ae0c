"""The band mask on wgmma accumulators (`jax_core/kernels/mgpu_band.py`).

The GPU path compares each register with a constant, relying on the wgmma layout splitting a score's
(row, col) into a thread's part plus a register's part. Checked here against the accumulator
fragment layout PTX documents for wgmma.mma_async (m64nNk16, 32-bit accumulators): thread t of the
warpgroup holds rows 16 (t // 32) + (t % 32) // 4 + 8 i and columns 2 (t % 4) + 8 j + {0, 1}, repeated
every 64 rows. The masks' results on the GPU are checked by the kernels' oracle tests there.
"""

import itertools
import types

import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.jax_core.kernels.mgpu_band import keep_band, layout_offsets

mgpu = pytest.importorskip("jax.experimental.mosaic.gpu")


def ptx_wgmma_fragment(rows, cols):
    """{thread: {(row, col)}} of a (rows, cols) float32 wgmma accumulator, from PTX's documentation."""
    held = {}
    for t in range(128):
        warp, lane = divmod(t, 32)
        held[t] = {(64 * m + 16 * warp + lane // 4 + 8 * i, 8 * j + 2 * (lane % 4) + e)
                   for m, i, j, e in itertools.product(range(rows // 64), range(2), range(cols // 8), range(2))}
    return held


@pytest.mark.parametrize("shape", [(64, 64), (64, 128), (128, 64), (64, 256), (128, 128)])
def test_wgmma_offsets_split_into_thread_and_register_parts(shape):
    threads, registers, vector = layout_offsets(mgpu.WGMMA_LAYOUT, shape)
    assert vector == 2
    got = {t: {(rt + rr, ct + cr + e) for _, (rr, cr) in registers for e in range(vector)}
           for t, (rt, ct) in enumerate(threads)}
    # Threads may be enumerated in another order than PTX numbers them: compare the sets held.
    expected = ptx_wgmma_fragment(*shape)
    assert sorted(map(sorted, got.values())) == sorted(map(sorted, expected.values()))
    assert len(set().union(*got.values())) == shape[0] * shape[1]


def test_offsets_that_carry_are_refused():
    # The wgmma layout's registers for 128 columns, claimed for an array of 64: a register's column
    # offset plus a thread's would then run into the next row.
    wgmma = mgpu.WGMMA_LAYOUT
    wide = types.SimpleNamespace(tiling=wgmma.tiling, warp_dims=wgmma.warp_dims, lane_dims=wgmma.lane_dims,
                                 vector_length=wgmma.vector_length,
                                 registers_shape=lambda shape: wgmma.registers_shape((shape[0], 2 * shape[1])))
    with pytest.raises(NotImplementedError, match="carry"):
        layout_offsets(wide, (64, 64))


@pytest.mark.parametrize("diff", [1, -1])
def test_keep_band_off_the_gpu_matches_a_direct_band(diff):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    lo, hi, row_end, col_end = -37, 21, 50, 90
    got = np.asarray(keep_band(jnp.asarray(x), fill=-np.inf, diff=diff, lo=jnp.int32(lo), hi=jnp.int32(hi),
                               row_end=jnp.int32(row_end), col_end=jnp.int32(col_end), on_gpu=False))
    row, col = np.indices(x.shape)
    d = (col - row) * diff
    keep = (d >= lo) & (d <= hi) & (row < row_end) & (col < col_end)
    np.testing.assert_array_equal(got, np.where(keep, x, -np.inf))
    assert 0 < keep.sum() < keep.size


def test_keep_band_checks_its_direction():
    with pytest.raises(ValueError, match="diff=2"):
        keep_band(jnp.zeros((64, 64)), fill=0.0, diff=2, lo=0, on_gpu=False)
