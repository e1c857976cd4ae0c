"""`kvcache_attention` and `flash_attn_with_kvcache`: append, rotary, attention in one call.

Oracle: `expected` below, written from the definitions in float64: the cache after the append as an
explicit tensor (new keys rotated at their positions through complex multiplication), queries
rotated the same way, each query's visible keys from lengths / starts / causal / window, ALiBi as
-slope * distance, a plain softmax. Caches hold NaN outside each sequence's valid region (paged:
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

from attention_reference import assert_dtype_rule
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
    hk = dense_k.shape[2]
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
        keys = torch.arange(start, end)
        pos_q = end - t + torch.arange(t)
        vis = torch.ones(t, len(keys), dtype=torch.bool)
        if causal:
            vis &= keys[None, :] <= pos_q[:, None]
        if window[0] >= 0:
            vis &= keys[None, :] >= pos_q[:, None] - window[0]
        if window[1] >= 0:
            vis &= keys[None, :] <= pos_q[:, None] + window[1]
        kk = ck[i, start:end].repeat_interleave(hq // hk, dim=1)  # (n, Hq, D)
        vv = cv[i, start:end].repeat_interleave(hq // hk, dim=1)
        logits = torch.einsum("thd,nhd->htn", qq[i], kk) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if alibi is not None:
            slopes = (alibi[i] if alibi.dim() == 2 else alibi).to(dtype)
            logits = logits - slopes[:, None, None] * (pos_q[:, None] - keys[None, :]).abs().to(dtype)
        logits = logits.masked_fill(~vis, -math.inf)
        if sinks is not None:
            logits = torch.cat((logits, sinks.to(dtype)[:, None, None].expand(hq, t, 1)), -1)
        row_lse = torch.logsumexp(logits.double(), -1)
        weights = torch.exp(logits.double() - torch.where(row_lse.isfinite(), row_lse, 0)[..., None]).to(dtype)
        if sinks is not None:
            weights = weights[..., :-1]
        out[i] = torch.einsum("htn,nhd->thd", weights, vv)
        lse[i] = row_lse
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
