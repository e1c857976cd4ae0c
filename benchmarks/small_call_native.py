"""Host time of a small call, (1, 4, 128, 64) bf16 causal: torch's SDPA, the native launcher, the XLA bridge."""
import time

import torch
import torch.nn.functional as F

from jaxattn.torch_api import scaled_dot_product_attention, sdpa_launcher


def per_call_us(fn, n=300, repeats=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n * 1e6)
    best.sort()
    return best[len(best) // 2], best[0], best[-1]


def main():
    q, k, v = (torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")
    g = torch.randn(1, 4, 128, 64, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, launcher in (("torch", None), ("native", "native"), ("xla", "xla")):
        def fwd():
            with torch.no_grad():
                if launcher is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
                with sdpa_launcher(launcher):
                    return scaled_dot_product_attention(q, k, v, is_causal=True, implementation="flash")

        def fwd_bwd():
            if launcher is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with sdpa_launcher(launcher):
                    out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="flash")
            out.backward(g)

        rows.append((name, per_call_us(fwd), per_call_us(fwd_bwd)))
    for name, f, fb in rows:
        print(f"{name:8s} fwd {f[0]:7.1f} us [{f[1]:.1f}, {f[2]:.1f}]   fwd+bwd {fb[0]:7.1f} us [{fb[1]:.1f}, {fb[2]:.1f}]")


if __name__ == "__main__":
    main()
