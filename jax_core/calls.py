"""The JAX functions behind the torch API's calls, in the layouts that API passes its tensors in.

Each takes arrays positionally (None for an absent one) and static arguments (hashable Python
constants) by keyword only, so that `jaxattn.bridge.jax_op` can run it on torch tensors: the
torch API validates and translates torch arguments, then calls one of these through the bridge.
The attention calls build their `AttentionCall` and `CallArrays` once and run them by `run_call`.

Layouts: (B, Hq, L, E) queries, (B, Hk, S, E) keys, (B, Hk, S, Ev) values ("BHTD"); flash's
varlen call takes packed (total, H, E) arrays with cu_seqlens; decode takes (B, Hq, T, D) queries
against a cache in its own layout; ring takes global arrays sharded over a device mesh. `seed` is None or an int32 (2,) array; dropout draws its
randomness from it.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from .base import AttentionOutput
from .call import AttentionCall, CallArrays
from .decode import decode_attention
from .dispatch import run_call
from .metadata import AttentionMetadata
from .ring import ring_attention, ring_attention_backward
from .visibility import Visibility


def _dropout_rng(seed):
    return None if seed is None else jax.random.fold_in(jax.random.key(seed[0]), seed[1])


def _mask_or_bias(attn_mask):
    """(bias, mask): a boolean mask selects (True = attend), any other is added to the logits."""
    if attn_mask is not None and attn_mask.dtype == jnp.bool_:
        return None, attn_mask
    return attn_mask, None


def _run(call: AttentionCall, arrays: CallArrays, *, platform, implementation) -> AttentionOutput:
    """`attention()` on a built call; the metadata carries the call's scale and dropout probability
    too (for implementations that read them there)."""
    metadata = AttentionMetadata(softmax_scale=call.scale, dropout_prob=call.dropout_prob, platform=platform)
    return run_call(call, arrays, metadata, implementation)


def sdpa(query, key, value, attn_mask, seed, *, is_causal, scale, dropout_p, implementation, platform):
    """torch's scaled_dot_product_attention: (B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev) -> (B, Hq, L, Ev)."""
    bias, mask = _mask_or_bias(attn_mask)
    call = AttentionCall(visibility=Visibility.of(is_causal), scale=scale, dropout_prob=dropout_p, layout="BHTD")
    arrays = CallArrays(query, key, value, bias=bias, mask=mask, dropout_rng=_dropout_rng(seed))
    return _run(call, arrays, platform=platform, implementation=implementation).attention_outputs


def sdpa_features(query, key, value, attn_mask, sinks, seed, *, causal, scale, softcap, dropout_p, implementation,
                  platform):
    """`sdpa` with a logits soft cap and/or attention sinks (as transformers' models pass them)."""
    bias, mask = _mask_or_bias(attn_mask)
    call = AttentionCall(visibility=Visibility.of(causal), logits_soft_cap=softcap, scale=scale, dropout_prob=dropout_p,
                         layout="BHTD")
    arrays = CallArrays(query, key, value, bias=bias, mask=mask, softmax_aux=sinks, dropout_rng=_dropout_rng(seed))
    return _run(call, arrays, platform=platform, implementation=implementation).attention_outputs


def _flash(query, key, value, sinks, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed, alibi_slopes, *,
           causal, causal_alignment, window, softcap, scale, dropout_p, max_seqlen, return_lse, implementation,
           platform):
    """(B, Hq, L, E) / (B, Hk, S, E|Ev) arrays, or packed (total, H, E) ones with cu_seqlens; ALiBi
    slopes (Hq,) or (B, Hq) float32 or None."""
    varlen = cu_seqlens_q is not None
    segment_ids = cu_seqlens = None
    if q_segment_ids is not None:
        kv_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        segment_ids = (q_segment_ids.astype(jnp.int32), kv_ids.astype(jnp.int32))
    if varlen:  # (total, H, E) -> (1, total, H, E): a free reshape
        query, key, value = query[None], key[None], value[None]
        cu_seqlens = (cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32))
    call = AttentionCall(visibility=Visibility.of(causal, causal_alignment, window), logits_soft_cap=softcap,
                         scale=scale, dropout_prob=dropout_p, return_lse=return_lse,
                         layout="BTHD" if varlen else "BHTD", max_seqlen=max_seqlen)
    arrays = CallArrays(query, key, value, softmax_aux=sinks, dropout_rng=_dropout_rng(seed), segment_ids=segment_ids,
                        cu_seqlens=cu_seqlens, alibi_slopes=alibi_slopes)
    out = _run(call, arrays, platform=platform, implementation=implementation)
    result, lse = out.attention_outputs, out.lse
    if varlen:  # (1, total_q, Hq, Ev) -> (total_q, Hq, Ev); LSE (1, Hq, total_q) -> (Hq, total_q)
        result, lse = result[0], None if lse is None else lse[0]
    return (result, lse) if return_lse else result


def flash(query, key, value, sinks, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed,
          alibi_slopes=None, *, causal, causal_alignment, window, softcap, scale, dropout_p, max_seqlen, implementation,
          platform):
    """The flash-attention features call: the output, (B, Hq, L, Ev) or packed (total_q, Hq, Ev)."""
    return _flash(query, key, value, sinks, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed,
                  alibi_slopes, causal=causal, causal_alignment=causal_alignment, window=window, softcap=softcap,
                  scale=scale, dropout_p=dropout_p, max_seqlen=max_seqlen, return_lse=False,
                  implementation=implementation, platform=platform)


def flash_with_lse(query, key, value, sinks, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed,
                   alibi_slopes=None, *, causal, causal_alignment, window, softcap, scale, dropout_p, max_seqlen, implementation,
          platform):
    """`flash` and the float32 log-sum-exp, (B, Hq, L) or (Hq, total_q)."""
    return _flash(query, key, value, sinks, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, seed,
                  alibi_slopes, causal=causal, causal_alignment=causal_alignment, window=window, softcap=softcap,
                  scale=scale, dropout_p=dropout_p, max_seqlen=max_seqlen, return_lse=True,
                  implementation=implementation, platform=platform)


def _decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes, *, window, softcap, scale,
            cache_layout, kernel, platform, return_lse, causal):
    out = decode_attention(
        q, k_cache, v_cache, lengths, starts=starts, block_table=block_table, sliding_window=window,
        logits_soft_cap=softcap, softmax_aux=sinks, cache_layout=cache_layout, query_layout="BHTD", kernel=kernel,
        return_lse=return_lse, metadata=AttentionMetadata(softmax_scale=scale, platform=platform), causal=causal,
        alibi_slopes=alibi_slopes,
    )
    return (out.attention_outputs, out.lse) if return_lse else out.attention_outputs


def decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes=None, *, window, softcap, scale,
           cache_layout, kernel, platform, causal=True):
    """(B, Hq, T, D) queries against a KV cache -> (B, Hq, T, Dv); causal=False: every query sees
    the whole valid region; ALiBi slopes (Hq,) or (B, Hq) float32 or None."""
    return _decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes, window=window,
                   softcap=softcap, scale=scale, cache_layout=cache_layout, kernel=kernel, platform=platform,
                   return_lse=False, causal=causal)


def decode_with_lse(q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes=None, *, window, softcap,
                    scale, cache_layout, kernel, platform, causal=True):
    """`decode` and the (B, Hq, T) float32 log-sum-exp."""
    return _decode(q, k_cache, v_cache, lengths, starts, block_table, sinks, alibi_slopes, window=window,
                   softcap=softcap, scale=scale, cache_layout=cache_layout, kernel=kernel, platform=platform,
                   return_lse=True, causal=causal)


def _swap(x):
    return jnp.swapaxes(x, 1, 2)


def ring(query, key, value, q_segment_ids, kv_segment_ids, alibi_slopes=None, *, mesh, **options):
    """Ring attention over the 1-D `mesh` on global (B, Hq, L, E) / (B, Hk, S, E|Ev) arrays sharded
    along L and S, segment ids (B, L) / (B, S) or None, replicated ALiBi slopes (Hq,) / (B, Hq) or
    None -> (output (B, Hq, L, Ev), float32 LSE (B, Hq, L)).

    `options` are `ring_attention`'s static keyword arguments (causal, sliding_window, scale, ...).
    """
    segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    out, lse = ring_attention(_swap(query), _swap(key), _swap(value), segment_ids=segment_ids, return_lse=True,
                              alibi_slopes=alibi_slopes, mesh=mesh, axis_name=mesh.axis_names[0], **options)
    return _swap(out), lse


def ring_backward(query, key, value, q_segment_ids, kv_segment_ids, alibi_slopes, out, lse, d_out, d_lse, *, mesh,
                  **options):
    """The gradients (dq, dk, dv) of `ring` from its saved output and LSE and their cotangents (no
    forward recompute; the ALiBi slopes get none)."""
    segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    grads = ring_attention_backward(_swap(query), _swap(key), _swap(value), _swap(out), lse, _swap(d_out), d_lse,
                                    segment_ids=segment_ids, alibi_slopes=alibi_slopes, mesh=mesh,
                                    axis_name=mesh.axis_names[0], **options)
    return tuple(_swap(g) for g in grads)


# The Hopper kernels (Pallas Mosaic GPU) on whole tiles, each one kernel call and nothing else, as
# `plgpu.as_torch_kernel` launches them on torch tensors. Arrays are (B, T, H, D); the caller pads
# lengths to whole tiles (`hopper_padded_lengths`) and passes the true key count
# `kv_len` (None: every key is real), or, with `tma_edges` (lengths in 8-row tiles, on a GPU), passes
# them in place (`HOPPER_TMA_EDGES`). `window` (left, right) with -1 unbounded, or None;
# `softcap` a float or None. The tile settings, per head dim, are the ones measured fastest on an H100
# (BENCHMARKS.md, "Hopper kernels"): at head dim 64 the forward's 256-key blocks halve the steps of a
# walk whose products are small, and the backward's 128-row query blocks (its warpgroups splitting
# dQ's rows) ran 8-12% faster than 64-row ones. The head-dim-256 forward has room for 64-key blocks
# in two stages beside one Q/O tile per warpgroup (192 KiB); its backward's items are 64 keys (2 x 32),
# which both warpgroups share (`flash_bwd_mgpu_wide.py`).
HOPPER_TILES = dict(
    forward={64: dict(block_q=64, block_kv=256, stages=2), 128: dict(block_q=64, block_kv=128, stages=2),
             256: dict(block_q=64, block_kv=64, stages=2)},
    backward={64: dict(block_q=128, block_kv=64, stages=2), 128: dict(block_q=64, block_kv=64, stages=2),
              256: dict(block_q=64, block_kv=32, stages=2)},
)
#: Forward tiles for short key lengths, per head dim: (most keys, tiles). At head dim 64 a causal walk
#: over at most 1024 keys is a few blocks long, and 256-key blocks spend a quarter of the first one
#: on the masked diagonal. Forward alone on the persistent grid, causal bf16, H200, 256- / 128-key
#: blocks, µs (BENCHMARKS.md "Forward key blocks at head dim 64 once more"; two runs where given):
#: 119.2-124.9 / 120.0-121.3 at (16, 16, 1024, 64), 166.7 / 185.7 at (16, 16, 1280, 64), 168.6 / 175.0
#: at (12, 16, 1536, 64), 185.1 and 203.1 / 197.3 and 196.1 at (8, 16, 2048, 64) (the fourth pass of
#: 2026-11-29: 208.1 / 214.2 and 186.2 / 194.0), 320.5-328.6 / 346.5-354.3 at (4, 16, 4096, 64). Three
#: compute warpgroups (`compute_wgs=3`, 192-row tiles) ran the kernel alone 1-8% faster up to 2048 keys
#: but the drop-in's training step no faster (BENCHMARKS.md "Three compute warpgroups"), so the tiles
#: stay two warpgroups'.
HOPPER_FORWARD_SHORT = {64: (1024, dict(block_q=64, block_kv=128, stages=2))}


def hopper_tiles(which: str, head_dim: int, kv_len: int) -> dict:
    """The Hopper kernel's tiles (block_q, block_kv, stages, and the forward's compute_wgs where not 2)
    for `which` ("forward" or "backward") at `head_dim` over `kv_len` keys, padded or not (the choice
    is the same either way: a short length pads to at most its bound)."""
    if which == "forward" and head_dim in HOPPER_FORWARD_SHORT:
        most, tiles = HOPPER_FORWARD_SHORT[head_dim]
        if kv_len <= most:
            return tiles
    if head_dim not in HOPPER_TILES[which]:
        raise ValueError(f"head_dim={head_dim}: the Hopper {which} kernel runs head dims "
                         f"{tuple(HOPPER_TILES[which])}; hint: use the Triton flash kernel")
    return HOPPER_TILES[which][head_dim]


#: Programs per multiprocessor of the Hopper forward's persistent grid (0: one program per tile). One
#: program fills a multiprocessor: three warpgroups, the compute ones at 232 registers a thread (or
#: four, three of them computing at 160).
HOPPER_FORWARD_PROGRAMS_PER_SM = 1


def hopper_forward_programs(multiprocessors: int) -> Optional[int]:
    """`programs` of the Hopper forward on a GPU with `multiprocessors` SMs: a persistent grid whose
    programs walk tiles in turn, loading the next while they store the last (None: one per tile)."""
    return multiprocessors * HOPPER_FORWARD_PROGRAMS_PER_SM or None


#: Programs per multiprocessor of the Hopper backward's persistent grid (0: one program per item of
#: 2 * block_kv keys). One program fills a multiprocessor, as in the forward. Backward alone, H200,
#: causal bf16 (BENCHMARKS.md "The backward's persistent grid"): 1.03-1.07x one program per item at
#: head dim 64 (4 / 16 / 8 x 4096 / 1024 / 2048 tokens, and GQA 32/8 heads), 0.99-1.02x at head dim 128.
HOPPER_BACKWARD_PROGRAMS_PER_SM = 1


def hopper_backward_programs(multiprocessors: int) -> Optional[int]:
    """`programs` of the Hopper backward on a GPU with `multiprocessors` SMs: a persistent grid whose
    programs walk key blocks in turn, the query-block ring running on from one to the next (None: one
    program per key block)."""
    return multiprocessors * HOPPER_BACKWARD_PROGRAMS_PER_SM or None


#: Fewest items (2 * block_kv keys of one KV head and head split) the Hopper backward's grid gets
#: where the GQA group allows, by grid (persistent or one program per item) and head dim. An item
#: walks every query head of its share of the group, so with few KV heads there are few items and the
#: longest causal walks leave multiprocessors idle; each split costs float32 partial dK, dV and
#: their sum. One program per item, H100, causal: head dim 128 at (1, 8192), 16 query heads, 488
#: TFLOP/s with 16 KV heads (1024 items), 438 with 8 (512), 275 with 2 (128); head dim 64, whose
#: items walk faster: (1, 8192, 32/8 heads) 353 / 380 / 398 TFLOP/s with 512 / 1024 / 2048 items, (2,
#: 4096, 32/8) 329 / 351 / 390, (1, 16384, 32/8) 444 / 442 / 426 with 1024 / 2048 / 4096. On the
#: persistent grid (H200, backward and the splits' sums, µs, BENCHMARKS.md "The backward's
#: persistent grid"), fewer splits win down to about four items per program: (2, 4096, 32/8 heads,
#: 64) 807 / 838 / 873 with 1 / 2 / 4 splits (512 items unsplit), (1, 8192, 32/8, 64) 1516 / 1538 /
#: 1596, (1, 16384, 32/8, 64) 5916 / 6048 with 1 / 2, (1, 8192, 16/8, 128) 1363 / 1433, (1, 8192,
#: 16/2, 128) 1436 / 1415 / 1410 with 2 / 4 / 8 (256 / 512 / 1024 items).
HOPPER_BACKWARD_MIN_ITEMS = dict(persistent={64: 512, 128: 512, 256: 512}, per_item={64: 2048, 128: 4 * 132,
                                                                                 256: 4 * 132})


@functools.lru_cache(maxsize=1024)  # asked per backward call (torch launch): once per signature
def hopper_head_splits(batch: int, num_q_heads: int, num_kv_heads: int, keys: int, head_dim: int,
                       persistent: bool = True, kv_batch: Optional[int] = None) -> int:
    """`head_splits` of the Hopper backward for `keys` padded keys: the smallest divisor of the query
    (batch, head) pairs per KV pair (the GQA group, times batch / kv_batch where (batch, head) pairs
    are folded into the batch; `kv_batch` None: the batch) whose items (KV batch x KV heads x splits x
    key blocks) number at least HOPPER_BACKWARD_MIN_ITEMS at this head dim on this grid (`persistent`:
    the persistent grid, else one program per item), or all of them."""
    kv_batch = batch if kv_batch is None else kv_batch
    group = num_q_heads // num_kv_heads * (batch // kv_batch)
    blocks = -(-keys // (2 * HOPPER_TILES["backward"][head_dim]["block_kv"]))  # the last may run past `keys`
    least = HOPPER_BACKWARD_MIN_ITEMS["persistent" if persistent else "per_item"][head_dim]
    for splits in range(1, group):
        if group % splits == 0 and kv_batch * num_kv_heads * splits * blocks >= least:
            return splits
    return group


#: Most query blocks one item of the Hopper backward walks (its query length times the query heads it
#: walks, over block_q) for which the backward runs in clusters of two programs on adjacent key
#: blocks, each query block loaded once for both by a multicast (`flash_bwd_mgpu`'s `cluster=2`).
#: Backward alone on the persistent grid, causal bf16, H200, µs, one program / clusters of two
#: (BENCHMARKS.md "Moving less data, measured; clusters of two in the backward"; medians of several
#: runs), walks of 8 to 16 blocks: (16, 16, 1024, 64) 352-376 / 334-358, (16, 1024, 16/8 heads, 64)
#: 336 / 315, (8, 16, 1024, 128) 330-337 / 299-306, (8, 16, 2048, 64) 553 / 535; of 32 and more,
#: slower in clusters: (4, 16, 2048, 128) 430 / 450, (4, 2048, 16/8, 64) 241 / 264, (4, 16, 4096, 64)
#: 776-795 / 905-936, (2, 16, 8192, 128) 2713-2830 / 2823-2853.
HOPPER_BACKWARD_CLUSTER_MOST_STEPS = 16


@functools.lru_cache(maxsize=1024)  # asked per backward call (torch launch): once per signature
def hopper_backward_cluster(batch: int, num_q_heads: int, kv_batch: int, num_kv_heads: int, rows: int, keys: int,
                            head_dim: int, head_splits: int, programs: Optional[int]) -> int:
    """`cluster` of the Hopper backward over the kernel's `rows` query rows and `keys` keys (padded or
    in place): 2 where an item walks at most HOPPER_BACKWARD_CLUSTER_MOST_STEPS query blocks (its share
    of the query (batch, head) pairs that read one KV (batch, head), `rows` each) on a persistent grid
    (`programs`, even) and the keys are whole pairs of items; else 1. Head dim 256 runs without
    clusters."""
    if head_dim not in (64, 128) or programs is None or programs % 2:
        return 1
    tiles = HOPPER_TILES["backward"][head_dim]
    sources = (batch // kv_batch) * (num_q_heads // num_kv_heads) // head_splits
    steps = -(-(rows * sources) // tiles["block_q"])
    pair_keys = 2 * 2 * tiles["block_kv"]
    return 2 if steps <= HOPPER_BACKWARD_CLUSTER_MOST_STEPS and keys % pair_keys == 0 else 1


#: Whether the torch launch passes lengths that are whole 8-row TMA tiles but not whole kernel tiles
#: in place (`tma_edges`: the kernels' last tiles run past them) instead of copying them into padded
#: buffers. In place / padded, H200, causal bf16, drop-in (BENCHMARKS.md "Lengths that are not whole
#: tiles, in place"): forward 905 / 1145 us at (2, 16, 8000, 128), 286 / 373 at (1, 16, 8000, 64),
#: 153 / 330 at (4, 16, 2056, 128); forward + backward 3912 / 4378, 1040 / 1303, 651 / 1261. The GPU
#: tests run it (`test_gpu_hopper.py`); the interpreter, and so the CPU tests, cannot (it refuses
#: copies past an array's end), so there the kernels pad.
HOPPER_TMA_EDGES = True


@functools.lru_cache(maxsize=1024)  # asked per call (torch launch): once per signature
def hopper_padded_lengths(l: int, s: int, head_dim: int, backward: bool, tma_edges: bool = False) -> tuple[int, int]:
    """(L, S) rounded up to whole tiles of the Hopper forward (`backward` False) or backward kernel at
    `head_dim`, with the tuned tiles: the lengths the caller pads to. With `tma_edges` (the kernels'
    option), (L, S) themselves where both are whole 8-row TMA tiles."""
    from .kernels.flash_mgpu_checks import TMA_ROWS

    if tma_edges and l % TMA_ROWS == 0 and s % TMA_ROWS == 0:
        return l, s
    if backward:
        from .kernels.flash_bwd_mgpu import padded_lengths
    else:
        from .kernels.flash_fwd_mgpu import padded_lengths
    tiles = hopper_tiles("backward" if backward else "forward", head_dim, s)
    wgs = {"compute_wgs": tiles["compute_wgs"]} if "compute_wgs" in tiles else {}  # the forward's tile rows
    return padded_lengths(l, s, block_q=tiles["block_q"], block_kv=tiles["block_kv"], **wgs)


def flash_hopper(query, key, value, sinks=None, *, scale, causal, diag_offset, window=None, softcap=None,
                 kv_len=None, programs=None, tma_edges=False):
    """(out (B, L, Hq, D), lse (B, Hq, L') float32, the sinks' logits included) on whole tiles (L' = L),
    or with `tma_edges` (L' = L rounded up to whole tiles); padded query rows are computed too.
    `sinks`: None or (Hq,) float32, one logit per query head.
    `programs`: None (one program per tile) or the persistent grid's size (`flash_forward_mgpu`).
    `tma_edges`: lengths in 8-row tiles, read in place (`flash_forward_mgpu_tiles`)."""
    from .kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles

    return flash_forward_mgpu_tiles(query, key, value, scale=scale, causal=causal, diag_offset=diag_offset,
                                    window=window, softcap=softcap, kv_len=kv_len, sinks=sinks, programs=programs,
                                    tma_edges=tma_edges, **hopper_tiles("forward", query.shape[-1], key.shape[1]))


def flash_hopper_backward(query, key, value, d_out, lse_log2, delta, dq_accum, *, scale, causal, diag_offset,
                          window=None, softcap=None, kv_len=None, head_splits=1, programs=None, cluster=1,
                          tma_edges=False):
    """(dq_accum + dQ float32, dK, dV): `flash_bwd_mgpu.flash_backward_mgpu_tiles` with the tuned tiles
    (with `head_splits` > 1, dK and dV as float32 partial sums (head_splits, B, S, Hk, D) to sum).
    Padded query rows must carry lse_log2 +inf and delta 0. `programs`: None (one program per key
    block) or the persistent grid's size (`flash_backward_mgpu`). `cluster`: programs per cluster
    (`hopper_backward_cluster`). `tma_edges`: lengths in 8-row tiles, read in place
    (`flash_backward_mgpu_tiles`)."""
    from .kernels.flash_bwd_mgpu import flash_backward_mgpu_tiles

    return flash_backward_mgpu_tiles(query, key, value, d_out, lse_log2, delta, dq_accum, scale=scale, causal=causal,
                                     diag_offset=diag_offset, window=window, softcap=softcap, kv_len=kv_len,
                                     head_splits=head_splits, programs=programs, cluster=cluster,
                                     tma_edges=tma_edges, **hopper_tiles("backward", query.shape[-1], key.shape[1]))
