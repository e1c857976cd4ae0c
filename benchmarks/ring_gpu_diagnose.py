"""Which piece of the GPU ring program fails to compile: each variant in its own process.

    python benchmarks/ring_gpu_diagnose.py

Variants (bf16, B=1, H=4, D=128, T=4096 unless said): a Triton flash call inside shard_map over two
GPUs (no collective); the same inside lax.switch on one GPU; a ppermute next to a Triton call; the
ring with the XLA block kernel; the ring with the Triton kernel (contiguous non-causal; zigzag
causal), forward only and forward+backward. Prints one JSON line per variant: ok, or the signal /
error it died with.
"""

from __future__ import annotations

import json
import subprocess
import sys

VARIANTS = ["shard_map_triton", "switch_triton", "ppermute_triton", "ring_xla", "ring_triton_contiguous",
            "ring_triton_zigzag", "block_bwd_f32", "block_bwd_bf16", "switch_block_bwd", "shard_map_block_bwd",
            "ring_xla_grad", "ring_triton_contiguous_grad", "ring_triton_zigzag_grad"]


def run(name: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn.jax_core import ring_attention
    from jaxattn.jax_core.kernels import flash_jax_triton as fj

    gpus = jax.devices("gpu")
    mesh = Mesh(np.array(gpus[:2]), ("sp",))
    shape = (1, 4096, 4, 128)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, shape, jnp.bfloat16) for kk in keys)
    cfg = fj.FlashConfig(scale=128 ** -0.5, layout="BTHD")

    def flash(q, k, v):
        return fj.flash_attention_triton(q, k, v, None, None, None, fj.FlashExtras(), cfg)[0]

    spec = P(None, "sp", None, None)
    shard = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    if name == "shard_map_triton":
        f = jax.jit(jax.shard_map(flash, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        out = f(*map(shard, (q, k, v)))
    elif name == "switch_triton":
        f = jax.jit(lambda i, q, k, v: jax.lax.switch(i, [flash, lambda q, k, v: flash(q, k, v) * 2], q, k, v))
        out = f(jnp.int32(1), q, k, v)
    elif name == "ppermute_triton":
        def body(q, k, v):
            k2 = jax.lax.ppermute(k, "sp", [(0, 1), (1, 0)])
            return flash(q, k2, v)
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        out = f(*map(shard, (q, k, v)))
    elif name == "ring_xla":
        out = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, kernel="xla"))(q, k, v)
    elif name == "ring_triton_contiguous":
        out = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=False, layout="contiguous",
                                                     kernel="triton"))(q, k, v)
    elif name == "ring_triton_zigzag":
        out = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, causal=True, kernel="triton"))(q, k, v)
    elif name.startswith("block_bwd") or name.endswith("block_bwd"):
        lse = jnp.zeros((1, 4, 4096), jnp.float32) + 5.0
        delta = jnp.ones((1, 4, 4096), jnp.float32)
        gdt = jnp.bfloat16 if name == "block_bwd_bf16" else jnp.float32

        def bwd(q, k, v, lse, delta):
            return fj.flash_block_backward(q, k, v, q, lse, delta, fj.FlashExtras(), cfg, grad_dtype=gdt)
        if name == "switch_block_bwd":
            f = jax.jit(lambda i, *a: jax.lax.switch(i, [bwd, lambda *a: bwd(*a)], *a))
            out = f(jnp.int32(1), q, k, v, lse, delta)
        elif name == "shard_map_block_bwd":
            lspec = P(None, None, "sp")

            def body(q, k, v, lse, delta):
                k = jax.lax.ppermute(k, "sp", [(0, 1), (1, 0)])
                return bwd(q, k, v, lse, delta)
            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3 + (lspec,) * 2, out_specs=(spec,) * 3))
            out = f(*map(shard, (q, k, v)), lse, delta)
        else:
            out = jax.jit(bwd)(q, k, v, lse, delta)
    else:
        kern = "xla" if "xla" in name else "triton"
        causal = "zigzag" in name or kern == "xla"
        layout = "contiguous" if "contiguous" in name else None

        def loss(q, k, v):
            return jnp.sum(ring_attention(q, k, v, mesh=mesh, causal=causal, layout=layout,
                                          kernel=kern).astype(jnp.float32))
        out = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    jax.block_until_ready(out)


def main() -> None:
    if len(sys.argv) > 1:
        run(sys.argv[1])
        return
    for name in VARIANTS:
        proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, name], capture_output=True,
                              text=True, timeout=300)
        tail = (proc.stderr or "").strip().splitlines()[-6:]
        print(json.dumps({"variant": name, "rc": proc.returncode, "ok": proc.returncode == 0,
                          "tail": tail if proc.returncode else []}), flush=True)


if __name__ == "__main__":
    main()
