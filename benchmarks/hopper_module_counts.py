"""Counts of chosen operations in the Hopper kernels' Mosaic GPU modules, lowered on any machine.

    python benchmarks/hopper_module_counts.py [--variant FILE ...]

Lowers the forward and backward (causal, bf16, (2, 1024, 4, D) at head dims 64 and 128, the tiles
the library picks) for CUDA without a GPU, catches each kernel's Mosaic GPU module before it is
serialised, and counts warpgroup barriers (`bar.sync`), mbarrier waits, wgmma ops and proxy fences in
its text: static counts, a quick check of what a change to the kernels adds or removes before any
GPU time (BENCHMARKS.md, "Band masks by constants"). `--variant` takes modified copies of
`flash_fwd_mgpu.py` or `flash_bwd_mgpu.py` (as `hopper_kernels_gpu.py --part variant` does).

Catching the module patches a private function of JAX's Mosaic GPU (`core._run_serde_pass`, jax
0.10-0.11); it is a development aid, not part of the library.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import core

from jaxattn.jax_core import calls
from jaxattn.jax_core.kernels import flash_bwd_mgpu, flash_fwd_mgpu
from kernel_variants import load_variant

PATTERNS = {"bar.sync": r"bar\.sync", "mbarrier waits": r"mbarrier\.try_wait", "wgmma": r"wgmma\.mma_async",
            "proxy fences": r"fence[._]proxy"}


def _modules(fn, *args) -> list[str]:
    """The text of each Mosaic GPU module that lowering fn(*args) for CUDA builds."""
    caught, serialise = [], core._run_serde_pass

    def catch(module, **kwargs):
        caught.append(str(module))
        return serialise(module, **kwargs)

    core._run_serde_pass = catch
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        core._run_serde_pass = serialise
    return caught


def counts(fwd=flash_fwd_mgpu, bwd=flash_bwd_mgpu) -> list[dict]:
    rows = []
    for d in (64, 128):
        q = jax.ShapeDtypeStruct((2, 1024, 4, d), jnp.bfloat16)
        rows_f32 = jax.ShapeDtypeStruct((2, 4, 1024), jnp.float32)
        acc = jax.ShapeDtypeStruct((2, 1024, 4, d), jnp.float32)
        cases = {}
        if fwd is not None:
            cases["forward"] = (functools.partial(fwd.flash_forward_mgpu, scale=d ** -0.5, causal=True,
                                                  **calls.hopper_tiles("forward", d, 1024)), (q, q, q))
        if bwd is not None:
            tiles = {k: v for k, v in calls.hopper_tiles("backward", d, 1024).items() if k != "stages"}
            cases["backward"] = (functools.partial(bwd.flash_backward_mgpu, scale=d ** -0.5, causal=True, **tiles),
                                 (q, q, q, q, rows_f32, rows_f32, acc))
        for name, (fn, args) in cases.items():
            text = _modules(fn, *args)[-1]
            rows.append(dict(kernel=name, head_dim=d,
                             **{k: len(re.findall(p, text)) for k, p in PATTERNS.items()}))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[],
                        help="a modified flash_fwd_mgpu.py or flash_bwd_mgpu.py (repeatable)")
    args = parser.parse_args()
    sets = [("as is", flash_fwd_mgpu, flash_bwd_mgpu)]
    for path in args.variant:
        module = load_variant(path)
        is_forward = hasattr(module, "flash_forward_mgpu")
        sets.append((path, module if is_forward else None, None if is_forward else module))
    for name, fwd, bwd in sets:
        for row in counts(fwd, bwd):
            print(f"{name}: {row['kernel']} head dim {row['head_dim']}: "
                  + ", ".join(f"{k} {row[k]}" for k in PATTERNS), flush=True)


if __name__ == "__main__":
    main()
