"""Flash-attention forward Triton kernel on torch tensors: compiled on a CUDA machine, under Triton's
interpreter on CPU tensors elsewhere.

The kernel (jax_core/kernels/flash_fwd_triton.py) is checked against the float64 oracle of
tests/attention_reference.py (FLASH_CONTRACT.md's math).

Where the kernel runs: conftest.py sets TRITON_INTERPRET=1 for the whole session on machines without a
GPU, before anything imports triton; this file never sets it (a file that did would switch every
later @triton.jit kernel of a GPU session to the interpreter). It follows the session: interpreted ->
CPU tensors, else CUDA tensors and the compiled kernel, so the same cases also check the real kernel
on a GPU.
"""

import os

import pytest

torch = pytest.importorskip("torch", reason="torch is needed to run the Triton kernel tests")
try:
    import triton  # noqa: F401
except Exception as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"triton cannot be imported ({exc!r}); skipping Triton kernel tests",
                allow_module_level=True)

from attention_reference import reference  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("no CUDA device and TRITON_INTERPRET is unset (conftest.py sets it where nvidia-smi is "
                "missing): the kernel can run neither compiled nor interpreted", allow_module_level=True)

import math  # noqa: E402

from jaxattn.jax_core.kernels.flash_fwd_triton import (  # noqa: E402
    flash_fwd_kernel,
    fwd_block_sizes,
    head_block,
    next_power_of_2,
)


# ----------------------------------------------------------------------------- launcher

def _launch(q, k, v, *, bias=None, mask=None, sinks=None, causal=False, window=(-1, -1),
            align="top_left", softcap=0.0, scale=None, block_m=16, block_n=16):
    """Runs flash_fwd_kernel on q's device; returns (out, lse)."""
    B, Hq, L, D = q.shape
    _, Hk, S, _ = k.shape
    Dv = v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    dev = q.device
    out = torch.empty((B, Hq, L, Dv), dtype=q.dtype, device=dev)
    lse = torch.empty((B, Hq, L), dtype=torch.float32, device=dev)
    dummy = torch.zeros(1, dtype=torch.float32, device=dev)
    bias_t = dummy if bias is None else bias.to(dev).expand(B, Hq, L, S)
    mask_t = dummy if mask is None else mask.to(dev, torch.int8).expand(B, Hq, L, S)
    sinks_t = dummy if sinks is None else sinks.to(dev, torch.float32)
    bias_s = (0, 0, 0, 0) if bias is None else bias_t.stride()
    mask_s = (0, 0, 0, 0) if mask is None else mask_t.stride()
    diag_offset = 0 if align == "top_left" else S - L
    grid = (triton.cdiv(L, block_m), B * Hq)
    flash_fwd_kernel[grid](
        q, k, v, bias_t, mask_t, sinks_t, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *bias_s, *mask_s, *out.stride(),
        Hq, Hk, L, S, D, Dv,
        float(scale), float(softcap), int(window[0]), int(window[1]), diag_offset,
        CAUSAL=causal, HAS_BIAS=bias is not None, HAS_MASK=mask is not None,
        HAS_SINKS=sinks is not None, SOFTCAP=softcap > 0,
        BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=next_power_of_2(D), BLOCK_DV=next_power_of_2(Dv),
    )
    return out, lse


# ----------------------------------------------------------------------------- reference

def _reference(q, k, v, *, align="top_left", softcap=0.0, **kw):
    """The float64 oracle with the launcher's argument names (softcap 0: none); returns (out, lse)."""
    return reference(q, k, v, alignment=align, softcap=softcap or None, **kw)


def _inputs(B=1, Hq=2, Hk=None, L=7, S=7, D=16, Dv=None, dtype=torch.float32, seed=0):
    Hk = Hq if Hk is None else Hk
    Dv = D if Dv is None else Dv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, Hk, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, Hk, S, Dv, generator=g).to(DEVICE, dtype)
    return q, k, v


def _check(q, k, v, tol=1e-5, block_m=16, block_n=16, **kw):
    out, lse = _launch(q, k, v, block_m=block_m, block_n=block_n, **kw)
    ref_out, ref_lse = _reference(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    # -inf rows must match exactly (assert_close treats equal infinities as equal).
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    return out, lse


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("B,Hq,L,S,D", [
    (2, 2, 33, 40, 24),
    (1, 2, 1, 7, 16),
    (1, 3, 7, 1, 40),
    (1, 2, 40, 33, 16),
])
def test_non_causal(B, Hq, L, S, D):
    _check(*_inputs(B=B, Hq=Hq, L=L, S=S, D=D))


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("L,S", [(7, 33), (33, 7), (1, 40), (40, 40)])
def test_causal(align, L, S):
    out, lse = _check(*_inputs(L=L, S=S, D=24), causal=True, align=align)
    if align == "bottom_right" and L > S:
        # The first L - S rows see nothing: out 0, lse -inf.
        assert (out[:, :, : L - S] == 0).all()
        assert torch.isneginf(lse[:, :, : L - S]).all()


@pytest.mark.parametrize("Hk", [2, 1])
def test_gqa_mqa(Hk):
    _check(*_inputs(B=2, Hq=4, Hk=Hk, L=33, S=40, D=16), causal=True, align="bottom_right")


def test_bias_broadcast_and_full():
    q, k, v = _inputs(B=2, Hq=2, L=33, S=40, D=16)
    g = torch.Generator().manual_seed(1)
    b_heads = torch.randn(1, 2, 33, 40, generator=g).to(DEVICE)
    _check(q, k, v, bias=b_heads.expand(2, 2, 33, 40))  # stride 0 on the batch dim
    b_rows = torch.randn(1, 1, 1, 40, generator=g).to(DEVICE)
    _check(q, k, v, bias=b_rows.expand(2, 2, 33, 40), causal=True)  # stride 0 on B, H, L
    b_full = torch.randn(2, 2, 33, 40, generator=g).to(DEVICE)
    b_full[0, 1, 3, :] = float("-inf")  # an additive-mask row: fully masked
    out, lse = _check(q, k, v, bias=b_full)
    assert (out[0, 1, 3] == 0).all() and torch.isneginf(lse[0, 1, 3])


def test_bool_mask_with_fully_masked_row():
    q, k, v = _inputs(B=2, Hq=2, L=33, S=40, D=24)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(2, 2, 33, 40, generator=g) > 0.3
    mask[1, 0, 5, :] = False
    mask[0, 1, 32, :] = False
    out, lse = _check(q, k, v, mask=mask.to(torch.int8))
    for b, h, i in [(1, 0, 5), (0, 1, 32)]:
        assert (out[b, h, i] == 0).all() and torch.isneginf(lse[b, h, i])
    # Broadcast over heads (stride 0), combined with causal.
    mask_b = (torch.rand(2, 1, 33, 40, generator=g) > 0.5).to(DEVICE, torch.int8)
    _check(q, k, v, mask=mask_b.expand(2, 2, 33, 40), causal=True, align="bottom_right")


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window,causal,L,S", [
    ((3, 0), False, 40, 40),
    ((2, 5), False, 33, 40),
    ((-1, 2), False, 40, 33),
    ((4, -1), False, 7, 40),
    ((5, -1), True, 40, 7),
    ((0, 0), False, 33, 33),
])
def test_window(align, window, causal, L, S):
    _check(*_inputs(L=L, S=S, D=16), window=window, causal=causal, align=align)


def test_softcap():
    q, k, v = _inputs(B=1, Hq=2, L=33, S=40, D=16)
    _check(q * 3, k, v, softcap=5.0, scale=1.0)
    g = torch.Generator().manual_seed(3)
    bias = torch.randn(1, 2, 33, 40, generator=g)
    _check(q * 3, k, v, softcap=5.0, scale=1.0, bias=bias, causal=True)


def test_sinks():
    q, k, v = _inputs(B=2, Hq=2, L=33, S=40, D=16)
    sinks = torch.tensor([0.5, -1.25], device=DEVICE)
    _check(q, k, v, sinks=sinks)
    _check(q, k, v, sinks=torch.tensor([3.0, 2.0]), causal=True, window=(6, -1))
    # A fully masked row with a sink: out 0, lse = sink.
    mask = torch.ones(2, 2, 33, 40, dtype=torch.int8)
    mask[1, 1, 7, :] = 0
    out, lse = _check(q, k, v, sinks=sinks, mask=mask)
    assert (out[1, 1, 7] == 0).all()
    assert lse[1, 1, 7].item() == pytest.approx(-1.25, abs=1e-6)
    # Bottom-right causal with L > S: the first L - S rows see only the sink.
    q2, k2, v2 = _inputs(Hq=2, L=33, S=7, D=16)
    out, lse = _check(q2, k2, v2, sinks=sinks, causal=True, align="bottom_right")
    assert (out[:, :, :26] == 0).all()
    torch.testing.assert_close(lse[0, :, :26], sinks[:, None].expand(2, 26))


def test_dv_differs_from_d():
    _check(*_inputs(B=1, Hq=2, L=33, S=40, D=16, Dv=40), causal=True)
    _check(*_inputs(B=1, Hq=2, L=7, S=33, D=40, Dv=24))


@pytest.fixture
def bf16_dot_in_interpreter(monkeypatch):
    """Works around a Triton interpreter gap: it stores bfloat16 as raw uint16 bits and its
    create_dot multiplies those bits as integers. Upcast bf16 operands to fp32 first (exact, as a
    tensor core's bf16 products are). Only the interpreter is patched, never the kernel (nothing to
    patch when the kernel runs compiled)."""
    if not INTERPRETED:
        return
    from triton.runtime import interpreter as interp
    import triton.language as tl

    original = interp.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype, bf16_dot_in_interpreter):
    q, k, v = _inputs(B=1, Hq=2, Hk=1, L=33, S=40, D=24, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(1, 2, 33, 40, generator=g).to(dtype)
    _check(q, k, v, tol=1e-2, causal=True, bias=bias, sinks=torch.tensor([0.1, -0.2]))


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(5)
    # (B, L, H, D) storage viewed as (B, H, L, D), as jax / torch layouts often are.
    q = torch.randn(2, 33, 2, 24, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(2, 40, 2, 24, generator=g).to(DEVICE).transpose(1, 2)
    v = torch.randn(2, 40, 2, 40, generator=g).to(DEVICE)[..., ::2].transpose(1, 2)  # stride_d = 2
    assert not q.is_contiguous() and not k.is_contiguous() and v.stride(-1) == 2
    out, lse = _check(q, k, v, causal=True)
    out_c, lse_c = _launch(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    torch.testing.assert_close(out, out_c, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_c, atol=1e-6, rtol=1e-6)


def test_block_skipping_does_not_change_results():
    q, k, v = _inputs(B=1, Hq=2, L=40, S=40, D=16)
    out16, lse16 = _check(q, k, v, causal=True, block_m=16, block_n=16)
    out64, lse64 = _check(q, k, v, causal=True, block_m=64, block_n=64)  # one block, no skipping
    torch.testing.assert_close(out16, out64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse16, lse64, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_skipped_blocks_are_not_read():
    # NaN in keys/values that a query block must skip: if the kernel loaded them, NaN would leak
    # into that block's rows (0 * NaN = NaN in P·V).
    q, k, v = _inputs(B=1, Hq=1, L=48, S=48, D=16)
    # Causal top-left, blocks of 16: rows < 32 never need keys >= 32.
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, 32:] = float("nan")
    v_nan[:, :, 32:] = float("nan")
    out, lse = _launch(q, k_nan, v_nan, causal=True)
    ref_out, ref_lse = _reference(q, k, v, causal=True)
    torch.testing.assert_close(out[:, :, :32].double(), ref_out[:, :, :32], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, :32].double(), ref_lse[:, :, :32], atol=1e-5, rtol=1e-5)
    # Window (4, 0): rows 32..47 need keys >= 28 only, so key block 0 (keys 0..15) is skipped.
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, :16] = float("nan")
    v_nan[:, :, :16] = float("nan")
    out, lse = _launch(q, k_nan, v_nan, window=(4, 0))
    ref_out, ref_lse = _reference(q, k, v, window=(4, 0))
    torch.testing.assert_close(out[:, :, 32:].double(), ref_out[:, :, 32:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, :, 32:].double(), ref_lse[:, :, 32:], atol=1e-5, rtol=1e-5)


def test_block_size_helpers():
    assert [next_power_of_2(n) for n in (1, 2, 3, 16, 24, 40, 80, 96, 192, 256)] == \
        [1, 2, 4, 16, 32, 64, 128, 128, 256, 256]
    assert head_block(8) == 16 and head_block(80) == 128
    for D in (16, 64, 80, 128, 192, 256):
        for nbytes in (2, 4):
            bm, bn, warps, stages = fwd_block_sizes(D, D, nbytes)
            assert bm >= 16 and bn >= 16 and warps in (4, 8) and stages >= 1
            assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0
    for D in (64, 128, 256):  # Q tile + `stages` K and V tiles fit an H100's 227 KiB of shared memory
        bm, bn, _, stages = fwd_block_sizes(D, D, 2)
        assert (bm * D + stages * 2 * bn * D) * 2 <= 227 * 1024
    assert fwd_block_sizes(256, 256, 2)[1] <= 64  # D = 256: narrower key blocks
    assert all(fwd_block_sizes(D, D, 4)[2] == 4 for D in (64, 128, 256))  # fp32: 4 warps
