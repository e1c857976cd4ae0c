"""Flash kernel benchmark through the torch API (steady-state timing, see gpu_timing.py).

    python benchmarks/flash_gpu.py [--out flash.json] [--quick]

TFLOP/s use flash-attn's convention: 4*B*H*L*S*D forward, halved for causal, x3.5 for
forward+backward.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxattn.bridge  # noqa: F401,E402
import jax  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_timing import time_torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from jaxattn.torch_api import flash_attention  # noqa: E402


def flops(b, h, l, s, d, causal):
    return 4 * b * h * l * s * d / (2 if causal else 1)


def bench_shape(b, h, l, d, causal, iters, extra=None):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16)
    extra = extra or {}
    sinks = torch.randn(h, device="cuda", requires_grad=True) if extra.get("sinks") else None
    kw = dict(causal=causal, softcap=extra.get("softcap"), sinks=sinks, dropout_p=extra.get("dropout", 0.0))
    if extra.get("segments"):  # `segments` documents of equal length packed in each row
        ids = torch.arange(l, device="cuda") * extra["segments"] // l
        kw["segment_ids"] = ids[None].expand(b, l).contiguous()
    if extra.get("varlen"):  # the batch packed as `b` sequences of length l: same work as the padded batch
        q, k, v = (x.detach().transpose(1, 2).reshape(b * l, h, d).requires_grad_() for x in (q, k, v))
        dout = dout.transpose(1, 2).reshape(b * l, h, d)
        cu = torch.arange(b + 1, device="cuda", dtype=torch.int32) * l
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=l, max_seqlen_k=l)
    f = flops(b, h, l, l, d, causal)
    if extra.get("segments"):
        f /= extra["segments"]  # only the useful work
    row = {"shape": [b, h, l, d], "causal": causal, **{k: v for k, v in extra.items()}}

    def ours_fwd():
        with torch.no_grad():
            flash_attention(q, k, v, implementation="flash", **kw)

    def ours_fb():
        out = flash_attention(q, k, v, implementation="flash", **kw)
        torch.autograd.grad(out, (q, k, v), dout)

    t0 = time.perf_counter()
    ours_fwd()
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - t0
    row["flash_fwd_tflops"] = f / time_torch(ours_fwd, iters=iters) / 1e6
    row["flash_fwdbwd_tflops"] = 3.5 * f / time_torch(ours_fb, iters=iters) / 1e6
    if not extra:
        for name, backend in (("torch_flash", SDPBackend.FLASH_ATTENTION), ("torch_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def t_fwd():
                with torch.no_grad(), sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            def t_fb():
                with sdpa_kernel(backend):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                torch.autograd.grad(out, (q, k, v), dout)
            try:
                row[f"{name}_fwd_tflops"] = f / time_torch(t_fwd, iters=iters) / 1e6
                row[f"{name}_fwdbwd_tflops"] = 3.5 * f / time_torch(t_fb, iters=iters) / 1e6
            except RuntimeError as exc:
                row[f"{name}_error"] = str(exc)[:160]
    return row


def peak_memory(b, h, l, d):
    """Peak extra device memory (MiB) of one forward+backward, each framework's own allocator read:
    torch's for torch's backends, and torch's plus JAX's for the flash path (JAX owns its buffers)."""
    out = {}
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    jax_device = jax.devices("gpu")[0]

    def jax_in_use():
        stats = jax_device.memory_stats() or {}
        return stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)

    for name, fn in (
        ("flash", lambda: flash_attention(q, k, v, causal=True, implementation="flash")),
        ("torch_cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    ):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn().sum().backward()  # warm-up and compile
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            torch_base = torch.cuda.memory_allocated()
            jax_base, jax_peak_before = jax_in_use()
            fn().sum().backward()
            torch.cuda.synchronize()
            jax_now, jax_peak = jax_in_use()
            torch_extra = torch.cuda.max_memory_allocated() - torch_base
            # JAX's peak counter is process-wide: count it only if this call raised it.
            jax_extra = max(jax_peak - jax_peak_before, 0) if name == "flash" else 0
            out[f"{name}_peak_extra_MiB"] = (torch_extra + jax_extra) / 2**20
    return out


SELECTION_SHAPES = [  # (B, H, L, D, causal, dtype)
    (1, 4, 128, 64, False, torch.bfloat16),
    (4, 16, 512, 64, False, torch.bfloat16),
    (16, 16, 1024, 64, True, torch.bfloat16),
    (8, 16, 2048, 128, False, torch.bfloat16),
    (2, 16, 8192, 128, True, torch.bfloat16),
    (2, 16, 8192, 128, True, torch.float16),
    (2, 8, 8192, 256, True, torch.bfloat16),
]


def selection_row(b, h, l, d, causal, dtype):
    """Forward and forward+backward time (µs) of our cuDNN path ("sdpa") and our kernels ("flash"),
    both through the torch API: the measurements behind automatic selection on CUDA."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=dtype)
    row = {"shape": [b, h, l, d], "causal": causal, "dtype": str(dtype).split(".")[-1]}
    iters = 20 if l <= 2048 else 5
    for impl in ("sdpa", "flash"):
        def fwd():
            with torch.no_grad():
                flash_attention(q, k, v, causal=causal, implementation=impl)

        def fb():
            out = flash_attention(q, k, v, causal=causal, implementation=impl)
            torch.autograd.grad(out, (q, k, v), dout)
        try:
            row[f"{impl}_fwd_us"] = time_torch(fwd, iters=iters)
            row[f"{impl}_fwdbwd_us"] = time_torch(fb, iters=iters)
        except Exception as exc:  # e.g. a head dim cuDNN rejects
            row[f"{impl}_error"] = str(exc)[:160]
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = [bench_shape(2, 16, 8192, 128, True, 5)]
    if not args.quick:
        rows += [
            bench_shape(8, 16, 2048, 128, False, 10),
            bench_shape(16, 16, 1024, 64, True, 10),
            bench_shape(2, 16, 8192, 64, True, 5),
            bench_shape(2, 8, 8192, 256, True, 3),
            bench_shape(2, 16, 8192, 128, True, 5, {"softcap": 30.0}),
            bench_shape(2, 16, 8192, 128, True, 5, {"sinks": True}),
            bench_shape(2, 16, 8192, 128, True, 5, {"segments": 1}),
            bench_shape(2, 16, 8192, 128, True, 5, {"segments": 4}),
            bench_shape(2, 16, 8192, 128, True, 5, {"varlen": True}),
            bench_shape(2, 16, 8192, 128, True, 5, {"dropout": 0.1}),
        ]
    result = {
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
                     "triton": __import__("triton").__version__},
        "rows": rows,
    }
    if not args.quick:
        result["memory_1x32x16384x128"] = peak_memory(1, 32, 16384, 128)
        result["selection"] = [selection_row(*shape) for shape in SELECTION_SHAPES]
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
