"""Which launcher runs a call: jaxattn's Triton kernels from torch ("native"), or the XLA bridge.

    >>> from jaxattn.torch_api import sdpa_launcher
    >>> with sdpa_launcher("xla"):       # JAX-launched executables (parity work against a JAX model)
    ...     out = scaled_dot_product_attention(q, k, v)
    >>> with sdpa_launcher("native"):    # only the Triton kernels launched from torch; raises otherwise
    ...     out = scaled_dot_product_attention(q, k, v)

"auto" (the default) runs the `flash` kernels natively on CUDA wherever automatic selection would
run them through JAX, and in place of the XLA paths where the native launch measured faster
(`prefer_native`). The native launcher runs on CUDA tensors, and on CPU tensors under Triton's
interpreter (TRITON_INTERPRET=1, for tests), with no XLA executable on the call path. Everything
JAX composes (cuDNN through `jax.nn`, ring, vanilla, TPU, CPU) stays on the XLA bridge.
`decode_attention` follows the same launchers with its own kernels (`native_decode`): "auto" runs
them natively on CUDA for calls without gradients.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Literal, Optional

import torch

from ..bridge.triton_launch import can_launch, interpreted
from ..jax_core import AttentionCall, AttentionInputs, AttentionRegistry
from ..jax_core.flash import FlashAttn
from ..jax_core.kernels.flash_plan import FlashConfig
from ..jax_core.visibility import Visibility
from .hopper_flash import HOPPER_MIN_LENGTH, hopper_launch_reasons

Launcher = Literal["auto", "native", "xla"]
LAUNCHERS = ("auto", "native", "xla")

#: Implementations whose kernels the native launcher runs.
NATIVE_IMPLEMENTATIONS = ("flash", "flash_attn2")

#: Automatic selection on CUDA keeps JAX's cuDNN (through the XLA bridge) only where its faster
#: kernel outweighs the XLA runtime's per-call host cost (about 0.3 ms forward, 1 ms forward +
#: backward, H100): head dims 65-128 with at least this many (query, key) pairs per (batch, head)
#: times batch * heads. At head dim 64 JAX's cuDNN ran at half of torch's (121 vs 239 TFLOP/s at
#: (16, 16, 1024, 64) causal) and below our kernel, so the native flash kernel runs there.
XLA_CUDNN_MIN_WORK = 2 * 16 * 8192 * 8192
#: Decoding calls (few queries against a cache) go to the native flash kernel up to this many
#: keys; beyond it the split-K decode kernel's bandwidth outweighs the XLA runtime's host cost.
NATIVE_DECODE_MAX_KEYS = 16384


#: Why no native launch runs under torch.func transforms (the XLA path's ops carry functorch's rules).
FUNCTORCH_REASON = ("a torch.func transform (grad, vjp, jacrev, vmap) is active, and the Triton kernels implement "
                    "none of its rules (sdpa_launcher('xla') or 'auto' runs such calls)")


class _ThreadLaunchers(threading.local):
    def __init__(self) -> None:
        self.stack: list[str] = ["auto"]


_current = _ThreadLaunchers()


def check_launcher(launcher: str, argument: str = "launcher") -> str:
    if launcher not in LAUNCHERS:
        raise ValueError(f"{argument}={launcher!r}: expected one of {LAUNCHERS} ('auto': native Triton launch where "
                         "it is faster, 'native': only that, 'xla': the JAX-launched executables).")
    return launcher


def current_launcher() -> str:
    """The innermost `sdpa_launcher` block's launcher ("auto" outside any)."""
    return _current.stack[-1]


@contextlib.contextmanager
def sdpa_launcher(launcher: Launcher) -> Iterator[None]:
    """Within the block, calls of this thread use `launcher` ("auto", "native" or "xla")."""
    stack = _current.stack
    stack.append(check_launcher(launcher))
    try:
        yield
    finally:
        stack.pop()


def describe(q_shape, k_shape, value_head_dim: int, dtype: torch.dtype, features: set) -> AttentionInputs:
    """A call on (B, Hq, L, E) / (B, Hk, S, E) / (B, Hk, S, Ev) tensors as a CUDA call of jax_core's
    vocabulary (what the Triton kernels are asked for, wherever they run)."""
    (b, hq, l, e), (hk, s) = q_shape, (k_shape[1], k_shape[2])
    return AttentionInputs(
        batch=b, q_len=l, kv_len=s, num_q_heads=hq, num_kv_heads=hk, head_dim=e, value_head_dim=value_head_dim,
        dtype=str(dtype).removeprefix("torch."), platform="gpu", backend="cuda",
        features=frozenset(set(features) | ({"gqa"} if hk != hq else set())),
    )


def native_reasons(inputs: AttentionInputs, device: torch.device) -> list[str]:
    """Why the native launcher cannot run `inputs` on `device` (empty when it can)."""
    reasons = [FUNCTORCH_REASON] if torch._C._are_functorch_transforms_active() else []
    if not can_launch(device):
        where = "a CUDA device with Triton installed" if device.type != "cpu" else "TRITON_INTERPRET=1 on CPU"
        reasons.append(f"the native launcher needs {where} (device {device})")
    if inputs.num_q_heads % inputs.num_kv_heads:
        reasons.append(f"num_q_heads={inputs.num_q_heads} is not a multiple of num_kv_heads={inputs.num_kv_heads}")
    return reasons + FlashAttn.triton_kernel_reasons(inputs)


def prefer_native(inputs: AttentionInputs) -> bool:
    """Automatic selection on CUDA: whether the native flash launch beats the XLA path's choice."""
    d = max(inputs.head_dim, inputs.value_head_dim)
    if inputs.q_len <= 16 and inputs.kv_len > inputs.q_len:  # decoding
        return inputs.kv_len <= NATIVE_DECODE_MAX_KEYS
    work = inputs.batch * inputs.num_q_heads * inputs.q_len * inputs.kv_len
    return not (64 < d <= 128 and work >= XLA_CUDNN_MIN_WORK)


def use_native(inputs: AttentionInputs, device: torch.device, choice, launcher: str, *,
               grad: Optional[bool] = None) -> bool:
    """Whether a call described by `inputs` (see `describe`) runs by the native launcher.

    Args:
        choice: None (automatic), a name or a tuple of names (`selection.normalize_choice`).
        launcher: "auto", "native" or "xla".
        grad: whether the call needs gradients; None when unknown (taken as maybe).

    Raises:
        ValueError: launcher "native" and the call cannot run natively (with the reasons).
    """
    return native_decision(inputs, device, choice, launcher, grad=grad)[0]


def native_decision(inputs: AttentionInputs, device: torch.device, choice, launcher: str, *,
                    grad: Optional[bool] = None) -> tuple[bool, str]:
    """`use_native`'s answer and why (the same decision; `explain_choice` prints it)."""
    if launcher == "xla":
        return False, "sdpa_launcher('xla') is active"
    names = (choice,) if isinstance(choice, str) else choice
    wanted = names is None or names[0] in NATIVE_IMPLEMENTATIONS
    reasons = native_reasons(inputs, device) if wanted else [
        f"implementation={choice!r} runs through JAX (the native launcher runs {NATIVE_IMPLEMENTATIONS})"]
    if launcher == "native":
        if reasons:
            raise ValueError("sdpa_launcher('native') cannot run this call: " + "; ".join(reasons) + ".")
        return True, "sdpa_launcher('native') is active"
    if reasons:
        return False, "the native launcher cannot run it: " + "; ".join(reasons)
    if device.type != "cuda":
        return False, f"automatic launch runs natively only on CUDA (device {device})"
    if names is not None:  # flash asked for by name
        return True, f"implementation={choice!r} asked for by name runs the Triton kernels"
    # Automatic: where the XLA path would run flash anyway, or where native measured faster.
    if prefer_native(inputs):
        decoding = inputs.q_len <= 16 and inputs.kv_len > inputs.q_len
        return True, (f"a decoding call with S={inputs.kv_len} <= {NATIVE_DECODE_MAX_KEYS} keys: one native launch "
                      "beats the XLA path's host cost" if decoding else
                      "our flash kernel measured faster than the XLA path's choice at this size and head dim")
    if grad is not None and not hopper_launch_reasons(inputs, device, grad=grad):
        kind = "train" if grad else "forward"
        return True, (f"the Hopper kernels{' with gradients' if grad else ' (no gradients)'} measured faster than "
                      f"the XLA path's cuDNN here (sm90, L and S >= {HOPPER_MIN_LENGTH[kind]})")
    xla = _xla_choice(inputs)
    if xla in NATIVE_IMPLEMENTATIONS:
        return True, "the XLA path would run flash too; the native launch skips its host cost"
    if inputs.q_len <= 16 and inputs.kv_len > inputs.q_len:
        return False, f"a decoding call over {NATIVE_DECODE_MAX_KEYS} keys: the XLA path's {xla} reads the cache faster"
    return False, f"the XLA path's {xla} measured faster here (head dim 65-128, B*H*L*S >= {XLA_CUDNN_MIN_WORK})"


def _xla_choice(inputs: AttentionInputs) -> Optional[str]:
    try:
        return AttentionRegistry.select(inputs).canonical_name()
    except (ValueError, NotImplementedError):
        return None


def native_config(q_shape, k_shape, value_head_dim: int, dtype: torch.dtype, device: torch.device, choice, *,
                  causal: bool = False, bottom_right: bool = False, window: Optional[tuple[int, int]] = None,
                  softcap: Optional[float] = None, sinks: bool = False, mask: Optional[torch.dtype] = None,
                  dropout_p: float = 0.0, lse: bool = False, scale: Optional[float] = None, segments: bool = False,
                  varlen: Optional[tuple[int, int]] = None, alibi: bool = False,
                  grad: Optional[bool] = None) -> Optional[FlashConfig]:
    """The flash kernels' settings when the native launcher runs a (B, Hq, L, E) / (B, Hk, S, E) call,
    else None (the XLA bridge runs it).

    Args:
        bottom_right: causal / window aligned bottom-right (diagonal offset S - L).
        mask: None, or the dtype of the call's mask (bool: a bool mask; else an additive bias).
        segments: the call has segment ids.
        varlen: (max_seqlen_q, max_seqlen_k) of a packed (varlen) call, else None; q_shape and
            k_shape are then (1, H, total, D).
        alibi: the call has ALiBi slopes.
        grad: whether the call needs gradients (a prepared call knows; None: unknown, taken as maybe).
            Only a long call's automatic choice depends on it (`native_decision`); decoding's memo
            below leaves it out.
        Others: the call's options; `choice` and the current `sdpa_launcher` as in `use_native`.

    The options become one `AttentionCall` (`_call`), whose `flash_config` gives the settings: the
    ones the JAX launch of the same call gives the kernels.
    """
    symbolic = False
    sizes = (*q_shape, *k_shape, value_head_dim)
    if not all(type(n) is int for n in sizes):
        # Under torch.jit.trace a tensor's sizes come as 0-d tensors: the settings take ints. Symbolic
        # sizes (torch.compile(dynamic=True)) stay symbolic, but are not hashable: no memo for them.
        if any(isinstance(n, torch.Tensor) for n in sizes):
            q_shape, k_shape, value_head_dim = tuple(map(int, q_shape)), tuple(map(int, k_shape)), int(value_head_dim)
        symbolic = any(isinstance(n, torch.SymInt) for n in (*q_shape, *k_shape, value_head_dim))
    l, s = q_shape[2], k_shape[2]
    # A decoding call's settings do not depend on its key length (a new one each step of a
    # growing cache) unless it is aligned bottom-right (diagonal offset S - L): memoized without it.
    memo = None
    # Under torch.compile no memo is read: Dynamo would guard the graph on the memo's contents (a
    # miss at trace time, a hit at the next call: one needless recompilation per signature).
    if (not symbolic and not torch.compiler.is_compiling() and l <= 16 < s <= NATIVE_DECODE_MAX_KEYS
            and not bottom_right and not segments and varlen is None and not alibi
            and not torch._C._are_functorch_transforms_active()):
        memo = (tuple(q_shape), tuple(k_shape[:2]), k_shape[3], value_head_dim, dtype, device, choice,
                current_launcher(), interpreted(), NATIVE_DECODE_MAX_KEYS, causal, window, softcap, sinks, mask,
                dropout_p, lse, scale)
        if memo in _DECODE_CONFIGS:
            return _DECODE_CONFIGS[memo]
    call = _call(causal=causal, bottom_right=bottom_right, window=window, softcap=softcap, dropout_p=dropout_p,
                 lse=lse, scale=scale, varlen=varlen, device=device)
    config = _native_config(q_shape, k_shape, value_head_dim, dtype, device, choice, call, sinks=sinks, mask=mask,
                            segments=segments, varlen=varlen is not None, alibi=alibi, grad=grad)
    if memo is not None:
        _keep(_DECODE_CONFIGS, memo, config)
    return config


def _keep(cache: dict, key, value) -> None:
    """cache[key] = value in a memo of at most 1024 entries (emptied when full: the keys are per
    signature, so a program that fills it is not reusing them anyway)."""
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = value


_DECODE_CONFIGS: dict = {}

#: The jax_core backend of a torch device the native launcher runs on (CUDA, or CPU interpreted).
_DEVICE_BACKENDS = {"cuda": "cuda", "cpu": "cpu"}


def _call(*, causal, bottom_right, window, softcap, dropout_p, lse, scale, varlen,
          device: Optional[torch.device] = None) -> AttentionCall:
    """The jax_core call of a torch call with these options (see `native_config`): (B, H, T, D)
    tensors ("BHTD"), the backend of `device` (None: no device, for features only).

    Sizes and numbers stay as given (a symbolic max_seqlen or scale is not specialized here);
    `AttentionCall.flash_config` turns them into the kernels' ints and floats.
    """
    backend = None if device is None else _DEVICE_BACKENDS.get(device.type)
    key = (causal, bottom_right, window, softcap, dropout_p, lse, scale, varlen, backend)
    # A decoding loop asks for the same options every step: build each call once. Not under
    # torch.compile, which would guard the graph on the memo's contents (see `native_config`).
    if torch.compiler.is_compiling():
        key = None
    try:
        found = None if key is None else _CALLS.get(key)
    except TypeError:  # unhashable options (a list): not kept
        found = key = None
    if found is not None:
        return found
    call = AttentionCall(
        visibility=Visibility.of(bool(causal), "bottom_right" if bottom_right else "top_left", window),
        logits_soft_cap=softcap,
        scale=scale,
        dropout_prob=float(dropout_p),
        return_lse=bool(lse),
        layout="BHTD",
        max_seqlen=None if varlen is None else tuple(varlen),
        backend=backend,
    )
    if key is not None:
        _keep(_CALLS, key, call)
    return call


_CALLS: dict = {}


def _native_config(q_shape, k_shape, value_head_dim, dtype, device, choice, call: AttentionCall, *, sinks, mask,
                   segments, varlen: bool, alibi, grad: Optional[bool]) -> Optional[FlashConfig]:
    l, s = q_shape[2], k_shape[2]
    features = _features(call, l, s, sinks=sinks, mask=mask, segments=segments, varlen=varlen, alibi=alibi)
    if not use_native(describe(q_shape, k_shape, value_head_dim, dtype, features), device, choice, current_launcher(),
                      grad=grad):
        return None
    return call.flash_config(l, s, q_shape[3], packed=varlen)


def call_features(l: int, s: int, *, causal: bool = False, bottom_right: bool = False,
                  window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None, sinks: bool = False,
                  mask: Optional[torch.dtype] = None, dropout_p: float = 0.0, lse: bool = False,
                  segments: bool = False, varlen: Optional[tuple[int, int]] = None, alibi: bool = False) -> set:
    """jax_core's feature names of a (L queries, S keys) call with these options (see `native_config`)."""
    call = _call(causal=causal, bottom_right=bottom_right, window=window, softcap=softcap, dropout_p=dropout_p,
                 lse=lse, scale=None, varlen=varlen)
    return _features(call, l, s, sinks=sinks, mask=mask, segments=segments, varlen=varlen is not None, alibi=alibi)


def _features(call: AttentionCall, l, s, *, sinks: bool, mask: Optional[torch.dtype], segments: bool, varlen: bool,
              alibi: bool) -> set:
    """The features of `call` on L queries and S keys, with the arrays the flags say are present."""
    features = set(call.visibility.features(l, s, varlen=varlen))
    if mask is not None:
        features.add("bool_mask" if mask == torch.bool else "bias")
    for name, on in (("softcap", call.logits_soft_cap is not None), ("sinks", sinks),
                     ("dropout", call.dropout_prob > 0), ("lse", call.return_lse), ("segment_ids", segments),
                     ("varlen", varlen), ("alibi", alibi)):
        if on:
            features.add(name)
    return features
