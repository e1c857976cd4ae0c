"""The compute warpgroups of the Hopper backward (`flash_bwd_mgpu.py`) at head dim 256. Imports only JAX.

At head dim 256 a warpgroup cannot keep dK and dV of keys of its own: 64 x 256 float32 each, all of
its registers. So the two compute warpgroups share an item's 2 * block_kv = 64 keys and split the
work between them, warpgroup w taking the query block's rows R_w = [32 w, 32 w + 32) for the scores
and the head's columns C_w = [128 w, 128 w + 128) for the gradients. Per query block of 64 rows:
    * S^T = K Q[R_w]^T and dP^T = V dO[R_w]^T, (64 keys, 32 rows), over all 256 columns;
    * P^T and dS^T of those rows, as in the other head dims, into its half of two shared (64, 64)
      tiles, then a rendezvous (`pds_ready`);
    * dV[:, C_w] += P^T dO[:, C_w] and dK[:, C_w] += dS^T Q[:, C_w]: its own rows' part from
      registers, the other warpgroup's from the shared tiles (64 registers a thread per accumulator);
    * dQ[:, C_w] += dS K[:, C_w], in two products of 64 columns, each added to dq_accum through its
      float32 staging tile by a TMA reduce-add;
    * `pds_free` says both have read P^T and dS^T, before either writes the next block's.
Each warpgroup loads (and at the item's end stores) its column half of K and V, the halves meeting in
one (64, 256) operand; the memory warpgroup streams Q, dO, LSE and delta as at the other head dims, with one dO
slot (`flash_bwd_mgpu.do_stages`). The work, the walk and its masks are `flash_bwd_mgpu`'s.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_bwd_mgpu import (COMPUTE_WGS, LOG2E, WIDE_DQ_COLS, _capped, _ds, _hide, _layout, _load_vector, _mma,
                             _per_step, _soft_cap, _store_dq, _T)
from .flash_bwd_mgpu_walks import _item, _walk_item


def compute_wide(refs, bufs, bars, cfg, *, program, wg):
    """The compute warpgroup `wg`'s walk. Its slices of swizzled tiles are static (one branch per
    warpgroup, `w`); indices into arrays of tiles or barriers derive from `wg` (Mosaic GPU in jax 0.11
    takes no constant index into a wgmma operand's ref)."""
    for w in range(COMPUTE_WGS):
        pl.when(wg == w)(functools.partial(_walk, refs, bufs, bars, cfg, program=program, w=w, wg=wg))


def _walk(refs, bufs, bars, cfg, *, program, w, wg):
    block_q, stages, do_slots = cfg.block_q, cfg.stages, cfg.do_stages
    keys = COMPUTE_WGS * cfg.block_kv
    _, k_ref, v_ref, _, _, _, dq_ref, dk_ref, dv_ref = refs
    k_all, v_all, q_smem, do_smem, lse_smem, delta_smem, pds, dq_smem = bufs
    dq_smem = dq_smem.at[wg]
    assert COMPUTE_WGS == 2
    peer = 1 - wg
    d, dtype = q_smem.shape[-1], q_smem.dtype
    half, rows_w = d // COMPUTE_WGS, block_q // COMPUTE_WGS
    own, other = pl.ds(w * rows_w, rows_w), pl.ds((1 - w) * rows_w, rows_w)
    cols = pl.ds(w * half, half)
    on_gpu = cfg.interpret is None
    scale = cfg.scale
    scale_log2 = (scale if cfg.softcap is None else cfg.softcap) * LOG2E

    def item(j, loaded):
        it = _item(program, j, cfg)
        if on_gpu:
            @pl.when(j > 0)  # the last item's dK and dV stores have read this warpgroup's halves
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        kv_block = (it.batch, pl.ds(it.kv_start, keys), it.kv_head, cols)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_block], k_all.at[wg], bars["k_ready"].at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_block], v_all.at[wg], bars["v_ready"].at[wg])
        for u in (wg, peer):  # the scores read both halves
            plgpu.barrier_wait(bars["k_ready"].at[u])
            plgpu.barrier_wait(bars["v_ready"].at[u])

        def q_step(step, carry, *, masked):
            dk, dv = carry
            n = loaded + step  # the block's number in the ring's run
            slot = lax.rem(n, jnp.int32(stages))
            # (With one slot, `n mod 1` would fold to a constant and dO's wgmma descriptors, hoisted out
            # of the loop, would spill: `_per_step`.)
            do_slot = lax.rem(n, jnp.int32(do_slots)) if do_slots > 1 else _per_step(0, n)
            # K and V's column halves, indexed so that their wgmma descriptors stay in the loop (`_per_step`)
            halves = [_per_step(u, n) for u in (wg, peer)] if w == 0 else [_per_step(u, n) for u in (peer, wg)]
            k_halves, v_halves = [k_all.at[u] for u in halves], [v_all.at[u] for u in halves]
            column_halves = [pl.ds(u * half, half) for u in range(COMPUTE_WGS)]
            # P^T and dS^T (Mosaic GPU in jax 0.11 takes no constant index into a wgmma operand's ref)
            pt_smem, dst_smem = pds.at[_per_step(0, n)], pds.at[_per_step(1, n)]
            q_batch, head, rows = it.block(step, cfg)
            plgpu.barrier_wait(bars["q_ready"].at[slot])
            plgpu.barrier_wait(bars["lse_ready"].at[slot])
            plgpu.barrier_wait(bars["do_ready"].at[do_slot])
            q_slot, do_block = q_smem.at[slot], do_smem.at[do_slot]
            s_t, dp_t = _mma(((keys, rows_w), tuple(k_halves), tuple(_T(q_slot.at[own, c]) for c in column_halves)),
                             ((keys, rows_w), tuple(v_halves), tuple(_T(do_block.at[own, c]) for c in column_halves)),
                             on_gpu=on_gpu)
            lse = _load_vector(lse_smem.at[slot, own], on_gpu=on_gpu)
            s_t, cap_grad = _soft_cap(s_t, cfg)
            p_t = jnp.exp2(s_t * scale_log2 - lax.broadcast_in_dim(lse, s_t.shape, [1]))
            if masked:
                p_t = _hide(p_t, rows + w * rows_w, it.kv_start, cfg, on_gpu=on_gpu)
            plgpu.barrier_wait(bars["delta_ready"].at[do_slot])
            delta = _load_vector(delta_smem.at[do_slot, own], on_gpu=on_gpu)
            ds16 = _capped(_ds(p_t, dp_t, delta, scale), cap_grad).astype(dtype)
            p16 = p_t.astype(dtype)

            @pl.when(n > 0)
            def _():
                plgpu.barrier_wait(bars["pds_free"])  # the other warpgroup has read the last block's
            pt_smem.at[:, own][...] = p16
            dst_smem.at[:, own][...] = ds16
            plgpu.commit_smem()
            plgpu.barrier_arrive(bars["pds_ready"])
            plgpu.barrier_wait(bars["pds_ready"])
            dv, dk = _mma((dv, (p16, pt_smem.at[:, other]), (do_block.at[own, cols], do_block.at[other, cols])),
                          (dk, (ds16, dst_smem.at[:, other]), (q_slot.at[own, cols], q_slot.at[other, cols])),
                          on_gpu=on_gpu)
            plgpu.barrier_arrive(bars["do_free"].at[do_slot])
            plgpu.barrier_arrive(bars["q_free"].at[slot])
            for c in range(0, half, WIDE_DQ_COLS):
                dq_cols = pl.ds(w * half + c, WIDE_DQ_COLS)
                dq, = _mma(((block_q, WIDE_DQ_COLS), _T(dst_smem), k_halves[w].at[:, pl.ds(c, WIDE_DQ_COLS)]),
                           on_gpu=on_gpu)
                target = (q_batch, pl.ds(rows, block_q), head, dq_cols)
                _store_dq(dq, dq_smem, dq_ref.at[target if on_gpu else (w, *target)], on_gpu=on_gpu)
            plgpu.barrier_arrive(bars["pds_free"])
            return dk, dv

        zeros = _layout(jnp.zeros((keys, half), jnp.float32), on_gpu=on_gpu)
        dk, dv = _walk_item(it, cfg, q_step, (zeros, zeros))
        plgpu.barrier_arrive(bars["kv_free"])  # the other warpgroup is done reading K and V
        plgpu.barrier_wait(bars["kv_free"])
        out_block = (it.batch, pl.ds(it.kv_start, keys), it.kv_head)
        if cfg.splits == 1:  # through this warpgroup's halves of the K and V tiles
            k_all.at[wg][...] = dk.astype(dtype)
            v_all.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_all.at[wg], dk_ref.at[(*out_block, cols)])
            plgpu.copy_smem_to_gmem(v_all.at[wg], dv_ref.at[(*out_block, cols)])
        else:  # float32 partial sums, 64 columns at a time through the dQ staging tile
            for acc, out in ((dk, dk_ref), (dv, dv_ref)):
                for c in range(0, half, WIDE_DQ_COLS):
                    if on_gpu:
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    dq_smem[...] = acc[:, c:c + WIDE_DQ_COLS]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(dq_smem, out.at[(it.part, *out_block, pl.ds(w * half + c, WIDE_DQ_COLS))])
                    if not on_gpu:
                        plgpu.wait_smem_to_gmem(0)
        if not on_gpu:
            plgpu.wait_smem_to_gmem(0)
        return loaded + it.steps(cfg)

    loaded = lax.fori_loop(0, cfg.items.count(program), item, jnp.int32(0))

    @pl.when(loaded > 0)
    def _():
        plgpu.barrier_wait(bars["pds_free"])  # the last release, so that no phase is left pending
    plgpu.wait_smem_to_gmem(0)
