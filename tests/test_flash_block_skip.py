"""Tiles that a bool mask or a -inf bias masks entirely are skipped by the flash kernels.

The GPU path (JAX wrapper, custom VJP, entry kernels, Triton kernels) runs here under Triton's
interpreter through the jax-triton stand-in (compiled on a CUDA machine, through jax-triton where
JAX runs on the GPU with it installed). The
oracle is the float64 reference of tests/attention_reference.py. Skipping is proven by poison:
keys, values or queries inside fully masked tiles are NaN, which any computed tile would spread
(0 * NaN = NaN in P @ V and in dS^T @ Q).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import assert_close_finite, reference_grads  # noqa: E402

from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402

ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels
TILE = 64  # every float32 tile of the kernels at head dim <= 64 is a multiple of this (CPU and H100)


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _j(t, dtype=np.float32):
    return jnp.asarray(t.numpy().astype(dtype))


def _t(x):
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def _flash(q, k, v, cot, *, bias=None, mask=None, cfg):
    """Out, lse and (dq, dk, dv, dbias) of sum(out * cot) through the flash kernels (BHTD)."""
    mask_j = None if mask is None else _j(mask, np.int8)
    bias_j = None if bias is None else _j(bias)
    cot_j = _j(cot)

    def loss(q, k, v, bias):
        out, lse = fj.flash_attention_triton(q, k, v, bias, mask_j, None, fj.FlashExtras(), cfg)
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) * cot_j), (out, lse)

    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(_j(q), _j(k), _j(v), bias_j)
    return _t(out), _t(lse), [None if g is None else _t(g) for g in grads]


def _reference(q, k, v, cot, *, bias=None, mask=None, **kw):
    """(out, lse, [dq, dk, dv, dbias]) of the float64 oracle."""
    out, lse, (dq, dk, dv, dbias, _) = reference_grads(q, k, v, cot, bias=bias, mask=mask, **kw)
    return out, lse, [dq, dk, dv, dbias]


_close = assert_close_finite


def _tile_mask(gen, shape, l, s, p_visible):
    """A bool (*shape, l, s) mask constant on TILE x TILE tiles, about p_visible of them visible."""
    tiles = torch.rand(*shape, -(-l // TILE), -(-s // TILE), generator=gen) < p_visible
    return tiles.repeat_interleave(TILE, -2).repeat_interleave(TILE, -1)[..., :l, :s]


# ------------------------------------------------------------------------------------------- table


def test_visibility_tiles_table():
    mask = np.zeros((1, 1, 5, 6), np.int8)
    mask[0, 0, 0, 5] = 1   # tile (0, 1)
    mask[0, 0, 4, 0] = 1   # tile (2, 0): the padded last row block
    bias = np.zeros((2, 1, 1, 6), np.float32)
    bias[1, 0, 0, :4] = -np.inf  # batch 1: keys 0-3 masked by the bias
    bias[0, 0, 0, 4] = np.nan    # NaN is not masked
    table = fj.visibility_tiles(None, jnp.asarray(mask), (2, 4))
    np.testing.assert_array_equal(table[0, 0], [[0, 1], [0, 0], [1, 0]])
    both = fj.visibility_tiles(jnp.asarray(bias), jnp.asarray(mask), (2, 4))
    assert both.shape == (2, 1, 3, 2)
    np.testing.assert_array_equal(both[0, 0], [[0, 1], [0, 0], [1, 0]])
    np.testing.assert_array_equal(both[1, 0], [[0, 1], [0, 0], [0, 0]])
    only_bias = fj.visibility_tiles(jnp.asarray(bias), None, (2, 4))
    assert only_bias.shape == (2, 1, 1, 2)  # broadcast query dim stays broadcast
    np.testing.assert_array_equal(only_bias[:, 0, 0], [[1, 1], [0, 1]])


def test_skip_table_lists_live_blocks():
    mask = np.zeros((1, 1, 4, 6), np.int8)
    mask[0, 0, 0, 5] = 1
    mask[0, 0, 0, 0] = 1
    mask[0, 0, 3, 2] = 1
    skip = ((1, 1), fj.visibility_tiles(None, jnp.asarray(mask), (1, 1)))
    rows = fj.skip_table(skip, 2, 2, 4, 6, "k")  # 2 query blocks x 3 key blocks
    assert rows.shape == (1, 1, 2, 7)
    np.testing.assert_array_equal(rows[0, 0, 0, :4], [0, 1, 1, 2])  # live key blocks 0 and 2
    np.testing.assert_array_equal(rows[0, 0, 0, 4:6], [0, 2])
    np.testing.assert_array_equal(rows[0, 0, 1, :4], [0, 0, 1, 1])  # live key block 1
    assert rows[0, 0, 1, 4] == 1
    cols = fj.skip_table(skip, 2, 2, 4, 6, "q")  # per key block, its live query blocks
    assert cols.shape == (1, 1, 3, 5)
    np.testing.assert_array_equal(cols[0, 0, :, :3], [[0, 1, 1], [0, 0, 1], [0, 1, 1]])
    np.testing.assert_array_equal(cols[0, 0, :, 3], [0, 1, 0])


# ---------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.thorough), True])
def test_tile_sparse_mask_with_gqa(causal):
    gen = torch.Generator().manual_seed(11 + causal)
    B, Hq, Hk, L, S, D = 2, 4, 2, 150, 229, 32
    q, k, v = (torch.randn(B, h, n, D, generator=gen, dtype=torch.float64) for h, n in ((Hq, L), (Hk, S), (Hk, S)))
    cot = torch.randn(B, Hq, L, D, generator=gen, dtype=torch.float64)
    mask = _tile_mask(gen, (B, Hq), L, S, 0.45)
    mask[0, 1, :70] = False  # fully masked rows: out 0, lse -inf
    cfg = fj.FlashConfig(scale=D ** -0.5, causal=causal, diag_offset=S - L)
    out, lse, grads = _flash(q, k, v, cot, mask=mask, cfg=cfg)
    r_out, r_lse, r_grads = _reference(q, k, v, cot, mask=mask, causal=causal, alignment="bottom_right")
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    for name, g, rg in zip("qkv", grads, r_grads):
        _close(f"d{name}", g, rg)


def test_masked_key_tiles_are_not_read():
    gen = torch.Generator().manual_seed(5)
    B, H, L, S, D = 1, 2, 97, 200, 48
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (L, S, S))
    cot = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, 1, 1, S, generator=gen) < 0.7  # broadcast over heads and queries
    mask[..., TILE:2 * TILE] = False  # one whole key tile masked for every query
    cfg = fj.FlashConfig(scale=D ** -0.5)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, TILE:2 * TILE] = float("nan")
    v_bad[:, :, TILE:2 * TILE] = float("nan")
    out, lse, (dq, dk, dv, _) = _flash(q, k_bad, v_bad, cot, mask=mask, cfg=cfg)
    r_out, r_lse, (r_dq, r_dk, r_dv, _) = _reference(q, k, v, cot, mask=mask)
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    _close("dq", dq, r_dq)
    _close("dk", dk, r_dk)  # the poisoned tile's gradient is exactly 0
    _close("dv", dv, r_dv)


def test_masked_query_tiles_are_not_read_in_backward():
    gen = torch.Generator().manual_seed(6)
    B, H, L, S, D = 2, 2, 190, 130, 40
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (L, S, S))
    cot = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    mask = torch.ones(B, 1, L, 1, dtype=torch.bool)  # per-row mask, broadcast over keys
    mask[:, :, TILE:2 * TILE] = False
    q_bad = q.clone()
    q_bad[:, :, TILE:2 * TILE] = float("nan")
    out, lse, (dq, dk, dv, _) = _flash(q_bad, k, v, cot, mask=mask, cfg=fj.FlashConfig(scale=D ** -0.5))
    r_out, r_lse, (r_dq, r_dk, r_dv, _) = _reference(q, k, v, cot, mask=mask.expand(B, 1, L, S))
    _close("out", out, r_out)  # fully masked rows give 0
    _close("lse", lse, r_lse)
    _close("dq", dq, r_dq)
    _close("dk", dk, r_dk)
    _close("dv", dv, r_dv)


@pytest.mark.parametrize("with_mask", [pytest.param(False, marks=pytest.mark.thorough), True])
def test_minus_inf_bias_tiles_and_bias_gradient(with_mask):
    gen = torch.Generator().manual_seed(7 + with_mask)
    B, H, L, S, D = 1, 3, 140, 170, 32
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64) for n in (L, S, S))
    cot = torch.randn(B, H, L, D, generator=gen, dtype=torch.float64)
    bias = torch.randn(1, H, L, S, generator=gen, dtype=torch.float64)
    bias = bias.masked_fill(~_tile_mask(gen, (1, H), L, S, 0.6), float("-inf"))
    mask = _tile_mask(gen, (B, 1), L, S, 0.8) if with_mask else None
    cfg = fj.FlashConfig(scale=D ** -0.5, causal=True)
    out, lse, (dq, dk, dv, dbias) = _flash(q, k, v, cot, bias=bias, mask=mask, cfg=cfg)
    # The oracle hides a key under a -inf bias (its bias gradient is 0), with no NaN from rows whose
    # every logit is -inf.
    r_out, r_lse, (r_dq, r_dk, r_dv, r_dbias) = _reference(q, k, v, cot, bias=bias, mask=mask, causal=True)
    _close("out", out, r_out)
    _close("lse", lse, r_lse)
    for name, g, rg in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), (r_dq, r_dk, r_dv, r_dbias)):
        _close(name, g, rg)


def test_launch_choices_are_config_methods():
    """A FlashConfig launches with the tuned tiles and skips masked tiles; the launch plans take
    these choices from its methods, which a benchmark overrides in a subclass of its own. The
    former fields of those choices are refused by name."""
    from jaxattn.jax_core.kernels import flash_plan as plan

    op = plan.Operand((1, 2, 128, 64), (0, 8192, 64, 1))
    call = plan.FlashCall(q=op, k=op, v=op, bias=None, mask=op, dtype_bytes=2)
    strides = op.strides

    def tiles(cfg):
        fwd = plan.forward_launch(call, cfg, strides)
        kv = plan.dkdv_launch(call, cfg, strides, strides, strides)
        dq = plan.dq_launch(call, cfg, strides, strides, None)
        return [(x.args["BLOCK_M"], x.args["BLOCK_N"], x.num_warps, x.num_stages) for x in (fwd, kv, dq)]

    tuned = plan.FlashConfig(scale=0.125)
    assert tiles(tuned) == [plan.fwd_block_sizes(64, 64, 2), *plan.bwd_tiles(64, 2)]
    assert plan.uses_skip_table(call, tuned)

    @dataclasses.dataclass(frozen=True)
    class Swept(plan.FlashConfig):
        def forward_tile(self, call):
            return 16, 32, 2, 1

        def backward_tiles(self, call):
            return (32, 16, 2, 1), (16, 16, 1, 1)

        def skips_masked_blocks(self):
            return False

    swept = Swept(scale=0.125)
    assert swept != tuned
    assert tiles(swept) == [(16, 32, 2, 1), (32, 16, 2, 1), (16, 16, 1, 1)]
    assert not plan.uses_skip_table(call, swept)
    for removed in ("fwd_tiles", "bwd_tiles", "skip_masked_blocks"):
        with pytest.raises(TypeError, match=removed):
            plan.FlashConfig(scale=0.125, **{removed: None})
