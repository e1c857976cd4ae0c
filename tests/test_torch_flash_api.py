"""`jaxattn.torch_api.flash_attention` on CPU (the reference implementation serves it here; the
Triton kernels are tested under the interpreter in test_flash_triton_*.py and on GPU in test_gpu.py).
The oracle is a float64 torch computation of the documented math."""

import math

import pytest
import torch

from attention_reference import reference

from jaxattn.torch_api import AttentionInputError, flash_attention


def make(gen, *shape, grad=True):
    return torch.randn(*shape, generator=gen, dtype=torch.float32).requires_grad_(grad)


CASES = [
    dict(),
    dict(causal=True),
    dict(causal=True, alignment="bottom_right"),
    dict(window=(3, 2)),
    dict(window=(4, -1), alignment="bottom_right"),
    dict(softcap=2.5),
    dict(sinks=True),
    dict(causal=True, softcap=5.0, sinks=True, alignment="bottom_right"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("lq,lk", [(13, 29), (29, 13)])
def test_flash_attention_matches_float64(case, lq, lk):
    gen = torch.Generator().manual_seed(lq * 100 + lk + len(case))
    q, k, v = make(gen, 2, 4, lq, 24), make(gen, 2, 2, lk, 24), make(gen, 2, 2, lk, 16)
    sinks = make(gen, 4) if case.get("sinks") else None
    kw = dict(causal=case.get("causal", False), window=case.get("window"), softcap=case.get("softcap"))
    alignment = case.get("alignment", "top_left")
    out, lse = flash_attention(q, k, v, causal_alignment=alignment, sinks=sinks, return_lse=True, **kw)
    ref_out, ref_lse = reference(q, k, v, alignment=alignment, sinks=sinks, **kw)
    assert out.shape == (2, 4, lq, 16) and lse.shape == (2, 4, lq)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-5, rtol=2e-5)

    dout = torch.randn(out.shape, generator=gen)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref_out, inputs, dout.double())
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg.double(), atol=5e-5, rtol=5e-5)


def test_lse_gradient_flows():
    gen = torch.Generator().manual_seed(3)
    q, k, v = make(gen, 1, 2, 9, 16), make(gen, 1, 2, 11, 16), make(gen, 1, 2, 11, 16)
    _, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    _, ref_lse = reference(q, k, v, causal=True)
    g = torch.autograd.grad(lse.sum(), (q, k))
    rg = torch.autograd.grad(ref_lse.sum(), (q, k))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=5e-5)


def test_forcing_flash_on_cpu_raises_not_implemented():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match="no flash kernel on cpu"):
        flash_attention(q, q, q, implementation="flash")


@pytest.mark.parametrize("name,value", [
    ("segment_ids", torch.zeros(1, 8, dtype=torch.int32)),
    ("cu_seqlens_q", torch.tensor([0, 8], dtype=torch.int32)),
    ("max_seqlen_k", 8),
])
def test_features_not_yet_supported_raise(name, value):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(NotImplementedError, match=name):
        flash_attention(q, q, q, **{name: value})


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=(2,)), "window"),
    (dict(window=(-2, 1)), "window"),
    (dict(softcap=0.0), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(causal_alignment="middle"), "causal_alignment"),
    (dict(dropout_p=0.1), "dropout_p"),
])
def test_bad_arguments(kwargs, match):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises((AttentionInputError, NotImplementedError), match=match):
        flash_attention(q, q, q, **kwargs)


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(5)
    q, k, v = make(gen, 1, 4, 10, 16), make(gen, 1, 2, 12, 16), make(gen, 1, 2, 12, 16)
    sinks = make(gen, 4)

    def f(q, k, v, sinks):
        return flash_attention(q, k, v, causal=True, causal_alignment="bottom_right", softcap=3.0, sinks=sinks)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(q, k, v, sinks)
    ref = f(q, k, v, sinks)
    torch.testing.assert_close(out, ref)
    g = torch.autograd.grad(out.sum(), (q, sinks))
    rg = torch.autograd.grad(ref.sum(), (q, sinks))
    for a, b in zip(g, rg):
        torch.testing.assert_close(a, b)
    assert math.isfinite(float(out.detach().sum()))
