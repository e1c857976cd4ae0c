"""`jaxattn.torch_api.flash_attention` on CPU (the reference implementation serves it here; the
Triton kernels are tested under the interpreter in test_flash_triton_*.py and on GPU in test_gpu.py).
The oracle is a float64 torch computation of the documented math."""

import math

import pytest
import torch

from attention_reference import reference, varlen_reference
from thorough_grid import grid

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


# By default: both windows and the case combining causal, bottom-right alignment, soft cap and sinks.
@pytest.mark.parametrize("case", grid(CASES, keep=[CASES[3], CASES[4], CASES[7]]),
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "plain")
@pytest.mark.parametrize("lq,lk", [(13, 29), pytest.param(29, 13, marks=pytest.mark.thorough)])
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


@pytest.mark.parametrize("kwargs,match", [
    (dict(window=(2,)), "window"),
    (dict(window=(-2, 1)), "window"),
    (dict(softcap=0.0), "softcap"),
    (dict(sinks=torch.zeros(3)), "sinks"),
    (dict(causal_alignment="middle"), "causal_alignment"),
])
def test_bad_arguments(kwargs, match):
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(AttentionInputError, match=match):
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


# ----------------------------------------------------------------------------------------------
# segment ids
# ----------------------------------------------------------------------------------------------


def _check_against(out, lse, ref_out, ref_lse, inputs, gen):
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=2e-5, rtol=2e-5)
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref_out, inputs, dout.double())
    for g, rg in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), rg.double(), atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("form,lq,lk,kw", [
    pytest.param("single", 13, 13, dict(), marks=pytest.mark.thorough),
    ("single", 13, 13, dict(causal=True, window=(4, -1))),
    ("pair", 11, 17, dict(causal=True, causal_alignment="bottom_right")),
    pytest.param("pair", 17, 11, dict(window=(3, 3)), marks=pytest.mark.thorough),
])
def test_segment_ids_match_float64(form, lq, lk, kw):
    gen = torch.Generator().manual_seed(lq * 7 + lk + len(kw))
    q, k, v = make(gen, 2, 4, lq, 24), make(gen, 2, 2, lk, 24), make(gen, 2, 2, lk, 16)
    # unsorted, non-contiguous ids; the key ids follow a different pattern than the query ids
    q_ids = torch.tensor([5, -1, 9])[torch.randint(0, 3, (2, lq), generator=gen)]
    kv_ids = q_ids if form == "single" else torch.tensor([9, 5, -1])[torch.randint(0, 3, (2, lk), generator=gen)]
    segment_ids = q_ids if form == "single" else (q_ids.to(torch.int32), kv_ids)
    out, lse = flash_attention(q, k, v, segment_ids=segment_ids, return_lse=True, **kw)
    ref_out, ref_lse = reference(q, k, v, segment_ids=(q_ids, kv_ids), alignment=kw.get("causal_alignment", "top_left"),
                                 causal=kw.get("causal", False), window=kw.get("window"))
    assert out.shape == (2, 4, lq, 16) and lse.shape == (2, 4, lq)
    _check_against(out, lse, ref_out, ref_lse, [q, k, v], gen)


# ----------------------------------------------------------------------------------------------
# varlen
# ----------------------------------------------------------------------------------------------

#: (L_n, S_n) per packed sequence: lengths 1, 7, 13, L_n != S_n, a sequence without keys.
VARLEN = [(1, 3), (7, 7), (13, 5), (4, 11), (1, 1), (2, 0), (6, 9)]


def _cu(lengths, dtype=torch.int32):
    cu = torch.zeros(len(lengths) + 1, dtype=dtype)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=dtype), 0)
    return cu


def packed_reference(q, k, v, cu_q, cu_k, **kw):
    """The oracle's `varlen_reference` on packed (total, H, E) tensors: ((total_q, Hq, Ev), (Hq, total_q))."""
    out, lse = varlen_reference(*(x.transpose(0, 1)[None] for x in (q, k, v)), cu_q, cu_k, **kw)
    return out[0].transpose(0, 1), lse[0]


@pytest.mark.parametrize("kw", [
    pytest.param(dict(), marks=pytest.mark.thorough),
    pytest.param(dict(causal=True), marks=pytest.mark.thorough),
    dict(causal=True, alignment="bottom_right", cu_dtype=torch.int64),
    pytest.param(dict(window=(2, 1), alignment="bottom_right", max_seqlen=(13, 11)), marks=pytest.mark.thorough),
    dict(causal=True, sinks=True, softcap=4.0),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_varlen_matches_per_sequence_float64(kw):
    kw = dict(kw)
    gen = torch.Generator().manual_seed(11 + len(kw))
    cu_dtype, max_seqlen = kw.pop("cu_dtype", torch.int32), kw.pop("max_seqlen", (None, None))
    sinks = make(gen, 4) if kw.pop("sinks", False) else None
    total_q, total_k = sum(l for l, _ in VARLEN) + 3, sum(s for _, s in VARLEN) + 2  # 35 and 38, with padding
    q, k, v = make(gen, total_q, 4, 24), make(gen, total_k, 2, 24), make(gen, total_k, 2, 16)
    cu_q, cu_k = _cu([l for l, _ in VARLEN], cu_dtype), _cu([s for _, s in VARLEN], cu_dtype)
    out, lse = flash_attention(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1],
        causal=kw.get("causal", False), causal_alignment=kw.get("alignment", "top_left"), window=kw.get("window"),
        softcap=kw.get("softcap"), sinks=sinks, return_lse=True,
    )
    assert out.shape == (total_q, 4, 16) and lse.shape == (4, total_q) and lse.dtype == torch.float32
    ref_out, ref_lse = packed_reference(q, k, v, cu_q, cu_k, sinks=sinks, **kw)
    assert torch.all(out[-3:] == 0) and torch.all(lse[:, -3:] == float("-inf"))  # padding rows
    _check_against(out, lse, ref_out, ref_lse, [q, k, v] + ([sinks] if sinks is not None else []), gen)


def test_max_seqlen_rounds_to_powers_of_two_and_reuses_compilations():
    from jaxattn.bridge import cache_info
    from jaxattn.torch_api.flash import _max_seqlen

    assert [_max_seqlen("m", n, 100) for n in (None, 1, 5, 8, 9, 64, 65, 500)] == [100, 1, 8, 8, 16, 64, 100, 100]
    q = torch.randn(20, 2, 8)
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)
    flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=15, max_seqlen_k=15)
    misses = cache_info().misses
    for n in (9, 12, 16):  # all round to 16: the compiled op is reused
        flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n)
    assert cache_info().misses == misses


# ----------------------------------------------------------------------------------------------
# dropout
# ----------------------------------------------------------------------------------------------


def test_dropout_reproducible_by_torch_seed():
    gen = torch.Generator().manual_seed(21)
    q, k, v = make(gen, 2, 4, 9, 16, grad=False), make(gen, 2, 2, 12, 16, grad=False), make(gen, 2, 2, 12, 8, grad=False)

    def run(seed, **kw):
        torch.manual_seed(seed)
        return flash_attention(q, k, v, dropout_p=0.3, causal=True, **kw)

    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(flash_attention(q, k, v, dropout_p=0.0), flash_attention(q, k, v))
    torch.testing.assert_close(flash_attention(q, k, v, dropout_p=0.0).double(), reference(q, k, v)[0],
                               atol=2e-5, rtol=2e-5)
    # the varlen layout draws from torch's RNG the same way
    qv, kv = q[0].transpose(0, 1), k[0].transpose(0, 1)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 12], dtype=torch.int32)
    torch.manual_seed(3)
    x = flash_attention(qv, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(x, flash_attention(qv, kv, kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, dropout_p=0.5))


def test_dropout_keeps_scaled_weights_and_backward_reuses_the_mask():
    """With V = identity the output is the dropped-out weight matrix itself."""
    p, s = 0.4, 16
    gen = torch.Generator().manual_seed(22)
    q, k = make(gen, 1, 2, 10, 8, grad=False), make(gen, 1, 2, s, 8, grad=False)
    v = torch.eye(s).expand(1, 2, s, s).clone().requires_grad_(True)
    torch.manual_seed(5)
    out = flash_attention(q, k, v, dropout_p=p)
    probs = reference(q, k, v)[0]  # (1, 2, 10, S): the weights before dropout
    kept = out != 0
    torch.testing.assert_close(out[kept].double(), probs[kept] / (1 - p), atol=1e-6, rtol=1e-5)
    assert abs((~kept).double().mean().item() - p) < 0.1
    dout = torch.randn(out.shape, generator=gen)
    (grad_v,) = torch.autograd.grad(out, v, dout)
    assert torch.isfinite(grad_v).all()
    # out = W_dropped @ V, so dL/dV = W_dropped^T @ dout with the forward's W_dropped
    torch.testing.assert_close(grad_v, out.detach().transpose(-1, -2) @ dout, atol=1e-5, rtol=1e-5)


@pytest.mark.thorough  # a statistical check; dropout's mask and gradients are checked exactly above
def test_dropout_mean_approaches_no_dropout_and_gradients_are_finite():
    gen = torch.Generator().manual_seed(23)
    q, k, v = make(gen, 1, 2, 4, 8), make(gen, 1, 2, 8, 8), make(gen, 1, 2, 8, 8)
    plain = flash_attention(q, k, v).detach()
    torch.manual_seed(7)
    draws = torch.stack([flash_attention(q, k, v, dropout_p=0.2).detach() for _ in range(300)])
    assert (draws.std(0) > 0).all()  # the draws differ
    torch.testing.assert_close(draws.mean(0), plain, atol=0.08, rtol=0)
    out = flash_attention(q, k, v, dropout_p=0.2, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


# ----------------------------------------------------------------------------------------------
# errors of the new arguments
# ----------------------------------------------------------------------------------------------

_CU = torch.tensor([0, 3, 8], dtype=torch.int32)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cu_seqlens_q=_CU), r"cu_seqlens_k: required with cu_seqlens_q"),
    (dict(cu_seqlens_q=_CU[None], cu_seqlens_k=_CU), r"cu_seqlens_q: expected a 1-D int32 tensor.*shape \(1, 3\)"),
    (dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU.float()), r"cu_seqlens_k: expected a 1-D int32 tensor.*float32"),
    (dict(cu_seqlens_q=_CU[:1], cu_seqlens_k=_CU[:1]), r"cu_seqlens_q: expected .* N \+ 1 >= 2"),
    (dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU[:2]), r"cu_seqlens_q and cu_seqlens_k: lengths 3 and 2 differ"),
    (dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU, max_seqlen_q=0), r"max_seqlen_q=0: expected None or a Python int"),
    (dict(cu_seqlens_q=_CU, cu_seqlens_k=_CU, segment_ids=torch.zeros(1, 8, dtype=torch.int32)),
     r"segment_ids: not with cu_seqlens_q"),
])
def test_varlen_argument_errors(kwargs, match):
    q = torch.randn(8, 2, 16)
    with pytest.raises(AttentionInputError, match=match):
        flash_attention(q, q, q, **kwargs)


def test_varlen_layout_errors():
    q, k = torch.randn(8, 4, 16), torch.randn(9, 2, 16)
    with pytest.raises(AttentionInputError, match=r"q: with cu_seqlens_q the inputs are packed \(total_q, Hq, E\)"):
        flash_attention(q[None], k[None], k[None], cu_seqlens_q=_CU, cu_seqlens_k=_CU)
    with pytest.raises(AttentionInputError, match=r"k and v: \(total_k, Hk\) differ"):
        flash_attention(q, k, k[:7], cu_seqlens_q=_CU, cu_seqlens_k=_CU)
    with pytest.raises(AttentionInputError, match=r"q: 4 heads is not a multiple of k's 3 heads"):
        flash_attention(q, k[:, :1].expand(9, 3, 16), k[:, :1].expand(9, 3, 16), cu_seqlens_q=_CU, cu_seqlens_k=_CU)


@pytest.mark.parametrize("kwargs,match", [
    (dict(cu_seqlens_k=_CU), r"cu_seqlens_k \(shape \(3,\), dtype torch.int32, device cpu\): only used with cu_seqlens_q"),
    (dict(max_seqlen_q=8), r"max_seqlen_q \(8\): only used with cu_seqlens_q"),
    (dict(dropout_p=1.0), r"dropout_p=1.0: expected a float in \[0, 1\)"),
    (dict(dropout_p=-0.1), r"dropout_p=-0.1"),
    (dict(dropout_p=True), r"dropout_p=True"),
    (dict(dropout_p="0.1"), r"dropout_p='0.1'"),
    (dict(segment_ids=(torch.zeros(2, 9, dtype=torch.int32), torch.zeros(2, 12, dtype=torch.int32))),
     r"segment_ids: q_ids has shape \(2, 9\).*expected an integer tensor of shape \(B, L\) = \(2, 8\)"),
    (dict(segment_ids=(torch.zeros(2, 8), torch.zeros(2, 12))), r"segment_ids: q_ids has shape \(2, 8\), dtype torch.float32"),
    (dict(segment_ids=(torch.zeros(2, 8, dtype=torch.int64), torch.zeros(2, 8, dtype=torch.int64))),
     r"segment_ids: kv_ids has shape \(2, 8\).*\(B, S\) = \(2, 12\)"),
    (dict(segment_ids=(torch.zeros(2, 8, dtype=torch.int64),)), r"segment_ids: expected a \(q_ids, kv_ids\) pair"),
])
def test_padded_layout_argument_errors(kwargs, match):
    q, k = torch.randn(2, 2, 8, 16), torch.randn(2, 2, 12, 16)
    with pytest.raises(AttentionInputError, match=match):
        flash_attention(q, k, k, **kwargs)


@pytest.mark.parametrize("s,ids,match", [
    (12, torch.zeros(2, 8, dtype=torch.int32), r"segment_ids: one tensor \(shape \(2, 8\).* needs L == S, but L=8 and S=12"),
    (8, torch.zeros(2, 9, dtype=torch.int32), r"segment_ids: segment_ids has shape \(2, 9\).*of shape \(B, L\) = \(2, 8\)"),
    (8, torch.zeros(8, dtype=torch.int32), r"segment_ids: segment_ids has shape \(8,\)"),
    (8, torch.zeros(2, 8), r"segment_ids: segment_ids has shape \(2, 8\), dtype torch.float32, device cpu; expected an integer"),
    (8, torch.zeros(2, 8, dtype=torch.bool), r"segment_ids: .*dtype torch.bool, device cpu; expected an integer"),
])
def test_single_segment_ids_tensor_errors(s, ids, match):
    q, k = torch.randn(2, 2, 8, 16), torch.randn(2, 2, s, 16)
    with pytest.raises(AttentionInputError, match=match):
        flash_attention(q, k, k, segment_ids=ids)


def test_torch_compile_varlen_and_segment_ids():
    gen = torch.Generator().manual_seed(31)
    q, k, v = make(gen, 12, 2, 8), make(gen, 14, 1, 8), make(gen, 14, 1, 8)
    cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 14], dtype=torch.int32)
    ids = torch.tensor([[0] * 5 + [1] * 7])

    def f(q, k, v, cu_q, cu_k, ids):
        a = flash_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=9, causal=True)
        b = flash_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                            segment_ids=(ids, ids[:, :12].new_tensor([[0] * 9 + [1] * 5])))
        return a, b

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    for x, y in zip(compiled(q, k, v, cu_q, cu_k, ids), f(q, k, v, cu_q, cu_k, ids)):
        torch.testing.assert_close(x, y)
