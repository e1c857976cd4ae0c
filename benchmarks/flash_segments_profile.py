"""Where the time of segment ids goes (JAX-only, no bridge): the segment tables, and the kernels
with precomputed tables against the plain kernels.

    python benchmarks/flash_segments_profile.py [B H L D]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp

from jaxattn.jax_core.kernels import flash_jax_triton as fj


def _ms(f, *args, iters=10):
    jax.block_until_ready(f(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best * 1e3


def run(b, h, l, d):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, h, l, d), jnp.bfloat16) for kk in keys[:3])
    dout = jax.random.normal(keys[3], (b, h, l, d), jnp.bfloat16)
    ids = jnp.broadcast_to(jnp.zeros((l,), jnp.int32), (b, l))
    cfg = fj.FlashConfig(scale=d**-0.5, causal=True)
    print("segment_tables:", f"{_ms(jax.jit(fj.segment_tables), ids, ids):.3f} ms", flush=True)
    tables = jax.jit(fj.segment_tables)(ids, ids)
    extras = fj.FlashExtras(segment_ids=(ids, ids))
    plain = jax.jit(lambda q, k, v: fj._forward(q, k, v, None, None, None, fj.FlashExtras(), None, None, cfg)[0])
    seg = jax.jit(lambda q, k, v, t: fj._forward(q, k, v, None, None, None, extras, t, None, cfg)[0])
    print("fwd kernel plain:", f"{_ms(plain, q, k, v):.3f} ms", flush=True)
    print("fwd kernel with segments (tables given):", f"{_ms(seg, q, k, v, tables):.3f} ms", flush=True)

    def fb(extras):
        def loss(q, k, v):
            return fj.flash_attention_triton(q, k, v, None, None, None, extras, cfg)[0]
        return jax.jit(lambda q, k, v: jax.vjp(loss, q, k, v)[1](dout))

    print("fwd+bwd plain:", f"{_ms(fb(fj.FlashExtras()), q, k, v, iters=5):.3f} ms", flush=True)
    print("fwd+bwd segments (tables inside):", f"{_ms(fb(extras), q, k, v, iters=5):.3f} ms", flush=True)


if __name__ == "__main__":
    run(*([int(a) for a in sys.argv[1:]] or [2, 16, 8192, 128]))
