"""Flash-attention forward for Hopper (sm90) in Pallas Mosaic GPU, FlashAttention-3 style.

Not wired into dispatch yet: `benchmarks/flash_mgpu_gpu.py` measures it. Imports only JAX and uses
Pallas Mosaic GPU APIs present, unchanged, from jax 0.10.2 to 0.11.

Arrays, (batch, length, heads, head dim) as Mosaic GPU's TMA wants them:
    q (B, L, Hq, D), k and v (B, S, Hk, D), bf16 or fp16, D 64 or 128; query head h reads KV head
    h // (Hq // Hk) (GQA). Returns out (B, L, Hq, D) in q's dtype and lse (B, Hq, L) float32,
    natural log. A row that sees no key gives out 0 and lse -inf.
L must be a multiple of 2 * block_q and S of block_kv: there are no masked edge tiles.

One program (a CUDA block of three warpgroups) owns 2 * block_q query rows of one head:
    * warpgroup 2 (memory) issues TMA copies of K and V blocks into a ring of `stages` shared-memory
      slots; `*_ready` barriers say a slot is filled, `*_free` barriers (two arrivals, one per compute
      warpgroup) say both have read it.
    * warpgroups 0 and 1 (compute) own block_q rows each: wgmma S = Q K^T, online softmax in
      registers (exp2, scale * log2(e) folded into one multiply), wgmma O += P V. A shared
      `turn` barrier makes them alternate, so one warpgroup's softmax overlaps the other's matmuls.
Causal: query row i sees keys j <= i + diag_offset (0 top-left, S - L bottom-right). Key blocks past
a program's diagonal are never loaded; only blocks crossing a warpgroup's diagonal are masked.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2
LOG2E = math.log2(math.e)
# The running max starts finite: a fully masked block (all scores -inf) then gives exp2(-inf) = 0
# and a rescale factor of 1 instead of exp2(-inf - -inf) = NaN, with no select on the hot path.
M_FLOOR = -1e30


#: Shared memory one thread block may use on sm90, and what the kernel keeps free of its buffers.
SMEM_BYTES = 232448
SMEM_RESERVE = 4096


def _check(q, k, v, scale, block_q, block_kv, stages):
    """Raises ValueError naming the argument, its value and what is expected."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name}.shape={x.shape}: expected (batch, length, heads, head_dim)")
        if x.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name}.dtype={x.dtype}: expected bfloat16 or float16 (wgmma operands); "
                             "cast float32 inputs first")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}: expected one dtype")
    b, l, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k.shape={k.shape}, v.shape={v.shape}: expected both (B={b}, S, Hk, D={d})")
    if d not in (64, 128):
        raise ValueError(f"head_dim={d}: expected 64 or 128; hint: use the Triton flash kernel")
    if hq % k.shape[2]:
        raise ValueError(f"query heads {hq}, KV heads {k.shape[2]}: expected a multiple (GQA)")
    if block_q % 64 or block_kv % 64 or block_q <= 0 or block_kv <= 0:
        raise ValueError(f"block_q={block_q}, block_kv={block_kv}: expected positive multiples of 64 "
                         "(a wgmma tile is 64 rows)")
    if stages < 2:
        raise ValueError(f"stages={stages}: expected at least 2 (one slot loading while one is read)")
    # Q/O tiles and the K and V rings; barriers and Mosaic's own scratch take a few KiB more (an
    # H100 run of D=128, block_kv=128, stages=3: 229,888 bytes of buffers, 232,568 in all).
    buffers = jnp.dtype(q.dtype).itemsize * (COMPUTE_WGS * block_q * d + 2 * stages * block_kv * d)
    if buffers > SMEM_BYTES - SMEM_RESERVE:
        raise ValueError(f"stages={stages}, block_kv={block_kv}, head_dim={d}: {buffers} bytes of shared-memory "
                         f"buffers, expected at most {SMEM_BYTES - SMEM_RESERVE} (Hopper's {SMEM_BYTES} per block "
                         f"less {SMEM_RESERVE} for barriers and scratch); hint: fewer stages or a smaller block_kv")
    if l % (COMPUTE_WGS * block_q):
        raise ValueError(f"query length L={l}: expected a multiple of 2 * block_q = {2 * block_q}; "
                         "hint: pad the queries or use the Triton flash kernel")
    if k.shape[1] % block_kv:
        raise ValueError(f"key length S={k.shape[1]}: expected a multiple of block_kv={block_kv}; "
                         "hint: pad the keys (and mask them) or use the Triton flash kernel")
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"scale={scale!r}: expected a positive Python float (it is compiled in)")


def _kv_steps(row_end, diag_offset, causal, block_kv, num_kv_blocks):
    """Key blocks that rows [.., row_end) need: all of them, or those up to the last row's diagonal."""
    if not causal:
        return jnp.int32(num_kv_blocks)
    visible_end = row_end + diag_offset  # keys j < row_end + diag_offset are visible to some row
    return jnp.clip(pl.cdiv(visible_end, jnp.int32(block_kv)), 0, num_kv_blocks)


def _program(q_ref, k_ref, v_ref, out_ref, lse_ref, *, scale, causal, diag_offset, block_q, block_kv,
             stages, num_kv_blocks, num_q_programs, group, interpret):
    d = q_ref.shape[-1]
    dtype = q_ref.dtype
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
    cfg = dict(scale=scale, causal=causal, diag_offset=diag_offset, block_q=block_q,
               block_kv=block_kv, stages=stages, num_kv_blocks=num_kv_blocks,
               num_q_programs=num_q_programs, group=group, interpret=interpret)
    # Allocated once for the three warpgroups together (collective over "wg").
    pl.run_scoped(
        lambda bufs, bars: _warpgroups(q_ref, k_ref, v_ref, out_ref, lse_ref, bufs, bars, **cfg),
        smem, barriers, collective_axes="wg")


def _warpgroups(q_ref, k_ref, v_ref, out_ref, lse_ref, bufs, bars, *, scale, causal, diag_offset,
                block_q, block_kv, stages, num_kv_blocks, num_q_programs, group, interpret):
    batch, head, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    # Longest causal rows first: the last programs to start are then the short ones.
    q_block = num_q_programs - 1 - lax.axis_index("q_blocks")
    program_rows = q_block * (COMPUTE_WGS * block_q)
    # Warpgroup 1 owns the later rows, so it needs the most key blocks: the memory warpgroup loads
    # that many and warpgroup 0 releases the slots it does not need.
    program_steps = _kv_steps(program_rows + COMPUTE_WGS * block_q, diag_offset, causal, block_kv,
                              num_kv_blocks)

    @pl.when(wg < COMPUTE_WGS)
    def _():
        # Registers moved from the memory warpgroup to the compute ones (Hopper's setmaxnreg).
        plgpu.set_max_registers(232, action="increase")
        _compute(q_ref, out_ref, lse_ref, bufs, bars, batch=batch, head=head, wg=wg,
                 rows=program_rows + wg * block_q, program_steps=program_steps, scale=scale,
                 causal=causal, diag_offset=diag_offset, block_q=block_q, block_kv=block_kv,
                 stages=stages, num_kv_blocks=num_kv_blocks, interpret=interpret)

    @pl.when(wg == COMPUTE_WGS)
    def _():
        plgpu.set_max_registers(40, action="decrease")
        _memory(k_ref, v_ref, bufs, bars, batch=batch, kv_head=lax.div(head, jnp.int32(group)),
                program_steps=program_steps, block_kv=block_kv, stages=stages)


def _memory(k_ref, v_ref, bufs, bars, *, batch, kv_head, program_steps, block_kv, stages):
    _, k_smem, v_smem, _ = bufs

    @pl.loop(0, program_steps)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        keys = (batch, pl.ds(step * block_kv, block_kv), kv_head)

        @pl.when(step >= stages)  # the slot's previous block must have been read by both
        def _():
            plgpu.barrier_wait(bars["k_free"].at[slot])
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], bars["k_ready"].at[slot])

        @pl.when(step >= stages)
        def _():
            plgpu.barrier_wait(bars["v_free"].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], bars["v_ready"].at[slot])

    # Observe the last releases too, so that every barrier phase is consumed before the barriers
    # go away (cheap: the compute warpgroups are finishing these blocks anyway).
    @pl.loop(jnp.maximum(program_steps - stages, 0), program_steps)
    def _(step):
        slot = lax.rem(step, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_free"].at[slot])
        plgpu.barrier_wait(bars["v_free"].at[slot])


def flash_forward_mgpu(q, k, v, *, scale, causal, diag_offset=0, block_q=64, block_kv=128, stages=2,
                       interpret=None):
    """(out, lse) of softmax(scale * q k^T [causal]) v; see the module docstring for layouts.

    One Mosaic GPU kernel call and nothing else, so that `plgpu.as_torch_kernel` can launch a
    function that calls this on torch tensors. `interpret`: Mosaic GPU interpret-mode parameters
    (`InterpretGPUParams`) to run on a CPU, or None to compile for the GPU."""
    _check(q, k, v, scale, block_q, block_kv, stages)
    b, l, hq, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    num_kv_blocks = s // block_kv
    body = functools.partial(
        _program, scale=float(scale), causal=bool(causal), diag_offset=int(diag_offset),
        block_q=block_q, block_kv=block_kv, stages=min(stages, num_kv_blocks),
        num_kv_blocks=num_kv_blocks, num_q_programs=l // (COMPUTE_WGS * block_q), group=hq // hk, interpret=interpret)
    call = plgpu.kernel(
        body,
        out_type=(jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, hq, l), jnp.float32)),
        grid=(hq, l // (COMPUTE_WGS * block_q), b),
        grid_names=("heads", "q_blocks", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )
    return call(q, k, v)


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


def _compute(q_ref, out_ref, lse_ref, bufs, bars, *, batch, head, wg, rows, program_steps, scale, causal,
             diag_offset, block_q, block_kv, stages, num_kv_blocks, interpret):
    qo_smem, k_smem, v_smem, lse_smem = bufs
    qo_smem, lse_smem = qo_smem.at[wg], lse_smem.at[wg]
    d = qo_smem.shape[-1]
    dtype = qo_smem.dtype
    scale_log2 = scale * LOG2E
    on_gpu = interpret is None

    def take_turn():
        plgpu.barrier_arrive(bars["turn"])
        plgpu.barrier_wait(bars["turn"])

    plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(rows, block_q), head], qo_smem, bars["q_ready"].at[wg])
    plgpu.barrier_wait(bars["q_ready"].at[wg])

    steps = _kv_steps(rows + block_q, diag_offset, causal, block_kv, num_kv_blocks)
    # Blocks every row of this warpgroup sees whole (the lowest row sees keys j <= rows + diag_offset).
    full_steps = (jnp.clip(lax.div(rows + diag_offset + 1, jnp.int32(block_kv)), 0, steps)
                  if causal else steps)

    def kv_step(i, carry, *, masked):
        acc, m, l = carry
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(bars["k_ready"].at[slot])

        # take_turn once the matmul is issued: the other warpgroup may then issue its own.
        s = _scores(qo_smem, k_smem.at[slot], take_turn, on_gpu=on_gpu)
        plgpu.barrier_arrive(bars["k_free"].at[slot])
        if masked:
            row, col = (_iota(s.shape, dim, on_gpu=on_gpu) for dim in (0, 1))
            s = jnp.where(row + (rows + diag_offset) >= col + i * block_kv, s, -jnp.inf)
        # Log2 domain: m is the running max of scale * log2(e) * s, so exp2 needs one FMA per score.
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
        """A block this warpgroup does not need (causal, warpgroup 0): free its slot, keep the turns."""
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
    # Warpgroup 1 starts one turn behind, so the two alternate: QK of one during softmax of the other.
    pl.when(wg == 1)(take_turn)
    carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), (acc, m, l))
    if causal:
        carry = lax.fori_loop(full_steps, steps, functools.partial(kv_step, masked=True), carry)
        lax.fori_loop(steps, program_steps, release, None)
    acc, m, l = carry
    pl.when(wg == 0)(take_turn)

    # l >= 1 for a row that saw a key (its max contributes exp2(0)); l = 0 (acc = 0) for one that saw
    # none, which max(l, 1) turns into out = 0, and log(0) into lse = -inf.
    acc = acc / lax.broadcast_in_dim(jnp.maximum(l, 1.0), acc.shape, [0])
    qo_smem[...] = acc.astype(dtype)
    lse_smem[...] = m * math.log(2.0) + jnp.log(l)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(qo_smem, out_ref.at[batch, pl.ds(rows, block_q), head])
    plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[batch, head, pl.ds(rows, block_q)])
    plgpu.wait_smem_to_gmem(0)
