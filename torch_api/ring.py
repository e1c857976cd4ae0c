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

from typing import Literal, Optional, Sequence, Union

import torch

from ..bridge.meshes import resolve_mesh
from ..bridge.sharded_op import ShardedJaxOp
from ..jax_core import calls
from ..jax_core.ring import ACCUMULATIONS
from ..jax_core.ring_layout import LAYOUTS
from .flash import _check_flag, _check_options, check_same_batch
from .validation import AttentionInputError, check_alibi, check_finite, check_qkv

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)

#: (q, k, v, q_ids, kv_ids) split along their sequence dims, ALiBi slopes replicated -> (output, LSE)
#: split the same way; the backward is a ring too, from the saved output and LSE.
_ring_op = ShardedJaxOp(calls.ring, backward=calls.ring_backward, name="jaxattn.ring_attention", num_outputs=2,
                        in_dims=(2, 2, 2, 1, 1, None), out_dims=(2, 2), module=__name__)


def _as_list(name: str, x, form: str) -> list[torch.Tensor]:
    if form == "shards":
        if not isinstance(x, (list, tuple)) or not x or not all(isinstance(t, torch.Tensor) for t in x):
            raise TypeError(f"{name}: q is a list of shards, so {name} must be a non-empty list of torch tensors too, "
                            f"got {type(x).__name__}.")
        return list(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (or, like q, a list of shards), got {type(x).__name__}.")
    return [x]


def ring_attention(
    q: Tensors,
    k: Tensors,
    v: Tensors,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    mesh: Union[None, "jax.sharding.Mesh", Sequence[Union[str, torch.device]]] = None,
    window: Optional[tuple[int, int]] = None,
    softcap: Optional[float] = None,
    segment_ids: Optional[tuple[Tensors, Tensors]] = None,
    layout: Optional[Literal["zigzag", "striped", "contiguous"]] = None,
    inputs_in_layout: bool = False,
    return_lse: bool = False,
    accumulation: Literal["float32", "input"] = "float32",
    alibi_slopes: Optional[torch.Tensor] = None,
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
        return_lse: also return the (B, Hq, L) float32 log-sum-exp (in the same form; -inf for rows
            that see no key).
        accumulation: "float32" keeps partial outputs and gradient accumulators in float32;
            "input" keeps them (and the dK / dV that travel round the ring) in q's dtype: about
            half the accumulator memory and gradient traffic for 16-bit inputs, one rounding per
            ring step.
        alibi_slopes: float32 (Hq,) or (B, Hq) ALiBi slopes on q's device (shard 0's with shards),
            flash-attn's convention: the logit of query i and key j gets -slope * |i + S - L - j|, in
            global positions whatever the layout. Every device gets all of them; no gradient flows
            to them. The blocks then run on the XLA block kernel (also on GPU).

    Returns:
        (B, Hq, L, Ev) output in q's form (a tensor, a list of shards, or this rank's shard); with
        `return_lse`, (output, lse).

    Raises:
        AttentionInputError: malformed shapes, dtypes, devices or options (the message names the
            argument and the fix).
    """
    single = isinstance(q, torch.Tensor)
    devices = tuple(str(t.device) for t in ([q] if single else q) if isinstance(t, torch.Tensor))
    whole, device_ids, axis = resolve_mesh(mesh, devices, single, AttentionInputError, "q", "ring")
    form = "full" if whole else "shards"
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
    check_alibi(alibi_slopes, qs[0].shape[1], qs[0].shape[0], qs[0].device)
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach()  # no gradient, as flash-attn
    if form == "full":
        check_finite({"q": qs[0], "k": ks[0], "v": vs[0], "alibi_slopes": alibi_slopes})
    options = dict(causal=is_causal, sliding_window=window, logits_soft_cap=softcap,
                   scale=None if scale is None else float(scale), layout=layout,
                   inputs_in_layout=bool(inputs_in_layout), accumulation=accumulation)
    if form == "full":
        q_ids, kv_ids = (None, None) if seg_lists is None else (seg_lists[0][0], seg_lists[1][0])
        out, lse = _ring_op(qs[0], ks[0], vs[0], q_ids, kv_ids, alibi_slopes, mesh=(device_ids, axis), **options)
    else:
        q_ids, kv_ids = (None, None) if seg_lists is None else seg_lists
        slopes = None if alibi_slopes is None else [alibi_slopes.to(t.device) for t in qs]  # a copy per device
        out, lse = _ring_op(qs, ks, vs, q_ids, kv_ids, slopes, mesh=(device_ids, axis), **options)
        if single:  # this rank's shard
            out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
