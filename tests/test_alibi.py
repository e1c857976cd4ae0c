"""ALiBi (`alibi_slopes`, flash-attn's convention) through `torch_api.flash_attention`.

Both launchers run here: the native one (the Triton kernels from torch, interpreted on CPU) and the
XLA bridge (on CPU the XLA reference implementations, which receive ALiBi as an additive bias). The
oracle is the float64 reference of tests/attention_reference.py with the explicit bias matrix it
builds from the formula (`alibi_bias`, `varlen_alibi_bias`): bias[b, h, i, j] = -slopes[b, h] *
|i + S - L - j| (positions and lengths of each sequence with varlen). Shapes stay small: the kernels run under Triton's interpreter.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import (alibi_bias, assert_close_finite, reference, varlen_alibi_bias,  # noqa: E402
                                 varlen_reference)

from jaxattn.bridge.triton_launch import can_launch  # noqa: E402
from jaxattn.jax_core import AttentionMetadata, attention  # noqa: E402
from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402
from jaxattn.jax_core.kernels.flash_plan import FlashConfig  # noqa: E402
from jaxattn.torch_api import flash_attention, native_flash, sdpa_launcher  # noqa: E402
from jaxattn.torch_api.native_flash import flash_forward  # noqa: E402
from jaxattn.torch_api.validation import AttentionInputError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels
pytestmark = pytest.mark.skipif(not can_launch(torch.device(DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1")
# compiled kernels (on CUDA) run float32 dots as tf32x3; the interpreter multiplies exactly
TOL = 2e-4 if DEVICE == "cuda" else 3e-5
GRAD_TOL = 5e-4 if DEVICE == "cuda" else 1e-4


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _lse_loss(out, lse, cot, cot_lse):
    """sum(out * cot) + sum(lse * cot_lse) over rows with a finite LSE (the LSE's gradient path too)."""
    finite = torch.isfinite(lse)
    return (out * cot).sum() + torch.where(finite, lse * cot_lse, torch.zeros_like(lse)).sum()


def _check(got, want, leaves_got, leaves_want):
    """Output, LSE (its -inf rows included) and the gradients of q, k, v."""
    (out, lse), (ref, ref_lse) = got, want
    assert_close_finite("out", out.detach().double().cpu(), ref.detach(), TOL)
    assert_close_finite("lse", lse.detach().double().cpu(), ref_lse.detach(), TOL)
    for name, a, b in zip("qkv", leaves_got, leaves_want):
        assert_close_finite(f"d{name}", a.grad.double().cpu(), b.grad, GRAD_TOL)


CASES = {
    # name: (b, hq, hk, l, s, d, per-batch slopes, flash_attention keywords)
    "gqa-head-slopes": (2, 4, 2, 13, 29, 16, False, dict()),
    "causal-bottom-right-batch-slopes": (2, 4, 2, 13, 29, 16, True, dict(causal=True, causal_alignment="bottom_right")),
    # top-left causality with L > S: the distance stays bottom-right aligned
    "causal-top-left-l-gt-s": (2, 4, 4, 29, 13, 16, True, dict(causal=True)),
    "window-softcap-sinks": (1, 4, 2, 17, 40, 16, False,
                             dict(window=(4, 6), causal_alignment="bottom_right", softcap=3.0, sinks=True)),
    "head-dim-80-segments": (2, 2, 1, 17, 33, 80, True, dict(causal=True, segments=True)),
}


@pytest.mark.parametrize("launcher", ["native", "xla"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_alibi_matches_the_float64_formula(case, launcher):
    b, hq, hk, l, s, d, per_batch, kw = CASES[case]
    kw = dict(kw)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, l, d), (b, hk, s, d), (b, hk, s, d)))
    slopes = torch.rand(b, hq, generator=gen) if per_batch else torch.rand(hq, generator=gen)
    sinks = torch.randn(hq, generator=gen) if kw.pop("sinks", False) else None
    segments = None
    if kw.pop("segments", False):
        segments = (torch.randint(0, 2, (b, l), generator=gen).sort(dim=1).values,
                    torch.randint(0, 2, (b, s), generator=gen).sort(dim=1).values)
    cot, cot_lse = torch.randn(b, hq, l, d, generator=gen), torch.randn(b, hq, l, generator=gen)

    leaves = [x.detach().clone().to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    with sdpa_launcher(launcher):
        out, lse = flash_attention(*leaves, alibi_slopes=slopes.to(DEVICE), sinks=None if sinks is None else
                                   sinks.to(DEVICE), segment_ids=None if segments is None else
                                   tuple(t.to(DEVICE) for t in segments), return_lse=True, **kw)
    _lse_loss(out, lse, cot.to(DEVICE), cot_lse.to(DEVICE)).backward()

    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = reference(*ref_leaves, causal=kw.get("causal", False),
                             alignment=kw.get("causal_alignment", "top_left"), window=kw.get("window"),
                             softcap=kw.get("softcap"), sinks=sinks, segment_ids=segments,
                             bias=alibi_bias(slopes, l, s))
    _lse_loss(ref, ref_lse, cot.double(), cot_lse.double()).backward()
    _check((out, lse), (ref, ref_lse), leaves, ref_leaves)


@pytest.mark.parametrize("launcher,causal", [("native", True), ("xla", True), ("native", False)])
def test_alibi_varlen_uses_positions_within_each_sequence(launcher, causal):
    """Sequences (q, k) of lengths (5, 14), (13, 16), (3, 2): the last one, bottom-right aligned,
    has a query row that sees no key (LSE -inf); rows after the last sequence are padding."""
    gen = torch.Generator().manual_seed(11 + causal)
    cu_q, cu_k = [0, 5, 18, 21], [0, 14, 30, 32]
    t, s, hq, hk, d = 24, 34, 4, 2, 16
    q = torch.randn(t, hq, d, generator=gen)
    k, v = (torch.randn(s, hk, d, generator=gen) for _ in "kv")
    slopes = torch.rand(len(cu_q) - 1, hq, generator=gen)
    cot, cot_lse = torch.randn(t, hq, d, generator=gen), torch.randn(hq, t, generator=gen)
    leaves = [x.detach().clone().to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    cu = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cu_q, cu_k)]
    with sdpa_launcher(launcher):
        out, lse = flash_attention(*leaves, causal=causal, causal_alignment="bottom_right", cu_seqlens_q=cu[0],
                                   cu_seqlens_k=cu[1], alibi_slopes=slopes.to(DEVICE), return_lse=True)
    _lse_loss(out, lse, cot.to(DEVICE), cot_lse.to(DEVICE)).backward()

    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = varlen_reference(*(x.transpose(0, 1)[None] for x in ref_leaves), cu_q, cu_k, causal=causal,
                                    alignment="bottom_right", bias=varlen_alibi_bias(slopes, cu_q, cu_k, t, s))
    ref, ref_lse = ref[0].transpose(0, 1), ref_lse[0]
    _lse_loss(ref, ref_lse, cot.double(), cot_lse.double()).backward()
    if causal:
        assert torch.isneginf(ref_lse[:, 18]).all()  # the empty row the docstring promises
    _check((out, lse), (ref, ref_lse), leaves, ref_leaves)


def test_alibi_with_dropout_uses_the_kernels_keep_mask():
    from test_native_launch import _keep_mask

    gen = torch.Generator().manual_seed(3)
    b, h, l, s, d, p = 1, 2, 19, 26, 16, 0.3
    q, k, v = (torch.randn(b, h, t, d, generator=gen) for t in (l, s, s))
    slopes = torch.rand(h, generator=gen)
    seed = torch.tensor([4321, 87], dtype=torch.int32, device=DEVICE)
    cfg = FlashConfig(scale=d ** -0.5, dropout_p=p, causal=True, diag_offset=s - l)
    leaves = [x.detach().clone().to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    out, lse = flash_forward(*leaves, cfg, seed=seed, alibi_slopes=slopes.to(DEVICE))
    cot = torch.randn(b, h, l, d, generator=gen)
    (out * cot.to(DEVICE)).sum().backward()
    keep = _keep_mask(seed, b * h, l, s, p).reshape(b, h, l, s)
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref, ref_lse = reference(*ref_leaves, causal=True, alignment="bottom_right", bias=alibi_bias(slopes, l, s),
                             dropout_keep=keep, dropout_p=p)
    (ref * cot.double()).sum().backward()
    _check((out, lse), (ref, ref_lse), leaves, ref_leaves)


def test_launchers_bit_identical_with_alibi(monkeypatch):
    """The torch launcher and the JAX launcher (static entries) give the same bits: outputs, LSE and
    gradients, with per-batch slopes, GQA and bottom-right causality."""
    monkeypatch.setattr(native_flash, "DYNAMIC_MAX_QUERIES", 0)
    gen = torch.Generator().manual_seed(17)
    b, hq, hk, l, s, d = 2, 4, 2, 21, 33, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, l, d), (b, hk, s, d), (b, hk, s, d)))
    slopes, cot = torch.rand(b, hq, generator=gen), torch.randn(b, hq, l, d, generator=gen)
    cfg = FlashConfig(scale=d ** -0.5, causal=True, diag_offset=s - l, softcap=4.0)
    leaves = [x.detach().clone().to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    out, lse = flash_forward(*leaves, cfg, alibi_slopes=slopes.to(DEVICE))
    (out * cot.to(DEVICE)).sum().backward()
    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731

    def loss(q, k, v):
        o, lse_ = fj.flash_attention_triton(q, k, v, None, None, None, fj.FlashExtras(alibi_slopes=j(slopes)), cfg)
        return jnp.sum(o * j(cot)), (o, lse_)

    grads, (jout, jlse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(j(q), j(k), j(v))
    if DEVICE == "cuda":  # compiled twice, the compiler may order the operations differently
        same = lambda t, a: np.allclose(t.detach().cpu().numpy(), np.asarray(a), rtol=1e-5, atol=1e-6)  # noqa: E731
    else:
        same = lambda t, a: np.array_equal(t.detach().cpu().numpy(), np.asarray(a))  # noqa: E731
    assert same(out, jout) and same(lse, jlse)
    for name, t, g in zip("qkv", leaves, grads):
        assert same(t.grad, g), f"grad {name} differs"


@pytest.mark.parametrize("implementation", ["flash", "vanilla"])
def test_jax_core_attention_takes_alibi_slopes(implementation):
    """jax_core's entry point: the Triton kernels (the jax-triton path) and the reference, which gets
    ALiBi as a bias; the slopes get no gradient."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hk, l, s, d = 2, 4, 2, 13, 29, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, l, hq, d), (b, s, hk, d), (b, s, hk, d)))
    slopes = torch.rand(hq, generator=gen)
    md = AttentionMetadata(platform="gpu", backend="rocm") if implementation == "flash" and not ON_GPU else None

    def run(q, k, v, slopes):
        res = attention(q, k, v, causal=True, causal_alignment="bottom_right", alibi_slopes=slopes,
                        return_lse=True, implementation=implementation, metadata=md)
        return jnp.sum(res.attention_outputs), (res.attention_outputs, res.lse)

    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    with jax.default_matmul_precision("float32"):  # XLA on a GPU would multiply float32 in TF32
        grads, (out, lse) = jax.grad(run, argnums=(0, 3), has_aux=True)(j(q), j(k), j(v), j(slopes))
    ref, ref_lse = reference(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, alignment="bottom_right",
                             bias=alibi_bias(slopes, l, s))
    to64 = lambda a: torch.from_numpy(np.array(a, np.float64))  # noqa: E731
    assert_close_finite("out", to64(out).transpose(1, 2), ref, TOL)
    assert_close_finite("lse", to64(lse), ref_lse, TOL)
    assert not np.asarray(grads[1]).any(), "the slopes got a gradient"


def test_alibi_causal_matches_flash_attn_reference_up_to_a_row_constant():
    """flash-attn's test reference biases causal rows by slope * (j - S + 1) instead of the distance:
    a per-row constant apart, so outputs agree and the LSE differs by -slope * (L - 1 - i)."""
    gen = torch.Generator().manual_seed(2)
    b, h, l, s, d = 1, 3, 7, 12, 8
    q, k, v = (torch.randn(b, h, t, d, generator=gen, dtype=torch.float64) for t in (l, s, s))
    slopes = torch.rand(h, generator=gen)
    ours, ours_lse = reference(q, k, v, causal=True, alignment="bottom_right", bias=alibi_bias(slopes, l, s))
    theirs_bias = torch.arange(-s + 1, 1, dtype=torch.float64) * slopes.double().view(1, h, 1, 1)
    theirs, theirs_lse = reference(q, k, v, causal=True, alignment="bottom_right", bias=theirs_bias)
    torch.testing.assert_close(ours, theirs)
    rows = torch.arange(l, dtype=torch.float64)
    torch.testing.assert_close(theirs_lse, ours_lse - slopes.double().view(1, h, 1) * (l - 1 - rows))


@pytest.mark.parametrize("launcher", ["native", "xla"])
def test_slopes_get_no_gradient(launcher):
    q = torch.randn(1, 2, 9, 16, device=DEVICE, requires_grad=True)
    slopes = torch.rand(2, device=DEVICE, requires_grad=True)
    with sdpa_launcher(launcher):
        out = flash_attention(q, q, q, causal=True, alibi_slopes=slopes)
    out.sum().backward()
    assert slopes.grad is None and q.grad is not None and torch.isfinite(q.grad).all()


BAD_SLOPES = {
    "wrong-heads": (lambda: torch.rand(3), AttentionInputError, r"alibi_slopes: .*shape \(3,\).*\(Hq,\)=\(4,\)"),
    "wrong-batch": (lambda: torch.rand(3, 4), AttentionInputError, r"alibi_slopes: .*\(B, Hq\)=\(2, 4\)"),
    "three-dims": (lambda: torch.rand(2, 4, 1), AttentionInputError, r"alibi_slopes: .*shape \(2, 4, 1\)"),
    "float64": (lambda: torch.rand(4, dtype=torch.float64), AttentionInputError, r"alibi_slopes: .*float64.*float32"),
    "bfloat16": (lambda: torch.rand(4).bfloat16(), AttentionInputError, r"alibi_slopes: .*bfloat16.*float32"),
    "device": (lambda: torch.rand(4, device="meta"), AttentionInputError, r"alibi_slopes: on meta but q is on"),
    "list": (lambda: [0.5] * 4, TypeError, r"alibi_slopes: expected a float32 tensor.*got list"),
    "infinite": (lambda: torch.tensor([0.5, float("inf"), 0.1, 0.2]), AttentionInputError, r"alibi_slopes"),
}


@pytest.mark.parametrize("bad", sorted(BAD_SLOPES))
def test_bad_slopes_raise_naming_alibi_slopes(bad):
    make, error, pattern = BAD_SLOPES[bad]
    q = torch.randn(2, 4, 5, 8, device=DEVICE)
    with pytest.raises(error, match=pattern):
        flash_attention(q, q, q, alibi_slopes=make())


def test_bad_slopes_on_varlen_and_in_jax_core():
    q = torch.randn(10, 4, 8, device=DEVICE)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AttentionInputError, match=r"alibi_slopes: .*\(N sequences, Hq\)=\(2, 4\)"):
        flash_attention(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, alibi_slopes=torch.rand(3, 4, device=DEVICE))
    x = jnp.zeros((2, 5, 4, 8))
    with pytest.raises(ValueError, match=r"alibi_slopes: shape \(3,\).*\(Hq,\)=\(4,\)"):
        attention(x, x, x, alibi_slopes=jnp.ones(3), implementation="vanilla")
    with pytest.raises(ValueError, match=r"alibi_slopes: .*int32"):
        attention(x, x, x, alibi_slopes=jnp.ones(4, jnp.int32), implementation="vanilla")
