"""Ring attention on simulated CPU devices: a causal sequence sharded over a mesh axis.

    python examples/ring_simulated.py                  # 8 simulated devices, 4096 tokens
    python examples/ring_simulated.py --devices 4 --seq 512

The sequence is split over the mesh axis "sp"; each device holds 1/n of the queries, keys and
values, and key/value blocks travel round the ring (zigzag layout: equal work per device under the
causal mask). The example checks output and gradients against single-device `vanilla` attention
and prints what each device holds.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(devices: int = 8, seq: int = 4096, heads: int = 8, kv_heads: int = 2, head_dim: int = 64,
         verbose: bool = True) -> dict:
    """Runs the example; returns the maximum absolute errors against vanilla attention."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn.jax_core import AttentionMetadata, attention, ring_attention

    if len(jax.devices()) < devices:
        raise SystemExit(f"only {len(jax.devices())} devices; set XLA_FLAGS=--xla_force_host_platform_device_count="
                         f"{devices} before JAX starts (this script does so when run directly).")
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    seq_sharding = NamedSharding(mesh, P(None, "sp", None, None))
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.device_put(jax.random.normal(keys[0], (1, seq, heads, head_dim)), seq_sharding)
    k = jax.device_put(jax.random.normal(keys[1], (1, seq, kv_heads, head_dim)), seq_sharding)
    v = jax.device_put(jax.random.normal(keys[2], (1, seq, kv_heads, head_dim)), seq_sharding)
    cot = jax.random.normal(keys[3], (1, seq, heads, head_dim))

    def ring_loss(q, k, v):
        return jnp.sum(ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True) * cot)

    def vanilla_loss(q, k, v):
        out = attention(q, k, v, causal=True, implementation="vanilla", metadata=AttentionMetadata())
        return jnp.sum(out.attention_outputs * cot)

    out = ring_attention(q, k, v, mesh=mesh, axis_name="sp", causal=True)
    grads = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2)))(q, k, v)
    ref = attention(*(jax.device_get(x) for x in (q, k, v)), causal=True, implementation="vanilla").attention_outputs
    ref_grads = jax.grad(vanilla_loss, argnums=(0, 1, 2))(*(jax.device_get(x) for x in (q, k, v)))
    errors = {"out": float(jnp.max(jnp.abs(jax.device_get(out) - ref)))}
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[name] = float(jnp.max(jnp.abs(jax.device_get(g) - r)))
    if verbose:
        shard = out.addressable_shards[0]
        print(f"{devices} devices, {seq} tokens: each device holds query/output rows of shape {shard.data.shape} "
              f"(output sharding {out.sharding.spec})")
        print("max |ring - vanilla|:", ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    return errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices on the ring (default 8)")
    parser.add_argument("--seq", type=int, default=4096,
                        help="sequence length, a multiple of 2 * --devices (zigzag layout; default 4096)")
    return parser


if __name__ == "__main__":
    parser = build_parser()
    args = parser.parse_args()
    if args.devices < 1:
        parser.error(f"--devices {args.devices}: expected a positive integer")
    if args.seq < 1 or args.seq % (2 * args.devices):
        parser.error(f"--seq {args.seq}: expected a positive multiple of 2 * --devices = {2 * args.devices}")
    if "jax" in sys.modules:
        raise SystemExit("run this file as a script (JAX must start after XLA_FLAGS is set).")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main(args.devices, args.seq)
