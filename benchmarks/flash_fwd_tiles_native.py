"""Native (torch-launched) flash forward time per tile at the model benchmark's attention shapes, in (B, L, H, D) and
(B, H, L, D) memory, against torch's SDPA (run on a CUDA machine: python benchmarks/flash_fwd_tiles_native.py)."""
import time, itertools
import torch
import torch.nn.functional as F
from jaxattn.torch_api.native_flash import flash_forward

from flash_swept_config import SweptFlashConfig

SHAPES = [(16, 16, 8, 512, 64), (4, 16, 8, 2048, 64), (2, 32, 8, 4096, 64), (1, 32, 8, 8192, 64)]
TILES = [None, (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (64, 32, 4, 4)]

def us(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n): fn()
        b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / n * 1e3)
    return best

with torch.no_grad():
    for (b, hq, hk, l, d), layout in [(s, lay) for lay in ("BLHD", "BHLD") for s in SHAPES]:
        if layout == "BLHD":
            q = torch.randn(b, l, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            k, v = (torch.randn(b, l, hk, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "kv")
        else:
            q = torch.randn(b, hq, l, d, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(b, hk, l, d, device="cuda", dtype=torch.bfloat16) for _ in "kv")
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        t_torch = us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        row = [f"{layout} B{b} H{hq}/{hk} L{l}: torch {t_torch:.0f}us"]
        for tile in TILES:
            cfg = SweptFlashConfig(scale=d ** -0.5, causal=True, fwd_tile=tile, fast_tanh=True)
            try:
                out, _ = flash_forward(q, k, v, cfg)
                err = (out.float() - ref.float()).abs().max().item()
                t = us(lambda: flash_forward(q, k, v, cfg))
                row.append(f"{tile}: {t:.0f} ({t_torch / t:.2f}x, err {err:.3f})")
            except Exception as e:
                row.append(f"{tile}: failed {type(e).__name__}: {str(e)[:80]}")
        print("\n  ".join(row), flush=True)
