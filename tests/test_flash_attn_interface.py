"""`jaxattn.flash_attn_interface`: flash-attn 2's functions, checked against flash-attn's documented
behaviour. The oracle is `flash_reference` below: flash-attn's documented rules (bottom-right
causal / window, the soft cap, the ALiBi bias, dropout with a given keep mask) in its own
(B, L, H, D) layout, mapped onto the suite's float64 oracle (tests/attention_reference.py). On CPU the XLA reference path serves the calls; the GPU class at the end
runs the Triton kernels under flash-attn's bf16/fp16 error rule."""

from __future__ import annotations

import importlib.util
import inspect
import math
import re

import pytest
import torch

from attention_reference import alibi_bias, assert_dtype_rule, reference

import jaxattn.flash_attn_interface as alias
from jaxattn.torch_api import AttentionInputError, sdpa_launcher
from jaxattn.torch_api import flash_attn_interface as fai


def flash_reference(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    softmax_scale=None, keep=None, dropout_p=0.0, dtype=torch.float64):
    """q (B, L, Hq, D), k (B, S, Hk, D), v (B, S, Hk, Dv) -> out (B, L, Hq, Dv), lse (B, Hq, L) in `dtype`.

    flash-attn's arguments mapped onto the suite's oracle (tests/attention_reference.py): query i sits
    at diagonal position i + S - L (bottom-right); window (left, right) keeps [i + S - L - left,
    i + S - L + right] (-1: unbounded; a side >= S is unbounded; causal forces right = 0); ALiBi adds
    -slope * |i + S - L - j|; `keep` (B, Hq, L, S) is a dropout keep mask (kept weights scaled by
    1 / (1 - dropout_p)). Rows that see nothing: out 0, lse -inf.
    """
    l, s = q.shape[1], k.shape[1]
    left, right = (-1 if w >= s else w for w in window_size)
    if causal:
        right = 0
    window = None if (left, right) == (-1, -1) else (left, right)
    bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, l, s, device=q.device)
    out, lse = reference(*(t.transpose(1, 2) for t in (q, k, v)), alignment="bottom_right", window=window,
                         softcap=softcap or None, scale=softmax_scale, bias=bias, dropout_keep=keep,
                         dropout_p=dropout_p, dtype=dtype)
    return out.transpose(1, 2), lse


def make(gen, *shape, grad=True):
    return torch.randn(*shape, generator=gen).requires_grad_(grad)


def check_against_reference(out, lse, ref_out, ref_lse, inputs, gen, tol=2e-5):
    """Output, LSE (-inf exactly where the reference's is) and the gradients of `inputs`."""
    assert out.shape == ref_out.shape and out.dtype == inputs[0].dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and bool((lse[~finite] == -math.inf).all())
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=tol, rtol=tol)
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref_out, inputs, dout.double())
    for name, g, rg in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), rg.double(), atol=5 * tol, rtol=5 * tol, msg=lambda m: f"d{name}: {m}")


# (B, L, S, Hq, Hk, D, options): L != S both ways, GQA / MQA, odd sizes, head dim 80 once.
CASES = [
    pytest.param(2, 97, 130, 4, 2, 32, dict(causal=True), id="causal-L<S-gqa"),
    pytest.param(1, 130, 97, 2, 1, 16, dict(causal=True), id="causal-L>S-mqa-empty-rows"),
    pytest.param(1, 97, 130, 2, 2, 16, dict(causal=True, window_size=(7, 3)), id="causal-window-right-ignored"),
    pytest.param(1, 97, 130, 2, 1, 16, dict(window_size=(-1, 0)), id="window(-1,0)"),
    pytest.param(2, 61, 45, 4, 2, 80, dict(softcap=4.0, alibi="batch", softmax_scale=0.3),
                 id="softcap-alibi(B,H)-d80-scale"),
    pytest.param(1, 97, 130, 2, 2, 16, dict(window_size=(5, 0)), id="window(5,0)", marks=pytest.mark.thorough),
    pytest.param(1, 45, 61, 2, 2, 16, dict(window_size=(6, 9)), id="window(6,9)", marks=pytest.mark.thorough),
    pytest.param(1, 40, 13, 2, 2, 16, dict(window_size=(3, 20)), id="window-right>=S-unbounded",
                 marks=pytest.mark.thorough),
    pytest.param(2, 97, 130, 4, 2, 16, dict(causal=True, alibi="head"), id="causal-alibi(H)",
                 marks=pytest.mark.thorough),
    pytest.param(1, 130, 97, 4, 4, 16, dict(causal=True, window_size=(9, -1), softcap=2.0), id="causal-window-softcap",
                 marks=pytest.mark.thorough),
]


def _case_inputs(gen, b, l, s, hq, hk, d, options):
    q, k, v = make(gen, b, l, hq, d), make(gen, b, s, hk, d), make(gen, b, s, hk, d)
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (b, hq), generator=gen) * 0.5
    return q, k, v, options


@pytest.mark.parametrize("b,l,s,hq,hk,d,options", CASES)
def test_flash_attn_func_matches_the_reference(b, l, s, hq, hk, d, options):
    gen = torch.Generator().manual_seed(l * 1000 + s + d)
    q, k, v, options = _case_inputs(gen, b, l, s, hq, hk, d, options)
    out, lse, s_dmask = fai.flash_attn_func(q, k, v, return_attn_probs=True, **options)
    ref_out, ref_lse = flash_reference(q, k, v, **options)
    assert out.shape == (b, l, hq, d) and lse.shape == (b, hq, l)
    check_against_reference(out, lse, ref_out, ref_lse, [q, k, v], gen)
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype  # flash-attn's S_dmask when dropout_p == 0


def test_causal_is_bottom_right_as_documented():
    """flash-attn's docstring example: L=2, S=5 keeps 1 1 1 1 0 / 1 1 1 1 1; L=5, S=2 hides rows 0-2.
    With v = identity each output row shows which keys it weighed."""
    for l, s, expected in ((2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
                           (5, 2, [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]])):
        q, k = torch.zeros(1, l, 1, 8), torch.zeros(1, s, 1, 8)
        v = torch.eye(s).reshape(1, s, 1, s)
        out = fai.flash_attn_func(q, k, v, causal=True)
        assert torch.equal((out[0, :, 0] > 0).int(), torch.tensor(expected, dtype=torch.int32))


def test_packed_variants_equal_the_unpacked_call():
    gen = torch.Generator().manual_seed(5)
    qkv = make(gen, 2, 37, 3, 2, 16)
    kw = dict(causal=True, window_size=(4, 0), softcap=3.0)
    out = fai.flash_attn_qkvpacked_func(qkv, **kw)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    expected = fai.flash_attn_func(q, k, v, **kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    dout = torch.randn(out.shape, generator=gen)
    edq, edk, edv = torch.autograd.grad(expected, [q, k, v], dout)
    (dqkv,) = torch.autograd.grad(out, [qkv], dout)
    torch.testing.assert_close(dqkv, torch.stack([edq, edk, edv], dim=2))

    kv = torch.stack([k.detach(), v.detach()], dim=2).requires_grad_()
    out = fai.flash_attn_kvpacked_func(q, kv, **kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    dq, dkv = torch.autograd.grad(out, [q, kv], dout)
    torch.testing.assert_close(dq, edq)
    torch.testing.assert_close(dkv, torch.stack([edk, edv], dim=2))


# Uneven sequences, an empty one (no queries, no keys) and one whose queries see no key.
CU_Q, CU_K = [0, 13, 13, 40, 47, 72], [0, 20, 20, 29, 29, 60]


def _varlen_reference(q, k, v, cu_q, cu_k, alibi_slopes=None, **options):
    """flash_reference on each packed sequence; (total_q, Hq, Dv) and (Hq, total_q)."""
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        slopes = None if alibi_slopes is None else alibi_slopes[n] if alibi_slopes.dim() == 2 else alibi_slopes
        o, lse = flash_reference(q[None, cu_q[n]:cu_q[n + 1]], k[None, cu_k[n]:cu_k[n + 1]],
                                 v[None, cu_k[n]:cu_k[n + 1]], alibi_slopes=slopes, **options)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("options", [
    dict(causal=True, window_size=(6, -1), alibi="batch"),
    pytest.param(dict(), marks=pytest.mark.thorough),
    pytest.param(dict(window_size=(3, 2), softcap=2.5, alibi="head"), marks=pytest.mark.thorough),
])
def test_varlen_matches_the_reference_per_sequence(options):
    gen = torch.Generator().manual_seed(11)
    hq, hk, d = 4, 2, 16
    q, k, v = make(gen, CU_Q[-1], hq, d), make(gen, CU_K[-1], hk, d), make(gen, CU_K[-1], hk, d)
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (len(CU_Q) - 1, hq), generator=gen)
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32) for c in (CU_Q, CU_K))
    lens_q, lens_k = [b - a for a, b in zip(CU_Q, CU_Q[1:])], [b - a for a, b in zip(CU_K, CU_K[1:])]
    out, lse, _ = fai.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             return_attn_probs=True, **options)
    ref_out, ref_lse = _varlen_reference(q, k, v, CU_Q, CU_K, **options)
    assert out.shape == (CU_Q[-1], hq, d) and lse.shape == (hq, CU_Q[-1])
    assert bool((lse[:, 40:47] == -math.inf).all()) and not bool(out[40:47].any())  # queries without keys
    check_against_reference(out, lse, ref_out, ref_lse, [q, k, v], gen)


def test_varlen_packed_variants_equal_the_unpacked_call():
    gen = torch.Generator().manual_seed(12)
    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
    qkv = make(gen, 30, 3, 2, 16)
    kw = dict(causal=True, softcap=3.0)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    expected = fai.flash_attn_varlen_func(q, k, v, cu, cu, 21, 21, **kw)
    dout = torch.randn(expected.shape, generator=gen)
    eq, ek, ev = torch.autograd.grad(expected, [q, k, v], dout)

    out = fai.flash_attn_varlen_qkvpacked_func(qkv, cu, 21, **kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(torch.autograd.grad(out, [qkv], dout)[0], torch.stack([eq, ek, ev], dim=1))

    kv = torch.stack([k.detach(), v.detach()], dim=1).requires_grad_()
    out = fai.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 21, 21, **kw)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    dq, dkv = torch.autograd.grad(out, [q, kv], dout)
    torch.testing.assert_close(dq, eq)
    torch.testing.assert_close(dkv, torch.stack([ek, ev], dim=1))


def test_dropout_drops_weights_from_torch_rng():
    """With v the identity, out[i, j] * (1 - p) is the attention weight of key j or 0 where dropped: the
    kept weights equal the reference's, about p of them are dropped, torch.manual_seed reproduces the
    mask, and the gradients are the reference's under that same mask (backward reuses it)."""
    p, l, s, h = 0.3, 40, 64, 2
    gen = torch.Generator().manual_seed(21)
    q, k = make(gen, 1, l, h, 16), make(gen, 1, s, h, 16)
    v = torch.eye(s).expand(1, h, s, s).transpose(1, 2).contiguous().requires_grad_()
    torch.manual_seed(7)
    out = fai.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    torch.manual_seed(7)
    again = fai.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    assert torch.equal(out, again)
    assert not torch.equal(out, fai.flash_attn_func(q, k, v, dropout_p=p, causal=True))  # the RNG moved on

    weights, _ = flash_reference(q, k, v, causal=True)  # (1, L, H, S): the undropped weights
    keep = (out != 0).permute(0, 2, 1, 3)  # (B, H, L, S)
    shown = weights.detach().permute(0, 2, 1, 3) > 0
    dropped = (~keep & shown).sum().item() / shown.sum().item()
    assert abs(dropped - p) < 0.03, dropped
    torch.testing.assert_close((out.double() * (1 - p))[out != 0], weights.detach()[out != 0], atol=1e-6, rtol=1e-5)

    ref_out, _ = flash_reference(q, k, v, causal=True, keep=keep, dropout_p=p)
    dout = torch.randn(out.shape, generator=gen)
    for g, rg in zip(torch.autograd.grad(out, [q, k, v], dout), torch.autograd.grad(ref_out, [q, k, v], dout.double())):
        torch.testing.assert_close(g.double(), rg.double(), atol=1e-4, rtol=1e-4)


def test_deterministic_is_accepted_and_repeatable():
    gen = torch.Generator().manual_seed(3)
    q, k, v = make(gen, 1, 97, 2, 16), make(gen, 1, 130, 2, 16), make(gen, 1, 130, 2, 16)
    outs = [fai.flash_attn_func(q, k, v, causal=True, deterministic=flag) for flag in (False, True, True)]
    grads = [torch.autograd.grad(o, [q, k, v], torch.ones_like(o)) for o in outs]
    for o, g in zip(outs[1:], grads[1:]):
        assert torch.equal(o, outs[0]) and all(torch.equal(a, b) for a, b in zip(g, grads[0]))
    # on CUDA, deterministic=True forces jaxattn's Triton kernels (cuDNN's backward uses atomics)
    for flag, expected in ((True, "flash"), (False, None)):
        assert fai._options(None, 0.0, flag, False, 0.0, torch.device("cuda"))["implementation"] == expected


# flash-attn 2's documented signatures: parameter names and defaults, in order.
COMMON = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
          ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
SIGNATURES = {
    "flash_attn_func": ["q", "k", "v"] + COMMON,
    "flash_attn_kvpacked_func": ["q", "kv"] + COMMON,
    "flash_attn_qkvpacked_func": ["qkv"] + COMMON,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + COMMON + [("block_table", None)],
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + COMMON,
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + COMMON,
}


# Arguments flash-attn 2's public functions lack (flash-attn 3's have them), after flash-attn 2's own.
KEYWORD_ONLY_EXTRAS = {"flash_attn_varlen_func": [("seqused_q", None), ("seqused_k", None)]}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_signatures_are_flash_attn_s(name):
    params = list(inspect.signature(getattr(fai, name)).parameters.values())
    extras = KEYWORD_ONLY_EXTRAS.get(name, [])
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default) for p in params]
    assert got == SIGNATURES[name] + extras
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:len(params) - len(extras)])
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[len(params) - len(extras):])
    assert getattr(alias, name) is getattr(fai, name)
    assert name in fai.__all__ and name in alias.__all__


def _small(gen):
    return make(gen, 1, 5, 2, 8), make(gen, 1, 7, 2, 8), make(gen, 1, 7, 2, 8)


@pytest.mark.parametrize("kw,error,names", [
    (dict(window_size=(-2, 0)), AttentionInputError, "window_size=(-2, 0)"),
    (dict(window_size=4), AttentionInputError, "window_size=4"),
    (dict(window_size=(1.5, 0)), AttentionInputError, "window_size=(1.5, 0)"),
    (dict(softcap=-1.0), AttentionInputError, "softcap=-1.0"),
    (dict(softcap=math.inf), AttentionInputError, "softcap=inf"),
    (dict(softmax_scale="0.1"), AttentionInputError, "softmax_scale='0.1'"),
    (dict(deterministic=1), TypeError, "deterministic=1"),
    (dict(return_attn_probs="yes"), TypeError, "return_attn_probs='yes'"),
    (dict(return_attn_probs=True, dropout_p=0.1), NotImplementedError, "return_attn_probs=True"),
    (dict(dropout_p=1.0), AttentionInputError, "dropout_p=1.0"),
    (dict(causal=1), TypeError, "causal=1"),
    (dict(alibi_slopes=torch.ones(3)), AttentionInputError, "alibi_slopes"),
])
def test_bad_arguments_raise_naming_them(kw, error, names):
    q, k, v = _small(torch.Generator().manual_seed(0))
    with pytest.raises(error, match=f"^{re.escape(names)}"):
        fai.flash_attn_func(q, k, v, **kw)


def test_bad_layouts_raise_naming_the_tensor():
    gen = torch.Generator().manual_seed(0)
    q, k, v = _small(gen)
    with pytest.raises(AttentionInputError, match=r"^q: expected shape \(batch, seqlen, nheads, headdim\)"):
        fai.flash_attn_func(q[0], k, v)
    with pytest.raises(AttentionInputError, match=r"^kv: .* with 2 at dim 2"):
        fai.flash_attn_kvpacked_func(q, torch.stack([k, v, v], dim=2))
    with pytest.raises(AttentionInputError, match=r"^qkv: expected shape \(batch, seqlen, 3, nheads, headdim\)"):
        fai.flash_attn_qkvpacked_func(q)
    with pytest.raises(AttentionInputError, match=r"^qkv: .* with 3 at dim 1"):
        fai.flash_attn_varlen_qkvpacked_func(make(gen, 6, 2, 2, 8), torch.tensor([0, 6], dtype=torch.int32), 6)
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor"):
        fai.flash_attn_func(q, None, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("jax_triton") is None,
                    reason="needs jax-triton (the gpu extra: pip install -e '.[gpu]' in the jaxattn checkout)")
class TestOnGPU:
    """bf16 / fp16 on CUDA, both launchers: error against a float32 reference at most twice torch's own
    same-dtype error (plus a rounding floor), outputs and gradients."""

    GPU_CASES = [
        (2, 97, 1025, 8, 2, 64, dict(causal=True)),
        (1, 1025, 97, 4, 4, 80, dict(causal=True, window_size=(32, 0), softcap=20.0)),
        (2, 200, 300, 4, 1, 128, dict(window_size=(40, 16), alibi="batch")),
        (1, 256, 256, 4, 2, 96, dict(causal=True, alibi="head")),
    ]

    @pytest.mark.parametrize("launcher", ["native", "xla"])
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    @pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c[:6])) + str(sorted(c[6])))
    def test_flash_attn_func_dtype_rule(self, case, dtype, launcher):
        gen = torch.Generator(device="cuda").manual_seed(sum(case[:6]))
        b, l, s, hq, hk, d, options = case
        q, k, v = (torch.randn(n, generator=gen, device="cuda").to(dtype).requires_grad_()
                   for n in ((b, l, hq, d), (b, s, hk, d), (b, s, hk, d)))
        options = dict(options)
        kind = options.pop("alibi", None)
        if kind is not None:
            options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (b, hq), generator=gen, device="cuda")
        with sdpa_launcher(launcher):
            out, lse, _ = fai.flash_attn_func(q, k, v, return_attn_probs=True, deterministic=True, **options)
        _cuda_reference_checks(out, lse, q, k, v, options, gen)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_varlen_dtype_rule_and_deterministic_backward(self, dtype):
        gen = torch.Generator(device="cuda").manual_seed(31)
        cu_q, cu_k = [0, 100, 100, 357, 400], [0, 130, 140, 140, 600]
        q, k, v = (torch.randn(n, generator=gen, device="cuda").to(dtype).requires_grad_()
                   for n in ((cu_q[-1], 8, 64), (cu_k[-1], 2, 64), (cu_k[-1], 2, 64)))
        kw = dict(causal=True, window_size=(64, 0), softcap=15.0)
        args = tuple(torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k)) + (257, 460)
        out = fai.flash_attn_varlen_func(q, k, v, *args, deterministic=True, **kw)
        dout = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
        grads = torch.autograd.grad(out, [q, k, v], dout)
        again = fai.flash_attn_varlen_func(q, k, v, *args, deterministic=True, **kw)
        assert torch.equal(out, again)
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(again, [q, k, v], dout)))
        for n in range(len(cu_q) - 1):
            qs, ks, vs = q[None, cu_q[n]:cu_q[n + 1]], k[None, cu_k[n]:cu_k[n + 1]], v[None, cu_k[n]:cu_k[n + 1]]
            ref, _ = flash_reference(qs, ks, vs, dtype=torch.float32, **kw)
            low, _ = flash_reference(qs, ks, vs, dtype=dtype, **kw)
            assert_dtype_rule(f"out[{n}]", out[None, cu_q[n]:cu_q[n + 1]], ref, low, floor=1e-3)


def _cuda_reference_checks(out, lse, q, k, v, options, gen):
    # float32 leaves for the reference, so that its gradients are not rounded to q's dtype
    high = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = flash_reference(*high, dtype=torch.float32, **options)
    low, _ = flash_reference(q, k, v, dtype=q.dtype, **options)
    assert out.dtype == q.dtype and out.is_contiguous()
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2
    dout = torch.randn(out.shape, generator=gen, device=out.device).to(out.dtype)
    grads = torch.autograd.grad(out, [q, k, v], dout)
    ref_grads = torch.autograd.grad(ref, high, dout.float())
    low_grads = torch.autograd.grad(low, [q, k, v], dout)
    for name, g, rg, lg in zip("qkv", grads, ref_grads, low_grads):
        assert_dtype_rule(f"d{name}", g, rg, lg, floor=1e-3)
