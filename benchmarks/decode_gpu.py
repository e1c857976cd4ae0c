"""Decode attention benchmark on CUDA: bandwidth of the Triton stream-K decode kernel against the device's
copy bandwidth and against torch SDPA over the padded cache with a mask.

    python benchmarks/decode_gpu.py [--out decode.json] [--sweep]

Setting (the issue's): bf16, Hq=32, Hkv=8, D=128, one query per sequence.
  * copy bandwidth: torch `dst.copy_(src)` of 1 GiB; reported as bytes read + written per second
    (`copy_gbps`, the usual "device copy bandwidth") and bytes read per second (`copy_read_gbps`).
  * decode GB/s = bytes of K and V the call must read (the valid positions only) / time;
    `frac_of_copy` = decode GB/s / copy_gbps (target >= 0.9 for full caches).
  * "jax": the jitted JAX function on arrays that share the torch tensors' memory (the kernel's
    own cost plus a JAX dispatch; back-to-back calls, wall time to block_until_ready). "torch_api":
    `jaxattn.torch_api.decode_attention` (bridge included). "torch_sdpa": torch's
    `scaled_dot_product_attention` on the same (B, Hkv, S, D) cache with a (B, 1, 1, S) bool mask
    and enable_gqa=True (its default backend choice), and "torch_sdpa_expanded" with K/V already
    repeated to Hq heads outside the timing (lets torch pick its memory-efficient kernel).
  * ragged batches: lengths uniform in [S/8, S] (one seeded draw); speedup = torch SDPA time / ours;
    `speedup_at_equal_efficiency` = 1 / (valid fraction of the cache) is what a kernel as efficient
    as torch's but reading only the valid positions would reach.
  * B=1, S=4096: latency through the torch API (steady state, and one call at a time).
  * paged (page size 16, pages in random order) against the contiguous cache.
Steady-state timing: back-to-back calls between CUDA events (torch) or to block_until_ready (JAX),
median of 5 repeats after warm-up (gpu_timing.py `time_torch` / `time_jax`).
`--sweep` also times tiles (BLOCK_N, warps, stages) and programs per multiprocessor of the kernel
itself (`SweptDecodeConfig`, this benchmark's own: the product takes its tuned choices);
`--ragged-sweep` only does that for ragged caches, next to torch SDPA and the read-only bandwidth;
`--ragged-draws N` times N draws of ragged lengths per shape (ours and torch SDPA on each draw);
`--stream` times programs per multiprocessor x tiles on full caches and several ragged draws.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxattn.bridge  # noqa: F401,E402  (memory policy first)
import jax  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import statistics  # noqa: E402
from typing import Optional  # noqa: E402

from gpu_timing import kernel_profile, time_jax, time_torch  # noqa: E402

from jaxattn.bridge import to_jax  # noqa: E402
from jaxattn.jax_core import decode_attention as jax_decode  # noqa: E402
from jaxattn.jax_core.kernels.decode_jax_triton import (STREAM_PROGRAMS_PER_SM, DecodeConfig,  # noqa: E402
                                                         decode_attention_triton)
from jaxattn.torch_api import decode_attention  # noqa: E402

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16


@dataclasses.dataclass(frozen=True)
class SweptDecodeConfig(DecodeConfig):
    """DecodeConfig with the launch choices under test: `tile` (BLOCK_N, num_warps, num_stages) and
    `programs_per_sm` of the stream schedule; None keeps the product's tuned choice."""

    tile: Optional[tuple[int, int, int]] = None
    programs_per_sm: Optional[int] = None

    def launch_tiles(self, d, dv, dtype_bytes):
        return self.tile or super().launch_tiles(d, dv, dtype_bytes)

    def stream_programs(self):
        tuned = super().stream_programs()
        return tuned if self.programs_per_sm is None else tuned // STREAM_PROGRAMS_PER_SM * self.programs_per_sm


def kernel_fn(**launch):
    """The jitted kernel alone on (B, Hq, 1, D) queries and a cache of `launch`'s layout (default
    (B, S, Hkv, D)), with `launch`'s tile and programs per multiprocessor."""
    cfg = SweptDecodeConfig(scale=D ** -0.5, q_layout="BHTD", **launch)
    return jax.jit(lambda q, k, v, n: decode_attention_triton(q, k, v, n, None, None, None, cfg)[0])


def copy_bandwidth(gib=1.0):
    src = torch.empty(int(gib * 2**30) // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_torch(lambda: dst.copy_(src), iters=20)
    nbytes = src.numel() * 2
    return {"bytes": nbytes, "us": us, "copy_gbps": 2 * nbytes / us / 1e3, "copy_read_gbps": nbytes / us / 1e3}


def kv_bytes(lengths):
    return int(lengths.sum()) * HKV * D * 2 * 2  # K and V, bf16


def make_inputs(b, s, lengths, gen):
    q = torch.randn(b, HQ, 1, D, generator=gen, device="cuda", dtype=DTYPE)
    k_bhsd, v_bhsd = (torch.randn(b, HKV, s, D, generator=gen, device="cuda", dtype=DTYPE) for _ in "kv")
    mask = (torch.arange(s, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    return q, k_bhsd, v_bhsd, mask


def cache_lengths(b, s, ragged, gen):
    """(B,) int32 lengths: all S, or uniform in [S/8, S] for a ragged batch."""
    if ragged:
        return torch.randint(s // 8, s + 1, (b,), generator=gen, device="cuda", dtype=torch.int32)
    return torch.full((b,), s, dtype=torch.int32, device="cuda")


def bshd_case(b, s, ragged):
    """Lengths and (B, S, Hkv, D) caches with their JAX views, for the kernel-only sweeps."""
    gen = torch.Generator(device="cuda").manual_seed(b * s)
    lengths = cache_lengths(b, s, ragged, gen)
    q, k_bhsd, v_bhsd, _ = make_inputs(b, s, lengths, gen)
    k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
    return lengths, to_jax([q, k, v, lengths])


def jax_caller(q, k, v, lengths, block_table=None, cache_layout="BSHD"):
    """A no-argument function running the jitted JAX decode on arrays sharing the tensors' memory."""
    arrays = to_jax([x for x in (q, k, v, lengths, block_table) if x is not None])
    fn = jax.jit(lambda q, k, v, n, *bt: jax_decode(q, k, v, n, block_table=bt[0] if bt else None,
                                                    cache_layout=cache_layout, query_layout="BHTD").attention_outputs)
    return lambda: fn(*arrays)


def torch_sdpa_times(q, k, v, mask, iters):
    """torch SDPA over the padded cache with the mask: as is (GQA), and with K/V pre-expanded."""
    row = {}
    with torch.no_grad():
        row["torch_sdpa_us"] = time_torch(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), iters=iters)
        k_rep, v_rep = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
        row["torch_sdpa_expanded_us"] = time_torch(
            lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, attn_mask=mask), iters=iters)
        del k_rep, v_rep
    return row


def paged_copy(k_bshd, v_bshd, page_size, gen):
    b, s = k_bshd.shape[:2]
    per_seq = s // page_size
    order = torch.randperm(b * per_seq, generator=torch.Generator().manual_seed(0)).cuda()
    pages = [torch.empty(b * per_seq, page_size, HKV, D, device="cuda", dtype=DTYPE) for _ in "kv"]
    for p, x in zip(pages, (k_bshd, v_bshd)):
        p[order] = x.reshape(b * per_seq, page_size, HKV, D)
    return pages[0], pages[1], order.view(b, per_seq).to(torch.int32)


def bench(b, s, copy_gbps, ragged, iters=30):
    gen = torch.Generator(device="cuda").manual_seed(b * s)
    lengths = cache_lengths(b, s, ragged, gen)
    q, k_bhsd, v_bhsd, mask = make_inputs(b, s, lengths, gen)
    k_bshd, v_bshd = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
    nbytes = kv_bytes(lengths)
    row = {"B": b, "S": s, "ragged": ragged, "kv_bytes": nbytes}
    row["jax_us"] = time_jax(jax_caller(q, k_bshd, v_bshd, lengths), iters=iters)
    row["jax_bhsd_us"] = time_jax(jax_caller(q, k_bhsd, v_bhsd, lengths, cache_layout="BHSD"), iters=iters)
    with torch.no_grad():
        row["torch_api_us"] = time_torch(lambda: decode_attention(q, k_bshd, v_bshd, lengths), iters=iters)
    row.update(torch_sdpa_times(q, k_bhsd, v_bhsd, mask, iters))
    row["jax_gbps"] = nbytes / row["jax_us"] / 1e3
    row["frac_of_copy"] = row["jax_gbps"] / copy_gbps
    row["torch_api_gbps"] = nbytes / row["torch_api_us"] / 1e3
    row["speedup_jax_vs_torch_sdpa"] = row["torch_sdpa_us"] / row["jax_us"]
    row["speedup_torch_api_vs_torch_sdpa"] = row["torch_sdpa_us"] / row["torch_api_us"]
    row["speedup_jax_vs_torch_sdpa_expanded"] = row["torch_sdpa_expanded_us"] / row["jax_us"]
    # torch reads the whole padded cache: reading only the valid fraction at torch's own efficiency
    # would give this speedup (1.78x on average for lengths uniform in [S/8, S]).
    row["valid_fraction"] = nbytes / (b * s * HKV * D * 2 * 2)
    row["speedup_at_equal_efficiency"] = 1 / row["valid_fraction"]
    if not ragged:
        k_pages, v_pages, table = paged_copy(k_bshd, v_bshd, 16, gen)
        row["paged_jax_us"] = time_jax(jax_caller(q, k_pages, v_pages, lengths, table, cache_layout="paged"),
                                       iters=iters)
        with torch.no_grad():
            row["paged_torch_api_us"] = time_torch(
                lambda: decode_attention(q, k_pages, v_pages, lengths, block_table=table), iters=iters)
        row["paged_jax_gbps"] = nbytes / row["paged_jax_us"] / 1e3
        row["paged_over_contiguous_time"] = row["paged_jax_us"] / row["jax_us"]
        del k_pages, v_pages
    # The same numbers from one call's output: a sanity check that every path agrees.
    with torch.no_grad():
        ours = decode_attention(q, k_bshd, v_bshd, lengths)
        ref = F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True)
    row["max_abs_diff_vs_torch"] = (ours.float() - ref.float()).abs().max().item()
    return row


def one_call_us(fn, n=50):
    """Median wall time of single calls from an idle GPU (synchronised before and after each)."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def latency_b1(s=4096):
    gen = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.full((1,), s, dtype=torch.int32, device="cuda")
    q, k_bhsd, v_bhsd, mask = make_inputs(1, s, lengths, gen)
    k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
    row = {"B": 1, "S": s}
    with torch.no_grad():
        row["torch_api_steady_us"] = time_torch(lambda: decode_attention(q, k, v, lengths), iters=100)
        row["torch_api_one_call_us"] = one_call_us(lambda: decode_attention(q, k, v, lengths))
        row["torch_sdpa_one_call_us"] = one_call_us(
            lambda: F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True))
        row["torch_sdpa_steady_us"] = time_torch(
            lambda: F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True), iters=100)
    row["jax_us"] = time_jax(jax_caller(q, k, v, lengths), iters=100)
    return row


def sweep(shapes, copy_gbps):
    """Kernel-only timings (JAX level) over tiles (at the tuned programs per multiprocessor) and
    programs per multiprocessor (at the tuned tile), for full or ragged (`ragged`: lengths uniform
    in [S/8, S]) caches."""
    rows = []
    tiles = [None, (32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 3), (64, 8, 4), (128, 8, 3)]
    for b, s, ragged in shapes:
        lengths, (qj, kj, vj, nj) = bshd_case(b, s, ragged)
        for tile in tiles:
            for pps in (None, 1, 2, 3, 4):
                if pps is not None and tile is not None:
                    continue  # programs are swept at the tuned tile
                fn = kernel_fn(tile=tile, programs_per_sm=pps)
                try:
                    us = time_jax(lambda: fn(qj, kj, vj, nj), iters=20)
                except Exception as exc:  # a tile Triton cannot compile: record and go on
                    rows.append({"B": b, "S": s, "ragged": ragged, "tile": tile, "programs_per_sm": pps,
                                 "error": str(exc)[:160]})
                    continue
                gbps = kv_bytes(lengths) / us / 1e3
                rows.append({"B": b, "S": s, "ragged": ragged, "tile": tile, "programs_per_sm": pps, "us": us,
                             "gbps": gbps, "frac_of_copy": gbps / copy_gbps})
                print(json.dumps(rows[-1]), flush=True)
        del qj, kj, vj
    return rows


def ragged_sweep(copy_gbps):
    """Ragged caches (and the full B=8 one for reference): cache layouts x tiles x programs per
    multiprocessor, with torch SDPA over the padded (B, Hkv, S, D) cache timed in the same
    process, and the device's read-only bandwidth (a bf16 sum of 1 GiB)."""
    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    read_us = time_torch(lambda: src.sum(dtype=torch.float32), iters=20)
    out = {"read_only_gbps": src.numel() * 2 / read_us / 1e3, "rows": []}
    del src
    tiles = [(64, 4, 3), (128, 4, 3), (128, 8, 3), (64, 4, 4)]
    for b, s, ragged in [(8, 32768, True), (32, 8192, True), (8, 32768, False)]:
        gen = torch.Generator(device="cuda").manual_seed(b * s)
        lengths = cache_lengths(b, s, ragged, gen)
        q, k_bhsd, v_bhsd, mask = make_inputs(b, s, lengths, gen)
        torch_us = torch_sdpa_times(q, k_bhsd, v_bhsd, mask, 30)["torch_sdpa_us"]
        nbytes = kv_bytes(lengths)
        for layout in ("BHSD", "BSHD"):
            if layout == "BSHD":
                k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
                del k_bhsd, v_bhsd
            else:
                k, v = k_bhsd, v_bhsd
            qj, kj, vj, nj = to_jax([q, k, v, lengths])
            for tile in tiles:
                for pps in (None, 1, 4):
                    fn = kernel_fn(cache_layout=layout, tile=tile, programs_per_sm=pps)
                    row = {"B": b, "S": s, "ragged": ragged, "layout": layout, "tile": tile,
                           "programs_per_sm": pps, "torch_sdpa_us": torch_us}
                    try:
                        row["us"] = time_jax(lambda: fn(qj, kj, vj, nj), iters=30)
                    except Exception as exc:  # a tile Triton cannot compile: record and go on
                        row["error"] = str(exc)[:160]
                    else:
                        row["frac_of_copy"] = nbytes / row["us"] / 1e3 / copy_gbps
                        row["speedup"] = torch_us / row["us"]
                    out["rows"].append(row)
                    print(json.dumps(row), flush=True)
            del qj, kj, vj, k, v
    return out


def ragged_draws(copy_gbps, draws):
    """Several draws of ragged lengths (uniform in [S/8, S], seeds 0 .. draws-1) over one cache per
    shape: per draw, ours (JAX and torch API) and torch SDPA over the padded cache with that draw's
    mask, and the speedup a kernel reading only the valid positions at torch's efficiency would get.
    The issue's ragged target is about the distribution of lengths, which one draw samples poorly
    at B=8 (valid fraction 0.5625 on average, 0.42-0.71 for the middle 90% of draws)."""
    out = []
    for b, s in [(8, 32768), (32, 8192)]:
        gen = torch.Generator(device="cuda").manual_seed(b * s)
        q, k_bhsd, v_bhsd, _ = make_inputs(b, s, torch.full((b,), s, device="cuda", dtype=torch.int32), gen)
        k_bshd, v_bshd = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
        for seed in range(draws):
            lengths = cache_lengths(b, s, True, torch.Generator(device="cuda").manual_seed(seed))
            mask = (torch.arange(s, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
            nbytes = kv_bytes(lengths)
            row = {"B": b, "S": s, "seed": seed, "kv_bytes": nbytes,
                   "valid_fraction": nbytes / (b * s * HKV * D * 2 * 2)}
            row["jax_us"] = time_jax(jax_caller(q, k_bshd, v_bshd, lengths), iters=30)
            with torch.no_grad():
                row["torch_api_us"] = time_torch(lambda: decode_attention(q, k_bshd, v_bshd, lengths), iters=30)
                row["torch_sdpa_us"] = time_torch(
                    lambda: F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True),
                    iters=30)
            row["jax_frac_of_copy"] = nbytes / row["jax_us"] / 1e3 / copy_gbps
            row["speedup_jax"] = row["torch_sdpa_us"] / row["jax_us"]
            row["speedup_torch_api"] = row["torch_sdpa_us"] / row["torch_api_us"]
            row["speedup_at_equal_efficiency"] = 1 / row["valid_fraction"]
            out.append(row)
            print(json.dumps(row), flush=True)
        del q, k_bhsd, v_bhsd, k_bshd, v_bshd
    for b in (8, 32):
        rows = [r for r in out if r["B"] == b]
        summary = {"B": b, "draws": len(rows)}
        for key in ("speedup_jax", "speedup_torch_api", "speedup_at_equal_efficiency", "valid_fraction"):
            vals = [r[key] for r in rows]
            summary[key] = {"median": statistics.median(vals), "mean": statistics.fmean(vals),
                            "min": min(vals), "max": max(vals)}
        summary["draws_at_or_above_1.7x_torch_api"] = sum(r["speedup_torch_api"] >= 1.7 for r in rows)
        print(json.dumps({"summary": summary}), flush=True)
    return out


def stream_sweep(copy_gbps, draws=4):
    """Programs per multiprocessor x tiles of the stream schedule on full caches and `draws` ragged
    draws per shape, JAX level, with torch SDPA over the padded cache timed on the same draw."""
    configs = [(pps, tile) for tile in [(64, 4, 3), (64, 4, 4), (128, 4, 3)] for pps in (1, 2, 3, 4)]
    out = []
    for b, s in [(8, 32768), (32, 8192)]:
        gen = torch.Generator(device="cuda").manual_seed(b * s)
        q, k_bhsd, v_bhsd, _ = make_inputs(b, s, torch.full((b,), s, device="cuda", dtype=torch.int32), gen)
        k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
        qj, kj, vj = to_jax([q, k, v])
        fns = {}
        for pps, tile in configs:
            fns[(pps, tile)] = kernel_fn(tile=tile, programs_per_sm=pps)
        for seed in [None] + list(range(draws)):
            lengths = (torch.full((b,), s, device="cuda", dtype=torch.int32) if seed is None
                       else cache_lengths(b, s, True, torch.Generator(device="cuda").manual_seed(seed)))
            mask = (torch.arange(s, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
            with torch.no_grad():
                torch_us = time_torch(lambda: F.scaled_dot_product_attention(
                    q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True), iters=30)
                ref = F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True)
            (nj,) = to_jax([lengths])
            nbytes = kv_bytes(lengths)
            for key, fn in fns.items():
                row = {"B": b, "S": s, "seed": seed, "programs_per_sm": key[0], "tile": key[1],
                       "valid_fraction": nbytes / (b * s * HKV * D * 4), "torch_sdpa_us": torch_us}
                row["us"] = time_jax(lambda: fn(qj, kj, vj, nj), iters=30)
                row["frac_of_copy"] = nbytes / row["us"] / 1e3 / copy_gbps
                row["speedup"] = torch_us / row["us"]
                got = torch.from_dlpack(fn(qj, kj, vj, nj))
                row["max_abs_diff_vs_torch"] = (got.float() - ref.float()).abs().max().item()
                out.append(row)
                print(json.dumps(row), flush=True)
        del q, k_bhsd, v_bhsd, k, v, qj, kj, vj
    return out


def kernel_times():
    """Per call: wall time (back-to-back, JAX level) and each GPU kernel's time from torch's profiler
    (it records JAX's kernels too), for our default decode and torch SDPA over the padded cache."""
    def per_kernel(fn):
        out: dict = {}
        for name, us in kernel_profile(fn, calls=30)[0].items():
            out[name[:60]] = out.get(name[:60], 0.0) + us
        return {k: round(v, 1) for k, v in out.items()}

    rows = []
    for b, s, ragged in [(8, 32768, True), (32, 8192, True), (8, 32768, False)]:
        gen = torch.Generator(device="cuda").manual_seed(b * s)
        lengths = cache_lengths(b, s, ragged, gen)
        q, k_bhsd, v_bhsd, mask = make_inputs(b, s, lengths, gen)
        k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
        ours = jax_caller(q, k, v, lengths)
        row = {"B": b, "S": s, "ragged": ragged, "jax_us": time_jax(ours, iters=30),
               "ours_kernels_us": per_kernel(lambda: jax.block_until_ready(ours()))}
        with torch.no_grad():
            call = lambda: F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True)  # noqa: E731
            row["torch_us"] = time_torch(call, iters=30)
            row["torch_kernels_us"] = per_kernel(call)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, k_bhsd, v_bhsd
    return rows


def small_caches():
    """Small caches through the torch API: the Triton kernel against the XLA formulation
    (`kernel="xla"`), per call back-to-back and one call at a time, with torch SDPA alongside."""
    rows = []
    for b, s in [(1, 1024), (1, 4096), (1, 16384), (4, 4096), (8, 8192)]:
        gen = torch.Generator(device="cuda").manual_seed(b * s + 1)
        lengths = torch.full((b,), s, dtype=torch.int32, device="cuda")
        q, k_bhsd, v_bhsd, mask = make_inputs(b, s, lengths, gen)
        k, v = (x.transpose(1, 2).contiguous() for x in (k_bhsd, v_bhsd))
        row = {"B": b, "S": s, "cache_mb": 2 * b * s * HKV * D * 2 / 2**20}
        with torch.no_grad():
            for kernel in ("triton", "xla"):
                call = lambda kernel=kernel: decode_attention(q, k, v, lengths, kernel=kernel)  # noqa: E731
                row[f"{kernel}_steady_us"] = time_torch(call, iters=100)
                row[f"{kernel}_one_call_us"] = one_call_us(call)
            ref = F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True)
            row["xla_max_abs_diff"] = (decode_attention(q, k, v, lengths, kernel="xla").float() - ref.float()).abs().max().item()
            row["torch_sdpa_steady_us"] = time_torch(
                lambda: F.scaled_dot_product_attention(q, k_bhsd, v_bhsd, attn_mask=mask, enable_gqa=True), iters=100)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--sweep", action="store_true", help="also sweep tiles and programs per multiprocessor")
    parser.add_argument("--only-sweep", action="store_true", help="only the sweep")
    parser.add_argument("--ragged-sweep", action="store_true",
                        help="only tiles x programs per multiprocessor on ragged caches, with torch SDPA alongside")
    parser.add_argument("--kernel-times", action="store_true",
                        help="only per-kernel GPU times of one call (ours and torch SDPA) from torch's profiler")
    parser.add_argument("--small", action="store_true", help="only small caches: Triton kernel against kernel='xla'")
    parser.add_argument("--stream", action="store_true",
                        help="only programs per multiprocessor x tiles, full and ragged caches")
    parser.add_argument("--ragged-draws", type=int, default=0, metavar="N",
                        help="only N seeded draws of ragged lengths per shape, each against torch SDPA")
    args = parser.parse_args()
    if args.small:
        print(json.dumps({"small": small_caches()}, indent=1))
        return
    if args.kernel_times:
        print(json.dumps({"kernel_times": kernel_times()}, indent=1))
        return
    copy = copy_bandwidth()
    if args.stream:
        print(json.dumps({"copy": copy, "stream": stream_sweep(copy["copy_gbps"])}))
        return
    if args.ragged_draws:
        print(json.dumps({"copy": copy, "ragged_draws": ragged_draws(copy["copy_gbps"], args.ragged_draws)}))
        return
    if args.ragged_sweep:
        print(json.dumps({"copy": copy, "ragged_sweep": ragged_sweep(copy["copy_gbps"])}, indent=1))
        return
    shapes = [(32, 8192, False), (8, 32768, False), (32, 8192, True), (8, 32768, True), (1, 4096, False)]
    if args.only_sweep:
        print(json.dumps({"copy": copy, "sweep": sweep(shapes, copy["copy_gbps"])}, indent=1))
        return
    result = {
        "device": torch.cuda.get_device_name(),
        "date": time.strftime("%Y-%m-%d"),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__},
        "setting": {"Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bfloat16", "q_len": 1},
        "copy": copy,
        "full": [bench(32, 8192, copy["copy_gbps"], False), bench(8, 32768, copy["copy_gbps"], False)],
        "ragged": [bench(32, 8192, copy["copy_gbps"], True), bench(8, 32768, copy["copy_gbps"], True)],
        "latency_b1": latency_b1(),
    }
    if args.sweep:
        result["sweep"] = sweep(shapes, copy["copy_gbps"])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
