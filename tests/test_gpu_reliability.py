"""GPU hardening tests: CUDA stream stress, CUDA graph capture, out of memory, multi-GPU device
mapping and memory flatness. Skipped without a CUDA device (flash / decode cases also without
jax-triton; multi-GPU cases without two GPUs).

Run with `pytest -s tests/test_gpu_reliability.py`: every test prints one or more lines starting
with "RELIABILITY " (iterations, mismatches, memory figures, exception types) for the log.

Oracle: torch's SDPA math backend in float32 on the same (bf16) inputs; a result matches when its
max abs error is at most 2x torch's own worst bf16 error (math backend and plain bf16 torch ops)
against that reference, plus FLOOR.

1. Stream stress: inputs (and grad_output) are written by torch kernels on a side stream s1, after
   a spin kernel that delays them; the jaxattn call is made with s1 current; the results are
   checked by kernels on a third stream s2 after `s2.wait_stream(s1)`. Consecutive iterations use
   different inputs from a pool, so a read of stale or half-written inputs, or a consumer not
   ordered after JAX's kernels, shows as a mismatch. (This is also the "CUDA graphs disabled"
   case of 2.)
2. CUDA graphs: capturing a jaxattn call in `torch.cuda.graph`, in a subprocess (a crash or a hang
   must not take the test session down): calls through the XLA bridge must raise a clear
   exception, natively launched flash and decode must capture with correct replays (GRAPH_OUTCOME); a crash,
   a hang, an unclear exception, the other outcome or wrong numbers fail.
3. Out of memory: a vanilla call whose (S x L) logits cannot fit raises a memory error; the next
   normal call works and is correct.
4. Multi-GPU: tensors on cuda:1 are computed on JAX's GPU 1 and come back there (forward,
   backward, decode), whatever torch's current device; mixing devices raises an error naming the
   argument.
5. Memory flatness: 10,000 forward calls at one shape leave torch's and JAX's device memory flat.
"""

import contextlib
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from jaxattn.torch_api import decode_attention, sdpa_implementation
from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa

HAS_JAX_TRITON = importlib.util.find_spec("jax_triton") is not None
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_triton = pytest.mark.skipif(not HAS_JAX_TRITON, reason="needs jax-triton (the gpu extra: pip install -e '.[gpu]' in the jaxattn checkout)")
needs_two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA devices")

DEV = "cuda"

FLOOR = 1e-3  # added to 2x torch's bf16 error
STRESS_ITERS = int(os.environ.get("JAXATTN_STRESS_ITERS", "1000"))
FLAT_ITERS = int(os.environ.get("JAXATTN_FLAT_ITERS", "10000"))
POOL = 4  # distinct input sets; iteration i uses entry i % POOL (consecutive iterations differ)
SYNC_EVERY = 64  # outputs are kept alive until s2 has consumed them (see _stress)
SLEEP_CYCLES = 100_000  # spin kernel on s1 before each write (~50 us): widens any race window

SHAPE = (4, 8, 512, 64)  # (B, H, L, E) of the stream stress, bf16
DECODE = dict(b=8, hq=16, hkv=2, s=4096, d=128)  # decode stress: one query vs a 4096-slot BSHD cache

SDPA_IMPLS = ["vanilla", "sdpa", pytest.param("flash", marks=needs_triton)]


def _say(test, **figures):
    print("RELIABILITY " + test + " " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


# ------------------------------------------------------------------ references


# _math: torch SDPA on its math backend; _naive: attention from plain torch ops in the inputs' dtype.
from attention_reference import decode_visibility  # noqa: E402
from test_gpu import _math, _naive  # noqa: E402


def _refs_and_tols(inputs, dout=None, **kw):
    """float32 math-backend reference [out, (dq, dk, dv)] of `inputs` and, per result, the tolerance
    2 * max(torch math bf16 error, plain bf16 ops error) + FLOOR, as 0-dim device tensors."""
    grad = dout is not None
    x32 = [t.detach().float().requires_grad_(grad) for t in inputs]
    ref = _math(*x32, **kw)
    refs = [ref.detach()] + (list(torch.autograd.grad(ref, x32, dout.float())) if grad else [])
    worst = [torch.zeros((), device=ref.device) for _ in refs]
    for fn in (_math, _naive):
        xl = [t.detach().clone().requires_grad_(grad) for t in inputs]
        low = fn(*xl, **kw)
        lows = [low.detach()] + (list(torch.autograd.grad(low, xl, dout)) if grad else [])
        worst = [torch.maximum(w, (lo.float() - r).abs().max()) for w, lo, r in zip(worst, lows, refs)]
    return refs, [2 * w + FLOOR for w in worst]


def _decode_refs_and_tols(q, k_cache, v_cache, lengths):
    kk, vv = (x.transpose(1, 2) for x in (k_cache, v_cache))  # BSHD -> BHSD
    # the single query of sequence b sees cache positions [0, lengths[b])
    mask = decode_visibility(lengths, None, 1, k_cache.shape[1])
    return _refs_and_tols([q, kk, vv], attn_mask=mask, enable_gqa=True)


def _errors(outs, refs, tols):
    return [((o.float() - r).abs().max() / t).item() for o, r, t in zip(outs, refs, tols)]


def _check_pool_separation(refs, tols):
    """A stale read (the previous iteration's inputs) must be detectable: neighbouring pool
    entries' references differ by far more than the tolerance."""
    for i in range(len(refs)):
        j = (i + 1) % len(refs)
        gap = min((a - b).abs().max().item() for a, b in zip(refs[i], refs[j]))
        tol = max(t.item() for t in tols[i] + tols[j])
        assert gap > 4 * tol, f"pool entries {i} and {j} differ by {gap:.3g}, tolerance {tol:.3g}: test too weak"


def _sleep():
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(SLEEP_CYCLES)


# ------------------------------------------------------------------ 1. stream stress


def _stress(label, pool, refs, tols, bufs, call):
    """Per iteration: on s1 a spin kernel, then pool entry i % POOL copied into `bufs`, then
    `call(*bufs)` (a list of result tensors) with s1 current; on s2, after s2.wait_stream(s1), each
    result compared with its reference. Returns the number of mismatches (NaN counts as one)."""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()
    s1.wait_stream(main)  # pool, buffers and references were made on the main stream
    s2.wait_stream(main)
    with torch.cuda.stream(s2):
        mismatches = torch.zeros((), dtype=torch.int64, device=DEV)
        worst = torch.zeros((), device=DEV)
    alive = []
    start = time.perf_counter()
    for i in range(STRESS_ITERS):
        n = i % len(pool)
        with torch.cuda.stream(s1):
            _sleep()
            with torch.no_grad():  # the buffers may be leaves that require grad
                for buf, src in zip(bufs, pool[n]):
                    buf.copy_(src)
            outs = call(*bufs)
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            for o, r, t in zip(outs, refs[n], tols[n]):
                err = (o.detach().float() - r).abs().max()
                mismatches += (~(err <= t)).long()
                torch.maximum(worst, err / t, out=worst)
        # JAX frees an output's memory as soon as torch drops it and knows nothing of s2's reads
        # (record_stream is a no-op for DLPack tensors): keep results until s2 has read them.
        alive.append(outs)
        if len(alive) >= SYNC_EVERY:
            s2.synchronize()
            alive.clear()
    torch.cuda.synchronize()
    alive.clear()
    elapsed = time.perf_counter() - start
    count = int(mismatches.item())
    _say("stream_stress", **label, iters=STRESS_ITERS, mismatches=count, worst_err_over_tol=f"{worst.item():.3f}",
         seconds=f"{elapsed:.1f}")
    return count


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("impl", SDPA_IMPLS)
def test_stream_stress_sdpa(impl, backward):
    gen = torch.Generator(device=DEV).manual_seed(11 + backward)

    def rand(shape=SHAPE):
        return torch.randn(*shape, generator=gen, device=DEV).bfloat16()

    n_in = 4 if backward else 3  # q, k, v (, grad_output)
    pool = [[rand() for _ in range(n_in)] for _ in range(POOL)]
    refs, tols = zip(*(_refs_and_tols(e[:3], e[3] if backward else None) for e in pool))
    _check_pool_separation(refs, tols)
    bufs = [torch.empty(SHAPE, device=DEV, dtype=torch.bfloat16).requires_grad_(backward and j < 3)
            for j in range(n_in)]
    with sdpa_implementation(impl):  # warm-up (compilation) and a plain correctness check first
        first = jax_sdpa(*pool[0][:3])
        assert max(_errors([first], refs[0][:1], tols[0][:1])) <= 1

        if backward:
            def call(q, k, v, dout):
                out = jax_sdpa(q, k, v)
                return [out, *torch.autograd.grad(out, (q, k, v), dout)]
        else:
            def call(q, k, v):
                return [jax_sdpa(q, k, v)]

        count = _stress(dict(impl=impl, mode="fwd_bwd" if backward else "fwd"), pool, refs, tols, bufs, call)
    assert count == 0


@needs_triton
def test_stream_stress_decode():
    c = DECODE
    gen = torch.Generator(device=DEV).manual_seed(12)

    def entry():
        q = torch.randn(c["b"], c["hq"], 1, c["d"], generator=gen, device=DEV).bfloat16()
        kc, vc = (torch.randn(c["b"], c["s"], c["hkv"], c["d"], generator=gen, device=DEV).bfloat16() for _ in "kv")
        lengths = torch.randint(1, c["s"] + 1, (c["b"],), generator=gen, device=DEV, dtype=torch.int32)
        return [q, kc, vc, lengths]

    pool = [entry() for _ in range(POOL)]
    refs, tols = zip(*(_decode_refs_and_tols(*e) for e in pool))
    _check_pool_separation(refs, tols)
    bufs = [torch.empty_like(t) for t in pool[0]]
    first = decode_attention(*pool[0])
    assert max(_errors([first], refs[0], tols[0])) <= 1

    def call(q, kc, vc, lengths):
        return [decode_attention(q, kc, vc, lengths)]

    assert _stress(dict(impl="decode", mode="fwd"), pool, refs, tols, bufs, call) == 0


# ------------------------------------------------------------------ 2. CUDA graphs

_GRAPH_SCRIPT = r"""
import json, sys, traceback
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from jaxattn.torch_api import decode_attention, scaled_dot_product_attention

impl = sys.argv[1]
torch.manual_seed(0)
dev = "cuda"


def math(*a, **kw):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*a, **kw)


if impl == "decode":
    q = torch.randn(4, 8, 1, 128, device=dev).bfloat16()
    kc, vc = (torch.randn(4, 1024, 2, 128, device=dev).bfloat16() for _ in "kv")
    lengths = torch.tensor([1, 1024, 517, 64], dtype=torch.int32, device=dev)
    inputs = [q, kc, vc]

    def call():
        return decode_attention(q, kc, vc, lengths)

    def reference():
        mask = (torch.arange(1024, device=dev)[None] < lengths[:, None])[:, None, None, :]
        return math(q.float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float(), attn_mask=mask, enable_gqa=True)
else:
    q, k, v = (torch.randn(2, 8, 256, 64, device=dev).bfloat16() for _ in "qkv")
    inputs = [q, k, v]

    def call():
        return scaled_dot_product_attention(q, k, v, implementation=impl)

    def reference():
        return math(q.float(), k.float(), v.float())


def check(make, what):
    try:
        out = make()
        torch.cuda.synchronize()
        err = (out.float() - reference()).abs().max().item()
    except Exception:
        traceback.print_exc()
        print(f"GRAPH check={what} err=raised ok=False", flush=True)
        return
    print(f"GRAPH check={what} err={err:.4g} ok={err < 0.05}", flush=True)  # bf16: garbage is >> 0.05


side = torch.cuda.Stream()  # warm-up on a side stream, as torch's CUDA graph docs ask
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        out = call()
torch.cuda.current_stream().wait_stream(side)
check(lambda: out, "warmup")

graph = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(graph):
        static_out = call()
except Exception as e:
    chain, x = [], e
    while x is not None and len(chain) < 5:
        chain.append(f"{type(x).__module__}.{type(x).__qualname__}: {x}"[:3000])
        x = x.__cause__ or x.__context__
    print("GRAPH outcome=raised", flush=True)
    print("GRAPH exception=" + json.dumps(chain), flush=True)
    traceback.print_exc()
    check(call, "after")
else:
    print("GRAPH outcome=captured", flush=True)
    check(lambda: (graph.replay(), static_out)[1], "replay1")
    for t in inputs:  # new values in the static inputs: a real replay recomputes
        t.copy_(torch.randn_like(t))
    check(lambda: (graph.replay(), static_out)[1], "replay2")
    check(call, "after")
print("GRAPH done", flush=True)
"""

GRAPH_TIMEOUT_S = 150
#: What capturing each implementation's call does. flash and decode run natively (their Triton
#: kernels launched from torch on the capture stream: torch_api/launch.py, torch_api/native_decode.py;
#: the decode call needs no gradient, so it takes the native launch): the capture records them and
#: its replays must recompute correctly. vanilla and sdpa run through the XLA bridge, which refuses a
#: capture before any CUDA work with an error saying so (bridge/dlpack.py).
GRAPH_OUTCOME = {"vanilla": "raised", "sdpa": "raised", "decode": "captured", "flash": "captured"}


def _text(x):
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


@pytest.mark.parametrize("impl", ["vanilla", "sdpa", pytest.param("flash", marks=needs_triton),
                                  pytest.param("decode", marks=needs_triton)])
def test_cuda_graph_capture(impl):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        # -P: the installed jaxattn, not the checkout's jaxattn/ folder (which lacks the layers) from the cwd.
        run = subprocess.run([sys.executable, "-P", "-c", _GRAPH_SCRIPT, impl], env=env, capture_output=True,
                             text=True, timeout=GRAPH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout)
        _say("cuda_graph", impl=impl, outcome="hang", seconds=GRAPH_TIMEOUT_S)
        pytest.fail(f"capturing a jaxattn call ({impl}) hung for {GRAPH_TIMEOUT_S} s; stdout:\n{out[-3000:]}\n"
                    f"stderr tail:\n{_text(e.stderr)[-3000:]}")
    seconds = time.perf_counter() - start
    out, err = run.stdout, run.stderr
    print(out, flush=True)
    checks = dict(re.findall(r"GRAPH check=(\w+) err=\S+ ok=(\w+)", out))
    outcome = re.search(r"GRAPH outcome=(\w+)", out)
    outcome = outcome.group(1) if outcome else f"crash(rc={run.returncode})"
    exc = re.search(r"GRAPH exception=(.*)", out)
    chain = json.loads(exc.group(1)) if exc else []
    _say("cuda_graph", impl=impl, outcome=outcome, rc=run.returncode, seconds=f"{seconds:.1f}",
         exception=json.dumps(chain[0][:300] if chain else None), checks=json.dumps(checks))
    detail = f"rc={run.returncode}\nstdout:\n{out[-3000:]}\nstderr tail:\n{err[-3000:]}"
    assert checks.get("warmup") == "True", f"the uncaptured warm-up call failed or was wrong; {detail}"
    assert run.returncode == 0 and "GRAPH done" in out, f"the process died after the capture; {detail}"
    assert outcome == GRAPH_OUTCOME[impl], (
        f"capturing a jaxattn call ({impl}): outcome {outcome}, expected {GRAPH_OUTCOME[impl]}; {detail}")
    if outcome == "raised":
        text = "\n".join(chain)
        assert "cannot be captured in a CUDA graph" in text, (
            f"capture raised, but the message does not say that CUDA graph capture is the problem: {chain}")
    else:
        assert checks.get("replay1") == "True" and checks.get("replay2") == "True", (
            f"the capture succeeded but replays give wrong results (garbage); {detail}")
    assert checks.get("after") == "True", f"a normal call after the capture attempt failed or was wrong; {detail}"


# ------------------------------------------------------------------ 3. out of memory


def test_out_of_memory_is_a_clear_error_and_the_next_call_works():
    shape = (1, 64, 262144, 128)  # fp32: 8 GiB per input; the (L x S) logits would be 16 TiB
    need = 3 * 64 * 262144 * 128 * 4
    free, total = torch.cuda.mem_get_info()
    if free < need + (8 << 30):
        pytest.skip(f"needs {need / 2**30 + 8:.0f} GiB free for the inputs, {free / 2**30:.0f} GiB free")
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=gen, device=DEV) for _ in "qkv")
    kind, message, is_runtime = None, "", False
    start = time.perf_counter()
    try:
        out = jax_sdpa(q, k, v, implementation="vanilla")
        torch.cuda.synchronize()  # should the failure be asynchronous
        out = out.shape
    except Exception as e:  # noqa: BLE001 - recorded and checked below
        # Only strings are kept: the traceback's frames would pin the 24 GiB of inputs.
        kind = f"{type(e).__module__}.{type(e).__qualname__}"
        message, is_runtime = str(e), isinstance(e, (RuntimeError, MemoryError))
    seconds = time.perf_counter() - start
    del q, k, v
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    _say("oom", type=kind, seconds=f"{seconds:.1f}", message=json.dumps(message[:300]),
         free_gib_before=f"{free / 2**30:.1f}", free_gib_after=f"{torch.cuda.mem_get_info()[0] / 2**30:.1f}")
    assert kind is not None, f"a 16 TiB attention returned a result of shape {out}"
    assert is_runtime, f"unexpected exception type {kind}: {message[:2000]}"
    assert re.search(r"out of memory|resource_exhausted|allocat|memory", message, re.IGNORECASE), (
        f"the error does not say memory ran out: {kind}: {message[:2000]}")

    # The next normal calls work and are correct (forward and backward).
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v = (torch.randn(2, 8, 256, 64, generator=gen, device=DEV).bfloat16().requires_grad_() for _ in "qkv")
    dout = torch.randn(2, 8, 256, 64, generator=gen, device=DEV).bfloat16()
    refs, tols = _refs_and_tols([q, k, v], dout)
    for impl in ("vanilla", None):
        out = jax_sdpa(q, k, v, implementation=impl)
        ratios = _errors([out, *torch.autograd.grad(out, (q, k, v), dout)], refs, tols)
        _say("oom_next_call", impl=impl or "auto", worst_err_over_tol=f"{max(ratios):.3f}")
        assert max(ratios) <= 1, (impl, ratios)
    torch.cuda.empty_cache()


# ------------------------------------------------------------------ 4. multi-GPU

# (device of the tensors, torch's current device during the call)
PLACEMENTS = [(1, 0), (1, 1), (0, 1)]


def _placement_id(p):
    return f"tensors_cuda{p[0]}-current_cuda{p[1]}"


@needs_two_gpus
@pytest.mark.parametrize("placement", PLACEMENTS, ids=_placement_id)
@pytest.mark.parametrize("impl", SDPA_IMPLS)
def test_multi_gpu_sdpa_runs_on_the_tensors_gpu(impl, placement):
    from jaxattn.bridge.devices import to_jax_device

    index, current = placement
    dev = torch.device("cuda", index)
    assert to_jax_device(dev).local_hardware_id == index
    with torch.cuda.device(current):
        gen = torch.Generator(device=dev).manual_seed(20 + index)
        q, k, v = (torch.randn(2, 8, 300, 64, generator=gen, device=dev).bfloat16().requires_grad_() for _ in "qkv")
        dout = torch.randn(2, 8, 300, 64, generator=gen, device=dev).bfloat16()
        refs, tols = _refs_and_tols([q, k, v], dout, is_causal=True)
        out = jax_sdpa(q, k, v, is_causal=True, implementation=impl)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        assert torch.cuda.current_device() == current
        torch.cuda.synchronize(dev)
    assert out.device == dev and all(g.device == dev for g in grads), (out.device, [g.device for g in grads])
    ratios = _errors([out, *grads], refs, tols)
    _say("multi_gpu", impl=impl, tensors=str(dev), current=f"cuda:{current}",
         worst_err_over_tol=f"{max(ratios):.3f}")
    assert max(ratios) <= 1, ratios


@needs_two_gpus
@needs_triton
@pytest.mark.parametrize("placement", PLACEMENTS[:2], ids=_placement_id)
def test_multi_gpu_decode_with_cache_on_cuda1(placement):
    index, current = placement
    dev = torch.device("cuda", index)
    with torch.cuda.device(current):
        gen = torch.Generator(device=dev).manual_seed(30)
        q = torch.randn(4, 8, 1, 128, generator=gen, device=dev).bfloat16()
        kc, vc = (torch.randn(4, 1024, 2, 128, generator=gen, device=dev).bfloat16() for _ in "kv")
        lengths = torch.tensor([1, 1024, 517, 64], dtype=torch.int32, device=dev)
        refs, tols = _decode_refs_and_tols(q, kc, vc, lengths)
        out = decode_attention(q, kc, vc, lengths)
        torch.cuda.synchronize(dev)
    assert out.device == dev
    ratios = _errors([out], refs, tols)
    _say("multi_gpu", impl="decode", tensors=str(dev), current=f"cuda:{current}",
         worst_err_over_tol=f"{max(ratios):.3f}")
    assert max(ratios) <= 1, ratios


@needs_two_gpus
def test_multi_gpu_mixed_devices_raise_an_error_naming_the_argument():
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    q0, k0, v0 = (torch.randn(1, 2, 16, 64, device=d0).bfloat16() for _ in "qkv")
    k1, v1 = k0.to(d1), v0.to(d1)
    mask1 = torch.ones(16, 16, dtype=torch.bool, device=d1)
    cache0, cache1 = (torch.randn(1, 32, 2, 64, device=d).bfloat16() for d in (d0, d1))
    lengths0, lengths1 = (torch.tensor([32], dtype=torch.int32, device=d) for d in (d0, d1))
    q1 = torch.randn(1, 2, 1, 64, device=d1).bfloat16()
    cases = {
        # name: (call, words the message must contain)
        "sdpa_key_on_cuda1": (lambda: jax_sdpa(q0, k1, v0), ["key", "cuda:0", "cuda:1"]),
        "sdpa_key_value_on_cuda1": (lambda: jax_sdpa(q0, k1, v1), ["key", "value", "cuda:0", "cuda:1"]),
        "sdpa_mask_on_cuda1": (lambda: jax_sdpa(q0, k0, v0, attn_mask=mask1), ["attn_mask", "cuda:0", "cuda:1"]),
        "decode_k_cache_on_cuda0": (lambda: decode_attention(q1, cache0, cache1, lengths1),
                                    ["k_cache", "cuda:0", "cuda:1"]),
        "decode_seqlens_on_cuda0": (lambda: decode_attention(q1, cache1, cache1, lengths0),
                                    ["cache_seqlens", "cuda:0", "cuda:1"]),
    }
    for name, (call, words) in cases.items():
        with pytest.raises((ValueError, RuntimeError)) as info:
            call()
        message = str(info.value)
        _say("multi_gpu_mixed", case=name, type=type(info.value).__name__, message=json.dumps(message[:200]))
        assert all(w in message for w in words), f"{name}: {message!r} should name {words}"
    # Nothing is left broken: plain calls on either GPU still work.
    for q, k, v in ((q0, k0, v0), (q0.to(d1), k1, v1)):
        refs, tols = _refs_and_tols([q, k, v])
        out = jax_sdpa(q, k, v)
        assert out.device == q.device
        assert max(_errors([out], refs, tols)) <= 1


# ------------------------------------------------------------------ 5. memory flatness


def _rss_mib():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def _memory():
    """(torch bytes allocated, JAX bytes in use or None) on cuda:0, after all work and frees."""
    from jaxattn.bridge.devices import to_jax_device

    gc.collect()
    torch.cuda.synchronize()
    time.sleep(0.2)  # let JAX's deferred frees of dropped buffers land
    stats = to_jax_device(torch.device("cuda", 0)).memory_stats() or {}
    return torch.cuda.memory_allocated(0), stats.get("bytes_in_use")


@pytest.mark.parametrize("impl", SDPA_IMPLS + [pytest.param("decode", marks=needs_triton)])
def test_memory_is_flat_over_many_calls(impl):
    gen = torch.Generator(device=DEV).manual_seed(40)
    if impl == "decode":
        q = torch.randn(8, 16, 1, 128, generator=gen, device=DEV).bfloat16()
        kc, vc = (torch.randn(8, 2048, 2, 128, generator=gen, device=DEV).bfloat16() for _ in "kv")
        lengths = torch.randint(1, 2049, (8,), generator=gen, device=DEV, dtype=torch.int32)

        def call():
            return decode_attention(q, kc, vc, lengths)
    else:
        q, k, v = (torch.randn(2, 8, 256, 64, generator=gen, device=DEV).bfloat16() for _ in "qkv")

        def call():
            return jax_sdpa(q, k, v, implementation=impl)

    with torch.cuda.device(0):
        for _ in range(100):  # warm-up: compilation, plans, lazily made workspaces
            out = call()
        first = out.float().sum().item()
        del out
        torch_before, jax_before = _memory()
        rss_before = _rss_mib()
        start = time.perf_counter()
        for _ in range(FLAT_ITERS):
            out = call()
        last = out.float().sum().item()
        del out
        seconds = time.perf_counter() - start
        torch_after, jax_after = _memory()
        rss_after = _rss_mib()
    torch_delta = torch_after - torch_before
    jax_delta = None if jax_before is None or jax_after is None else jax_after - jax_before
    _say("memory_flat", impl=impl, iters=FLAT_ITERS, seconds=f"{seconds:.1f}",
         us_per_call=f"{seconds / FLAT_ITERS * 1e6:.0f}",
         torch_allocated_before=torch_before, torch_allocated_after=torch_after, torch_delta=torch_delta,
         jax_bytes_in_use_before=jax_before, jax_bytes_in_use_after=jax_after, jax_delta=jax_delta,
         host_rss_mib_before=f"{rss_before:.0f}", host_rss_mib_after=f"{rss_after:.0f}")
    assert first == last  # same inputs, deterministic kernels
    assert abs(torch_delta) <= 1 << 20, f"torch allocated {torch_delta} more bytes over {FLAT_ITERS} calls"
    if jax_delta is not None:  # 2 MiB: a leak of one 256-byte block per call would show
        assert abs(jax_delta) <= 2 << 20, f"JAX holds {jax_delta} more bytes over {FLAT_ITERS} calls"
