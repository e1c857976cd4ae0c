"""Flash-attention forward for Hopper (sm90) in Pallas Mosaic GPU, FlashAttention-3 style.

The torch drop-in runs it on Hopper for the calls `torch_api.hopper_flash` accepts, with the backward
of `flash_bwd_mgpu.py`. Imports only JAX and uses Pallas Mosaic GPU APIs present from jax 0.10.2 to
0.11.

Arrays, (batch, length, heads, head dim) as Mosaic GPU's TMA wants them:
    q (B, L, Hq, D), k and v (B, S, Hk, D), bf16 or fp16, D 64 or 128, any L, S >= 1; query head h
    reads KV head h // (Hq // Hk) (GQA). Returns out (B, L, Hq, D) in q's dtype and lse (B, Hq, L)
    float32, natural log. A row that sees no key gives out 0 and lse -inf (the sink's logit with sinks).

One program (a CUDA block of three warpgroups) owns 2 * block_q query rows of one head:
    * warpgroup 2 (memory) issues TMA copies of K and V blocks into a ring of `stages` shared-memory
      slots; `*_ready` barriers say a slot is filled, `*_free` barriers (two arrivals, one per compute
      warpgroup) say both have read it.
    * warpgroups 0 and 1 (compute) own block_q rows each: wgmma S = Q K^T, online softmax in
      registers (exp2, scale * log2(e) folded into one multiply), wgmma O += P V. A shared
      `turn` barrier makes them alternate, so one warpgroup's softmax overlaps the other's matmuls.

Features, all compiled in (none of them costs anything when unused):
    * causal and sliding window `window=(left, right)` (-1: unbounded side): query row i sees keys
      i + diag_offset - left <= j <= i + diag_offset + right; causal is right = 0 (diag_offset 0
      aligns top-left, S - L bottom-right). A program loads only the key blocks between its first
      row's left edge and its last row's right edge; a compute warpgroup releases the ring slots of
      blocks it does not need, and masks only the blocks that cross one of its rows' band edges.
    * logits soft cap: s -> softcap * tanh(scale * s / softcap) before the softmax.
    * attention sinks: one logit per query head that joins each row's softmax normaliser (and the
      LSE) but carries no value; an extra kernel operand only when given, (Hq,), or (B, Hq) on whole
      tiles (`flash_forward_mgpu_tiles`: a caller that folds (batch, head) pairs into the batch).
Edge tiles: TMA moves whole tiles only, so `flash_forward_mgpu` pads q to a multiple of 2 * block_q
rows and k, v to a multiple of block_kv (a copy only when a length is not one already), runs the
kernel with the true key count `kv_len` (keys past it are masked in the last key block only) and
slices the padded query rows off. `flash_forward_mgpu_tiles` is the bare kernel call on whole
tiles, for launchers (such as `plgpu.as_torch_kernel`) that pad themselves; `padded_lengths`
says to what.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .flash_mgpu_checks import COMPUTE_WGS, SMEM_BYTES, SMEM_RESERVE  # noqa: F401 (re-exported)
from .flash_mgpu_checks import check_arrays, check_features, check_tiling, check_whole_tiles

LOG2E = math.log2(math.e)
# The running max starts finite: a fully masked block (all scores -inf) then gives exp2(-inf) = 0
# and a rescale factor of 1 instead of exp2(-inf - -inf) = NaN, with no select on the hot path.
M_FLOOR = -1e30


@dataclasses.dataclass(frozen=True)
class _Band:
    """Which keys each query row sees, all static: row i sees keys j with
    i + diag_offset - left <= j <= i + diag_offset + right (None: that side unbounded) and j < kv_len."""
    diag_offset: int
    left: int | None
    right: int | None
    kv_len: int
    block_q: int
    block_kv: int

    @property
    def num_kv_blocks(self):
        return pl.cdiv(self.kv_len, self.block_kv)

    @property
    def ragged_end(self):
        """Whether the last key block holds padding (keys >= kv_len) to mask."""
        return self.kv_len % self.block_kv != 0


def _kv_end(row_end, band):
    """One past the last key block that rows [.., row_end) need."""
    if band.right is None:
        return jnp.int32(band.num_kv_blocks)
    visible_end = row_end + (band.diag_offset + band.right)  # keys j < this are visible to some row
    return jnp.clip(pl.cdiv(visible_end, jnp.int32(band.block_kv)), 0, band.num_kv_blocks)


def _kv_start(row_start, kv_end, band):
    """The first key block that rows [row_start, ..) need (at most kv_end); Python 0 with no left edge."""
    if band.left is None:
        return 0
    first_key = jnp.maximum(row_start + (band.diag_offset - band.left), 0)
    return jnp.minimum(lax.div(first_key, jnp.int32(band.block_kv)), kv_end)


def _full_blocks(rows, lo, hi, band):
    """[full_lo, full_hi) within [lo, hi): the key blocks every row of rows [rows, rows + block_q)
    sees whole, so they need no mask; the blocks of [lo, full_lo) and [full_hi, hi) cross an edge."""
    full_lo = lo
    if band.left is not None:  # the last row's left edge is the tightest
        last_row_first_key = jnp.maximum(rows + (band.block_q - 1 + band.diag_offset - band.left), 0)
        full_lo = jnp.clip(pl.cdiv(last_row_first_key, jnp.int32(band.block_kv)), lo, hi)
    if band.right is None and not band.ragged_end:
        return full_lo, hi
    whole_blocks = band.kv_len // band.block_kv  # blocks with no key past kv_len
    if band.right is None:
        return full_lo, (whole_blocks if band.left is None else jnp.clip(whole_blocks, full_lo, hi))
    # The first row's right edge is the tightest.
    full_end = lax.div(rows + (band.diag_offset + band.right) + 1, jnp.int32(band.block_kv))
    if band.ragged_end:
        full_end = jnp.minimum(full_end, whole_blocks)
    return full_lo, jnp.clip(full_end, full_lo, hi)


def _mask(s, i, rows, band, *, on_gpu):
    """s (rows [rows, rows + block_q) x keys of block i) with the keys outside each row's band at -inf."""
    row, col = (_iota(s.shape, dim, on_gpu=on_gpu) for dim in (0, 1))
    if band.right is not None:
        s = jnp.where(row + (rows + (band.diag_offset + band.right)) >= col + i * band.block_kv, s, -jnp.inf)
    if band.left is not None:
        s = jnp.where(col + i * band.block_kv >= row + (rows + (band.diag_offset - band.left)), s, -jnp.inf)
    if band.ragged_end:
        s = jnp.where(col + i * band.block_kv < band.kv_len, s, -jnp.inf)
    return s


def _program(*refs, scale, band, softcap, has_sinks, stages, num_q_programs, group, interpret):
    q_ref, k_ref, v_ref = refs[:3]
    sinks_ref = refs[3] if has_sinks else None
    out_ref, lse_ref = refs[-2:]
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
    block_q, block_kv = band.block_q, band.block_kv
    # 128-byte rows (64 16-bit elements) in 128-byte swizzled tiles: the layout TMA writes and
    # wgmma reads without bank conflicts.
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        plgpu.SMEM((COMPUTE_WGS, block_q, d), dtype, transforms=transforms),  # Q, then O
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),  # K ring
        plgpu.SMEM((stages, block_kv, d), dtype, transforms=transforms),  # V ring
        plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32),  # LSE rows
    )
    barriers = dict(
        q_ready=plgpu.Barrier(num_barriers=COMPUTE_WGS),
        k_ready=plgpu.Barrier(num_barriers=stages),
        v_ready=plgpu.Barrier(num_barriers=stages),
        k_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        v_free=plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),
        turn=plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    )
    cfg = dict(scale=scale, band=band, softcap=softcap, stages=stages, num_q_programs=num_q_programs,
               group=group, interpret=interpret)
    # Allocated once for the three warpgroups together (collective over "wg").
    pl.run_scoped(
        lambda bufs, bars: _warpgroups(q_ref, k_ref, v_ref, sinks_ref, out_ref, lse_ref, bufs, bars, **cfg),
        smem, barriers, collective_axes="wg")


def _warpgroups(q_ref, k_ref, v_ref, sinks_ref, out_ref, lse_ref, bufs, bars, *, scale, band, softcap,
                stages, num_q_programs, group, interpret):
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    block_q = band.block_q
    # Longest causal rows first: the last programs to start are then the short ones.
    q_block = num_q_programs - 1 - lax.axis_index("q_blocks")
    program_rows = q_block * (COMPUTE_WGS * block_q)
    # The program's key blocks: from warpgroup 0's first to warpgroup 1's last (their rows come
    # later). The memory warpgroup loads all of them; each compute warpgroup releases the slots of
    # those it does not need.
    program_end = _kv_end(program_rows + COMPUTE_WGS * block_q, band)
    program_start = (0 if band.left is None else
                     _kv_start(program_rows, _kv_end(program_rows + block_q, band), band))

    @pl.when(wg < COMPUTE_WGS)
    def _():
        # Registers moved from the memory warpgroup to the compute ones (Hopper's setmaxnreg).
        plgpu.set_max_registers(232, action="increase")
        _compute(q_ref, sinks_ref, out_ref, lse_ref, bufs, bars, batch=batch, head=head, wg=wg,
                 rows=program_rows + wg * block_q, program_start=program_start, program_end=program_end,
                 scale=scale, band=band, softcap=softcap, stages=stages, interpret=interpret)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        _memory(k_ref, v_ref, bufs, bars, batch=batch, kv_head=lax.div(head, jnp.int32(group)),
                program_start=program_start, program_end=program_end, block_kv=band.block_kv, stages=stages)


def _memory(k_ref, v_ref, bufs, bars, *, batch, kv_head, program_start, program_end, block_kv, stages):
    _, k_smem, v_smem, _ = bufs

    # Block `step` goes to slot step % stages; the ring's first round (from program_start) finds
    # every slot free.
    @pl.loop(program_start, program_end)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        keys = (batch, pl.ds(step * block_kv, block_kv), kv_head)

        @pl.when(step >= program_start + stages)  # the slot's previous block must have been read by both
        def _():
            plgpu.barrier_wait(bars["k_free"].at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], bars["k_ready"].at[slot])

        @pl.when(step >= program_start + stages)
        def _():
            plgpu.barrier_wait(bars["v_free"].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], bars["v_ready"].at[slot])

    # Observe the last releases too, so that every barrier phase is consumed before the barriers
    # go away (cheap: the compute warpgroups are finishing these blocks anyway).
    @pl.loop(jnp.maximum(program_end - stages, program_start), program_end)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_free"].at[slot])
        plgpu.barrier_wait(bars["v_free"].at[slot])


def padded_lengths(l, s, *, block_q=64, block_kv=128):
    """(L, S) rounded up to the kernel's whole tiles: 2 * block_q query rows, block_kv keys."""
    rows = COMPUTE_WGS * block_q
    return pl.cdiv(l, rows) * rows, pl.cdiv(s, block_kv) * block_kv


def _pad_rows(x, length):
    """x (B, n, H, D) with zero rows appended up to `length` (x itself when n is already that)."""
    if x.shape[1] == length:
        return x
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def _checked_band(q, k, v, *, scale, causal, diag_offset, window, softcap, sinks, block_q, block_kv, stages,
                  per_batch_sinks=False):
    """The checked arguments' band, all keys (kv_len = S) real."""
    check_arrays(q, k, v)
    check_tiling(q.shape[3], jnp.dtype(q.dtype).itemsize, block_q, block_kv, stages)
    check_features(q.shape[2], scale=scale, diag_offset=diag_offset, window=window, softcap=softcap,
                   sinks=sinks, batch=q.shape[0] if per_batch_sinks else None)
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0
    return _Band(diag_offset=int(diag_offset), left=None if left < 0 else int(left),
                 right=None if right < 0 else int(right), kv_len=k.shape[1], block_q=block_q, block_kv=block_kv)


def flash_forward_mgpu(q, k, v, *, scale, causal, diag_offset=0, block_q=64, block_kv=128, stages=2,
                       window=None, softcap=None, sinks=None, interpret=None):
    """(out, lse) of softmax(scale * q k^T [causal, window, soft cap, sinks]) v, any L, S >= 1; see
    the module docstring for layouts and features.

    Pads q, k, v to whole tiles (no copy when they are whole already), runs the kernel and slices
    the padded rows off: with whole tiles this is one Mosaic GPU kernel call and nothing else.
    `window`: (left, right), -1 unbounded, or None. `softcap`: float or None. `sinks`: (Hq,) float32
    or None. `interpret`: Mosaic GPU interpret-mode parameters (`InterpretGPUParams`) to run on a
    CPU, or None to compile for the GPU."""
    band = _checked_band(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, window=window,
                         softcap=softcap, sinks=sinks, block_q=block_q, block_kv=block_kv, stages=stages)
    l, s = q.shape[1], k.shape[1]
    rows, keys = padded_lengths(l, s, block_q=block_q, block_kv=block_kv)
    out, lse = _launch(_pad_rows(q, rows), _pad_rows(k, keys), _pad_rows(v, keys), sinks, band=band,
                       scale=scale, softcap=softcap, stages=stages, interpret=interpret)
    if rows != l:
        out, lse = out[:, :l], lse[:, :, :l]
    return out, lse


def flash_forward_mgpu_tiles(q, k, v, *, scale, causal, kv_len=None, diag_offset=0, block_q=64, block_kv=128,
                             stages=2, window=None, softcap=None, sinks=None, interpret=None):
    """`flash_forward_mgpu` on whole tiles: L a multiple of 2 * block_q, S of block_kv (see
    `padded_lengths`), keys from `kv_len` on (default S: none) masked as padding, padded query rows
    computed like the others. Padding must be finite (zeros, say): a masked key's weight is 0, and
    0 * NaN is NaN. One Mosaic GPU kernel call and nothing else, so that `plgpu.as_torch_kernel`
    can launch a function that calls this on torch tensors."""
    band = _checked_band(q, k, v, scale=scale, causal=causal, diag_offset=diag_offset, window=window,
                         softcap=softcap, sinks=sinks, block_q=block_q, block_kv=block_kv, stages=stages,
                         per_batch_sinks=True)
    kv_len = band.kv_len if kv_len is None else kv_len
    check_whole_tiles(q.shape[1], k.shape[1], kv_len, block_q, block_kv)
    return _launch(q, k, v, sinks, band=dataclasses.replace(band, kv_len=int(kv_len)), scale=scale,
                   softcap=softcap, stages=stages, interpret=interpret)


def _launch(q, k, v, sinks, *, band, scale, softcap, stages, interpret):
    """The kernel call on whole tiles (arguments checked)."""
    b, l, hq, d = q.shape
    hk = k.shape[2]
    body = functools.partial(
        _program, scale=float(scale), band=band, softcap=None if softcap is None else float(softcap),
        has_sinks=sinks is not None, stages=min(stages, band.num_kv_blocks),
        num_q_programs=l // (COMPUTE_WGS * band.block_q), group=hq // hk, interpret=interpret)
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, l), jnp.float32)),
        grid=(hq, l // (COMPUTE_WGS * band.block_q), b),
        grid_names=("heads", "q_blocks", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return call(q, k, v) if sinks is None else call(q, k, v, sinks)


# Mosaic GPU's interpreter (jax 0.10 to 0.11) runs plain JAX ops on the CPU: it has no layout casts,
# no run_state, and its wgmma takes neither a transposed operand nor one in registers. The helpers
# below hold these GPU-only constructs and, under `on_gpu=False`, the same math as plain dots on the
# same shared-memory slots (so TMA, barriers and the pipeline still run as on the GPU).
def _wgmma_layout(x, *, on_gpu):
    """x in the layout of a wgmma accumulator (2-D) or of its row reductions (1-D)."""
    if not on_gpu:
        return x
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA if x.ndim == 2 else plgpu.Layout.WGMMA.reduce(1))


def _iota(shape, dim, *, on_gpu):
    if not on_gpu:
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _scores(q_smem, k_slot, after_issue, *, on_gpu):
    """q @ k^T in float32 from shared memory; calls after_issue() between issuing and reading it."""
    def qk(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_slot, (1, 0)))
        after_issue()
        return acc_ref[...]
    if on_gpu:
        return pl.run_scoped(qk, plgpu.ACC((q_smem.shape[0], k_slot.shape[0]), jnp.float32))
    after_issue()
    return lax.dot_general(q_smem[...], k_slot[...], (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _accumulate_pv(acc, p, v_slot, *, in_place):
    """acc + p @ v, p in registers. On the GPU the wgmma accumulates into acc's registers (run_state
    hands them to it and returns once it is done)."""
    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p, v_slot)
    if in_place:
        return pl.run_state(pv)(plgpu.ACC.init(acc))
    return acc + lax.dot_general(p, v_slot[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _compute(q_ref, sinks_ref, out_ref, lse_ref, bufs, bars, *, batch, head, wg, rows, program_start,
             program_end, scale, band, softcap, stages, interpret):
    qo_smem, k_smem, v_smem, lse_smem = bufs
    qo_smem, lse_smem = qo_smem.at[wg], lse_smem.at[wg]
    block_q = band.block_q
    d = qo_smem.shape[-1]
    dtype = qo_smem.dtype
    # Log2 domain: the softmax runs on t * log2(e) * s for t = scale, or with a soft cap on
    # softcap * log2(e) * tanh(scale / softcap * s), so that exp2 needs one FMA per score.
    scale_log2 = (scale if softcap is None else softcap) * LOG2E
    on_gpu = interpret is None

    def take_turn():
        plgpu.barrier_arrive(bars["turn"])
        plgpu.barrier_wait(bars["turn"])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(rows, block_q), head], qo_smem, bars["q_ready"].at[wg])
    plgpu.barrier_wait(bars["q_ready"].at[wg])

    # This warpgroup's key blocks [start, end) of the program's [program_start, program_end).
    end = _kv_end(rows + block_q, band)
    start = _kv_start(rows, end, band)
    full_start, full_end = _full_blocks(rows, start, end, band)

    def kv_step(i, carry, *, masked):
        acc, m, l = carry
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_ready"].at[slot])

        # take_turn once the matmul is issued: the other warpgroup may then issue its own.
        s = _scores(qo_smem, k_smem.at[slot], take_turn, on_gpu=on_gpu)
        plgpu.barrier_arrive(bars["k_free"].at[slot])
        if softcap is not None:  # before the mask: tanh(-inf) would be a finite -1
            s = jnp.tanh(s * (scale / softcap))
        if masked:
            s = _mask(s, i, rows, band, on_gpu=on_gpu)
        m_new = jnp.maximum(m, s.max(axis=1) * scale_log2)
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(dtype)
        # Finish the softmax before handing the tensor cores over, rather than letting the compiler
        # sink part of it past the barrier into the other warpgroup's turn.
        acc, m_new, l, p16 = lax.optimization_barrier((acc, m_new, l, p16))
        plgpu.barrier_arrive(bars["turn"])
        plgpu.barrier_wait(bars["v_ready"].at[slot])
        plgpu.barrier_wait(bars["turn"])

        acc = _accumulate_pv(acc, p16, v_smem.at[slot], in_place=on_gpu)
        plgpu.barrier_arrive(bars["v_free"].at[slot])
        return acc, m_new, l

    def release(i, _):
        """A block of the program this warpgroup does not need: free its slot, keep the turns."""
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_ready"].at[slot])
        plgpu.barrier_arrive(bars["k_free"].at[slot])
        plgpu.barrier_wait(bars["v_ready"].at[slot])
        plgpu.barrier_arrive(bars["v_free"].at[slot])
        take_turn()
        take_turn()

    acc = _wgmma_layout(jnp.zeros((block_q, d), jnp.float32), on_gpu=on_gpu)
    m = _wgmma_layout(jnp.full((block_q,), M_FLOOR, jnp.float32), on_gpu=on_gpu)
    l = _wgmma_layout(jnp.zeros((block_q,), jnp.float32), on_gpu=on_gpu)
    if sinks_ref is not None:
        # The sink is one more logit with no value: the running max and sum start from it (a -inf
        # sink leaves them at M_FLOOR and 0).
        sink = (sinks_ref[head] if len(sinks_ref.shape) == 1 else sinks_ref[batch, head]) * LOG2E
        m = jnp.maximum(m, sink)
        l = jnp.exp2(sink - m)
    # Warpgroup 1 starts one turn behind, so the two alternate: QK of one during softmax of the other.
    pl.when(wg == 1)(take_turn)
    carry = (acc, m, l)
    if band.left is not None:
        lax.fori_loop(program_start, start, release, None)
        carry = lax.fori_loop(start, full_start, functools.partial(kv_step, masked=True), carry)
    carry = lax.fori_loop(full_start, full_end, functools.partial(kv_step, masked=False), carry)
    if band.right is not None or band.ragged_end:
        carry = lax.fori_loop(full_end, end, functools.partial(kv_step, masked=True), carry)
    if band.right is not None:
        lax.fori_loop(end, program_end, release, None)
    acc, m, l = carry
    pl.when(wg == 0)(take_turn)

    # l >= 1 for a row that saw a key or has a sink (its max contributes exp2(0)); l = 0 (acc = 0)
    # for one that saw neither, which max(l, 1) turns into out = 0, and log(0) into lse = -inf.
    acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])
    qo_smem[...] = acc.astype(dtype)
    lse_smem[...] = m * math.log(2.0) + jnp.log(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(rows, block_q), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(rows, block_q)])
    plgpu.wait_smem_to_gmem(0)
