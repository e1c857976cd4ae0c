"""`seqused_k` in the varlen layout: sequence n uses only the first seqused_k[n] keys of its
cu_seqlens_k range; the rest are ignored as if absent (flash-attn's convention: causality, windows
and ALiBi align to the used length).

The oracle is tests/attention_reference.py's float64 `varlen_reference` on the used keys packed
here without the unused ones (their cu_seqlens_k is the cumulative seqused_k), with ALiBi as an
explicit bias matrix. Unused keys, and key rows after cu_seqlens_k[N], hold NaN: none may reach a
result, and their gradients are exactly 0. Sequences: uneven lengths, one using no key while it
has queries, one using all its keys, one without queries, one whose causal queries partly see
nothing (L > used), and two padding query rows after cu_seqlens_q[N].
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import jax_triton_interpret
from attention_reference import assert_close_finite, varlen_alibi_bias, varlen_reference

import jaxattn.torch_api.flash as flash_module
from jaxattn.bridge.triton_launch import can_launch
from jaxattn.torch_api import AttentionInputError, flash_attention, sdpa_launcher
from jaxattn.torch_api import flash_attn_interface as fai

LENS_Q = [13, 6, 0, 9, 21]
LENS_K = [20, 7, 5, 16, 25]
USED = [11, 0, 5, 16, 9]  # sequence 1 uses no key, sequence 3 all of its keys
PAD_Q, PAD_K = 2, 3  # rows after the last sequence


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


def used_mask() -> torch.Tensor:
    """(total_k,) bool: the packed key rows in use."""
    mask = torch.zeros(sum(LENS_K) + PAD_K, dtype=torch.bool)
    for start, used in zip(cumulative(LENS_K).tolist(), USED):
        mask[start:start + used] = True
    return mask


def inputs(gen, hq: int, hk: int, d: int, dv: int):
    """q (total_q + PAD_Q, Hq, D); k, v (total_k + PAD_K, Hk, D|Dv) with NaN in every unused row."""
    q = torch.randn(sum(LENS_Q) + PAD_Q, hq, d, generator=gen).requires_grad_()
    keep = used_mask()[:, None, None]
    k, v = (torch.randn(keep.shape[0], hk, width, generator=gen).masked_fill(~keep, math.nan).requires_grad_()
            for width in (d, dv))
    return q, k, v


def reference(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None, alibi_slopes=None,
              alignment="bottom_right"):
    """float64 out (total_q, Hq, Dv) and LSE (Hq, total_q) on the used keys only, differentiable in the
    given (full, NaN-holding) leaves: the unused rows are never selected."""
    rows = used_mask().nonzero()[:, 0]
    k, v = k.double()[rows], v.double()[rows]
    left, right = window_size
    window = None if (left, right) == (-1, -1) else (left, -1 if causal else right)
    bias = None if alibi_slopes is None else varlen_alibi_bias(
        alibi_slopes, cumulative(LENS_Q), cumulative(USED), q.shape[0], k.shape[0])
    out, lse = varlen_reference(q.double().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                cumulative(LENS_Q), cumulative(USED), causal=causal, alignment=alignment,
                                window=window, softcap=softcap or None, scale=softmax_scale, bias=bias)
    return out[0].transpose(0, 1), lse[0]


def call(q, k, v, **options):
    return fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q), max(LENS_K),
                                      return_attn_probs=True, seqused_k=torch.tensor(USED, dtype=torch.int32),
                                      **options)


def check(out, lse, ref_out, ref_lse, leaves, ref_leaves, gen, tol=3e-5):
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_close_finite("out", out.detach().double(), ref_out.detach(), tol)
    assert_close_finite("lse", lse.detach().double(), ref_lse.detach(), tol)
    cu_q = cumulative(LENS_Q).tolist()
    assert bool((lse[:, cu_q[1]:cu_q[2]] == -math.inf).all()), "sequence 1 uses no key: its LSE is -inf"
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, g, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_finite(name, g.double(), rg, 4 * tol)
    unused = ~used_mask()
    for name, g in zip(("dk", "dv"), grads[1:]):
        assert bool((g[unused] == 0).all()), f"{name}: nonzero gradient at an unused key"


def _options(gen, hq, options):
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (len(LENS_Q), hq), generator=gen)
    return options


CASES = [
    pytest.param(4, 2, 16, 16, dict(causal=True), id="causal-gqa"),
    pytest.param(3, 1, 8, 24, dict(window_size=(5, 2), softmax_scale=0.3), id="window-mqa-dv24"),
    pytest.param(4, 2, 16, 16, dict(causal=True, window_size=(6, 3), softcap=2.5, alibi="batch"),
                 id="causal-window-softcap-alibi(N,H)"),
    pytest.param(2, 2, 80, 80, dict(alibi="head"), id="alibi(H)-d80", marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("hq,hk,d,dv,options", CASES)
def test_seqused_k_matches_the_float64_reference(hq, hk, d, dv, options):
    gen = torch.Generator().manual_seed(hq * 100 + d + dv)
    q, k, v = inputs(gen, hq, hk, d, dv)
    options = _options(gen, hq, options)
    out, lse, _ = call(q, k, v, **options)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, **options)
    check(out, lse, ref_out, ref_lse, [q, k, v], leaves, gen)


def test_flash_attention_top_left_with_int64_lengths():
    """`flash_attention` itself, causal aligned top-left, int64 cu_seqlens and seqused_k."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs(gen, 4, 2, 16, 16)
    out, lse = flash_attention(q, k, v, causal=True, cu_seqlens_q=cumulative(LENS_Q).long(),
                               cu_seqlens_k=cumulative(LENS_K).long(), seqused_k=torch.tensor(USED),
                               return_lse=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, causal=True, alignment="top_left")
    check(out, lse, ref_out, ref_lse, [q, k, v], leaves, gen)


@pytest.mark.skipif(not can_launch(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
def test_native_launcher_matches_the_float64_reference(monkeypatch):
    """The Triton kernels launched from torch (interpreted on CPU), forward and backward: they never
    read the unused (NaN) keys."""
    monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())
    launched = []
    forward = flash_module.flash_forward
    monkeypatch.setattr(flash_module, "flash_forward", lambda *a, **kw: launched.append(1) or forward(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    q, k, v = inputs(gen, 4, 2, 16, 16)
    with sdpa_launcher("native"):
        out, lse, _ = call(q, k, v, causal=True, window_size=(9, -1))
    assert launched, "the native launcher did not run the call"
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, causal=True, window_size=(9, -1))
    check(out, lse, ref_out, ref_lse, [q, k, v], leaves, gen, tol=1e-4)


def test_paged_keys_with_seqused_k():
    """With a block_table, sequence n's keys are the first seqused_k[n] positions of its pages (pages
    laid out here in shuffled order, NaN wherever a position is unused)."""
    gen = torch.Generator().manual_seed(21)
    page_size, hq, hk, d = 4, 4, 2, 16
    q, k, v = inputs(gen, hq, hk, d, d)
    cu_k = cumulative(LENS_K).tolist()
    pages_of = [-(-n // page_size) for n in LENS_K]
    order = torch.randperm(sum(pages_of), generator=gen).tolist()
    table = torch.zeros(len(LENS_K), max(pages_of), dtype=torch.int32)
    pools = [torch.full((sum(pages_of), page_size, hk, d), math.nan) for _ in range(2)]
    for n, count in enumerate(pages_of):
        for j in range(count):
            table[n, j] = order.pop()
        for pos in range(USED[n]):
            for pool, packed in zip(pools, (k, v)):
                pool[table[n, pos // page_size], pos % page_size] = packed[cu_k[n] + pos].detach()
    k_pool, v_pool = (pool.requires_grad_() for pool in pools)
    options = dict(causal=True, window_size=(7, 0))
    out, lse, _ = call(q, k_pool, v_pool, block_table=table, **options)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(*leaves, **options)
    assert_close_finite("out", out.detach().double(), ref_out.detach(), 3e-5)
    assert_close_finite("lse", lse.detach().double(), ref_lse.detach(), 3e-5)
    dout = torch.randn(out.shape, generator=gen)
    dq, dk_pool = torch.autograd.grad(out, [q, k_pool], dout)
    ref_dq, ref_dk = torch.autograd.grad(ref_out, leaves[:2], dout.double())
    assert_close_finite("dq", dq.double(), ref_dq, 1e-4)
    for n in range(len(LENS_K)):
        for pos in range(LENS_K[n] if n == 3 else USED[n] + 1):  # a used slot, and the first unused one
            page, slot = int(table[n, pos // page_size]), pos % page_size
            want = ref_dk[cu_k[n] + pos] if pos < USED[n] else torch.zeros_like(ref_dk[0])
            assert_close_finite(f"dk_pool[seq {n}, pos {pos}]", dk_pool[page, slot].double(), want, 1e-4)


def _bad_call(seqused_k, **kw):
    q, k, v = (torch.randn(sum(LENS_Q), 2, 8), torch.randn(sum(LENS_K), 2, 8), torch.randn(sum(LENS_K), 2, 8))
    if kw.pop("padded", False):
        return flash_attention(q.view(1, 2, -1, 8), k.view(1, 2, -1, 8), v.view(1, 2, -1, 8), seqused_k=seqused_k)
    return fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q), max(LENS_K),
                                      seqused_k=seqused_k, **kw)


@pytest.mark.parametrize("seqused_k,kw,error,pattern", [
    ([11, 0, 5, 16, 9], {}, TypeError, r"^seqused_k: expected a 1-D int32 tensor of N=5 used key lengths"),
    (torch.tensor(USED, dtype=torch.float32), {}, AttentionInputError,
     r"^seqused_k: got shape \(5,\), dtype torch.float32"),
    (torch.tensor(USED + [0], dtype=torch.int32), {}, AttentionInputError, r"^seqused_k: got shape \(6,\)"),
    (torch.tensor([USED], dtype=torch.int32), {}, AttentionInputError, r"^seqused_k: got shape \(1, 5\)"),
    (torch.tensor(USED, dtype=torch.int32, device="meta"), {}, AttentionInputError,
     r"^seqused_k: on meta but q is on cpu"),
    (torch.tensor([11, -1, 5, 16, 9], dtype=torch.int32), {}, AttentionInputError,
     r"^seqused_k: values \[11, -1, 5, 16, 9\], but sequence 1 uses -1 keys where cu_seqlens_k gives it 7"),
    (torch.tensor([11, 0, 6, 16, 9], dtype=torch.int32), {}, AttentionInputError,
     r"^seqused_k: values .*sequence 2 uses 6 keys where cu_seqlens_k gives it 5"),
    (torch.tensor([11, 0, 6, 16, 9], dtype=torch.int32), dict(block_table="table"), AttentionInputError,
     r"^seqused_k: values .*sequence 2 uses 6 keys"),
    (torch.tensor(USED, dtype=torch.int32), dict(padded=True), AttentionInputError,
     r"^seqused_k \(shape \(5,\).*\): only used with cu_seqlens_q"),
])
def test_bad_seqused_k_raises_naming_it(seqused_k, kw, error, pattern):
    if kw.get("block_table") == "table":
        q = torch.randn(sum(LENS_Q), 2, 8)
        pool = torch.randn(40, 4, 2, 8)
        table = torch.arange(5 * 8, dtype=torch.int32).view(5, 8)
        with pytest.raises(error, match=pattern):
            fai.flash_attn_varlen_func(q, pool, pool, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q),
                                       max(LENS_K), block_table=table, seqused_k=seqused_k)
        return
    with pytest.raises(error, match=pattern):
        _bad_call(seqused_k, **kw)
