"""Host time per decoding attention call on CUDA: transformers' sdpa attention function against the jaxattn
plug-in and drop-in, with a profile of the plug-in (python benchmarks/plugin_decode_host.py)."""
import time, cProfile, pstats, io
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from jaxattn.torch_api import scaled_dot_product_attention
from jaxattn.torch_api.transformers_plugin import make_attention_function
from jaxattn.torch_api import native_flash as nf

def us(fn, n=500, repeats=7):
    for _ in range(50): fn()
    torch.cuda.synchronize()
    res = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        res.append((time.perf_counter() - t) / n * 1e6)
    res.sort()
    return round(res[len(res) // 2], 1)

class Mod(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4
    training = False
mod = Mod()
ours = make_attention_function()
for b, s in ((1, 150), (16, 150)):
    q = torch.randn(b, 1, 32, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(b, 8, s, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    with torch.no_grad():
        rows = {
            "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
            "hf sdpa fn": lambda: sdpa_attention_forward(mod, q, k, v, None, dropout=0.0, scaling=0.125),
            "jaxattn sdpa": lambda: scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.125),
            "jaxattn plugin": lambda: ours(mod, q, k, v, None, dropout=0.0, scaling=0.125),
        }
        print(f"B{b} S{s}", {name: us(fn) for name, fn in rows.items()}, flush=True)
        pr = cProfile.Profile(); pr.enable()
        for _ in range(2000): ours(mod, q, k, v, None, dropout=0.0, scaling=0.125)
        torch.cuda.synchronize(); pr.disable()
        out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22); print(out.getvalue())
