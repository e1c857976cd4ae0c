"""`jaxattn bench --models`: whole Llama models, transformers' "sdpa" against jaxattn's plug-in.

    jaxattn bench --models --out docs/bench          # the GPU run (about 3 minutes on an H100)
    jaxattn bench --models --models-size tiny        # a 2-layer model, seconds on a CPU (float32)
    jaxattn bench --models --models-size long        # head dim 128 at 8k and 16k tokens (the Hopper kernels)
    jaxattn bench --models --models-size wide        # head dim 256 at 4k and 8k tokens (the Hopper forward)
    jaxattn bench --models --profile                 # + kernel times of one step of each train/prefill cell

Models are built from `transformers.LlamaConfig` with random weights (nothing is downloaded), in
bfloat16 on CUDA and float32 on the CPU. One model object runs both implementations: its attention
is switched with `model.set_attn_implementation` ("sdpa", then the name `register_transformers`
registered), so both see the same weights and inputs in the same process. Cells (`MODES`):

    train              one training step: forward with labels=input_ids, loss.backward(); grads
                       are set to None before each step (no optimizer step)
    prefill            forward under torch.no_grad(), use_cache=False, logits of the last position
                       only (as generation's prefill)
    generate-dynamic   greedy model.generate of N new tokens after a random prompt, default cache
    generate-static    the same with cache_implementation="static" (transformers compiles the
                       decoding step with torch.compile on CUDA)
    small-fwd          jaxattn.torch_api.scaled_dot_product_attention against torch's on one small
    small-fwd+bwd      causal call (1, 4, 128, 64), forward / forward+backward, µs per call

Timing: each implementation is warmed up first (its first call, with compilation, is reported as
warmup_s), then `repeats` rounds of one timed loop each (the same number of calls per loop),
sdpa then jaxattn in even rounds and jaxattn then sdpa in odd ones, synchronised before and after
each loop; a cell reports the median time per call and the [min, max] over loops. Ratio = jaxattn
speed / sdpa speed (sdpa_ms / jaxattn_ms; > 1: jaxattn faster); paired_ratio is the median over
rounds of the two loops' ratio, with its quartiles: the host's speed drifts between rounds by more
than the gaps measured here, and a round's two loops share the drift. A cell that raises is recorded with "error: <type>: <message>" (and
"failed_impl": the implementation whose call raised) and the run goes on. Output: a table on
stdout; models.json and models.md in --out (rewritten after each cell).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

SIZES = ("tiny", "full", "long", "wide")
IMPLS = ("sdpa", "jaxattn")  # the two columns; "jaxattn" is whatever name register_transformers returned
MODES = ("train", "prefill", "generate-dynamic", "generate-static", "small-fwd", "small-fwd+bwd")
#: Kernel names (lower case) containing one of these count as attention kernels in --profile.
ATTENTION_KERNEL_WORDS = ("attn", "flash", "fwd", "bwd", "dkdv", "dq", "delta", "cudnn", "fmha", "mosaic_gpu")
TOP_KERNELS = 5
PAD_TOKEN = 0  # prompts are drawn from [FIRST_TOKEN, vocab): the pad token never occurs
FIRST_TOKEN = 3
MESSAGE_CHARS = 300


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A Llama model (random weights) and the cells run on it.

    Attributes:
        name: short name used in the table ("A", "B", "tiny").
        hidden, layers, heads, kv_heads, intermediate, vocab: the LlamaConfig; head dim = hidden // heads.
        cases: (batch, length) of the train and prefill cells: input_ids (batch, length).
        generate_batches: batch sizes of the generate cells (empty: no generation on this model).
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    cases: tuple[tuple[int, int], ...]
    generate_batches: tuple[int, ...] = ()

    def config(self, max_positions: int):
        """A LlamaConfig without an EOS token, so that greedy generation never stops early."""
        import transformers

        return transformers.LlamaConfig(
            hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate, vocab_size=self.vocab,
            max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None, pad_token_id=PAD_TOKEN,
        )

    def describe(self) -> dict:
        return {"hidden": self.hidden, "layers": self.layers, "heads": self.heads, "kv_heads": self.kv_heads,
                "head_dim": self.hidden // self.heads, "intermediate": self.intermediate, "vocab": self.vocab}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run measures and how long it times each cell.

    Attributes:
        size: "tiny", "full", "long" or "wide".
        dtype: torch dtype name of the models and the small calls.
        models: run in order, one at a time.
        prompt_len, new_tokens: generate cells: a (B, prompt_len) prompt, new_tokens greedy tokens.
        repeats: timed loops per implementation (train, prefill, small calls).
        loop_s: wanted seconds per timed loop of train/prefill (sets the calls per loop), at most max_calls.
        small_shape, small_loop_s: (B, H, L, D) of the small calls and their wanted seconds per loop.
        gen_runs: timed generate calls per implementation (one call per loop).
    """

    size: str
    dtype: str
    models: tuple[ModelSpec, ...]
    prompt_len: int
    new_tokens: int
    repeats: int = 9
    loop_s: float = 0.3
    max_calls: int = 50
    small_shape: tuple[int, int, int, int] = (1, 4, 128, 64)
    small_loop_s: float = 0.05
    gen_runs: int = 15


def plan(size: str, device: str) -> Plan:
    """The "tiny" (CPU test), "full" (GPU report), "long" (head dim 128, long sequences) or "wide" (head dim
    256) plan; bfloat16 on CUDA, float32 elsewhere."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    if size == "tiny":
        tiny = ModelSpec("tiny", 64, 2, 4, 2, 128, 128, cases=((2, 32),), generate_batches=(1, 2))
        return Plan("tiny", dtype, (tiny,), prompt_len=16, new_tokens=4, repeats=5, loop_s=0.01,
                    small_loop_s=0.005, gen_runs=3)
    if size == "full":
        # Intermediate sizes of the Llama ratio (about 8/3 x hidden): attention is a visible share of a step.
        a = ModelSpec("A", 1024, 16, 16, 8, 2816, 32000, cases=((16, 512), (4, 2048)))
        b = ModelSpec("B", 2048, 16, 32, 8, 5632, 32000, cases=((2, 4096), (1, 8192)), generate_batches=(1, 16))
        return Plan("full", dtype, (a, b), prompt_len=128, new_tokens=32)
    if size == "long":
        # Head dim 128 (as Llama 3 8B and most 7-70B models) at long contexts: the sizes where the
        # Hopper kernels (`torch_api.hopper_flash`) run on an H100.
        c = ModelSpec("C", 2048, 16, 16, 8, 5632, 32000, cases=((1, 8192), (1, 16384)))
        return Plan("long", dtype, (c,), prompt_len=128, new_tokens=32)
    if size == "wide":
        # Head dim 256 (as Gemma 2 and 3): on sm90 the Hopper forward runs its prefill and both Hopper
        # kernels its training (the backward whose warpgroups split the head's columns).
        d = ModelSpec("D", 2048, 16, 8, 4, 5632, 32000, cases=((2, 4096), (1, 8192)))
        return Plan("wide", dtype, (d,), prompt_len=128, new_tokens=32)
    raise ValueError(f"size={size!r}: expected one of {SIZES}.")


# ------------------------------------------------------------------------------------------------
# Timing


@dataclasses.dataclass
class Timings:
    """Result of `time_interleaved`: per implementation, seconds per call of each timed loop."""

    per_call_s: dict[str, list[float]]
    warmup_s: dict[str, float]
    calls_per_loop: int

    def median_ms(self, impl: str) -> float:
        return statistics.median(self.per_call_s[impl]) * 1e3

    def spread_ms(self, impl: str) -> list[float]:
        return [min(self.per_call_s[impl]) * 1e3, max(self.per_call_s[impl]) * 1e3]

    def paired_ratios(self, base: str, other: str) -> list[float]:
        """Per round, base's time / other's time: both loops of a round ran back to back, so a
        drift of the host's speed (which moves whole runs by several percent) cancels within a pair."""
        return [b / o for b, o in zip(self.per_call_s[base], self.per_call_s[other])]


def time_interleaved(calls: dict[str, Callable[[], Any]], select: Callable[[str], None], clock, *, repeats: int,
                     loop_s: float, max_calls: int, warmup: int = 1) -> Timings:
    """Times `calls` (implementation -> no-argument call) in alternation, in one process.

    Each implementation is selected (`select(impl)`, untimed) and called once (timed on its own,
    synchronised: compilation shows up here) and `warmup` more times. The slowest warm-up call sets
    the calls per loop (about `loop_s` seconds, 1 to `max_calls`), the same for every implementation.
    Then `repeats` rounds of one loop per implementation, in the order of `calls` in even rounds
    and the reverse order in odd ones (so that neither implementation always runs first in a pair).

    Args:
        calls: implementation name -> call.
        select: switches the model (if any) to an implementation before its calls.
        clock: a `jaxattn.bench_timing.Clock` of the calls' device.
        repeats: timed loops per implementation.
        loop_s: wanted seconds per loop; 0 for one call per loop.
        max_calls: at most this many calls per loop.
        warmup: untimed calls after the first one.
    """
    if repeats < 1 or max_calls < 1 or loop_s < 0 or warmup < 0:
        raise ValueError(f"time_interleaved: repeats={repeats} (>= 1), max_calls={max_calls} (>= 1), "
                         f"loop_s={loop_s} (>= 0), warmup={warmup} (>= 0) expected.")
    first, slowest = {}, 0.0
    for impl, fn in calls.items():
        with _blame(impl):
            select(impl)
            first[impl] = _timed_once(fn, clock)
            last = first[impl]
            for _ in range(warmup):
                last = _timed_once(fn, clock)
        slowest = max(slowest, last)
    n = int(min(max_calls, max(1, math.ceil(loop_s / max(slowest, 1e-9)))))
    per_call: dict[str, list[float]] = {impl: [] for impl in calls}
    order = list(calls.items())
    for round_ in range(repeats):
        for impl, fn in (order if round_ % 2 == 0 else order[::-1]):
            with _blame(impl):
                select(impl)
                clock.sync()  # the loop starts on an idle device ...
                seconds = clock.loop_seconds(fn, n)
                clock.sync()  # ... and ends when the device has finished (loop_seconds waits for its end event)
            per_call[impl].append(seconds / n)
    return Timings(per_call, first, n)


class ImplementationFailed(Exception):
    """A call of one implementation raised; `__cause__` is the original exception."""

    def __init__(self, impl: str):
        super().__init__(f"{impl} failed")
        self.impl = impl


@contextlib.contextmanager
def _blame(impl: str):
    """Re-raises an exception of the block as ImplementationFailed(impl), so the cell says which failed."""
    try:
        yield
    except Exception as exc:
        raise ImplementationFailed(impl) from exc


def _timed_once(fn: Callable[[], Any], clock) -> float:
    clock.sync()
    t0 = time.perf_counter()
    fn()
    clock.sync()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------
# Cells


def _cell(model: str, case: str, mode: str) -> dict:
    return {"model": model, "case": case, "mode": mode, "sdpa_ms": None, "jaxattn_ms": None, "sdpa_spread": None,
            "jaxattn_spread": None, "ratio": None, "error": None}


def _fill(cell: dict, timings: Timings) -> dict:
    """Times (ms), spreads and the ratio sdpa_ms / jaxattn_ms (> 1: jaxattn faster) into `cell`."""
    for impl in IMPLS:
        cell[f"{impl}_ms"] = timings.median_ms(impl)
        cell[f"{impl}_spread"] = timings.spread_ms(impl)
    cell["ratio"] = cell["sdpa_ms"] / cell["jaxattn_ms"]
    paired = sorted(timings.paired_ratios(*IMPLS))
    cell["paired_ratio"] = statistics.median(paired)
    cell["paired_ratio_quartiles"] = [_quantile(paired, 0.25), _quantile(paired, 0.75)]
    cell["warmup_s"] = {impl: timings.warmup_s[impl] for impl in IMPLS}
    cell["calls_per_loop"] = timings.calls_per_loop
    cell["repeats"] = len(timings.per_call_s[IMPLS[0]])
    return cell


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks of a sorted list."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def error_text(exc: BaseException) -> str:
    """"error: <type>: <first line of the message>" (cut to MESSAGE_CHARS)."""
    lines = str(exc).strip().splitlines()
    return f"error: {type(exc).__name__}: {lines[0] if lines else ''}"[:MESSAGE_CHARS]


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


class ModelPair:
    """The model(s) behind the two columns: one model whose attention is switched with
    `set_attn_implementation` (transformers >= 4.56), else one model per implementation with the
    same weights (the second loads the first's state dict)."""

    def __init__(self, spec: ModelSpec, names: dict[str, str], max_positions: int, dtype, device: str):
        import torch

        self.names = names
        torch.manual_seed(0)  # the same random weights every run
        first = self._build(spec, names["sdpa"], max_positions, dtype, device)
        if hasattr(first, "set_attn_implementation"):
            self.models = {impl: first for impl in IMPLS}
        else:
            second = self._build(spec, names["jaxattn"], max_positions, dtype, device)
            second.load_state_dict(first.state_dict())
            self.models = {"sdpa": first, "jaxattn": second}
        self.params = sum(p.numel() for p in first.parameters())

    @staticmethod
    def _build(spec: ModelSpec, attn: str, max_positions: int, dtype, device: str):
        import torch
        import transformers

        # Built on the device: random init of a 1B-parameter model on the host takes half a minute.
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(spec.config(max_positions),
                                                                 attn_implementation=attn, dtype=dtype)

    def model(self, impl: str):
        return self.models[impl]

    def select(self, impl: str) -> None:
        """Switches the shared model to `impl`'s attention (no-op with one model per implementation)."""
        model = self.models[impl]
        if self.models["sdpa"] is self.models["jaxattn"] and model.config._attn_implementation != self.names[impl]:
            model.set_attn_implementation(self.names[impl])

    def close(self) -> None:
        self.models = {}


def _input_ids(batch: int, length: int, vocab: int, device: str, seed: int):
    """(batch, length) int64 token ids in [FIRST_TOKEN, vocab)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(FIRST_TOKEN, vocab, (batch, length), generator=gen).to(device)


def train_step(model, ids) -> None:
    """One training step on ids (B, L): forward with labels = ids (shifted inside the model), backward."""
    model.zero_grad(set_to_none=True)  # no accumulation into last step's grads
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()


def prefill(model, ids) -> None:
    """Inference forward on ids (B, L); logits of the last position only, as generation's prefill."""
    import torch

    with torch.no_grad():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)


def generate(model, prompt, new_tokens: int, static: bool, device: str):
    """Greedy generation: prompt (B, P) -> (B, P + new_tokens) token ids.

    min_new_tokens = max_new_tokens and a config without EOS: every call makes exactly new_tokens.
    transformers compiles the static-cache decoding step on CUDA only; elsewhere compilation is
    turned off explicitly so that the CPU run stays seconds long on every transformers version.
    """
    import torch

    return model.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD_TOKEN,
        cache_implementation="static" if static else None, disable_compile=device != "cuda",
    )


def _model_cell(run: "_Run", cell: dict, measure: Callable[[], None]) -> dict:
    """Runs `measure` (which fills `cell`), recording an exception as the cell's error."""
    run.say(f"{cell['model']} {cell['case']} {cell['mode']}")
    try:
        measure()
    except ImplementationFailed as exc:  # one failing cell (OOM, a compile error) must not end the run
        cell["error"], cell["failed_impl"] = error_text(exc.__cause__), exc.impl
        _free(run.device)
    except Exception as exc:
        cell["error"] = error_text(exc)
        _free(run.device)
    run.add(cell)
    return cell


def _train_or_prefill(run: "_Run", pair: ModelPair, spec: ModelSpec, batch: int, length: int, mode: str) -> dict:
    cell = _cell(spec.name, f"B{batch} L{length}", mode)

    def measure():
        ids = _input_ids(batch, length, spec.vocab, run.device, seed=batch * 100003 + length)
        fn = train_step if mode == "train" else prefill
        for impl in IMPLS:
            pair.model(impl).train(mode == "train")
        calls = {impl: (lambda m=pair.model(impl): fn(m, ids)) for impl in IMPLS}
        try:
            _fill(cell, time_interleaved(calls, pair.select, run.clock, repeats=run.plan.repeats,
                                         loop_s=run.plan.loop_s, max_calls=run.plan.max_calls))
            if run.profile:
                _profile_cell(run, cell, calls, pair.select)
        finally:
            for impl in IMPLS:
                pair.model(impl).zero_grad(set_to_none=True)  # free the grads before the next cell

    return _model_cell(run, cell, measure)


def _generate_cell(run: "_Run", pair: ModelPair, spec: ModelSpec, batch: int, static: bool) -> dict:
    n, p = run.plan.new_tokens, run.plan.prompt_len
    cell = _cell(spec.name, f"B{batch} P{p} N{n}", "generate-static" if static else "generate-dynamic")
    cell.update(batch=batch, new_tokens=n, tokens_per_s=None, tokens_match=None)

    def measure():
        prompt = _input_ids(batch, p, spec.vocab, run.device, seed=batch)
        outputs = {}

        def call(impl):
            outputs[impl] = generate(pair.model(impl), prompt, n, static, run.device)

        for impl in IMPLS:
            pair.model(impl).eval()
        calls = {impl: (lambda i=impl: call(i)) for impl in IMPLS}
        timings = time_interleaved(calls, pair.select, run.clock, repeats=run.plan.gen_runs, loop_s=0.0, max_calls=1)
        for impl, out in outputs.items():
            if tuple(out.shape) != (batch, p + n):
                raise RuntimeError(f"{impl} generated {tuple(out.shape)}, expected {(batch, p + n)}")
        _fill(cell, timings)
        cell["tokens_per_s"] = {impl: batch * n / (cell[f"{impl}_ms"] / 1e3) for impl in IMPLS}
        # Greedy tokens agree in float32; in bfloat16 rounding differences may flip a near tie.
        cell["tokens_match"] = bool((outputs["sdpa"] == outputs["jaxattn"]).all())

    return _model_cell(run, cell, measure)


def _small_cell(run: "_Run", backward: bool) -> dict:
    b, h, length, d = run.plan.small_shape
    cell = _cell("attention call", f"B{b} H{h} L{length} D{d} causal", "small-fwd+bwd" if backward else "small-fwd")

    def measure():
        cell.update(_time_small(run, backward))
        for impl in IMPLS:  # µs per call: these calls are short
            cell[f"{impl}_us"] = cell[f"{impl}_ms"] * 1e3

    return _model_cell(run, cell, measure)


def _time_small(run: "_Run", backward: bool) -> dict:
    """torch's and jaxattn's scaled_dot_product_attention on q, k, v (B, H, L, D), causal."""
    import torch
    import torch.nn.functional as F

    from .torch_api import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(7)
    dtype = getattr(torch, run.plan.dtype)
    q, k, v, dout = (torch.randn(*run.plan.small_shape, generator=gen).to(run.device, dtype) for _ in range(4))
    attend = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
              "jaxattn": lambda: scaled_dot_product_attention(q, k, v, is_causal=True,
                                                              implementation=run.implementation)}
    if backward:
        for x in (q, k, v):
            x.requires_grad_()
        calls = {impl: (lambda f=f: torch.autograd.grad(f(), (q, k, v), dout)) for impl, f in attend.items()}
    else:
        calls = {impl: (lambda f=f: _no_grad(f)) for impl, f in attend.items()}
    timings = time_interleaved(calls, lambda impl: None, run.clock, repeats=run.plan.repeats,
                               loop_s=run.plan.small_loop_s, max_calls=2000, warmup=3)
    return _fill({}, timings)


def _no_grad(fn: Callable[[], Any]) -> Any:
    import torch

    with torch.no_grad():
        return fn()


# ------------------------------------------------------------------------------------------------
# Profiling (--profile)


#: Consecutive calls profiled per implementation after one unprofiled call: the averages are the
#: steady state the timed loops see (a single profiled step after switching implementations read
#: a long-sequence attention kernel 12% faster than its steady state).
PROFILE_STEPS = 3


def _profile_cell(run: "_Run", cell: dict, calls: dict[str, Callable[[], Any]], select) -> None:
    """PROFILE_STEPS profiled calls of each implementation: device time per call, the top attention
    kernels and the wall time per call, so that a slow cell splits into kernel time and host time."""
    cell["kernels"], cell["kernel_total_us"], cell["profile_step_ms"] = {}, {}, {}
    try:
        for impl, fn in calls.items():
            select(impl)
            total, top, step_ms = profile_steps(fn, run.clock, PROFILE_STEPS)
            cell["kernels"][impl], cell["kernel_total_us"][impl], cell["profile_step_ms"][impl] = top, total, step_ms
    except Exception as exc:  # the profiler is optional: the timings stay valid without it
        cell["profile_error"] = error_text(exc)


def profile_steps(fn: Callable[[], Any], clock, steps: int) -> tuple[float, list[dict], float]:
    """Profiles `steps` consecutive calls of `fn` after one unprofiled call; averages per call.

    Returns:
        (µs per call of the device's kernels (on the CPU: of all ops' self time), the TOP_KERNELS
        attention kernels by time per call as [{"name", "us", "calls"}] (calls per call), the wall
        time per call in ms).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if steps < 1:
        raise ValueError(f"steps={steps}: expected at least 1 profiled call.")
    on_cuda = clock.device_type == "cuda"
    # On CUDA only the device's activity: tracing every CPU op would slow the host side it measures.
    activities = [ProfilerActivity.CUDA] if on_cuda else [ProfilerActivity.CPU]
    fn()
    clock.sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        clock.sync()
        step_ms = (time.perf_counter() - t0) * 1e3 / steps
    wanted = DeviceType.CUDA if on_cuda else DeviceType.CPU
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type != wanted:
            continue
        us = event.time_range.elapsed_us() if on_cuda else event.self_cpu_time_total
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += us / steps
        entry[1] += 1
    total = sum(us for us, _ in totals.values())
    attention = [(name, us, n / steps) for name, (us, n) in totals.items()
                 if any(word in name.lower() for word in ATTENTION_KERNEL_WORDS)]
    attention.sort(key=lambda item: -item[1])
    top = [{"name": name[:160], "us": round(us, 1), "calls": n} for name, us, n in attention[:TOP_KERNELS]]
    return round(total, 1), top, step_ms


# ------------------------------------------------------------------------------------------------
# The run


class _Run:
    """A run's settings, its cells so far, progress lines and output files."""

    def __init__(self, device: str, plan_: Plan, implementation: Optional[str], profile: bool,
                 out_dir: Optional[str], progress: bool, header: dict):
        from .bench_timing import Clock

        self.device, self.plan, self.implementation, self.profile = device, plan_, implementation, profile
        self.out_dir, self.progress, self.header = out_dir, progress, header
        self.clock = Clock(device)
        self.cells: list[dict] = []
        self.t0 = time.perf_counter()

    def say(self, text: str) -> None:
        if self.progress:
            print(f"[{time.perf_counter() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    def add(self, cell: dict) -> None:
        """Adds a cell and rewrites the files, so that an interrupted run keeps what it measured."""
        self.cells.append(cell)
        if cell["error"]:
            self.say(f"  {_note(cell)}")
        self.write(self.report(complete=False))

    def report(self, complete: bool) -> dict:
        header = {**self.header, "elapsed_s": round(time.perf_counter() - self.t0, 1), "complete": complete}
        return {"header": header, "cells": self.cells}

    def write(self, report: dict) -> list[str]:
        """Writes `report` (from `report`: the files then hold what the caller keeps)."""
        if self.out_dir is None:
            return []
        return write_outputs(report, self.out_dir)


def package_versions() -> dict:
    """Versions of jaxattn, python and the packages involved, from package metadata.

    Read without importing: importing jax_triton (for its __version__) sets TRITON_CACHE_DIR=""
    for the whole process, after which Triton kernels launched from torch (jaxattn's native
    launcher, inductor's kernels for the static cache) fail with "Could not create or locate cache dir".
    """
    import platform
    from importlib import metadata

    import torch

    from ._version import __version__

    out = {"jaxattn": __version__, "python": platform.python_version()}
    for dist in ("torch", "jax", "jaxlib", "triton", "jax-triton", "transformers", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:  # an optional package that is absent
            continue
    if torch.version.cuda:
        out["cuda (torch)"] = torch.version.cuda
    return out


def _header(device: str, plan_: Plan, jax_name: str, implementation: Optional[str]) -> dict:
    import platform

    import torch

    versions = package_versions()
    name = torch.cuda.get_device_name() if device == "cuda" else (platform.processor() or platform.machine())
    return {
        "device": device, "device_name": name, "date": time.strftime("%Y-%m-%d"), "versions": versions,
        "size": plan_.size, "dtype": plan_.dtype, "attn_implementation": {"sdpa": "sdpa", "jaxattn": jax_name},
        "jaxattn_implementation": implementation or "automatic selection",
        "models": {spec.name: spec.describe() for spec in plan_.models},
        "prompt_len": plan_.prompt_len, "new_tokens": plan_.new_tokens, "repeats": plan_.repeats,
        "generate_runs": plan_.gen_runs, "command": "jaxattn " + " ".join(sys.argv[1:]) if sys.argv else None,
        "timing": "warm-up first (reported as warmup_s: first call, compilation included), then rounds of one loop "
                  "per implementation (order alternating between rounds), synchronised around each loop; median and "
                  "[min, max] over loops of the time per call; paired_ratio: median and quartiles over rounds of "
                  "the round's sdpa / jaxattn time",
        "ratio": "sdpa_ms / jaxattn_ms = jaxattn speed / sdpa speed (> 1: jaxattn faster)",
    }


def _check_args(size: Optional[str], device: Optional[str], implementation: Optional[str]) -> tuple[str, str]:
    """(device, size) with the defaults filled in; ValueError or ImportError naming a bad argument."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu") or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda' (cuda needs a GPU torch can see).")
    if size is None:
        size = "full" if device == "cuda" else "tiny"
    if size not in SIZES:
        raise ValueError(f"size={size!r}: expected one of {SIZES}.")
    if implementation is not None:
        from .jax_core import AttentionRegistry

        implementation = AttentionRegistry.current_name(implementation)
        if implementation not in AttentionRegistry.list_implementations():
            raise ValueError(f"implementation={implementation!r}: expected one of "
                             f"{AttentionRegistry.list_implementations()} or None (automatic selection).")
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"jaxattn bench --models needs transformers >= 4.56 (the hf extra: pip install -e '.[hf]' "
                          f"in the jaxattn checkout): {exc}") from exc
    return device, size


def run_models(size: Optional[str] = None, *, device: Optional[str] = None, implementation: Optional[str] = None,
               profile: bool = False, out_dir: Optional[str] = None, progress: bool = False,
               print_table: bool = False) -> dict:
    """Runs the model benchmark; returns {"header": {...}, "cells": [...]} (the models.json content).

    Args:
        size: "tiny", "full", "long" or "wide" (`plan`); default "full" on CUDA, "tiny" otherwise.
        device: "cuda" or "cpu"; default cuda when torch sees a GPU.
        implementation: a jaxattn implementation name forced for the jaxattn column (registered
            as attn_implementation "jaxattn_forced"); None: jaxattn's automatic selection ("jaxattn").
        profile: train and prefill cells also record PROFILE_STEPS profiled steps of each implementation (`profile_steps`).
        out_dir: write models.json and models.md there.
        progress: progress lines on stderr.
        print_table: print the table on stdout at the end.

    Raises:
        ValueError: a bad size, device or implementation. ImportError: transformers is missing.
    """
    from . import bridge  # noqa: F401  (GPU memory policy before JAX starts)
    import torch

    from .bench import _start_runtimes
    from .torch_api import register_transformers

    device, size = _check_args(size, device, implementation)
    plan_ = plan(size, device)
    jax_name = register_transformers("jaxattn" if implementation is None else "jaxattn_forced", implementation)
    _start_runtimes(device)
    header = _header(device, plan_, jax_name, implementation)
    from .bridge import triton_program

    if device == "cuda" and triton_program.enabled():  # measure the steady path: programs built
        import time

        start = time.perf_counter()
        header["compiled_launch_programs"] = triton_program.wait(900)
        header["compiled_launch_programs_build_s"] = round(time.perf_counter() - start, 1)
    run = _Run(device, plan_, implementation, profile, out_dir, progress, header)
    for backward in (False, True):
        _small_cell(run, backward)
    max_positions = max([length for spec in plan_.models for _, length in spec.cases]
                        + [plan_.prompt_len + plan_.new_tokens])
    for spec in plan_.models:
        _run_model(run, spec, {"sdpa": "sdpa", "jaxattn": jax_name}, max_positions, getattr(torch, plan_.dtype))
    if print_table:
        print(format_table(run.cells))
    report = run.report(complete=True)  # once: the file and the returned report carry one elapsed_s
    for line in run.write(report):
        print(line)
    return report


def _run_model(run: _Run, spec: ModelSpec, names: dict[str, str], max_positions: int, dtype) -> None:
    """All cells of one model; the model is freed before the next one is built."""
    run.say(f"building model {spec.name} ({spec.describe()})")
    try:
        pair = ModelPair(spec, names, max_positions, dtype, run.device)
    except Exception as exc:  # e.g. out of memory: the model's cells are listed with the error
        message = error_text(exc)
        for batch, length in spec.cases:
            for mode in ("train", "prefill"):
                run.add({**_cell(spec.name, f"B{batch} L{length}", mode), "error": message})
        _free(run.device)
        return
    run.header["models"][spec.name]["params"] = pair.params
    for batch, length in spec.cases:
        for mode in ("train", "prefill"):
            _train_or_prefill(run, pair, spec, batch, length, mode)
    for static in (False, True):
        for batch in spec.generate_batches:
            _generate_cell(run, pair, spec, batch, static)
    pair.close()
    del pair
    _free(run.device)


# ------------------------------------------------------------------------------------------------
# Output


def _fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    return f"{ms * 1e3:.1f} us" if ms < 1 else f"{ms:.2f} ms" if ms < 100 else f"{ms:.0f} ms"


def _fmt_cell(cell: dict, impl: str) -> str:
    text = _fmt_ms(cell[f"{impl}_ms"])
    if cell.get("tokens_per_s"):
        text += f" ({cell['tokens_per_s'][impl]:.0f} tok/s)"
    return text


def _note(cell: dict) -> str:
    notes = []
    if cell["error"]:
        notes.append(f"{cell['failed_impl']}: {cell['error']}" if cell.get("failed_impl") else cell["error"])
    if cell.get("paired_ratio") is not None:
        lo, hi = cell["paired_ratio_quartiles"]
        notes.append(f"paired {cell['paired_ratio']:.2f}x [{lo:.2f}, {hi:.2f}]")
    if cell.get("tokens_match") is False:
        notes.append("tokens differ")
    if cell.get("kernel_total_us"):
        notes.append("kernels " + " / ".join(f"{cell['kernel_total_us'][i] / 1e3:.1f}" for i in IMPLS if
                                             i in cell["kernel_total_us"]) + " ms")
    return "; ".join(notes)


def format_table(cells: list[dict]) -> str:
    """A plain-text table, one line per cell; ratio > 1: jaxattn faster."""
    head = f"{'model':<14} {'case':<22} {'mode':<16} {'sdpa':>24} {'jaxattn':>24} {'ratio':>6}  note"
    lines = [head, "-" * len(head)]
    for c in cells:
        ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "-"
        lines.append(f"{c['model']:<14} {c['case']:<22} {c['mode']:<16} {_fmt_cell(c, 'sdpa'):>24} "
                     f"{_fmt_cell(c, 'jaxattn'):>24} {ratio:>6}  {_note(c)}"[:220])
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    """models.md: the run's header and one table row per cell."""
    h = report["header"]
    models = "; ".join(f"{name}: " + ", ".join(f"{k} {v}" for k, v in spec.items())
                       for name, spec in h["models"].items())
    lines = [f"- Device: {h['device_name']} ({h['device']}); date {h['date']}; size {h['size']}, {h['dtype']}; "
             f"{h.get('elapsed_s')} s", f"- Models (Llama, random weights): {models}",
             f"- jaxattn: attn_implementation {h['attn_implementation']['jaxattn']!r}, "
             f"{h['jaxattn_implementation']}",
             "- Versions: " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
             f"- Timing: {h['timing']}. Ratio: {h['ratio']}.", "",
             "| model | case | mode | sdpa | jaxattn | ratio | note |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for c in report["cells"]:
        ratio = f"{c['ratio']:.2f}x" if c["ratio"] is not None else "n/a"
        lines.append(f"| {c['model']} | {c['case']} | {c['mode']} | {_fmt_cell(c, 'sdpa')} | "
                     f"{_fmt_cell(c, 'jaxattn')} | {ratio} | {_note(c)} |")
    return "\n".join(lines) + "\n"


def write_outputs(report: dict, out_dir: str) -> list[str]:
    """Writes models.json and models.md into out_dir; returns a note to print when complete."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out_dir, "models.md"), "w") as f:
        f.write(markdown_table(report))
    return [f"wrote {out_dir}/models.json, models.md"] if report["header"]["complete"] else []


# ------------------------------------------------------------------------------------------------
# Command line (options added to `jaxattn bench`)

#: `jaxattn bench` options that mean nothing to --models (which has its own plan).
_OTHER_OPTIONS = {"impl": "--impl", "dtype": "--dtype", "fwd_only": "--fwd-only", "max_minutes": "--max-minutes",
                  "from_json": "--from-json"}
_OWN_OPTIONS = {"models_size": "--models-size", "implementation": "--implementation", "profile": "--profile"}


def _implementation_arg(value: str) -> str:
    from .jax_core import AttentionRegistry

    names = AttentionRegistry.list_implementations()
    value = AttentionRegistry.current_name(value)
    if value not in names:
        raise argparse.ArgumentTypeError(f"--implementation {value!r}: expected one of {', '.join(names)}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the --models options to the `jaxattn bench` parser."""
    group = parser.add_argument_group("model benchmark (--models)")
    group.add_argument("--models", action="store_true",
                       help="whole Llama models (random weights): transformers' sdpa against jaxattn's plug-in, "
                            "train / prefill / generate; writes models.json and models.md to --out")
    group.add_argument("--models-size", choices=SIZES, help="full: 2 models, bf16 (default on CUDA); long: one head-dim-128 "
                       "model at 8k and 16k tokens; wide: one head-dim-256 model at 4k and 8k tokens; tiny: a 2-layer model (default elsewhere); --quick/--full do not "
                       "apply to --models")
    group.add_argument("--implementation", type=_implementation_arg, metavar="NAME",
                       help="force this jaxattn implementation (registered as attn_implementation 'jaxattn_forced'); "
                            "default automatic selection")
    group.add_argument("--profile", action="store_true",
                       help="train and prefill cells: profile one step of each implementation (kernel time, top attention kernels)")


def wanted(args: argparse.Namespace) -> bool:
    """Whether the command line asks for the model benchmark (--models or one of its options)."""
    return bool(args.models) or any(getattr(args, key) for key in _OWN_OPTIONS)


def main(args: argparse.Namespace) -> int:
    """`jaxattn bench --models ...`; returns the exit status."""
    errors = [f"{flag} is only used with --models" for key, flag in _OWN_OPTIONS.items()
              if getattr(args, key) and not args.models]
    errors += [f"{flag} is not used with --models" for key, flag in _OTHER_OPTIONS.items()
               if args.models and getattr(args, key)]
    if errors:
        print(f"jaxattn bench: error: {'; '.join(errors)}", file=sys.stderr)
        return 2
    try:
        run_models(args.models_size, device=args.device, implementation=args.implementation, profile=args.profile,
                   out_dir=args.out, progress=not args.no_progress, print_table=True)
    except (ValueError, ImportError) as exc:
        print(f"jaxattn bench: error: {exc}", file=sys.stderr)
        return 2
    return 0
