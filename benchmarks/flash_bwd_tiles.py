"""Sweep of the flash backward tiles at one shape (JAX-only, no bridge): prints ms per fwd+bwd.

    python benchmarks/flash_bwd_tiles.py [B H L D]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from jaxattn.jax_core.kernels.flash_jax_triton import FlashExtras, bwd_tiles, flash_attention_triton

from flash_swept_config import SweptFlashConfig

KV_TILES = [(32, 128, 4, 3), (64, 128, 8, 2), (64, 128, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 3)]
Q_TILES = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2)]


def run(b, h, l, d):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, h, l, d), jnp.bfloat16) for kk in keys[:3])
    dout = jax.random.normal(keys[3], (b, h, l, d), jnp.bfloat16)
    flops = 3.5 * 4 * b * h * l * l * d / 2

    def timed(tiles):
        cfg = SweptFlashConfig(scale=d**-0.5, causal=True, bwd_tiles=tiles)
        f = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: flash_attention_triton(q, k, v, None, None, None, FlashExtras(), cfg)[0], q, k, v)[1](dout))
        try:
            jax.block_until_ready(f(q, k, v))
        except Exception as exc:  # a tile the compiler rejects
            return float("nan"), str(exc)[:80]
        t0 = time.perf_counter()
        for _ in range(5):
            out = f(q, k, v)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t0) / 5 * 1e3
        return ms, f"{flops / ms / 1e9:.0f} TFLOP/s"

    default = bwd_tiles(d, jnp.bfloat16)
    print("default", default, *timed(default), flush=True)
    best_kv = default[0]
    best = timed(default)[0]
    for kv in KV_TILES:
        ms, note = timed((kv, default[1]))
        print("dkdv", kv, f"{ms:.2f} ms", note, flush=True)
        if ms < best:
            best, best_kv = ms, kv
    for qt in Q_TILES:
        ms, note = timed((best_kv, qt))
        print("dq", best_kv, qt, f"{ms:.2f} ms", note, flush=True)


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]] or [2, 16, 8192, 128]
    run(*args)
