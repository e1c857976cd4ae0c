"""Parity kit: compare torch tensors with JAX arrays, or a torch function with a JAX one.

    >>> from jaxattn.testing import assert_close, compare, compare_callables, compare_to_reference
    >>> report = compare(torch_out, jax_out)            # dtype-aware tolerances, readable report
    >>> print(report)
    output: PASS  shape (2, 8, 97, 80) bfloat16, tolerance atol 1.6e-02 + rtol 1.6e-02 * |expected|
      max |error| 3.9e-03 at (1, 5, 40, 17) (actual 0.5312, expected 0.5352), mean 2.2e-04
      worst error / tolerance 0.17 (1 is the limit); 0.50 eps of bfloat16 at the data's scale
    >>> assert_close(torch_out, jax_out)                 # pytest-friendly: AssertionError with the report
    >>> suite = compare_callables(torch_fn, jax_fn, q, k, v)   # forward and gradients, one report each
    >>> suite.assert_ok()

Inputs may be torch tensors (any device, requires_grad or not), JAX arrays, NumPy arrays or
Python numbers; they are compared in float64 on the host. The tolerance defaults to
`TOLERANCES[dtype]` for the lower of the two precisions. `compare_to_reference` applies the rule
the project's tests use for low precisions: a candidate's error against a high-precision reference
may be at most `factor` times a baseline's error (torch's, in the same dtype) plus a rounding floor.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

#: Machine epsilon of each floating dtype (the distance from 1.0 to the next representable value).
EPS: dict[str, float] = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}

#: Default (atol, rtol) per dtype for two computations of the same result in that dtype: each output
#: is rounded once (up to half an eps) and the sums behind it are ordered differently, so low
#: precisions allow about two eps; float32 allows for the longer accumulations of attention.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
}

_PRECISION_ORDER = ("bfloat16", "float16", "float32", "float64")


def _dtype_name(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return "float64"
    name = str(dtype).replace("torch.", "")
    return {"half": "float16", "float": "float32", "double": "float64"}.get(name, name)


def to_numpy(x: Any) -> tuple[np.ndarray, str]:
    """Any tensor or array as a float64 host array, with the name of its original dtype.

    Args:
        x: torch tensor, JAX array, NumPy array or Python number (any shape).

    Returns:
        (float64 ndarray of x's shape, dtype name such as "bfloat16").
    """
    name = _dtype_name(x)
    if type(x).__module__.startswith("torch"):
        t = x.detach().to("cpu")
        if t.is_complex():
            raise TypeError(f"complex tensors are not supported (got {t.dtype}).")
        return t.double().numpy(), name
    arr = np.asarray(x)
    if arr.dtype.kind == "c":
        raise TypeError(f"complex arrays are not supported (got {arr.dtype}).")
    return arr.astype(np.float64), name


def _lower_precision(a: str, b: str) -> str:
    ranked = [d for d in (a, b) if d in _PRECISION_ORDER]
    if not ranked:
        return "float64"
    return min(ranked, key=_PRECISION_ORDER.index)


def _format_index(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ")" if index else "()"


@dataclasses.dataclass(frozen=True)
class ParityReport:
    """Element-wise comparison of two arrays of the same shape.

    Attributes:
        name: what was compared ("output", "grad[0]", ...).
        shape: the arrays' shape.
        dtype: the dtype whose tolerance applies (the lower precision of the two inputs).
        atol, rtol: element (i) passes when |actual_i - expected_i| <= atol + rtol * |expected_i|.
        max_abs_error, mean_abs_error: over the finite elements.
        worst_index: index of the element with the largest error relative to its tolerance.
        actual_at_worst, expected_at_worst: the two values there.
        worst_ratio: that element's |error| / tolerance (the comparison passes at <= 1).
        eps_at_scale: max_abs_error in eps of `dtype` times max(1, max |expected|).
        num_failing: elements over their tolerance.
        nonfinite_mismatches: positions where one side is NaN/inf and the other is not (or the
            infinities differ).
        passed: num_failing == 0 and nonfinite_mismatches == 0.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    atol: float
    rtol: float
    max_abs_error: float
    mean_abs_error: float
    worst_index: tuple[int, ...]
    actual_at_worst: float
    expected_at_worst: float
    worst_ratio: float
    eps_at_scale: float
    num_failing: int
    nonfinite_mismatches: int
    passed: bool

    def __str__(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        lines = [
            f"{self.name}: {status}  shape {self.shape} {self.dtype}, tolerance atol {self.atol:.1e} + rtol "
            f"{self.rtol:.1e} * |expected|",
            f"  max |error| {self.max_abs_error:.2e} at {_format_index(self.worst_index)} (actual "
            f"{self.actual_at_worst:.6g}, expected {self.expected_at_worst:.6g}), mean {self.mean_abs_error:.2e}",
            f"  worst error / tolerance {self.worst_ratio:.2f} (1 is the limit); {self.eps_at_scale:.2f} eps of "
            f"{self.dtype} at the data's scale",
        ]
        if self.num_failing:
            total = int(np.prod(self.shape)) if self.shape else 1
            lines.append(f"  {self.num_failing} of {total} elements over the tolerance")
        if self.nonfinite_mismatches:
            lines.append(f"  {self.nonfinite_mismatches} positions are NaN/inf on one side only (or differ in sign)")
        return "\n".join(lines)

    def assert_ok(self) -> "ParityReport":
        """Raises AssertionError with the report when the comparison failed; returns self."""
        __tracebackhide__ = True
        if not self.passed:
            raise AssertionError("\n" + str(self))
        return self


def compare(
    actual: Any,
    expected: Any,
    *,
    dtype: Optional[str] = None,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    name: str = "output",
) -> ParityReport:
    """Compares two tensors/arrays element by element with dtype-aware tolerances.

    Args:
        actual: torch tensor, JAX array, NumPy array or number, shape X.
        expected: the same kinds, shape X (no broadcasting: shapes must be equal).
        dtype: dtype name whose `TOLERANCES` entry applies; default the lower precision of the
            two inputs (integer inputs count as float64).
        atol, rtol: override the dtype's tolerance.
        name: label of the report.

    Returns:
        ParityReport (passed or not; call `.assert_ok()` or use `assert_close` to raise).

    Raises:
        ValueError: the shapes differ, or `dtype` has no default tolerance and atol/rtol are not given.
    """
    a, a_dtype = to_numpy(actual)
    e, e_dtype = to_numpy(expected)
    if a.shape != e.shape:
        raise ValueError(f"{name}: actual has shape {a.shape} but expected has shape {e.shape}; compare equal shapes.")
    dtype = dtype or _lower_precision(a_dtype, e_dtype)
    if dtype not in TOLERANCES and (atol is None or rtol is None):
        raise ValueError(f"dtype={dtype!r}: no default tolerance (known: {sorted(TOLERANCES)}); pass atol and rtol.")
    d_atol, d_rtol = TOLERANCES.get(dtype, (0.0, 0.0))
    atol = d_atol if atol is None else float(atol)
    rtol = d_rtol if rtol is None else float(rtol)

    a_fin, e_fin = np.isfinite(a), np.isfinite(e)
    both_nan = np.isnan(a) & np.isnan(e)
    same_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    nonfinite_mismatches = int(np.count_nonzero(~(a_fin & e_fin) & ~both_nan & ~same_inf))
    finite = a_fin & e_fin
    a0, e0 = np.where(finite, a, 0.0), np.where(finite, e, 0.0)
    err = np.abs(a0 - e0)
    tol = atol + rtol * np.abs(e0)
    ratio = np.where(finite, err / np.where(tol > 0, tol, np.inf), 0.0)
    ratio = np.where(finite & (tol == 0) & (err > 0), np.inf, ratio)
    if a.size:
        worst = np.unravel_index(int(np.argmax(ratio)), a.shape) if a.ndim else ()
        worst_ratio = float(ratio[worst]) if a.ndim else float(ratio)
        max_abs = float(err.max())
        mean_abs = float(err[finite].mean()) if finite.any() else 0.0
        scale = max(1.0, float(np.abs(e[finite]).max())) if finite.any() else 1.0
        at_a, at_e = float(a[worst]), float(e[worst])
    else:
        worst, worst_ratio, max_abs, mean_abs, scale, at_a, at_e = (), 0.0, 0.0, 0.0, 1.0, float("nan"), float("nan")
    num_failing = int(np.count_nonzero(ratio > 1.0))
    eps = EPS.get(dtype, EPS["float64"])
    return ParityReport(
        name=name, shape=tuple(a.shape), dtype=dtype, atol=atol, rtol=rtol, max_abs_error=max_abs,
        mean_abs_error=mean_abs, worst_index=tuple(int(i) for i in worst), actual_at_worst=at_a,
        expected_at_worst=at_e, worst_ratio=worst_ratio, eps_at_scale=max_abs / (eps * scale),
        num_failing=num_failing, nonfinite_mismatches=nonfinite_mismatches,
        passed=num_failing == 0 and nonfinite_mismatches == 0,
    )


def assert_close(actual: Any, expected: Any, **kwargs: Any) -> ParityReport:
    """`compare(actual, expected, **kwargs)`, raising AssertionError with the report on failure.

    Keyword arguments are those of `compare` (dtype, atol, rtol, name). Returns the report.
    """
    __tracebackhide__ = True
    return compare(actual, expected, **kwargs).assert_ok()


def _numpy_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes  # a dependency of jax

        return ml_dtypes.bfloat16
    return np.dtype(name)


def rounding_floor(reference: Any, dtype: str) -> float:
    """Twice the largest rounding error of `dtype` near the reference's values shifted by 0.3:
    2 * max |(r + 0.3 - 0.3) - r| with r the reference rounded to `dtype` and each step rounded.

    flash-attn's forward tolerance term: the error that rounding alone causes at the data's
    scale, which keeps the 2x rule meaningful where the baseline's own error is close to 0.

    Args:
        reference: high-precision values, any shape.
        dtype: name of the low precision.
    """
    ref, _ = to_numpy(reference)
    np_dtype = _numpy_dtype(dtype)

    def rounded(v):
        return v.astype(np_dtype).astype(np.float64)

    r = rounded(ref)
    shift = float(rounded(np.float64(0.3)))  # the constant in the dtype, as torch's arithmetic has it
    shifted = rounded(rounded(r + shift) - shift)
    return 2.0 * float(np.abs(shifted - r).max()) if r.size else 0.0


@dataclasses.dataclass(frozen=True)
class ReferenceReport:
    """A candidate's and a baseline's error against one high-precision reference.

    Attributes:
        name: what was compared.
        dtype: the candidate's dtype.
        candidate_error, baseline_error: max |x - reference| over the elements.
        worst_index: where the candidate's error is largest.
        factor, floor: the rule is candidate_error <= factor * baseline_error + floor.
        bound: factor * baseline_error + floor.
        passed: the rule holds and the candidate has no NaN/inf where the reference is finite.
        nonfinite: elements where the candidate is NaN/inf but the reference is finite.
    """

    name: str
    dtype: str
    candidate_error: float
    baseline_error: float
    worst_index: tuple[int, ...]
    factor: float
    floor: float
    bound: float
    nonfinite: int
    passed: bool

    def __str__(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        rel = self.candidate_error / self.baseline_error if self.baseline_error > 0 else float("inf")
        text = (
            f"{self.name}: {status}  {self.dtype}: error {self.candidate_error:.2e} at "
            f"{_format_index(self.worst_index)}, limit {self.factor:g} x baseline {self.baseline_error:.2e} + "
            f"{self.floor:.1e} = {self.bound:.2e} (candidate / baseline {rel:.2f})"
        )
        if self.nonfinite:
            text += f"; {self.nonfinite} NaN/inf elements where the reference is finite"
        return text

    def assert_ok(self) -> "ReferenceReport":
        """Raises AssertionError with the report when the rule failed; returns self."""
        __tracebackhide__ = True
        if not self.passed:
            raise AssertionError("\n" + str(self))
        return self


def compare_to_reference(
    candidate: Any,
    baseline: Any,
    reference: Any,
    *,
    factor: float = 2.0,
    floor: Optional[float] = None,
    name: str = "output",
) -> ReferenceReport:
    """The low-precision rule: candidate's error vs `reference` <= factor * baseline's + floor.

    Typical use: candidate = jaxattn in bfloat16, baseline = torch's SDPA in bfloat16, reference
    = the same computation in float32 or float64.

    Args:
        candidate: tensor/array of shape X (its dtype names the precision).
        baseline: shape X, the established computation in the same dtype.
        reference: shape X, higher precision.
        factor: allowed multiple of the baseline's error (2 in the project's tests).
        floor: additive slack; default `rounding_floor(reference, candidate's dtype)`.
        name: label of the report.

    Raises:
        ValueError: the shapes differ.
    """
    c, c_dtype = to_numpy(candidate)
    b, _ = to_numpy(baseline)
    r, _ = to_numpy(reference)
    if not c.shape == b.shape == r.shape:
        raise ValueError(f"{name}: shapes differ: candidate {c.shape}, baseline {b.shape}, reference {r.shape}.")
    finite_ref = np.isfinite(r)
    nonfinite = int(np.count_nonzero(finite_ref & ~np.isfinite(c)))
    r0 = np.where(finite_ref, r, 0.0)
    c_err = np.abs(np.where(finite_ref & np.isfinite(c), c, r0) - r0)
    b_err = np.abs(np.where(finite_ref & np.isfinite(b), b, r0) - r0)
    if floor is None:
        floor = rounding_floor(np.where(finite_ref, r, 0.0), c_dtype) if c_dtype in EPS else 0.0
    cand = float(c_err.max()) if c.size else 0.0
    base = float(b_err.max()) if b.size else 0.0
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(c_err)), c.shape)) if c.ndim and c.size else ()
    bound = factor * base + floor
    return ReferenceReport(
        name=name, dtype=c_dtype, candidate_error=cand, baseline_error=base, worst_index=worst, factor=float(factor),
        floor=float(floor), bound=bound, nonfinite=nonfinite, passed=cand <= bound and nonfinite == 0,
    )


@dataclasses.dataclass(frozen=True)
class ParitySuite:
    """Several reports (forward and gradients); `passed` when all passed."""

    reports: tuple

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.reports)

    def __getitem__(self, name: str):
        for r in self.reports:
            if r.name == name:
                return r
        raise KeyError(f"{name!r}: reports are {[r.name for r in self.reports]}.")

    def __iter__(self):
        return iter(self.reports)

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.reports)

    def assert_ok(self) -> "ParitySuite":
        """Raises AssertionError listing every report when any failed; returns self."""
        __tracebackhide__ = True
        if not self.passed:
            failed = ", ".join(r.name for r in self.reports if not r.passed)
            raise AssertionError(f"parity failed for {failed}:\n{self}")
        return self


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def compare_callables(
    torch_fn: Callable,
    jax_fn: Callable,
    *inputs: Any,
    grad: bool = True,
    names: Optional[Sequence[str]] = None,
    dtype: Optional[str] = None,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
    seed: int = 0,
) -> ParitySuite:
    """Runs a torch function and a JAX function on the same inputs; compares outputs and gradients.

    Each input is given once (torch tensor, JAX array or NumPy array) and handed to `torch_fn` as a
    torch tensor (on its own device if it was one, else the CPU) and to `jax_fn` as a JAX array
    (default device), with the same values and dtype. Gradients: both functions' vector-Jacobian
    products with the same random cotangents (seeded), with respect to every floating input.

    Args:
        torch_fn: (*torch tensors) -> tensor or tuple of tensors.
        jax_fn: (*JAX arrays) -> array or tuple of arrays of the same shapes.
        *inputs: the arguments, any shapes.
        grad: also compare gradients.
        names: one label per input for the gradient reports (default "0", "1", ...).
        dtype, atol, rtol: as for `compare` (applied to every report).
        seed: seed of the cotangents.

    Returns:
        ParitySuite with reports "output" (or "output[i]") and "grad <name>" per floating input.
    """
    import jax
    import jax.numpy as jnp
    import torch

    if names is not None and len(names) != len(inputs):
        raise ValueError(f"names: {len(names)} labels for {len(inputs)} inputs.")
    # float64 inputs need JAX's x64 mode, switched on only around this comparison
    x64 = any(to_numpy(x)[1] == "float64" for x in inputs)
    with jax.enable_x64(True) if x64 else contextlib.nullcontext():
        labels = list(names) if names is not None else [str(i) for i in range(len(inputs))]
        t_in, j_in, floating = [], [], []
        for i, x in enumerate(inputs):
            arr, name = to_numpy(x)
            device = x.device if isinstance(x, torch.Tensor) else "cpu"
            if name in EPS:
                t_dtype = getattr(torch, name)
                t = torch.from_numpy(arr).to(device=device, dtype=t_dtype).requires_grad_(grad)
                j = jnp.asarray(arr.astype(_numpy_dtype(name)))
                floating.append(i)
            else:
                src = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
                t = torch.from_numpy(np.array(src)).to(device)
                j = jnp.asarray(src)
            t_in.append(t)
            j_in.append(j)
        t_out = _as_tuple(torch_fn(*t_in))
        j_out = _as_tuple(jax_fn(*j_in))
        if len(t_out) != len(j_out):
            raise ValueError(f"torch_fn returned {len(t_out)} outputs but jax_fn {len(j_out)}.")
        single = len(t_out) == 1
        opts = dict(dtype=dtype, atol=atol, rtol=rtol)
        reports = [compare(j, t, name="output" if single else f"output[{n}]", **opts)
                   for n, (t, j) in enumerate(zip(t_out, j_out))]
        if grad and floating:
            rng = np.random.default_rng(seed)
            cots = [rng.standard_normal(tuple(t.shape)) for t in t_out]
            t_cots = [torch.from_numpy(c).to(device=t.device, dtype=t.dtype) for c, t in zip(cots, t_out)]
            t_grads = torch.autograd.grad(t_out, [t_in[i] for i in floating], t_cots, allow_unused=True)

            def jax_of_floats(*xs):
                args = list(j_in)
                for i, x in zip(floating, xs):
                    args[i] = x
                return _as_tuple(jax_fn(*args))

            _, vjp = jax.vjp(jax_of_floats, *[j_in[i] for i in floating])
            j_grads = vjp(tuple(jnp.asarray(c.astype(_numpy_dtype(_dtype_name(j)))) for c, j in zip(cots, j_out)))
            for i, tg, jg in zip(floating, t_grads, j_grads):
                if tg is None:
                    tg = torch.zeros(t_in[i].shape, dtype=t_in[i].dtype)
                reports.append(compare(jg, tg, name=f"grad {labels[i]}", **opts))
        return ParitySuite(tuple(reports))
