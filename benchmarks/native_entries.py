"""Forward and forward+backward time of the native launch with static and dynamic entry kernels,
against the XLA-launched flash kernels and torch's SDPA, at the model benchmark's attention shapes."""
import time

import torch
import torch.nn.functional as F

from jaxattn.torch_api import native_flash, scaled_dot_product_attention, sdpa_launcher

SHAPES = [(16, 16, 8, 512, 64), (4, 16, 8, 2048, 64), (2, 32, 8, 4096, 64), (1, 32, 8, 8192, 64), (2, 16, 16, 8192, 128)]


def ms(fn, n=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n * 1e3)
    return sorted(times)[2]


def main():
    tuned = native_flash.DYNAMIC_MAX_QUERIES  # the entries' flavour follows the query length; forced here
    for b, hq, hk, l, d in SHAPES:
        q = torch.randn(b, l, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(b, l, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_() for _ in "kv")
        g = torch.randn(b, hq, l, d, device="cuda", dtype=torch.bfloat16)
        row = []
        for name in ("torch", "static", "dynamic", "xla"):
            def call():
                if name == "torch":
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                native_flash.DYNAMIC_MAX_QUERIES = {"static": 0, "dynamic": 1 << 20}.get(name, tuned)
                with sdpa_launcher("xla" if name == "xla" else "native"):
                    return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, implementation="flash")

            def fwd():
                with torch.no_grad():
                    call()

            def fwd_bwd():
                torch.autograd.grad(call(), (q, k, v), g)

            row.append(f"{name} {ms(fwd):.2f}/{ms(fwd_bwd):.2f}")
        native_flash.DYNAMIC_MAX_QUERIES = tuned
        print(f"B{b} H{hq}/{hk} L{l} D{d} causal, fwd/fwd+bwd ms: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
