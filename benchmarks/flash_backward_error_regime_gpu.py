"""The backward's error where the values are an attention output, per backend: dq, dk, dv of each
backend against torch's math on float32 copies, as a multiple of torch's math in bf16 (the 2x rule's
yardstick), with random values and with values that are themselves an attention output (small,
near-average rows, as in a model's second attention layer). Causal bf16, (2, 16, 2048), head dims 64
and 128, a random cotangent.

    python benchmarks/flash_backward_error_regime_gpu.py

Fused backwards (FlashAttention's form, ours included) take each row's delta = rowsum(dO * O) from
the output rounded to bf16, where the math backward sums P * dP; with small values that rounding
weighs more in dS = P * (dP - delta).
"""

from __future__ import annotations

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hopper_torch_gpu import drop_in, torch_backend


def main():
    torch.manual_seed(0)
    rows = {"hopper": drop_in(True), "triton": drop_in(False), "torch flash": torch_backend(SDPBackend.FLASH_ATTENTION),
            "torch cudnn": torch_backend(SDPBackend.CUDNN_ATTENTION), "torch math bf16": torch_backend(SDPBackend.MATH)}
    for d in (64, 128):
        def randn():
            return torch.randn(2, 16, 2048, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.MATH):
            attention_output = F.scaled_dot_product_attention(randn(), randn(), randn(), is_causal=True)
        for values, v in (("v random", randn()), ("v = attention output", attention_output)):
            q, k, cot = randn(), randn(), randn()
            leaves = [x.float().requires_grad_(True) for x in (q, k, v)]
            with sdpa_kernel(SDPBackend.MATH):
                want = F.scaled_dot_product_attention(*leaves, is_causal=True)
            want_grads = torch.autograd.grad(want, leaves, cot.float())
            errors = {}
            for name, fn in rows.items():
                inputs = [x.clone().requires_grad_(True) for x in (q, k, v)]
                grads = torch.autograd.grad(fn(*inputs, True), inputs, cot)
                errors[name] = [(g.float() - w).abs().max().item() for g, w in zip(grads, want_grads)]
            base = errors["torch math bf16"]
            print(d, values, " | ".join(
                f"{n}: dq {e[0]:.1e} ({e[0] / base[0]:.2f}x) dk {e[1] / base[1]:.2f}x dv {e[2] / base[2]:.2f}x"
                for n, e in errors.items()))


if __name__ == "__main__":
    main()
