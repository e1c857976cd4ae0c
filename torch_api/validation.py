"""Input checks of the torch API, with messages that name the argument, its value and a fix.

Errors derive from both ValueError and RuntimeError: code written against torch (which raises
RuntimeError) and code expecting ValueError both catch them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional

import torch

from ..bridge.functorch import underlying
from ..bridge.triton_autograd import recorded


class AttentionInputError(ValueError, RuntimeError):
    """An argument of an attention call is malformed."""


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: "cpu": check CPU inputs for NaN/inf (free of host syncs); "always": CUDA too (one host sync per
#: call); "off": never. Checks are skipped while torch.compile traces.
_finite_check = ["cpu"]


def set_finite_check(mode: str) -> None:
    """Sets when inputs are checked for NaN/inf: "cpu" (default), "always" or "off"."""
    if mode not in ("cpu", "always", "off"):
        raise ValueError(f"mode={mode!r}: expected 'cpu', 'always' or 'off'.")
    _finite_check[0] = mode


class _Exempt(threading.local):
    def __init__(self) -> None:
        self.active = False


_exempt = _Exempt()


@contextlib.contextmanager
def finite_check_exempt() -> Iterator[None]:
    """Within the block `check_finite` checks nothing: for calls whose key/value tensors are whole
    KV caches, where slots outside the valid region may hold anything (the caller checks the
    tensors it was given)."""
    before, _exempt.active = _exempt.active, True
    try:
        yield
    finally:
        _exempt.active = before


def describe(t) -> str:
    """A tensor's shape, dtype and device (or the type of a non-tensor), for error messages."""
    if isinstance(t, torch.Tensor):
        return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"
    return f"a {type(t).__name__}"


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def check_qkv(query, key, value, enable_gqa: bool, names: tuple[str, str, str] = ("query", "key", "value"),
              gqa_flag: bool = True, allow_empty: bool = False) -> None:
    """Checks types, ranks, dtypes, devices and sizes of (N, ..., H, L, E) query/key/value.

    Args:
        names: the arguments' names in the caller's signature (flash and ring call them q, k, v).
        gqa_flag: whether the caller has an `enable_gqa` argument to name in messages (APIs that
            always allow grouped-query attention pass enable_gqa=True, gqa_flag=False).
    """
    qname, kname, vname = names
    for name, t in ((qname, query), (kname, key), (vname, value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}.")
        if t.dim() < 2:
            raise AttentionInputError(f"{name}: expected at least 2 dims (..., L, E), got shape {_shape(t)}.")
        if t.dtype not in _FLOAT_DTYPES:
            raise AttentionInputError(
                f"{name}: dtype {t.dtype} is not a floating type; expected one of "
                "float16, bfloat16, float32, float64 (call .float() or .to(torch.bfloat16))."
            )
        if t.numel() == 0 and not allow_empty:
            raise AttentionInputError(f"{name}: is empty (shape {_shape(t)}); every dimension must be > 0.")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa={enable_gqa!r}: expected a bool.")
    if not (query.dtype == key.dtype == value.dtype):
        raise AttentionInputError(
            f"{qname}, {kname} and {vname} must share a dtype; got {query.dtype}, {key.dtype}, {value.dtype} "
            f"(convert them with .to({qname}.dtype))."
        )
    if not (query.device == key.device == value.device):
        raise AttentionInputError(
            f"{qname}, {kname} and {vname} must be on one device; got {query.device}, {key.device}, {value.device} "
            f"(move them with .to({qname}.device))."
        )
    if not (query.dim() == key.dim() == value.dim()):
        raise AttentionInputError(
            f"{qname}, {kname} and {vname} must have the same number of dims; got shapes {_shape(query)}, "
            f"{_shape(key)}, {_shape(value)}."
        )
    if key.shape[-1] != query.shape[-1]:
        raise AttentionInputError(
            f"{kname}: head dim {key.shape[-1]} != {qname} head dim {query.shape[-1]} (shapes {_shape(key)} and {_shape(query)})."
        )
    if key.shape[-2] != value.shape[-2]:
        raise AttentionInputError(
            f"{kname} and {vname}: sequence lengths differ, {key.shape[-2]} and {value.shape[-2]} "
            f"(shapes {_shape(key)} and {_shape(value)})."
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise AttentionInputError(f"{kname} {_shape(key)} and {vname} {_shape(value)}: leading dims differ.")
    for i in range(query.dim() - 2):
        qn, kn = query.shape[i], key.shape[i]
        is_head = i == query.dim() - 3
        if qn == kn or kn == 1:
            continue
        if is_head and enable_gqa:
            if qn % kn:
                raise AttentionInputError(
                    f"{'enable_gqa=True: ' if gqa_flag else ''}{qname} heads {qn} must be a multiple of "
                    f"{kname}/{vname} heads {kn} "
                    f"(shapes {_shape(query)} and {_shape(key)})."
                )
            continue
        if is_head:
            raise AttentionInputError(
                f"{kname}: {kn} heads but {qname} has {qn} (shapes {_shape(key)} and {_shape(query)}); "
                "for grouped-query attention pass enable_gqa=True."
            )
        raise AttentionInputError(
            f"{kname}: dim {i} is {kn} but {qname}'s is {qn} (shapes {_shape(key)} and {_shape(query)}); "
            "leading dims must match or be 1."
        )


def check_options(attn_mask, dropout_p, is_causal, scale, query) -> None:
    """Checks dropout_p, is_causal, scale and the mask's type (its shape: `check_mask_shape`)."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal={is_causal!r}: expected a bool.")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p={dropout_p!r}: expected a float in [0, 1), got {type(dropout_p).__name__}.")
    if not 0.0 <= dropout_p < 1.0:
        raise AttentionInputError(f"dropout_p={dropout_p!r}: expected a float in [0, 1).")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale={scale!r}: expected None or a finite float, got {type(scale).__name__}.")
    if scale is not None and not math.isfinite(scale):
        raise AttentionInputError(f"scale={scale!r}: expected None or a finite float.")
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask: expected a torch.Tensor or None, got {type(attn_mask).__name__}.")
    if is_causal:
        raise AttentionInputError(
            "attn_mask was given with is_causal=True; pass one or the other (fold the causal mask into attn_mask)."
        )
    if attn_mask.dtype != torch.bool and attn_mask.dtype != query.dtype:
        raise AttentionInputError(
            f"attn_mask: dtype {attn_mask.dtype} is neither bool nor the query dtype {query.dtype} "
            "(use a bool mask, True = attend, or an additive mask of the query's dtype)."
        )
    if attn_mask.device != query.device:
        raise AttentionInputError(
            f"attn_mask: on {attn_mask.device} but query is on {query.device} (move it with .to(query.device))."
        )


def check_mask_shape(attn_mask: torch.Tensor, target: tuple[int, ...]) -> None:
    """The mask must broadcast to `target` = (N, ..., Hq, L, S)."""
    shape = _shape(attn_mask)
    if len(shape) > len(target) or any(m not in (1, t) for m, t in zip(shape[::-1], target[::-1])):
        raise AttentionInputError(
            f"attn_mask: shape {shape} does not broadcast to (N, ..., Hq, L, S) = {target}."
        )


def finite_check_applies(device: torch.device) -> bool:
    """Whether `check_finite` looks at tensors on `device` under the current `set_finite_check` mode."""
    mode = _finite_check[0]
    return mode == "always" or (mode == "cpu" and device.type == "cpu")


#: Tensors in which only NaN is an error (+-inf are meaningful values).
_NAN_ONLY = ("attn_mask", "sinks")


def finite_check_reads(t: torch.Tensor) -> bool:
    """Whether `check_finite` would read `t` now (lets a caller skip building a tensor only for it)."""
    mode = _finite_check[0]
    if mode == "off" or _exempt.active or torch.compiler.is_compiling() or recorded():
        return False
    return mode == "always" or t.device.type == "cpu"


def check_finite(tensors: dict[str, Optional[torch.Tensor]]) -> None:
    """Raises on NaN/inf in query/key/value (and NaN in a float mask), as `set_finite_check` allows.

    One host read for all tensors: NaN propagates through amin/amax and +-inf shows in them (a
    mask's amax is clamped: only its NaN counts); only a failing call counts the bad positions.
    Attention-sink logits ("sinks") are checked like a mask: -inf (no sink) is valid, NaN is not.
    Under torch.func transforms the plain tensors beneath the wrappers are read: they hold every
    vmapped sample (vmap refuses to read a batched tensor's value).
    """
    mode = _finite_check[0]
    # A recorded call (FakeTensorMode, torch.jit.trace) has no values to read, or none its trace keeps.
    if mode == "off" or _exempt.active or torch.compiler.is_compiling() or recorded():
        return
    if torch._C._are_functorch_transforms_active():
        tensors = {name: None if t is None else underlying(t) for name, t in tensors.items()}
    checked, extremes = [], []
    for name, t in tensors.items():
        if t is None or t.dtype == torch.bool or not t.numel() or (mode == "cpu" and t.device.type != "cpu"):
            continue
        checked.append((name, t))
        if name in _NAN_ONLY:  # -inf (and +inf) are valid additive mask values; NaN is not
            extremes.append(t.amax().clamp(-1, 1))
        else:
            extremes.extend(torch.aminmax(t))
    if not checked:
        return
    if len({e.dtype for e in extremes}) > 1:
        extremes = [e.float() for e in extremes]
    if bool(torch.isfinite(torch.stack(extremes)).all()):
        return
    for name, t in checked:
        bad = torch.isnan(t) if name in _NAN_ONLY else ~torch.isfinite(t)
        if bool(bad.any()):
            what = "NaN" if name in _NAN_ONLY else "NaN or inf"
            raise AttentionInputError(
                f"{name}: contains {what} values at {int(bad.sum())} position(s) "
                "(check the producer of this tensor; jaxattn.torch_api.set_finite_check('off') disables this check)."
            )


def index_tensor(name: str, t, shape: tuple, what: str, device) -> torch.Tensor:
    """An int32 (or int64, converted) index tensor of exactly `shape` on `device` (lengths, starts,
    batch indices of a cache call); `what` spells the shape for the message, e.g. "(B,)"."""
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64) or tuple(t.shape) != shape:
        raise AttentionInputError(f"{name}: expected an int32 tensor of shape {what} = {shape}, got {describe(t)}.")
    if t.device != device:
        raise AttentionInputError(f"{name}: on {t.device} but q is on {device} (move it with .to(q.device)).")
    return t if t.dtype == torch.int32 else t.to(torch.int32)


def block_table_tensor(block_table, b: int, device) -> torch.Tensor:
    """A cache call's page table: an int32 (or int64, converted) tensor (B, max_pages) on `device`."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != b:
        raise AttentionInputError(f"block_table: expected an int32 tensor of shape (B, max_pages) with B={b}, "
                                  f"got {describe(block_table)}.")
    return index_tensor("block_table", block_table, tuple(block_table.shape), "(B, max_pages)", device)


def check_alibi(alibi_slopes, hq: int, batch: int, device: torch.device, batch_name: str = "B") -> None:
    """ALiBi slopes as flash-attn takes them: None, or a float32 tensor (Hq,) or (batch, Hq) on
    `device` (q's). `batch_name` names the batch dim in messages ("N sequences" for varlen calls)."""
    if alibi_slopes is None:
        return
    want = f"a float32 tensor of shape (Hq,)=({hq},) or ({batch_name}, Hq)=({batch}, {hq}) on {device}"
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected {want}, got {type(alibi_slopes).__name__}.")
    if tuple(alibi_slopes.shape) not in ((hq,), (batch, hq)) or alibi_slopes.dtype != torch.float32:
        raise AttentionInputError(f"alibi_slopes: got {describe(alibi_slopes)}; expected {want} (one slope per query "
                                  "head, optionally per batch row; e.g. slopes.float()).")
    if alibi_slopes.device != device:
        raise AttentionInputError(f"alibi_slopes: on {alibi_slopes.device} but q is on {device} (move it with "
                                  ".to(q.device)).")
