"""The Hopper kernels' eager call as a compiled program (`bridge.triton_program`): no Python per call.

An eager `hopper_flash` call spends most of its host time in Python: the autograd.Function and its
node, the views, the allocations, two Mosaic GPU launches and two Triton passes. Once a call
signature (shapes, strides, dtype, device, settings) has run, all of that is fixed but the tensors'
pointers, so its launches are registered as a program whose forward, autograd node and backward
run in C++: the Mosaic kernels through their compiled host programs (`MosaicKernel.host_launch`),
the passes through `cuLaunchKernel`. The same compiled kernels run with the same arguments, so the
results are the Python path's, bit for bit.

A signature gets a program where no copy is taken: lengths the kernels read in place (whole tiles,
or multiples of 8 with `calls.HOPPER_TMA_EDGES`) and inputs in a layout they read in place
(contiguous (B, H, T, D) memory, GQA included, or (B, T, H, D) memory seen transposed). The
forward-only program is registered after the signature's first call without gradients; the
training program after its first backward. The gradient of the output is read in
the output's own layout (another layout is copied into it, as the Python path does).

Buffers of the programs (see `triton_program.cpp`). Forward: 0 q, 1 k, 2 v, then the forward
kernel's outputs (out, lse). Backward: 0 q, 1 k, 2 v, 3 out, 4 lse, 5 dO, 6 delta, 7 the LSE in log2
units, 8 dQ's float32 accumulator, then the backward kernel's new outputs (dK, dV, or their
per-split float32 partials), then dQ (and with head splits dK, dV) in the inputs' dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..bridge import triton_program
from ..bridge.mosaic_launch import HostLaunch
from ..jax_core import calls
from ..jax_core.kernels.flash_plan import FlashConfig
from . import hopper_flash as _hopper

#: Settled signatures: key -> program id, or -1 where the signature cannot run as a program.
_PROGRAMS: dict = {}
#: A cap, not a cache size: a workload cycling through more signatures keeps the Python path for new ones.
MAX_SIGNATURES = 1024


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool) -> tuple:
    """The call signature a program is settled for; `calls.HOPPER_TMA_EDGES` is part of it (it decides
    whether lengths that are not whole tiles are read in place, which a program needs)."""
    return (grad, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, cfg,
            calls.HOPPER_TMA_EDGES)


def program(key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[int]:
    """The registered program of signature `key`, where these tensors may run it (16-byte aligned:
    the kernels were compiled for aligned pointers)."""
    found = _PROGRAMS.get(key)
    if found is None or found < 0 or (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        return None
    return found


def unsettled(key: tuple) -> bool:
    return key not in _PROGRAMS and len(_PROGRAMS) < MAX_SIGNATURES


def may_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool) -> bool:
    """Whether a program runs, or will run once registered, this call: programs on and their extension
    not failed to build, inputs the kernels read in place, and the signature not settled without one
    (a JAX whose Mosaic kernels have no host program to call, a launch the extension cannot take).
    A settled signature answers from its entry, so a call that has its program pays one lookup."""
    settled = _PROGRAMS.get(signature(q, k, v, cfg, grad))
    if settled is not None:
        return settled >= 0
    return triton_program.enabled() and triton_program.build_error() is None and in_place(q, k, v, backward=grad)


def in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> bool:
    """Whether the kernels read these inputs in place (no padding, no copy)."""
    l, s, d = q.shape[2], k.shape[2], q.shape[-1]
    if _hopper.kernel_lengths(l, s, d, False, q.device)[:2] != (l, s):
        return False
    if backward and _hopper.kernel_lengths(l, s, d, True, q.device)[:2] != (l, s):
        return False
    tensors = (q, k, v)
    if all(t.is_contiguous() for t in tensors):  # (batch, head) pairs folded, with or without GQA
        return True
    return all(t.transpose(1, 2).is_contiguous() for t in tensors)


def _settle(key: tuple, q: torch.Tensor, register) -> None:
    """Records `key`'s program: -1 off CUDA or with programs off, else the registered id (or -1)
    once the extension is built; nothing while it is still building (a later call retries)."""
    if not q.is_cuda or not triton_program.enabled():
        _PROGRAMS[key] = -1
    elif triton_program.ready():
        found = register()
        _PROGRAMS[key] = -1 if found is None else found


def _meta(*tensors: torch.Tensor) -> tuple:
    """Shape-only stand-ins: what a host launch is planned from (its outputs allocate no memory)."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors)


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _kernel_output(kernel_shape: tuple, dtype: torch.dtype, like: Optional[torch.Tensor], folded: bool) -> tuple:
    """The allocation of a kernel output of `kernel_shape` (contiguous memory), as a (B, H, T, D)
    view like `like`'s where the program returns it (None: kept in the kernel's shape)."""
    meta = torch.empty(kernel_shape, dtype=dtype, device="meta")
    return _layout(meta if like is None else _hopper._torch_view(meta, like, folded))


def _launch_buffers(plan: HostLaunch, args: list, first_new: int, views: dict) -> tuple[list, list, list]:
    """(allocations, pointer buffers, buffer of each returned result) of a Mosaic launch whose arguments
    are `args` (buffer indices), new outputs allocated from buffer `first_new` on; `views[i]` the
    allocation of the i-th returned result where it is not kept in the kernel's shape."""
    allocs, outs = [], []
    for index, (alias, shape, dtype) in enumerate(plan.outputs):
        if alias is not None:
            outs.append(args[alias])
            continue
        returned = plan.returned.index(index) if index in plan.returned else None
        allocs.append(views.get(returned) or _layout(torch.empty(shape, dtype=dtype, device="meta")))
        outs.append(first_new + len(allocs) - 1)
    return allocs, args + outs, [outs[i] for i in plan.returned]


def record_forward(key: tuple, q, k, v, cfg: FlashConfig) -> None:
    if not in_place(q, k, v, backward=False):
        _PROGRAMS[key] = -1
        return
    _settle(key, q, lambda: _register(q, k, v, cfg, None))


def record_train(key: tuple, q, k, v, out, lse, cfg: FlashConfig) -> None:
    if not in_place(q, k, v, backward=True):
        _PROGRAMS[key] = -1
        return
    _settle(key, q, lambda: _register(q, k, v, cfg, (out, lse)))


def _register(q, k, v, cfg: FlashConfig, saved: Optional[tuple]) -> Optional[int]:
    """Registers the signature's program (forward only, or with the backward where `saved` holds the
    Python path's out and lse of a call just run); None where a launch cannot run compiled."""
    l, s = q.shape[2], k.shape[2]
    (kq, kk, kv), folded = _hopper._kernel_views((q, k, v), (l, s, s))
    edges = _hopper.kernel_lengths(l, s, q.shape[-1], False, q.device)[2]  # read in place either way
    static = _hopper._forward_static(cfg, s, q.device, edges)
    forward = _hopper._FORWARD.host_launch(_meta(kq, kk, kv), static)
    if forward is None:
        return None
    out_view = _kernel_output(forward.outputs[forward.returned[0]][1], q.dtype, q, folded)
    forward_allocs, forward_args, (out, lse) = _launch_buffers(forward, [0, 1, 2], 3, {0: out_view})
    common = dict(num_inputs=3, forward_allocs=forward_allocs,
                  forward_launches=[(forward.program, forward_args)], outputs=[out],
                  second_order_error=_hopper._OP.second_order_message())
    if saved is None:
        return triton_program.register(**common, saved=[], grad_layouts=[], backward_allocs=[],
                                       backward_launches=[], grads=[-1, -1, -1])
    return _register_train(q, k, v, cfg, saved, (kq, kk, kv), folded, common, [0, 1, 2, out, lse])


def _register_train(q, k, v, cfg, saved, kernel_inputs, folded, common, saved_buffers) -> Optional[int]:
    """`_register` with the backward: the operands pass, the backward kernel, the results pass (buffers
    in the module docstring), planned as the Python path's call just ran them."""
    out_t, lse_t = saved
    kq, kk, kv = kernel_inputs
    batch, _, heads = kq.shape[:3]
    rows = _hopper.row_vector_length(q.shape[2], k.shape[2], q.shape[-1], backward=True)
    f32 = torch.float32
    row_vector = _layout(torch.empty((batch, heads, rows), dtype=f32, device="meta"))
    accum = torch.empty(kq.shape, dtype=f32, device="meta")
    allocs = [row_vector, row_vector, _layout(accum)]  # 6 delta, 7 lse_log2, 8 dQ's accumulator
    # The operands pass reads dO in out's layout, which the program's gradient layout is.
    operands = _hopper.operands_launch(out_t, out_t, lse_t, accum, rows, folded)
    edges = _hopper.kernel_lengths(q.shape[2], k.shape[2], q.shape[-1], True, q.device)[2]
    static = _hopper._backward_static(cfg, k.shape[2], kq, kk, q.device, edges)
    splits = static["head_splits"]
    rows_meta = torch.empty((batch, heads, rows), dtype=f32, device="meta")
    backward = _hopper._BACKWARD.host_launch((*_meta(kq, kk, kv, kq), rows_meta, rows_meta.clone(), accum), static)
    if backward is None:
        return None
    # Without head splits the kernel writes dK and dV in the inputs' dtype: returned as (B, H, T, D) views.
    views = {} if splits > 1 else {i: _kernel_output(*backward.outputs[backward.returned[i]][1:], like, folded)
                                   for i, like in ((1, k), (2, v))}
    new, args, (dq_f32, dk_out, dv_out) = _launch_buffers(backward, [0, 1, 2, 5, 7, 6, 8], 9, views)
    allocs += new
    dq = 9 + len(new)
    allocs.append(_kernel_output(kq.shape, q.dtype, q, folded))
    parts = backward.outputs[backward.returned[1]][1] if splits > 1 else None
    results = _hopper.results_launch(accum.numel(), parts, q.dtype, q.device)
    if splits > 1:
        allocs += [_kernel_output(kk.shape, k.dtype, k, folded), _kernel_output(kv.shape, v.dtype, v, folded)]
        grads = [dq, dq + 1, dq + 2]
        result_buffers = dict(dQAccum=dq_f32, dQ=dq, dKParts=dk_out, dK=dq + 1, dVParts=dv_out, dV=dq + 2)
    else:
        grads = [dq, dk_out, dv_out]
        result_buffers = dict(dQAccum=dq_f32, dQ=dq, dKParts=dq_f32, dK=dq, dVParts=dq_f32, dV=dq)
    return triton_program.register(
        **common, saved=saved_buffers, grad_layouts=[(tuple(out_t.shape), tuple(out_t.stride()), q.dtype)],
        backward_allocs=allocs,
        backward_launches=[(operands, dict(Out=3, dOut=5, Lse=4, Delta=6, LseLog2=7, dQAccum=8)),
                           (backward.program, args), (results, result_buffers)],
        grads=grads)
