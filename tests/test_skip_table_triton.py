"""The block-skip table written by the Triton kernel equals the jnp table of `flash_jax_triton`.

Both launches run here under Triton's interpreter: the torch one (CPU tensors, the entry with
runtime sizes and strides) and the JAX one (through the jax-triton stand-in, the all-constexpr
entry). The oracle is `flash_jax_triton.skip_table` over `visibility_tiles` at the kernel's own
tile. Masks are drawn per (block_m x block_n) tile, so whole tiles are dead, and sparse inside live
tiles, so a single visible element must keep a tile live.

Shape legend: B batch, H heads, L query length, S key length; masks / biases (B|1, H|1, L|1, S|1).
"""

import inspect

import jax.numpy as jnp
import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from thorough_grid import grid  # noqa: E402

# The torch launch runs compiled on a CUDA machine, interpreted elsewhere.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402
from jaxattn.jax_core.kernels import skip_table_triton as st  # noqa: E402
from jaxattn.jax_core.kernels.skip_table_jax import skip_table_jax  # noqa: E402

L, S = 97, 130  # neither a multiple of any tile


def _sparse_mask(gen, dims, tile, p_tile=0.5, p_elem=0.05):
    """int8 mask of `dims`: each tile dead with probability 1 - p_tile, else p_elem of it visible."""
    b, h, l, s = dims
    tm, tn = min(tile[0], l), min(tile[1], s)
    tiles = torch.rand(b, h, -(-l // tm), -(-s // tn), generator=gen) < p_tile
    live = tiles.repeat_interleave(tm, 2).repeat_interleave(tn, 3)[..., :l, :s]
    elems = torch.rand(b, h, l, s, generator=gen) < p_elem
    elems[..., 0, 0] = True  # a lone visible element in the first tile (when that tile is live)
    return (live & elems).to(torch.int8)


def _neg_inf_bias(gen, dims, tile, dtype=torch.float32):
    """Random bias of `dims`, -inf over whole tiles and scattered elsewhere, with a few NaNs."""
    bias = torch.randn(*dims, generator=gen)
    bias = torch.where(_sparse_mask(gen, dims, tile, p_tile=0.5, p_elem=0.3) != 0, bias, float("-inf"))
    bias[torch.rand(*dims, generator=gen) < 0.01] = float("nan")  # NaN counts as visible
    return bias.to(dtype)


def _oracle(bias, mask, block_m, block_n, l, s, along):
    """The jnp table of `flash_jax_triton` (torch inputs)."""
    j = lambda x, dt: None if x is None else jnp.asarray(x.float().numpy().astype(dt))  # noqa: E731
    tile = (block_m, block_n)
    fine = fj.visibility_tiles(j(bias, np.float32), j(mask, np.int8), tile)
    return np.asarray(fj.skip_table((tile, fine), block_m, block_n, l, s, along))


def _torch_table(bias, mask, block_m, block_n, l, s, along):
    """The table from torch CPU tensors through the runtime-size entry (as the torch launcher does)."""
    dev = DEVICE
    # Strides are read from the tensors on the device (a move may lay a view out anew).
    mask, bias = (None if x is None else x.to(dev) for x in (mask, bias))
    given = [x for x in (mask, bias) if x is not None]
    b, h = max(x.shape[0] for x in given), max(x.shape[1] for x in given)
    strides = lambda x: None if x is None else st.broadcast_strides(x.shape, x.stride())  # noqa: E731
    grid, num_warps, args = st.skip_table_launch(b, h, l, s, block_m, block_n, along,
                                                 mask_strides=strides(mask), bias_strides=strides(bias))
    table = torch.full(st.skip_table_shape(b, h, l, s, block_m, block_n, along), -1, dtype=torch.int32, device=dev)
    st.skip_table_entry_dynamic[grid](
        torch.zeros(1, dtype=torch.int8, device=dev) if mask is None else mask,
        torch.zeros(1, device=dev) if bias is None else bias, table, num_warps=num_warps, **args)
    return table.cpu().numpy()


def _jax_table(bias, mask, block_m, block_n, l, s, along):
    j = lambda x, dt: None if x is None else jnp.asarray(x.float().numpy().astype(dt))  # noqa: E731
    return np.asarray(skip_table_jax(j(bias, np.float32), j(mask, np.int8), block_m, block_n, l, s, along))


# (name, block_m, block_n, l, s, mask dims or None, bias dims or None)
CASES = [
    ("mask", 16, 16, L, S, (2, 2, L, S), None),
    ("bias", 32, 64, L, S, None, (2, 1, L, S)),
    ("mask+bias", 64, 32, L, S, (1, 2, L, S), (2, 1, L, S)),
    ("padding", 128, 64, L, S, (2, 1, 1, S), None),
    ("rows", 32, 64, L, S, (2, 2, L, 1), (1, 1, 1, S)),
    ("one-query", 16, 16, 1, S, (2, 2, 1, S), (2, 1, 1, S)),
    ("one-key", 16, 16, L, 1, None, (1, 2, L, 1)),
]


def _inputs(case, seed):
    name, bm, bn, l, s, mdims, bdims = case
    gen = torch.Generator().manual_seed(seed)
    mask = None if mdims is None else _sparse_mask(gen, mdims, (bm, bn))
    bias = None if bdims is None else _neg_inf_bias(gen, bdims, (bm, bn))
    return bias, mask


def _check(table, oracle):
    assert table.dtype == np.int32 and table.shape == oracle.shape
    np.testing.assert_array_equal(table, oracle)
    c = (oracle.shape[-1] - 1) // 2
    assert (oracle[..., c] < c).any()  # the draws left some block dead, so skipping is exercised


@pytest.fixture
def interpreted_jax_triton(monkeypatch):
    """jax-triton's launch: the real one where JAX runs on the GPU with it installed, else the stand-in
    (interpreted on CPU, compiled on a CUDA machine)."""
    jax_triton_interpret.install(monkeypatch)


# the q-direction tables are checked by default through the JAX launch below, the k-direction here
# By default each case runs through one of the two launches (both launches see a mask and a bias).
TORCH_KEPT = [c for c in CASES if c[0] in ("mask", "mask+bias", "rows", "one-key")]
JAX_KEPT = [c for c in CASES if c not in TORCH_KEPT]


@pytest.mark.parametrize("along", ["k", pytest.param("q", marks=pytest.mark.thorough)])
@pytest.mark.parametrize("case", grid(CASES, keep=TORCH_KEPT), ids=[c[0] for c in CASES])
def test_torch_launch_matches_jnp_table(case, along):
    bias, mask = _inputs(case, seed=len(case[0]))
    args = (case[1], case[2], case[3], case[4], along)
    _check(_torch_table(bias, mask, *args), _oracle(bias, mask, *args))


@pytest.mark.parametrize("along", [pytest.param("k", marks=pytest.mark.thorough), "q"])  # "k": the torch launch above
@pytest.mark.parametrize("case", grid(CASES, keep=JAX_KEPT), ids=[c[0] for c in CASES])
def test_jax_launch_matches_jnp_table(case, along, interpreted_jax_triton):
    bias, mask = _inputs(case, seed=100 + len(case[0]))
    args = (case[1], case[2], case[3], case[4], along)
    _check(_jax_table(bias, mask, *args), _oracle(bias, mask, *args))


def test_mask_and_bias_meet_on_the_same_element():
    """A tile where the mask shows one element and the bias another is dead (per element, not per tile)."""
    mask = torch.zeros(1, 1, 16, 32, dtype=torch.int8)
    bias = torch.full((1, 1, 16, 32), float("-inf"))
    mask[0, 0, 3, 4] = 1
    bias[0, 0, 5, 6] = 0.0        # tile (0, 0): visible elements differ -> dead
    mask[0, 0, 9, 20] = 1
    bias[0, 0, 9, 20] = float("nan")  # tile (0, 1): same element, NaN bias -> live
    table = _torch_table(bias, mask, 16, 16, 16, 32, "k")
    np.testing.assert_array_equal(table[0, 0, 0], [0, 0, 1, 1, 0])
    np.testing.assert_array_equal(table, _oracle(bias, mask, 16, 16, 16, 32, "k"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_bias_and_strided_views(dtype):
    """16-bit biases and non-contiguous views (a slice of a larger array, an expanded mask)."""
    gen = torch.Generator().manual_seed(3)
    bias = _neg_inf_bias(gen, (2, 2, L + 5, S + 9), (32, 32), dtype)[:, :, 5:, :S]
    mask = _sparse_mask(gen, (2, 1, 1, S), (32, 32)).expand(2, 2, L, S)  # stride 0 on H and L
    for along in ("k", "q"):
        np.testing.assert_array_equal(_torch_table(bias, mask, 32, 32, L, S, along),
                                      _oracle(bias, mask, 32, 32, L, S, along))


def test_launch_plan():
    pad = st.broadcast_strides((2, 1, 1, S))
    assert pad == (S, 0, 0, 1)
    grid, num_warps, args = st.skip_table_launch(2, 4, L, S, 64, 32, "q", mask_strides=pad)
    assert grid == (-(-S // 32), 8) and st.skip_table_shape(2, 4, L, S, 64, 32, "q") == (2, 4, 5, 5)
    assert args["TILE_M"] == 1 and args["TILE_N"] == 32  # a broadcast query dim is scanned once
    assert args["HAS_MASK"] and not args["HAS_BIAS"] and args["ALONG_Q"]
    assert all(type(v) in (int, bool) for v in args.values())
    for entry, static in ((st.skip_table_entry_static, True), (st.skip_table_entry_dynamic, False)):
        params = inspect.signature(getattr(entry, "fn", entry)).parameters
        assert list(params) == ["Mask", "Bias", "Table", *args]
        for name in ("H", "L", "S", "smb", "sbn"):
            assert (params[name].annotation is triton.language.constexpr) == static
    with pytest.raises(ValueError):
        st.skip_table_launch(1, 1, L, S, 48, 32, "k")
    with pytest.raises(ValueError):
        st.skip_table_shape(1, 1, L, S, 64, 32, "x")
