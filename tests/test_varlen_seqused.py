"""`seqused_q` / `seqused_k` in the varlen layout: sequence n uses only the first seqused_q[n] queries
of its cu_seqlens_q range and the first seqused_k[n] keys of its cu_seqlens_k range; the rest are
ignored as if absent (flash-attn 3's convention: causality, windows and ALiBi align to the used
lengths). Unused query rows give 0, LSE -inf and zero gradients; unused keys zero gradients.

The oracle is tests/attention_reference.py's float64 `seqused_reference`: each sequence computed
on its used rows only, packed without the others, with ALiBi as an explicit bias matrix. Unused
query and key rows hold NaN, and so does the output gradient of unused query rows: none may reach
a result, and their gradients are exactly 0. Sequences (`LAYOUT`): uneven lengths, one using no
key while it has queries, one using all its keys, one without queries, one using none of its
queries, one whose causal queries partly see nothing (L > used keys), the last one's unused query
tail, and padding rows after cu_seqlens_q[N] / cu_seqlens_k[N].
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import jax_triton_interpret
from attention_reference import assert_close_finite, seqused_reference, used_rows, varlen_alibi_bias

import jaxattn.torch_api.flash as flash_module
from jaxattn.bridge.triton_launch import can_launch
from jaxattn.torch_api import AttentionInputError, flash_attention, sdpa_launcher
from jaxattn.torch_api import flash_attn_interface as fai


def cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)


@dataclass(frozen=True)
class Layout:
    """N packed sequences, the rows each one uses (None: all of them), padding rows after the last."""
    lens_q: list
    lens_k: list
    used_q: Optional[list] = None
    used_k: Optional[list] = None
    pad_q: int = 2
    pad_k: int = 3

    @property
    def total_q(self) -> int:
        return sum(self.lens_q) + self.pad_q

    @property
    def total_k(self) -> int:
        return sum(self.lens_k) + self.pad_k

    def mask(self, side: str) -> torch.Tensor:
        """(total,) bool: the packed query ("q") or key ("k") rows in use."""
        lens, used, total = ((self.lens_q, self.used_q, self.total_q) if side == "q"
                             else (self.lens_k, self.used_k, self.total_k))
        mask = torch.zeros(total, dtype=torch.bool)
        mask[used_rows(cumulative(lens), used, total)] = True
        return mask

    def tensor(self, side: str, dtype=torch.int32) -> Optional[torch.Tensor]:
        used = self.used_q if side == "q" else self.used_k
        return None if used is None else torch.tensor(used, dtype=dtype)


LENS_Q = [13, 6, 0, 9, 21]
LENS_K = [20, 7, 5, 16, 25]
USED_K = [11, 0, 5, 16, 9]  # sequence 1 uses no key, sequence 3 all of its keys
USED_Q = [10, 6, 0, 0, 17]  # sequence 1 all of its queries, sequence 3 none, sequence 4 not its tail
KEYS = Layout(LENS_Q, LENS_K, used_k=USED_K)
QUERIES = Layout(LENS_Q, LENS_K, used_q=USED_Q)
BOTH = Layout(LENS_Q, LENS_K, used_q=USED_Q, used_k=USED_K)
# awkward sizes: 97 used queries of 120, 1025 packed keys
AWKWARD = Layout([120, 7, 30], [600, 1, 421], used_q=[97, 3, 30], used_k=[513, 1, 0], pad_q=0, pad_k=3)


def inputs(gen, layout: Layout, hq: int, hk: int, d: int, dv: int):
    """q (total_q, Hq, D); k, v (total_k, Hk, D|Dv) with NaN in every unused row of a sequence."""
    def make(rows, heads, width, used):
        x = torch.randn(rows, heads, width, generator=gen)
        return x.masked_fill(~used[:, None, None], math.nan).requires_grad_()
    keep_q, keep_k = layout.mask("q"), layout.mask("k")
    keep_q[sum(layout.lens_q):] = True  # padding rows hold numbers: they are no sequence's unused rows
    keep_k[sum(layout.lens_k):] = True
    return make(layout.total_q, hq, d, keep_q), make(layout.total_k, hk, d, keep_k), make(layout.total_k, hk, dv,
                                                                                         keep_k)


def reference(layout: Layout, q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, softmax_scale=None,
              alibi_slopes=None, sinks=None, alignment="bottom_right"):
    """float64 out (total_q, Hq, Dv) and LSE (Hq, total_q) on the used rows only, differentiable in
    the given (full, NaN-holding) leaves: the unused rows are never selected."""
    left, right = window_size
    window = None if (left, right) == (-1, -1) else (left, -1 if causal else right)
    used_q, used_k = layout.used_q or layout.lens_q, layout.used_k or layout.lens_k
    bias = None if alibi_slopes is None else varlen_alibi_bias(
        alibi_slopes, cumulative(used_q), cumulative(used_k), sum(used_q), sum(used_k))
    out, lse = seqused_reference(
        *(x.double().transpose(0, 1)[None] for x in (q, k, v)), cumulative(layout.lens_q),
        cumulative(layout.lens_k), layout.used_q, layout.used_k, causal=causal, alignment=alignment,
        window=window, softcap=softcap or None, scale=softmax_scale, bias=bias,
        sinks=None if sinks is None else sinks.double())
    return out[0].transpose(0, 1), lse[0]


def call(layout: Layout, q, k, v, return_attn_probs=True, **options):
    return fai.flash_attn_varlen_func(q, k, v, cumulative(layout.lens_q), cumulative(layout.lens_k),
                                      max(layout.lens_q), max(layout.lens_k), return_attn_probs=return_attn_probs,
                                      seqused_q=layout.tensor("q"), seqused_k=layout.tensor("k"), **options)


def output_grad(gen, layout: Layout, shape) -> torch.Tensor:
    """A random output gradient, NaN in the query rows outside every used range (when seqused_q
    makes them unused): no result may read them."""
    dout = torch.randn(shape, generator=gen)
    if layout.used_q is not None:
        dout[~layout.mask("q")] = math.nan
    return dout


def check(layout, out, lse, ref_out, ref_lse, leaves, ref_leaves, gen, tol=3e-5):
    """Output, LSE and the gradients of every leaf against the reference; exact zeros / -inf where
    rows are unused."""
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_close_finite("out", out.detach().double(), ref_out.detach(), tol)
    assert_close_finite("lse", lse.detach().double(), ref_lse.detach(), tol)
    unused_q = ~layout.mask("q")
    assert bool((out[unused_q] == 0).all()), "an unused query row has a nonzero output"
    assert bool((lse[:, unused_q] == -math.inf).all()), "an unused query row has a finite LSE"
    dout = output_grad(gen, layout, out.shape)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close_finite(name, g.double(), rg, 4 * tol)
    assert bool((grads[0][unused_q] == 0).all()), "dq: nonzero gradient at an unused query row"
    unused_k = ~layout.mask("k")
    for name, g in zip(("dk", "dv"), grads[1:3]):
        assert bool((g[unused_k] == 0).all()), f"{name}: nonzero gradient at an unused key"


def _options(gen, hq, num_seqs, options):
    options = dict(options)
    kind = options.pop("alibi", None)
    if kind is not None:
        options["alibi_slopes"] = torch.rand((hq,) if kind == "head" else (num_seqs, hq), generator=gen)
    return options


def _run_and_check(layout, hq, hk, d, dv, options, seed, tol=3e-5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = inputs(gen, layout, hq, hk, d, dv)
    options = _options(gen, hq, len(layout.lens_q), options)
    out, lse, _ = call(layout, q, k, v, **options)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(layout, *leaves, **options)
    check(layout, out, lse, ref_out, ref_lse, [q, k, v], leaves, gen, tol)
    return lse


CASES = [
    pytest.param(4, 2, 16, 16, dict(causal=True), id="causal-gqa"),
    pytest.param(3, 1, 8, 24, dict(window_size=(5, 2), softmax_scale=0.3), id="window-mqa-dv24"),
    pytest.param(4, 2, 16, 16, dict(causal=True, window_size=(6, 3), softcap=2.5, alibi="batch"),
                 id="causal-window-softcap-alibi(N,H)"),
    pytest.param(2, 2, 80, 80, dict(alibi="head"), id="alibi(H)-d80", marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("hq,hk,d,dv,options", CASES)
def test_seqused_k_matches_the_float64_reference(hq, hk, d, dv, options):
    lse = _run_and_check(KEYS, hq, hk, d, dv, options, hq * 100 + d + dv)
    cu_q = cumulative(LENS_Q).tolist()
    assert bool((lse[:, cu_q[1]:cu_q[2]] == -math.inf).all()), "sequence 1 uses no key: its LSE is -inf"


@pytest.mark.parametrize("layout", [pytest.param(QUERIES, id="seqused_q"), pytest.param(BOTH, id="both")])
@pytest.mark.parametrize("hq,hk,d,dv,options", CASES)
def test_seqused_q_matches_the_float64_reference(layout, hq, hk, d, dv, options):
    _run_and_check(layout, hq, hk, d, dv, options, hq * 100 + d + dv + len(layout.used_k or ()))


@pytest.mark.parametrize("options", [dict(causal=True), dict(window_size=(40, 7), alibi="batch")],
                         ids=["causal", "window-alibi(N,H)"])
def test_awkward_lengths_head_dim_80(options):
    """97 used queries of 120, 1025 packed keys (513 used in one sequence), head dim 80, GQA."""
    _run_and_check(AWKWARD, 4, 2, 80, 80, options, 97)


def test_flash_attention_top_left_with_int64_lengths():
    """`flash_attention` itself, causal aligned top-left, int64 cu_seqlens, seqused_q and seqused_k."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = inputs(gen, BOTH, 4, 2, 16, 16)
    out, lse = flash_attention(q, k, v, causal=True, cu_seqlens_q=cumulative(LENS_Q).long(),
                               cu_seqlens_k=cumulative(LENS_K).long(), seqused_q=BOTH.tensor("q", torch.int64),
                               seqused_k=BOTH.tensor("k", torch.int64), return_lse=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(BOTH, *leaves, causal=True, alignment="top_left")
    check(BOTH, out, lse, ref_out, ref_lse, [q, k, v], leaves, gen)


def _flash_with_sinks(layout, q, k, v, sinks, **options):
    return flash_attention(q, k, v, sinks=sinks, causal=True, causal_alignment="bottom_right",
                           cu_seqlens_q=cumulative(layout.lens_q), cu_seqlens_k=cumulative(layout.lens_k),
                           seqused_q=layout.tensor("q"), seqused_k=layout.tensor("k"), return_lse=True, **options)


def test_sinks_on_the_xla_reference():
    """With sinks, a used row that sees no key has the sinks' LSE, an unused row still -inf; the
    sinks' gradient reads no unused row's (NaN) output gradient. The pure XLA implementation that
    takes varlen calls ("vanilla")."""
    gen = torch.Generator().manual_seed(31)
    q, k, v = inputs(gen, BOTH, 4, 2, 16, 16)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    with sdpa_launcher("xla"):
        out, lse = _flash_with_sinks(BOTH, q, k, v, sinks, implementation="vanilla")
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    ref_out, ref_lse = reference(BOTH, *leaves[:3], causal=True, sinks=leaves[3])
    check(BOTH, out, lse, ref_out, ref_lse, [q, k, v, sinks], leaves, gen)
    cu_q = cumulative(LENS_Q).tolist()
    assert bool(torch.isfinite(lse[:, cu_q[1]:cu_q[2]]).all()), "sequence 1 sees only the sinks: a finite LSE"


@pytest.mark.skipif(not can_launch(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
@pytest.mark.parametrize("layout,sinks", [pytest.param(KEYS, False, id="seqused_k"),
                                          pytest.param(BOTH, True, id="both-sinks")])
def test_native_launcher_matches_the_float64_reference(monkeypatch, layout, sinks):
    """The Triton kernels launched from torch (interpreted on CPU), forward and backward: they never
    read the unused (NaN) rows."""
    monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())
    launched = []
    forward = flash_module.flash_forward
    monkeypatch.setattr(flash_module, "flash_forward", lambda *a, **kw: launched.append(1) or forward(*a, **kw))
    gen = torch.Generator().manual_seed(8)
    q, k, v = inputs(gen, layout, 4, 2, 16, 16)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    if sinks:
        sinks = torch.randn(4, generator=gen).requires_grad_()
        with sdpa_launcher("native"):
            out, lse = _flash_with_sinks(layout, q, k, v, sinks, window=(9, -1))
        leaves.append(sinks.detach().double().requires_grad_())
        ref_out, ref_lse = reference(layout, *leaves[:3], causal=True, window_size=(9, -1), sinks=leaves[3])
        q_leaves = [q, k, v, sinks]
    else:
        with sdpa_launcher("native"):
            out, lse, _ = call(layout, q, k, v, causal=True, window_size=(9, -1))
        ref_out, ref_lse = reference(layout, *leaves, causal=True, window_size=(9, -1))
        q_leaves = [q, k, v]
    assert launched, "the native launcher did not run the call"
    check(layout, out, lse, ref_out, ref_lse, q_leaves, leaves, gen, tol=1e-4)


@pytest.mark.skipif(not can_launch(torch.device("cpu")), reason="needs TRITON_INTERPRET=1 (tests/conftest.py)")
def test_xla_launcher_flash_kernels_match_the_float64_reference(monkeypatch):
    """The XLA launcher running jax_core's "flash" implementation (jax-triton, interpreted on CPU):
    the op is told it runs on a GPU, the only platform with flash kernels."""
    monkeypatch.setitem(sys.modules, "jax_triton", jax_triton_interpret.module())
    ops = flash_module._flash_jax, flash_module._flash_lse_jax
    for name, op in zip(("_flash_jax", "_flash_lse_jax"), ops):
        monkeypatch.setattr(flash_module, name, lambda *a, op=op, **kw: op(*a, **{**kw, "platform": "gpu"}))
    gen = torch.Generator().manual_seed(12)
    q, k, v = inputs(gen, BOTH, 4, 2, 16, 16)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    slopes = torch.rand(len(LENS_Q), 4, generator=gen)
    with sdpa_launcher("xla"):
        out, lse = _flash_with_sinks(BOTH, q, k, v, sinks, window=(5, -1), alibi_slopes=slopes, implementation="flash")
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, sinks)]
    ref_out, ref_lse = reference(BOTH, *leaves[:3], causal=True, window_size=(5, -1), alibi_slopes=slopes,
                                 sinks=leaves[3])
    check(BOTH, out, lse, ref_out, ref_lse, [q, k, v, sinks], leaves, gen, tol=1e-4)


def test_dropout_keeps_the_reference_weights_of_the_used_rows():
    """v holds one-hot rows (key j of sequence n: e_j), so out[i, h, j] * (1 - p) is query i's
    weight of its sequence's key j, or 0 where dropped: the kept weights are the reference's, about p
    of them are dropped, unused rows stay 0 (dq too), and torch.manual_seed reproduces the pattern."""
    p, hq = 0.25, 2
    gen = torch.Generator().manual_seed(17)
    q, k, _ = inputs(gen, BOTH, hq, 1, 16, 1)
    width = max(LENS_K)
    v = torch.zeros(BOTH.total_k, 1, width)
    for start, used in zip(cumulative(LENS_K).tolist(), USED_K):
        v[start:start + used, 0, :used] = torch.eye(used)
    outs = []
    for _ in range(2):
        torch.manual_seed(3)
        outs.append(call(BOTH, q, k, v, return_attn_probs=False, dropout_p=p, causal=True))
    assert torch.equal(outs[0], outs[1])
    ref_out, _ = reference(BOTH, q.detach(), k.detach(), v, causal=True)
    out = outs[0].detach().double()
    shown, kept = ref_out > 0, out != 0
    assert not bool((kept & ~shown).any()), "a weight where the reference has none"
    torch.testing.assert_close(out[kept] * (1 - p), ref_out[kept], atol=1e-6, rtol=1e-5)
    dropped = (shown & ~kept).sum().item() / shown.sum().item()
    assert 0.15 < dropped < 0.35, f"dropped {dropped:.2f} of the weights, expected about {p}"
    dq, = torch.autograd.grad(outs[0], [q], output_grad(gen, BOTH, out.shape))
    unused_q = ~BOTH.mask("q")
    assert bool((dq[unused_q] == 0).all()) and bool(torch.isfinite(dq).all())


def _paged(gen, layout: Layout, k, v, page_size: int):
    """Page pools holding each sequence's used keys in shuffled pages (NaN wherever a position is
    unused), and the (N, max pages) table."""
    hk, d = k.shape[1], k.shape[2]
    cu_k = cumulative(layout.lens_k).tolist()
    pages_of = [-(-n // page_size) for n in layout.lens_k]
    order = torch.randperm(sum(pages_of), generator=gen).tolist()
    table = torch.zeros(len(layout.lens_k), max(pages_of), dtype=torch.int32)
    pools = [torch.full((sum(pages_of), page_size, hk, d), math.nan) for _ in range(2)]
    for n, count in enumerate(pages_of):
        for j in range(count):
            table[n, j] = order.pop()
        for pos in range((layout.used_k or layout.lens_k)[n]):
            for pool, packed in zip(pools, (k, v)):
                pool[table[n, pos // page_size], pos % page_size] = packed[cu_k[n] + pos].detach()
    return pools[0].requires_grad_(), pools[1].requires_grad_(), table


@pytest.mark.parametrize("layout", [pytest.param(KEYS, id="seqused_k"), pytest.param(BOTH, id="both")])
def test_paged_keys_with_seqused(layout):
    """With a block_table, sequence n's keys are the first seqused_k[n] positions of its pages, its
    queries the first seqused_q[n] rows of its range."""
    gen = torch.Generator().manual_seed(21)
    page_size, hq, hk, d = 4, 4, 2, 16
    q, k, v = inputs(gen, layout, hq, hk, d, d)
    k_pool, v_pool, table = _paged(gen, layout, k, v, page_size)
    options = dict(causal=True, window_size=(7, 0), alibi="batch")
    options = _options(gen, hq, len(layout.lens_q), options)
    out, lse, _ = call(layout, q, k_pool, v_pool, block_table=table, **options)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = reference(layout, *leaves, **options)
    assert_close_finite("out", out.detach().double(), ref_out.detach(), 3e-5)
    assert_close_finite("lse", lse.detach().double(), ref_lse.detach(), 3e-5)
    unused_q = ~layout.mask("q")
    assert bool((out[unused_q] == 0).all()) and bool((lse[:, unused_q] == -math.inf).all())
    dout = output_grad(gen, layout, out.shape)
    dq, dk_pool = torch.autograd.grad(out, [q, k_pool], dout)
    ref_dq, ref_dk = torch.autograd.grad(ref_out, leaves[:2], dout.double())
    assert_close_finite("dq", dq.double(), ref_dq, 1e-4)
    assert bool((dq[unused_q] == 0).all())
    cu_k, used_k = cumulative(LENS_K).tolist(), layout.used_k or LENS_K
    for n in range(len(LENS_K)):
        for pos in range(min(LENS_K[n], used_k[n] + 1)):  # the used slots, and the first unused one
            page, slot = int(table[n, pos // page_size]), pos % page_size
            want = ref_dk[cu_k[n] + pos] if pos < used_k[n] else torch.zeros_like(ref_dk[0])
            assert_close_finite(f"dk_pool[seq {n}, pos {pos}]", dk_pool[page, slot].double(), want, 1e-4)


def _small_qkv():
    return (torch.randn(sum(LENS_Q), 2, 8), torch.randn(sum(LENS_K), 2, 8), torch.randn(sum(LENS_K), 2, 8))


def _bad_call(name, value, **kw):
    q, k, v = _small_qkv()
    if kw.pop("padded", False):
        return flash_attention(q.view(1, 2, -1, 8), k.view(1, 2, -1, 8), v.view(1, 2, -1, 8), **{name: value})
    if kw.pop("block_table", False):
        pool = torch.randn(40, 4, 2, 8)
        kw["block_table"] = torch.arange(5 * 8, dtype=torch.int32).view(5, 8)
        k = v = pool
    return fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q), max(LENS_K),
                                      **{name: value}, **kw)


def _bad_cases(name, used, side, sides, cu_name, lens):
    """The same malformed values for seqused_q (queries) and seqused_k (keys)."""
    over = list(used)
    over[2] = lens[2] + 1
    negative = list(used)
    negative[1] = -1
    return [
        (name, list(used), {}, TypeError, rf"^{name}: expected a 1-D int32 tensor of N=5 used {side} lengths"),
        (name, torch.tensor(used, dtype=torch.float32), {}, AttentionInputError,
         rf"^{name}: got shape \(5,\), dtype torch.float32"),
        (name, torch.tensor(list(used) + [0], dtype=torch.int32), {}, AttentionInputError,
         rf"^{name}: got shape \(6,\)"),
        (name, torch.tensor([used], dtype=torch.int32), {}, AttentionInputError, rf"^{name}: got shape \(1, 5\)"),
        (name, torch.tensor(used, dtype=torch.int32, device="meta"), {}, AttentionInputError,
         rf"^{name}: on meta but q is on cpu"),
        (name, torch.tensor(negative, dtype=torch.int32), {}, AttentionInputError,
         rf"^{name}: values .*, but sequence 1 uses -1 {sides} where {cu_name} gives it {lens[1]}"),
        (name, torch.tensor(over, dtype=torch.int32), {}, AttentionInputError,
         rf"^{name}: values .*sequence 2 uses {over[2]} {sides} where {cu_name} gives it {lens[2]}"),
        (name, torch.tensor(over, dtype=torch.int32), dict(block_table=True), AttentionInputError,
         rf"^{name}: values .*sequence 2 uses {over[2]} {sides}"),
        (name, torch.tensor(used, dtype=torch.int32), dict(padded=True), AttentionInputError,
         rf"^{name} \(shape \(5,\).*\): only used with cu_seqlens_q"),
    ]


@pytest.mark.parametrize("name,value,kw,error,pattern",
                         _bad_cases("seqused_k", USED_K, "key", "keys", "cu_seqlens_k", LENS_K)
                         + _bad_cases("seqused_q", USED_Q, "query", "queries", "cu_seqlens_q", LENS_Q))
def test_bad_seqused_raises_naming_it(name, value, kw, error, pattern):
    with pytest.raises(error, match=pattern):
        _bad_call(name, value, **kw)


def test_unused_query_rows_may_hold_nan_but_used_ones_may_not():
    """The finite check reads the used query rows only."""
    q, k, v = _small_qkv()
    q[cumulative(LENS_Q)[1] - 1] = math.nan  # sequence 0's last row: unused with USED_Q[0] = 10 of 13
    seqused_q = torch.tensor(USED_Q, dtype=torch.int32)
    out = fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q), max(LENS_K),
                                     seqused_q=seqused_q)
    assert bool(torch.isfinite(out).all())
    q[0, 0, 0] = math.nan
    with pytest.raises(AttentionInputError, match="q"):
        fai.flash_attn_varlen_func(q, k, v, cumulative(LENS_Q), cumulative(LENS_K), max(LENS_Q), max(LENS_K),
                                   seqused_q=seqused_q)
