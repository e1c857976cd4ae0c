"""What skipping fully masked tiles buys, and what the visibility table costs (JAX-level, GPU).

For a few bool masks at (B, H, L, D) bf16 it times the flash forward and forward+backward with
skipping on (the product's choice) and off (`SweptFlashConfig` of `flash_swept_config.py`), plus
the table alone, and prints a JSON line per case.

    python benchmarks/flash_block_skip.py [--out FILE] [B H L D]

Masks (broadcast over batch and heads, (1, 1, L, L)):
    dense:     every element visible (the table is pure overhead here).
    documents: 8 documents on the diagonal, block-diagonal (packed sequences written as a mask).
    causal:    the causal rule written as a bool mask instead of `causal=True`.
    sliding:   a 1024-wide band (a sliding window written as a mask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from jaxattn.jax_core.kernels import flash_jax_triton as fj

from flash_swept_config import SweptFlashConfig


def _us(fn, *args, warmup=3, iters=10, repeats=5):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    return statistics.median(times)


def masks(l: int) -> dict[str, jax.Array]:
    i = jnp.arange(l)[:, None]
    j = jnp.arange(l)[None, :]
    doc = l // 8
    return {
        "dense": jnp.ones((l, l), jnp.bool_),
        "documents": (i // doc) == (j // doc),
        "causal": j <= i,
        "sliding": (j <= i) & (j > i - 1024),
    }


def run(b: int, h: int, l: int, d: int) -> list[dict]:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(kk, (b, h, l, d), jnp.bfloat16) for kk in keys[:3])
    dout = jax.random.normal(keys[3], (b, h, l, d), jnp.bfloat16)
    rows = []
    for name, m in masks(l).items():
        mask = m.astype(jnp.int8)[None, None]
        visible = float(jnp.mean(m))
        row = {"mask": name, "shape": [b, h, l, d], "visible_fraction": round(visible, 4)}
        for skip in (False, True):
            cfg = SweptFlashConfig(scale=d ** -0.5, skip_masked_blocks=skip)

            def fwd(q, k, v, mask, cfg=cfg):
                return fj.flash_attention_triton(q, k, v, None, mask, None, fj.FlashExtras(), cfg)[0]

            def fwd_bwd(q, k, v, mask, cfg=cfg):
                out, vjp = jax.vjp(lambda q, k, v: fj.flash_attention_triton(
                    q, k, v, None, mask, None, fj.FlashExtras(), cfg)[0], q, k, v)
                return vjp(dout)

            tag = "skip" if skip else "noskip"
            row[f"fwd_us_{tag}"] = round(_us(jax.jit(fwd), q, k, v, mask), 1)
            row[f"fwd_bwd_us_{tag}"] = round(_us(jax.jit(fwd_bwd), q, k, v, mask), 1)
        table = jax.jit(lambda m: fj.visibility_tiles(None, m, (64, 64)))
        row["table_us"] = round(_us(table, mask), 1)
        row["fwd_speedup"] = round(row["fwd_us_noskip"] / row["fwd_us_skip"], 3)
        row["fwd_bwd_speedup"] = round(row["fwd_bwd_us_noskip"] / row["fwd_bwd_us_skip"], 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="*", type=int, default=[2, 16, 8192, 128])
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = run(*args.shape)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
