"""The native launcher: jaxattn's Triton kernels launched from torch, through the public torch API.

On CPU the kernels run under Triton's interpreter on torch CPU tensors (conftest sets
TRITON_INTERPRET=1 without a GPU), forced with `sdpa_launcher("native")`; on a CUDA machine the
same tests run the compiled kernels. The oracle is torch's SDPA (math) in float64 or the float64
reference of tests/attention_reference.py. Bit-identity of the two launchers is tested against the
JAX launcher (jax-triton where JAX runs on the GPU with it installed, else the stand-in).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import jax_triton_interpret  # noqa: E402
from attention_reference import assert_close_finite, assert_dtype_rule, reference, reference_grads  # noqa: E402
from thorough_grid import grid  # noqa: E402

from jaxattn.bridge import cache_info  # noqa: E402
from jaxattn.bridge.triton_launch import can_launch  # noqa: E402
from jaxattn.jax_core.kernels import flash_jax_triton as fj  # noqa: E402
from jaxattn.jax_core.kernels.flash_plan import FlashConfig  # noqa: E402
from jaxattn.torch_api import flash_attention, scaled_dot_product_attention, sdpa_launcher  # noqa: E402
from jaxattn.torch_api import native_flash  # noqa: E402
from jaxattn.torch_api import sdpa as sdpa_module  # noqa: E402
from jaxattn.torch_api.native_flash import flash_forward  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = jax_triton_interpret.real_jax_triton_runs()  # else the stand-in launches the kernels
pytestmark = pytest.mark.skipif(not can_launch(torch.device(DEVICE)), reason="needs CUDA or TRITON_INTERPRET=1")
# float32 runs its dots as tf32x3 on a GPU (near fp32); exact fp32 products under the interpreter.
TOL = 2e-4 if DEVICE == "cuda" else 2e-5


@pytest.fixture(autouse=True)
def interpreted_jax_triton(monkeypatch):
    jax_triton_interpret.install(monkeypatch)


def _randn(gen, *shape, transposed=False):
    """float32 (B, H, T, D) on DEVICE; `transposed`: a (B, T, H, D) tensor viewed as (B, H, T, D)."""
    if transposed:
        b, h, t, d = shape
        return torch.randn(b, t, h, d, generator=gen).transpose(1, 2).to(DEVICE)
    return torch.randn(*shape, generator=gen).to(DEVICE)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _f64(*ts):
    return [t.detach().double().cpu().requires_grad_(True) for t in ts]


SDPA_CASES = {
    # name: (B, Hq, Hk, L, S, D, is_causal, mask kind, transposed inputs)
    "causal-gqa-transposed": (2, 4, 2, 37, 37, 32, True, None, True),
    "causal-L<S": (1, 2, 2, 17, 50, 16, True, None, False),
    "padding-mask-gqa": (2, 4, 1, 33, 45, 24, False, "padding", True),
    "bias-broadcast-heads": (2, 2, 2, 29, 40, 80, False, "bias", False),
    "bool-mask-full": (1, 3, 3, 21, 30, 16, False, "bool", False),
}


@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_sdpa_native_matches_torch(case):
    b, hq, hk, l, s, d, causal, mask_kind, transposed = SDPA_CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q, k, v = (_randn(gen, *shape, transposed=transposed) for shape in ((b, hq, l, d), (b, hk, s, d), (b, hk, s, d)))
    mask = None
    if mask_kind == "padding":
        lengths = torch.randint(1, s + 1, (b,), generator=gen)
        mask = (torch.arange(s)[None, :] < lengths[:, None])[:, None, None, :].to(DEVICE)
    elif mask_kind == "bool":
        mask = (torch.rand(b, hq, l, s, generator=gen) > 0.4).to(DEVICE)
    elif mask_kind == "bias":
        mask = torch.randn(b, 1, l, s, generator=gen).to(DEVICE).requires_grad_(True)
    q, k, v = _leaves(q, k, v)
    cot = _randn(gen, b, hq, l, d)
    before = cache_info()
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=hq != hk)
        (out * cot).sum().backward()
    assert cache_info() == before, "an XLA executable ran for a native call"
    leaves = _f64(q, k, v) + ([mask.detach().double().cpu().requires_grad_(True)] if mask_kind == "bias" else [])
    ref_mask = leaves[3] if mask_kind == "bias" else (None if mask is None else mask.cpu())
    ref = F.scaled_dot_product_attention(*leaves[:3], attn_mask=ref_mask, is_causal=causal, enable_gqa=hq != hk)
    (ref * cot.double().cpu()).sum().backward()
    assert_close_finite("out", out.detach().double().cpu(), ref.detach(), TOL)
    for name, got, want in zip("qkv", (q, k, v), leaves):
        assert_close_finite(f"grad {name}", got.grad.double().cpu(), want.grad, TOL)
    if mask_kind == "bias":
        assert_close_finite("grad bias", mask.grad.double().cpu(), leaves[3].grad, TOL)


@pytest.mark.parametrize("d", [160, 256])
def test_wide_head_dims_train_in_fp16_within_twice_torch_error(d):
    """Head dims above 128 in 16 bits (their own backward tiles: 32 keys per dK/dV program): out, dq, dk,
    dv of a causal GQA call with lengths that are no whole tile, within twice the error of the same math
    in fp16 against float64. (fp16: the Triton interpreter computes bf16 wrongly on the CPU; the GPU
    tests run bf16.)"""
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ())))
    b, hq, hk, l, s = 1, 4, 2, 97, 130
    q, cot = (torch.randn(b, hq, l, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    leaves = [x.to(torch.float16).to(DEVICE).requires_grad_(True) for x in (q, k, v)]
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out, leaves, cot.to(torch.float16).to(DEVICE))
    exact = [x.to(torch.float16).double() for x in (q, k, v)]
    want, _, (dq, dk, dv, _, _) = reference_grads(*exact, cot.to(torch.float16).double(), causal=True)
    low_leaves = [x.to(torch.float16).requires_grad_(True) for x in (q, k, v)]
    low, _ = reference(*low_leaves, causal=True, dtype=torch.float16)
    low_grads = torch.autograd.grad(low, low_leaves, cot.to(torch.float16))
    for name, got, ref, theirs in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, dq, dk, dv), (low, *low_grads)):
        assert_dtype_rule(name, got.double().cpu(), ref, theirs.double(), floor=4e-3 * max(1.0, ref.abs().max().item()))


FLASH_CASES = {
    # name: (B, Hq, Hk, L, S, D, options)
    "bottom-right-window": (1, 4, 2, 23, 61, 32, dict(causal=True, causal_alignment="bottom_right", window=(9, 0))),
    "softcap-sinks": (2, 2, 1, 30, 30, 16, dict(causal=True, softcap=3.0, sinks=True)),
    "window-both-sides": (1, 2, 2, 40, 40, 24, dict(window=(5, 7))),
    "lse-bottom-right": (1, 2, 2, 9, 33, 16, dict(causal=True, causal_alignment="bottom_right", return_lse=True)),
}


@pytest.mark.parametrize("case", sorted(FLASH_CASES))
def test_flash_attention_native_matches_reference(case):
    b, hq, hk, l, s, d, opts = FLASH_CASES[case]
    opts = dict(opts)
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    q, k, v = _leaves(_randn(gen, b, hq, l, d, transposed=True), _randn(gen, b, hk, s, d), _randn(gen, b, hk, s, d))
    sinks = None
    if opts.pop("sinks", False):
        sinks = torch.randn(hq, 2, generator=gen).to(DEVICE).requires_grad_(True)
    return_lse = opts.get("return_lse", False)
    cot, cot_lse = _randn(gen, b, hq, l, d), _randn(gen, b, hq, l)
    before = cache_info()
    with sdpa_launcher("native"):
        result = flash_attention(q, k, v, sinks=sinks, **opts)
    out, lse = result if return_lse else (result, None)
    loss = (out * cot).sum() + ((lse * cot_lse).sum() if return_lse else 0)
    loss.backward()
    assert cache_info() == before
    leaves = _f64(q, k, v)
    s64 = None if sinks is None else sinks.detach().double().cpu().requires_grad_(True)
    ref_sinks = None if s64 is None else torch.logsumexp(s64, -1)
    ref, ref_lse = reference(*leaves, causal=opts.get("causal", False), alignment=opts.get("causal_alignment", "top_left"),
                             window=opts.get("window"), softcap=opts.get("softcap"), sinks=ref_sinks)
    ref_loss = (ref * cot.double().cpu()).sum() + ((ref_lse * cot_lse.double().cpu()).sum() if return_lse else 0)
    ref_loss.backward()
    assert_close_finite("out", out.detach().double().cpu(), ref.detach(), TOL)
    if return_lse:
        assert_close_finite("lse", lse.detach().double().cpu(), ref_lse.detach(), TOL)
    for name, got, want in zip("qkv", (q, k, v), leaves):
        assert_close_finite(f"grad {name}", got.grad.double().cpu(), want.grad, TOL)
    if sinks is not None:
        assert_close_finite("grad sinks", sinks.grad.double().cpu(), s64.grad, TOL)


def _packed_case(gen, case):
    """Inputs, `flash_attention` options and reference keywords of a segment-ids or varlen case."""
    if case.startswith("segments"):
        b, hq, hk, l, s, d = 2, 4, 2, 37, 45, 24
        q, k, v = _leaves(_randn(gen, b, hq, l, d, transposed=True), _randn(gen, b, hk, s, d), _randn(gen, b, hk, s, d))
        q_ids = torch.randint(0, 4, (b, l), generator=gen).sort(dim=1).values.to(DEVICE)
        kv_ids = torch.randint(0, 4, (b, s), generator=gen).to(DEVICE)  # unsorted: spans are not runs
        kv_ids[0, 5] = 9  # an id beyond S's range on one side only
        causal = case == "segments-causal"
        opts = dict(segment_ids=(q_ids, kv_ids), causal=causal, causal_alignment="bottom_right")
        return (q, k, v), opts, dict(causal=causal, alignment="bottom_right", segment_ids=(q_ids.cpu(), kv_ids.cpu()))
    lens_q, lens_k = (5, 17, 9), (7, 20, 3)
    cu_q = torch.tensor((0, 5, 22, 31), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor((0, 7, 27, 30), dtype=torch.int32, device=DEVICE)
    assert sum(lens_q) == 31 and sum(lens_k) == 30
    hq, hk, d = 4, 2, 16
    # 3 padding rows after the last query sequence, 2 after the last key sequence
    q, k, v = _leaves(_randn(gen, 34, hq, d), _randn(gen, 32, hk, d), _randn(gen, 32, hk, d))
    opts = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, causal_alignment="bottom_right", window=(6, 0),
                return_lse=True)
    return (q, k, v), opts, dict(causal=True, alignment="bottom_right", window=(6, 0), cu_seqlens=(cu_q.cpu(), cu_k.cpu()))


@pytest.mark.parametrize("case", ["segments", "segments-causal", "varlen"])
def test_packed_calls_run_natively(case):
    """Segment ids and varlen offsets run by the native launcher (segment tables from the
    segment-table kernel), output, LSE and gradients against the float64 reference."""
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    (q, k, v), opts, ref_kw = _packed_case(gen, case)
    before = cache_info()
    with sdpa_launcher("native"):
        result = flash_attention(q, k, v, **opts)
    out, lse = result if opts.get("return_lse") else (result, None)
    cot = torch.randn(out.shape, generator=gen).to(DEVICE)
    (out * cot).sum().backward()
    assert cache_info() == before, "an XLA executable ran for a native call"
    varlen = "cu_seqlens" in ref_kw
    as_bhtd = (lambda t: t.detach().cpu()[None].transpose(1, 2)) if varlen else (lambda t: t.detach().cpu())
    ref, ref_lse, grads = reference_grads(*(as_bhtd(t) for t in (q, k, v)), as_bhtd(cot).double(), **ref_kw)
    assert_close_finite("out", as_bhtd(out).double(), ref, TOL)
    if lse is not None:
        assert_close_finite("lse", lse.detach().double().cpu(), ref_lse[0], TOL)
    for name, got, want in zip("qkv", (q, k, v), grads):
        assert_close_finite(f"grad {name}", as_bhtd(got.grad).double(), want, TOL)


def test_dropout_uses_the_kernels_keep_mask_and_torch_rng():
    """Output and gradients equal the float64 computation with the kernels' own keep mask; the
    same torch seed gives the same result, another seed another one."""
    gen = torch.Generator().manual_seed(7)
    b, h, l, s, d, p = 1, 2, 19, 26, 16, 0.3
    q, k, v = _leaves(*(_randn(gen, b, h, t, d) for t in (l, s, s)))
    seed = torch.tensor([12345, 678], dtype=torch.int32, device=DEVICE)
    cfg = FlashConfig(scale=d ** -0.5, dropout_p=p)
    out, _ = flash_forward(q, k, v, cfg, seed=seed)
    cot = _randn(gen, b, h, l, d)
    (out * cot).sum().backward()
    keep = _keep_mask(seed, b * h, l, s, p).reshape(b, h, l, s)
    leaves = _f64(q, k, v)
    ref, _ = reference(*leaves, dropout_keep=keep.cpu(), dropout_p=p)
    (ref * cot.double().cpu()).sum().backward()
    assert_close_finite("out", out.detach().double().cpu(), ref.detach(), TOL)
    for name, got, want in zip("qkv", (q, k, v), leaves):
        assert_close_finite(f"grad {name}", got.grad.double().cpu(), want.grad, TOL)
    torch.manual_seed(3)
    with sdpa_launcher("native"):
        a = scaled_dot_product_attention(q, k, v, dropout_p=p)
        torch.manual_seed(3)
        b_ = scaled_dot_product_attention(q, k, v, dropout_p=p)
        c = scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b_) and not torch.equal(a, c)


def _keep_mask(seed, bh, l, s, p):
    """The keep mask the kernels apply, materialised by their own Triton helper (native launch)."""
    from jaxattn.bridge.triton_launch import KernelLaunch
    from jaxattn.jax_core.kernels.flash_entries_triton import dropout_mask_entry

    keep = torch.empty(bh, l, s, dtype=torch.int8, device=DEVICE)
    KernelLaunch(dropout_mask_entry, (-(-l // 32), bh), 4, 1, ("Seed", "Keep"),
                 dict(BH=bh, L=l, S=s, dropout_p=p, BLOCK_M=32, BLOCK_N=64))(seed, keep)
    return keep.cpu().double()


BIT_CASES = {
    "causal-gqa": (dict(causal=True), False, False),
    "bias-softcap-sinks": (dict(causal=False, softcap=2.5), True, True),
    "bottom-right-window-dropout": (dict(causal=True, diag_offset=12, window=(6, -1), dropout_p=0.25), False, False),
}


@pytest.mark.parametrize("case,entries", grid(sorted(BIT_CASES), ["static", "dynamic"], keep=[
    *((case, "static") for case in BIT_CASES), ("causal-gqa", "dynamic")]))
def test_launchers_bit_identical(case, entries, monkeypatch):
    """The torch launcher and the JAX launcher give the same bits (outputs, LSE and gradients) with the
    static entries, which the native launcher uses for every call but decoding; the dynamic ones
    agree bit for bit under the interpreter and to rounding when compiled."""
    # l = 21 queries: static by the product's threshold; a threshold above it gives the dynamic entries
    monkeypatch.setattr(native_flash, "DYNAMIC_MAX_QUERIES", 0 if entries == "static" else 1 << 20)
    opts, with_bias, with_sinks = BIT_CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    b, hq, hk, l, s, d = 2, 4, 2, 21, 33, 16
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, l, d), (b, hk, s, d), (b, hk, s, d)))
    bias = torch.randn(1, hq, l, s, generator=gen) if with_bias else None
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    seed = torch.tensor([99, 5], dtype=torch.int32)
    cot = torch.randn(b, hq, l, d, generator=gen)
    cfg = FlashConfig(scale=d ** -0.5, **opts)
    # torch launcher
    tq, tk, tv = _leaves(*(x.to(DEVICE) for x in (q, k, v)))
    tb = None if bias is None else bias.to(DEVICE).clone().requires_grad_(True)
    ts = None if sinks is None else sinks.to(DEVICE).clone().requires_grad_(True)
    out, lse = flash_forward(tq, tk, tv, cfg, bias=tb, sinks=ts, seed=seed.to(DEVICE))
    (out * cot.to(DEVICE)).sum().backward()
    # JAX launcher
    j = lambda t: None if t is None else jnp.asarray(t.numpy())  # noqa: E731

    def loss(q, k, v, bias):
        o, lse_ = fj.flash_attention_triton(q, k, v, bias, None, j(sinks), fj.FlashExtras(seed=j(seed)), cfg)
        return jnp.sum(o * j(cot)), (o, lse_)

    grads, (jout, jlse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(j(q), j(k), j(v), j(bias))
    if entries == "static" or DEVICE == "cpu":
        same = lambda t, a: np.array_equal(t.detach().cpu().numpy(), np.asarray(a))  # noqa: E731
    else:  # compiled with runtime sizes: the same operations, which the compiler may fuse differently
        same = lambda t, a: np.allclose(t.detach().cpu().numpy(), np.asarray(a), rtol=1e-5, atol=1e-6)  # noqa: E731
    assert same(out, jout) and same(lse, jlse)
    for name, t, g in zip(("q", "k", "v"), (tq, tk, tv), grads):
        assert same(t.grad, g), f"grad {name} differs"
    if bias is not None:
        np.testing.assert_allclose(tb.grad.cpu().numpy(), np.asarray(grads[3]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["segments", "varlen"])
def test_launchers_bit_identical_on_packed_calls(case):
    """Segment ids (tables from the segment-table kernel on both sides) and varlen offsets: the two
    launchers give the same bits, outputs, LSE and gradients (static entries)."""
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    hq, hk, d = 4, 2, 16
    if case == "segments":
        b, l, s = 2, 40, 52
        ids = (torch.randint(0, 3, (b, l), generator=gen).sort(dim=1).values, torch.randint(0, 3, (b, s), generator=gen))
        cfg, cu = FlashConfig(scale=d ** -0.5, causal=True, diag_offset=s - l), None
    else:
        b, l, s, ids = 1, 30, 36, None
        cu = (torch.tensor([0, 11, 27], dtype=torch.int32), torch.tensor([0, 20, 33], dtype=torch.int32))
        cfg = FlashConfig(scale=d ** -0.5, causal=True, varlen=(16, 20), varlen_bottom_right=True)
    q, k, v = (torch.randn(*shape, generator=gen) for shape in ((b, hq, l, d), (b, hk, s, d), (b, hk, s, d)))
    cot = torch.randn(b, hq, l, d, generator=gen)
    tq, tk, tv = _leaves(*(x.to(DEVICE) for x in (q, k, v)))
    moved = lambda pair: None if pair is None else tuple(t.to(DEVICE) for t in pair)  # noqa: E731
    out, lse = flash_forward(tq, tk, tv, cfg, segment_ids=moved(ids), cu_seqlens=moved(cu))
    (out * cot.to(DEVICE)).sum().backward()
    j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
    extras = fj.FlashExtras(segment_ids=None if ids is None else tuple(map(j, ids)),
                            cu_seqlens=None if cu is None else tuple(map(j, cu)))

    def loss(q, k, v):
        o, lse_ = fj.flash_attention_triton(q, k, v, None, None, None, extras, cfg)
        return jnp.sum(o * j(cot)), (o, lse_)

    grads, (jout, jlse) = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(j(q), j(k), j(v))
    same = lambda t, a: np.array_equal(t.detach().cpu().numpy(), np.asarray(a))  # noqa: E731
    assert same(out, jout) and same(lse, jlse)
    for name, t, g in zip(("q", "k", "v"), (tq, tk, tv), grads):
        assert same(t.grad, g), f"grad {name} differs"


def test_native_refuses_what_it_cannot_run():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64, device=DEVICE)
    with sdpa_launcher("native"), pytest.raises(ValueError, match="dtype float64"):
        scaled_dot_product_attention(q, q, q)
    with pytest.raises(ValueError, match="launcher='bogus'"):
        with sdpa_launcher("bogus"):
            pass


def test_native_second_order_raises_and_names_the_xla_path():
    """create_graph=True through the native kernels raises (their gradients would read zero when
    differentiated again); the XLA path gives the second derivative (checked against torch)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_randn(gen, 1, 2, 12, 16).requires_grad_(True) for _ in range(3))
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(q, k, v, is_causal=True)
    with pytest.raises(NotImplementedError, match="create_graph=True.*sdpa_launcher\\('xla'\\)"):
        torch.autograd.grad(out.float().square().sum(), [q], create_graph=True)
    (first,) = torch.autograd.grad(out.float().square().sum(), [q])  # first order still works
    assert first.abs().sum() > 0


def test_xla_launcher_still_serves_the_same_call():
    """sdpa_launcher("xla") keeps the JAX-launched path: the result matches the native one."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (_randn(gen, 1, 2, 12, 16) for _ in range(3))
    with sdpa_launcher("native"):
        native = scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_launcher("xla"):
        xla = scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(native, xla, rtol=TOL, atol=TOL)


def test_masked_tiles_are_skipped():
    """Keys and values inside key blocks the mask hides entirely are NaN: a computed tile would
    spread NaN (0 * NaN) into outputs and gradients; skipped ones cannot."""
    gen = torch.Generator().manual_seed(11)
    b, h, l, s, d = 1, 2, 70, 192, 32
    q, k, v = (_randn(gen, b, h, t, d) for t in (l, s, s))
    mask = torch.ones(b, 1, l, s, dtype=torch.bool)
    mask[..., 64:128] = False  # one whole key block of every kernel's 64-wide tiles
    k[..., 64:128, :] = float("nan")
    v[..., 64:128, :] = float("nan")
    q, k, v = _leaves(q, k, v)
    cot = _randn(gen, b, h, l, d)
    cfg = FlashConfig(scale=d ** -0.5)
    out, _ = flash_forward(q, k, v, cfg, mask=mask.to(DEVICE))  # the API's finite check would refuse NaN
    (out * cot).sum().backward()
    leaves = _f64(q.nan_to_num(), k.nan_to_num(), v.nan_to_num())
    ref = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
    (ref * cot.double().cpu()).sum().backward()
    assert_close_finite("out", out.detach().double().cpu(), ref.detach(), TOL)
    assert_close_finite("grad q", q.grad.double().cpu(), leaves[0].grad, TOL)
    kept = torch.ones(s, dtype=torch.bool)
    kept[64:128] = False
    assert_close_finite("grad k", k.grad.double().cpu()[..., kept, :], leaves[1].grad[..., kept, :], TOL)


def test_growing_cache_steps_rebind_one_planned_forward(monkeypatch):
    """Decoding steps on a growing cache (a transposed (B, S, Hk, D) buffer sliced to each length,
    GQA, lengths crossing multiples of 16): each new length matches torch, and only the first is
    planned, by the drop-in and by the launcher; the others rebind its sizes and strides."""
    planned, checked = [], []
    real_plan = native_flash._plan_launches
    monkeypatch.setattr(native_flash, "_plan_launches", lambda *a: planned.append(a) or real_plan(*a))
    monkeypatch.setattr(native_flash, "_LAUNCHES", {})
    monkeypatch.setattr(native_flash, "_FOLLOWS_KEYS", {})
    real_init = sdpa_module._PreparedSdpa.__init__
    monkeypatch.setattr(sdpa_module._PreparedSdpa, "__init__",
                        lambda self, *a: checked.append(a) or real_init(self, *a))
    monkeypatch.setattr(sdpa_module, "_prepared", {})
    monkeypatch.setattr(sdpa_module, "_prepared_decoding", {})
    gen = torch.Generator().manual_seed(5)
    b, hq, hk, d = 2, 4, 2, 16
    cache = torch.randn(b, 40, hk, d, generator=gen).to(DEVICE)
    values = torch.randn(b, 40, hk, d, generator=gen).to(DEVICE)
    for s in (17, 18, 31, 32, 33, 40):
        q = _randn(gen, b, hq, 1, d)
        k, v = cache[:, :s].transpose(1, 2), values[:, :s].transpose(1, 2)
        with torch.no_grad(), sdpa_launcher("native"):
            out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ref = F.scaled_dot_product_attention(*_f64(q, k, v), enable_gqa=True)
        assert_close_finite(f"out at S={s}", out.double().cpu(), ref.detach(), TOL)
    assert len(planned) == 1 and len(checked) == 1, (len(planned), len(checked))


def test_repeated_no_grad_calls_reuse_the_planned_launch(monkeypatch):
    """An eager call without gradients launches the forward its signature planned once; a call of
    the same signature that needs gradients still gets them (through the op), equal to torch's."""
    looked_up = []
    real = native_flash._launches
    monkeypatch.setattr(native_flash, "_launches", lambda *a, **kw: looked_up.append(a) or real(*a, **kw))
    gen = torch.Generator().manual_seed(21)
    q, k, v = (_randn(gen, 2, 4, 33, 16, transposed=True) for _ in range(3))
    with sdpa_launcher("native"):
        with torch.no_grad():
            outs = [scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3) for _ in range(3)]
        assert len(looked_up) == 1
        ql, kl, vl = _leaves(q, k, v)
        out = scaled_dot_product_attention(ql, kl, vl, is_causal=True, scale=0.3)
    ref = F.scaled_dot_product_attention(*_f64(q, k, v), is_causal=True, scale=0.3)
    for o in outs:
        assert_close_finite("no-grad out", o.double().cpu(), ref.detach(), TOL)
    cot = _randn(gen, 2, 4, 33, 16)
    (out * cot).sum().backward()
    leaves = _f64(q, k, v)
    (F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3) * cot.double().cpu()).sum().backward()
    for name, got, want in zip("qkv", (ql, kl, vl), leaves):
        assert_close_finite(f"grad {name}", got.grad.double().cpu(), want.grad, TOL)


def test_training_calls_reuse_planned_launches(monkeypatch):
    """Calls of one signature that need gradients (a training step's layers) plan their forward and,
    per gradient layout, their backward once; every call's output and gradients match torch's, for a
    dense and a transposed output gradient and with only some inputs requiring grad (the Python
    launch path; on CUDA the compiled program is tested in test_gpu_native.py)."""
    monkeypatch.setenv("JAXATTN_TRITON_PROGRAMS", "0")
    looked_up = []
    real = native_flash._launches
    monkeypatch.setattr(native_flash, "_launches", lambda *a, **kw: looked_up.append(a) or real(*a, **kw))
    gen = torch.Generator().manual_seed(23)
    b, hq, hk, l, d = 2, 4, 2, 41, 16
    base = [_randn(gen, b, h, l, d, transposed=True) for h in (hq, hk, hk)]
    cots = [_randn(gen, b, hq, l, d), _randn(gen, b, hq, l, d, transposed=True)] * 2
    for step, cot in enumerate(cots):
        q, k, v = _leaves(*base)
        if step == 3:
            q.requires_grad_(False)
        with sdpa_launcher("native"):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        (out * cot).sum().backward()
        leaves = _f64(*base)
        ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
        (ref * cot.double().cpu()).sum().backward()
        assert_close_finite(f"out, step {step}", out.detach().double().cpu(), ref.detach(), TOL)
        for name, got, want in zip("qkv", (q, k, v), leaves):
            if got.requires_grad:
                assert_close_finite(f"grad {name}, step {step}", got.grad.double().cpu(), want.grad, TOL)
        assert q.grad is None if step == 3 else q.grad is not None
    # forward; backward for a dense cotangent; backward for a transposed one; a q without grad is
    # another signature (its forward planned once more, its backward found for the same layout).
    assert len(looked_up) == 5, len(looked_up)


def test_rebinding_a_constexpr_is_refused():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_randn(gen, 1, 2, 5, 16) for _ in range(3))
    launch = native_flash._launches(native_flash.NativeFlashSpec(FlashConfig(scale=0.25)), q, k, v, None, None, None,
                                    None)["fwd"]
    with pytest.raises(ValueError, match="BLOCK_M: a constexpr cannot be rebound"):
        launch.rebind(BLOCK_M=32)
    assert launch.rebind(S=7).scalars["S"] == 7 and launch.scalars["S"] == 5
