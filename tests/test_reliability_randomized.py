"""Property-based randomized parity: every implementation against an independent float64 oracle.

Run (CI profile, the default: a few examples per test, well under 2 minutes on 2 CPU cores; the
default `pytest` keeps only the SDPA drop-in's forward test, the others are marked thorough):

    .venv/bin/python -m pytest tests/test_reliability_randomized.py --thorough --hypothesis-show-statistics

Thorough (>= 1000 examples per test; 5-10 minutes per test on 2 CPU cores, about 2 hours in all):

    .venv/bin/python -m pytest tests/test_reliability_randomized.py --hypothesis-profile=thorough --hypothesis-show-statistics
    # or JAXATTN_HYPOTHESIS_PROFILE=thorough; JAXATTN_HYPOTHESIS_MAX_EXAMPLES=N sets every test's count,
    # e.g. JAXATTN_HYPOTHESIS_MAX_EXAMPLES=150 ... -k flash for a shorter interpreted-flash run.

What is drawn: batch 1..2, KV heads 1..2 with a GQA ratio in {1, 2, 4}, query and key lengths 1..70
drawn independently (awkward sizes favoured), head dims in {8, 16, 24, 40, 80} (and a different value
head dim where the implementation takes one), dtypes (float32 / float64, bfloat16 / float16 where the
implementation runs them on CPU), causality, bool / additive masks in several broadcast shapes
(fully masked rows included: torch gives them 0), the scale, and per implementation its features:
soft cap, sliding windows, sinks, segment ids, bottom-right alignment, the LSE, ragged / paged decode
caches. Inputs are fresh random tensors from a generator seeded by a drawn integer.

Oracles (never the implementation under test): torch's math SDPA on float64 copies of the inputs, or
the float64 plain-torch reference of tests/attention_reference.py (`decode_reference` for caches).
Tolerances: float64 1e-10 and float32 2e-5, relative to max(1, |oracle|max) (gradients 1e-9 / 5e-5);
bfloat16 / float16: our error against the float64 oracle <= 2x torch's own same-dtype error + one
unit of the dtype's epsilon at the output's scale.

Implementations: "vanilla" and "sdpa" through the torch SDPA and flash_attention APIs (gradients
too), "decode" through the torch decode API (contiguous BSHD / BHSD and paged caches, ragged starts
and lengths, NaN in unused slots), and all five registered implementations through
`jax_core.attention()`: "flash" runs its GPU path under Triton's interpreter (tests/
jax_triton_interpret.py; float32 / float16 only: the stand-in cannot carry bfloat16) and "ring" runs
on a mesh of simulated CPU devices. A draw an implementation declares unsupported (its
`not_supported_reasons`) is rejected with `assume`; the strategies are built per implementation so
that this is rare (Hypothesis fails the test with a health check if it is not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_reference import assert_dtype_rule, decode_reference, max_error, reference, segment_visibility
from decode_cases import layout_cache, ragged_cache

from jaxattn.jax_core import AttentionInputs, AttentionMetadata, AttentionRegistry, attention
from jaxattn.torch_api import decode_attention, flash_attention, scaled_dot_product_attention

PROFILE = settings.get_current_profile_name()
#: Randomized sweeps run under `pytest --thorough` (tests/conftest.py); the deterministic grids of the
#: other files cover each implementation and feature in the default run.
THOROUGH = pytest.mark.thorough
DIMS = (8, 16, 24, 40, 80)
AWKWARD = (1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 47, 63, 64, 65, 70)
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
                "float16": torch.float16}
TOL = {"float64": 1e-10, "float32": 2e-5}
GRAD_TOL = {"float64": 1e-9, "float32": 5e-5}


def budget(ci_examples: int):
    """This test's example count in the CI profile (JAXATTN_HYPOTHESIS_MAX_EXAMPLES overrides any profile)."""
    forced = os.environ.get("JAXATTN_HYPOTHESIS_MAX_EXAMPLES")
    if forced:
        return settings(max_examples=int(forced))
    return settings(max_examples=ci_examples) if PROFILE == "ci" else (lambda f: f)


# --- strategies ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shapes:
    b: int
    hq: int
    hk: int
    l: int
    s: int
    e: int
    ev: int


def lengths(hi: int = 70, lo: int = 1):
    """Sequence lengths in [lo, hi], block-boundary sizes favoured."""
    edges = [n for n in AWKWARD if lo <= n <= hi] or [lo]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


@st.composite
def shapes(draw, *, same_ev=False, max_l=70, max_s=70, equal_ls=False):
    hk = draw(st.integers(1, 2))
    l = draw(lengths(max_l))
    s = l if equal_ls else draw(lengths(max_s))
    e = draw(st.sampled_from(DIMS))
    ev = e if same_ev else draw(st.one_of(st.just(e), st.sampled_from(DIMS)))
    return Shapes(draw(st.integers(1, 2)), hk * draw(st.sampled_from((1, 2, 4))), hk, l, s, e, ev)


def scales(e: int):
    """None (1/sqrt(E)) or a scale keeping the logits' spread moderate (float32 stays well-conditioned)."""
    return st.one_of(st.none(), st.floats(0.1, 2.0).map(lambda m: m / math.sqrt(e)))


def seeds():
    return st.integers(0, 2**31 - 1)


def window_sides(hi: int = 24):
    return st.one_of(st.just(-1), st.integers(0, hi))


# --- tensors and checks ----------------------------------------------------------------------------


def randn(g: torch.Generator, *shape: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def qkv(g, sh: Shapes, dtype):
    """(B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev) random tensors."""
    return (randn(g, sh.b, sh.hq, sh.l, sh.e, dtype=dtype), randn(g, sh.b, sh.hk, sh.s, sh.e, dtype=dtype),
            randn(g, sh.b, sh.hk, sh.s, sh.ev, dtype=dtype))


def check(name: str, got: torch.Tensor, want: torch.Tensor, dtype: str, *, lowp: Optional[torch.Tensor] = None,
          tol: Optional[dict] = None) -> None:
    """`got` against the float64 `want`: same shape and non-finite pattern; error within the dtype's rule
    (low precision: <= 2x the error of torch's same-dtype result `lowp`, plus one epsilon)."""
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite), f"{name}: non-finite pattern differs from the oracle's"
    assert torch.equal(got[~finite].double(), want[~finite]), f"{name}: non-finite values differ"
    size = max(1.0, want[finite].abs().max().item()) if finite.any() else 1.0
    if dtype in ("float32", "float64"):
        err, bound = max_error(got, want), (tol or TOL)[dtype] * size
        assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} ({dtype})"
        return
    assert_dtype_rule(f"{name} ({dtype})", got, want, lowp, floor=torch.finfo(TORCH_DTYPES[dtype]).eps * size)


def ours_supports(impl: str, sh: Shapes, dtype: str, metadata: Optional[AttentionMetadata] = None, *,
                  platform: str = "cpu", **features) -> None:
    """`assume` the implementation declares support (its own `not_supported_reasons`), recording why not."""
    shape = jax.ShapeDtypeStruct
    inputs = AttentionInputs.from_arrays(
        shape((sh.b, sh.l, sh.hq, sh.e), jnp.dtype(dtype)), shape((sh.b, sh.s, sh.hk, sh.e), jnp.dtype(dtype)),
        shape((sh.b, sh.s, sh.hk, sh.ev), jnp.dtype(dtype)), platform=platform,
        backend="rocm" if platform == "gpu" else platform, **features)
    reasons = AttentionRegistry.get(impl).not_supported_reasons(inputs, metadata)
    if reasons:
        event(f"{impl}: rejected ({reasons[0]})")
    assume(not reasons)
    event(f"{impl}: ran {dtype}")


def torch_math(q, k, v, **kw) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def f64(x):
    return None if x is None else (x.double() if x.dtype.is_floating_point else x)


# --- torch SDPA API: vanilla, sdpa -------------------------------------------------------------------


SDPA_DTYPES = {"vanilla": ("float32", "float64", "bfloat16", "float16"), "sdpa": ("float32", "bfloat16")}
MASK_SHAPES = {"LS": lambda sh: (sh.l, sh.s), "B1LS": lambda sh: (sh.b, 1, sh.l, sh.s),
               "1H1S": lambda sh: (1, sh.hq, 1, sh.s), "BHLS": lambda sh: (sh.b, sh.hq, sh.l, sh.s),
               "S": lambda sh: (sh.s,)}


@dataclasses.dataclass(frozen=True)
class SdpaCase:
    shapes: Shapes
    dtype: str
    causal: bool
    mask: Optional[str]  # None, "bool", "float"
    mask_shape: str
    p_keep: float
    dead_rows: bool  # some rows fully masked (torch: output 0)
    scale: Optional[float]
    seed: int


@st.composite
def sdpa_cases(draw, impl: str, dtypes=None):
    sh = draw(shapes(same_ev=impl == "sdpa"))
    mask = draw(st.sampled_from((None, "bool", "float")))
    return SdpaCase(
        sh, draw(st.sampled_from(dtypes or SDPA_DTYPES[impl])), mask is None and draw(st.booleans()), mask,
        draw(st.sampled_from(sorted(MASK_SHAPES))), draw(st.floats(0.05, 1.0)),
        mask is not None and draw(st.sampled_from((False, False, True))), draw(scales(sh.e)), draw(seeds()))


def make_mask(g, case: SdpaCase, dtype) -> Optional[torch.Tensor]:
    """A bool or additive (-inf = hidden) mask; every row sees a key unless `dead_rows`."""
    if case.mask is None:
        return None
    shape = MASK_SHAPES[case.mask_shape](case.shapes)
    keep = torch.rand(shape, generator=g) < case.p_keep
    keep.scatter_(-1, torch.randint(0, shape[-1], (*shape[:-1], 1), generator=g), True)
    if case.dead_rows:
        keep &= ~(torch.rand((*shape[:-1], 1), generator=g) < 0.3)
    if case.mask == "bool":
        return keep
    return (2 * randn(g, *shape, dtype=torch.float64)).masked_fill(~keep, float("-inf")).to(dtype)


def sdpa_inputs(case: SdpaCase, dtype):
    g = torch.Generator().manual_seed(case.seed)
    q, k, v = qkv(g, case.shapes, dtype)
    return g, q, k, v, make_mask(g, case, dtype)


def sdpa_features(case: SdpaCase) -> dict:
    return dict(causal=case.causal, mask=True if case.mask == "bool" else None,
                bias=True if case.mask == "float" else None)


def sdpa_kwargs(case: SdpaCase, mask) -> dict:
    return dict(attn_mask=mask, is_causal=case.causal, scale=case.scale, enable_gqa=True)


@pytest.mark.parametrize("impl", [pytest.param("vanilla", marks=THOROUGH), "sdpa"])
@budget(10)
@given(data=st.data())
def test_sdpa_api_forward(impl, data):
    """scaled_dot_product_attention(implementation=impl) == torch math SDPA on float64 copies."""
    case = data.draw(sdpa_cases(impl), label="case")
    ours_supports(impl, case.shapes, case.dtype, **sdpa_features(case))
    dtype = TORCH_DTYPES[case.dtype]
    _, q, k, v, mask = sdpa_inputs(case, dtype)
    kw = sdpa_kwargs(case, mask)
    out = scaled_dot_product_attention(q, k, v, implementation=impl, **kw)
    assert out.dtype == dtype
    want = torch_math(f64(q), f64(k), f64(v), **{**kw, "attn_mask": f64(mask)})
    lowp = None if case.dtype in TOL else torch_math(q, k, v, **kw)
    check("out", out, want, case.dtype, lowp=lowp)


GRAD_DTYPES = {"vanilla": ("float64",), "sdpa": ("float32",)}  # sdpa has no float64 (jax.nn downcasts it)


def grads_of(fn, leaves, cot):
    """(out, grads of sum(out * cot) w.r.t. every leaf that requires grad, None for the others)."""
    out = fn(*leaves)
    wrt = [x for x in leaves if x is not None and x.requires_grad]
    got = iter(torch.autograd.grad(out, wrt, cot))
    return out.detach(), [next(got) if x is not None and x.requires_grad else None for x in leaves]


def leaves_of(tensors, dtype=None):
    """Fresh leaves (float ones require grad), optionally cast."""
    out = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        t = t.detach().clone() if dtype is None or not t.dtype.is_floating_point else t.detach().to(dtype)
        out.append(t.requires_grad_(True) if t.dtype.is_floating_point else t)
    return out


@THOROUGH
@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@budget(5)
@given(data=st.data())
def test_sdpa_api_gradients(impl, data):
    """dq, dk, dv and a float mask's gradient == torch math SDPA's float64 gradients."""
    case = data.draw(sdpa_cases(impl, GRAD_DTYPES[impl]), label="case")
    ours_supports(impl, case.shapes, case.dtype, backward=True, **sdpa_features(case))
    g, q, k, v, mask = sdpa_inputs(case, TORCH_DTYPES[case.dtype])
    kw = dict(is_causal=case.causal, scale=case.scale, enable_gqa=True)
    cot = randn(g, case.shapes.b, case.shapes.hq, case.shapes.l, case.shapes.ev)
    out, grads = grads_of(lambda q, k, v, m: scaled_dot_product_attention(q, k, v, attn_mask=m, implementation=impl,
                                                                          **kw), leaves_of((q, k, v, mask)),
                          cot.to(q.dtype))
    want, want_grads = grads_of(lambda q, k, v, m: torch_math(q, k, v, attn_mask=m, **kw),
                                leaves_of((q, k, v, mask), torch.float64), cot.double())
    check("out", out, want, case.dtype)
    for name, got, ref in zip(("dq", "dk", "dv", "dmask"), grads, want_grads):
        assert (got is None) == (ref is None), name
        if ref is not None:
            check(name, got, ref, case.dtype, tol=GRAD_TOL)


# --- torch flash_attention API: vanilla, sdpa --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FlashCase:
    shapes: Shapes
    dtype: str
    causal: bool
    alignment: str
    window: Optional[tuple[int, int]]
    softcap: Optional[float]
    sinks: Optional[int]  # None, or sinks per head (1: shape (Hq,))
    segments: Optional[str]  # None, "shared" (one (B, L) tensor, L == S) or "pair"
    n_segments: int
    sorted_segments: bool
    scale: Optional[float]
    return_lse: bool
    seed: int


FLASH_DTYPES = {"vanilla": ("float32", "float64", "bfloat16", "float16"), "sdpa": ("float32", "bfloat16"),
                "decode": ("float32", "float64"), "ring": ("float32", "float64"), "flash": ("float32", "float16")}
#: Features each implementation takes (beyond causal / GQA / windows), for its strategy.
RICH = {"vanilla": True, "flash": True, "ring": True, "decode": True, "sdpa": False}


@st.composite
def flash_cases(draw, impl: str, *, dtypes=None, max_l=70, max_s=70, lse=True):
    rich = RICH[impl]
    sh = draw(shapes(same_ev=impl == "sdpa", max_l=max_l, max_s=max_s, equal_ls=impl == "ring"
                     and draw(st.booleans())))
    segments = None
    if rich and impl != "decode":
        segments = draw(st.sampled_from((None, "pair") + (("shared",) if sh.l == sh.s else ())))
    alignment = draw(st.sampled_from(("top_left", "bottom_right"))) if rich or sh.l == sh.s else "top_left"
    if impl == "ring" and sh.l != sh.s:
        causal, window = False, None  # ring: positional masks need L == S
    else:
        causal = draw(st.booleans())
        window = draw(st.one_of(st.none(), st.tuples(window_sides(), window_sides())))
    return FlashCase(
        sh, draw(st.sampled_from(dtypes or FLASH_DTYPES[impl])), causal, alignment, window,
        draw(st.one_of(st.none(), st.floats(0.5, 30.0))) if rich else None,
        draw(st.sampled_from((None, 1, 1, 3))) if rich else None, segments, draw(st.integers(1, 3)),
        draw(st.booleans()), draw(scales(sh.e)), lse and impl != "sdpa" and draw(st.booleans()), draw(seeds()))


def flash_inputs(case: FlashCase, dtype):
    """(g, q, k, v, sinks, (q_ids, kv_ids) or None, the segment mask (B, 1, L, S) or None)."""
    g = torch.Generator().manual_seed(case.seed)
    sh = case.shapes
    q, k, v = qkv(g, sh, dtype)
    sinks = None
    if case.sinks:
        sinks = randn(g, sh.hq, *(() if case.sinks == 1 else (case.sinks,)))
    ids = None
    if case.segments:
        q_ids = torch.randint(0, case.n_segments, (sh.b, sh.l), generator=g)
        kv_ids = q_ids if case.segments == "shared" else torch.randint(0, case.n_segments, (sh.b, sh.s), generator=g)
        if case.sorted_segments:
            q_ids, kv_ids = q_ids.sort(-1).values, kv_ids.sort(-1).values
        ids = (q_ids, kv_ids)
    mask = None if ids is None else segment_visibility(*ids)
    return g, q, k, v, sinks, ids, mask


def flash_reference(case: FlashCase, q, k, v, sinks, mask, dtype=torch.float64, bias=None):
    """(out, lse) of the documented math by tests/attention_reference.py in `dtype`."""
    return reference(q, k, v, causal=case.causal, alignment=case.alignment, window=case.window, softcap=case.softcap,
                     sinks=sinks, scale=case.scale, mask=mask, bias=bias, dtype=dtype)


def flash_api(case: FlashCase, impl, q, k, v, sinks, ids, return_lse):
    segment_ids = None if ids is None else (ids[0] if case.segments == "shared" else ids)
    return flash_attention(q, k, v, causal=case.causal, causal_alignment=case.alignment, window=case.window,
                           softcap=case.softcap, sinks=sinks, segment_ids=segment_ids, scale=case.scale,
                           return_lse=return_lse, implementation=impl)


def flash_features(case: FlashCase) -> dict:
    return dict(causal=case.causal, causal_alignment=case.alignment, sliding_window=case.window,
                logits_soft_cap=case.softcap, softmax_aux=True if case.sinks else None,
                segment_ids=case.segments is not None, return_lse=case.return_lse)


@THOROUGH
@pytest.mark.parametrize("impl", ["vanilla", "sdpa"])
@budget(8)
@given(data=st.data())
def test_flash_api_forward(impl, data):
    """flash_attention(implementation=impl): output (and LSE) == the float64 reference."""
    case = data.draw(flash_cases(impl), label="case")
    ours_supports(impl, case.shapes, case.dtype, **flash_features(case))
    dtype = TORCH_DTYPES[case.dtype]
    _, q, k, v, sinks, ids, mask = flash_inputs(case, dtype)
    got = flash_api(case, impl, q, k, v, sinks, ids, case.return_lse)
    out, lse = got if case.return_lse else (got, None)
    assert out.dtype == dtype
    want, want_lse = flash_reference(case, q, k, v, sinks, mask)
    low = (None, None) if case.dtype in TOL else flash_reference(case, q, k, v, sinks, mask, dtype=dtype)
    check("out", out, want, case.dtype, lowp=low[0])
    if lse is not None:
        check("lse", lse, want_lse, case.dtype, lowp=low[1])


@THOROUGH
@budget(5)
@given(data=st.data())
def test_flash_api_gradients_vanilla(data):
    """float64 gradients of q, k, v and the sinks through flash_attention == the reference's."""
    case = data.draw(flash_cases("vanilla", dtypes=("float64",), lse=False), label="case")
    ours_supports("vanilla", case.shapes, case.dtype, backward=True, **flash_features(case))
    g, q, k, v, sinks, ids, mask = flash_inputs(case, torch.float64)
    cot = randn(g, case.shapes.b, case.shapes.hq, case.shapes.l, case.shapes.ev, dtype=torch.float64)
    leaves = leaves_of((q, k, v, sinks))
    out, grads = grads_of(lambda q, k, v, s: flash_api(case, "vanilla", q, k, v, s, ids, False), leaves, cot)
    want, want_grads = grads_of(lambda q, k, v, s: flash_reference(case, q, k, v, s, mask)[0],
                                leaves_of((q, k, v, sinks)), cot)
    check("out", out, want, case.dtype)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads):
        if ref is not None:
            check(name, got, ref, case.dtype, tol=GRAD_TOL)


# --- torch decode API: decode ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    b: int
    hq: int
    hkv: int
    t: int
    capacity: int
    d: int
    dv: int
    dtype: str
    layout: str  # "BSHD", "BHSD", "paged"
    page_size: int
    lengths: tuple
    starts: Optional[tuple]
    window: Optional[int]
    softcap: Optional[float]
    sinks: Optional[int]
    scale: Optional[float]
    return_lse: bool
    seed: int


@st.composite
def decode_cases(draw):
    layout = draw(st.sampled_from(("BSHD", "BHSD", "paged")))
    page_size = draw(st.sampled_from((1, 2, 4, 8, 16))) if layout == "paged" else 1
    capacity = page_size * draw(st.integers(1, 70 // page_size)) if layout == "paged" else draw(lengths())
    b, hkv, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.sampled_from(DIMS))
    t = draw(st.integers(1, 16))
    seq = st.integers(0, capacity)
    return DecodeCase(
        b, hkv * draw(st.sampled_from((1, 2, 4))), hkv, t, capacity, d, draw(st.one_of(st.just(d), st.sampled_from(DIMS))),
        draw(st.sampled_from(("float32", "float64", "bfloat16", "float16"))), layout, page_size,
        tuple(draw(st.lists(st.one_of(st.integers(min(t, capacity), capacity), seq), min_size=b, max_size=b))),
        draw(st.one_of(st.none(), st.lists(seq, min_size=b, max_size=b).map(tuple))),
        draw(st.one_of(st.none(), st.integers(0, 24))), draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        draw(st.sampled_from((None, 1, 1, 3))), draw(scales(d)), draw(st.booleans()), draw(seeds()))


def decode_inputs(case: DecodeCase):
    """(q, dense NaN-padded k, v, the cache in its layout (k, v, block_table), lengths, starts, sinks)."""
    g = torch.Generator().manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]
    lens = torch.tensor(case.lengths, dtype=torch.int32)
    starts = None if case.starts is None else torch.tensor(case.starts, dtype=torch.int32)
    q = randn(g, case.b, case.hq, case.t, case.d, dtype=dtype)
    k, v = ragged_cache(g, case.b, case.capacity, case.hkv, case.d, lens, starts, dv=case.dv, dtype=dtype)
    cache = layout_cache(k, v, case.layout, gen=g, page_size=case.page_size)
    sinks = None if not case.sinks else randn(g, case.hq, *(() if case.sinks == 1 else (case.sinks,)))
    return q, k, v, cache, lens, starts, sinks


@THOROUGH
@budget(10)
@given(data=st.data())
def test_decode_api_forward(data):
    """decode_attention over ragged contiguous / paged caches == the float64 masked-SDPA oracle (and its LSE)."""
    case = data.draw(decode_cases(), label="case")
    q, k, v, (kc, vc, table), lens, starts, sinks = decode_inputs(case)
    event(f"decode: ran {case.dtype} {case.layout}")
    got = decode_attention(q, kc, vc, lens, cache_starts=starts, block_table=table, window=case.window,
                           softcap=case.softcap, sinks=sinks, scale=case.scale,
                           cache_layout="BHSD" if case.layout == "BHSD" else "BSHD", return_lse=case.return_lse)
    out, lse = got if case.return_lse else (got, None)
    assert out.dtype == q.dtype and out.shape == (case.b, case.hq, case.t, case.dv)
    kw = dict(window=case.window, softcap=case.softcap, scale=case.scale)
    want, want_lse = decode_reference(q, k, v, lens, starts, sinks=sinks, **kw)
    low = (None, None) if case.dtype in TOL else decode_reference(q, k, v, lens, starts, sinks=sinks, dtype=q.dtype, **kw)
    check("out", out, want, case.dtype, lowp=low[0])
    if lse is not None:
        check("lse", lse, want_lse, case.dtype, lowp=low[1])


# --- jax_core.attention(): every registered implementation --------------------------------------------


@contextlib.contextmanager
def interpreted_triton():
    """jax_triton replaced by the Triton-interpreter stand-in (the CPU run of flash's GPU path)."""
    import jax_triton_interpret

    saved = sys.modules.get("jax_triton")
    sys.modules["jax_triton"] = jax_triton_interpret.module()
    try:
        yield
    finally:
        if saved is None:
            sys.modules.pop("jax_triton", None)
        else:
            sys.modules["jax_triton"] = saved


def setting_for(impl: str, n_devices: int):
    """(metadata, platform, context) that run `impl` on this CPU machine."""
    if impl == "flash":
        pytest.importorskip("triton")
        return AttentionMetadata(platform="gpu", backend="rocm"), "gpu", interpreted_triton()
    if impl == "ring":
        mesh = Mesh(np.array(jax.devices("cpu")[:n_devices]), ("sp",))
        return AttentionMetadata(mesh=mesh), "cpu", contextlib.nullcontext()
    return AttentionMetadata(), "cpu", contextlib.nullcontext()


JAX_CASES = {  # impl: (CI examples, strategy)
    "vanilla": (5, lambda: flash_cases("vanilla", dtypes=("float32", "float64"))),
    "sdpa": (5, lambda: flash_cases("sdpa", dtypes=("float32",))),
    "decode": (5, lambda: flash_cases("decode", max_l=16)),
    "ring": (3, lambda: flash_cases("ring", max_l=40, max_s=40)),
    "flash": (4, lambda: flash_cases("flash", max_l=40, max_s=40)),
}


def jnp_of(t: Optional[torch.Tensor]):
    return None if t is None else jnp.asarray(t.numpy())


@st.composite
def jax_extras(draw, impl: str):
    """(bias shape name or None, bool mask shape name or None, layout, gradients?) for the jax-level call."""
    maskable = impl in ("vanilla", "sdpa", "flash")
    bias = draw(st.sampled_from((None, "B1LS", "1H1S", "BHLS"))) if maskable else None
    mask = draw(st.sampled_from((None, "LS", "B1LS", "1H1S"))) if maskable else None
    return bias, mask, draw(st.sampled_from(("BTHD", "BHTD"))), draw(st.booleans())


def check_interface(impl: str, data) -> None:
    """jax_core.attention(implementation=impl) in both layouts: output, LSE and (float32/64) gradients of
    q, k, v == the float64 reference, with bias and bool masks where the implementation takes them."""
    case = data.draw(JAX_CASES[impl][1](), label="case")
    bias_shape, mask_shape, layout, want_grads = data.draw(jax_extras(impl), label="bias, mask, layout, grads")
    n_devices = data.draw(st.sampled_from((2, 4)), label="ring devices") if impl == "ring" else 1
    metadata, platform, ctx = setting_for(impl, n_devices)
    with ctx:
        check_against_reference(impl, case, metadata.replace(softmax_scale=case.scale), platform,
                                (bias_shape, mask_shape, layout, want_grads))


def check_against_reference(impl: str, case: FlashCase, metadata, platform: str, extras) -> None:
    """The body of `check_interface`, inside the implementation's context."""
    bias_shape, mask_shape, layout, want_grads = extras
    ours_supports(impl, case.shapes, case.dtype, metadata, platform=platform, bias=bias_shape, mask=mask_shape,
                  **flash_features(case))
    sh, dtype = case.shapes, TORCH_DTYPES[case.dtype]
    g, q, k, v, sinks, ids, seg_mask = flash_inputs(case, dtype)
    bias = None if bias_shape is None else randn(g, *MASK_SHAPES[bias_shape](sh), dtype=dtype)
    mask = None
    if mask_shape is not None:
        mask = torch.rand(MASK_SHAPES[mask_shape](sh), generator=g) < 0.8
    cot = randn(g, sh.b, sh.hq, sh.l, sh.ev)
    grads = want_grads and case.dtype in TOL

    def run(q, k, v):
        to = (lambda x: x) if layout == "BHTD" else (lambda x: jnp.swapaxes(x, 1, 2))
        res = attention(to(q), to(k), to(v), bias=jnp_of(bias), mask=jnp_of(mask), causal=case.causal,
                        causal_alignment=case.alignment, sliding_window=case.window, logits_soft_cap=case.softcap,
                        softmax_aux=jnp_of(sinks), return_lse=case.return_lse, implementation=impl,
                        metadata=metadata, layout=layout,
                        segment_ids=None if ids is None else tuple(jnp_of(x.int()) for x in ids))
        return to(res.attention_outputs), res.lse

    with jax.enable_x64(case.dtype == "float64"):
        qj, kj, vj = (jnp_of(x) for x in (q, k, v))
        if grads:
            (out, lse), vjp = jax.vjp(jax.jit(run), qj, kj, vj)
            dq, dk, dv = vjp((jnp_of(cot.to(dtype)), None if lse is None else jnp.zeros_like(lse)))
        else:
            out, lse = jax.jit(run)(qj, kj, vj)
        assert out.dtype == qj.dtype, f"output dtype {out.dtype} != {qj.dtype}"
    to_t = lambda x: torch.from_numpy(np.asarray(x).astype(np.float64))
    full_mask = seg_mask if mask is None else (mask if seg_mask is None else mask & seg_mask)
    if grads:
        leaves = leaves_of((q, k, v), torch.float64)
        want, want_grads_ = grads_of(lambda q, k, v: flash_reference(case, q, k, v, f64(sinks), full_mask,
                                                                     bias=f64(bias))[0], leaves, cot.double())
        for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), want_grads_):
            check(name, to_t(got), ref, case.dtype, tol=GRAD_TOL)
    want, want_lse = flash_reference(case, q, k, v, f64(sinks), full_mask, bias=f64(bias))
    low = (None, None)
    if case.dtype not in TOL:
        low = flash_reference(case, q, k, v, sinks, full_mask, dtype=dtype, bias=bias)
    check("out", to_t(out), want, case.dtype, lowp=low[0])
    if case.return_lse:
        assert lse is not None, "no LSE returned"
        check("lse", to_t(lse), want_lse, case.dtype, lowp=low[1])


def interface_test(impl: str):
    """One test per implementation, each with its own CI budget."""
    @THOROUGH
    @budget(JAX_CASES[impl][0])
    @given(data=st.data())
    def test(data):
        check_interface(impl, data)

    test.__doc__ = f"jax_core.attention(implementation={impl!r}) == the float64 reference (`check_interface`)."
    return test


test_attention_interface_vanilla = interface_test("vanilla")
test_attention_interface_sdpa = interface_test("sdpa")
test_attention_interface_decode = interface_test("decode")
test_attention_interface_ring = interface_test("ring")
test_attention_interface_flash = interface_test("flash")
