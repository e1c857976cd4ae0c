"""`jaxattn bench`: our implementations against torch's SDPA backends on the current device.

    jaxattn bench --quick                 # small shapes, CPU-friendly (CI smoke test)
    jaxattn bench --full --out docs/bench  # the BENCHMARKS.md run (under 3 minutes on an H100)
    jaxattn bench --models --out docs/bench  # whole Llama models, transformers' sdpa vs jaxattn (bench_models.py)

Sweeps implementations x shapes x dtypes x {forward, forward+backward} x decode shapes. Ours go
through the torch API (`jaxattn.torch_api.scaled_dot_product_attention(implementation=name)`,
`decode_attention` for "decode", "auto" for automatic selection); torch's backends through
`torch.nn.attention.sdpa_kernel` ("torch-math", "torch-efficient", "torch-flash", "torch-cudnn").
A backend that cannot run a call is listed with its reason. Each (shape, dtype, mode) cell draws
fresh random inputs shared by every implementation. Timing rules and FLOP/byte counting:
`jaxattn.bench_timing`. Output: a table on stdout; bench.csv, bench.json, summary.md (Markdown
tables) and PNG plots with error bars in --out (default ./jaxattn-bench). Every time and ratio is
given with the spread of its repeats; rows whose repeats disagree too much to compare are marked
and a closing warning says so (`jaxattn.bench_spread`). From Python, `run_bench(...)` returns the
rows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import warnings
from typing import Callable, Optional, Sequence

from . import bench_models

TORCH_BACKENDS = {  # our name -> torch.nn.attention.SDPBackend member
    "torch-math": "MATH", "torch-efficient": "EFFICIENT_ATTENTION", "torch-flash": "FLASH_ATTENTION",
    "torch-cudnn": "CUDNN_ATTENTION",
}
DTYPE_ALIASES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                 "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
MODES = ("fwd", "fwd+bwd")
#: Implementations that build the full (L, S) score matrix: skipped above `Preset.max_score_gib`.
MATERIALISING = ("vanilla", "torch-math")


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention shape. q: (B, Hq, L, D); k, v: (B, Hkv, S, D).

    Attributes:
        group: "sweep" (sequence-length sweep, plotted), "shape" (other prefill shapes), "small"
            (small calls, latency bars) or "decode" (KV-cache decoding, GB/s).
        decode: a decoding call (one query per sequence against a full cache; forward only).
    """

    group: str
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool
    decode: bool = False

    @property
    def label(self) -> str:
        heads = f"H{self.q_heads}" if self.q_heads == self.kv_heads else f"H{self.q_heads}/{self.kv_heads}"
        kind = "decode" if self.decode else ("causal" if self.causal else "full")
        return f"B{self.batch} {heads} L{self.q_len} S{self.kv_len} D{self.head_dim} {kind}"


@dataclasses.dataclass(frozen=True)
class Preset:
    """A benchmark plan.

    Attributes:
        cases: shapes, in run order.
        dtypes: cases run in dtypes[0]; those of `all_dtype_groups` also in the other dtypes.
        repeats, target_s: timed loops per measurement and wanted seconds per loop.
        max_score_gib: `MATERIALISING` implementations are skipped above this (L, S) fp32 score size.
    """

    name: str
    cases: tuple[Case, ...]
    dtypes: tuple[str, ...]
    all_dtype_groups: tuple[str, ...]
    repeats: int
    target_s: float
    max_score_gib: float


def _sweep(lengths: Sequence[int], tokens: int, heads: int, head_dim: int) -> tuple[Case, ...]:
    return tuple(Case("sweep", max(1, tokens // n), heads, heads, n, n, head_dim, True) for n in lengths)


def preset(name: str, device_type: str) -> Preset:
    """The "quick" (tiny shapes, seconds on a CPU) or "full" (the H100 report) plan for a device."""
    if name == "quick":
        cases = _sweep((64, 128, 256), 256, 2, 32) + (
            Case("small", 1, 4, 4, 128, 128, 64, True),
            Case("decode", 2, 4, 2, 1, 512, 32, False, decode=True),
        )
        dtypes = ("bfloat16",) if device_type == "cuda" else ("float32",)
        return Preset("quick", cases, dtypes, ("sweep",), repeats=5, target_s=0.002, max_score_gib=2.0)
    if name == "full":
        cases = _sweep((512, 1024, 2048, 4096, 8192, 16384), 16384, 16, 128) + (
            Case("shape", 8, 16, 16, 2048, 2048, 128, False),
            Case("shape", 4, 32, 8, 4096, 4096, 128, True),
            Case("small", 1, 4, 4, 128, 128, 64, True),
            Case("small", 1, 32, 8, 1, 4096, 128, False, decode=True),
            Case("decode", 32, 32, 8, 1, 8192, 128, False, decode=True),
            Case("decode", 8, 32, 8, 1, 32768, 128, False, decode=True),
        )
        dtypes = ("bfloat16", "float16") if device_type == "cuda" else ("float32",)
        return Preset("full", cases, dtypes, ("sweep",), repeats=5, target_s=0.02, max_score_gib=2.0)
    raise ValueError(f"preset={name!r}: expected 'quick' or 'full'.")


def our_names() -> list[str]:
    """Our implementation names: the registry's canonical names, and "auto" (automatic selection)."""
    from .jax_core import AttentionRegistry

    names = AttentionRegistry.canonical_names()
    first = [n for n in ("sdpa", "flash", "decode", "vanilla") if n in names]
    return first + [n for n in names if n not in first] + ["auto"]


def all_impl_names() -> list[str]:
    return our_names() + list(TORCH_BACKENDS)


#: Left out by default: "auto" runs one of the others; "ring" needs a device mesh with a sequence
#: axis (multi-device), which a call through the torch API on one device does not have.
NOT_BY_DEFAULT = ("auto", "ring")


def default_impls() -> list[str]:
    """Every implementation but those of `NOT_BY_DEFAULT` (each can still be asked for with --impl)."""
    return [n for n in all_impl_names() if n not in NOT_BY_DEFAULT]


def _check_names(kind: str, values, allowed: Sequence[str], hint: str) -> list[str]:
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"{kind}={values!r}: expected a non-empty list of {sorted(allowed)}; {hint}")
    return values


def normalize_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16' etc.; ValueError naming the choices otherwise."""
    try:
        return DTYPE_ALIASES[str(name).lower()]
    except KeyError:
        raise ValueError(f"dtype={name!r}: expected one of {sorted(set(DTYPE_ALIASES))}.") from None


# ------------------------------------------------------------------------------------------------
# Inputs and calls


def _inputs(case: Case, dtype, mode: str, device: str, seed: int):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    grad = mode == "fwd+bwd"

    def draw(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    q = draw(case.batch, case.q_heads, case.q_len, case.head_dim)
    k = draw(case.batch, case.kv_heads, case.kv_len, case.head_dim)
    v = draw(case.batch, case.kv_heads, case.kv_len, case.head_dim)
    if grad:
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    dout = draw(case.batch, case.q_heads, case.q_len, case.head_dim) if grad else None
    return q, k, v, dout


def _attention_fn(impl: str, case: Case, q, k, v) -> Callable:
    """A no-argument call of `impl` on (q, k, v)."""
    import torch
    import torch.nn.functional as F

    gqa = case.q_heads != case.kv_heads
    if impl in TORCH_BACKENDS:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa)
    from .torch_api import decode_attention, scaled_dot_product_attention

    if impl == "decode":
        lengths = torch.full((case.batch,), case.kv_len, dtype=torch.int32, device=q.device)
        return lambda: decode_attention(q, k, v, lengths, cache_layout="BHSD")
    name = None if impl == "auto" else impl
    return lambda: scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=gqa, implementation=name)


def _timed_fn(impl: str, case: Case, mode: str, inputs) -> Callable:
    import torch

    q, k, v, dout = inputs
    attend = _attention_fn(impl, case, q, k, v)
    if mode == "fwd":
        return attend

    def forward_backward():
        torch.autograd.grad(attend(), (q, k, v), dout)

    return forward_backward


def _context(impl: str, mode: str):
    """no_grad for forward-only (the inference forward), and torch's backend choice."""
    import torch

    stack = contextlib.ExitStack()
    if mode == "fwd":
        stack.enter_context(torch.no_grad())
    if impl in TORCH_BACKENDS:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(getattr(SDPBackend, TORCH_BACKENDS[impl])))
    return stack


def _classify(impl: str, exc: BaseException, caught: list, device: str) -> tuple[str, str]:
    """(status, reason) for a failed measurement: "unsupported" when the backend declined the call."""
    from .bench_report import clip_reason, short_reason
    from .jax_core.registry import ImplementationUnavailableError

    text = " ".join(str(exc).split())
    if isinstance(exc, (ImplementationUnavailableError, NotImplementedError)):
        return "unsupported", clip_reason(text)
    if impl in TORCH_BACKENDS and ("No available kernel" in text or "No viable backend" in text):
        notes = [n for n in (short_reason(w.message) for w in caught) if n]
        if device == "cpu" and impl in ("torch-efficient", "torch-cudnn"):
            notes.insert(0, "CUDA-only backend")
        return "unsupported", clip_reason("; ".join(notes) or text)
    if "out of memory" in text.lower() or "RESOURCE_EXHAUSTED" in text:
        return "error", "out of memory"
    return "error", clip_reason(f"{type(exc).__name__}: {text}")


# ------------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class _Run:
    device: str
    plan: Preset
    deadline: Optional[float]
    max_minutes: Optional[float]


def _score_gib(case: Case) -> float:
    return case.batch * case.q_heads * case.q_len * case.kv_len * 4 / 2**30


def _skip_reason(run: _Run, impl: str, case: Case) -> Optional[str]:
    if run.deadline is not None and time.perf_counter() > run.deadline:
        return f"time budget reached (--max-minutes {run.max_minutes:g})"
    if impl in MATERIALISING and _score_gib(case) > run.plan.max_score_gib:
        return f"builds the {_score_gib(case):.1f} GiB score matrix (limit {run.plan.max_score_gib:g} GiB)"
    return None


@contextlib.contextmanager
def _calling(impl: str, mode: str, caught: list):
    """The context of `impl`'s calls; the warnings they raise are appended to `caught` (for `_classify`)."""
    with warnings.catch_warnings(record=True) as seen, _context(impl, mode):
        warnings.simplefilter("always")
        try:
            yield
        finally:
            caught.extend(seen)


def _failed(run: _Run, row: dict, impl: str, exc: BaseException, caught: list) -> None:
    status, reason = _classify(impl, exc, caught, run.device)
    if run.device == "cuda":
        import torch

        torch.cuda.empty_cache()
    row.update(status=status, reason=reason)


def _measure_cell(run: _Run, impls: Sequence[str], case: Case, dtype: str, mode: str, inputs) -> list[dict]:
    """One row per implementation of a cell.

    Each implementation is first called, warmed up and calibrated on its own (`prepare`); then
    `repeats` rounds run one timed loop of each, the order reversed every other round
    (`round_orders`), so that round r of any two implementations ran back to back and their
    per-round ratio is free of the host's drift between rounds (`jaxattn.bench_spread`).
    """
    from .bench_report import metrics
    from .bench_timing import Clock, Timing, prepare, round_orders

    clock = Clock(run.device)
    rows = {impl: {"impl": impl, "family": "torch" if impl in TORCH_BACKENDS else "ours"} for impl in impls}
    ready = {}  # impl -> (call, first call seconds, calls per loop)
    for impl in impls:
        skip = _skip_reason(run, impl, case)
        if skip is not None:
            rows[impl].update(status="skipped", reason=skip)
            continue
        caught: list = []
        try:
            with _calling(impl, mode, caught):
                fn = _timed_fn(impl, case, mode, inputs)
                ready[impl] = (fn, *prepare(fn, clock, target_s=run.plan.target_s))
        except Exception as exc:  # a backend that cannot run this cell: recorded with its reason
            _failed(run, rows[impl], impl, exc, caught)
    per_call: dict[str, list[float]] = {impl: [] for impl in ready}
    for order in round_orders(ready, run.plan.repeats):
        for impl in order:
            if impl not in per_call:  # failed in an earlier round
                continue
            fn, _, iters = ready[impl]
            caught = []
            try:
                with _calling(impl, mode, caught):
                    per_call[impl].append(clock.loop_seconds(fn, iters) / iters)
            except Exception as exc:
                _failed(run, rows[impl], impl, exc, caught)
                del per_call[impl]
    for impl, times in per_call.items():
        timing = Timing.of_repeats(ready[impl][1], ready[impl][2], times)
        rows[impl].update(status="ok", reason="", **metrics(case, dtype, mode, timing))
    return [rows[impl] for impl in impls]


def _measure_row(run: _Run, impl: str, case: Case, dtype: str, mode: str, inputs) -> dict:
    """One implementation's row, timed alone."""
    return _measure_cell(run, [impl], case, dtype, mode, inputs)[0]


def _cells(plan: Preset, dtypes: Sequence[str], all_dtypes_everywhere: bool, modes: Sequence[str]):
    for i, dtype in enumerate(dtypes):
        for case in plan.cases:
            if i > 0 and not all_dtypes_everywhere and case.group not in plan.all_dtype_groups:
                continue
            for mode in modes:
                if case.decode and mode != "fwd":
                    continue  # decoding is inference: forward only
                yield case, dtype, mode


def _impls_for(case: Case, impls: Sequence[str]) -> list[str]:
    return [n for n in impls if case.decode or n != "decode"]  # decode is a decoding-only API


def _start_runtimes(device: str) -> None:
    """Starts torch's and JAX's device runtimes, so that no first call pays for them."""
    import jax
    import jax.numpy as jnp
    import torch

    (torch.ones(8, device=device) * 2).sum().item()
    jax.block_until_ready(jnp.ones(8) * 2)
    if device == "cuda":  # time the steady native path: its compiled launch programs built first
        from .bridge import triton_program

        if triton_program.enabled():
            triton_program.wait(900)


def run_bench(preset_name: str = "quick", *, impls: Optional[Sequence[str]] = None,
              dtypes: Optional[Sequence[str]] = None, fwd_only: bool = False, device: Optional[str] = None,
              out_dir: Optional[str] = None, plots: bool = True, max_minutes: Optional[float] = None,
              progress: bool = False, print_table: bool = False, repeats: Optional[int] = None) -> list[dict]:
    """Runs the benchmark; returns one dict per (shape, dtype, mode, implementation).

    Args:
        preset_name: "quick" or "full" (`preset`).
        impls: implementation names (`all_impl_names()`); default `default_impls()`.
        dtypes: "bfloat16", "float16", "float32" (or bf16/fp16/fp32); default the preset's. Given
            explicitly, every case runs in every dtype.
        fwd_only: forward only (no forward+backward cells).
        device: "cuda" or "cpu"; default cuda when torch sees a GPU.
        out_dir: writes bench.csv, bench.json, summary.md and PNGs there (after every cell, so an
            interrupted run keeps what it measured).
        plots: write PNG plots (needs matplotlib; without it a note is printed and plots skipped).
        max_minutes: stop measuring after this much wall time (later rows: status "skipped").
        progress: progress bar on stderr.
        print_table: print the results table on stdout at the end, and a warning when some rows
            are unsteady (`jaxattn.bench_spread`).
        repeats: timed rounds per cell (default the preset's); more rounds give steadier medians
            and wider, truer min-max intervals on a loaded machine.

    Returns:
        Rows with the columns of `jaxattn.bench_report.COLUMNS` and the per-repeat times
        "repeat_us". `vs_torch_best` is torch's fastest backend's median time in the same cell over
        this row's (> 1: faster than torch's best); `vs_torch_paired`, `vs_torch_min` and
        `vs_torch_max` are the median, min and max over rounds of the same ratio taken per round.

    Raises:
        ValueError: an unknown preset, implementation, dtype or device, or a bad max_minutes.
    """
    from . import bridge  # noqa: F401  (GPU memory policy before JAX starts)
    import torch

    from .bench_report import Progress, finish_cell, format_table, run_metadata, write_outputs
    from .bench_spread import loaded_warning, mark_unsteady

    impls = _check_names("impls", impls if impls is not None else default_impls(), all_impl_names(),
                         "'auto' is automatic selection, torch-* are torch's SDPA backends.")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda' (cuda needs a GPU torch can see).")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"max_minutes={max_minutes!r}: expected a positive number of minutes or None.")
    plan = preset(preset_name, device)
    if repeats is not None:
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats={repeats!r}: expected a whole number of timed rounds >= 1 (e.g. 9 on a "
                             "loaded machine).")
        plan = dataclasses.replace(plan, repeats=repeats)
    explicit = dtypes is not None
    dtypes = [normalize_dtype(d) for d in dtypes] if explicit else list(plan.dtypes)
    _check_names("dtypes", dtypes, sorted(set(DTYPE_ALIASES.values())), "e.g. --dtype bf16.")
    modes = ("fwd",) if fwd_only else MODES
    start = time.perf_counter()
    run = _Run(device, plan, None if max_minutes is None else start + 60 * max_minutes, max_minutes)
    cells = list(_cells(plan, dtypes, explicit, modes))
    _start_runtimes(device)
    meta = run_metadata(device, plan, impls, dtypes, modes, max_minutes)
    bar = Progress(sum(len(_impls_for(c, impls)) for c, _, _ in cells), enabled=progress)
    rows: list[dict] = []
    for seed, (case, dtype, mode) in enumerate(cells):
        inputs = _inputs(case, getattr(torch, dtype), mode, device, seed)
        cell_impls = _impls_for(case, impls)
        bar.step(f"{dtype} {mode} {case.label} ({', '.join(cell_impls)})", count=len(cell_impls))
        rows += finish_cell(_measure_cell(run, cell_impls, case, dtype, mode, inputs), case, dtype, mode)
        mark_unsteady(rows)
        del inputs
        if out_dir is not None:
            meta["elapsed_s"] = round(time.perf_counter() - start, 1)
            write_outputs(rows, meta, out_dir, plots=False, complete=False)
    bar.close()
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    if print_table:
        print(format_table(rows))
    if out_dir is not None:
        for line in write_outputs(rows, meta, out_dir, plots=plots, complete=True):
            print(line)
    if print_table and loaded_warning(rows, plan.repeats):
        print(loaded_warning(rows, plan.repeats))
    return rows


# ------------------------------------------------------------------------------------------------
# Command line

HELP = "time our implementations against torch's SDPA backends on this device"
#: Where the command line writes its files (plots included) when --out is not given.
DEFAULT_OUT = "jaxattn-bench"


def _impl_arg(value: str) -> str:
    names = all_impl_names()
    if value not in names:
        raise argparse.ArgumentTypeError(f"unknown implementation {value!r}; choose from {', '.join(names)} "
                                         "(repeat --impl for several)")
    return value


def _dtype_arg(value: str) -> str:
    try:
        return normalize_dtype(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _minutes_arg(value: str) -> float:
    try:
        minutes = float(value)
    except ValueError:
        minutes = float("nan")
    if not minutes > 0:
        raise argparse.ArgumentTypeError(f"--max-minutes {value!r}: expected a positive number of minutes")
    return minutes


def _repeats_arg(value: str) -> int:
    try:
        repeats = int(value)
    except ValueError:
        repeats = 0
    if repeats < 1:
        raise argparse.ArgumentTypeError(f"--repeats {value!r}: expected a whole number of rounds >= 1 (e.g. 9)")
    return repeats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the `bench` options to `parser`."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="tiny shapes, seconds on a CPU (the default)")
    size.add_argument("--full", dest="preset", action="store_const", const="full",
                      help="sequence sweep, other shapes, small calls and decode (BENCHMARKS.md)")
    parser.set_defaults(preset="quick")
    parser.add_argument("--impl", action="append", type=_impl_arg, metavar="NAME",
                        help="implementation to run (repeatable): ours (sdpa, flash, decode, vanilla, ring, auto) or "
                             "torch-math, torch-efficient, torch-flash, torch-cudnn; default all but auto and ring")
    parser.add_argument("--dtype", action="append", type=_dtype_arg, metavar="DTYPE",
                        help="bfloat16/bf16, float16/fp16, float32/fp32 (repeatable); default the preset's")
    parser.add_argument("--out", metavar="DIR", help="write bench.csv, bench.json, summary.md and PNG plots here "
                        f"(default ./{DEFAULT_OUT})")
    parser.add_argument("--repeats", type=_repeats_arg, metavar="N",
                        help="timed rounds per cell (default: the preset's, 5); more give steadier "
                             "numbers on a loaded machine")
    parser.add_argument("--no-plots", action="store_true", help="no PNG plots")
    parser.add_argument("--fwd-only", action="store_true", help="forward only (no forward+backward)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--max-minutes", type=_minutes_arg, metavar="M",
                        help="stop measuring after M minutes (later rows are listed as skipped)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--from-json", metavar="FILE", help="measure nothing: re-draw the table, summary.md "
                        "and plots of a previous run's bench.json (into --out, default the file's folder)")
    bench_models.add_arguments(parser)  # --models: whole transformers models (jaxattn/bench_models.py)


def _redraw(path: str, out_dir: Optional[str], plots: bool) -> int:
    from .bench_report import format_table, load_json, write_outputs

    try:
        rows, meta = load_json(path)
    except (OSError, ValueError) as exc:
        print(f"jaxattn bench: error: --from-json {path!r}: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    for line in write_outputs(rows, meta, out_dir or os.path.dirname(os.path.abspath(path)), plots=plots,
                              complete=bool(meta.get("complete"))):
        print(line)
    return 0


def main(args: argparse.Namespace) -> int:
    """Runs `jaxattn bench` with parsed arguments; returns the exit status."""
    if bench_models.wanted(args):
        if args.repeats is not None:
            print("jaxattn bench: error: --repeats is not used with --models (its plan sets the rounds per cell)",
                  file=sys.stderr)
            return 2
        return bench_models.main(args)
    if args.from_json:
        return _redraw(args.from_json, args.out, plots=not args.no_plots)
    try:
        run_bench(args.preset, impls=args.impl, dtypes=args.dtype, fwd_only=args.fwd_only, device=args.device,
                  out_dir=args.out or DEFAULT_OUT, plots=not args.no_plots, max_minutes=args.max_minutes,
                  progress=not args.no_progress, print_table=True, repeats=args.repeats)
    except ValueError as exc:
        print(f"jaxattn bench: error: {exc}", file=sys.stderr)
        return 2
    return 0
