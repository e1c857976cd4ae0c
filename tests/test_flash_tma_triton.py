"""The Hopper forward prototype (jax_core/kernels/flash_fwd_tma_triton.py) and its launch plan
(flash_tma_plan.py) against the float64 oracle of tests/attention_reference.py.

Like test_flash_triton_fwd.py, this file follows the session's choice of Triton mode (conftest.py sets
TRITON_INTERPRET=1 where there is no GPU): interpreted on CPU tensors, else compiled on CUDA tensors,
where the kernel's TMA descriptors need an sm90+ GPU and a Triton allocator (set by `_launch`).
"""

import math
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is needed to run the Triton kernel tests")
try:
    import triton
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton cannot be imported ({exc!r}); skipping Triton kernel tests", allow_module_level=True)

from attention_reference import assert_dtype_rule, reference  # noqa: E402
from test_flash_triton_fwd import bf16_dot_in_interpreter  # noqa: E402,F401 (a fixture)

from jaxattn.jax_core.kernels.flash_fwd_tma_triton import flash_fwd_tma_kernel  # noqa: E402
from jaxattn.jax_core.kernels.flash_plan import Operand  # noqa: E402
from jaxattn.jax_core.kernels.flash_tma_plan import TmaTile, fwd_tma_launch  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
    DEVICE = "cuda"
else:
    pytest.skip("the TMA prototype runs under TRITON_INTERPRET=1 or on an sm90+ GPU", allow_module_level=True)

# Small tiles under the interpreter (several key blocks per row, diagonals that cross blocks); the
# prototype's real tiles on a GPU.
SMALL = TmaTile(block_m=32, block_n=16, num_warps=4, num_stages=2)


def _operand(t):
    return Operand(tuple(t.shape), tuple(t.stride()))


def _launch(q, k, v, *, causal, align="top_left", scale=None, tile=SMALL):
    """Runs flash_fwd_tma_kernel through its plan; returns (out, lse)."""
    B, Hq, L, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = torch.empty_like(q)
    lse = torch.empty((B, Hq, L), dtype=torch.float32, device=q.device)
    if not INTERPRETED:  # device-side descriptors need global scratch memory
        triton.set_allocator(lambda size, align_, stream: torch.empty(size, dtype=torch.int8, device=q.device))
    launch = fwd_tma_launch(
        _operand(q), _operand(k), _operand(v), _operand(out), dtype_bytes=q.element_size(), scale=scale,
        causal=causal, diag_offset=S - L if align == "bottom_right" else 0, tile=tile,
        base_addresses=[t.data_ptr() for t in (q, k, v, out)])
    flash_fwd_tma_kernel[launch.grid](q, k, v, out, lse, **launch.args, num_warps=launch.num_warps,
                                      num_stages=launch.num_stages)
    return out, lse


def _inputs(B=1, Hq=4, Hk=2, L=97, S=130, D=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hk, S, D, generator=g).to(DEVICE, dtype)
    return q, k, v


def _check(q, k, v, *, causal, align="top_left", scale=None, tile=SMALL, tol=1e-5):
    """Kernel against the float64 oracle; float32 inputs to `tol`, 16-bit ones by the dtype rule."""
    out, lse = _launch(q, k, v, causal=causal, align=align, scale=scale, tile=tile)
    want_out, want_lse = reference(q, k, v, causal=causal, alignment=align, scale=scale)
    assert out.dtype == q.dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if q.dtype == torch.float32:
        torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    else:
        low, _ = reference(q, k, v, causal=causal, alignment=align, scale=scale, dtype=q.dtype)
        assert_dtype_rule("out", out.double(), want_out, low.double(), 2e-3)
    # -inf rows must match exactly (assert_close treats equal infinities as equal).
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=1e-4)
    return out, lse


def test_bottom_right_causal_gqa_ragged_lengths():
    # L=97, S=130: diagonal offset 33 crosses key blocks; the last query and key blocks are partial.
    _check(*_inputs(Hq=4, Hk=2, L=97, S=130), causal=True, align="bottom_right")


def test_top_left_causal_square():
    _check(*_inputs(Hq=2, Hk=2, L=128, S=128), causal=True)


def test_top_left_causal_keys_longer_than_queries():
    _check(*_inputs(Hq=4, Hk=2, L=97, S=130), causal=True, align="top_left")


def test_non_causal_ragged_lengths_and_scale():
    _check(*_inputs(B=2, Hq=4, Hk=1, L=97, S=130), causal=False, scale=0.3)


def test_empty_rows_bottom_right_queries_longer_than_keys():
    # L=130 > S=97 bottom-right: the first 33 queries see no key -> out 0, lse -inf.
    out, lse = _check(*_inputs(Hq=4, Hk=2, L=130, S=97), causal=True, align="bottom_right")
    assert (out[:, :, :33] == 0).all() and torch.isinf(lse[:, :, :33]).all()
    assert torch.isfinite(lse[:, :, 33:]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_dim_128_and_half_precision(dtype, bf16_dot_in_interpreter):
    _check(*_inputs(Hq=2, Hk=1, L=97, S=130, D=128, dtype=dtype), causal=True, align="bottom_right")


@pytest.mark.parametrize("tile", [
    TmaTile(64, 32, 4, 3, heads_fastest=False),  # query blocks fastest in the grid
    TmaTile(64, 64, 4, 2, warp_specialize=True),
    TmaTile(16, 64, 4, 1),  # key blocks wider than query blocks
], ids=["m-fastest", "warp-specialized", "narrow-m"])
def test_tile_variants(tile):
    _check(*_inputs(Hq=2, Hk=1, L=97, S=130, dtype=torch.float16), causal=True, align="bottom_right", tile=tile)


def test_strided_bthd_layout():
    g = torch.Generator().manual_seed(3)
    # (B, L, H, D) storage viewed as (B, H, L, D); V with a padded sequence stride.
    q = torch.randn(2, 97, 4, 64, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 130, 2, 64, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 2, 130, 72, generator=g).to(DEVICE)[..., :64]
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(2) == 72
    _check(q, k, v, causal=True, align="bottom_right")


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_blocks_above_the_diagonal_are_not_read():
    # Causal top-left, query blocks of 32 and key blocks of 16: rows < 64 need keys < 64 only. A
    # loaded NaN key or value would leak into those rows (0 * NaN = NaN in P.V).
    q, k, v = _inputs(Hq=2, Hk=2, L=96, S=96)
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, 64:] = float("nan")
    v_nan[:, :, 64:] = float("nan")
    out, lse = _launch(q, k_nan, v_nan, causal=True)
    want_out, want_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, :64].double(), want_out[:, :, :64], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, :64].double(), want_lse[:, :, :64], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- the plan's checks

def _plan(q=(1, 4, 97, 64), k=(1, 2, 130, 64), **kw):
    def op(dims):
        stride, strides = 1, []
        for n in reversed(dims):
            strides.append(stride)
            stride *= n
        return Operand(dims, tuple(reversed(strides)))
    args = dict(dtype_bytes=2, scale=0.125, causal=True)
    args.update(kw)
    return fwd_tma_launch(op(q), op(k), op(k), op(q), **args)


def test_plan_grid_and_arguments():
    launch = _plan(tile=TmaTile(128, 64, 8, 3, heads_fastest=True))
    assert launch.grid == (4, 1) and launch.num_warps == 8 and launch.num_stages == 3
    assert launch.args["sqm"] == 64 and launch.args["skh"] == 130 * 64 and launch.args["HEAD_DIM"] == 64
    assert _plan(tile=TmaTile(32, 64, 4, 2, heads_fastest=False)).grid == (4, 4)


@pytest.mark.parametrize("kw, match", [
    (dict(q=(1, 4, 97, 80), k=(1, 2, 130, 80)), r"q.dims\[3\] \(head dim\)=80"),
    (dict(k=(1, 3, 130, 64)), r"k.dims\[1\] \(KV heads\)=3"),
    (dict(dtype_bytes=1), r"dtype_bytes=1"),
    (dict(tile=TmaTile(block_m=96)), r"tile.block_m=96"),
    (dict(tile=TmaTile(block_n=512)), r"tile.block_n=512: expected a power of two in \[16, 256\]"),
    (dict(tile=TmaTile(num_warps=2)), r"tile.num_warps=2"),
    (dict(scale=float("nan")), r"scale=nan"),
    (dict(base_addresses=[0, 8, 0, 0]), r"k data address='0x8'"),
])
def test_plan_rejects_what_the_kernel_cannot_take(kw, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kw)


def test_plan_rejects_unaligned_and_non_unit_strides():
    good = Operand((1, 2, 97, 64), (97 * 64, 97 * 64, 64, 1))
    padded = Operand((1, 2, 97, 64), (97 * 72, 97 * 72, 72, 1))  # 144-byte rows: aligned
    fwd_tma_launch(good, padded, good, good, dtype_bytes=2, scale=1.0, causal=False)
    unaligned = Operand((1, 2, 97, 64), (104 * 68, 104 * 68, 68, 1))  # 136-byte rows
    with pytest.raises(ValueError, match=r"k.strides\[2\]=68: expected a positive multiple of 8 elements"):
        fwd_tma_launch(good, unaligned, good, good, dtype_bytes=2, scale=1.0, causal=False)
    strided = Operand((1, 2, 97, 64), (97 * 128, 97 * 128, 128, 2))
    with pytest.raises(ValueError, match=r"v.strides\[3\] \(head-dim stride\)=2"):
        fwd_tma_launch(good, good, strided, good, dtype_bytes=2, scale=1.0, causal=False)
