"""The Triton flash kernels on CUDA (through jax-triton): the feature grid in bf16/fp16, forward and
gradients, with flash-attn's rule: our error against a float64 reference is at most twice that of
plain torch ops in the same dtype. Skipped without a CUDA device or jax-triton."""

import importlib.util

import pytest
import torch

from attention_reference import reference

from jaxattn.torch_api import flash_attention, scaled_dot_product_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None, reason="needs jax-triton (pip install 'jaxattn[gpu]')"),
]

DEV = "cuda"

CASES = [
    dict(b=2, hq=4, hk=4, l=97, s=1025, d=64),
    dict(b=2, hq=4, hk=4, l=128, s=128, d=128, causal=True),
    dict(b=1, hq=8, hk=2, l=97, s=130, d=80, causal=True),
    dict(b=1, hq=8, hk=1, l=97, s=1025, d=128, causal=True, alignment="bottom_right"),
    dict(b=1, hq=4, hk=4, l=1025, s=97, d=64, causal=True, alignment="bottom_right"),
    dict(b=1, hq=4, hk=2, l=256, s=256, d=96, window=(64, 0)),
    dict(b=1, hq=4, hk=4, l=200, s=300, d=64, window=(32, 16), alignment="bottom_right"),
    dict(b=1, hq=4, hk=4, l=256, s=256, d=128, causal=True, softcap=30.0),
    dict(b=1, hq=4, hk=2, l=97, s=1025, d=64, sinks=True),
    dict(b=1, hq=4, hk=4, l=128, s=256, d=192, causal=True),
    dict(b=1, hq=2, hk=2, l=130, s=130, d=256),
    dict(b=1, hq=4, hk=4, l=97, s=130, d=64, dv=32),
]


def _case_id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_flash_kernels_feature_grid(case, dtype):
    case = dict(case)
    gen = torch.Generator(device=DEV).manual_seed(len(_case_id(case)) + (dtype == torch.float16))
    b, hq, hk, l, s, d = (case.pop(n) for n in ("b", "hq", "hk", "l", "s", "d"))
    dv = case.pop("dv", d)

    def make(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(dtype).requires_grad_()

    q, k, v = make(b, hq, l, d), make(b, hk, s, d), make(b, hk, s, dv)
    sinks = torch.randn(hq, generator=gen, device=DEV).requires_grad_() if case.pop("sinks", False) else None
    alignment = case.pop("alignment", "top_left")
    kw = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"))

    out, lse = flash_attention(q, k, v, causal_alignment=alignment, sinks=sinks, return_lse=True,
                               implementation="flash", **kw)
    ref, ref_lse = reference(q, k, v, alignment=alignment, sinks=sinks, **kw)
    low, _ = reference(q, k, v, alignment=alignment, sinks=sinks, dtype=dtype, **kw)
    assert out.dtype == dtype
    assert _err(out, ref) <= 2 * _err(low, ref) + 1e-3
    finite = torch.isfinite(ref_lse)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-3

    dout = torch.randn(out.shape, generator=gen, device=DEV).to(dtype)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double())
    low_grads = torch.autograd.grad(low, inputs, dout)
    for name, g, rg, lg in zip("qkvs", grads, ref_grads, low_grads):
        assert _err(g, rg.double()) <= 2 * _err(lg, rg.double()) + 1e-3, name


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_flash_through_sdpa_with_masks(mask_kind):
    gen = torch.Generator(device=DEV).manual_seed(7)
    b, h, l, s, d = 2, 4, 97, 1025, 64
    q, k, v = (torch.randn(b, h, n, d, generator=gen, device=DEV).bfloat16().requires_grad_() for n in (l, s, s))
    if mask_kind == "bool":
        mask = torch.rand(b, 1, l, s, generator=gen, device=DEV) > 0.3
        mask[:, :, 5] = False  # a fully masked row
    else:
        mask = torch.randn(1, h, l, s, generator=gen, device=DEV).bfloat16().requires_grad_()
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, implementation="flash")
    ref, _ = reference(q, k, v, **({"mask": mask} if mask_kind == "bool" else {"bias": mask}))
    low, _ = reference(q, k, v, dtype=torch.bfloat16, **({"mask": mask} if mask_kind == "bool" else {"bias": mask}))
    assert _err(out, ref) <= 2 * _err(low, ref) + 1e-3
    inputs = [q, k, v] + ([mask] if mask_kind == "float" else [])
    dout = torch.randn(out.shape, generator=gen, device=DEV).bfloat16()
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout.double())
    low_grads = torch.autograd.grad(low, inputs, dout)
    for g, rg, lg in zip(grads, ref_grads, low_grads):
        assert _err(g, rg.double()) <= 2 * _err(lg, rg.double()) + 1e-3
