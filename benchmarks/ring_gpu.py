"""Ring attention on 2 GPUs against the flash implementation on 1 GPU: forward+backward, peak memory.

    python benchmarks/ring_gpu.py --out ring.json [--lengths 32768 131072] [--iters 5]

bf16, B=1, H=32, D=128, causal. For each total length T: one process runs `flash` on one GPU over
the whole sequence; one process runs `ring` (zigzag layout, Triton block kernels) with the sequence
sharded over both GPUs, with float32 accumulators ("ring") and with accumulators in the inputs'
dtype ("ring_input", `accumulation="input"`). Each reports the median forward+backward time (`jax.value_and_grad` of
sum(out * cot)) and every GPU's peak memory. Scaling efficiency = t_flash / (2 t_ring); the ring's
speedup over one GPU is t_flash / t_ring (ideal 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _measure(kind: str, length: int, iters: int, heads: int, dim: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn.jax_core import attention, ring_attention

    gpus = jax.devices("gpu")
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (1, length, heads, dim)
    if kind.startswith("ring"):
        accumulation = "input" if kind == "ring_input" else "float32"
        mesh = Mesh(np.array(gpus[:2]), ("sp",))
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "sp", None, None)))  # noqa: E731

        def attn(q, k, v):
            return ring_attention(q, k, v, mesh=mesh, causal=True, accumulation=accumulation)
    else:
        put = lambda x: jax.device_put(x, gpus[0])  # noqa: E731

        def attn(q, k, v):
            return attention(q, k, v, causal=True, implementation="flash").attention_outputs
    q, k, v, cot = (put(jax.random.normal(kk, shape, jnp.bfloat16)) for kk in keys)

    def loss(q, k, v):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * cot.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - t0)
    used = gpus[:2] if kind.startswith("ring") else gpus[:1]
    peaks = [d.memory_stats().get("peak_bytes_in_use", 0) / 2**30 for d in used]
    flops = 4 * length * length * dim * heads / 2 * 3.5  # causal fwd (2 matmuls) + bwd (2.5x)
    median = float(np.median(times))
    return dict(kind=kind, length=length, heads=heads, dim=dim, median_s=median, times_s=times,
                first_call_s=compile_s, peak_gib_per_gpu=peaks, tflops_total=flops / median / 1e12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="ring_gpu.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--kinds", nargs="+", default=["flash", "ring", "ring_input"],
                        choices=["flash", "ring", "ring_input"])
    parser.add_argument("--one", nargs=2, metavar=("KIND", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # child process: one measurement, printed as JSON
        print("RESULT " + json.dumps(_measure(args.one[0], int(args.one[1]), args.iters, args.heads, args.dim)))
        return
    import jax

    result = dict(device=[d.device_kind for d in jax.devices()], jax=jax.__version__,
                  xla_flags=os.environ.get("XLA_FLAGS", ""), runs=[], pairs=[])
    for length in args.lengths:
        pair = {}
        for kind in args.kinds:
            proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--one", kind, str(length), "--iters", str(args.iters),
                                   "--heads", str(args.heads), "--dim", str(args.dim)],
                                  capture_output=True, text=True, env=dict(os.environ))
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                run = dict(kind=kind, length=length, returncode=proc.returncode,
                           error=(proc.stdout + proc.stderr)[-3000:])
            else:
                run = json.loads(line[len("RESULT "):])
            result["runs"].append(run)
            pair[kind] = run
            print(json.dumps(run)[:400], flush=True)
        for ring in ("ring", "ring_input"):
            if "median_s" in pair.get("flash", {}) and "median_s" in pair.get(ring, {}):
                speedup = pair["flash"]["median_s"] / pair[ring]["median_s"]
                result["pairs"].append(dict(length=length, kind=ring, speedup=speedup, efficiency=speedup / 2,
                                            memory_ratio=max(pair[ring]["peak_gib_per_gpu"]) / pair["flash"]["peak_gib_per_gpu"][0]))
                print(json.dumps(result["pairs"][-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
