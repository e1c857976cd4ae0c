"""CUDA acceptance tests: parity in bf16/fp16, stream ordering, zero-copy, memory sharing.

Skipped without a CUDA device. Run on a GPU machine with `pytest tests/test_gpu.py`.
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_reference import assert_dtype_rule, reference

import jaxattn.bridge as bridge
from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = "cuda"


def _math(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def _naive(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):
    """Attention from plain torch ops in the inputs' dtype: the oracle's math (tests/attention_reference.py)
    run in q's dtype, with SDPA's arguments (a bool attn_mask hides keys, a float one is added)."""
    if not enable_gqa and q.shape[-3] != k.shape[-3]:
        raise ValueError("different head counts need enable_gqa=True (as for torch's SDPA)")
    kw = {} if attn_mask is None else {"mask" if attn_mask.dtype == torch.bool else "bias": attn_mask}
    return reference(q, k, v, causal=is_causal, dtype=q.dtype, **kw)[0]


def _inputs(gen, b, hq, hk, l, s, e, dtype, requires_grad=False):
    def make(*shape):
        return torch.randn(*shape, generator=gen, device=DEV, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)

    return make(b, hq, l, e), make(b, hk, s, e), make(b, hk, s, e)


CASES = [
    dict(b=2, hq=8, hk=8, l=97, s=1025, e=80, is_causal=False),
    dict(b=2, hq=8, hk=8, l=128, s=128, e=128, is_causal=True),
    dict(b=1, hq=8, hk=2, l=97, s=130, e=64, is_causal=True, enable_gqa=True),
    dict(b=2, hq=4, hk=4, l=97, s=130, e=64, mask="bool"),
    dict(b=2, hq=4, hk=4, l=97, s=130, e=64, mask="float"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("implementation", [None, "sdpa", "vanilla"])
def test_parity_low_precision(case, dtype, implementation):
    gen = torch.Generator(device=DEV).manual_seed(hash((str(case), str(dtype))) % 2**31)
    case = dict(case)
    mask_kind = case.pop("mask", None)
    b, hq, hk, l, s, e = (case.pop(k) for k in ("b", "hq", "hk", "l", "s", "e"))
    q, k, v = _inputs(gen, b, hq, hk, l, s, e, dtype, requires_grad=True)
    if mask_kind == "bool":
        case["attn_mask"] = torch.rand(b, 1, l, s, generator=gen, device=DEV) > 0.3
    elif mask_kind == "float":
        case["attn_mask"] = torch.randn(1, hq, l, s, generator=gen, device=DEV).to(dtype)
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    kw32 = dict(case)
    if mask_kind == "float":
        kw32["attn_mask"] = case["attn_mask"].float()
    ref = _math(q32, k32, v32, **kw32)
    dout = torch.randn(ref.shape, generator=gen, device=DEV)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout)

    # torch's same-dtype error: the worse of its math backend and plain low-precision torch ops
    # (flash-attn's reference), each against the float32 reference.
    torch_runs = [_math(q, k, v, **case), _naive(q, k, v, **case)]
    torch_grads_runs = [torch.autograd.grad(o, (q, k, v), dout.to(dtype)) for o in torch_runs]
    ours = jax_sdpa(q, k, v, **case, implementation=implementation)
    our_grads = torch.autograd.grad(ours, (q, k, v), dout.to(dtype))
    assert ours.dtype == dtype and ours.shape == ref.shape

    assert_dtype_rule("out", ours, ref, torch_runs, floor=1e-4)
    for i, (name, g, rg) in enumerate(zip("qkv", our_grads, ref_grads)):
        assert_dtype_rule(f"d{name}", g, rg, [tg[i] for tg in torch_grads_runs], floor=1e-4)


def test_zero_copy_cuda():
    t = torch.randn(4, 64, device=DEV)
    (a,) = bridge.to_jax([t])
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    (back,) = bridge.to_torch([a])
    assert back.data_ptr() == a.unsafe_buffer_pointer()


@pytest.mark.parametrize("call_on_side_stream", [True, False])
def test_stream_ordering(call_on_side_stream):
    """Inputs made on a side stream, outputs used at once by torch kernels: 1000 iterations."""
    side = torch.cuda.Stream()
    gen = torch.Generator(device=DEV).manual_seed(0)
    worst = torch.zeros((), device=DEV)
    for _ in range(1000):
        with torch.cuda.stream(side):
            q, k, v = _inputs(gen, 1, 4, 4, 128, 128, 64, torch.bfloat16)
            q = q * 1.5  # more kernels on the side stream right before the call
        if call_on_side_stream:
            with torch.cuda.stream(side):
                out = jax_sdpa(q, k, v, is_causal=True)
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                worst = torch.maximum(worst, (out.float() * 2 - ref.float() * 2).abs().max())
        else:
            torch.cuda.current_stream().wait_stream(side)
            out = jax_sdpa(q, k, v, is_causal=True)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            worst = torch.maximum(worst, (out.float() * 2 - ref.float() * 2).abs().max())
    torch.cuda.synchronize()
    assert worst.item() < 0.05


def test_jax_does_not_preallocate_gpu_memory():
    code = (
        "import torch, jaxattn.torch_api as t\n"
        "q = torch.randn(1, 4, 128, 64, device='cuda')\n"
        "t.scaled_dot_product_attention(q, q, q)\n"
        "free, total = torch.cuda.mem_get_info()\n"
        "print(free / total)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    # -P: the installed jaxattn, not the checkout's jaxattn/ folder (which lacks the layers) from the cwd.
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) > 0.5, out.stdout
