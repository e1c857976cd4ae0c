"""A per-warpgroup timeline of the Hopper kernels (`flash_fwd_mgpu.py`, `flash_bwd_mgpu.py`) from Mosaic
GPU's in-kernel profiler. Imports only JAX.

The kernels name their steps with `jax.named_scope` (the softmax, each product, each wait); Mosaic GPU
emits nothing for a name unless its profiler is on. Inside `recorded(directory, steps)`, a kernel
traced there is compiled with the profiler: one thread per warpgroup stores the SM clock at each named
step's entry and exit into shared memory, and after each call a Chrome trace (`*-trace.json`, one
track per warpgroup of each program) is written into `directory`. `steps` bounds the named steps one
warpgroup records per call; its records take 16 * steps bytes of shared memory per warpgroup beside
the kernel's own buffers (a kernel that does not fit fails to compile, naming both sizes). The records
cost a few cycles each and change how ptxas schedules around them, so a timeline says where a
warpgroup waits and what it computes, not how long the kernel takes without them.
`benchmarks/hopper_timeline_gpu.py` runs and summarises it.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import os
from typing import NamedTuple, Optional

from jax.experimental.pallas import mosaic_gpu as plgpu


class Recording(NamedTuple):
    directory: str
    steps: int


_RECORDING: contextvars.ContextVar[Optional[Recording]] = contextvars.ContextVar("mgpu_timeline", default=None)


@contextlib.contextmanager
def recorded(directory: str, steps: int):
    """Kernels traced inside record their named steps (see the module docstring). A function jitted
    and traced before is not traced again here: jit a fresh one inside."""
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive int (named steps one warpgroup records per call); "
                         "hint: a few per key or query block walked, times the blocks one program walks")
    if not isinstance(directory, str) or not os.path.isdir(directory):
        raise ValueError(f"directory={directory!r}: expected an existing directory for the traces; hint: "
                         "os.makedirs(directory, exist_ok=True) first")
    token = _RECORDING.set(Recording(directory, int(steps)))
    try:
        yield
    finally:
        _RECORDING.reset(token)


def compiler_params(*, interpret, **params) -> plgpu.CompilerParams:
    """The kernels' `plgpu.CompilerParams(**params)`, with the profiler on inside `recorded` when they
    compile for the GPU (`interpret` None; Mosaic GPU's interpreter has no profiler)."""
    recording = _RECORDING.get()
    if recording is not None and interpret is None:
        params.update(profile_space=recording.steps, profile_dir=recording.directory)
    return plgpu.CompilerParams(**params)


def tracks(trace: dict) -> dict:
    """{track number: its records in order} of one Chrome trace of `recorded`."""
    found: dict = {}
    for event in trace["traceEvents"]:
        found.setdefault(event["tid"], []).append(event)
    return found


def outermost_steps(events: list) -> list:
    """[(name, begin, end)] of one track's outermost named steps, in SM cycles from its first record."""
    first = events[0]["ts"]
    open_steps, steps = [], []
    for event in events:
        cycles = (event["ts"] - first) * 1e3
        if event["ph"] == "B":
            open_steps.append((event["name"], cycles))
            continue
        name, began = open_steps.pop()
        if not open_steps:
            steps.append((name, began, cycles))
    return steps


def summarise(trace: dict, warpgroups: int, clock_ghz: float) -> dict:
    """What one Chrome trace of `recorded` says, from a kernel of `warpgroups` warpgroups per program.

    Returns {"warpgroups": [per warpgroup: {"span": mean cycles from its first record to its last,
    "steps": {name: mean cycles in that step (outermost names only)}, "other": the span's rest}],
    "ends_us": sorted µs from the first program's start to each program's last record} (a program's
    records are in SM cycles from its start; `clock_ghz` converts them). Mosaic GPU's trace numbers a
    track 1 + warpgroup + warpgroups * program and gives each record "ts" = (the program's start in ns
    + cycles since its first record) / 1000."""
    steps = [{} for _ in range(warpgroups)]
    spans = [[] for _ in range(warpgroups)]
    starts, ends = {}, {}
    for track, events in tracks(trace).items():
        wg, program = (track - 1) % warpgroups, (track - 1) // warpgroups
        first = events[0]["ts"]
        for name, began, ended in outermost_steps(events):
            steps[wg][name] = steps[wg].get(name, 0.0) + ended - began
        span = (events[-1]["ts"] - first) * 1e3
        spans[wg].append(span)
        starts[program] = min(starts.get(program, float("inf")), first * 1e3)
        ends[program] = max(ends.get(program, 0.0), first * 1e3 + span / clock_ghz)
    summary = []
    for wg in range(warpgroups):
        count = max(len(spans[wg]), 1)
        span = sum(spans[wg]) / count
        mean = {name: total / count for name, total in sorted(steps[wg].items(), key=lambda kv: -kv[1])}
        summary.append(dict(span=span, steps=mean, other=span - sum(mean.values())))
    origin = min(starts.values(), default=0.0)
    return dict(warpgroups=summary, ends_us=sorted((end - origin) / 1e3 for end in ends.values()))
