"""The Hopper kernels (Pallas Mosaic GPU forward and backward) through the torch drop-in, against the
same drop-in on the Triton kernels and torch's own SDPA backends (cuDNN, flash), in one process.

    python benchmarks/hopper_torch_gpu.py [--out hopper_torch.json] [--quick | --targets | --head-dim-64 | --features]
                                          [--edges | --backward-step | --head-dim-256]
                                          [--rows 'jaxattn hopper,torch cudnn']
                                          [--rounds 3]

Rows, causal bf16 at head dim 128 unless noted, each timed forward only (no grad) and forward +
backward (autograd.grad of the output against a fixed cotangent):
    * "jaxattn hopper": `scaled_dot_product_attention` under `sdpa_launcher("native")`, with the Hopper
      kernels at every shape `torch_api.hopper_flash.hopper_reasons` accepts (its length thresholds,
      which these rows set, off);
    * "jaxattn triton": the same call with the Hopper kernels switched off (the Triton kernels);
    * "torch cudnn" / "torch flash": F.scaled_dot_product_attention under `sdpa_kernel`;
    * "jaxattn hopper padded" and "jaxattn hopper in place" (`--edges`): "jaxattn hopper" with
      `calls.HOPPER_TMA_EDGES` off and on: lengths that are not whole kernel tiles copied into
      zero-padded tiles, or (whole 8-row TMA tiles) read in place. "jaxattn hopper" takes the
      library's setting (on).
Then head dim 64, GQA at head dim 64, and lengths that are not whole tiles. And the feature costs at
(2,16,8192,128): the forward kernel with a soft cap, sinks, or a causal window covering every key,
against the plain causal kernel (as_torch_kernel directly); forward + backward through `hopper_flash`
with a soft cap or windows; each cost paired with the plain call round by round (`feature_costs`).
`--head-dim-256` times the forward alone at head dim 256 (the Hopper kernels have no backward there).
`--backward-step` times a training step's parts at the target shapes instead: the forward with gradients
and the backward step alone, ours against cuDNN, and our backward step on the Python path split into
its operands pass, kernel and results pass (CUDA events around each), with what lies outside them.

Timing: `gpu_timing.time_torch` (back-to-back calls between CUDA events, median of repeats), the rows
of a shape timed in turn, `--rounds` times; each row reports the median of its rounds, and the
Hopper row its ratio to cuDNN round by round (median and range), which a drift of the GPU's clock
over the run moves far less than the ratio of two medians (the "in place" row likewise).
TFLOP/s: forward 4*B*H*L*S*D (halved for causal), forward + backward 3.5x that. Each row's output
is checked against torch's math on float32 copies first (max abs error, flagged above 3e-2).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Optional
from unittest import mock

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import jax
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import time_torch, write_report
from jaxattn.bridge import triton_program
from jaxattn.jax_core import calls
from jaxattn.torch_api import hopper_flash, hopper_program, scaled_dot_product_attention, sdpa_launcher

SHAPES = [(1, 16, 16384, 128), (2, 16, 8192, 128), (2, 16, 4096, 128), (4, 16, 2048, 128), (8, 16, 1024, 128)]
# Head dim 64 (the target shapes among them), GQA at head dim 64 as (B, Hq, Hk, L, D) (model B
# of the model benchmark: 32 query heads, 8 KV heads); and lengths that are not whole tiles (one
# padded copy).
SHAPES_64 = [(1, 16, 16384, 64), (1, 16, 8192, 64), (4, 16, 4096, 64), (16, 16, 1024, 64)]
GQA_SHAPES_64 = [(2, 32, 8, 4096, 64), (1, 32, 8, 8192, 64)]
EDGE_SHAPES = [(2, 16, 8000, 128), (1, 16, 8000, 64), (4, 16, 2056, 128)]
FEATURE_SHAPE = (2, 16, 8192, 128)
# Head dim 256, forward only: lengths from 1k to 16k, and Gemma 2 9B's 16 query / 8 KV heads.
SHAPES_256 = [(1, 8, 16384, 256), (2, 8, 8192, 256), (4, 8, 4096, 256), (8, 8, 2048, 256), (16, 8, 1024, 256),
              (2, 16, 8, 4096, 256)]


# Head dim 256 with gradients: model D's calls (8 query / 4 KV heads at 4096 and 8192 tokens), and
# lengths from 1k to 8k.
SHAPES_256_TRAIN = [(2, 8, 4, 4096, 256), (1, 8, 4, 8192, 256), (2, 8, 8192, 256), (4, 8, 4096, 256),
                    (16, 8, 1024, 256)]


def flops(b, h, l, d, causal):
    return 4 * b * h * l * l * d / (2 if causal else 1)


def drop_in(hopper: bool, tma_edges: Optional[bool] = None):
    """The drop-in with the Hopper kernels at every eligible shape (or none); `tma_edges` None keeps
    `calls.HOPPER_TMA_EDGES` as the library sets it."""
    def run(q, k, v, causal):
        gqa = q.shape[1] != k.shape[1]
        saved = dict(hopper_flash.HOPPER_MIN_LENGTH), hopper_flash.HOPPER_MIN_LENGTH_PROGRAM, calls.HOPPER_TMA_EDGES
        calls.HOPPER_TMA_EDGES = saved[2] if tma_edges is None else tma_edges
        # "hopper": every eligible shape (no length threshold); "triton": none.
        hopper_flash.HOPPER_MIN_LENGTH.update(forward=0 if hopper else math.inf, train=0 if hopper else math.inf)
        hopper_flash.HOPPER_MIN_LENGTH_PROGRAM = {kind: {} for kind in saved[1]}  # the lengths above decide
        try:
            with sdpa_launcher("native"):
                return scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        finally:
            hopper_flash.HOPPER_MIN_LENGTH.update(saved[0])
            hopper_flash.HOPPER_MIN_LENGTH_PROGRAM = saved[1]
            calls.HOPPER_TMA_EDGES = saved[2]
    return run


def torch_backend(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    return run


ROWS = {"jaxattn hopper": drop_in(True), "jaxattn triton": drop_in(False),
        "torch cudnn": torch_backend(SDPBackend.CUDNN_ATTENTION),
        "torch flash": torch_backend(SDPBackend.FLASH_ATTENTION),
        "jaxattn hopper padded": drop_in(True, tma_edges=False),
        "jaxattn hopper in place": drop_in(True, tma_edges=True)}
#: The rows timed unless --rows says otherwise ("padded" and "in place" differ only at lengths that
#: are not whole tiles: `--edges`).
DEFAULT_ROWS = ("jaxattn hopper", "jaxattn triton", "torch cudnn", "torch flash")


def measure(shape, causal, dtype, rows, *, names=tuple(ROWS), rounds=3, train_too=True):
    """One shape, (B, H, L, D) or with GQA (B, Hq, Hk, L, D), through the rows `names`. The rows are
    timed in turn, `rounds` times (so that a drift of the GPU's clock over the run lands on every
    row alike); each row reports its median, and "jaxattn hopper" its per-round ratios to "torch
    cudnn" (paired: the two timed back to back). `train_too` False: the forward alone."""
    b, h, hk, l, d = shape if len(shape) == 5 else (*shape[:2], *shape[1:])
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, cot = (torch.randn(b, heads, l, d, generator=gen, device="cuda", dtype=dtype) for heads in (h, hk, hk, h))
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    with torch.no_grad():
        want = F.scaled_dot_product_attention(q[:1].float(), k[:1].float(), v[:1].float(), is_causal=causal,
                                              enable_gqa=h != hk)
    found, timers = {}, {}
    for name in names:
        fn = ROWS[name]
        row = found[name] = dict(shape=list(shape), causal=causal, dtype=str(dtype).split(".")[-1], row=name,
                                 fwd_rounds=[], **(dict(fwd_bwd_rounds=[]) if train_too else {}))
        try:
            with torch.no_grad():
                row["max_abs_err"] = (fn(q, k, v, causal)[:1].float() - want).abs().max().item()

            def forward(fn=fn):
                with torch.no_grad():
                    return fn(q, k, v, causal)

            def train(fn=fn):
                out = fn(*leaves, causal)
                torch.autograd.grad(out, leaves, cot)
            timers[name] = forward, train
        except Exception as exc:  # noqa: BLE001 - report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    for _ in range(rounds):
        for name, (forward, train) in timers.items():
            found[name]["fwd_rounds"].append(round(time_torch(forward, iters=10, repeats=3), 1))
            if train_too:
                found[name]["fwd_bwd_rounds"].append(round(time_torch(train, iters=5, repeats=3), 1))
    f = flops(b, h, l, d, causal)
    keys = ("fwd", "fwd_bwd") if train_too else ("fwd",)
    for name, row in found.items():
        if "error" not in row:
            row["fwd_us"] = statistics.median(row["fwd_rounds"])
            row["fwd_tflops"] = f / row["fwd_us"] / 1e6
            if train_too:
                row["fwd_bwd_us"] = statistics.median(row["fwd_bwd_rounds"])
                row["fwd_bwd_tflops"] = 3.5 * f / row["fwd_bwd_us"] / 1e6
        rows.append(row)
        print(format_row(row), flush=True)
    theirs = found.get("torch cudnn")
    for name in ("jaxattn hopper", "jaxattn hopper padded", "jaxattn hopper in place"):
        ours = found.get(name)
        if not (ours and theirs and "error" not in ours and "error" not in theirs):
            continue
        for key in keys:
            ratios = sorted(t / o for o, t in zip(ours[f"{key}_rounds"], theirs[f"{key}_rounds"]))
            ours[f"{key}_vs_cudnn"] = dict(median=statistics.median(ratios), low=ratios[0], high=ratios[-1])
        print(f"{'':20} {name[len('jaxattn '):]} / cudnn, paired by round: " + " | ".join(
            f"{key.replace('_', '+')} {ours[f'{key}_vs_cudnn']['median']:.2f}x [{ours[f'{key}_vs_cudnn']['low']:.2f}, "
            f"{ours[f'{key}_vs_cudnn']['high']:.2f}]" for key in keys), flush=True)


def feature_costs(rows, rounds):
    """The forward kernel with each feature against the plain causal kernel (as_torch_kernel directly),
    and forward + backward through `hopper_flash`, `rounds` times: each round times every variant with
    the plain call, the order reversed every other round and the GPU rested before each row, so that
    neither clock drift nor the order favours one; a cost is the median over rounds of the variant's
    time over the plain call's of the same round."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles
    from jaxattn.jax_core.kernels.flash_plan import FlashConfig

    b, h, l, d = FEATURE_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, l, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    # The compiled programs' extension builds in the background on first use: a timing taken while the
    # compiler holds the CPU measures the build (16.7 ms per forward + backward once, against 3.8).
    triton_program.wait(600)
    sinks = torch.randn(h, generator=gen, device="cuda", dtype=torch.float32)
    programs = hopper_flash.forward_programs(q.device)  # the persistent grid, as the torch launch runs it
    forward = {}
    for name, (kw, extra) in {"plain causal": (dict(), ()), "soft cap 30": (dict(softcap=30.0), ()),
                              "sinks": (dict(), (sinks,)), f"window ({l}, 0)": (dict(window=(l, 0)), ())}.items():
        def fn(q, k, v, *s, kw=kw):
            return flash_forward_mgpu_tiles(q, k, v, scale=d ** -0.5, causal=True, sinks=s[0] if s else None,
                                            programs=programs, **kw)
        kernel = plgpu.as_torch_kernel(fn)
        forward[f"hopper forward, {name}"] = lambda kernel=kernel, extra=extra: kernel(q, k, v, *extra)

    leaves = [torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
              for _ in range(3)]
    cot = torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    train = {}
    for name, kw in {"plain causal": dict(), "soft cap 30": dict(softcap=30.0), f"window ({l}, 0)": dict(window=(l, 0)),
                     "window (1024, 0)": dict(window=(1024, 0))}.items():
        def step(cfg=FlashConfig(scale=d ** -0.5, causal=True, **kw)):
            out = hopper_flash.hopper_flash(*leaves, cfg, grad=True)
            torch.autograd.grad(out, leaves, cot)
        train[f"hopper fwd+bwd, {name}"] = step

    for calls_, key in ((train, "fwd_bwd_us"), (forward, "fwd_us")):
        names = list(calls_)
        times = {name: [] for name in names}
        for rnd in range(rounds):
            for name in (names if rnd % 2 == 0 else names[::-1]):
                time.sleep(1.0)  # each row starts from a rested GPU
                times[name].append(time_torch(calls_[name], iters=10 if key == "fwd_us" else 5))
        plain = times[names[0]]
        for name in names:
            costs = [t / p - 1 for t, p in zip(times[name], plain)]
            us = statistics.median(times[name])
            row = dict(shape=[b, h, l, d], row=name, cost=statistics.median(costs),
                       cost_range=[min(costs), max(costs)], rounds_us=[round(t, 1) for t in times[name]])
            row[key] = us
            if key == "fwd_us":
                row["fwd_tflops"] = flops(b, h, l, d, True) / us / 1e6
            rows.append(row)
            print(f"{str(tuple(row['shape'])):20} {name:36} {us:9.1f} us  {100 * row['cost']:+.1f}% "
                  f"[{100 * min(costs):+.1f}, {100 * max(costs):+.1f}]", flush=True)


class _Spans:
    """CUDA events around calls of the named functions of `module` while entered (the Python path's
    pieces of a step): per name, the mean time from the call's first launch to its last, µs. The
    events are recorded on the stream without a synchronisation, so back-to-back steps keep the GPU
    queued and a span reads GPU time."""

    def __init__(self, module, names):
        self.module, self.names, self.events = module, names, {name: [] for name in names}

    def __enter__(self):
        self.saved = {name: getattr(self.module, name) for name in self.names}
        for name, fn in self.saved.items():
            setattr(self.module, name, self._timed(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.module, name, fn)

    def _timed(self, name, fn):
        def call(*args, **kwargs):  # forwards every argument as given
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args, **kwargs)
            end.record()
            self.events[name].append((start, end))
            return result
        return call

    def mean_us(self):
        torch.cuda.synchronize()
        return {name: statistics.mean(a.elapsed_time(b) * 1e3 for a, b in pairs) if pairs else float("nan")
                for name, pairs in self.events.items()}


#: The Python path's pieces of the Hopper backward step (`hopper_flash.hopper_backward`).
BACKWARD_PIECES = ("backward_operands", "_BACKWARD", "backward_results")


def backward_step(shape, rows, rounds):
    """A training step's parts alone, causal bf16, ours (both Hopper kernels) against cuDNN: the forward
    with gradients (its graph kept, no backward) and the backward step (`autograd.grad` of a kept
    forward, `retain_graph`), timed in turn `rounds` times; then our backward step on the Python path
    (compiled programs off), split into its operands pass, kernel and results pass by CUDA events."""
    b, h, l, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
              for _ in range(3)]
    cot = torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    parts = {}
    for name in ("jaxattn hopper", "torch cudnn"):
        fn = ROWS[name]
        torch.autograd.grad(fn(*leaves, True), leaves, cot)  # settles the signature's program
        out = fn(*leaves, True)  # a graph of the settled path (ours: the compiled program's node)
        torch.autograd.grad(out, leaves, cot, retain_graph=True)
        parts[name] = (lambda fn=fn: fn(*leaves, True),
                       lambda out=out: torch.autograd.grad(out, leaves, cot, retain_graph=True))
    times = {name: ([], []) for name in parts}
    for _ in range(rounds):
        for name, (forward, step) in parts.items():
            times[name][0].append(time_torch(forward, iters=10, repeats=3))
            times[name][1].append(time_torch(step, iters=5, repeats=3))
    for name, (forward, step) in times.items():
        row = dict(shape=list(shape), row=f"{name}, step parts", fwd_with_grad_us=statistics.median(forward),
                   bwd_step_us=statistics.median(step), fwd_rounds=forward, bwd_rounds=step)
        rows.append(row)
        print(f"{str(tuple(shape)):20} {name:15} forward with grad {row['fwd_with_grad_us']:9.1f} us | backward step "
              f"{row['bwd_step_us']:9.1f} us", flush=True)
    # The Python path: a fresh signature (its settled program dropped) with the programs switched off.
    saved_programs = dict(hopper_program._PROGRAMS)
    hopper_program._PROGRAMS.clear()
    try:
        with mock.patch.dict(os.environ, {triton_program.ENV_SWITCH: "0"}):
            out = ROWS["jaxattn hopper"](*leaves, True)

            def python_step():
                torch.autograd.grad(out, leaves, cot, retain_graph=True)
            python_step()
            whole = time_torch(python_step, iters=5, repeats=3)
            with _Spans(hopper_flash, BACKWARD_PIECES) as spans:
                for _ in range(10):
                    python_step()
            pieces = spans.mean_us()
    finally:
        hopper_program._PROGRAMS.clear()
        hopper_program._PROGRAMS.update(saved_programs)
    row = dict(shape=list(shape), row="jaxattn hopper, Python path backward step", bwd_step_us=whole,
               pieces_us={"operands pass": pieces["backward_operands"], "kernel": pieces["_BACKWARD"],
                          "results pass": pieces["backward_results"]})
    row["outside_pieces_us"] = whole - sum(row["pieces_us"].values())
    rows.append(row)
    print(f"{str(tuple(shape)):20} Python path backward step {whole:9.1f} us: " + ", ".join(
        f"{k} {v:.1f}" for k, v in row["pieces_us"].items()) + f", outside them {row['outside_pieces_us']:.1f} us",
          flush=True)


def format_row(row):
    head = f"{str(tuple(row['shape'])):20} {row['dtype']:8} {'causal' if row['causal'] else 'full':6} {row['row']:15}"
    if "error" in row:
        return f"{head} FAILED {row['error']}"
    train = (f"fwd+bwd {row['fwd_bwd_us']:9.1f} us {row['fwd_bwd_tflops']:6.1f} TF | " if "fwd_bwd_us" in row else "")
    return (f"{head} fwd {row['fwd_us']:9.1f} us {row['fwd_tflops']:6.1f} TF | {train}"
            f"err {row['max_abs_err']:.1e}{'  <-- ERROR' if row['max_abs_err'] > 3e-2 else ''}")


#: The issue's target shapes, causal bf16 (`--targets`).
TARGET_SHAPES = [(1, 16, 16384, 128), (2, 16, 8192, 128), (4, 16, 4096, 64), (16, 16, 1024, 64)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true", help="the first shape only, no feature costs")
    which.add_argument("--targets", action="store_true", help="the target shapes only, no feature costs")
    which.add_argument("--head-dim-64", action="store_true", help="the head-dim-64 shapes only")
    which.add_argument("--features", action="store_true", help="the feature costs only")
    which.add_argument("--backward-step", action="store_true",
                       help="the target shapes' training step in parts: the forward with gradients, the backward "
                            "step, and ours on the Python path split into its passes and kernel")
    which.add_argument("--head-dim-256", action="store_true", help="head dim 256, the forward alone")
    which.add_argument("--head-dim-256-train", action="store_true",
                       help="head dim 256, forward and forward + backward (model D's shapes among them)")
    which.add_argument("--edges", action="store_true",
                       help="the lengths that are not whole tiles only, padded and in place (calls.HOPPER_TMA_EDGES)")
    parser.add_argument("--rows", default=None,
                        help=f"comma-separated rows to time among {', '.join(ROWS)} "
                             f"(default: {', '.join(DEFAULT_ROWS)}; "
                             "with --edges, the Hopper rows and cuDNN)")
    parser.add_argument("--rounds", type=int, default=3, help="times each row is timed, in turn with the others")
    args = parser.parse_args()
    default = ("jaxattn hopper padded", "jaxattn hopper in place", "torch cudnn") if args.edges else DEFAULT_ROWS
    names = tuple(name.strip() for name in args.rows.split(",")) if args.rows else default
    unknown = [name for name in names if name not in ROWS]
    if unknown or args.rounds < 1:
        parser.error(f"--rows {args.rows!r}, --rounds {args.rounds}: expected rows among {list(ROWS)} and "
                     "at least one round")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, jax {jax.__version__}", flush=True)
    # Eager calls run as compiled programs once the programs' extension is built (in the background,
    # on first use): build it first, so that every row times the steady state a training loop sees.
    print("compiled programs:", triton_program.wait(600), flush=True)
    rows = []

    def run(shape, causal=True, dtype=torch.bfloat16, train_too=True):
        measure(shape, causal, dtype, rows, names=names, rounds=args.rounds, train_too=train_too)

    if args.features:
        feature_costs(rows, args.rounds)
    elif args.targets:
        for shape in TARGET_SHAPES:
            run(shape)
    elif args.backward_step:
        for shape in TARGET_SHAPES:
            backward_step(shape, rows, args.rounds)
    elif args.head_dim_64:
        for shape in SHAPES_64 + GQA_SHAPES_64 + [s for s in EDGE_SHAPES if s[-1] == 64]:
            run(shape)
    elif args.edges:
        for shape in EDGE_SHAPES:
            run(shape)
    elif args.head_dim_256:
        for shape in SHAPES_256:
            run(shape, train_too=False)
        run(SHAPES_256[1], causal=False, train_too=False)
    elif args.head_dim_256_train:
        for shape in SHAPES_256_TRAIN:
            run(shape)
    elif args.quick:
        run(SHAPES[0])
    else:
        for shape in SHAPES:
            run(shape)
        run(SHAPES[0], causal=False)
        run(SHAPES[1], dtype=torch.float16)
        for shape in SHAPES_64 + GQA_SHAPES_64 + EDGE_SHAPES:
            run(shape)
        feature_costs(rows, args.rounds)
    if args.out:
        write_report(args.out, rows)


if __name__ == "__main__":
    main()
