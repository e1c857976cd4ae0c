"""Reliability of the torch API under threads, in-place mutation and long runs.

* Threads: eight threads call `scaled_dot_product_attention` at once, two per shape set (GQA,
  causal, bool and additive masks, L != S, with and without grad), each call in a
  `sdpa_implementation("vanilla")` block or under the default choice. Every output and gradient is checked against torch's math SDPA,
  each thread's implementation choice stays its own, and the compiled-executable cache's counters
  add up to the lookups the calls made.
* Aliasing: an in-place change of a tensor saved for backward (q, k, v or the output) raises
  torch's version-counter error instead of giving wrong gradients; outputs and gradients never
  share memory with the arguments; no forward or backward writes into q, k, v, the mask, the
  output's gradient or a KV cache (no JAX buffer donation into torch memory).
* Memory: host RSS stays flat over 10,000 calls at one shape, and the cache keeps its bound while
  shapes keep changing.

Oracles: torch's math SDPA: `torch._scaled_dot_product_attention_math` inside threads (the
`sdpa_kernel` context flips process-wide flags, so threads entering and leaving it would race),
`sdpa_kernel(SDPBackend.MATH)` elsewhere; bitwise clones for "unchanged".
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import threading
import time
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from thorough_grid import grid

from jaxattn.bridge import cache_info, clear_cache, set_cache_size
from jaxattn.bridge.cache import LRUCache
from jaxattn.torch_api import (
    current_implementation, decode_attention, flash_attention, scaled_dot_product_attention, sdpa_implementation,
)

ATOL, RTOL = 2e-5, 1e-5  # float32 against float32 math SDPA: observed errors are ~1e-6
INPLACE_ERROR = "modified by an inplace operation"


# --- helpers ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One call signature: (B, Hq, L, E) queries against (B, Hk, S, E) keys and values."""

    b: int
    hq: int
    hk: int
    l: int
    s: int
    e: int
    causal: bool = False
    mask: Optional[str] = None  # None, "bool" or "float" (additive)
    grad: bool = False


def make_inputs(case: Case, gen: torch.Generator) -> tuple:
    """Fresh random (q, k, v, mask) for `case`; bool masks keep key 0 visible in every row."""
    q = torch.randn(case.b, case.hq, case.l, case.e, generator=gen)
    k = torch.randn(case.b, case.hk, case.s, case.e, generator=gen)
    v = torch.randn(case.b, case.hk, case.s, case.e, generator=gen)
    mask = None
    if case.mask == "bool":
        mask = torch.rand(case.b, case.hq, case.l, case.s, generator=gen) > 0.4
        mask[..., 0] = True  # a row with no visible key is NaN for torch's math SDPA
    elif case.mask == "float":
        mask = torch.randn(case.b, 1, case.l, case.s, generator=gen)
    if case.grad:
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    return q, k, v, mask


def math_sdpa(q, k, v, mask, causal: bool) -> torch.Tensor:
    """torch's math SDPA, called directly: no process-wide backend flags, so safe in threads.

    The public function turns a bool mask into an additive one before it reaches the math kernel;
    called directly, the kernel needs that done here.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    return torch._scaled_dot_product_attention_math(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[-3] != k.shape[-3]
    )[0]


def ours(q, k, v, mask, causal: bool) -> torch.Tensor:
    return scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=q.shape[-3] != k.shape[-3])


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) bytes of the storage under `t`."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm), after a garbage collection and,
    with glibc, `malloc_trim(0)`: freed heap pages are returned first, so that a leak cannot hide
    in memory that is free but still resident (without the trim, a simulated 1 KiB-per-call leak
    over 10,000 calls showed as only 1.8 MiB of RSS; with it, as 10 MiB)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


@pytest.fixture
def fresh_cache():
    """An empty cache with zeroed counters; the capacity in force before the test is restored."""
    maxsize = cache_info().maxsize
    clear_cache()
    try:
        yield
    finally:
        set_cache_size(maxsize)


def run_threads(target: Callable[[int], None], n: int) -> list[BaseException]:
    """Runs target(0..n-1) in n threads started together; returns the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        try:
            barrier.wait(timeout=60)
            target(i)
        except BaseException as exc:  # surfaced by the caller
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


# --- 1. threads ------------------------------------------------------------------------------------

THREAD_CASES = (
    Case(b=2, hq=4, hk=4, l=8, s=8, e=16, causal=True),  # inference
    Case(b=1, hq=4, hk=2, l=6, s=10, e=8, mask="bool", grad=True),  # GQA, L < S, bool mask
    Case(b=2, hq=2, hk=2, l=12, s=5, e=8, mask="float", grad=True),  # L > S, additive mask
    Case(b=1, hq=6, hk=2, l=4, s=9, e=16, causal=True, grad=True),  # GQA, causal, L < S
)
N_THREADS, CALLS_PER_THREAD = 8, 200


def thread_choice(i: int, n: int) -> Optional[str]:
    """Thread i's choice for its call n: "vanilla" (in a block) or None (default), alternating per
    call and opposite between the two threads of a case, so that both share both executables."""
    return "vanilla" if (n + i // len(THREAD_CASES)) % 2 else None


@pytest.mark.thorough  # by default: test_implementation_choice_does_not_leak_between_threads, test_fast_path.py
def test_threads_with_own_shapes_choices_and_grads(fresh_cache):
    """8 threads x 200 calls: every output and gradient matches, choices stay per thread, counters add up."""
    stats = [dict(forward=0, backward=0, mismatches=[], leaks=[], max_size=0) for _ in range(N_THREADS)]

    def work(i: int) -> None:
        case = THREAD_CASES[i % len(THREAD_CASES)]
        gen, st = torch.Generator().manual_seed(1000 + i), stats[i]
        for n in range(CALLS_PER_THREAD):
            q, k, v, mask = make_inputs(case, gen)
            choice = thread_choice(i, n)
            block = sdpa_implementation(choice) if choice else contextlib.nullcontext()
            with block:
                before = current_implementation()
                out = ours(q, k, v, mask, case.causal)
                after = current_implementation()
            if before != choice or after != choice:
                st["leaks"].append((n, before, after))
            st["forward"] += 1
            got, want = [out], [math_sdpa(q, k, v, mask, case.causal)]
            if case.grad:
                go = torch.randn(out.shape, generator=gen)
                got += torch.autograd.grad(out, (q, k, v), go)
                want += torch.autograd.grad(want[0], (q, k, v), go)
                st["backward"] += 1
            bad = [j for j, (a, b) in enumerate(zip(got, want)) if not close(a.detach(), b.detach())]
            if bad:
                st["mismatches"].append((n, bad, max((a - b).abs().max().item() for a, b in zip(got, want))))
            st["max_size"] = max(st["max_size"], cache_info().size)

    errors = run_threads(work, N_THREADS)
    assert not errors, errors[:3]
    assert [s["mismatches"] for s in stats] == [[]] * N_THREADS
    assert [s["leaks"] for s in stats] == [[]] * N_THREADS
    assert current_implementation() is None
    info = cache_info()
    lookups = sum(s["forward"] + s["backward"] for s in stats)  # one cache lookup per forward and backward
    assert lookups == N_THREADS * CALLS_PER_THREAD + sum(CALLS_PER_THREAD * 2 for c in THREAD_CASES if c.grad)
    assert info.hits + info.misses == lookups
    # One executable per (case, choice) forward and per grad (case, choice) backward, each shared
    # by two threads; concurrent first calls of one signature build it once.
    distinct = 2 * len(THREAD_CASES) + 2 * sum(c.grad for c in THREAD_CASES)
    assert info.size == distinct
    assert info.misses == distinct, f"{info.misses - distinct} duplicate builds"
    assert max(s["max_size"] for s in stats) <= info.maxsize


def test_implementation_choice_does_not_leak_between_threads(fresh_cache):
    """A block in one thread neither steers another thread's calls nor loses entries to its exits."""
    gen = torch.Generator().manual_seed(7)
    case = Case(b=1, hq=2, hk=2, l=5, s=7, e=8)
    inside, release = threading.Event(), threading.Event()
    seen: dict = {}

    def holder() -> None:
        # "flash" cannot run on CPU: a call under this choice raises, which makes a leak visible.
        with sdpa_implementation("flash"):
            try:
                ours(*make_inputs(case, torch.Generator().manual_seed(8)), False)
            except (ValueError, NotImplementedError) as exc:
                seen["holder_error"] = exc
            inside.set()
            release.wait(60)
            seen["holder_choice"] = current_implementation()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(60)
        assert current_implementation() is None
        q, k, v, mask = make_inputs(case, gen)
        out = ours(q, k, v, mask, False)  # automatic selection, not the other thread's "flash"
        assert close(out, math_sdpa(q, k, v, mask, False))
        with sdpa_implementation("vanilla"):
            release.set()
            thread.join(60)
            assert current_implementation() == "vanilla"  # the holder's exit popped its own entry
        assert current_implementation() is None
    finally:
        release.set()
        thread.join(60)
    assert "holder_error" in seen, "the holder's own block had no effect"
    assert seen["holder_choice"] == "flash"


def test_sequence_buckets_block_stays_in_its_thread():
    """A `sequence_buckets` block pads only its own thread's calls; `set_sequence_buckets` is the
    process-wide default every thread sees."""
    from jaxattn.torch_api import current_sequence_buckets, sequence_buckets, set_sequence_buckets

    inside, release = threading.Event(), threading.Event()
    seen: dict = {}

    def holder() -> None:
        with sequence_buckets([64, 128]):
            seen["inside"] = current_sequence_buckets()
            inside.set()
            release.wait(60)
        seen["after"] = current_sequence_buckets()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(60)
        assert current_sequence_buckets() is None  # the other thread's block does not apply here
        set_sequence_buckets([32])
        with sequence_buckets([16]):
            release.set()
            thread.join(60)
            assert current_sequence_buckets() == (16,)  # the holder's exit popped its own entry
        assert current_sequence_buckets() == (32,)
    finally:
        set_sequence_buckets(None)
        release.set()
        thread.join(60)
    assert seen == {"inside": (64, 128), "after": (32,)}


def test_cache_builds_a_key_once_for_concurrent_misses():
    """Eight threads missing one key together: one build (a miss), seven hits on its value."""
    cache, builds = LRUCache(maxsize=4), []

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.2)  # the others arrive while it builds
        return object()

    results = [None] * 8
    assert not run_threads(lambda i: results.__setitem__(i, cache.get_or_build("key", build)), 8)
    assert len(builds) == 1 and all(r is results[0] for r in results)
    info = cache.info()
    assert (info.hits, info.misses, info.size) == (7, 1, 1)


def test_cache_rebuilds_after_a_failed_concurrent_build():
    """A build that raises fails only its own caller; a waiting thread builds the key instead."""
    cache, builds = LRUCache(maxsize=4), []

    def build():
        builds.append(threading.get_ident())
        time.sleep(0.2)
        if len(builds) == 1:
            raise RuntimeError("first build fails")
        return "built"

    results = [None] * 8
    errors = run_threads(lambda i: results.__setitem__(i, cache.get_or_build("key", build)), 8)
    assert [str(e) for e in errors] == ["first build fails"]
    assert len(builds) == 2 and results.count("built") == 7
    info = cache.info()
    assert (info.hits, info.misses, info.size) == (6, 2, 1)


# --- 2. aliasing and in-place mutation -----------------------------------------------------------

INPLACE_CASE = Case(b=1, hq=2, hk=2, l=6, s=6, e=8, causal=True)


def _inplace_forward(api: str, leaves, how: str):
    """Runs `api` on views of `leaves` (or the leaves, for how="leaf"); returns (inputs, output)."""
    if how == "leaf":
        inputs = list(leaves)
    elif how == "view":
        inputs = [t.clone()[:] for t in leaves]  # views of non-leaf tensors
    else:
        inputs = [t.clone() for t in leaves]
    q, k, v = inputs
    out = ours(q, k, v, None, True) if api == "sdpa" else flash_attention(q, k, v, causal=True)
    return inputs, out


INPLACE_WAYS = [(how, target) for how in ("whole", "view", "leaf") for target in ("query", "key", "value", "output")
                if not (how == "leaf" and target == "output")]  # the output is no leaf


@pytest.mark.parametrize("api", ["sdpa", "flash"])
@pytest.mark.parametrize("how, target", INPLACE_WAYS)
def test_inplace_change_before_backward_raises(api, how, target):
    """q.add_(1) (or k, v, the output) between forward and backward raises torch's version error.

    how: "whole" changes the non-leaf tensor passed in (or the output), "view" writes through a
    view of it, "leaf" changes the leaf passed in directly (under no_grad, as torch requires).
    """
    gen = torch.Generator().manual_seed(21)
    leaves = [t.requires_grad_() for t in make_inputs(INPLACE_CASE, gen)[:3]]
    inputs, out = _inplace_forward(api, leaves, how)
    victim = out if target == "output" else inputs[["query", "key", "value"].index(target)]
    with torch.no_grad() if how == "leaf" else contextlib.nullcontext():  # a leaf needs no_grad
        if how == "view":
            victim[..., :1].add_(1.0)  # a write through a view of the saved tensor
        else:
            victim.add_(1.0)
    with pytest.raises(RuntimeError, match=INPLACE_ERROR):
        out.backward(torch.randn(out.shape, generator=gen))


@pytest.mark.parametrize("api", ["sdpa", "flash"])
def test_backward_without_inplace_change_is_right(api):
    """The control of the test above: the same calls, unmodified, give the math SDPA gradients."""
    gen = torch.Generator().manual_seed(21)
    leaves = [t.requires_grad_() for t in make_inputs(INPLACE_CASE, gen)[:3]]
    inputs, out = _inplace_forward(api, leaves, "view")
    go = torch.randn(out.shape, generator=gen)
    grads = torch.autograd.grad(out, leaves, go)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, go)
    assert close(out.detach(), ref.detach())
    assert all(close(a, b) for a, b in zip(grads, ref_grads))


def _sdpa_call(gen, implementation=None, gqa=False, squeeze=False, single_key=False):
    """(arguments by name, the names differentiated, a function of the arguments giving the output)."""
    case = Case(b=2, hq=4, hk=2 if gqa else 4, l=7, s=1 if single_key else 9, e=8, mask="float")
    q, k, v, mask = make_inputs(case, gen)
    if squeeze:
        q, k, v, mask = q[0, 0], k[0, 0], v[0, 0], mask[0, 0]
    args = dict(q=q, k=k, v=v, mask=mask)

    def call(q, k, v, mask):
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, implementation=implementation)

    return args, ("q", "k", "v", "mask"), call


def _flash_call(gen):
    case = Case(b=2, hq=4, hk=2, l=9, s=9, e=8)
    q, k, v, _ = make_inputs(case, gen)
    sinks = torch.randn(4, generator=gen)
    args = dict(q=q, k=k, v=v, sinks=sinks)

    def call(q, k, v, sinks):
        return flash_attention(q, k, v, causal=True, sinks=sinks, window=(4, -1))

    return args, ("q", "k", "v", "sinks"), call


def _decode_call(gen):
    b, s, hkv, hq, d = 2, 16, 2, 4, 8
    args = dict(
        q=torch.randn(b, hq, 1, d, generator=gen),
        k_cache=torch.randn(b, s, hkv, d, generator=gen),
        v_cache=torch.randn(b, s, hkv, d, generator=gen),
        cache_seqlens=torch.tensor([5, 16], dtype=torch.int32),
    )
    return args, ("q", "k_cache", "v_cache"), decode_attention


CALLS = {
    "sdpa": lambda gen: _sdpa_call(gen),
    "sdpa_vanilla": lambda gen: _sdpa_call(gen, implementation="vanilla"),
    "sdpa_gqa": lambda gen: _sdpa_call(gen, gqa=True),
    "sdpa_2d": lambda gen: _sdpa_call(gen, squeeze=True),
    "sdpa_single_key": lambda gen: _sdpa_call(gen, single_key=True),  # output = v: a tempting alias
    "flash": _flash_call,
    "decode": _decode_call,
}


def _run_call(name: str, grad: bool, seed: int = 31):
    """Builds and runs CALLS[name]; returns (args, their clones before the call, output, grad names)."""
    gen = torch.Generator().manual_seed(seed)
    args, diff, call = CALLS[name](gen)
    if grad:
        for n in diff:
            args[n].requires_grad_()
    before = {n: t.detach().clone() for n, t in args.items()}
    out = call(**args)
    return args, before, out, diff, gen


def _assert_unchanged(args: dict, before: dict, when: str) -> None:
    for n, t in args.items():
        assert torch.equal(t.detach(), before[n]), f"{n} changed by the {when}"


# the default run: every call with gradients (which checks the output first), less the sdpa variants
# whose outputs come from the same path as "sdpa"
@pytest.mark.parametrize("name,grad", grid(sorted(CALLS), [False, True], keep=[
    (name, True) for name in CALLS if name not in ("sdpa_vanilla", "sdpa_gqa")]))
def test_outputs_and_grads_do_not_alias_arguments(name, grad):
    """Outputs and gradients own their memory: no overlap, and writing into them leaves inputs alone."""
    args, before, out, diff, gen = _run_call(name, grad=grad)
    assert not [n for n, t in args.items() if overlaps(out, t)], "the output shares memory with an argument"
    go = torch.randn(out.shape, generator=gen)
    grads = dict(zip(diff, torch.autograd.grad(out, [args[n] for n in diff], go))) if grad else {}
    for g_name, g in grads.items():
        shared = [n for n, t in {**args, "out": out, "grad_output": go}.items() if overlaps(g, t)]
        assert not shared, f"grad of {g_name} shares memory with {shared}"
    for a, b in [(a, b) for a in grads for b in grads if a < b]:
        assert not overlaps(grads[a], grads[b]), f"grads of {a} and {b} share memory"
    with torch.no_grad():
        out.fill_(float("nan"))
        for g in grads.values():
            g.fill_(float("nan"))
    _assert_unchanged(args, before, "writes into the output and gradients")


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("name", sorted(CALLS))
def test_calls_never_write_into_their_arguments(name, grad):
    """No donation into torch memory: q, k, v, mask, sinks, KV cache and grad_output stay bitwise equal."""
    args, before, out, diff, gen = _run_call(name, grad=grad)
    _assert_unchanged(args, before, "forward")
    if grad:
        go = torch.randn(out.shape, generator=gen)
        go_before = go.clone()
        torch.autograd.grad(out, [args[n] for n in diff], go)
        _assert_unchanged(args, before, "backward")
        assert torch.equal(go, go_before), "grad_output changed by the backward"


def test_decode_matches_math_sdpa_on_the_valid_prefix():
    """decode_attention on a KV cache equals math SDPA over each sequence's valid positions."""
    args, _, out, _, _ = _run_call("decode", grad=False)
    q, kc, vc, lengths = args["q"], args["k_cache"], args["v_cache"], args["cache_seqlens"]
    for b, n in enumerate(lengths.tolist()):
        k, v = kc[b : b + 1, :n].transpose(1, 2), vc[b : b + 1, :n].transpose(1, 2)
        with sdpa_kernel(SDPBackend.MATH):
            want = F.scaled_dot_product_attention(q[b : b + 1], k, v, enable_gqa=True)
        assert close(out[b : b + 1], want)


# --- 3. memory ---------------------------------------------------------------------------------------

MEMORY_CALLS, MEMORY_WARMUP = 10_000, 500
#: Measured (2 CPU cores, glibc 2.36): RSS grew by 0.04-0.05 MiB over 10,000 forward calls after
#: warm-up, by 10 MiB with a simulated 1 KiB-per-call leak. 4 MiB is ~80x the former, 0.4x the latter.
RSS_BOUND = 4 * 2**20
#: Forward + backward: 3,000 calls; measured growth 0.19 MiB, 3.6 MiB with a 1 KiB-per-call leak.
GRAD_CALLS, GRAD_RSS_BOUND = 3_000, 2 * 2**20
MEMORY_CASE = Case(b=1, hq=2, hk=2, l=16, s=16, e=16, causal=True)


@pytest.mark.thorough  # 10,500 calls
def test_rss_flat_over_ten_thousand_calls(fresh_cache):
    """10,000 forward calls at one shape after 500 warm-up calls grow RSS by less than RSS_BOUND."""
    q, k, v, _ = make_inputs(MEMORY_CASE, torch.Generator().manual_seed(41))
    for _ in range(MEMORY_WARMUP):
        ours(q, k, v, None, True)
    start = rss_bytes()
    for _ in range(MEMORY_CALLS):
        out = ours(q, k, v, None, True)
    grown = rss_bytes() - start
    assert close(out, math_sdpa(q, k, v, None, True))
    info = cache_info()
    assert (info.misses, info.hits) == (1, MEMORY_WARMUP + MEMORY_CALLS - 1)
    assert grown < RSS_BOUND, f"RSS grew by {grown / 2**20:.2f} MiB over {MEMORY_CALLS} calls"


@pytest.mark.thorough  # 3,250 forward and backward calls
def test_rss_flat_over_forward_backward_calls(fresh_cache):
    """3,000 forward + backward calls (saved JAX arrays, autograd graphs) after 250 warm-up calls
    grow RSS by less than GRAD_RSS_BOUND (measured: 0.19 MiB; a 1 KiB-per-call leak: 3.6 MiB)."""
    gen = torch.Generator().manual_seed(42)
    q, k, v, _ = make_inputs(dataclasses.replace(MEMORY_CASE, grad=True), gen)
    go = torch.randn(q.shape, generator=gen)
    for _ in range(MEMORY_WARMUP // 2):
        ours(q, k, v, None, True).backward(go)
    start = rss_bytes()
    for _ in range(GRAD_CALLS):
        q.grad = k.grad = v.grad = None
        ours(q, k, v, None, True).backward(go)
    grown = rss_bytes() - start
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.autograd.backward(math_sdpa(*ref, None, True), go)
    assert all(close(a.grad, b.grad) for a, b in zip((q, k, v), ref))
    assert grown < GRAD_RSS_BOUND, f"RSS grew by {grown / 2**20:.2f} MiB over {GRAD_CALLS} calls"


@pytest.mark.thorough  # compiles 31 shapes
def test_cache_stays_bounded_while_shapes_change(fresh_cache):
    """set_cache_size(8) and 30 distinct shapes: size <= 8 throughout, 22 evictions, LRU order kept."""
    set_cache_size(8)
    gen = torch.Generator().manual_seed(51)
    sizes = []
    for l in range(1, 31):
        q, k, v, _ = make_inputs(Case(b=1, hq=1, hk=1, l=l, s=l, e=8), gen)
        assert close(ours(q, k, v, None, False), math_sdpa(q, k, v, None, False))
        sizes.append(cache_info().size)
    info = cache_info()
    assert max(sizes) <= 8 and sizes[-1] == 8
    assert (info.hits, info.misses) == (0, 30)
    assert info.misses - info.size == 22  # each miss inserts one executable: 22 were evicted
    for l, hit in ((30, True), (23, True), (22, False)):  # the 8 most recent are 23..30
        before = cache_info()
        q, k, v, _ = make_inputs(Case(b=1, hq=1, hk=1, l=l, s=l, e=8), gen)
        ours(q, k, v, None, False)
        after = cache_info()
        assert (after.hits - before.hits, after.misses - before.misses) == ((1, 0) if hit else (0, 1)), l
        assert after.size <= 8
