"""The Hopper flash kernels (Pallas Mosaic GPU: `flash_fwd_mgpu`, `flash_bwd_mgpu`) launched from torch.

The native launcher runs them in place of the Triton kernels for the calls `hopper_reasons` accepts:
sm90, bf16/fp16, head dim 64, 128 or 256 (query and value), causal in either alignment or none, sliding
windows, a logits soft cap, GQA, sinks (one logit per query head; eager calls), no bias, mask,
dropout or packing, not inside CUDA graph capture (a first launch loads its module), and query and
key lengths of at least `HOPPER_MIN_LENGTH` (forward only, or with gradients;
`HOPPER_MIN_LENGTH_PROGRAM` for calls a compiled program runs), below which the Triton kernels
measured faster (BENCHMARKS.md "Hopper kernels", "Compiled programs for the Hopper path"). Eager
calls launch directly; under torch.compile a call is the custom op `jaxattn::hopper_flash` (with its
backward op, `bridge.mosaic_op`), which Inductor keeps opaque and CUDA graphs leave out
(`mode="reduce-overhead"` captures the rest of the graph).
Automatic launch (`launch.native_decision`) sends a call that `hopper_launch_reasons` accepts (with or
without gradients, as the call needs: the drop-in's prepared calls, `flash_attention` and the
transformers plug-in tell it) to the native launcher, and so to these kernels, instead of JAX's cuDNN;
a call whose need of gradients is unknown keeps JAX's cuDNN. `flash_attention` and the plug-in reach
them through `native_flash.flash_forward` when they want no LSE back (these kernels' LSE is not
differentiable).

Any lengths: the kernels move whole tiles (128 query rows and 128 keys serve both; 256 keys in the
head-dim-64 forward over more than 1024 keys, `calls.hopper_tiles`), so a tensor whose length is not
a whole number of tiles is copied once into a zero-padded buffer (the copy a non-contiguous layout
takes anyway), the kernels get the true key count and mask the padded keys, padded query rows get LSE
+inf and delta 0 in the backward (so they add nothing), and the results are views of the true rows.
Whole tiles keep the zero-copy views. With `calls.HOPPER_TMA_EDGES` (on), lengths in whole 8-row TMA
tiles go in place on a GPU instead (`kernel_lengths`): the kernels' last tiles run past them.

dQ accumulates by float32 reduce-adds whose order varies: gradients are not bit-reproducible run to
run; `torch.use_deterministic_algorithms(True)` keeps such calls on the Triton kernels.

Shape legend: B batch, Hq / Hk query / KV heads, L query length, S key length, D head dim.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..bridge import triton_program
from ..bridge.compile_hints import assume_constant_result
from ..bridge.devices import multiprocessors
from ..bridge.mosaic_launch import MosaicKernel, mosaic_reasons
from ..bridge.mosaic_op import MosaicOp
from ..bridge.triton_launch import KernelLaunch
from ..jax_core import AttentionInputs, calls
from ..jax_core.kernels import flash_plan
from ..jax_core.kernels.flash_mgpu_checks import BACKWARD_HEAD_DIMS, FORWARD_HEAD_DIMS
from ..jax_core.kernels.flash_plan import FlashConfig, Operand

from . import hopper_program

try:
    from ..jax_core.kernels.hopper_bwd_passes_triton import (hopper_backward_operands_kernel,
                                                             hopper_backward_results_kernel)
except ImportError:  # no triton: the passes around the backward by torch ops
    hopper_backward_operands_kernel = hopper_backward_results_kernel = None

#: Shortest query and key lengths (the smaller of L and S) at which the Hopper kernels run, forward
#: only and with gradients. `benchmarks/hopper_torch_gpu.py` on an H100 (BENCHMARKS.md "Hopper
#: kernels"), bf16 causal, head dim 128, Hopper against Triton through the drop-in: forward 537 vs
#: 682 us at (4, 16, 4096), 421 vs 366 us at (8, 16, 2048); forward + backward 1253 vs 1416 us at
#: (2, 16, 4096), 1267 vs 820 us at (4, 16, 2048), where the Hopper path's host time (about 1.3 ms
#: per forward + backward against the Triton path's 0.5 ms) exceeds the kernels' time. With the
#: backward's steps in two Triton passes (H200, BENCHMARKS.md "The backward's steps in two passes"):
#: 1033 vs 825 us at (4, 16, 2048), still host-bound, so the threshold stays.
HOPPER_MIN_LENGTH = dict(forward=4096, train=4096)
#: The same for calls a compiled program runs (`hopper_program`: lengths and inputs read in place,
#: programs on, eager), per head dim, given at least HOPPER_MIN_PAIRS_PROGRAM query-key pairs (B*Hq*L*S):
#: their host time is about the Triton path's, so the kernels' GPU time decides. H200, drop-in
#: forward + backward, Hopper / Triton / torch cuDNN, us (BENCHMARKS.md "Compiled programs for the
#: Hopper path"): 546 / 576 / 503 at (16, 16, 1024, 64), 475 / 493 / 412 at (8, 16, 1024, 128), 674 /
#: 785 / 632 at (4, 16, 2048, 128); forward alone 150 / 126 at (16, 16, 1024, 64) and 223 / 208 at
#: (8, 16, 2048, 64), 103 / 125 at (8, 16, 1024, 128). With the forward's persistent grid (BENCHMARKS.md
#: "A persistent grid for the Hopper forward"), head dim 64 forward: 195-201 / 218 us at (8, 16, 2048,
#: 64), 128-133 / 132 at (16, 16, 1024, 64) (even: 2048 it was). With 128-key blocks over short walks
#: (`calls.HOPPER_FORWARD_SHORT`; BENCHMARKS.md "Where the head-dim-128 backward waits"): 113 / 132 us
#: at (16, 16, 1024, 64), and 122 / 124 in the run before, so 1024 at both head dims.
#: The head-dim-256 forward (BENCHMARKS.md "Head dim 256: the Hopper forward"): 185.5 / 228.7 us at (16, 8,
#: 1024, 256). Its backward (BENCHMARKS.md "A Hopper backward at head dim 256"), forward + backward
#: Hopper / Triton: 1354 / 1096 us at (16, 8, 1024, 256), 2685 / 3326 at (4, 8, 4096, 256), so 4096.
HOPPER_MIN_LENGTH_PROGRAM = dict(forward={64: 1024, 128: 1024, 256: 1024}, train={64: 1024, 128: 1024, 256: 4096})
#: Smaller calls are host-bound on either path, and the Triton path's host time is the shorter.
HOPPER_MIN_PAIRS_PROGRAM = 8 * 16 * 1024 * 1024
#: Multiprocessors the interpreted kernels (CPU tensors, tests) take: a few, so that programs walk
#: several tiles there too.
HOPPER_INTERPRETED_SMS = 3
_FORWARD = MosaicKernel(calls.flash_hopper)
_BACKWARD = MosaicKernel(calls.flash_hopper_backward)
_LOG2E = 1.4426950408889634
#: Head dims of the kernels, forward only and with gradients.
HOPPER_HEAD_DIMS = dict(forward=FORWARD_HEAD_DIMS, train=BACKWARD_HEAD_DIMS)
#: jax_core features (`AttentionInputs.features`) the kernels take.
_FEATURES = frozenset({"causal", "causal_bottom_right", "gqa", "sliding_window", "softcap", "sinks"})


def shortest_hopper_length() -> int:
    """The shortest length at which any call may take the Hopper kernels (a cheap first test)."""
    return min(*HOPPER_MIN_LENGTH.values(), *(n for by_dim in HOPPER_MIN_LENGTH_PROGRAM.values()
                                              for n in by_dim.values()))


def _min_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool) -> int:
    """The length threshold of this call: the compiled programs' where one runs it, else the Python path's."""
    kind = "train" if grad else "forward"
    (b, hq, l, d), s = q.shape, k.shape[2]
    shortest = HOPPER_MIN_LENGTH_PROGRAM[kind].get(d, HOPPER_MIN_LENGTH[kind])
    if (shortest <= min(l, s) < HOPPER_MIN_LENGTH[kind] and b * hq * l * s >= HOPPER_MIN_PAIRS_PROGRAM
            and q.is_cuda and not torch.compiler.is_compiling() and hopper_program.may_run(q, k, v, cfg, grad)):
        return shortest
    return HOPPER_MIN_LENGTH[kind]


def _reasons(dtype_name: str, d: int, dv: int, hq: int, hk: int, l: int, s: int, grad: bool,
             min_length: Optional[int] = None) -> list[str]:
    """What keeps a call of these sizes off the Hopper kernels, features aside (`hopper_reasons`,
    `hopper_launch_reasons`); `min_length`: the call's length threshold (default: the Python path's)."""
    reasons = []
    kind = "train" if grad else "forward"
    min_length = HOPPER_MIN_LENGTH[kind] if min_length is None else min_length
    if dtype_name not in ("bfloat16", "float16"):
        reasons.append(f"dtype {dtype_name}: the Hopper kernels take bfloat16 or float16")
    if d != dv or d not in HOPPER_HEAD_DIMS[kind]:
        reasons.append(f"head dims {d}/{dv}: the Hopper kernels run head dims {HOPPER_HEAD_DIMS[kind]}"
                       f"{' with gradients' if grad else ''}")
    if hq % hk:
        reasons.append(f"num_q_heads={hq} is not a multiple of num_kv_heads={hk}")
    if min(l, s) < min_length:
        reasons.append(f"lengths L={l}, S={s} below {min_length}{' with gradients' if grad else ''}: "
                       "the Triton kernels measured faster")
    if torch.are_deterministic_algorithms_enabled():
        reasons.append("deterministic algorithms are on, and the Hopper backward adds dQ in varying order")
    return reasons


def hopper_reasons(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool) -> list[str]:
    """Why the Hopper kernels do not run this native flash call (empty when they do); `grad`: whether
    it needs gradients.

    q (B, Hq, L, D), k (B, Hk, S, D), v (B, Hk, S, Dv) as the native launcher takes them (no bias,
    mask, sinks or packing: the caller checks those)."""
    (_, hq, l, d), (hk, s), dv = q.shape, k.shape[1:3], v.shape[-1]
    same = k.dtype == q.dtype and v.dtype == q.dtype
    reasons = _reasons(str(q.dtype).removeprefix("torch.") if same else "mixed", d, dv, hq, hk, l, s, grad,
                       _min_length(q, k, v, cfg, grad))
    if cfg.dropout_p or cfg.varlen is not None:
        reasons.append("dropout or varlen: the Hopper kernels have neither")
    if reasons:
        return reasons
    if torch.compiler.is_compiling():
        device = _device_reasons(q.device)
        return [device] if device else []
    return mosaic_reasons(q.device)


@assume_constant_result
def _device_reasons(device: torch.device) -> str:
    """`mosaic_reasons(device)` as one string ("" when there are none), for a call torch.compile traces:
    run for real while it traces (Dynamo cannot trace the CUDA queries), and fixed for the graph, which
    is guarded on its tensors' devices. Capture is not one of them then: the graph's ops are tagged
    so that CUDA graphs leave them out (`bridge.mosaic_op`)."""
    return "; ".join(mosaic_reasons(device))


def hopper_launch_reasons(inputs: AttentionInputs, device: torch.device, *, grad: bool) -> list[str]:
    """Why the Hopper kernels would not run a call described by `inputs` (empty when they would; `grad`:
    whether it needs gradients): what `hopper_reasons` asks of the tensors, from the call's
    description, for automatic launch to ask before it chooses a launcher."""
    if device.type != "cuda":
        return [f"Mosaic GPU kernels run on CUDA devices (device {device})"]
    reasons = _reasons(inputs.dtype, inputs.head_dim, inputs.value_head_dim, inputs.num_q_heads,
                       inputs.num_kv_heads, inputs.q_len, inputs.kv_len, grad=grad)
    if inputs.features - _FEATURES:
        reasons.append(f"features {sorted(inputs.features - _FEATURES)}: the Hopper kernels have none of them")
    return reasons or mosaic_reasons(device)


def _kernel_views(tensors: tuple[torch.Tensor, ...], lengths: tuple[int, ...]) -> tuple[list[torch.Tensor], bool]:
    """(B, H, T, D) tensors as the kernels' (batch, T', heads, D) arrays of T' = `lengths` rows (whole
    tiles), and whether they were folded: (B, H, T, D) memory itself passes as (B*H, T', 1, D)
    (attention per (batch, head) pair; with GQA the kernels read KV pair b*Hk + h // (Hq/Hk) =
    (b*Hq + h) // (Hq/Hk) for query pair b*Hq + h, `flash_mgpu_checks.batch_group`); (B, T, H, D)
    memory seen transposed passes as is; anything else is copied to (B, T', H, D). No copy where
    T = T' and the memory fits; otherwise one copy, into a buffer whose rows T.. are zeros."""
    if all(t.is_contiguous() for t in tensors):
        return [_padded(t, n, 2).reshape(t.shape[0] * t.shape[1], n, 1, t.shape[3])
                for t, n in zip(tensors, lengths)], True
    return [_padded(t.transpose(1, 2), n, 1).contiguous() for t, n in zip(tensors, lengths)], False


def _padded(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """t with zero rows appended along `dim` up to n: t itself when it has n, else one copy."""
    if t.shape[dim] == n:
        return t
    shape = list(t.shape)
    shape[dim] = n
    out = t.new_empty(shape)  # contiguous
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    out.narrow(dim, t.shape[dim], n - t.shape[dim]).zero_()
    return out


def _torch_view(x: torch.Tensor, like: torch.Tensor, folded: bool) -> torch.Tensor:
    """A kernel result of (batch, T', heads, D) back in `like`'s (B, H, T, D) shape (its first T rows)."""
    b, h, t, d = like.shape
    if folded:
        return x.view(b, h, x.shape[1], d)[:, :, :t]
    return x[:, :t].transpose(1, 2)


def kernel_lengths(l: int, s: int, d: int, backward: bool, device: torch.device) -> tuple[int, int, bool]:
    """(rows, keys, tma_edges): the lengths the kernels get for L queries and S keys on `device`, and
    whether they are not whole tiles but read in place (`calls.HOPPER_TMA_EDGES`, on a GPU only: the
    interpreted kernels pad)."""
    whole = calls.hopper_padded_lengths(l, s, d, backward=backward)
    if not (calls.HOPPER_TMA_EDGES and device.type == "cuda"):
        return (*whole, False)
    rows, keys = calls.hopper_padded_lengths(l, s, d, backward=backward, tma_edges=True)
    return rows, keys, (rows, keys) != whole


def row_vector_length(l: int, s: int, d: int, backward: bool) -> int:
    """The rows of the kernels' per-row vectors (the forward's LSE, the backward's LSE and delta) for L
    queries and S keys: whole tiles, in place or not (the kernels' 1-D copies of them have no edge)."""
    return calls.hopper_padded_lengths(l, s, d, backward=backward)[0]


def _static(cfg: FlashConfig, kv_len: int) -> dict:
    window = None if tuple(cfg.window) == (-1, -1) else tuple(int(w) for w in cfg.window)
    return dict(scale=float(cfg.scale), causal=bool(cfg.causal), diag_offset=int(cfg.diag_offset), window=window,
                softcap=None if cfg.softcap is None else float(cfg.softcap), kv_len=int(kv_len))


def forward_programs(device: torch.device) -> Optional[int]:
    """The forward's persistent grid on `device` (`calls.hopper_forward_programs`)."""
    return calls.hopper_forward_programs(multiprocessors(device, HOPPER_INTERPRETED_SMS))


def _forward_static(cfg: FlashConfig, kv_len: int, device: torch.device, tma_edges: bool) -> dict:
    return dict(_static(cfg, kv_len), programs=forward_programs(device), tma_edges=tma_edges)


def backward_programs(device: torch.device) -> Optional[int]:
    """The backward's persistent grid on `device` (`calls.hopper_backward_programs`)."""
    return calls.hopper_backward_programs(multiprocessors(device, HOPPER_INTERPRETED_SMS))


def _backward_static(cfg: FlashConfig, kv_len: int, kq: torch.Tensor, kk: torch.Tensor, device: torch.device,
                     tma_edges: bool) -> dict:
    """The backward kernel's settings for the kernel views kq (queries) and kk (keys, padded or in place
    with `tma_edges`): the persistent grid on `device`, the head splits it wants
    (`calls.hopper_head_splits`) and its clusters (`calls.hopper_backward_cluster`)."""
    programs = backward_programs(device)
    batch, rows, heads, d = kq.shape
    splits = calls.hopper_head_splits(batch, heads, kk.shape[2], kk.shape[1], d, persistent=programs is not None,
                                      kv_batch=kk.shape[0])
    cluster = calls.hopper_backward_cluster(batch, heads, kk.shape[0], kk.shape[2], rows, kk.shape[1], d, splits,
                                            programs)
    return dict(_static(cfg, kv_len), head_splits=splits, programs=programs, cluster=cluster, tma_edges=tma_edges)


def hopper_forward(q, k, v, cfg: FlashConfig, sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, L, D), lse (B, Hq, L) float32), no gradient; `sinks`: None or (Hq,) float logits,
    one per query head, in each row's softmax normaliser (and so in the LSE)."""
    l, s = q.shape[2], k.shape[2]
    rows, keys, edges = kernel_lengths(l, s, q.shape[-1], False, q.device)
    (kq, kk, kv), folded = _kernel_views((q, k, v), (rows, keys, keys))
    if sinks is not None:  # folded: the kernels' batch is (B, H) pairs, one sink each
        sinks = sinks.detach().float()
        sinks = (sinks.repeat(q.shape[0]).view(-1, 1) if folded else sinks.contiguous(),)
    out, lse = _FORWARD(kq, kk, kv, *(sinks or ()), **_forward_static(cfg, s, q.device, edges))
    return _torch_view(out, q, folded), lse.view(*q.shape[:2], lse.shape[-1])[..., :l]


def hopper_backward(q, k, v, out, lse, dout, cfg: FlashConfig, sinks: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(dq, dk, dv) in (B, H, T, D) shapes of the inputs' dtype, and d sinks ((Hq,) of the sinks' dtype;
    None without sinks), from the forward's out and lse."""
    l, s = q.shape[2], k.shape[2]
    rows, keys, edges = kernel_lengths(l, s, q.shape[-1], True, q.device)
    if rows == l and (dout.stride() != out.stride() or dout.dtype != q.dtype):
        # The kernel reads dO in out's layout: one copy of dO (as torch's own flash backward takes)
        # keeps q, k and v in place, where dO in another layout would send all four to copies.
        dout = torch.empty_strided(out.shape, out.stride(), dtype=q.dtype, device=out.device).copy_(dout)
    (kq, kk, kv, kdo), folded = _kernel_views((q, k, v, dout), (rows, keys, keys, rows))
    batch, _, heads = kq.shape[:3]  # the kernels' (batch, heads, T') order of the row vectors
    # The row vectors have whole tiles' rows even where the kernels read the queries in place: a
    # 1-D copy past the end of one (batch, head) row would run on into the next one's.
    whole = row_vector_length(l, s, q.shape[-1], backward=True)
    lse_log2, delta = torch.empty((2, batch, heads, whole), dtype=torch.float32, device=q.device).unbind(0)
    accum = torch.empty(kq.shape, dtype=torch.float32, device=q.device)
    backward_operands(out, dout, lse, delta, lse_log2, accum, folded)
    static = _backward_static(cfg, s, kq, kk, q.device, edges)
    splits = static["head_splits"]
    dq, dk, dv = _BACKWARD(kq, kk, kv, kdo, lse_log2, delta, accum, **static)
    if splits > 1:  # dK, dV as the splits' float32 partial sums
        dq, dk, dv = backward_results(dq, dk, dv, q.dtype)
    else:
        dq = backward_results(dq, None, None, q.dtype)[0]
    dsinks = None
    if sinks is not None:  # the sink's logit reaches the output only through the normaliser
        weight = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.detach().float()[None, :, None] - lse))
        dsinks = (-(weight * delta.view(*q.shape[:2], whole)[..., :l]).sum(dim=(0, 2))).to(sinks.dtype)
    return _torch_view(dq, q, folded), _torch_view(dk, k, folded), _torch_view(dv, v, folded), dsinks


def backward_operands(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                      lse_log2: torch.Tensor, accum: torch.Tensor, folded: bool) -> None:
    """Writes the Hopper backward's row operands and zeroes its dQ accumulator, in one Triton launch
    (`hopper_bwd_passes_triton`; torch ops where Triton is missing).

    Args:
        out, dout: (B, Hq, L, D) forward output and its gradient, any strides.
        lse: (B, Hq, L) float32 natural-log LSE of the forward (-inf: the row saw no key).
        delta, lse_log2: (batch, heads, rows) float32 contiguous, written: rowsum(dO * O) and the LSE in
            log2 units (+inf for -inf); rows L.. (the kernels' padding) get 0 and +inf.
        accum: the float32 dQ accumulator in the kernels' query layout, zeroed: (B*Hq, rows, 1, D)
            when `folded`, else (B, rows, Hq, D).
    """
    b, hq, l, _ = out.shape
    rows = delta.shape[-1]
    if hopper_backward_operands_kernel is None:
        delta3, lse3 = delta.view(b, hq, rows), lse_log2.view(b, hq, rows)
        delta3[..., :l] = (out.float() * dout.float()).sum(-1)
        delta3[..., l:] = 0.0
        lse3[..., :l] = torch.where(lse == -math.inf, math.inf, lse * _LOG2E)
        lse3[..., l:] = math.inf
        accum.zero_()
        return
    operands_launch(out, dout, lse, accum, rows, folded)(out, dout, lse, delta, lse_log2, accum)


def operands_launch(out: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor, accum: torch.Tensor, rows: int,
                    folded: bool) -> KernelLaunch:
    """The operands pass's launch for these tensors' shapes and strides (`backward_operands`), kept
    per signature."""
    st = accum.stride()
    accum_strides = (out.shape[1] * st[0], st[0], st[1]) if folded else (st[0], st[2], st[1])
    key = (out.shape, out.stride(), dout.stride(), lse.stride(), accum_strides, rows, accum.shape[1], out.dtype,
           dout.dtype, out.device)

    def make():
        planned = flash_plan.hopper_backward_operands_launch(
            Operand.of(out.shape, out.stride()), tuple(dout.stride()), tuple(lse.stride()), accum_strides, rows,
            accum_rows=accum.shape[1])
        return KernelLaunch(hopper_backward_operands_kernel, planned.grid, planned.num_warps, planned.num_stages,
                            ("Out", "dOut", "Lse", "Delta", "LseLog2", "dQAccum"), planned.args)
    return _kept(_OPERAND_LAUNCHES, key, make)


_OPERAND_LAUNCHES: dict = {}


def backward_results(dq: torch.Tensor, dk_parts: Optional[torch.Tensor], dv_parts: Optional[torch.Tensor],
                     dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(dq, dk, dv) in `dtype` from the backward's float32 results, in one Triton launch
    (`hopper_bwd_passes_triton`; torch ops where Triton is missing): dq (batch, rows, heads, D) cast,
    dk and dv (splits, batch, keys, heads, D) partial sums summed over the splits (None: the kernel
    wrote dK and dV itself, and they come back None)."""
    if hopper_backward_results_kernel is None:
        if dk_parts is None:
            return dq.to(dtype), None, None
        return dq.to(dtype), dk_parts.sum(0).to(dtype), dv_parts.sum(0).to(dtype)
    # Three allocations, not views of one: the gradients must not share a storage.
    dq16 = torch.empty(dq.shape, dtype=dtype, device=dq.device)
    launch = results_launch(dq.numel(), None if dk_parts is None else dk_parts.shape, dtype, dq.device)
    if dk_parts is None:  # dQ alone: the dK and dV arguments are not read
        launch(dq, dq16, dq, dq16, dq, dq16)
        return dq16, None, None
    dk, dv = (torch.empty(dk_parts.shape[1:], dtype=dtype, device=dq.device) for _ in range(2))
    launch(dq, dq16, dk_parts, dk, dv_parts, dv)
    return dq16, dk, dv


def results_launch(nq: int, parts_shape: Optional[torch.Size], dtype: torch.dtype,
                   device: torch.device) -> KernelLaunch:
    """The results pass's launch (`backward_results`) for dQ of `nq` elements and dK, dV partials of
    `parts_shape` (None: none), kept per signature."""
    splits, nkv = (1, 0) if parts_shape is None else (parts_shape[0], math.prod(parts_shape[1:]))
    key = (nq, nkv, splits, dtype, device)

    def make():
        planned = flash_plan.hopper_backward_results_launch(nq, nkv, splits)
        return KernelLaunch(hopper_backward_results_kernel, planned.grid, planned.num_warps, planned.num_stages,
                            ("dQAccum", "dQ", "dKParts", "dK", "dVParts", "dV"), planned.args)
    return _kept(_RESULT_LAUNCHES, key, make)


def _kept(launches: dict, key: tuple, make) -> KernelLaunch:
    """`launches[key]`, made by `make()` the first time. One per training shape: a program cycling
    through more than 256 starts over rather than growing without bound."""
    launch = launches.get(key)
    if launch is None:
        if len(launches) >= 256:
            launches.clear()
        launch = launches[key] = make()
    return launch


_RESULT_LAUNCHES: dict = {}


class _HopperFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg: FlashConfig, signature: Optional[tuple], q, k, v, sinks):
        out, lse = hopper_forward(q, k, v, cfg, sinks)
        ctx.cfg, ctx.signature = cfg, signature
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        if torch.is_grad_enabled():
            raise NotImplementedError(_OP.second_order_message())
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grads = hopper_backward(q, k, v, out, lse, dout, ctx.cfg, sinks)
        if ctx.signature is not None and hopper_program.unsettled(ctx.signature):
            hopper_program.record_train(ctx.signature, q, k, v, out, lse, ctx.cfg)
        return (None, None, *grads)


_OP = MosaicOp("jaxattn::hopper_flash", lambda cfg, q, k, v: hopper_forward(q, k, v, cfg),
               lambda cfg, inputs, outputs, grads: hopper_backward(*inputs, *outputs, grads[0], cfg)[:3],
               num_outputs=1, spec_types=(FlashConfig,),
               second_order_hint="sdpa_launcher('xla') runs a differentiable path.")


def hopper_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool,
                 sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention out (B, Hq, L, D) by the Hopper kernels; with `grad`, differentiable in q, k, v (and
    `sinks`, None or (Hq,) float logits, one per query head: eager calls only).

    Eager calls take the shortest host path: a call signature's compiled program once it has one
    (`hopper_program`; calls without sinks), else an autograd.Function or the forward alone, which
    register it. Under torch.compile the call is the `jaxattn::hopper_flash` custom op
    (`bridge.mosaic_op`), one opaque graph node with its backward op."""
    if torch.compiler.is_compiling():
        if sinks is not None:
            raise NotImplementedError("hopper_flash: sinks under torch.compile; the native Triton kernels take them.")
        return _OP(cfg, q, k, v)[0]
    if sinks is not None:
        if grad:
            return _HopperFunction.apply(cfg, None, q, k, v, sinks)
        return hopper_forward(q, k, v, cfg, sinks)[0]
    signature = hopper_program.signature(q, k, v, cfg, grad)
    found = hopper_program.program(signature, q, k, v)
    if found is not None:
        if grad:
            return triton_program.apply(found, [q, k, v])[0]
        return triton_program.forward_only(found, [q, k, v])[0]
    record = hopper_program.unsettled(signature)
    if grad:
        return _HopperFunction.apply(cfg, signature if record else None, q, k, v, None)
    out = hopper_forward(q, k, v, cfg)[0]
    if record:
        hopper_program.record_forward(signature, q, k, v, cfg)
    return out
