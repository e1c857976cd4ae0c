"""The flash kernels launched from torch: on torch's stream, on the tensors' own memory.

The same Triton kernels as the `flash` implementation's JAX path (`jax_core/kernels`), launched
with the same plans (`flash_plan`), but by Triton itself on torch tensors: no DLPack, no XLA
executable, no copy of transposed or sliced layouts (the kernels read through each tensor's four
strides). The entry kernels are the shape-dynamic ones, so a new length (a growing KV cache)
needs no new compilation.

Shape legend: B batch, Hq / Hk query / KV heads, L query length, S key length, D / Dv head dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch.autograd import forward_ad

from ..bridge import triton_program
from ..bridge.triton_autograd import PreparedTritonCall, TritonOp, cached_hash, recorded
from ..bridge.triton_launch import KernelLaunch, optional, traced
from ..jax_core.kernels import flash_plan as plan
from ..jax_core.kernels.flash_plan import FlashConfig, Operand
from .hopper_flash import HOPPER_HEAD_DIMS, hopper_flash, hopper_reasons, shortest_hopper_length

try:
    from ..jax_core.kernels import flash_entries_triton as entries_triton
    from ..jax_core.kernels.segment_table_triton import (segment_table_entry_dynamic, segment_table_entry_static,
                                                         segment_table_launch, segment_table_shapes)
    from ..jax_core.kernels.skip_table_triton import (skip_table_entry_dynamic, skip_table_entry_static,
                                                      skip_table_launch, skip_table_shape)
except ImportError:  # no triton: `launch.can_launch` is False and nothing below is launched
    entries_triton = None

_FWD_TENSORS = ("Q", "K", "V", "Bias", "Mask", "Sinks", "SegQ", "SegK", "CuQ", "CuK", "Seed", "Vis", "Alibi", "Out", "Lse")
_BWD_INPUTS = ("Q", "K", "V", "Bias", "Mask", "dOut", "Lse", "Delta", "SegQ", "SegK", "CuQ", "CuK", "Seed", "Vis", "Alibi")


_ENTRIES = {} if entries_triton is None else {
    flavour: dict(fwd=getattr(entries_triton, f"fwd_entry_{flavour}"), delta=getattr(entries_triton, f"delta_entry_{flavour}"),
                  dkdv=getattr(entries_triton, f"dkdv_entry_{flavour}"), dq=getattr(entries_triton, f"dq_entry_{flavour}"),
                  skip=skip_table_entry_dynamic if flavour == "dynamic" else skip_table_entry_static,
                  segments=segment_table_entry_dynamic if flavour == "dynamic" else segment_table_entry_static)
    for flavour in ("static", "dynamic")
}


@dataclasses.dataclass(frozen=True)
class NativeFlashSpec:
    """Everything static about a native flash call besides the tensors' shapes and strides."""

    cfg: FlashConfig
    # q, k, v, bias, mask, sinks, seed; 11 with q_ids, kv_ids, cu_q, cu_k (`PACKED_INPUTS`); 12 with ALiBi
    # slopes after those (`ALIBI_INPUTS`).
    num_inputs: int = 7

    def __hash__(self) -> int:
        return cached_hash(self, self.cfg, self.num_inputs)


def _symbolic(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a size of these tensors is symbolic (torch.compile with dynamic shapes)."""
    return any(isinstance(n, torch.SymInt) for t in tensors if t is not None for n in t.shape)


def _operand(t: torch.Tensor) -> Operand:
    """A (B, H, T, D)-ordered tensor's sizes and strides, stride 0 on size-1 dims. In a traced call
    concrete sizes become ints (the static entries are specialised to them); symbolic ones stay
    symbolic (the dynamic entries take them at run time)."""
    if traced() and not _symbolic(t):
        shape, stride = tuple(int(n) for n in t.shape), tuple(int(st) for st in t.stride())
    else:
        shape, stride = tuple(t.shape), t.stride()
    return Operand.of(shape, stride)


#: Inputs of a call with segment ids or varlen offsets: the 7 of every call, then q_ids, kv_ids, cu_q, cu_k.
PACKED_INPUTS = 11
#: Inputs of a call with ALiBi slopes: the 11 of a packed call (None where absent), then the slopes.
ALIBI_INPUTS = 12


def _call(q, k, v, bias, mask, sinks, packed=(None, None, None, None), alibi=None) -> plan.FlashCall:
    q_ids, _, cu_q, _ = packed
    return plan.FlashCall(
        q=_operand(q), k=_operand(k), v=_operand(v), bias=None if bias is None else _operand(bias),
        mask=None if mask is None else _operand(mask), dtype_bytes=q.element_size(), has_sinks=sinks is not None,
        has_segments=q_ids is not None, num_seqs=None if cu_q is None else int(cu_q.shape[0]) - 1,
        alibi_stride=None if alibi is None else _alibi_stride(alibi),
    )


def _alibi_stride(alibi: torch.Tensor) -> int:
    """Batch stride of (Hq,) or (B, Hq) slopes whose head dim is contiguous; 0 when they broadcast."""
    return 0 if alibi.dim() == 1 or alibi.shape[0] == 1 else int(alibi.stride(0))


def _key(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype)


# Launches per (spec, operand signature): planning a call costs more host time than launching it.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 4096
#: Forward launches whose keys enter only through `flash_plan.key_args`, by their signature without
#: the keys' length and strides.
_FOLLOWS_KEYS: dict = {}


#: Decoding-like calls (at most this many queries) use the shape-dynamic entries: a growing KV cache
#: then reuses one compilation. Longer calls use the static entries, whose constant sizes and strides
#: compile to faster code (one compilation per shape, as the JAX launcher does).
DYNAMIC_MAX_QUERIES = 16


def _entries(q: torch.Tensor, k: torch.Tensor) -> dict:
    """Symbolic sizes (one compiled graph for many lengths) take the dynamic entries too: the static
    ones need every size as a compile-time constant."""
    if traced() and _symbolic(q, k):  # only a traced call has symbolic sizes: eager calls skip the scan
        return _ENTRIES["dynamic"]
    return _ENTRIES["dynamic" if q.shape[2] <= DYNAMIC_MAX_QUERIES else "static"]


def _out_strides(q: torch.Tensor, dv: int) -> tuple[int, int, int, int]:
    """Strides of Out, a (B, Hq, L, Dv) view of (B, L, Hq, Dv) memory (`_out_buffer`), 0 on size-1 dims."""
    b, hq, l, _ = q.shape if _symbolic(q) else (int(n) for n in q.shape)
    full = (l * hq * dv, dv, hq * dv, 1)
    return tuple(0 if n == 1 else st for n, st in zip((b, hq, l, dv), full))


def _launches(spec: NativeFlashSpec, q, k, v, bias, mask, sinks, seed, do_strides=None, write_ds: bool = False,
              packed=(None, None, None, None), alibi=None) -> dict:
    """The forward's launches, or with `do_strides` (dOut's) the backward's; cached per signature.

    packed: (q_ids (B, L), kv_ids (B, S), cu_q (N + 1,), cu_k (N + 1,)), None where absent.
    alibi: None or float32 (Hq,) / (B, Hq) ALiBi slopes.
    """
    entries = _entries(q, k)
    if traced():  # symbolic sizes are not hashable, and a traced call plans once anyway
        return _plan_launches(spec, entries, q, k, v, bias, mask, sinks, seed, do_strides, write_ds, packed, alibi)
    key = (spec, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), v.shape, v.stride(), _key(bias),
           _key(mask), sinks is not None, seed is not None, do_strides, write_ds, entries["fwd"],
           *(_key(t) for t in packed), _key(alibi))
    found = _LAUNCHES.get(key)
    if found is not None:
        return found
    # A forward of the shape-dynamic entries that differs from a planned one only in the keys'
    # length and strides (a decoding step on a grown cache) is that launch with `key_args` replaced.
    sibling_key = None
    if (do_strides is None and entries is _ENTRIES["dynamic"] and bias is None and mask is None
            and packed == (None, None, None, None) and alibi is None):
        sibling_key = (spec, q.shape, q.stride(), q.dtype, q.device, k.shape[:2], k.shape[3:], v.shape[3:],
                       k.shape[2] == 1, sinks is not None, seed is not None)
        sibling = _FOLLOWS_KEYS.get(sibling_key)
        if sibling is not None:
            found = dict(skip=None, segments=None,
                         fwd=sibling["fwd"].rebind(**plan.key_args(_operand(k), _operand(v))))
    if len(_LAUNCHES) >= _MAX_LAUNCHES:
        _LAUNCHES.clear()
        _FOLLOWS_KEYS.clear()
    if found is None:
        found = _plan_launches(spec, entries, q, k, v, bias, mask, sinks, seed, do_strides, write_ds, packed, alibi)
        if sibling_key is not None and plan.forward_follows_keys(_call(q, k, v, bias, mask, sinks), spec.cfg):
            _FOLLOWS_KEYS[sibling_key] = found
    _LAUNCHES[key] = found
    return found


#: Dtypes of the placeholders passed for switched-off pointer arguments (never read by the kernels).
_PLACEHOLDER_DTYPES = dict(Bias=None, Mask=torch.int8, Sinks=torch.float32, SegQ=torch.int32, SegK=torch.int32,
                           CuQ=torch.int32, CuK=torch.int32, Seed=torch.int32, Vis=torch.int32, dS=torch.float32,
                           Alibi=torch.float32)


def _plan_launches(spec: NativeFlashSpec, entries: dict, q, k, v, bias, mask, sinks, seed, do_strides,
                   write_ds: bool, packed, alibi=None) -> dict:
    """Plans the forward's launches (`do_strides` None: skip tables, forward) or the backward's (skip
    tables, Delta, dK/dV, dQ): a call without gradients never plans a backward.

    Tensors a call does not have (features switched off) are fixed placeholders of each launch; the
    launches take the others in their kernel order (see `_given`).
    """
    call, cfg = _call(q, k, v, bias, mask, sinks, packed, alibi), spec.cfg
    out_strides = _out_strides(q, v.shape[3])
    b, hq, l, _ = call.q.dims
    dv = call.v.dims[3]
    # dOut has Out's sizes; its strides are the gradient's own (read in place).
    skip = _skip_plans(call, cfg, entries)  # the tables are contiguous, written by the skip-table kernel
    q_ids, kv_ids, cu_q, _ = packed
    absent = (set() if q_ids is not None else {"SegQ", "SegK"}) | (set() if cu_q is not None else {"CuQ", "CuK"})
    absent |= {name for name, t in (("Bias", bias), ("Mask", mask), ("Sinks", sinks), ("Seed", seed),
                                                 ("Alibi", alibi)) if t is None}
    absent |= set() if skip else {"Vis"}
    absent |= set() if write_ds else {"dS"}

    def launch(kernel, planned: plan.Launch, names) -> KernelLaunch:
        fixed = {n: optional(None, _PLACEHOLDER_DTYPES[n] or q.dtype, q.device) for n in names if n in absent}
        return KernelLaunch(kernel, planned.grid, planned.num_warps, planned.num_stages,
                            [n for n in names if n not in absent], planned.args, fixed)

    segments = None
    if q_ids is not None:  # the tables are written by the segment-table kernel (contiguous)
        grid, warps, args = segment_table_launch(b, l, call.k.dims[2], q_ids.stride(), kv_ids.stride())
        segments = KernelLaunch(entries["segments"], grid, warps, 1, ("QIds", "KIds", "SegQ", "SegK", "Scratch"),
                                args)
    if do_strides is None:
        return dict(skip=skip, segments=segments, fwd=launch(entries["fwd"], plan.forward_launch(call, cfg, out_strides,
                                                                             skip and skip["fwd"][1]), _FWD_TENSORS))
    do_strides = tuple(0 if n == 1 else st if isinstance(st, torch.SymInt) else int(st)
                       for n, st in zip((b, hq, l, dv), do_strides))
    # Gradients have the layouts of `torch.empty_like` of q, k, v (those of the inputs when dense).
    dq_strides, dk_strides, dv_strides = (_operand(torch.empty_like(t, device="meta")).strides for t in (q, k, v))
    return dict(
        skip=skip, segments=segments,
        delta=launch(entries["delta"], plan.delta_launch(Operand((b, hq, l, dv), out_strides), do_strides),
                     ("Out", "dOut", "Delta")),
        dkdv=launch(entries["dkdv"], plan.dkdv_launch(call, cfg, do_strides, dk_strides, dv_strides,
                                                      skip and skip["dkdv"][1]), _BWD_INPUTS + ("dK", "dV")),
        dq=launch(entries["dq"], plan.dq_launch(call, cfg, do_strides, dq_strides,
                                                plan.contiguous_strides((b, hq, l, call.k.dims[2]))
                                                if write_ds else None, skip and skip["dq"][1]),
                  _BWD_INPUTS + ("dQ", "dS")),
    )


def _given(*tensors: Optional[torch.Tensor]) -> list:
    """The tensors a launch takes: those present (the absent ones are its fixed placeholders)."""
    return [t for t in tensors if t is not None]


def _skip_plans(call: plan.FlashCall, cfg: FlashConfig, entries: dict) -> Optional[dict]:
    """Per kernel ("fwd", "dkdv", "dq"): (table shape, table strides, the skip-table kernel's launch),
    or None when no tiles are skipped (no bool mask or bias)."""
    if not plan.uses_skip_table(call, cfg):
        return None
    b, hq, l, _ = call.q.dims
    s = call.k.dims[2]
    given = [o for o in (call.mask, call.bias) if o is not None]
    tb = b if any(o.dims[0] != 1 for o in given) else 1
    th = hq if any(o.dims[1] != 1 for o in given) else 1
    fwd = plan.forward_tile(call, cfg)
    kv, dq = plan.backward_tiles(call, cfg)
    plans = {}
    for name, (block_m, block_n), along in (("fwd", fwd[:2], "k"), ("dkdv", kv[:2], "q"), ("dq", dq[:2], "k")):
        shape = skip_table_shape(tb, th, l, s, block_m, block_n, along)
        grid, warps, args = skip_table_launch(tb, th, l, s, block_m, block_n, along,
                                              call.mask.strides if call.mask is not None else None,
                                              call.bias.strides if call.bias is not None else None)
        launch = KernelLaunch(entries["skip"], grid, warps, 1, ("Mask", "Bias", "Table"), args)
        plans[name] = (shape, _table_strides(shape), launch)
    return plans


def _table_strides(shape: tuple) -> tuple:
    """Strides of a contiguous skip table, 0 on its broadcast (size-1) batch and head dims. Its rows
    keep their stride even when there is one: under torch.compile with symbolic lengths, a stride
    that depends on whether a length fits one block would compile a second graph for short ones."""
    tb, th, rows, cols = shape
    return (0 if tb == 1 else th * rows * cols, 0 if th == 1 else rows * cols, cols, 1)


def _skip_table(skip: Optional[dict], name: str, bias, mask, device) -> Optional[torch.Tensor]:
    """The int32 skip table of kernel `name`, or None when no tiles are skipped."""
    if skip is None:
        return None
    shape, _, launch = skip[name]
    # Flat: the kernels address it through the planned strides, and a 4-D tensor with a row dim
    # that is 1 for short lengths would make torch.compile guard on that (a second graph).
    table = torch.empty((math.prod(shape),), dtype=torch.int32, device=device)
    launch(optional(mask, torch.int8, device), optional(bias, torch.float32, device), table)
    return table


def _out_buffer(q: torch.Tensor, dv: int) -> torch.Tensor:
    """Out as a (B, Hq, L, Dv) view of (B, L, Hq, Dv) memory: the layout models transpose it back to."""
    b, hq, l, _ = q.shape
    return torch.empty_strided((b, hq, l, dv), (l * hq * dv, dv, hq * dv, 1), dtype=q.dtype, device=q.device)


def _forward(spec: NativeFlashSpec, q, k, v, bias, mask, sinks, seed, q_ids=None, kv_ids=None, cu_q=None, cu_k=None,
             alibi=None, launches: Optional[dict] = None):
    """(out, lse), then with segment ids the segment tables (residuals the backward reads)."""
    packed = (q_ids, kv_ids, cu_q, cu_k)
    if launches is None:
        launches = _launches(spec, q, k, v, bias, mask, sinks, seed, packed=packed, alibi=alibi)
    out = _out_buffer(q, v.shape[3])
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if cu_q is not None:  # rows after the last packed sequence belong to no program: 0, LSE -inf
        out.zero_()
        lse.fill_(float("-inf"))
    tables = _segment_tables(launches["segments"], q_ids, kv_ids, q.shape[2], k.shape[2])
    table = _skip_table(launches["skip"], "fwd", bias, mask, q.device)
    launches["fwd"](*_given(q, k, v, bias, mask, sinks, *tables, cu_q, cu_k, seed, table, alibi, out, lse))
    return (out, lse, *tables)


def _segment_tables(launch: Optional[KernelLaunch], q_ids, kv_ids, l: int, s: int) -> tuple:
    """(SegQ, SegK) int32 tables of the segment ids (`segment_table_triton`), () without them."""
    if launch is None:
        return ()
    seg_q, seg_k, scratch = (torch.empty(shape, dtype=torch.int32, device=q_ids.device)
                             for shape in segment_table_shapes(q_ids.shape[0], l, s))
    launch(q_ids, kv_ids, seg_q, seg_k, scratch)
    return seg_q, seg_k


def _grad_like(grad: Optional[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """dOut as the kernels read it: the gradient as it comes (any strides), zeros when Out was unused."""
    return torch.zeros_like(out) if grad is None else grad


def _backward(spec: NativeFlashSpec, inputs, outputs, grads, needs, launches: Optional[dict] = None):
    q, k, v, bias, mask, sinks, seed, *rest = inputs
    packed = tuple(rest[:4]) or (None, None, None, None)
    alibi = rest[4] if len(rest) > 4 else None
    out, lse, *tables = outputs
    cu_q, cu_k = packed[2:]
    dout = _grad_like(grads[0], out)
    write_ds = bool(needs[3])
    if launches is None:
        launches = _launches(spec, q, k, v, bias, mask, sinks, seed, dout.stride(), write_ds, packed, alibi)
    dev = q.device
    delta = torch.empty_like(lse)
    launches["delta"](out, dout, delta)
    if len(grads) > 1 and grads[1] is not None:  # d lse / d logit = P: folds into Delta
        delta = delta - grads[1]
    # With varlen, rows and keys after the last packed sequence belong to no program: their
    # gradients are 0.
    alloc = torch.zeros_like if cu_q is not None else torch.empty_like
    dq, dk, dv = alloc(q), alloc(k), alloc(v)
    b, hq, l, _ = q.shape
    ds = torch.empty((b, hq, l, k.shape[2]), dtype=torch.float32, device=dev) if write_ds else None
    skip = launches["skip"]
    launches["dkdv"](*_given(q, k, v, bias, mask, dout, lse, delta, *tables, cu_q, cu_k, seed,
                             _skip_table(skip, "dkdv", bias, mask, dev), alibi, dk, dv))
    launches["dq"](*_given(q, k, v, bias, mask, dout, lse, delta, *tables, cu_q, cu_k, seed,
                           _skip_table(skip, "dq", bias, mask, dev), alibi, dq, ds))
    grads_in = {0: dq, 1: dk, 2: dv}
    if write_ds:
        grads_in[3] = _reduce_to(ds, bias).to(bias.dtype)
    if needs[5]:
        p_sink = torch.where(torch.isneginf(lse), 0.0, torch.exp(sinks.float()[None, :, None] - lse))
        grads_in[5] = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
    return [grads_in[i] for i, need in enumerate(needs) if need]


def _reduce_to(grad: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Sums a (B, Hq, L, S) gradient over the dims `like` broadcasts (size 1)."""
    dims = tuple(i for i, n in enumerate(like.shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


FLASH_OP = TritonOp("jaxattn::native_flash", _forward, _backward, num_outputs=2,
                    spec_types=(NativeFlashSpec, FlashConfig),
                    second_order_hint="Run such calls on the XLA path, whose gradients are differentiable to any "
                                      "order: `with jaxattn.torch_api.sdpa_launcher('xla'): ...`.")


def narrow(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A broadcast (stride-0) dim of a bias or mask becomes size 1, so the kernels read it once and its
    gradient is summed over that dim, not written per element."""
    if t is None or 0 not in t.stride():
        return t
    return t[tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(t.shape, t.stride()))]


def _plain_launch() -> bool:
    """Whether a call may take the direct launches (the Hopper kernels, a signature's prepared Triton
    launches): no forward-mode AD or functorch transform, and, in eager, not inside a Triton op's
    traced body or a program's recording."""
    if forward_ad._current_level >= 0 or torch._C._are_functorch_transforms_active():
        return False
    return torch.compiler.is_compiling() or not (traced() or recorded())


def reverse_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether reverse-mode autograd will want gradients of a call on `tensors` (None: absent)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def takes_hopper(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, grad: bool) -> bool:
    """Whether the Hopper kernels run this call without bias, mask or packing (`hopper_reasons`).
    The cheap tests first: most calls (decoding, short prefills) stop at the lengths. Symbolic sizes
    (torch.compile with dynamic shapes) keep the Triton kernels: a Mosaic kernel is compiled per
    shape, and testing the lengths would guard the graph on them (one graph per length instead of
    one for all)."""
    shortest = shortest_hopper_length()
    return (q.shape[-1] in HOPPER_HEAD_DIMS["forward"] and not _symbolic(q, k)
            and q.shape[2] >= shortest and k.shape[2] >= shortest
            and not hopper_reasons(q, k, v, cfg, grad))


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: FlashConfig, *,
                  bias: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None,
                  sinks: Optional[torch.Tensor] = None, seed: Optional[torch.Tensor] = None,
                  segment_ids: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                  cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                  alibi_slopes: Optional[torch.Tensor] = None, need_lse: bool = True,
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Flash attention by the native launcher; differentiable in q, k, v, bias and sinks.

    Args:
        q: (B, Hq, L, D), k: (B, Hk, S, D), v: (B, Hk, S, Dv): any strides (a (B, L, H, D) tensor
            transposed is read in place). With `cu_seqlens`, B = 1 and L / S are the packed lengths.
        cfg: the kernels' settings (`cfg.layout` is not used: tensors are (B, H, T, D) views;
            `cfg.varlen` is set exactly when `cu_seqlens` is given).
        bias: None or float (B|1, Hq|1, L|1, S|1) of q's dtype, added to the logits.
        mask: None or bool/int8 (B|1, Hq|1, L|1, S|1), True = attend.
        sinks: None or float (Hq,) or (Hq, n) sink logits (n per head merge by log-sum-exp).
        seed: (2,) int32 Philox seed, needed when cfg.dropout_p > 0.
        segment_ids: None or integer (q_ids (B, L), kv_ids (B, S)): query i sees key j only where
            their ids are equal.
        cu_seqlens: None or int32 (cu_q (N + 1,), cu_k (N + 1,)) offsets of N sequences packed
            back to back; rows and keys after the last sequence get 0 (LSE -inf, gradients 0).
        alibi_slopes: None or float (Hq,) or (B, Hq) ALiBi slopes (B: the sequences with
            `cu_seqlens`): -slope * |i + S - L - j| joins each logit after scale, soft cap and bias,
            with positions and lengths of the sequence. No gradient.
        need_lse: False when the caller drops the LSE: a call without bias, mask, dropout, segments,
            packing or ALiBi (sinks only in eager calls) that the Hopper kernels take (`takes_hopper`)
            then runs them (their LSE is not differentiable), and the LSE returned is None.

    Returns:
        out (B, Hq, L, Dv) of q's dtype (a view of (B, L, Hq, Dv) memory, or of (B, Hq, L, Dv) memory
        from the Hopper kernels on contiguous (B, H, T, D) inputs), lse (B, Hq, L) float32 or None.
    """
    if sinks is not None:  # several sink logits per head join the denominator as their log-sum-exp
        sinks = (sinks if sinks.dim() == 1 else torch.logsumexp(sinks.float(), -1)).float()
    if (not need_lse and bias is None and mask is None and seed is None and segment_ids is None
            and cu_seqlens is None and alibi_slopes is None and _plain_launch()
            and (sinks is None or not torch.compiler.is_compiling())):  # the compiled Hopper op has no sinks
        grad = reverse_grad(q, k, v, sinks)
        if takes_hopper(q, k, v, cfg, grad):
            return hopper_flash(q, k, v, cfg, grad, sinks), None
    if mask is not None and mask.dtype == torch.bool:
        # Same bytes, read as int8 by the kernels; Inductor cannot lower a bool->int8 view, so a
        # traced call converts (fused into the mask's producer).
        mask = mask.to(torch.int8) if torch.compiler.is_compiling() else mask.view(torch.int8)
    if (cfg.varlen is not None) != (cu_seqlens is not None):
        raise ValueError(f"cfg.varlen={cfg.varlen!r} and cu_seqlens go together.")
    if segment_ids is None and cu_seqlens is None and alibi_slopes is None:
        return FLASH_OP(NativeFlashSpec(cfg), q, k, v, narrow(bias), narrow(mask), sinks, seed)
    q_ids, kv_ids = segment_ids if segment_ids is not None else (None, None)
    cu_q, cu_k = (c.to(torch.int32) for c in cu_seqlens) if cu_seqlens is not None else (None, None)
    if alibi_slopes is None:
        return FLASH_OP(NativeFlashSpec(cfg, PACKED_INPUTS), q, k, v, narrow(bias), narrow(mask), sinks, seed,
                        q_ids, kv_ids, cu_q, cu_k)
    # The kernels read float32 slopes with a contiguous head dim; the slopes get no gradient.
    alibi = alibi_slopes.detach().to(torch.float32).contiguous()
    return FLASH_OP(NativeFlashSpec(cfg, ALIBI_INPUTS), q, k, v, narrow(bias), narrow(mask), sinks, seed,
                    q_ids, kv_ids, cu_q, cu_k, alibi)


class NativeFlash(PreparedTritonCall):
    """The native flash call of one call signature (the drop-in prepares one per signature).

    `flash_forward` with this signature's settings; on Hopper, calls `hopper_flash.hopper_reasons`
    accepts run the Mosaic GPU kernels instead. A call without bias, mask or dropout (a
    decoding step, a causal prefill, a causal training step) keeps its launches here, since the
    signature fixes them: an eager call that needs no gradient launches directly, one that needs
    gradients enters autograd through `PreparedTritonCall.apply` with this object as its state, and its
    backward finds the backward launches here too (host time is most of a small call's cost, and
    a host-bound model step pays it per layer).
    """

    __slots__ = ("cfg", "spec", "_kernel", "_launches", "_backward_launches", "_programs")
    op = FLASH_OP

    def __init__(self, cfg: FlashConfig):
        self.cfg, self.spec = cfg, NativeFlashSpec(cfg)
        self._kernel = self._launches = None
        self._backward_launches: dict = {}
        # Compiled programs (`bridge.triton_program`): "forward" for calls without gradients,
        # "train" for calls with; -1 where one cannot run. Registered from the launches once their
        # kernels are compiled (after a call of each kind) and the extension is built.
        self._programs: dict = {}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                 mask: Optional[torch.Tensor] = None, seed: Optional[torch.Tensor] = None) -> torch.Tensor:
        """(B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, Dv) of this signature -> out (B, Hq, L, Dv)."""
        if bias is None and mask is None and seed is None and _plain_launch():
            grad = reverse_grad(q, k, v)
            if takes_hopper(q, k, v, self.cfg, grad):  # under torch.compile: one custom op node
                return hopper_flash(q, k, v, self.cfg, grad)
            if not torch.compiler.is_compiling():
                return self._eager(q, k, v, grad)
        return flash_forward(q, k, v, self.cfg, bias=bias, mask=mask, seed=seed)[0]

    def _eager(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: bool) -> torch.Tensor:
        """An eager call without bias, mask or dropout on the Triton kernels, by this signature's launches
        (or its compiled program, once registered)."""
        kernel = _entries(q, k)["fwd"]
        if self._kernel is not kernel:
            self._launches = _launches(self.spec, q, k, v, None, None, None, None)
            self._kernel = kernel
            self._backward_launches = {}
            self._programs = {}
        program = self._programs.get("train" if grad else "forward")
        if program is not None and program >= 0 and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
            if grad:
                return triton_program.apply(program, [q, k, v])[0]
            return triton_program.forward_only(program, [q, k, v])[0]
        if grad:
            return self.apply(q, k, v)[0]
        out, lse = _forward(self.spec, q, k, v, None, None, None, None, launches=self._launches)
        if "forward" not in self._programs:
            self._record_program("forward", q, lambda: self._program(q, k, v, out, lse, None))
        return out

    def forward(self, q, k, v):
        out, lse = _forward(self.spec, q, k, v, None, None, None, None, launches=self._launches)
        return (out,), (q, k, v, out, lse)

    def backward(self, saved, grads):
        q, k, v, out, lse = saved
        dout = grads[0]
        strides = dout.stride()
        launches = self._backward_launches.get(strides)
        if launches is None:
            launches = self._backward_launches[strides] = _launches(self.spec, q, k, v, None, None, None, None,
                                                                    strides, False)
        got = _backward(self.spec, (q, k, v, None, None, None, None), (out, lse), grads, _QKV_NEEDS, launches)
        if "train" not in self._programs:
            self._record_program("train", q, lambda: self._program(q, k, v, out, lse, (dout, launches)))
        return got

    def _record_program(self, kind: str, q: torch.Tensor, register) -> None:
        """Settles `kind`'s program once per signature: -1 off CUDA or with programs switched off, the
        registered id (or -1) once the extension is built; nothing while it is still building."""
        if not q.is_cuda or not triton_program.enabled():
            self._programs[kind] = -1
        elif triton_program.ready():
            found = register()
            self._programs[kind] = -1 if found is None else found

    def _program(self, q, k, v, out, lse, backward: Optional[tuple]) -> Optional[int]:
        """Registers this signature's compiled program (forward only, or with the backward planned
        for the gradient layout of `backward` = (dOut, its launches)); None where it cannot run."""
        layout = lambda t: (tuple(t.shape), tuple(t.stride()), t.dtype)  # noqa: E731
        # Forward buffers: 0 q, 1 k, 2 v, 3 out, 4 lse.
        fwd = [(self._launches["fwd"], dict(Q=0, K=1, V=2, Out=3, Lse=4))]
        common = dict(num_inputs=3, forward_allocs=[layout(out), layout(lse)], forward_launches=fwd, outputs=[3],
                      second_order_error=FLASH_OP.second_order_message())
        if backward is None:
            return triton_program.register(**common, saved=[], grad_layouts=[], backward_allocs=[],
                                           backward_launches=[], grads=[-1, -1, -1])
        dout, launches = backward
        # Backward buffers: 0 q, 1 k, 2 v, 3 out, 4 lse (saved), 5 dOut, 6 Delta, 7 dQ, 8 dK, 9 dV.
        grads_like = [layout(torch.empty_like(t, device="meta")) for t in (q, k, v)]
        reads = dict(Q=0, K=1, V=2, dOut=5, Lse=4, Delta=6)
        return triton_program.register(
            **common, saved=[0, 1, 2, 3, 4], grad_layouts=[(tuple(out.shape), tuple(dout.stride()), out.dtype)],
            backward_allocs=[layout(lse)] + grads_like,
            backward_launches=[(launches["delta"], dict(Out=3, dOut=5, Delta=6)),
                               (launches["dkdv"], dict(reads, dK=8, dV=9)),
                               (launches["dq"], dict(reads, dQ=7))],
            grads=[7, 8, 9])


#: What the backward of a call without bias, mask or sinks computes: dQ, dK, dV.
_QKV_NEEDS = (True, True, True, False, False, False, False)
