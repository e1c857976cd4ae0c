"""`kvcache_attention` and `flash_attn_with_kvcache`: append, rotary, attention in one call.

Oracle: `expected` below, written from the definitions in float64: the cache after the append as an
explicit tensor (new keys rotated at their positions through complex multiplication), queries
rotated the same way, then per sequence the suite's float64 oracle (tests/attention_reference.py)
on its visible slots [start, length) with the queries at the last positions (bottom-right), the
window, the soft cap, sinks and ALiBi as -slope * distance. Caches hold NaN outside each sequence's valid region (paged:
in unused and spare pages too), so reading a slot that is not part of the sequence shows. The cache
contents after the call are compared exactly where no rotary applies.

CPU runs: the XLA paths by default (the decode kernels' XLA formulation for T <= 16, the flash
varlen path beyond), and the Triton kernels under the interpreter with `sdpa_launcher("native")`.
GPU cases (bf16, the compiled kernels) are at the end and skip without CUDA.
"""

import importlib.util
import math

import pytest
import torch

from attention_reference import alibi_bias, assert_dtype_rule, reference
from decode_cases import layout_cache

from jaxattn.bridge.triton_launch import can_launch
from jaxattn.torch_api import AttentionInputError, flash_attn_with_kvcache, kvcache_attention, sdpa_launcher

HK, D = 2, 16
PAGE = 8


# --- the float64 reference --------------------------------------------------------------------------


def rotary_tables(rows, rotary_dim, dtype=torch.float32, device="cpu"):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def rotate(x, cos, sin, interleaved):
    """x (..., D) float64 rotated by the angle whose (cos, sin) (..., R/2) are given: complex products."""
    half = cos.shape[-1]
    if interleaved:
        pairs = x[..., : 2 * half].reshape(*x.shape[:-1], half, 2)
        z = torch.complex(pairs[..., 0], pairs[..., 1])
    else:
        z = torch.complex(x[..., :half], x[..., half: 2 * half])
    z = z * torch.complex(cos, sin)
    turned = (torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved
              else torch.cat((z.real, z.imag), -1))
    return torch.cat((turned, x[..., 2 * half:]), -1)


def expected(q, dense_k, dense_v, lengths, starts, k_new=None, v_new=None, *, rotary=None, causal=True,
             window=(-1, -1), softcap=None, alibi=None, sinks=None, scale=None, dtype=torch.float64):
    """(out (B, T, Hq, Dv), lse (B, Hq, T), cache_k, cache_v after the append) in `dtype`.

    rotary: None or (cos, sin, interleaved, shared_q_position)."""
    b, t, hq, d = q.shape
    t_new = 0 if k_new is None else k_new.shape[1]
    scale = d ** -0.5 if scale is None else scale
    ck, cv, qq = dense_k.to(dtype).clone(), dense_v.to(dtype).clone(), q.to(dtype).clone()
    out = torch.zeros(b, t, hq, dense_v.shape[3], dtype=dtype)
    lse = torch.full((b, hq, t), -math.inf, dtype=torch.float64)
    for i in range(b):
        length, start = int(lengths[i]), 0 if starts is None else int(starts[i])
        for n in range(t_new):
            key = k_new[i, n].to(dtype)
            if rotary is not None:
                cos, sin, inter, _ = rotary
                key = rotate(key.double(), cos[length + n].double(), sin[length + n].double(), inter).to(dtype)
            ck[i, length + n], cv[i, length + n] = key, v_new[i, n].to(dtype)
        if rotary is not None:
            cos, sin, inter, shared = rotary
            pos = [length if shared else length + n for n in range(t)]
            qq[i] = torch.stack([rotate(q[i, n].double(), cos[p].double(), sin[p].double(), inter)
                                 for n, p in enumerate(pos)]).to(dtype)
        end = length + t_new
        # sequence i's visible slots [start, end) and its t queries at the last positions: the oracle's
        # bottom-right alignment, and ALiBi's distance |end - t + n - (start + j)| is its default offset
        n_keys = max(end - start, 0)
        kk, vv = (c[i, start:start + n_keys].transpose(0, 1)[None] for c in (ck, cv))  # (1, Hk, n, D)
        bias = None if alibi is None else alibi_bias(alibi[i] if alibi.dim() == 2 else alibi, t, n_keys)
        o, row_lse = reference(qq[i].transpose(0, 1)[None], kk, vv, causal=causal, alignment="bottom_right",
                               window=None if tuple(window) == (-1, -1) else tuple(window), softcap=softcap,
                               sinks=sinks, scale=scale, bias=bias, dtype=dtype)
        out[i] = o[0].transpose(0, 1)
        lse[i] = row_lse[0].double()
    return out, lse, ck, cv


# --- cases ------------------------------------------------------------------------------------------


def make_case(seed, *, layout, t, groups=2, t_new=None, s=48, lengths=(0, 7, 20, 30), starts=None, dv=D,
              dtype=torch.float32, device="cpu"):
    """Inputs and the caller's cache in `layout` ("contiguous", "batch_idx", "paged")."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b, hq = len(lengths), HK * groups
    t_new = t if t_new is None else t_new
    lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
    starts = None if starts is None else torch.tensor(starts, dtype=torch.int32, device=device)
    j = torch.arange(s, device=device)
    valid = (j[None] < lengths[:, None]) & (j[None] >= (0 if starts is None else starts[:, None]))
    dense = [torch.where(valid[..., None, None], torch.randn(b, s, HK, dim, generator=gen, device=device),
                         torch.tensor(float("nan"), device=device)).to(dtype) for dim in (D, dv)]
    q = torch.randn(b, t, hq, D, generator=gen, device=device).to(dtype)
    k = torch.randn(b, t_new, HK, D, generator=gen, device=device).to(dtype) if t_new else None
    v = torch.randn(b, t_new, HK, dv, generator=gen, device=device).to(dtype) if t_new else None
    extra = {}
    if layout == "contiguous":
        kc, vc = (x.clone() for x in dense)
    elif layout == "batch_idx":  # the sequences' rows shuffled into a larger cache of NaN rows
        rows = torch.randperm(b + 2, generator=gen, device=device)[:b]
        kc, vc = (torch.full((b + 2, *x.shape[1:]), float("nan"), dtype=dtype, device=device) for x in dense)
        kc[rows], vc[rows] = dense
        extra["cache_batch_idx"] = rows.to(torch.int32)
    else:
        kc, vc, table = layout_cache(*dense, "paged", gen=gen, page_size=PAGE)
        extra["block_table"] = table
    return dict(q=q, k=k, v=v, kc=kc, vc=vc, dense=dense, lengths=lengths, starts=starts, extra=extra, gen=gen)


def read_back(case):
    """The caller's cache after the call as dense (B, S, Hk, D|Dv) tensors."""
    kc, vc, extra = case["kc"], case["vc"], case["extra"]
    if "cache_batch_idx" in extra:
        rows = extra["cache_batch_idx"].long()
        return kc[rows], vc[rows]
    if "block_table" in extra:
        table = extra["block_table"].long()
        return kc[table].flatten(1, 2), vc[table].flatten(1, 2)
    return kc, vc


def run_case(case, *, rotary=None, **kw):
    rot = {} if rotary is None else dict(rotary_cos=rotary[0], rotary_sin=rotary[1], rotary_interleaved=rotary[2],
                                         rotary_shared_q_position=rotary[3])
    with torch.no_grad():
        return kvcache_attention(case["q"], case["kc"], case["vc"], case["lengths"], k=case["k"], v=case["v"],
                                 cache_starts=case["starts"], return_lse=True, **case["extra"], **rot, **kw)


def check(case, out, lse, *, rotary=None, tol=2e-5, **kw):
    window = kw.pop("window", None)
    window = (-1, -1) if window is None else ((window, -1) if isinstance(window, int) else window)
    ref, ref_lse, ref_k, ref_v = expected(case["q"], *case["dense"], case["lengths"], case["starts"], case["k"],
                                          case["v"], rotary=rotary, window=window, **kw)
    assert out.shape == ref.shape and out.dtype == case["q"].dtype
    assert (out.double() - ref).abs().max().item() < tol
    assert torch.equal(lse.isfinite(), ref_lse.isfinite())
    finite = ref_lse.isfinite()
    if finite.any():
        assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < tol
    got_k, got_v = read_back(case)
    # the values appended are exact (rotated keys within rounding of a float32 rotation); every
    # other slot, NaN included, is untouched
    assert torch.equal(got_v.double().nan_to_num(7.0), ref_v.nan_to_num(7.0))
    if rotary is None:
        assert torch.equal(got_k.double().nan_to_num(7.0), ref_k.nan_to_num(7.0))
    else:
        assert torch.equal(got_k.isnan(), ref_k.isnan())
        assert (got_k.double() - ref_k).nan_to_num(0.0).abs().max().item() < 1e-5


ROTARY = {"none": None, "gptj": True, "neox": False}


def tables(kind, s, rotary_dim=8):
    if ROTARY[kind] is None:
        return None
    cos, sin = rotary_tables(s, rotary_dim)
    return (cos, sin, ROTARY[kind], False)


# (layout, T, causal, rotary, groups, window, starts)
CASES = [
    ("contiguous", 1, True, "neox", 2, None, (0, 2, 5, 0)),
    ("contiguous", 5, False, "gptj", 2, None, None),
    ("paged", 5, True, "gptj", 1, (3, -1), (0, 1, 9, 4)),
    ("paged", 16, False, "none", 2, (4, 2), None),
    ("batch_idx", 5, True, "neox", 2, None, None),
    ("contiguous", 17, True, "gptj", 2, None, (0, 3, 11, 2)),
    ("contiguous", 17, False, "neox", 1, (6, 3), None),
    ("paged", 17, True, "neox", 2, None, (0, 6, 0, 29)),
    ("batch_idx", 17, False, "none", 2, None, None),
    ("contiguous", 40, True, "gptj", 2, None, (0, 3, 11, 2)),
    ("paged", 40, False, "neox", 2, (10, 5), None),
]
THOROUGH = [(layout, t, causal, rot, 2, None, (0, 1, 4, 3))
            for layout in ("contiguous", "batch_idx", "paged") for t in (1, 5, 16, 17, 40)
            for causal in (True, False) for rot in ROTARY]
GRID = CASES + [pytest.param(*c, marks=pytest.mark.thorough) for c in THOROUGH if c not in CASES]


@pytest.mark.parametrize("layout,t,causal,rot,groups,window,starts", GRID, ids=lambda x: str(x))
def test_against_float64_reference(layout, t, causal, rot, groups, window, starts):
    s = 80 if t > 17 else 48
    case = make_case(t * 7 + causal + groups, layout=layout, t=t, groups=groups, s=s,
                     lengths=(0, 5, 20, 33) if t > 17 else (0, 7, 20, 30), starts=starts)
    rotary = tables(rot, s)
    out, lse = run_case(case, rotary=rotary, causal=causal, window=window)
    check(case, out, lse, rotary=rotary, causal=causal, window=window)


@pytest.mark.parametrize("t", [5, 17])
def test_softcap_alibi_sinks_scale(t):
    case = make_case(50 + t, layout="contiguous", t=t, starts=(0, 2, 5, 1))
    hq = case["q"].shape[2]
    alibi = torch.rand(4, hq, generator=case["gen"]) * 0.3
    sinks = torch.randn(hq, generator=case["gen"])
    kw = dict(causal=True, window=(9, -1), softcap=3.0, scale=0.4)
    out, lse = run_case(case, alibi_slopes=alibi, **kw)
    check(case, out, lse, alibi=alibi, **kw)
    case = make_case(60 + t, layout="paged", t=t)
    out, lse = run_case(case, sinks=sinks, **kw)
    check(case, out, lse, sinks=sinks, **kw)


# (layout, T, causal, (B, Hq) slopes, window, softcap)
ALIBI_DECODE = [
    ("contiguous", 1, True, True, None, None),
    ("paged", 5, False, False, (4, 2), 3.0),
    ("batch_idx", 16, True, False, (7, -1), None),
    pytest.param("paged", 16, False, True, None, 2.0, marks=pytest.mark.thorough),
]


@pytest.mark.parametrize("layout,t,causal,per_batch,window,softcap", ALIBI_DECODE, ids=str)
def test_alibi_with_few_queries_runs_on_the_decode_kernels(monkeypatch, layout, t, causal, per_batch, window,
                                                            softcap):
    """T <= 16 with ALiBi goes to the decode kernels, slopes and all (the flash path is made to fail)."""
    import jaxattn.torch_api.kvcache_call as kvcache_call

    seen, run_decode = [], kvcache_call.run_decode
    monkeypatch.setattr(kvcache_call, "run_decode",
                        lambda *a, **kw: seen.append(kw["alibi_slopes"]) or run_decode(*a, **kw))
    monkeypatch.setattr(kvcache_call, "_on_flash_kernels",
                        lambda *a, **kw: pytest.fail("a call with T <= 16 and ALiBi took the flash path"))
    case = make_case(300 + t, layout=layout, t=t, starts=(0, 2, 5, 1))
    alibi = 0.05 + 0.5 * torch.rand((4, HK * 2) if per_batch else (HK * 2,), generator=case["gen"])
    out, lse = run_case(case, causal=causal, window=window, softcap=softcap, alibi_slopes=alibi)
    assert len(seen) == 1 and seen[0] is not None and torch.equal(seen[0], alibi)
    check(case, out, lse, causal=causal, window=window, softcap=softcap, alibi=alibi)


def test_no_append_and_fewer_queries_than_new_keys():
    # no k / v: the queries are the last T positions of the existing cache
    case = make_case(70, layout="paged", t=3, t_new=0, lengths=(3, 7, 20, 30))
    out, lse = run_case(case, causal=True)
    check(case, out, lse, causal=True)
    # T_new = 6 new keys, T = 2 queries: the queries are the last two of the new positions
    case = make_case(71, layout="contiguous", t=2, t_new=6, starts=(0, 1, 0, 3))
    rotary = (*rotary_tables(48, 16), False, False)  # rotary_dim = D
    out, lse = run_case(case, causal=False, rotary=rotary)
    check(case, out, lse, causal=False, rotary=rotary)


@pytest.mark.parametrize("t", [3, 17])
def test_empty_sequences_and_unused_table_entries(t):
    # sequence 0 has no keys (zeros, LSE -inf); block-table entries past the used pages hold -1
    for layout in ("contiguous", "paged"):
        case = make_case(75 + t, layout=layout, t=t, t_new=0, lengths=(0, 20, 30, 40), starts=(0, 20, 1, 0))
        if layout == "paged":
            table = case["extra"]["block_table"]
            used = (case["lengths"].long() + PAGE - 1) // PAGE
            table[torch.arange(table.shape[1])[None, :] >= used[:, None]] = -1
        out, lse = run_case(case, causal=False)
        assert torch.equal(out[:2], torch.zeros_like(out[:2]))
        check(case, out, lse, causal=False)


def test_value_head_dim_and_int_lengths():
    case = make_case(80, layout="batch_idx", t=17, dv=8, lengths=(9, 9, 9, 9))
    with torch.no_grad():
        out, lse = kvcache_attention(case["q"], case["kc"], case["vc"], 9, k=case["k"], v=case["v"], causal=True,
                                     return_lse=True, **case["extra"])
    check(case, out, lse, causal=True)


def test_rotary_shared_query_position():
    case = make_case(90, layout="contiguous", t=4)
    rotary = (*rotary_tables(48, 8), True, True)
    out, lse = run_case(case, causal=False, rotary=rotary)
    check(case, out, lse, causal=False, rotary=rotary)


# --- the Triton kernels (interpreted on CPU) --------------------------------------------------------


NATIVE = [("paged", 5, False, "gptj", (3, 2)), ("contiguous", 17, True, "neox", (6, -1))]
NATIVE += [pytest.param(*c, marks=pytest.mark.thorough) for c in [
    ("batch_idx", 1, False, "none", None), ("contiguous", 16, True, "gptj", None),
    ("paged", 17, False, "none", (4, 4)), ("batch_idx", 40, False, "gptj", None)]]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or not can_launch(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                    reason="needs triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout,t,causal,rot,window", NATIVE, ids=lambda x: str(x))
def test_native_kernels(layout, t, causal, rot, window):
    s = 80 if t > 17 else 48
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(100 + t, layout=layout, t=t, s=s, lengths=(0, 5, 20, 33) if t > 17 else (0, 7, 20, 30),
                     starts=None if layout == "paged" else (0, 2, 4, 1), device=dev)
    rotary = tables(rot, s)
    if rotary is not None:
        rotary = (rotary[0].to(dev), rotary[1].to(dev), *rotary[2:])
    with sdpa_launcher("native"):
        out, lse = run_case(case, rotary=rotary, causal=causal, window=window)
    case = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in case.items()}
    case["dense"] = [x.cpu() for x in case["dense"]]
    case["extra"] = {name: x.cpu() for name, x in case["extra"].items()}
    rotary = None if rotary is None else (rotary[0].cpu(), rotary[1].cpu(), *rotary[2:])
    check(case, out.cpu(), lse.cpu(), rotary=rotary, causal=causal, window=window, tol=2e-4 if dev == "cuda" else 2e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or not can_launch(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                    reason="needs triton, and CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("layout,per_batch", [("paged", True), ("batch_idx", False)])
def test_native_kernels_with_alibi(monkeypatch, layout, per_batch):
    """ALiBi with T <= 16 on the decode kernels launched from torch (the flash path is made to fail):
    no XLA executable runs."""
    import jaxattn.torch_api.kvcache_call as kvcache_call
    from jaxattn.bridge import cache_info

    monkeypatch.setattr(kvcache_call, "_on_flash_kernels",
                        lambda *a, **kw: pytest.fail("a call with T <= 16 and ALiBi took the flash path"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    case = make_case(500 + per_batch, layout=layout, t=5, starts=(0, 2, 4, 1), device=dev)
    alibi = 0.05 + 0.5 * torch.rand((4, HK * 2) if per_batch else (HK * 2,), generator=case["gen"], device=dev)
    before = cache_info()
    with sdpa_launcher("native"):
        out, lse = run_case(case, causal=not per_batch, window=(6, 2), alibi_slopes=alibi)
    assert cache_info() == before, "an XLA executable ran for a native call"
    case = {name: x.cpu() if isinstance(x, torch.Tensor) else x for name, x in case.items()}
    case["dense"] = [x.cpu() for x in case["dense"]]
    case["extra"] = {name: x.cpu() for name, x in case["extra"].items()}
    check(case, out.cpu(), lse.cpu(), causal=not per_batch, window=(6, 2), alibi=alibi.cpu(),
          tol=2e-4 if dev == "cuda" else 2e-5)


# --- flash_attn_with_kvcache (flash-attn 2's semantics and defaults) --------------------------------


@pytest.mark.parametrize("layout,t,causal,window,interleaved", [
    ("contiguous", 1, False, (-1, -1), True),
    ("paged", 5, True, (-1, -1), False),
    ("batch_idx", 5, False, (-1, -1), True),   # not causal, not local: every query rotated at cache_seqlens
    ("contiguous", 5, False, (3, 1), False),   # local: queries at their own positions
    ("contiguous", 5, False, (60, 60), True),  # sides >= the capacity are unbounded: not local
    ("paged", 17, False, (-1, -1), False),
    ("contiguous", 17, True, (4, -1), True),
], ids=str)
def test_flash_attn_with_kvcache(layout, t, causal, window, interleaved):
    case = make_case(200 + t, layout=layout, t=t, starts=(0, 1, 2, 3))
    cos, sin = rotary_tables(48, 8)
    local = any(0 <= w < 48 for w in window)
    rotary = (cos, sin, interleaved, not causal and not local)
    extra = dict(case["extra"])
    # flash-attn's leftpad is not with paged caches there; here it is (a superset)
    out, lse = flash_attn_with_kvcache(case["q"], case["kc"], case["vc"], case["k"], case["v"], rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=case["lengths"], cache_leftpad=case["starts"],
                                       causal=causal, window_size=window, rotary_interleaved=interleaved,
                                       num_splits=3, return_softmax_lse=True, **extra)
    ref_window = tuple(-1 if w >= 48 else w for w in window)
    check(case, out, lse, rotary=rotary, causal=causal, window=ref_window)


def test_flash_attn_with_kvcache_defaults():
    # cache_seqlens None: each sequence is its whole cache row; softcap 0.0: off; non-causal by default
    case = make_case(300, layout="contiguous", t=3, t_new=0, lengths=(48, 48, 48, 48))
    q = case["q"].requires_grad_()
    out = flash_attn_with_kvcache(q, case["kc"], case["vc"], softcap=0.0, alibi_slopes=None)
    assert not out.requires_grad  # an inference call, as flash-attn's: no autograd history
    ref, _, _, _ = expected(case["q"].detach(), *case["dense"], case["lengths"], None, causal=False)
    assert (out.double() - ref).abs().max().item() < 2e-5
    # an int cache_seqlens, softcap, ALiBi
    case = make_case(301, layout="paged", t=4, lengths=(12, 12, 12, 12))
    slopes = torch.rand(case["q"].shape[2], generator=case["gen"])
    out, lse = flash_attn_with_kvcache(case["q"], case["kc"], case["vc"], case["k"], case["v"], cache_seqlens=12,
                                       softcap=5.0, alibi_slopes=slopes, softmax_scale=0.3, causal=True,
                                       return_softmax_lse=True, **case["extra"])
    check(case, out, lse, causal=True, softcap=5.0, alibi=slopes, scale=0.3)


# --- errors -----------------------------------------------------------------------------------------


def _bad(case, **changes):
    args = dict(q=case["q"], k_cache=case["kc"], v_cache=case["vc"], cache_seqlens=case["lengths"], k=case["k"],
                v=case["v"], **case["extra"])
    args.update(changes)
    q, kc, vc, lengths = (args.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens"))
    with torch.no_grad():
        kvcache_attention(q, kc, vc, lengths, **args)


ERRORS = [
    ("q", lambda c: dict(q=c["q"][0]), "q: expected a non-empty 4-D"),
    ("q dtype", lambda c: dict(q=c["q"].double()), "k_cache: torch.float32"),
    ("heads", lambda c: dict(q=c["q"][:, :, :3]), "not a multiple"),
    ("rows", lambda c: dict(q=c["q"][:3], k=c["k"][:3], v=c["v"][:3], cache_seqlens=c["lengths"][:3]),
     "cache_batch_idx"),
    ("k only", lambda c: dict(v=None), "pass both"),
    ("k shape", lambda c: dict(k=c["k"][:, :, :1]), "k: shape"),
    ("lengths", lambda c: dict(cache_seqlens=c["lengths"].float()), "cache_seqlens: expected an int32"),
    ("overflow", lambda c: dict(cache_seqlens=torch.tensor([0, 0, 0, 47], dtype=torch.int32)), "capacity"),
    ("starts", lambda c: dict(cache_starts=torch.tensor([1, 0, 0, 0], dtype=torch.int32)), "cache_starts"),
    ("window", lambda c: dict(window=(-2, 0)), "window=\\(-2, 0\\)"),
    ("softcap", lambda c: dict(softcap=0.0), "softcap=0.0"),
    ("causal", lambda c: dict(causal=1), "causal=1"),
    ("rotary one", lambda c: dict(rotary_cos=rotary_tables(48, 8)[0]), "pass both"),
    ("rotary dim", lambda c: dict(zip(("rotary_cos", "rotary_sin"), rotary_tables(48, 2 * D + 2))), "rotary_dim"),
    ("rotary rows", lambda c: dict(zip(("rotary_cos", "rotary_sin"), rotary_tables(40, 8))), "capacity 48"),
    ("rotary no k", lambda c: dict(k=None, v=None, **dict(zip(("rotary_cos", "rotary_sin"), rotary_tables(48, 8)))),
     "needs k and v"),
    ("alibi", lambda c: dict(alibi_slopes=torch.ones(3)), "alibi_slopes"),
    ("batch idx", lambda c: dict(cache_batch_idx=torch.tensor([0, 1, 2, 9], dtype=torch.int32)), "cache_batch_idx"),
]


@pytest.mark.parametrize("name,change,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument(name, change, message):
    case = make_case(400, layout="contiguous", t=2)
    with pytest.raises((AttentionInputError, TypeError), match=message):
        _bad(case, **change(case))


def test_paged_errors():
    case = make_case(401, layout="paged", t=2)
    table = case["extra"]["block_table"].clone()
    table[3, 3] = 999  # a page holding positions of sequence 3 (length 30 + 2)
    with pytest.raises(AttentionInputError, match="block_table: entry \\[3, 3\\] = 999"):
        _bad(case, block_table=table)
    with pytest.raises(AttentionInputError, match="block_table\\[cache_batch_idx\\]"):
        _bad(case, cache_batch_idx=torch.arange(4, dtype=torch.int32))


def test_not_differentiable():
    case = make_case(402, layout="contiguous", t=2)
    with pytest.raises(AttentionInputError, match="not differentiable.*q require grad"):
        kvcache_attention(case["q"].requires_grad_(), case["kc"], case["vc"], case["lengths"])
    with pytest.raises(AttentionInputError, match="cache_seqlens: required with k / v"):
        flash_attn_with_kvcache(case["q"], case["kc"], case["vc"], case["k"], case["v"])
    with pytest.raises(AttentionInputError, match="num_splits=-1"):
        flash_attn_with_kvcache(case["q"], case["kc"], case["vc"], num_splits=-1)


# --- GPU: bf16 / fp16 on the compiled kernels (skipped without CUDA) --------------------------------


GPU_CASES = [("contiguous", 1, True, "neox"), ("paged", 4, False, "gptj"), ("batch_idx", 16, True, "none"),
             ("contiguous", 33, True, "gptj"), ("paged", 100, False, "neox")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,t,causal,rot", GPU_CASES, ids=str)
def test_on_gpu(layout, t, causal, rot, dtype):
    s = 512
    case = make_case(500 + t, layout=layout, t=t, groups=4, s=s, lengths=(0, 1, 300, 400), starts=(0, 0, 17, 100),
                     dtype=dtype, device="cuda")
    rotary = tables(rot, s)
    if rotary is not None:
        rotary = (rotary[0].cuda(), rotary[1].cuda(), *rotary[2:])
    out, lse = run_case(case, rotary=rotary, causal=causal, window=(200, -1))
    cpu = lambda x: None if x is None else x.cpu()  # noqa: E731
    args = (cpu(case["q"]), *(x.cpu() for x in case["dense"]), case["lengths"].cpu(), cpu(case["starts"]),
            cpu(case["k"]), cpu(case["v"]))
    rot_cpu = None if rotary is None else (rotary[0].cpu(), rotary[1].cpu(), *rotary[2:])
    kw = dict(rotary=rot_cpu, causal=causal, window=(200, -1))
    ref, ref_lse, _, _ = expected(*args, **kw)
    low, _, _, _ = expected(*args, dtype=dtype, **kw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert_dtype_rule("out", out.cpu(), ref, low, floor=1e-3)
    finite = ref_lse.isfinite()
    assert torch.equal(lse.cpu().isfinite(), finite)
    assert (lse.cpu().double()[finite] - ref_lse[finite]).abs().max().item() < 1e-2
