"""Flash attention backward Triton kernels (jax_core/kernels/flash_bwd_triton.py) on torch tensors:
compiled on a CUDA machine, under Triton's interpreter on CPU tensors elsewhere.

No forward kernel is involved: out and lse come from the float64 oracle of tests/attention_reference.py
(FLASH_CONTRACT.md's math), and the gradients (dq, dk, dv, dS / dbias, dsinks) are checked against
float64 torch autograd of the same oracle.

Where the kernels run: conftest.py sets TRITON_INTERPRET=1 for the whole session on machines without a
GPU, before anything imports triton; this file never sets it (a file that did would switch every
later @triton.jit kernel of a GPU session to the interpreter). It follows the session: interpreted ->
CPU tensors, else CUDA tensors and the compiled kernels, so the same cases also check the real kernels
on a GPU.
"""

import dataclasses
import os
from typing import Optional

import pytest
import torch

try:
    import triton
except Exception as exc:  # pragma: no cover - depends on the machine
    pytest.skip(f"triton is not importable ({exc!r}): the Triton backward kernels cannot run",
                allow_module_level=True)

from attention_reference import reference as float64_reference  # noqa: E402
from thorough_grid import grid  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRETED:
    DEVICE = "cpu"
    from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

    if not isinstance(triton.language.sum, InterpretedFunction):
        raise RuntimeError(
            "triton was imported (in compiled mode) before TRITON_INTERPRET=1 was set, so its own jit "
            "helpers (tl.sum, ...) cannot run under the interpreter: set TRITON_INTERPRET=1 before "
            "anything imports triton (environment or conftest.py)")
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("no CUDA device and TRITON_INTERPRET is unset (conftest.py sets it where nvidia-smi is "
                "missing): the kernels can run neither compiled nor interpreted", allow_module_level=True)

from jaxattn.jax_core.kernels import flash_bwd_triton as kern  # noqa: E402


NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# the oracle with the kernels' argument names
# ----------------------------------------------------------------------------------------------


def reference(q, k, v, *, bias, mask, sinks, probe, scale, softcap, causal, window, diag):
    """The float64 oracle of the contract's math. `probe` is a zero (B, Hq, L, S) tensor added to the
    bias (after the soft cap), so its gradient is dS (the gradient w.r.t. the logit after softcap and
    bias). `diag` is the kernels' diagonal offset: 0 (top-left) or S - L (bottom-right).

    Returns:
        out (B, Hq, L, Dv); lse (B, Hq, L) with -inf on rows with nothing visible and no sink.
    """
    L, S = q.shape[2], k.shape[2]
    assert diag in (0, S - L), f"diag={diag}: the oracle knows top-left (0) and bottom-right ({S - L}) only"
    return float64_reference(q, k, v, bias=probe if bias is None else bias + probe, mask=mask, sinks=sinks,
                             scale=scale, softcap=softcap, causal=causal, window=window,
                             alignment="bottom_right" if diag else "top_left")


# ----------------------------------------------------------------------------------------------
# test-local launcher
# ----------------------------------------------------------------------------------------------


def launch_backward(q, k, v, out, do, lse, *, bias, mask, scale, softcap, causal, window, diag,
                    write_ds, block_m=16, block_n=16, delta=None, kernels=None):
    """Runs the three backward kernels on q's device (compiled on CUDA, interpreted on the CPU). bias / mask are
    (B, Hq, L, S) views, stride 0 on broadcast dims. Outputs start as NaN so unwritten elements
    show up. Every argument is passed positionally, in the contract's order.

    Args:
        kernels: object with the contract's dK/dV and dQ kernels as attributes (default: this file's
            interpreted copy of the module); lets the same launcher drive other entry points.

    Returns:
        dict with delta, dq, dk, dv and ds (None unless write_ds).
    """
    kernels = kernels or kern
    B, Hq, L, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    block_d, block_dv = triton.next_power_of_2(D), triton.next_power_of_2(Dv)
    if delta is None:
        delta = torch.full((B, Hq, L), float("nan"), dtype=torch.float32, device=dev)
        kernels.flash_bwd_preprocess_kernel[(triton.cdiv(L, block_m), B * Hq)](
            out, do, delta, *out.stride(), *do.stride(), Hq, L, Dv, block_m, block_dv)
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dv = torch.full_like(v, float("nan"))
    ds = (torch.full((B, Hq, L, S), float("nan"), dtype=torch.float32, device=dev) if write_ds
          else torch.zeros(1, device=dev))
    bias_t = bias if bias is not None else q
    mask_t = mask if mask is not None else torch.zeros(1, dtype=torch.int8, device=dev)
    bias_st = tuple(bias.stride()) if bias is not None else (0, 0, 0, 0)
    mask_st = tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)
    scalars = (Hq, Hk, L, S, D, Dv, scale, softcap if softcap is not None else 1.0,
               window[0], window[1], diag)
    flags = (causal, bias is not None, mask is not None, softcap is not None)
    blocks = (block_m, block_n, block_d, block_dv)
    common_strides = (*q.stride(), *k.stride(), *v.stride(), *bias_st, *mask_st, *do.stride())
    kernels.flash_bwd_dkdv_kernel[(triton.cdiv(S, block_n), B * Hk)](
        q, k, v, bias_t, mask_t, do, lse, delta, dk, dv,
        *common_strides, *dk.stride(), *dv.stride(), *scalars, *flags, *blocks)
    kernels.flash_bwd_dq_kernel[(triton.cdiv(L, block_m), B * Hq)](
        q, k, v, bias_t, mask_t, do, lse, delta, dq, ds,
        *common_strides, *dq.stride(), *(ds.stride() if write_ds else (0, 0, 0, 0)), *scalars,
        *flags, write_ds, *blocks)
    return dict(delta=delta, dq=dq, dk=dk, dv=dv, ds=ds if write_ds else None)


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 1
    Hq: int = 2
    Hk: int = 2
    L: int = 37
    S: int = 45
    D: int = 16
    Dv: Optional[int] = None
    causal: bool = False
    bottom_right: bool = False
    window: tuple[int, int] = (-1, -1)
    bias: Optional[str] = None  # None, "full" (B, Hq, L, S), "heads" (1, Hq, 1, S), "batch" (B, 1, L, S)
    bias_neg_inf_row: bool = False  # bias = -inf on a whole row (and on a few scattered elements)
    mask: Optional[str] = None  # None, "full", "batch" (B, 1, L, S); both leave one row fully masked
    sinks: bool = False
    softcap: Optional[float] = None
    dtype: torch.dtype = torch.float32
    layout: str = "BHTD"  # "BTHD": tensors are permuted views with non-contiguous strides
    write_ds: bool = True
    block_m: int = 16
    block_n: int = 16


CASES = {
    "noncausal": Case(B=2),
    "causal_topleft_L<S": Case(L=20, S=45, causal=True),
    "causal_bottomright_L<S": Case(L=20, S=45, causal=True, bottom_right=True),
    "causal_topleft_L>S": Case(L=45, S=20, causal=True),
    # diag_offset = -25: the first 25 rows see nothing (lse = -inf, zero gradients).
    "causal_bottomright_L>S": Case(L=45, S=20, causal=True, bottom_right=True),
    "gqa": Case(B=2, Hq=4, Hk=2, L=33, S=29, causal=True, bottom_right=True),
    "mqa": Case(Hq=4, Hk=1, L=21, S=35),
    "bias_full": Case(bias="full", L=30, S=35),
    "bias_heads_broadcast": Case(B=2, bias="heads", causal=True, L=30, S=35),
    "bias_batch_broadcast": Case(B=2, Hq=4, Hk=2, bias="batch", L=30, S=35),
    # lse = -inf on a row whose keys are all visible but biased to -inf: P must be 0, not NaN.
    "bias_neg_inf_row": Case(bias="full", bias_neg_inf_row=True, L=30, S=35),
    "mask_full_with_empty_row": Case(mask="full", L=30, S=35),
    "mask_broadcast_causal": Case(B=2, mask="batch", causal=True, L=30, S=35),
    "window_left_only_topleft": Case(window=(5, -1), L=40, S=40),
    "window_right_only_bottomright": Case(window=(-1, 3), bottom_right=True, L=20, S=50),
    "window_both_bottomright_L>S": Case(window=(6, 2), bottom_right=True, L=50, S=30),
    "window_causal_mixed_blocks": Case(window=(7, -1), causal=True, L=50, S=50, block_m=32, block_n=16),
    "softcap": Case(softcap=2.0, causal=True, L=30, S=30),
    "softcap_bias": Case(softcap=1.5, bias="full", L=25, S=33),
    "sinks": Case(sinks=True, Hq=4, Hk=2, L=30, S=35),
    "sinks_empty_row": Case(sinks=True, mask="full", L=30, S=35),
    "dv_ne_d": Case(D=16, Dv=32, causal=True, L=30, S=35),
    "d24_non_pow2": Case(D=24, Dv=40, L=30, S=35, write_ds=False),
    "bthd_strides": Case(B=2, Hq=4, Hk=2, layout="BTHD", causal=True, L=30, S=35),
    "fp16": Case(dtype=torch.float16, B=2, Hq=4, Hk=2, causal=True, bias="heads", L=30, S=35),
}


def _make(case: Case, seed: int = 0):
    """Inputs of a case in float64 (B, H, T, D); bias / mask at their broadcast shapes."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hk, L, S, D = case.B, case.Hq, case.Hk, case.L, case.S, case.D
    Dv = case.Dv or D

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * s

    q, k, v = rnd(B, Hq, L, D), rnd(B, Hk, S, D), rnd(B, Hk, S, Dv)
    do = rnd(B, Hq, L, Dv)
    bias = None
    if case.bias is not None:
        shape = {"full": (B, Hq, L, S), "heads": (1, Hq, 1, S), "batch": (B, 1, L, S)}[case.bias]
        bias = rnd(*shape, s=0.5)
        if case.bias_neg_inf_row:
            bias[..., 5, :] = NEG_INF
            bias[..., 7, ::3] = NEG_INF
    mask = None
    if case.mask is not None:
        shape = {"full": (B, Hq, L, S), "batch": (B, 1, L, S)}[case.mask]
        mask = (torch.rand(*shape, generator=g) < 0.7).to(torch.int8)
        mask[..., 3, :] = 0  # a fully masked row
    sinks = rnd(Hq, s=1.0) if case.sinks else None
    return q, k, v, do, bias, mask, sinks


def _to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """Same logical (B, H, T, D) tensor; for BTHD stored as (B, T, H, D) and permuted back."""
    if layout == "BHTD":
        return x.contiguous()
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _check(name, actual, ref, tol, errors=None):
    """max |actual - ref| <= tol * max |ref| (relative to the tensor's scale), and no NaN/inf.

    The scale has a floor of 0.5 (inputs are O(1)): a gradient that cancels to ~0, e.g. a row that
    sees a single key (dS = P (dP - Delta) = 0 up to the rounding of two float32 dot products of
    O(1) terms, 1.9e-6 under Triton 3.9's interpreter), is held to an absolute 5e-6.
    The relative error is recorded in `errors` (a dict) when given."""
    actual = actual.detach().cpu().to(torch.float64)
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = (actual - ref).abs().max().item()
    mag = max(ref.abs().max().item(), 0.5)
    if errors is not None:
        errors[name] = err / mag
    assert err <= tol * mag, f"{name}: max abs err {err:.3g} > {tol} * {mag:.3g}"


def run_case(case: Case, *, device=DEVICE, kernels=None, tol=None, errors=None):
    """Reference vs kernels for one case; raises on a mismatch. Returns (kernel outputs, lse)."""
    q64, k64, v64, do64, bias64, mask, sinks64 = _make(case)
    B, Hq, L, S = case.B, case.Hq, case.L, case.S
    scale = case.D ** -0.5
    diag = S - L if case.bottom_right else 0
    cfg = dict(scale=scale, softcap=case.softcap, causal=case.causal, window=case.window, diag=diag)

    # float64 reference forward and autograd.
    leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
    probe = torch.zeros(B, Hq, L, S, dtype=torch.float64, requires_grad=True)
    bias_leaf = bias64.clone().requires_grad_(True) if bias64 is not None else None
    sinks_leaf = sinks64.clone().requires_grad_(True) if sinks64 is not None else None
    out64, lse64 = reference(*leaves, bias=bias_leaf, mask=mask, sinks=sinks_leaf, probe=probe, **cfg)
    wrt = [*leaves, probe] + [t for t in (bias_leaf, sinks_leaf) if t is not None]
    grads = torch.autograd.grad(out64, wrt, do64)
    ref = dict(zip(("dq", "dk", "dv", "ds"), grads[:4]))
    extra = list(grads[4:])
    ref_dbias = extra.pop(0) if bias_leaf is not None else None
    ref_dsinks = extra.pop(0) if sinks_leaf is not None else None

    # Kernel inputs in the case's dtype and layout; lse float32 with -inf rows kept.
    dt, lay = case.dtype, case.layout
    q, k, v, out, do = (_to_layout(t.detach().to(device, dt), lay) for t in (q64, k64, v64, out64, do64))
    lse = lse64.detach().to(device, torch.float32).contiguous()
    bias = bias64.to(device, torch.float32).expand(B, Hq, L, S) if bias64 is not None else None
    mask_v = mask.to(device).expand(B, Hq, L, S) if mask is not None else None
    got = launch_backward(q, k, v, out, do, lse, bias=bias, mask=mask_v, **cfg, write_ds=case.write_ds,
                          block_m=case.block_m, block_n=case.block_n, kernels=kernels)

    if tol is None:
        tol = 1e-5 if dt == torch.float32 else 2e-2
    delta64 = (do64 * out64.detach()).sum(-1)
    _check("delta", got["delta"], delta64, tol, errors)
    for name in ("dq", "dk", "dv"):
        assert got[name].dtype == dt
        _check(name, got[name], ref[name], tol, errors)
    if case.write_ds:
        _check("ds", got["ds"], ref["ds"], tol, errors)
    if ref_dbias is not None:
        ds = got["ds"].cpu().to(torch.float64)
        dims = tuple(i for i, n in enumerate(bias64.shape) if n == 1)
        dbias = ds.sum(dim=dims, keepdim=True) if dims else ds
        _check("dbias", dbias, ref_dbias, tol, errors)
    if ref_dsinks is not None:
        # The contract's formula (computed outside the kernels) from the kernel's Delta.
        delta = got["delta"].cpu().double()
        dsinks = -(torch.exp(sinks64.view(1, Hq, 1) - lse.cpu().double()) * delta).sum((0, 2))
        _check("dsinks", dsinks, ref_dsinks, tol, errors)
    return {k_: (v_.cpu() if v_ is not None else None) for k_, v_ in got.items()}, lse.cpu()


# ----------------------------------------------------------------------------------------------
# tests
# ----------------------------------------------------------------------------------------------


#: The default run: both causal alignments, GQA, each bias / mask / window / softcap / sinks kind once,
#: head dims, strides and float16; --thorough adds the variants.
CASES_KEPT = ["causal_topleft_L<S", "causal_bottomright_L>S", "gqa", "bias_heads_broadcast", "bias_neg_inf_row",
              "mask_full_with_empty_row", "window_both_bottomright_L>S", "window_causal_mixed_blocks",
              "softcap_bias", "sinks_empty_row", "dv_ne_d", "bthd_strides", "fp16"]


@pytest.mark.parametrize("name", grid(list(CASES), keep=CASES_KEPT))
def test_backward_matches_float64_autograd(name):
    run_case(CASES[name])


def _bounds_cases() -> dict[str, Case]:
    """Small single-head cases whose visibility edges fall on and next to block edges, so that an
    off-by-one in the kernels' loop bounds (skipping a block that holds one visible element)
    shows up as a wrong gradient."""
    modes = {
        "causal": dict(causal=True),
        "w1_": dict(window=(1, -1)),
        "w_1": dict(window=(-1, 1)),
        "w0_0": dict(window=(0, 0)),
        "causal_w16": dict(causal=True, window=(16, -1)),
        "w3_15": dict(window=(3, 15)),
    }
    cases = {}
    for L, S in ((16, 17), (17, 16), (17, 33), (33, 17), (32, 32)):
        for align in ("tl", "br"):
            for mode, kw in modes.items():
                cases[f"L{L}_S{S}_{align}_{mode}"] = Case(
                    Hq=1, Hk=1, L=L, S=S, bottom_right=align == "br", write_ds=True, **kw)
    for name, kw in (("bm32_bn16", dict(block_m=32, block_n=16)), ("bm16_bn32", dict(block_m=16, block_n=32))):
        for mode in ("causal", "w1_", "w_1", "w3_15"):
            cases[f"L33_S47_br_{mode}_{name}"] = Case(Hq=1, Hk=1, L=33, S=47, bottom_right=True,
                                                       **modes[mode], **kw)
    return cases


BOUNDS_CASES = _bounds_cases()
#: The default run: every mode and alignment at L=17, S=33 (edges on both sides of a block), and
#: one case per unequal block shape; --thorough runs the other lengths too.
BOUNDS_KEPT = [n for n in BOUNDS_CASES if n.startswith("L17_S33_")] + ["L33_S47_br_causal_bm32_bn16",
                                                                       "L33_S47_br_w3_15_bm16_bn32"]


@pytest.mark.parametrize("name", grid(list(BOUNDS_CASES), keep=BOUNDS_KEPT))
def test_loop_bounds_at_block_edges(name):
    run_case(BOUNDS_CASES[name])


def test_fully_masked_rows_get_zero_gradients():
    """Rows that see nothing (lse = -inf) give exact zeros in dQ and dS, never NaN."""
    got, lse = run_case(CASES["causal_bottomright_L>S"])
    empty = torch.isinf(lse)
    assert empty.any()
    assert (got["dq"][empty] == 0).all() and (got["ds"][empty] == 0).all()
    got, lse = run_case(CASES["mask_full_with_empty_row"])
    assert torch.isinf(lse[..., 3]).all()
    assert (got["dq"][..., 3, :] == 0).all() and (got["ds"][..., 3, :] == 0).all()


def test_sink_gradient_formula():
    """dsink_h = -sum_{b,i} exp(sink_h - lse_bhi) * Delta_bhi (pure torch; documents the formula)."""
    g = torch.Generator().manual_seed(3)
    B, Hq, Hk, L, S, D = 2, 4, 2, 9, 13, 8
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in
               ((B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D)))
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64, requires_grad=True)
    do = torch.randn(B, Hq, L, D, generator=g, dtype=torch.float64)
    mask = torch.ones(B, Hq, L, S, dtype=torch.int8)
    mask[:, :, 2] = 0  # a row left with the sink alone
    probe = torch.zeros(B, Hq, L, S, dtype=torch.float64)
    out, lse = reference(q, k, v, bias=None, mask=mask, sinks=sinks, probe=probe, scale=D ** -0.5,
                         softcap=None, causal=True, window=(-1, -1), diag=S - L)
    (dsinks_autograd,) = torch.autograd.grad(out, sinks, do)
    delta = (do * out.detach()).sum(-1)
    dsinks = -(torch.exp(sinks.detach().view(1, Hq, 1) - lse.detach()) * delta).sum((0, 2))
    torch.testing.assert_close(dsinks, dsinks_autograd, rtol=1e-10, atol=1e-12)


def test_external_delta_is_used():
    """The main kernels read Delta as given (a caller may fold an LSE cotangent into it)."""
    case = CASES["noncausal"]
    q64, k64, v64, do64, _, _, _ = _make(case)
    scale = case.D ** -0.5
    probe = torch.zeros(case.B, case.Hq, case.L, case.S, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q64, k64, v64)]
    out64, lse64 = reference(*leaves, bias=None, mask=None, sinks=None, probe=probe, scale=scale,
                             softcap=None, causal=False, window=(-1, -1), diag=0)
    dlse = torch.randn(lse64.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    ref = torch.autograd.grad((out64, lse64), leaves, (do64, dlse))
    delta = ((do64 * out64.detach()).sum(-1) - dlse).to(DEVICE, torch.float32).contiguous()
    q, k, v, out, do = (t.detach().to(DEVICE, torch.float32).contiguous() for t in (q64, k64, v64, out64, do64))
    got = launch_backward(q, k, v, out, do, lse64.detach().to(DEVICE, torch.float32).contiguous(), bias=None, mask=None,
                          scale=scale, softcap=None, causal=False, window=(-1, -1), diag=0,
                          write_ds=False, delta=delta)
    for name, r in zip(("dq", "dk", "dv"), ref):
        _check(name, got[name], r, 1e-5)
