"""The Hopper kernels alone (Pallas Mosaic GPU, `jax.jit` on JAX arrays): the backward on one program
per item against its persistent grid, the backward by GQA head splits, and the head-dim-64 forward by
key-block size, each against torch's cuDNN backend in the same process where it applies.

    python benchmarks/hopper_kernels_gpu.py [--out hopper_kernels.json] [--part grids|splits|forward-tiles|forward-wgs]
    python benchmarks/hopper_kernels_gpu.py --part variant --variant my_flash_bwd_mgpu.py [--rounds 5]
    python benchmarks/hopper_kernels_gpu.py --part variant --variant my_flash_fwd_mgpu.py [--softcap 30] [--forward-tiles 128:128x3]

Rows, causal bf16:
    * "grids": the backward (`flash_backward_mgpu_tiles`, the tuned tiles and head splits) with
      `programs` None (one program per item) and the SM count (persistent), and torch cuDNN's backward
      (autograd.grad of a retained graph) on the same shape;
    * "splits": the backward on the persistent grid plus the float32 partial sums of the head splits,
      by splits, at GQA shapes (`calls.HOPPER_BACKWARD_MIN_ITEMS`);
    * "forward-tiles": the forward on the persistent grid by (block_kv, stages), head dims 64 and 128
      at short lengths (`calls.HOPPER_FORWARD_SHORT`);
    * "forward-wgs": the head-dim-64 forward on the persistent grid by compute warpgroups per program
      (tiles of 2 or 3 x 64 query rows), key block and stages, lengths read in place (`tma_edges`),
      and torch cuDNN's forward;
    * "variant": the backward as is against a modified copy of `flash_bwd_mgpu.py` (`--variant`, loaded
      as a module of the same package), both on the persistent grid with the tuned tiles and head
      splits, and torch cuDNN's backward, at the "grids" shapes; or, for a copy of
      `flash_fwd_mgpu.py`, the forward likewise (and the variant with other tiles: at head dim 64,
      and those `--forward-tiles` names) against cuDNN's forward at `FORWARD_VARIANT_SHAPES`.
      `docs/bench/variants/*.patch` are the variants BENCHMARKS.md reports (`git apply` one to a copy
      of the checkout, or `patch -o`).
The residuals the backward reads come from our forward. Timing: `gpu_timing.time_jax` (back-to-back
calls, then block_until_ready) and `time_torch`, `--rounds` rounds (default 3) of the variants in turn, median.
TFLOP/s count the causal forward as 2*B*H*L*L*D and the backward as 2.5 times that. Each backward
variant's gradients are compared with the first variant's (max abs difference; dQ's float32 adds
come in another order, the rest is equal to the bit).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from gpu_timing import time_jax, time_torch, write_report
from kernel_variants import load_variant
from jaxattn.jax_core import calls
from jaxattn.jax_core.kernels.flash_bwd_mgpu import backward_operands, flash_backward_mgpu_tiles
from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles

# (B, L, Hq, Hk, D)
GRID_SHAPES = [(1, 16384, 16, 16, 128), (2, 8192, 16, 16, 128), (8, 1024, 16, 16, 128), (1, 8192, 16, 8, 128),
               (4, 4096, 16, 16, 64), (8, 2048, 16, 16, 64), (16, 1024, 16, 16, 64), (2, 4096, 32, 8, 64)]
SPLIT_SHAPES = [((2, 4096, 32, 8, 64), (1, 2, 4)), ((1, 8192, 32, 8, 64), (1, 2, 4)),
                ((1, 16384, 32, 8, 64), (1, 2)), ((1, 8192, 16, 8, 128), (1, 2)), ((1, 8192, 16, 2, 128), (2, 4, 8))]
TILE_SHAPES = [(16, 1024, 16, 64), (16, 1280, 16, 64), (12, 1536, 16, 64), (8, 2048, 16, 64), (4, 4096, 16, 64),
               (8, 1024, 16, 128)]
TILES = [(256, 2), (128, 2), (128, 3), (128, 4), (64, 2), (64, 4)]


def causal_flops(b, h, l, d):
    return 2 * b * h * l * l * d


def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


ROUNDS = 3  # rounds of the variants in turn (`--rounds`)


def timed(fns: dict, flops: float, rounds=None) -> dict:
    """{name: (median µs, TFLOP/s, per-round µs)}, the variants timed in turn, `rounds` times."""
    times = {name: [] for name in fns}
    for _ in range(rounds or ROUNDS):
        for name, fn in fns.items():
            times[name].append(time_jax(fn, iters=10, repeats=3))
    return {name: (statistics.median(t), flops / statistics.median(t) / 1e6, [round(x, 1) for x in t])
            for name, t in times.items()}


def backward_inputs(b, l, hq, hk, d):
    """q, k, v, do (B, L, H, D) bf16 and the backward's row operands from our forward."""
    keys = jax.random.split(jax.random.key(0), 4)
    q, do = (jax.random.normal(key, (b, l, hq, d), jnp.bfloat16) for key in keys[:2])
    k, v = (jax.random.normal(key, (b, l, hk, d), jnp.bfloat16) for key in keys[2:])
    forward = functools.partial(calls.flash_hopper, scale=d ** -0.5, causal=True, diag_offset=0, programs=sms())
    out, lse = jax.jit(forward)(q, k, v)
    lse_log2, delta = jax.jit(backward_operands)(out, do, lse)
    return q, k, v, do, lse_log2, delta, jnp.zeros(q.shape, jnp.float32)


def cudnn_backward_us(b, l, hq, hk, d):
    q, do = (torch.randn(b, hq, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    leaves = [x.requires_grad_(True) for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=hq != hk)
        return time_torch(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), iters=10)


def backward_fn(shape, splits, programs, kernel=flash_backward_mgpu_tiles, softcap=None):
    """A jitted backward (`kernel`: a `flash_backward_mgpu_tiles`) of whole tiles with the splits'
    partial sums; `softcap` as the kernel takes it."""
    b, l, hq, hk, d = shape

    def run(q, k, v, do, lse_log2, delta, accum):
        dq, dk, dv = kernel(q, k, v, do, lse_log2, delta, accum, scale=d ** -0.5, causal=True,
                                               head_splits=splits, programs=programs, softcap=softcap,
                                               **calls.hopper_tiles("backward", d, l))
        if splits > 1:
            dk, dv = dk.sum(0).astype(k.dtype), dv.sum(0).astype(v.dtype)
        return dq, dk, dv
    return jax.jit(run)


def compare(variants: dict, args) -> dict:
    """{name: callable} of the variants, each run once and compared with the first (printed)."""
    fns, first = {}, None
    for name, fn in variants.items():
        got = jax.block_until_ready(fn(*args))
        first = got if first is None else first
        diff = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32)))) for a, r in zip(got, first)]
        print(f"    {name}: max abs difference from {next(iter(variants))} (dq, dk, dv) {diff}", flush=True)
        fns[name] = functools.partial(fn, *args)
    return fns


def grids(rows):
    for shape in GRID_SHAPES:
        b, l, hq, hk, d = shape
        splits = calls.hopper_head_splits(b, hq, hk, l, d)
        args = backward_inputs(*shape)
        fns = compare({"programs=None": backward_fn(shape, splits, None),
                       f"programs={sms()}": backward_fn(shape, splits, sms())}, args)
        result = timed(fns, 2.5 * causal_flops(b, hq, l, d))
        cudnn = cudnn_backward_us(*shape)
        row = dict(part="grids", shape=list(shape), head_splits=splits, cudnn_us=cudnn,
                   variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()})
        rows.append(row)
        print(f"{shape} splits {splits}: " + " | ".join(f"{n} {us:.1f} us {tf:.1f} TF" for n, (us, tf, _) in
                                                      result.items()) + f" | cudnn {cudnn:.1f} us", flush=True)


def splits(rows):
    for shape, options in SPLIT_SHAPES:
        b, l, hq, hk, d = shape
        args = backward_inputs(*shape)
        fns = compare({f"splits={n}": backward_fn(shape, n, sms()) for n in options}, args)
        result = timed(fns, 2.5 * causal_flops(b, hq, l, d))
        policy = calls.hopper_head_splits(b, hq, hk, l, d)
        rows.append(dict(part="splits", shape=list(shape), policy=policy,
                         variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()}))
        print(f"{shape} policy {policy}: " + " | ".join(f"{n} {us:.1f} us" for n, (us, _, _) in result.items()),
              flush=True)


def forward_fns(shape, options: dict, launcher: str = "jax") -> dict:
    """{name: callable} of the forward (causal bf16, persistent grid) on inputs of `shape` (B, L, H, D),
    one per option {name: (a `flash_forward_mgpu_tiles`, its tiles)}, each run once and its output
    compared with the first one's (printed). An option that does not compile or fit (the kernel's own
    shared-memory check) is reported and left out. `launcher` "jax": `jax.jit` on JAX arrays; "torch":
    on torch tensors through the drop-in's launcher (`bridge.mosaic_launch.MosaicKernel`)."""
    d = shape[-1]
    if launcher == "torch":
        from jaxattn.bridge.mosaic_launch import MosaicKernel

        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bind, done, as_f32 = MosaicKernel, torch.cuda.synchronize, lambda x: x.float()
    else:
        q, k, v = (jax.random.normal(key, shape, jnp.bfloat16) for key in jax.random.split(jax.random.key(1), 3))
        bind, done, as_f32 = jax.jit, lambda: None, lambda x: x.astype(jnp.float32)
    fns, first = {}, None
    for name, (kernel, tiles) in options.items():
        # A variant may take inputs after q, k, v (a tile list, say): `kernel.extra_inputs` makes them.
        extra = getattr(kernel, "extra_inputs", lambda *_, **__: [])(q.shape, k.shape, causal=True, programs=sms(),
                                                                      **tiles)
        extra = [torch.as_tensor(x, device="cuda") if launcher == "torch" else jnp.asarray(x) for x in extra]
        call = functools.partial(bind(functools.partial(kernel, scale=d ** -0.5, causal=True, programs=sms(),
                                                        **tiles)), q, k, v, *extra)
        try:
            out, _ = jax.block_until_ready(call())
            done()
        except Exception as exc:  # noqa: BLE001 - reported, and the others go on
            print(f"{shape} {name}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        first = out if first is None else first
        print(f"    {name}: max abs difference of out from the first {float(abs(as_f32(out) - as_f32(first)).max())}",
              flush=True)
        fns[name] = call
    return fns


def forward_tiles(rows):
    for shape in TILE_SHAPES:
        b, l, h, d = shape
        fns = forward_fns(shape, {f"block_kv={block_kv} stages={stages}": (
            flash_forward_mgpu_tiles, dict(block_q=64, block_kv=block_kv, stages=stages)) for block_kv, stages in TILES})
        result = timed(fns, causal_flops(b, h, l, d))
        rows.append(dict(part="forward-tiles", shape=list(shape), chosen=calls.hopper_tiles("forward", d, l),
                         variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()}))
        print(f"{shape}: " + " | ".join(f"{n} {us:.1f} us" for n, (us, _, _) in result.items()), flush=True)


# The head-dim-64 forward by compute warpgroups per program (tiles of 2 or 3 x 64 query rows), key
# block and stages.
WGS_SHAPES = [(16, 1024, 16, 64), (8, 2048, 16, 64), (4, 4096, 16, 64), (1, 8192, 16, 64), (1, 16384, 16, 64)]
WGS_TILES = [(2, 128, 2), (2, 256, 2), (3, 128, 2), (3, 128, 3), (3, 128, 4)]


def forward_wgs(rows):
    for shape in WGS_SHAPES:
        b, l, h, d = shape
        fns = forward_fns(shape, {f"wgs={wgs} block_kv={block_kv} stages={stages}": (
            flash_forward_mgpu_tiles, dict(block_q=64, block_kv=block_kv, stages=stages, compute_wgs=wgs,
                                           tma_edges=True)) for wgs, block_kv, stages in WGS_TILES})
        result = timed(fns, causal_flops(b, h, l, d))
        cudnn = cudnn_forward_us(b, l, h, d)
        rows.append(dict(part="forward-wgs", shape=list(shape), chosen=calls.hopper_tiles("forward", d, l),
                         cudnn_us=cudnn,
                         variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()}))
        print(f"{shape}: " + " | ".join(f"{n} {us:.1f} us" for n, (us, _, _) in result.items())
              + f" | cudnn {cudnn:.1f} us", flush=True)


# Forward variants: (B, L, H, D) causal, and the tiles each is timed with beside the tuned ones.
FORWARD_VARIANT_SHAPES = [(1, 16384, 16, 128), (2, 8192, 16, 128), (8, 1024, 16, 128), (4, 4096, 16, 64),
                          (16, 1024, 16, 64), (1, 8192, 16, 64)]
FORWARD_VARIANT_TILES = {64: [dict(block_q=64, block_kv=128, stages=2)],
                         128: []}


def variant(rows, path, softcap=None):
    """The kernel as is against the modified copy at `path`: of `flash_bwd_mgpu.py` (the backward at
    the "grids" shapes) or of `flash_fwd_mgpu.py` (the forward at `FORWARD_VARIANT_SHAPES`, with
    `softcap` if given)."""
    module = load_variant(path)
    if hasattr(module, "flash_forward_mgpu_tiles"):
        return forward_variant(rows, path, module, softcap)
    if softcap is not None:
        raise ValueError(f"--softcap {softcap}: the backward variants run without a cap; hint: leave it out")
    for shape in GRID_SHAPES:
        b, l, hq, hk, d = shape
        splits = calls.hopper_head_splits(b, hq, hk, l, d)
        args = backward_inputs(*shape)
        fns = compare({"as is": backward_fn(shape, splits, sms()),
                       "variant": backward_fn(shape, splits, sms(), module.flash_backward_mgpu_tiles)}, args)
        result = timed(fns, 2.5 * causal_flops(b, hq, l, d))
        cudnn = cudnn_backward_us(*shape)
        rows.append(dict(part="variant", variant=str(path), shape=list(shape), head_splits=splits, cudnn_us=cudnn,
                         variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()}))
        print(f"{shape} splits {splits}: " + " | ".join(f"{n} {us:.1f} us" for n, (us, _, _) in result.items())
              + f" | cudnn {cudnn:.1f} us", flush=True)


def cudnn_forward_us(b, l, h, d):
    q, k, v = (torch.randn(b, h, l, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
        return time_torch(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), iters=10)


def forward_variant(rows, path, module, softcap=None):
    """With `softcap`, both kernels run with that cap, and the kernel as is without it as well (the
    cap's cost)."""
    for shape in FORWARD_VARIANT_SHAPES:
        b, l, h, d = shape
        tuned = calls.hopper_tiles("forward", d, l)
        capped = tuned if softcap is None else dict(tuned, softcap=softcap)
        options = {"as is": (flash_forward_mgpu_tiles, capped), "variant": (module.flash_forward_mgpu_tiles, capped)}
        if softcap is None:
            options.update({f"variant {t['block_kv']}x{t['stages']}": (module.flash_forward_mgpu_tiles, t)
                            for t in FORWARD_VARIANT_TILES[d] if t != tuned})
        else:
            options["as is, no cap"] = (flash_forward_mgpu_tiles, tuned)
        result = timed(forward_fns(shape, options), causal_flops(b, h, l, d))
        cudnn = cudnn_forward_us(b, l, h, d)
        rows.append(dict(part="variant", variant=str(path), softcap=softcap, shape=list(shape), cudnn_us=cudnn,
                         variants={name: dict(us=us, tflops=tf, rounds=r) for name, (us, tf, r) in result.items()}))
        print(f"{shape} forward: " + " | ".join(f"{n} {us:.1f} us" for n, (us, _, _) in result.items())
              + f" | cudnn {cudnn:.1f} us", flush=True)


PARTS = {"grids": grids, "splits": splits, "forward-tiles": forward_tiles, "forward-wgs": forward_wgs,
         "variant": variant}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--part", choices=sorted(PARTS), action="append",
                        help="one part (repeatable); default grids, splits and forward-tiles")
    parser.add_argument("--variant", default=None,
                        help="the modified flash_bwd_mgpu.py or flash_fwd_mgpu.py that --part variant times")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the variants in turn")
    parser.add_argument("--softcap", type=float, default=None,
                        help="a forward variant's soft cap (both kernels; the kernel as is also without it)")
    parser.add_argument("--forward-tiles", action="append", default=[], metavar="D:KVxSTAGES",
                        help="more tiles a forward variant is timed with at head dim D, e.g. 128:128x3 "
                             "(block_kv 128, 3 stages; repeatable)")
    args = parser.parse_args()
    if ("variant" in (args.part or ())) != (args.variant is not None) or args.rounds < 1:
        parser.error(f"--part {args.part}, --variant {args.variant!r}, --rounds {args.rounds}: expected --variant "
                     "FILE exactly with --part variant, and at least one round")
    global ROUNDS
    ROUNDS = args.rounds
    for spec in args.forward_tiles:
        try:
            d, tile = spec.split(":")
            block_kv, stages = tile.split("x")
            FORWARD_VARIANT_TILES[int(d)].append(dict(block_q=64, block_kv=int(block_kv), stages=int(stages)))
        except (ValueError, KeyError):
            parser.error(f"--forward-tiles {spec!r}: expected D:KVxSTAGES with D one of "
                         f"{sorted(FORWARD_VARIANT_TILES)}, e.g. 128:128x3")
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, jax {jax.__version__}", flush=True)
    rows = []
    for part in args.part or ["grids", "splits", "forward-tiles"]:
        if part == "variant":
            variant(rows, args.variant, args.softcap)
        else:
            PARTS[part](rows)
    if args.out:
        write_report(args.out, rows)


if __name__ == "__main__":
    main()
