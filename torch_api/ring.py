"""`ring_attention`: sequence-parallel (ring) attention for torch tensors in torch's (B, H, L, E) layout.

Shape legend: B batch, Hq / Hk query / key-value heads (Hq % Hk == 0), L query length, S key length,
E q/k head dim, Ev value head dim; a shard holds L / n (S / n) positions of the sequence, n being the
number of devices of the ring.

Three ways to call it:

(a1) Full tensors, one process: `ring_attention(q, k, v, is_causal=True, mesh=["cuda:0", "cuda:1"])`.
     The tensors (on one device) are sharded over the mesh's devices for the call; the output comes
     back as one tensor on the input's device. (Lengths not divisible by n are replicated once.)
(a2) Shards, one process owning several devices: `q = [q0, q1, ...]` with q_i on cuda:i (likewise k,
     v): shard i holds positions [i L/n, (i + 1) L/n) in natural order. The shards are imported
     zero-copy and assembled into one global JAX array; the output is a list of shards on the same
     devices.
(b)  One process per GPU (torchrun), after `jaxattn.bridge.initialize_from_torchrun()`: each rank
     passes its own shard (rank r holds positions [r L/n, (r + 1) L/n)) and gets its output shard.
     XLA's collectives move the key/value blocks between processes.

Under a causal mask the shards are permuted into the zigzag layout inside the call (equal work per
device) and the output is permuted back, unless `inputs_in_layout=True` says the caller's shards
already are in `layout` order (`jaxattn.jax_core.ring_layout.to_layout`).

The op is differentiable (the backward is a ring too, from the saved output and LSE, no forward
recompute) and traceable by torch.compile (custom ops with fake implementations).
"""

from __future__ import annotations

import functools
from typing import Literal, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..bridge.devices import to_jax_device
from ..bridge.dlpack import to_jax
from ..bridge.distributed import global_from_shards, torch_shards
from ..jax_core.ring import ACCUMULATIONS
from ..jax_core.ring import ring_attention as _jax_ring
from ..jax_core.ring import ring_attention_backward as _jax_ring_backward
from ..jax_core.ring_layout import LAYOUTS
from .flash import _check_flag, _check_options, check_same_batch
from .validation import AttentionInputError, check_finite, check_qkv

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# --- JAX side --------------------------------------------------------------------------------------


def _mesh_of(device_ids: tuple[int, ...], axis: str) -> Mesh:
    by_id = {d.id: d for d in jax.devices()}
    return Mesh(np.array([by_id[i] for i in device_ids]), (axis,))


def _swap(x):
    return jnp.swapaxes(x, 1, 2)


@functools.lru_cache(maxsize=64)
def _jax_functions(device_ids, axis, options):
    """Jitted (forward, backward) on global (B, H, L, E) arrays sharded over the mesh."""
    mesh = _mesh_of(device_ids, axis)
    kw = dict(options, mesh=mesh, axis_name=axis)

    def forward(q, k, v, q_seg, kv_seg):
        seg = None if q_seg is None else (q_seg, kv_seg)
        out, lse = _jax_ring(_swap(q), _swap(k), _swap(v), segment_ids=seg, return_lse=True, **kw)
        return _swap(out), lse

    def backward(q, k, v, q_seg, kv_seg, out, lse, dout, dlse):
        seg = None if q_seg is None else (q_seg, kv_seg)
        grads = _jax_ring_backward(_swap(q), _swap(k), _swap(v), _swap(out), lse, _swap(dout), dlse,
                                   segment_ids=seg, **kw)
        return tuple(_swap(g) for g in grads)

    return mesh, jax.jit(forward), jax.jit(backward)


_SEQ = {4: P(None, None, "sp", None), 3: P(None, None, "sp"), 2: P(None, "sp")}


def _spec(ndim: int, axis: str) -> P:
    return P(*(axis if a == "sp" else a for a in _SEQ[ndim]))


def _import(groups, form: str, mesh: Mesh, axis: str):
    """Lists of torch shards (or one full tensor each) -> global JAX arrays (None stays None)."""
    out = []
    for group in groups:
        if group is None:
            out.append(None)
            continue
        spec = _spec(group[0].dim(), axis)
        if form == "full":
            (x,) = to_jax([group[0]])
            seq = group[0].shape[2 if group[0].dim() >= 3 else 1]
            sharding = NamedSharding(mesh, spec if seq % mesh.shape[axis] == 0 else P())
            out.append(jax.device_put(x, sharding))
        else:
            out.append(global_from_shards(group, mesh, spec, 2 if group[0].dim() >= 3 else 1))
    return out


def _export(arrays, form: str, device: torch.device) -> list[torch.Tensor]:
    """Global JAX arrays -> torch tensors: each array's shards in order, or one full tensor each."""
    result = []
    for x in arrays:
        if form == "full":
            result.append(torch.from_dlpack(jax.device_put(x, to_jax_device(device))))
        else:
            result.extend(torch_shards(x, 2 if x.ndim >= 3 else 1))
    return result


def _split(tensors: list[torch.Tensor], n: int, has_seg: bool):
    groups = [tensors[i * n:(i + 1) * n] for i in range(len(tensors) // n)]
    q, k, v = groups[:3]
    seg = groups[3:5] if has_seg else (None, None)
    return q, k, v, seg[0], seg[1], groups[5 if has_seg else 3:]


# --- torch custom ops ------------------------------------------------------------------------------


def _parse(spec: str):
    import ast

    form, n, has_seg, device_ids, axis, options = ast.literal_eval(spec)
    return form, n, has_seg, tuple(device_ids), axis, tuple(options)


@torch.library.custom_op("jaxattn::ring_attention", mutates_args=())
def _ring_op(tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    form, n, has_seg, device_ids, axis, options = _parse(spec)
    mesh, forward, _ = _jax_functions(device_ids, axis, options)
    q, k, v, q_seg, kv_seg, _ = _split(tensors, n, has_seg)
    out, lse = forward(*_import((q, k, v, q_seg, kv_seg), form, mesh, axis))
    return _export((out, lse), form, tensors[0].device)


@_ring_op.register_fake
def _ring_op_fake(tensors, spec):
    _, n, _, _, _, _ = _parse(spec)
    q, v = tensors[:n], tensors[2 * n:3 * n]
    outs = [torch.empty((*s.shape[:3], v[0].shape[3]), dtype=s.dtype, device=s.device) for s in q]
    lses = [torch.empty(tuple(s.shape[:3]), dtype=torch.float32, device=s.device) for s in q]
    return outs + lses


@torch.library.custom_op("jaxattn::ring_attention_backward", mutates_args=())
def _ring_backward_op(tensors: list[torch.Tensor], spec: str) -> list[torch.Tensor]:
    form, n, has_seg, device_ids, axis, options = _parse(spec)
    mesh, _, backward = _jax_functions(device_ids, axis, options)
    q, k, v, q_seg, kv_seg, rest = _split(tensors, n, has_seg)
    out, lse, dout, dlse = rest
    grads = backward(*_import((q, k, v, q_seg, kv_seg, out, lse, dout, dlse), form, mesh, axis))
    return _export(grads, form, tensors[0].device)


@_ring_backward_op.register_fake
def _ring_backward_op_fake(tensors, spec):
    _, n, _, _, _, _ = _parse(spec)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors[:3 * n]]


def _setup_context(ctx, inputs, output):
    tensors, spec = inputs
    _, n, has_seg, _, _, _ = _parse(spec)
    ctx.spec, ctx.n, ctx.has_seg = spec, n, has_seg
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors, *output)


def _backward(ctx, grads):
    if torch.is_grad_enabled():  # create_graph=True: these gradients would not be differentiable again
        raise NotImplementedError(
            "ring_attention: second-order gradients (a backward with create_graph=True) are not implemented; "
            "the gradients of ring attention cannot be differentiated again.")
    n = ctx.n
    saved = list(ctx.saved_tensors)
    n_in = 5 * n if ctx.has_seg else 3 * n
    inputs, out, lse = saved[:n_in], saved[n_in:n_in + n], saved[n_in + n:]
    dout = [g if g is not None else torch.zeros_like(o) for g, o in zip(grads[:n], out)]
    dlse = [g if g is not None else torch.zeros_like(x) for g, x in zip(grads[n:], lse)]
    computed = torch.ops.jaxattn.ring_attention_backward(inputs + out + lse + dout + dlse, ctx.spec)
    return list(computed) + [None] * (n_in - 3 * n), None


_ring_op.register_autograd(_backward, setup_context=_setup_context)


# --- public API ------------------------------------------------------------------------------------


def _as_list(name: str, x, form: str) -> list[torch.Tensor]:
    if form == "shards":
        if not isinstance(x, (list, tuple)) or not x or not all(isinstance(t, torch.Tensor) for t in x):
            raise TypeError(f"{name}: q is a list of shards, so {name} must be a non-empty list of torch tensors too, "
                            f"got {type(x).__name__}.")
        return list(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (or, like q, a list of shards), got {type(x).__name__}.")
    return [x]


@torch.compiler.assume_constant_result
def _setup(single: bool, mesh, shard_devices: tuple) -> tuple[str, tuple[int, ...], str]:
    """(form, device ids of the ring, axis name): JAX runtime queries, constant while torch.compile traces."""
    form = "shards" if not single or jax.process_count() > 1 else "full"
    return (form, *_resolve_mesh(mesh, [torch.device(d) for d in shard_devices], form))


def _resolve_mesh(mesh, shard_devices: list[torch.device], form: str) -> tuple[tuple[int, ...], str]:
    """(device ids of the ring, axis name)."""
    if isinstance(mesh, Mesh):
        if len(mesh.axis_names) != 1:
            raise AttentionInputError(f"mesh: expected a 1-D mesh (one sequence axis), got axes {mesh.axis_names}.")
        devices = list(mesh.devices.flat)
        axis = mesh.axis_names[0]
    elif mesh is None:
        if form == "full":
            platform = "gpu" if shard_devices[0].type == "cuda" else "cpu"
            devices = jax.local_devices(backend=platform)
        elif jax.process_count() > 1:
            devices = jax.devices()
        elif all(d.type == "cpu" for d in shard_devices):  # CPU shards: the first n (simulated) CPU devices
            devices = jax.local_devices(backend="cpu")[:len(shard_devices)]
        else:
            devices = [to_jax_device(d) for d in shard_devices]
        axis = "sp"
    elif isinstance(mesh, (list, tuple)) and mesh:
        try:
            devices = [to_jax_device(torch.device(d)) for d in mesh]
        except (TypeError, RuntimeError) as err:
            raise AttentionInputError(f"mesh={mesh!r}: expected torch devices such as ['cuda:0', 'cuda:1'] ({err}).") from None
        axis = "sp"
    else:
        raise TypeError(f"mesh={mesh!r}: expected None, a 1-D jax.sharding.Mesh or a list of torch devices.")
    if len({d.id for d in devices}) != len(devices):
        raise AttentionInputError(f"mesh: a device appears twice in {devices}.")
    if form == "shards":
        local = [d for d in devices if d.process_index == jax.process_index()]
        cuda = jax.process_count() == 1 and shard_devices[0].type == "cuda"
        got = [to_jax_device(d) for d in shard_devices] if cuda else None
        if len(shard_devices) != len(local) or (cuda and got != local):
            raise AttentionInputError(
                f"q: {len(shard_devices)} shard(s) on {[str(d) for d in shard_devices]}, but the ring's devices of this "
                f"process are {local}; pass one shard per device, in the ring's order.")
    return tuple(d.id for d in devices), axis


def ring_attention(
    q: Tensors,
    k: Tensors,
    v: Tensors,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    mesh: Union[None, Mesh, Sequence[Union[str, torch.device]]] = None,
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    segment_ids: Optional[tuple[Tensors, Tensors]] = None,
    layout: Optional[Literal["zigzag", "striped", "contiguous"]] = None,
    inputs_in_layout: bool = False,
    return_lse: bool = False,
    accumulation: Literal["float32", "input"] = "float32",
):
    """Ring attention: the sequence is split over several devices; K/V blocks travel round the ring.

    Args:
        q: (B, Hq, L, E) full tensor; or a list of n shards (B, Hq, L/n, E), shard i on the ring's
            i-th device; or, in a multi-process run (torchrun), this rank's shard.
        k: (B, Hk, S, E) in the same form as q (shards (B, Hk, S/n, E)).
        v: (B, Hk, S, Ev) in the same form.
        is_causal: top-left causal mask over the global positions (needs L == S).
        scale: softmax scale; default 1/sqrt(E).
        mesh: the ring's devices: a 1-D `jax.sharding.Mesh`, a list of torch devices
            (["cuda:0", "cuda:1"]), or None: the shards' devices (a2), every device of every process
            (b), or every local device of the input's kind (a1).
        window: (left, right) keys visible around each query's position, -1 unbounded (needs L == S).
        softcap: logits soft cap c in c * tanh(s / c).
        segment_ids: (q_ids (B, L), kv_ids (B, S)) integer tensors in q's form (shards (B, L/n));
            a query sees only keys with its id.
        layout: "zigzag", "striped" or "contiguous"; None: zigzag when causal without a window, else
            contiguous.
        inputs_in_layout: the shards already are in `layout` order (and so is the output).
        return_lse: also return the (B, Hq, L) float32 log-sum-exp (in the same form).
        accumulation: "float32" keeps partial outputs and gradient accumulators in float32;
            "input" keeps them (and the dK / dV that travel round the ring) in q's dtype: about
            half the accumulator memory and gradient traffic for 16-bit inputs, one rounding per
            ring step.

    Returns:
        (B, Hq, L, Ev) output in q's form (a tensor, a list of shards, or this rank's shard); with
        `return_lse`, (output, lse).

    Raises:
        AttentionInputError: malformed shapes, dtypes, devices or options (the message names the
            argument and the fix).
    """
    single = isinstance(q, torch.Tensor)
    devices = tuple(str(t.device) for t in ([q] if single else q) if isinstance(t, torch.Tensor))
    form, device_ids, axis = _setup(single, mesh, devices)
    if single and form == "shards":  # this rank's shard
        q, k, v = [q], [k], [v]
        if segment_ids is not None:
            segment_ids = tuple([s] if isinstance(s, torch.Tensor) else s for s in segment_ids)
    qs, ks, vs = (_as_list(name, x, form) for name, x in (("q", q), ("k", k), ("v", v)))
    if not (len(qs) == len(ks) == len(vs)):
        raise AttentionInputError(f"q, k and v: {len(qs)}, {len(ks)} and {len(vs)} shards; give one shard per device.")
    for i, (a, b_, c) in enumerate(zip(qs, ks, vs)):
        check_qkv(a, b_, c, enable_gqa=True, names=("q", "k", "v"), gqa_flag=False)
        if a.dim() != 4:
            raise AttentionInputError(f"q: expected (B, Hq, L, E) tensors, got shape {tuple(a.shape)}"
                                      f"{f' (shard {i})' if form == 'shards' else ''}.")
        check_same_batch(a, b_)
        if (a.shape[:2], a.shape[3], b_.shape[:2]) != (qs[0].shape[:2], qs[0].shape[3], ks[0].shape[:2]) or \
                a.shape[2] != qs[0].shape[2] or b_.shape[2] != ks[0].shape[2]:
            raise AttentionInputError(f"shard {i}: shapes q {tuple(a.shape)}, k {tuple(b_.shape)} differ from shard 0's "
                                      f"q {tuple(qs[0].shape)}, k {tuple(ks[0].shape)}; shards must be equal in size.")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal={is_causal!r}: expected a bool.")
    _check_flag("inputs_in_layout", inputs_in_layout)
    _check_flag("return_lse", return_lse)
    window = _check_options("top_left", window, softcap, None, scale, qs[0].shape[1], qs[0].device)
    if layout is not None and layout not in LAYOUTS:
        raise AttentionInputError(f"layout={layout!r}: expected one of {LAYOUTS} or None.")
    if accumulation not in ACCUMULATIONS:
        raise AttentionInputError(f"accumulation={accumulation!r}: expected one of {ACCUMULATIONS}.")
    seg_lists = None
    if segment_ids is not None:
        if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
            raise AttentionInputError("segment_ids: expected a pair (q_ids, kv_ids).")
        seg_lists = [_as_list(name, x, form) for name, x in zip(("q_ids", "kv_ids"), segment_ids)]
        for name, group, ref in (("q_ids", seg_lists[0], qs), ("kv_ids", seg_lists[1], ks)):
            for t, r in zip(group, ref):
                if t.dtype not in _INT_DTYPES or tuple(t.shape) != (r.shape[0], r.shape[2]) or t.device != r.device:
                    raise AttentionInputError(
                        f"segment_ids: {name} has shape {tuple(t.shape)}, dtype {t.dtype} on {t.device}; expected an "
                        f"integer tensor of shape {(r.shape[0], r.shape[2])} on {r.device}.")
            if len(group) != len(qs):
                raise AttentionInputError(f"segment_ids: {name} has {len(group)} shards, q has {len(qs)}.")
        seg_lists = [[t.to(torch.int32) for t in g] for g in seg_lists]
    if form == "full":
        check_finite({"q": qs[0], "k": ks[0], "v": vs[0]})
    options = (("causal", is_causal), ("sliding_window", window), ("logits_soft_cap", softcap),
               ("scale", None if scale is None else float(scale)), ("layout", layout),
               ("inputs_in_layout", bool(inputs_in_layout)), ("accumulation", accumulation))
    spec = repr((form, len(qs), seg_lists is not None, device_ids, axis, options))
    tensors = qs + ks + vs + (seg_lists[0] + seg_lists[1] if seg_lists is not None else [])
    result = torch.ops.jaxattn.ring_attention(tensors, spec)
    n = len(qs)
    out, lse = result[:n], result[n:]
    if single:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
