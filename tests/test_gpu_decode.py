"""Decode attention on CUDA via the torch API: the CPU grid (cache layouts, GQA 1/4/8, q_len 1/4,
ragged lengths incl. 1 and S_max and an empty sequence, window, soft cap, sinks, ALiBi) in bf16/fp16, with
flash-attn's rule: our error against a float64 reference is at most twice torch's error in the same
dtype, plus 1e-3. Calls without gradients launch the Triton kernels from torch (triton, which the
test extra installs on Linux, is all they need); the call with gradients runs the XLA path, whose
Triton kernels go through jax-triton with JAX on the GPU. Skipped without a CUDA device or triton;
the XLA-path test also without jax-triton or JAX on the GPU."""

import importlib.util
import os
import sys

import jax
import pytest
import torch
import torch.nn.functional as F

from attention_reference import assert_dtype_rule, decode_alibi, decode_reference
from decode_cases import layout_cache, ragged_cache

from jaxattn.torch_api import KVCache, decode_attention, scaled_dot_product_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="needs triton (the test extra: pip install -e '.[test]' in the jaxattn checkout)"),
]
# A decode call that needs gradients runs the XLA path: JAX on the GPU launching the kernels through jax-triton.
XLA_PATH_ON_GPU = (torch.cuda.is_available() and importlib.util.find_spec("jax_triton") is not None
                   and jax.default_backend() == "gpu")
needs_xla_path = pytest.mark.skipif(
    not XLA_PATH_ON_GPU, reason="the call with gradients runs the XLA path: needs jax-triton and JAX on the GPU "
                                "(the gpu extra: pip install -e '.[gpu]' in the jaxattn checkout, and a CUDA jaxlib)")

DEV = "cuda"
B, HKV, S = 5, 2, 1008  # S a multiple of the page size (16)
LENGTHS = [1, S, 517, 0, 64]  # length 1, a full cache, ragged, empty, one key block
STARTS = [0, 0, 100, 0, 63]

# (layout, GQA ratio, q_len, window, softcap, sinks, head dim)
CASES = [
    ("BSHD", 1, 1, None, None, False, 128),
    ("BSHD", 4, 4, 200, None, True, 128),
    ("BSHD", 8, 1, None, 30.0, False, 64),
    ("BHSD", 4, 1, None, None, True, 128),
    ("BHSD", 8, 4, 64, 20.0, True, 128),
    ("BHSD", 1, 4, None, None, False, 256),
    ("paged", 1, 1, None, 30.0, True, 128),
    ("paged", 4, 4, None, None, False, 128),
    ("paged", 8, 4, 300, 30.0, True, 80),
]


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_kernels_on_gpu(case, dtype):
    layout, groups, t, window, softcap, with_sinks, d = case
    gen = torch.Generator(device=DEV).manual_seed(sum(map(hash, map(str, case))) % 2**31 + (dtype == torch.float16))
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    starts = torch.tensor(STARTS, dtype=torch.int32, device=DEV)
    hq = HKV * groups
    q = torch.randn(B, hq, t, d, generator=gen, device=DEV).to(dtype)
    k, v = ragged_cache(gen, B, S, HKV, d, lengths, starts, dtype=dtype, device=DEV)
    sinks = torch.randn(hq, generator=gen, device=DEV) if with_sinks else None
    kc, vc, table = layout_cache(k, v, layout, gen=gen, page_size=16)
    kw = dict(window=window, softcap=softcap, sinks=sinks)
    out, lse = decode_attention(q, kc, vc, lengths, cache_starts=starts, block_table=table,
                                cache_layout="BHSD" if layout == "BHSD" else "BSHD", return_lse=True, **kw)
    ref, ref_lse = decode_reference(q, k, v, lengths, starts, **kw)
    low, _ = decode_reference(q, k, v, lengths, starts, dtype=dtype, **kw)
    assert out.dtype == dtype and out.shape == (B, hq, t, d)
    assert torch.isfinite(out).all()
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-2


@pytest.mark.parametrize("launcher", ["auto", "xla"])  # torch's launcher of the kernels, jax-triton's
@pytest.mark.parametrize("layout,per_batch", [("BSHD", True), ("paged", False)])
def test_alibi_on_gpu(layout, per_batch, launcher):
    from jaxattn.torch_api import sdpa_launcher

    gen = torch.Generator(device=DEV).manual_seed(7 + per_batch)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    starts = torch.tensor(STARTS, dtype=torch.int32, device=DEV)
    hq, t, d = 8, 3, 128
    q = torch.randn(B, hq, t, d, generator=gen, device=DEV).bfloat16()
    k, v = ragged_cache(gen, B, S, HKV, d, lengths, starts, dtype=torch.bfloat16, device=DEV)
    kc, vc, table = layout_cache(k, v, layout, gen=gen, page_size=16)
    slopes = 2.0 ** -torch.arange(1, hq + 1, device=DEV, dtype=torch.float32)  # Bloom-style per-head slopes
    slopes = slopes.expand(B, hq).contiguous() * (1 + torch.arange(B, device=DEV)[:, None]) if per_batch else slopes
    kw = dict(window=300, softcap=30.0)
    with sdpa_launcher(launcher):
        out, lse = decode_attention(q, kc, vc, lengths, cache_starts=starts, block_table=table, alibi_slopes=slopes,
                                    return_lse=True, **kw)
    bias = decode_alibi(slopes, lengths, t, S)
    ref, ref_lse = decode_reference(q, k, v, lengths, starts, bias=bias, **kw)
    low, _ = decode_reference(q, k, v, lengths, starts, bias=bias, dtype=torch.bfloat16, **kw)
    assert_dtype_rule("out", out, ref, low, floor=1e-3)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse.double()[finite] - ref_lse[finite]).abs().max().item() < 1e-2


def test_float32_on_gpu():
    gen = torch.Generator(device=DEV).manual_seed(3)
    lengths = torch.tensor(LENGTHS, dtype=torch.int32, device=DEV)
    starts = torch.tensor(STARTS, dtype=torch.int32, device=DEV)
    q = torch.randn(B, 8, 4, 64, generator=gen, device=DEV)
    k, v = ragged_cache(gen, B, S, HKV, 64, lengths, starts, device=DEV)
    out = decode_attention(q, k, v, lengths, cache_starts=starts, window=300, softcap=20.0)
    ref, _ = decode_reference(q, k, v, lengths, starts, window=300, softcap=20.0)
    assert _err(out, ref) < 2e-4  # tf32x3 dots


@needs_xla_path
def test_sdpa_drop_in_decoding_call_is_right_automatic_or_forced_to_decode():
    gen = torch.Generator(device=DEV).manual_seed(4)
    q = torch.randn(2, 8, 1, 128, generator=gen, device=DEV).bfloat16().requires_grad_()
    k, v = (torch.randn(2, 2, 700, 128, generator=gen, device=DEV).bfloat16().requires_grad_() for _ in "kv")
    ref = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), enable_gqa=True)
    low = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    dout = torch.randn(ref.shape, generator=gen, device=DEV).bfloat16()
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    low_grads = torch.autograd.grad(low, (q, k, v), dout)
    # Automatic selection runs one query against 700 keys on the native flash kernel (README's
    # selection table); forced, the XLA decode kernel. Both must meet the dtype rule, gradients too.
    for implementation in (None, "decode"):
        out = scaled_dot_product_attention(q, k, v, enable_gqa=True, implementation=implementation)
        assert_dtype_rule(f"out ({implementation})", out, ref, low, floor=1e-3)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        for name, g, rg, lg in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads):
            assert_dtype_rule(f"{name} ({implementation})", g, rg, lg, floor=1e-3)


@pytest.mark.parametrize("paged", [False, True])
def test_kv_cache_on_gpu(paged):
    gen = torch.Generator(device=DEV).manual_seed(5 + paged)
    b, hq, hkv, d = 3, 16, 4, 128
    cache = (KVCache.paged(b, 300, hkv, d, page_size=16, dtype=torch.bfloat16, device=DEV) if paged
             else KVCache.contiguous(b, 300, hkv, d, dtype=torch.bfloat16, device=DEV))
    cache.key.fill_(float("nan"))
    cache.value.fill_(float("nan"))
    cache.set_starts([3, 0, 40])
    ks, vs = [], []
    for t in (100, 1, 1, 4, 1):
        k, v = (torch.randn(b, hkv, t, d, generator=gen, device=DEV).bfloat16() for _ in "kv")
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    q = torch.randn(b, hq, 1, d, generator=gen, device=DEV).bfloat16()
    dense_k, dense_v = (torch.cat(x, dim=2).transpose(1, 2) for x in (ks, vs))
    lengths = torch.full((b,), 107, dtype=torch.int32, device=DEV)
    ref, _ = decode_reference(q, dense_k, dense_v, lengths, cache.starts)
    low, _ = decode_reference(q, dense_k, dense_v, lengths, cache.starts, dtype=torch.bfloat16)
    assert_dtype_rule("out", cache.attend(q), ref, low, floor=1e-3)


def test_generate_tiny_example_on_gpu(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        import generate_tiny
    finally:
        sys.path.pop(0)
    assert generate_tiny.main(["--device", DEV, "--steps", "12"]) == 0
    assert capsys.readouterr().out.count("tokens match torch SDPA") == 2
