"""`flash_hopper` (alias `flash_mgpu`): the FlashAttention-3-style Hopper kernels for JAX callers.

Runs the Pallas Mosaic GPU kernels of `kernels/flash_fwd_mgpu.py` (forward: out and the natural-log
LSE) and `kernels/flash_bwd_mgpu.py` (backward: dQ, dK, dV in one kernel) as one differentiable
function, `flash_hopper_attention`, with the tiles tuned per head dim and length (`calls.hopper_tiles`).

Where: CUDA on an sm90 (Hopper) GPU, bf16/fp16, head dims 64, 128 and 256 (equal q/k and v head dims), any lengths, GQA, causal in both alignments, sliding windows, a logits
soft cap, one sink logit per query head, the LSE and gradients (the sinks' included). It is not in
the automatic selection order (`registry.PRIORITIES`): it runs when asked for by name. Tests pass `interpret=` (Mosaic GPU's
interpret-mode parameters) to `flash_hopper_attention` to run the same kernels on a CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from .base import AttentionImpl, AttentionOutput
from .call import AttentionCall, CallArrays
from .capabilities import AttentionInputs, Capabilities, device_multiprocessors
from .kernels.flash_mgpu_checks import BACKWARD_HEAD_DIMS, FORWARD_HEAD_DIMS
from .metadata import AttentionMetadata
from .registry import AttentionRegistry

_FEATURES = frozenset({"causal", "causal_bottom_right", "gqa", "sliding_window", "softcap", "sinks", "lse",
                       "backward"})


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The kernels' static settings (hashable: a non-differentiable argument of the custom VJP)."""
    scale: float
    causal: bool
    diag_offset: int
    window: Optional[tuple[int, int]]
    softcap: Optional[float]
    interpret: Any

    def kernel_keywords(self, head_dim: int, kv_len: int, which: str) -> dict:
        from .calls import hopper_tiles  # calls imports the dispatch machinery: import it when running

        return dict(scale=self.scale, causal=self.causal, diag_offset=self.diag_offset, window=self.window,
                    softcap=self.softcap, interpret=self.interpret, **hopper_tiles(which, head_dim, kv_len))


def flash_hopper_attention(q, k, v, sinks=None, *, scale: float, causal: bool = False, diag_offset: int = 0,
                           window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
                           interpret: Any = None) -> tuple[jax.Array, jax.Array]:
    """(out (B, L, Hq, D) in q's dtype, lse (B, Hq, L) float32 natural log) of the Hopper kernels on
    q (B, L, Hq, D), k and v (B, S, Hk, D), differentiable in q, k, v and `sinks` ((Hq,) float32 or
    None). Query i sees keys i + diag_offset - left <= j <= i + diag_offset + right, with
    `window` = (left, right) (-1: unbounded side; None: no window) and right = 0 when `causal`.
    `interpret`: Mosaic GPU interpret-mode parameters to run on a CPU; None compiles for the GPU."""
    settings = _Settings(scale=float(scale), causal=bool(causal), diag_offset=int(diag_offset),
                         window=None if window is None else tuple(window),
                         softcap=None if softcap is None else float(softcap), interpret=interpret)
    return _attention(q, k, v, sinks, settings)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, sinks, settings: _Settings):
    return _forward(q, k, v, sinks, settings)


def _forward(q, k, v, sinks, settings: _Settings):
    from .calls import hopper_forward_programs
    from .kernels.flash_fwd_mgpu import flash_forward_mgpu

    # On the GPU a persistent grid; interpreted, one program per tile.
    programs = None if settings.interpret is not None else hopper_forward_programs(device_multiprocessors(0))
    return flash_forward_mgpu(q, k, v, sinks=sinks, programs=programs,
                              **settings.kernel_keywords(q.shape[-1], k.shape[1], "forward"))


def _vjp_forward(q, k, v, sinks, settings: _Settings):
    out, lse = _forward(q, k, v, sinks, settings)
    return (out, lse), (q, k, v, sinks, out, lse)


def _vjp_backward(settings: _Settings, residuals, cotangents):
    from .calls import hopper_backward_cluster, hopper_backward_programs, hopper_head_splits, hopper_padded_lengths
    from .kernels.flash_bwd_mgpu import backward_operands, flash_backward_mgpu, sinks_gradient

    q, k, v, sinks, out, lse = residuals
    dout, dlse = cotangents
    dout = dout.astype(q.dtype)
    lse_log2, delta = backward_operands(out, dout, lse)
    # d lse / d logit is the probability, so an LSE cotangent enters dS = P (dP - delta) as -dlse.
    delta = delta - dlse
    keys = hopper_padded_lengths(q.shape[1], k.shape[1], q.shape[-1], backward=True)[1]
    # On the GPU a persistent grid, as the forward's; interpreted, one program per key block.
    programs = None if settings.interpret is not None else hopper_backward_programs(device_multiprocessors(0))
    splits = hopper_head_splits(q.shape[0], q.shape[2], k.shape[2], keys, q.shape[-1], persistent=programs is not None)
    rows = hopper_padded_lengths(q.shape[1], k.shape[1], q.shape[-1], backward=True)[0]
    cluster = hopper_backward_cluster(q.shape[0], q.shape[2], k.shape[0], k.shape[2], rows, keys, q.shape[-1], splits,
                                      programs)
    dq, dk, dv = flash_backward_mgpu(q, k, v, dout, lse_log2, delta, jnp.zeros(q.shape, jnp.float32),
                                     head_splits=splits, programs=programs, cluster=cluster,
                                     **settings.kernel_keywords(q.shape[-1], k.shape[1], "backward"))
    dsinks = None if sinks is None else sinks_gradient(sinks, lse, delta).astype(sinks.dtype)
    return dq.astype(q.dtype), dk, dv, dsinks


_attention.defvjp(_vjp_forward, _vjp_backward)


@functools.lru_cache(maxsize=None)
def _mosaic_gpu_import_error() -> Optional[str]:
    """Why Pallas Mosaic GPU cannot be imported here (None when it can)."""
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception as exc:  # an older jax, or a missing dependency of Mosaic GPU (absl-py)
        return f"{type(exc).__name__}: {exc}"
    return None


@AttentionRegistry.register
class FlashHopper(AttentionImpl):
    """The Pallas Mosaic GPU flash kernels on Hopper; see the module docstring."""

    capabilities = Capabilities(platforms=frozenset({"gpu"}), dtypes=frozenset({"float16", "bfloat16"}),
                                features=_FEATURES, max_head_dim=max(FORWARD_HEAD_DIMS))
    layouts = frozenset({"BTHD", "BHTD"})

    @classmethod
    def get_impl_name(cls) -> tuple[str, ...]:
        return ("flash_hopper", "flash_mgpu")

    @classmethod
    def extra_reasons(cls, inputs: AttentionInputs, metadata: AttentionMetadata) -> list[str]:
        reasons = []
        if inputs.backend != "cuda":
            reasons.append(f"backend {inputs.backend!r}: the Hopper kernels are Pallas Mosaic GPU, NVIDIA CUDA "
                           "only (use 'flash' or 'sdpa' elsewhere)")
        if inputs.head_dim not in FORWARD_HEAD_DIMS:
            reasons.append(f"head_dim={inputs.head_dim}: the Hopper kernels take head dims {FORWARD_HEAD_DIMS} only "
                           "(use 'flash' for others)")
        elif "backward" in inputs.features and inputs.head_dim not in BACKWARD_HEAD_DIMS:
            reasons.append(f"head_dim={inputs.head_dim} with gradients: the Hopper backward takes head dims "
                           f"{BACKWARD_HEAD_DIMS} only (use 'flash' to train at head dim {inputs.head_dim})")
        if inputs.value_head_dim != inputs.head_dim:
            reasons.append(f"value_head_dim={inputs.value_head_dim} != head_dim={inputs.head_dim}: the Hopper "
                           "kernels need equal head dims")
        if metadata.mesh is not None:
            reasons.append("flash_hopper does not run under a mesh (use 'ring', 'sdpa' or 'vanilla')")
        if inputs.backend == "cuda":
            error = _mosaic_gpu_import_error()
            if error is not None:
                reasons.append(f"Pallas Mosaic GPU cannot be imported ({error}); hint: jax >= 0.10.2 with absl-py")
            if jax.default_backend() == "gpu":
                capability = getattr(jax.devices()[0], "compute_capability", None)
                if capability != "9.0":
                    reasons.append(f"GPU compute capability {capability!r}: the Hopper kernels (wgmma, TMA) need "
                                   "'9.0' (H100, H200); use 'flash' on other GPUs")
        return reasons

    def compute(self, call: AttentionCall, arrays: CallArrays) -> AttentionOutput:
        aux = arrays.softmax_aux
        if aux is not None and aux.ndim != 1:
            raise ValueError(f"softmax_aux of shape {aux.shape}: flash_hopper expected one sink logit per query "
                             "head, shape (Hq,); hint: merge several sinks per head by logsumexp over the last axis")
        dtype = jnp.dtype(self.metadata.runtime_dtype) if self.metadata.runtime_dtype else arrays.query.dtype
        swap = call.layout == "BHTD"  # the kernels take (B, T, H, D)
        q, k, v = (jnp.swapaxes(x, 1, 2) if swap else x for x in (x.astype(dtype) for x in arrays.qkv))
        cfg = call.flash_config(q.shape[1], k.shape[1], q.shape[-1])
        window = None if tuple(cfg.window) == (-1, -1) else tuple(cfg.window)
        out, lse = flash_hopper_attention(q, k, v, None if aux is None else aux.astype(jnp.float32),
                                          scale=cfg.scale, causal=cfg.causal, diag_offset=cfg.diag_offset,
                                          window=window, softcap=cfg.softcap, interpret=None)
        return AttentionOutput(attention_outputs=jnp.swapaxes(out, 1, 2) if swap else out, lse=lse)
