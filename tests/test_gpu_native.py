"""The native launcher on CUDA: streams, CUDA graphs, torch.compile and transformers' static cache;
the decode kernels launched from torch too.

Skipped without a CUDA device. The oracle is the same call through torch's own SDPA (or the eager
native call where the point is that a captured or compiled call replays it exactly); for decode,
the float64 reference of tests/attention_reference.py and the JAX launcher's bits.
"""

import pytest
import torch
import torch.nn.functional as F

from jaxattn.bridge import cache_info
from jaxattn.torch_api import (decode_attention, flash_attention, register_transformers, scaled_dot_product_attention,
                               sdpa_launcher)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEV = "cuda"


def _qkv(b=2, hq=8, hk=2, l=97, s=97, d=64, dtype=torch.bfloat16, seed=0, grad=False):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, device=DEV, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(b, hq, l, d), make(b, hk, s, d), make(b, hk, s, d)


def test_automatic_selection_runs_natively_without_xla():
    q, k, v = _qkv(grad=True)
    before = cache_info()
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.float().sum().backward()
    assert cache_info() == before
    ref = F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_repeated_eager_calls_take_the_direct_launch(monkeypatch):
    """After the first call, every launch of an eager forward and backward (the backward runs on
    autograd's device thread) goes straight to the compiled kernel, not through Triton's binder."""
    from jaxattn.bridge.triton_launch import KernelLaunch
    from jaxattn.torch_api import sdpa as sdpa_module

    monkeypatch.setenv("JAXATTN_TRITON_PROGRAMS", "0")  # the default Python launch path (the compiled one is tested below)
    monkeypatch.setattr(sdpa_module, "_prepared", {})
    q, k, v = _qkv(b=1, hq=4, hk=2, l=128, s=128, grad=True)
    call = lambda: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa: E731
    call().float().sum().backward()
    direct, binder = [], []
    fast = KernelLaunch._fast
    monkeypatch.setattr(KernelLaunch, "_fast", lambda self, *a: (direct.append(1), fast(self, *a))[1])
    monkeypatch.setattr(KernelLaunch, "_kwargs", lambda self, t: binder.append(1) or dict(zip(self.tensors, t), **self.scalars))
    out = call()
    out.float().sum().backward()
    assert binder == [] and len(direct) == 4  # forward, Delta, dK/dV, dQ
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                               rtol=2e-2, atol=2e-2)


def test_compiled_program_replays_the_launches_bit_for_bit(monkeypatch):
    """Once its kernels are compiled, a signature's calls run as a compiled program (C++ autograd
    node, no Python per launch): forward, gradients (for the planned gradient layout and another
    one) and the no-grad forward equal the Python launch path's bit for bit; a second-order
    backward raises; CUDA-graph capture replays it."""
    from jaxattn.bridge import triton_program
    from jaxattn.torch_api import sdpa as sdpa_module

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    assert triton_program.wait(600), triton_program.build_error()
    monkeypatch.setattr(sdpa_module, "_prepared", {})
    gen = torch.Generator(device=DEV).manual_seed(7)
    b, hq, hk, l, d = 2, 8, 4, 97, 80
    base = [torch.randn(b, l, h, d, generator=gen, device=DEV, dtype=torch.bfloat16) for h in (hq, hk, hk)]
    cot = torch.randn(b, l, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16)

    def step(cotangent):
        q, k, v = (t.detach().transpose(1, 2).requires_grad_(True) for t in base)
        with sdpa_launcher("native"):
            out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(cotangent)
        return out.detach(), q.grad, k.grad, v.grad

    python_path = step(cot.transpose(1, 2))  # the first call plans and compiles, on the Python path
    prepared = next(p for p in sdpa_module._prepared.values() if p.native_call is not None)
    assert isinstance(prepared.native_call._programs.get("train"), int)
    called = []
    real_apply = triton_program.apply
    monkeypatch.setattr(triton_program, "apply", lambda *a: called.append(1) or real_apply(*a))
    compiled = step(cot.transpose(1, 2))
    assert called, "the compiled program did not run"
    for name, got, want in zip(("out", "dq", "dk", "dv"), compiled, python_path):
        assert torch.equal(got, want), name
    other_layout = step(cot.transpose(1, 2).contiguous())  # a dense (B, H, L, D) gradient is read in the planned layout
    for name, got, want in zip(("out", "dq", "dk", "dv"), other_layout, python_path):
        assert torch.equal(got, want), name

    q, k, v = (t.detach().transpose(1, 2).requires_grad_(True) for t in base)
    with sdpa_launcher("native"):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with pytest.raises(NotImplementedError, match="create_graph=True"):
        torch.autograd.grad(out.float().square().sum(), [q], create_graph=True)

    q, k, v = (t.transpose(1, 2) for t in base)
    with torch.no_grad(), sdpa_launcher("native"):
        first = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        again = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert torch.equal(first, python_path[0]) and torch.equal(again, python_path[0])
        static = [t.clone() for t in base]
        views = [t.transpose(1, 2) for t in static]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = scaled_dot_product_attention(*views, is_causal=True, enable_gqa=True)
        fresh = [torch.randn_like(t) for t in base]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        want = scaled_dot_product_attention(*(t.transpose(1, 2) for t in fresh), is_causal=True, enable_gqa=True)
    torch.cuda.synchronize()
    assert torch.equal(captured, want)


def test_decoding_steps_run_compiled_programs_with_their_lengths(monkeypatch):
    """Decoding calls (shape-dynamic kernels, whose sizes and strides are runtime integers) run as
    compiled programs after a length's first call: every layer's call at that length equals the
    Python launch path's bit for bit and torch's SDPA, across lengths crossing multiples of 16 and a
    transposed cache."""
    from jaxattn.bridge import triton_program
    from jaxattn.torch_api import sdpa as sdpa_module
    from jaxattn.torch_api.native_flash import flash_forward

    monkeypatch.setenv(triton_program.ENV_SWITCH, "1")
    assert triton_program.wait(600), triton_program.build_error()
    monkeypatch.setattr(sdpa_module, "_prepared", {})
    monkeypatch.setattr(sdpa_module, "_prepared_decoding", {})
    gen = torch.Generator(device=DEV).manual_seed(9)
    b, hq, hk, d = 3, 32, 8, 64
    cache = [torch.randn(b, 300, hk, d, generator=gen, device=DEV, dtype=torch.bfloat16) for _ in "kv"]
    called = []
    real = triton_program.forward_only
    monkeypatch.setattr(triton_program, "forward_only", lambda *a: called.append(1) or real(*a))
    for s in (130, 131, 144, 145, 160, 299):
        q = torch.randn(b, 1, hq, d, generator=gen, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        k, v = (c[:, :s].transpose(1, 2) for c in cache)
        with torch.no_grad():
            layers = [scaled_dot_product_attention(q, k, v, enable_gqa=True) for _ in range(3)]
        prepared = next(p for p in sdpa_module._prepared.values() if p.native is not None and p.seq_k == s)
        with torch.no_grad():
            python_path = flash_forward(q, k, v, prepared.native)[0]  # the op's Python launch path
        for out in layers:
            assert torch.equal(out, python_path), s
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(python_path, want, rtol=2e-2, atol=2e-2)
    assert len(called) >= 2 * 6, "decoding calls did not run as compiled programs"


def test_growing_cache_reuses_compilations_and_matches_torch(monkeypatch):
    """A decode call per cache length (lengths divisible by 16 and not, strides changing with them):
    each equals torch's SDPA, and the kernels are compiled/bound by Triton only a few times (a new
    length reuses the compiled kernel of its specialization)."""
    from jaxattn.bridge.triton_launch import KernelLaunch

    gen = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn(2, 1, 8, 64, generator=gen, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    cache = torch.randn(2, 1200, 2, 64, generator=gen, device=DEV, dtype=torch.bfloat16)
    binder = []
    kwargs = KernelLaunch._kwargs
    monkeypatch.setattr(KernelLaunch, "_kwargs", lambda self, t: binder.append(1) or kwargs(self, t))
    for s in range(1000, 1041):
        k = cache[:, :s].transpose(1, 2).contiguous()  # a new (B, Hk, S, D) tensor per step, as a grown cache
        v = cache[:, 100:100 + s].transpose(1, 2)       # a strided view
        out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2, msg=f"S={s}")
    assert len(binder) <= 6, len(binder)


def test_side_stream_inputs_consumed_at_once():
    """Inputs written on a side stream, the call and its consumer on that stream: 1000 iterations
    equal the reference (a kernel on the wrong stream would read half-written inputs)."""
    q0, k0, v0 = _qkv(b=1, hq=4, hk=4, l=256, s=256)
    ref = scaled_dot_product_attention(q0, k0, v0, is_causal=True)
    side = torch.cuda.Stream()
    bad = torch.zeros((), device=DEV, dtype=torch.int32)
    with torch.cuda.stream(side):
        for i in range(1000):
            q = q0 * 1.0 if i % 2 == 0 else q0.clone()
            k, v = k0 + 0.0, v0.clone()
            out = scaled_dot_product_attention(q, k, v, is_causal=True)
            bad += (out != ref).any().int()
    torch.cuda.synchronize()
    assert bad.item() == 0


def test_cuda_graph_capture_and_replay():
    q, k, v = _qkv(b=2, hq=4, hk=2, l=128, s=128, grad=True)
    dout = torch.randn(2, 4, 128, 64, device=DEV, dtype=torch.bfloat16)

    def step():
        out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (1, 2):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, generator=gen, device=DEV, dtype=t.dtype))
        graph.replay()
        eager = step()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_torch_compile_fullgraph(mode):
    q, k, v = _qkv(b=2, hq=4, hk=2, l=130, s=130, grad=True)
    mask = torch.rand(2, 1, 130, 130, device=DEV) > 0.2

    def f(q, k, v):
        a = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        c = flash_attention(q, k, v, causal=True, causal_alignment="bottom_right", window=(32, 0), softcap=20.0)
        return (a.float() + b.float() + c.float()).square().sum()

    compiled = torch.compile(f, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a CUDA graph after warm-up runs
        loss = compiled(q, k, v)
        grads = torch.autograd.grad(loss, (q, k, v))
    want = f(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v))
    torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)


def test_torch_compile_dynamic_shapes_one_graph():
    """torch.compile(dynamic=True, fullgraph=True) over native calls: one graph serves every length
    (L and S apart, causal and masked, forward and gradients), each call equal to the eager call."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")

    def f(q, k, v, mask):
        a = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return (a.float() + b.float()).square().sum()

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend=counter)
    for i, (l, s) in enumerate(((97, 130), (130, 97), (33, 1025), (200, 200))):
        q, k, v = _qkv(b=2, hq=4, hk=2, l=l, s=s, grad=True)
        mask = torch.rand(2, 1, l, s, device=DEV) > 0.2
        loss = compiled(q, k, v, mask)
        if i == 0:  # Dynamo may call the backend twice for the first (a restart for symbolic floats)
            first = counter.frame_count
        grads = torch.autograd.grad(loss, (q, k, v))
        want = f(q, k, v, mask)
        want_grads = torch.autograd.grad(want, (q, k, v))
        torch.testing.assert_close(loss, want, rtol=1e-3, atol=1e-3)
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2)
    assert counter.frame_count == first, f"{counter.frame_count - first} recompilations"


def test_transformers_static_cache_generation():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                      max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config).to(DEV, torch.bfloat16).eval()
    name = register_transformers()
    prompt = torch.randint(0, 1000, (2, 24), device=DEV)
    tokens = {}
    for impl in ("sdpa", name):
        model.set_attn_implementation(impl)
        for cache in ("dynamic", "static"):
            kw = dict(cache_implementation="static") if cache == "static" else {}
            tokens[impl, cache] = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                                 pad_token_id=0, **kw)
    # bf16 logits can tie differently; the first tokens must agree
    for cache in ("dynamic", "static"):
        assert torch.equal(tokens["sdpa", cache][:, :28], tokens[name, cache][:, :28])


def test_xla_launcher_forced_for_parity_work():
    q, k, v = _qkv()
    before = cache_info()
    with sdpa_launcher("xla"):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, implementation="flash")
    assert cache_info().misses + cache_info().hits > before.misses + before.hits
    native = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, implementation="flash")
    assert torch.equal(out, native)  # one kernel source, two launchers, the same bits


# --- decode: the decode kernels launched from torch (torch_api/native_decode.py) ------------------


def _decode_inputs(layout, *, t=1, seed=0, b=5, hq=16, hkv=4, s=1008, d=128, dtype=torch.bfloat16):
    """q (B, Hq, T, D), the cache in `layout` (ragged lengths with starts; paged: 16-position pages
    in a shuffled order), its dense (B, S, Hkv, D) twin for the oracle, and (Hq,) sink logits."""
    from decode_cases import layout_cache, ragged_cache

    gen = torch.Generator(device=DEV).manual_seed(seed)
    lengths = torch.tensor([1, s, 517, 0, 64], dtype=torch.int32, device=DEV)[:b]
    starts = torch.tensor([0, 0, 100, 0, 63], dtype=torch.int32, device=DEV)[:b]
    q = torch.randn(b, hq, t, d, generator=gen, device=DEV).to(dtype)
    k, v = ragged_cache(gen, b, s, hkv, d, lengths, starts, dtype=dtype, device=DEV)
    k, v = torch.nan_to_num(k), torch.nan_to_num(v)
    kc, vc, table = layout_cache(k, v, layout, gen=gen, page_size=16)
    sinks = torch.randn(hq, generator=gen, device=DEV)
    return q, kc, vc, table, lengths, starts, sinks, (k, v)


def _needs_jax_triton():
    import importlib.util

    if importlib.util.find_spec("jax_triton") is None:
        pytest.skip("the XLA decode path on CUDA needs jax-triton (the gpu extra: pip install -e '.[gpu]')")


@pytest.mark.parametrize("layout,t", [("BSHD", 1), ("BHSD", 1), ("paged", 1), ("paged", 4)])
def test_native_decode_bit_identical_to_the_jax_launch(layout, t):
    """bf16, GQA, ragged lengths with starts, window, soft cap and sinks: the torch launcher (the
    default on CUDA, no XLA executable) and the JAX launcher (forced with sdpa_launcher("xla")) run
    the same kernels with the same plan and give the same bits; both meet the float64 oracle."""
    from attention_reference import assert_dtype_rule, decode_reference

    _needs_jax_triton()
    q, kc, vc, table, lengths, starts, sinks, (k, v) = _decode_inputs(layout, t=t, seed=len(layout) + t)
    kw = dict(cache_starts=starts, block_table=table, window=300, softcap=30.0, sinks=sinks, return_lse=True,
              cache_layout="BHSD" if layout == "BHSD" else "BSHD")
    before = cache_info()
    out, lse = decode_attention(q, kc, vc, lengths, **kw)
    assert cache_info() == before, "an XLA executable ran for a native decode call"
    with sdpa_launcher("xla"):
        xla_out, xla_lse = decode_attention(q, kc, vc, lengths, **kw)
    after = cache_info()
    assert after.hits + after.misses > before.hits + before.misses
    assert torch.equal(out, xla_out) and torch.equal(lse, xla_lse)
    ref, _ = decode_reference(q, k, v, lengths, starts, window=300, softcap=30.0, sinks=sinks)
    low, _ = decode_reference(q, k, v, lengths, starts, window=300, softcap=30.0, sinks=sinks, dtype=torch.bfloat16)
    assert_dtype_rule("out", out, ref, low, floor=1e-3)


def test_repeated_native_decode_calls_take_the_direct_launch(monkeypatch):
    """After the first call of a signature, a decode step's three launches (segment table, stream
    kernel, merge) go straight to the compiled kernels: no planning, no Triton argument binding."""
    from jaxattn.bridge.triton_launch import KernelLaunch
    from jaxattn.torch_api import native_decode

    q, kc, vc, table, lengths, starts, sinks, _ = _decode_inputs("paged")
    call = lambda: decode_attention(q, kc, vc, lengths, cache_starts=starts, block_table=table)  # noqa: E731
    first = call()
    planned, direct, binder = [], [], []
    plan, fast, kwargs = native_decode._plan_launches, KernelLaunch._fast, KernelLaunch._kwargs
    monkeypatch.setattr(native_decode, "_plan_launches", lambda *a: planned.append(1) or plan(*a))
    monkeypatch.setattr(KernelLaunch, "_fast", lambda self, *a: (direct.append(1), fast(self, *a))[1])
    monkeypatch.setattr(KernelLaunch, "_kwargs", lambda self, t: binder.append(1) or kwargs(self, t))
    lengths.add_(3).clamp_(max=kc.shape[1] * table.shape[1])  # the next step's lengths, in place
    again = call()
    assert planned == [] and binder == [] and len(direct) == 3
    assert not torch.equal(first, again)


@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_native_decode_under_torch_compile_fullgraph(mode):
    """A compiled decode step (paged, sinks, window) equals the eager native call bit for bit, with
    new lengths each call and no XLA executable."""
    q, kc, vc, table, lengths, starts, sinks, _ = _decode_inputs("paged", t=2, seed=9)

    def step(q, kc, vc, lengths, starts, table, sinks):
        out, lse = decode_attention(q, kc, vc, lengths, cache_starts=starts, block_table=table, sinks=sinks,
                                    window=200, return_lse=True)
        return out.float() * 2, lse

    compiled = torch.compile(step, fullgraph=True, mode=mode)
    before = cache_info()
    for shift in (0, 5, 40):  # reduce-overhead records a CUDA graph after warm-up runs
        new_lengths = (lengths + shift).clamp(max=kc.shape[1] * table.shape[1])
        got = compiled(q, kc, vc, new_lengths, starts, table, sinks)
        want = step(q, kc, vc, new_lengths, starts, table, sinks)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"shift {shift}"
    assert cache_info() == before


def test_native_decode_cuda_graph_replays_with_new_lengths():
    """A captured decode step replays with the lengths (and queries) written in place between
    replays: the segment table is computed on the device from the lengths of the replay."""
    q, kc, vc, table, lengths, starts, sinks, _ = _decode_inputs("BSHD", t=1, seed=4)
    static_lengths = lengths.clone()

    def call():
        return decode_attention(q, kc, vc, static_lengths, cache_starts=starts, sinks=sinks, window=400,
                                return_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for seed in (1, 2):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        static_lengths.copy_(torch.randint(0, kc.shape[1] + 1, lengths.shape, generator=gen, device=DEV,
                                           dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=gen, device=DEV, dtype=q.dtype))
        graph.replay()
        eager = call()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want), f"replay {seed}"
