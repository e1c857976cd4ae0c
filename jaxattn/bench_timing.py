"""Timing and work counting for `jaxattn bench`.

Timing rule (`measure`): the first call (trace + compile for a JAX implementation) is timed on its
own, synchronised; a few warm-up calls follow; one calibration loop picks how many back-to-back
calls make a repeat last about `target_s`; the result is the median over `repeats` of the time per
call of such a loop, with the fastest and slowest repeat and every repeat's time (`Timing`).
`jaxattn bench` times the implementations of a cell in rounds (`round_orders`: one loop of each
per round, the order reversed every other round), so that their repeats pair up
(`jaxattn.bench_spread`). On CUDA each loop is timed with two CUDA events on torch's current stream
(our results make that stream wait on JAX's work, so the events enclose it); on the CPU with the
host clock after the last call has returned (CPU calls return finished tensors).

Work counting: attention FLOPs count the multiply-adds of the two matrix products (Q·Kᵀ and P·V)
over the (query, key) pairs the mask leaves visible, 2 FLOPs each; forward+backward counts 3.5x
the forward (the backward recomputes Q·Kᵀ and does four more products: dV, dP, dQ, dK). Decode
calls are memory-bound and are reported in bytes moved (q, K, V read once, the output written).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Optional

#: Forward+backward FLOPs over forward FLOPs (2 products forward, 5 backward).
FWD_BWD_FLOP_FACTOR = 3.5


def visible_pairs(q_len: int, kv_len: int, causal: bool) -> int:
    """Number of (query, key) pairs a call attends over.

    Causal masks are top-left aligned, as torch's `is_causal`: query i sees keys 0..i.

    Args:
        q_len: L, queries per head.
        kv_len: S, keys per head.
        causal: top-left causal mask.

    Returns:
        L*S without a mask; sum over i < L of min(i + 1, S) with one (L(L+1)/2 when L == S).
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"q_len={q_len}, kv_len={kv_len}: expected non-negative lengths.")
    if not causal:
        return q_len * kv_len
    full = max(q_len - kv_len, 0)  # rows i >= S see all S keys
    ramp = q_len - full  # rows i < S see i + 1 keys
    return ramp * (ramp + 1) // 2 + full * kv_len


def attention_flops(batch: int, q_heads: int, q_len: int, kv_len: int, head_dim: int, value_head_dim: int,
                    causal: bool, backward: bool) -> float:
    """FLOPs of one attention call: 2 * B * Hq * pairs * (D + Dv), x3.5 with the backward.

    Args:
        batch, q_heads, q_len, kv_len, head_dim, value_head_dim: B, Hq, L, S, D, Dv.
        causal: top-left causal mask (about half the pairs when L == S).
        backward: count forward+backward.
    """
    fwd = 2.0 * batch * q_heads * visible_pairs(q_len, kv_len, causal) * (head_dim + value_head_dim)
    return fwd * FWD_BWD_FLOP_FACTOR if backward else fwd


def decode_bytes(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int,
                 value_head_dim: int, itemsize: int) -> int:
    """Bytes a decode call must move: q (B, Hq, T, D) and K (B, Hkv, S, D), V (B, Hkv, S, Dv) read,
    the output (B, Hq, T, Dv) written."""
    q_and_out = batch * q_heads * q_len * (head_dim + value_head_dim)
    cache = batch * kv_heads * kv_len * (head_dim + value_head_dim)
    return (q_and_out + cache) * itemsize


@dataclasses.dataclass(frozen=True)
class Timing:
    """Result of `measure`.

    Attributes:
        first_call_s: wall time of the first call, synchronised (includes trace and compile).
        median_s: median over repeats of the time per call in a back-to-back loop (warm-up excluded).
        min_s, max_s: fastest and slowest repeat (per call).
        iters: calls per repeat; repeats: number of repeats.
        per_call_s: each repeat's time per call, in the order they ran.
    """

    first_call_s: float
    median_s: float
    min_s: float
    max_s: float
    iters: int
    repeats: int
    per_call_s: tuple[float, ...] = ()

    @classmethod
    def of_repeats(cls, first_call_s: float, iters: int, per_call_s) -> "Timing":
        """The Timing of given per-repeat times per call (median, min, max over them)."""
        per_call_s = tuple(per_call_s)
        if not per_call_s:
            raise ValueError("per_call_s=(): expected at least one repeat's time per call.")
        return cls(first_call_s, statistics.median(per_call_s), min(per_call_s), max(per_call_s), iters,
                   len(per_call_s), per_call_s)


class Clock:
    """Times a loop of calls on one device: CUDA events on CUDA, the host clock elsewhere."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        if device_type == "cuda":
            import torch

            self._torch = torch

    def sync(self) -> None:
        if self.device_type == "cuda":
            self._torch.cuda.synchronize()

    def loop_seconds(self, fn: Callable[[], Any], iters: int) -> float:
        """Seconds for `iters` back-to-back calls of `fn` (the device idle at the start)."""
        if self.device_type == "cuda":
            start = self._torch.cuda.Event(enable_timing=True)
            end = self._torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return time.perf_counter() - t0


def measure(fn: Callable[[], Any], clock: Clock, *, repeats: int = 5, warmup: int = 2, target_s: float = 0.02,
            max_iters: int = 200, first_call_s: Optional[float] = None) -> Timing:
    """Times `fn` by the module's rule.

    Args:
        fn: a no-argument call (the same inputs every time).
        clock: how to time a loop on the call's device.
        repeats: timed loops; the median is reported.
        warmup: untimed calls after the first one.
        target_s: wanted duration of one timed loop (sets the calls per loop).
        max_iters: at most this many calls per loop.
        first_call_s: pass a first-call time measured elsewhere to skip the first call here.

    Returns:
        A `Timing`.
    """
    if repeats < 1 or warmup < 0 or max_iters < 1 or not target_s > 0:
        raise ValueError(f"measure: repeats={repeats} (>= 1), warmup={warmup} (>= 0), max_iters={max_iters} "
                         f"(>= 1), target_s={target_s} (> 0) expected.")
    first_call_s, iters = prepare(fn, clock, warmup=warmup, target_s=target_s, max_iters=max_iters,
                                  first_call_s=first_call_s)
    per_call = [clock.loop_seconds(fn, iters) / iters for _ in range(repeats)]
    return Timing.of_repeats(first_call_s, iters, per_call)


def prepare(fn: Callable[[], Any], clock: Clock, *, warmup: int = 2, target_s: float = 0.02, max_iters: int = 200,
            first_call_s: Optional[float] = None) -> tuple[float, int]:
    """The untimed part of `measure`: first call (timed on its own), warm-up, calibration.

    Returns:
        (first_call_s, iters): the first call's seconds and the calls per timed loop.
    """
    if first_call_s is None:
        clock.sync()
        t0 = time.perf_counter()
        fn()
        clock.sync()
        first_call_s = time.perf_counter() - t0
    for _ in range(warmup):
        fn()
    clock.sync()
    one = clock.loop_seconds(fn, 1)
    return first_call_s, int(min(max_iters, max(1, math.ceil(target_s / max(one, 1e-9)))))


def round_orders(names, repeats: int) -> list[list]:
    """The order of `names` in each of `repeats` rounds: as given in even rounds, reversed in odd ones,
    so that no implementation always runs first (or right after the same neighbour) in a pair."""
    names = list(names)
    return [names if r % 2 == 0 else names[::-1] for r in range(repeats)]
