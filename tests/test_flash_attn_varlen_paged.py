"""`flash_attn_varlen_func(..., block_table=...)`: paged K/V in flash-attn's varlen layout.

The oracle is tests/attention_reference.py's float64 `varlen_reference` on keys gathered here from
the pages position by position (position j of sequence n: slot j % page_size of page
block_table[n, j // page_size]), with ALiBi as an explicit bias matrix. Pool slots that no sequence
uses hold NaN and table entries past a sequence's last page hold out-of-range indices: neither may
reach a result. Sequences: uneven lengths, L != S both ways, an empty one, one whose queries see
no key, and a page shared by two sequences (its gradient is the sum of both uses).
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
from jaxattn.torch_api import AttentionInputError, sdpa_launcher
from jaxattn.torch_api import flash_attn_interface as fai

LENS_Q = [13, 0, 27, 7, 25]
LENS_K = [20, 0, 9, 0, 31]  # sequence 1 is empty; sequence 3's queries see no key
EXTRA_PAGES = 3  # pages no sequence uses (NaN)


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


def paged_inputs(gen, page_size: int, hq: int, hk: int, d: int, dv: int = None):
    """q (total_q, Hq, D) and NaN-padded pools (P, PS, Hk, D|Dv) with a shuffled block table whose
    last sequence reuses sequence 0's first page, and whose unused entries point outside the pool."""
    dv = d if dv is None else dv
    needed = [-(-n // page_size) for n in LENS_K]
    num_pages = sum(needed) - 1 + EXTRA_PAGES  # the last sequence's first page is shared
    order = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(LENS_K), max(needed) + 1), -1, dtype=torch.int32)
    table[:, -1] = num_pages + 5
    for n, count in enumerate(needed):
        for j in range(count):
            table[n, j] = table[0, 0] if (n == len(LENS_K) - 1 and j == 0) else order.pop()
    used = torch.zeros(num_pages, page_size, dtype=torch.bool)
    for n, length in enumerate(LENS_K):
        for j in range(length):
            used[table[n, j // page_size], j % page_size] = True
    pools = []
    for width in (d, dv):
        pool = torch.randn(num_pages, page_size, hk, width, generator=gen)
        pools.append(pool.masked_fill(~used[:, :, None, None], math.nan).requires_grad_())
    q = torch.randn(sum(LENS_Q), hq, d, generator=gen).requires_grad_()
    return q, pools[0], pools[1], table


def gather_keys(pool: torch.Tensor, table: torch.Tensor, page_size: int) -> torch.Tensor:
    """The sequences' keys packed (total_k, Hk, D), one position at a time."""
    rows = [pool[int(table[n, j // page_size]), j % page_size]
            for n, length in enumerate(LENS_K) for j in range(length)]
    return torch.stack(rows)


def reference(q, k_pool, v_pool, table, page_size, *, causal=False, window_size=(-1, -1), softcap=0.0,
              softmax_scale=None, alibi_slopes=None):
    """float64 out (total_q, Hq, Dv) and LSE (Hq, total_q), differentiable in the given leaves."""
    k, v = (gather_keys(pool, table, page_size).double() for pool in (k_pool, v_pool))
    left, right = window_size
    window = None if (left, right) == (-1, -1) else (left, -1 if causal else right)
    bias = None if alibi_slopes is None else varlen_alibi_bias(
        alibi_slopes, cumulative(LENS_Q), cumulative(LENS_K), q.shape[0], k.shape[0])
    out, lse = varlen_reference(q.double().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                cumulative(LENS_Q), cumulative(LENS_K), causal=causal, alignment="bottom_right",
                                window=window, softcap=softcap or None, scale=softmax_scale, bias=bias)
    return out[0].transpose(0, 1), lse[0]


def call(q, k_pool, v_pool, table, **options):
    return fai.flash_attn_varlen_func(q, k_pool, v_pool, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q),
                                      max(LENS_K), block_table=table, return_attn_probs=True, **options)


def check(out, lse, ref_out, ref_lse, leaves, ref_leaves, gen, tol=3e-5):
    assert out.shape == ref_out.shape and out.dtype == leaves[0].dtype and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert_close_finite("out", out.detach().double(), ref_out.detach(), tol)
    assert_close_finite("lse", lse.detach().double(), ref_lse.detach(), tol)
    q_ends = cumulative(LENS_Q).tolist()
    assert bool((lse[:, q_ends[3]:q_ends[4]] == -math.inf).all()) and not bool(out[q_ends[3]:q_ends[4]].any())
    dout = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, g, rg in zip(("dq", "dk_pool", "dv_pool"), grads, ref_grads):
        assert_close_finite(name, g.double(), rg, 4 * tol)


CASES = [
    pytest.param(4, 4, 2, 16, dict(causal=True), id="page4-causal-gqa"),
    pytest.param(16, 2, 1, 80, dict(window_size=(5, 2), softmax_scale=0.3), id="page16-window-mqa-d80"),
    pytest.param(4, 4, 2, 16, dict(causal=True, window_size=(6, 3), softcap=2.5, alibi="batch"),
                 id="page4-causal-window-softcap-alibi(N,H)", marks=pytest.mark.thorough),
    pytest.param(16, 4, 4, 16, dict(alibi="head", int64_table=True), id="page16-alibi(H)-int64-table",
                 marks=pytest.mark.thorough),
]


def _options(gen, hq, options):
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (len(LENS_Q), hq), generator=gen)
    return options, options.pop("int64_table", False)


@pytest.mark.parametrize("page_size,hq,hk,d,options", CASES)
def test_paged_varlen_matches_the_float64_reference(page_size, hq, hk, d, options):
    gen = torch.Generator().manual_seed(page_size * 100 + d)
    q, k_pool, v_pool, table = paged_inputs(gen, page_size, hq, hk, d)
    options, int64_table = _options(gen, hq, options)
    out, lse, s_dmask = call(q, k_pool, v_pool, table.long() if int64_table else table, **options)
    assert s_dmask.shape == (0,)
    leaves = [x.detach().double().requires_grad_() for x in (q, k_pool, v_pool)]
    ref_out, ref_lse = reference(*leaves, table, page_size, **options)
    check(out, lse, ref_out, ref_lse, [q, k_pool, v_pool], leaves, gen)


def test_paged_call_equals_the_same_keys_packed():
    """The non-paged varlen call on the same keys (packed from the pools by differentiable indexing):
    the same output, LSE and gradients, the pools' included."""
    gen = torch.Generator().manual_seed(5)
    page_size, hq = 4, 4
    q, k_pool, v_pool, table = paged_inputs(gen, page_size, hq, 2, 16, dv=24)
    options = dict(causal=True, window_size=(7, 0), alibi_slopes=torch.rand(len(LENS_Q), hq, generator=gen))
    out, lse, _ = call(q, k_pool, v_pool, table, **options)
    k, v = (gather_keys(pool, table, page_size) for pool in (k_pool, v_pool))
    want, want_lse, _ = fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q),
                                                   max(LENS_K), return_attn_probs=True, **options)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=2e-6)
    dout = torch.randn(out.shape, generator=gen)
    for name, g, w in zip(("dq", "dk_pool", "dv_pool"), torch.autograd.grad(out, [q, k_pool, v_pool], dout),
                          torch.autograd.grad(want, [q, k_pool, v_pool], dout)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.skipif(not can_launch(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
def test_native_launcher_matches_the_float64_reference(monkeypatch):
    """The Triton kernels launched from torch (interpreted on CPU), forward and backward."""
    monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())
    launched = []
    forward = flash_module.flash_forward
    monkeypatch.setattr(flash_module, "flash_forward", lambda *a, **kw: launched.append(1) or forward(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    q, k_pool, v_pool, table = paged_inputs(gen, 4, 4, 2, 16)
    with sdpa_launcher("native"):
        out, lse, _ = call(q, k_pool, v_pool, table, causal=True, window_size=(9, -1))
    assert launched, "the native launcher did not run the call"
    leaves = [x.detach().double().requires_grad_() for x in (q, k_pool, v_pool)]
    ref_out, ref_lse = reference(*leaves, table, 4, causal=True, window_size=(9, -1))
    check(out, lse, ref_out, ref_lse, [q, k_pool, v_pool], leaves, gen, tol=1e-4)


def test_dropout_keeps_the_reference_weights_of_the_kept_keys():
    """v's pages hold one-hot rows (position j of every sequence: e_j), so out[i, h, j] * (1 - p) is
    query i's weight of key j or 0: the kept weights are the reference's, about p of them are dropped,
    and torch.manual_seed reproduces the pattern."""
    p, page_size, hq = 0.25, 4, 2
    gen = torch.Generator().manual_seed(13)
    q, k_pool, _, table = paged_inputs(gen, page_size, hq, 1, 16)
    capacity = table.shape[1] * page_size
    v_pool = torch.zeros(k_pool.shape[0], page_size, 1, capacity)
    for n in range(len(LENS_K)):
        for j in range(LENS_K[n]):
            v_pool[table[n, j // page_size], j % page_size, 0, j] = 1.0
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(fai.flash_attn_varlen_func(q, k_pool, v_pool, cumulative(LENS_Q), cumulative(LENS_K),
                                               max(LENS_Q), max(LENS_K), dropout_p=p, causal=True, block_table=table))
    assert torch.equal(outs[0], outs[1])
    ref_out, _ = reference(q.detach().double(), k_pool, v_pool.double(), table, page_size, causal=True)
    out = outs[0].detach().double()
    shown = ref_out > 0
    kept = out != 0
    assert not bool((kept & ~shown).any())
    torch.testing.assert_close(out[kept] * (1 - p), ref_out[kept], atol=1e-6, rtol=1e-5)
    dropped = (shown & ~kept).sum().item() / shown.sum().item()
    assert abs(dropped - p) < 0.05, dropped


def _bad_cases():
    q = torch.randn(sum(LENS_Q), 2, 8)
    pool = torch.randn(20, 4, 2, 8)
    table = torch.arange(5 * 9, dtype=torch.int32).remainder(20).view(5, 9)
    return q, pool, table


@pytest.mark.parametrize("change,error,pattern", [
    (dict(block_table=[[0, 1]]), TypeError, r"^block_table: expected an int32 tensor"),
    (dict(block_table="float"), AttentionInputError, r"^block_table: got shape \(5, 9\), dtype torch.float32"),
    (dict(block_table="1d"), AttentionInputError, r"^block_table: got shape \(45,\)"),
    (dict(block_table="rows"), AttentionInputError, r"^block_table: 4 rows, but cu_seqlens_k holds 5 sequences"),
    (dict(block_table="page99"), AttentionInputError, r"^block_table: entry \[0, 1\] = 99 is not a page of k"),
    (dict(block_table="short"), AttentionInputError, r"^block_table: sequence 4 has 31 keys \(cu_seqlens_k\), more "
                                                     r"than the 5 pages of its row hold"),
    (dict(k="packed"), AttentionInputError, r"^k: with block_table, expected the paged cache"),
    (dict(v="half"), AttentionInputError, r"^v: torch.float16 on cpu, but q is torch.float32"),
    (dict(max_seqlen_k=16), AttentionInputError, r"^max_seqlen_k=16: the longest sequence in cu_seqlens_k"),
])
def test_bad_arguments_raise_naming_them(change, error, pattern):
    q, pool, table = _bad_cases()
    args = dict(k=pool, v=pool, block_table=table, max_seqlen_k=max(LENS_K))
    variants = {"float": table.float(), "1d": table.flatten(), "rows": table[:4], "short": table[:, :5],
                "packed": pool.flatten(0, 1), "half": pool.half()}
    page99 = table.clone()
    page99[0, 1] = 99
    variants["page99"] = page99
    args.update({name: variants.get(value, value) if isinstance(value, str) else value
                 for name, value in change.items()})
    with pytest.raises(error, match=pattern):
        fai.flash_attn_varlen_func(q, args["k"], args["v"], cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q),
                                   args["max_seqlen_k"], block_table=args["block_table"])
