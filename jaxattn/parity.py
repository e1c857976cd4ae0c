"""`jaxattn parity`: every implementation x dtype x a few shapes against torch, on this machine's device.

For each case the inputs are drawn in float32 and rounded to the dtype; then

    reference   torch's SDPA in float64 on the rounded inputs (the oracle)
    baseline    torch's SDPA in the dtype (whatever backend torch picks on the device)
    candidate   jaxattn's drop-in in the dtype, with one implementation forced

and the candidate's max error against the reference, for the output and for the gradients of q,
k and v (one random cotangent), must be at most 2x the baseline's plus a rounding floor
(`jaxattn.testing.compare_to_reference`). Implementations that declare they cannot run a case are
listed with their reasons; gradients are skipped where an implementation declares no backward.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from .testing import ReferenceReport, compare_to_reference


@dataclasses.dataclass(frozen=True)
class ParityCase:
    """One attention call: (B, Hq, L, E) queries, (B, Hk, S, E) keys and values."""

    name: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    bool_mask: bool = False

    def describe(self) -> str:
        heads = f"{self.q_heads}" if self.q_heads == self.kv_heads else f"{self.q_heads}/{self.kv_heads}"
        return f"{self.name} B{self.batch} H{heads} L{self.q_len} S{self.kv_len} E{self.head_dim}"


#: Shape sets: "default" for a real run, "small" for a quick check (CPU tests).
CASES: dict[str, tuple[ParityCase, ...]] = {
    "default": (
        ParityCase("causal", 2, 8, 8, 1024, 1024, 128, causal=True),
        ParityCase("gqa+mask", 2, 8, 2, 97, 1025, 80, bool_mask=True),
        ParityCase("decode", 4, 16, 4, 1, 2048, 128),
    ),
    "small": (
        ParityCase("causal", 1, 2, 2, 33, 33, 16, causal=True),
        ParityCase("gqa+mask", 1, 4, 2, 17, 40, 24, bool_mask=True),
        ParityCase("decode", 2, 4, 2, 1, 50, 16),
    ),
}

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ParityRow:
    """The result for one implementation x dtype x case.

    Attributes:
        status: "PASS", "FAIL", "n/a" (the implementation declares it cannot run the case) or
            "ERROR" (it raised).
        forward: the output's report (None unless it ran).
        gradients: one report per gradient (q, k, v); empty when not run.
        note: reasons (n/a), the exception (ERROR), or why gradients were skipped.
    """

    implementation: str
    dtype: str
    case: ParityCase
    status: str
    forward: Optional[ReferenceReport] = None
    gradients: tuple = ()
    note: str = ""
    seconds: float = 0.0


def _device():
    import torch

    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _reasons(name: str, case: ParityCase, dtype: str, device) -> tuple[list[str], bool]:
    """(reasons it cannot run the forward, whether it declares a backward for this case)."""
    from .jax_core import AttentionInputs, AttentionRegistry, backend_of

    platform = "gpu" if device.type == "cuda" else "cpu"
    features = {"causal"} if case.causal else set()
    if case.bool_mask:
        features.add("bool_mask")
    if case.q_heads != case.kv_heads:
        features.add("gqa")
    args = (case.batch, case.q_len, case.kv_len, case.q_heads, case.kv_heads, case.head_dim, case.head_dim, dtype,
            platform, backend_of(platform))
    impl = AttentionRegistry.get(name)
    forward = impl.not_supported_reasons(AttentionInputs(*args, frozenset(features)))
    backward = not impl.not_supported_reasons(AttentionInputs(*args, frozenset(features | {"backward"})))
    return forward, backward


def _inputs(case: ParityCase, dtype, device, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    b, hq, hk, l, s, e = case.batch, case.q_heads, case.kv_heads, case.q_len, case.kv_len, case.head_dim
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((b, hq, l, e), (b, hk, s, e), (b, hk, s, e)))
    cot = torch.randn(b, hq, l, e, generator=g)
    mask = torch.rand(b, 1, l, s, generator=g) < 0.7 if case.bool_mask else None
    q, k, v, cot = (x.to(device=device, dtype=dtype) for x in (q, k, v, cot))
    return q, k, v, cot, None if mask is None else mask.to(device)


def _run(fn, q, k, v, cot, grad: bool):
    import torch

    q, k, v = (x.detach().clone().requires_grad_(grad) for x in (q, k, v))
    out = fn(q, k, v)
    if not grad:
        return out.detach(), ()
    grads = torch.autograd.grad(out, (q, k, v), cot.to(out.dtype))
    return out.detach(), grads


def run_case(name: str, dtype: str, case: ParityCase, *, grad: bool = True, seed: int = 0) -> ParityRow:
    """Runs one implementation on one case in one dtype against torch (see the module docstring)."""
    import torch

    from .torch_api import scaled_dot_product_attention
    from .torch_api.patch import TORCH_SDPA  # torch's own function, even while patch_sdpa is active

    device = _device()
    reasons, has_backward = _reasons(name, case, dtype, device)
    if reasons:
        return ParityRow(name, dtype, case, "n/a", note="; ".join(reasons))
    t_dtype = getattr(torch, dtype)
    q, k, v, cot, mask = _inputs(case, t_dtype, device, seed)
    gqa = case.q_heads != case.kv_heads
    kwargs = dict(attn_mask=mask, is_causal=case.causal, enable_gqa=gqa)
    do_grad = grad and has_backward
    note = "" if do_grad or not grad else "no backward declared"
    start = time.perf_counter()
    try:
        ref_out, ref_grads = _run(lambda a, b, c: TORCH_SDPA(a, b, c, **kwargs),
                                  *(x.double() for x in (q, k, v, cot)), grad=do_grad)
        base_out, base_grads = _run(lambda a, b, c: TORCH_SDPA(a, b, c, **kwargs),
                                    q, k, v, cot, grad=do_grad)
        cand_out, cand_grads = _run(
            lambda a, b, c: scaled_dot_product_attention(a, b, c, implementation=name, **kwargs), q, k, v, cot,
            grad=do_grad)
    except Exception as exc:  # one broken implementation must not hide the others' rows
        return ParityRow(name, dtype, case, "ERROR", note=f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
                         seconds=time.perf_counter() - start)
    forward = compare_to_reference(cand_out, base_out, ref_out, name="output")
    gradients = tuple(
        compare_to_reference(c, b, r, name=f"grad {n}")
        for n, c, b, r in zip("qkv", cand_grads, base_grads, ref_grads)
    )
    passed = forward.passed and all(r.passed for r in gradients)
    return ParityRow(name, dtype, case, "PASS" if passed else "FAIL", forward, gradients, note,
                     time.perf_counter() - start)


def run_parity(
    implementations: Optional[Sequence[str]] = None,
    dtypes: Sequence[str] = DTYPES,
    shapes: str = "default",
    *,
    grad: bool = True,
    seed: int = 0,
) -> list[ParityRow]:
    """Every implementation x dtype x case of `CASES[shapes]` on this machine's device.

    Args:
        implementations: registered names; default every registered implementation.
        dtypes: dtype names from `DTYPES`.
        shapes: a key of `CASES`.
        grad: also compare the gradients of q, k and v.
        seed: seed of the inputs.

    Returns:
        One ParityRow per combination, in that order.
    """
    from .jax_core import AttentionRegistry

    if shapes not in CASES:
        raise ValueError(f"shapes={shapes!r}: expected one of {sorted(CASES)}.")
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ValueError(f"dtypes: {dtype!r} is not one of {DTYPES}.")
    names = list(implementations) if implementations else AttentionRegistry.canonical_names()
    for name in names:
        AttentionRegistry.get(name)  # unknown names raise, listing the registered ones
    return [run_case(n, d, c, grad=grad, seed=seed) for n in names for d in dtypes for c in CASES[shapes]]


def _ratio(report: Optional[ReferenceReport]) -> str:
    if report is None:
        return "-"
    return f"{report.candidate_error:.1e} / {report.baseline_error:.1e}"


def _worst_grad(row: ParityRow) -> Optional[ReferenceReport]:
    if not row.gradients:
        return None
    return max(row.gradients, key=lambda r: r.candidate_error / r.bound if r.bound > 0 else float("inf"))


def format_table(rows: Sequence[ParityRow]) -> str:
    """A text table: implementation, dtype, case, forward and worst-gradient errors (ours / torch's), status."""
    header = ("implementation", "dtype", "case", "fwd err (jaxattn / torch)", "grad err (jaxattn / torch)", "result")
    lines = [header]
    for row in rows:
        worst = _worst_grad(row)
        grad = _ratio(worst) + (f" [{worst.name}]" if worst is not None else "")
        result = row.status + (f": {row.note}" if row.note else "")
        lines.append((row.implementation, row.dtype, row.case.describe(), _ratio(row.forward), grad, result))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths)) + "  " + line[-1])
        if n == 0:
            out.append("  ".join("-" * w for w in widths) + "  " + "-" * len(header[-1]))
    return "\n".join(out)


def add_arguments(parser) -> None:
    """The options of `jaxattn parity`."""
    parser.add_argument("--implementations", nargs="+", metavar="NAME", default=None,
                        help="registered implementations to test (default: all)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="dtypes to test")
    parser.add_argument("--shapes", choices=sorted(CASES), default="default",
                        help="'default' (realistic sizes) or 'small' (a quick check)")
    parser.add_argument("--no-grad", action="store_true", help="compare forward outputs only")


def main(implementations: Optional[Sequence[str]], dtypes: Sequence[str], shapes: str, grad: bool) -> int:
    """Prints the device, the rule and the table; returns 1 when any row failed or raised, else 0."""
    import torch

    device = _device()
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"jaxattn parity on {device.type} ({label}), torch {torch.__version__}")
    print("rule: max |error| vs torch float64 <= 2 x torch's same-dtype error + rounding floor "
          "(forward, and the gradients of q, k, v)")
    rows = run_parity(implementations, dtypes, shapes, grad=grad)
    print(format_table(rows))
    failed = [r for r in rows if r.status in ("FAIL", "ERROR")]
    ran = sum(r.status in ("PASS", "FAIL") for r in rows)
    print(f"{ran - sum(r.status == 'FAIL' for r in rows)} of {ran} ran and passed; "
          f"{sum(r.status == 'n/a' for r in rows)} not applicable; {sum(r.status == 'ERROR' for r in rows)} errors")
    for row in failed:
        if row.status == "FAIL":
            print(f"\n{row.implementation} {row.dtype} {row.case.describe()}:")
            for report in (row.forward, *row.gradients):
                print(f"  {report}")
    return 1 if failed else 0
