"""Sweep of the flash forward tiles at one shape (JAX-only, no bridge): prints TFLOP/s per tile,
plain and with a soft cap (hardware tanh).

    python benchmarks/flash_fwd_tiles.py [B H L D [causal: 0|1]]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from jaxattn.jax_core.kernels.flash_fwd_triton import fwd_block_sizes
from jaxattn.jax_core.kernels.flash_jax_triton import FlashExtras, flash_attention_triton

from flash_swept_config import SweptFlashConfig

TILES = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
         (128, 32, 8, 4), (64, 128, 4, 3)]


def run(b, h, l, d, causal=1):
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, h, l, d), jnp.bfloat16) for kk in keys)
    flops = 4 * b * h * l * l * d / (2 if causal else 1)

    def timed(tiles, softcap=None):
        cfg = SweptFlashConfig(scale=d**-0.5, causal=bool(causal), fwd_tile=tiles, softcap=softcap, fast_tanh=True)
        f = jax.jit(lambda q, k, v: flash_attention_triton(q, k, v, None, None, None, FlashExtras(), cfg)[0])
        try:
            jax.block_until_ready(f(q, k, v))
        except Exception as exc:  # a tile the compiler rejects
            return float("nan"), str(exc)[:80]
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(10):
                out = f(q, k, v)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - t0) / 10)
        return best * 1e3, f"{flops / best / 1e12:.0f} TFLOP/s"

    default = fwd_block_sizes(d, d, 2)
    for tiles in [default] + [t for t in TILES if t != default]:
        ms, note = timed(tiles)
        ms_cap, note_cap = timed(tiles, softcap=30.0)
        print("fwd", (b, h, l, d, "causal" if causal else "full"), tiles, f"{ms:.3f} ms", note, "| softcap", f"{ms_cap:.3f} ms", note_cap, flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] or [2, 16, 8192, 128]
    run(*args)
