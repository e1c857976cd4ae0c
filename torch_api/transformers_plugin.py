"""Hugging Face transformers integration: jaxattn as an `attn_implementation`.

    >>> from jaxattn.torch_api import register_transformers
    >>> register_transformers()                         # registers "jaxattn"
    >>> model = AutoModelForCausalLM.from_config(config, attn_implementation="jaxattn")
    >>> model.set_attn_implementation("jaxattn")        # or switch an existing model

`register_transformers` adds two entries under the same name: the attention function to
`transformers.AttentionInterface` and, to `transformers.AttentionMaskInterface`, the mask function
transformers uses for its own "sdpa" (a (B, 1, L, S) boolean mask, True = attend, or None when
`is_causal` alone describes the call). Without the mask entry transformers would build no mask at
all for an unknown implementation, and padding would be attended silently.

What the attention function does with the keyword arguments models pass:
    dropout, scaling, is_causal     as transformers' "sdpa" does.
    softcap (Gemma 2 and others)    logits soft cap, computed by jaxattn (transformers' "sdpa" cannot).
    s_aux (gpt-oss)                 per-head attention sink logits, differentiable.
    sliding_window                  already part of the mask built by the registered mask function;
                                    without a mask and with more keys than the window, the query
                                    positions are unknown and the call raises.
    position_bias (T5, ...)         added to the logits: folded into a float mask with the attention mask
                                    (or causality) as transformers' "sdpa" does; its gradient flows.
    indices (DeepSeek-V3.2, ...)    the keys each query attends to, (B, L, k) int: folded into the mask as
                                    those models do themselves for "eager" and "sdpa".
    deterministic (ModernBERT)      True: run-to-run identical results, forward and backward. On CPU every
                                    implementation is (XLA's CPU backend); on GPUs only the Triton flash
                                    kernels are known to be (no floating-point atomics), so True selects
                                    flash there, and a forced choice without it raises
                                    (`transformers_kwargs.deterministic_choice`).
    position_ids, use_cache, ...    (`NO_EFFECT_KWARGS`) carry nothing the attention needs: positions
                                    are already applied to q/k, and padding and packed sequences are
                                    in the mask.
    sinks, block_indices            (`REFUSED_KWARGS`) raise NotImplementedError saying what they mean:
                                    per-query sink logits (Inkling 2; `s_aux` is per head), block-sparse
                                    selections the model turns into a mask only for "eager"/"sdpa".
    anything else                   raises TypeError naming it, unless its value is None or False.

transformers is an optional dependency (extra `hf`); this module imports it only inside
`register_transformers`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..bridge import jax_op
from ..jax_core import calls
from .autocast import autocast_dtype, autocast_off, cast
from .launch import native_config
from .native_flash import flash_forward, reverse_grad
from .sdpa import scaled_dot_product_attention
from .selection import current_implementation, normalize_choice
from .transformers_kwargs import check_extra_kwargs, deterministic_choice, fold_into_mask, short as _short
from .validation import AttentionInputError, check_finite, check_qkv

DEFAULT_NAME = "jaxattn"

#: Soft cap and/or sinks on (B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev) tensors -> (B, Hq, L, Ev).
_features_jax = jax_op(calls.sdpa_features, name="jaxattn.hf_attention", module=__name__)


def make_attention_function(implementation: Union[None, str, Sequence[str]] = None) -> Callable:
    """The attention function transformers calls for a jaxattn `attn_implementation`.

    Args:
        implementation: the JAX implementation(s) to run (see `scaled_dot_product_attention`);
            None: the `sdpa_implementation` context's choice, else automatic selection.

    Returns:
        `f(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
        sliding_window=None, softcap=None, s_aux=None, position_bias=None, indices=None, deterministic=None,
        **kwargs) -> (output, None)` with query
        (B, Hq, L, E), key (B, Hk, S, E), value (B, Hk, S, Ev), attention_mask None or
        broadcastable to (B, Hq, L, S) (bool, True = attend, or additive float), and output
        (B, L, Hq, Ev), contiguous. Extra keyword arguments follow the module docstring's rules.
    """
    fixed = normalize_choice(implementation) if implementation is not None else None

    def jaxattn_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        dropout: float = 0.0,
        scaling: Optional[float] = None,
        is_causal: Optional[bool] = None,
        sliding_window: Optional[int] = None,
        softcap: Optional[float] = None,
        s_aux: Optional[torch.Tensor] = None,
        position_bias: Optional[torch.Tensor] = None,
        indices: Optional[torch.Tensor] = None,
        deterministic: Optional[bool] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """(B, Hq, L, E), (B, Hk, S, E), (B, Hk, S, Ev), mask None or (B|1, 1|Hq, L, S) -> ((B, L, Hq, Ev), None)."""
        # `kwargs` holds what models pass beyond the named arguments; each one is checked, none is dropped.
        check_extra_kwargs(kwargs, attention_mask)
        if deterministic is not None and not isinstance(deterministic, bool):
            raise AttentionInputError(f"deterministic={deterministic!r}: expected a bool or None.")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise AttentionInputError(f"{name}: expected a (B, H, L, E) tensor, got {_short(t)}.")
        q_len, kv_len = query.shape[2], key.shape[2]
        if sliding_window is not None and attention_mask is None and kv_len > sliding_window:
            raise AttentionInputError(
                f"sliding_window={sliding_window} with attention_mask=None and {kv_len} keys: the window's query "
                "positions are unknown without a mask. Register the jaxattn mask function (register_transformers() "
                "does) so that transformers builds the sliding-window mask, or pass a 4-D mask."
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        # As transformers' sdpa: a mask, when given, already holds causality; one query sees every key.
        causal = bool(causal) and q_len > 1 and attention_mask is None
        if position_bias is not None or indices is not None:
            # As transformers' sdpa: the bias (and a sparse key selection) go into one mask with causality.
            attention_mask = fold_into_mask(query, key, attention_mask, causal, position_bias, indices)
            causal = False
        choice = fixed if fixed is not None else current_implementation()
        if deterministic:
            choice = deterministic_choice(choice, query.device)
        gqa = key.shape[1] != query.shape[1]
        if softcap is None and s_aux is None:
            out = scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
                enable_gqa=gqa, implementation=choice,
            )
        else:
            out = _with_features(query, key, value, attention_mask, s_aux, causal=causal, scale=scaling,
                                 softcap=softcap, dropout_p=dropout, implementation=choice)
        return out.transpose(1, 2).contiguous(), None

    jaxattn_attention_forward.implementation = fixed
    return jaxattn_attention_forward


def _with_features(query, key, value, mask, sinks, *, causal, scale, softcap, dropout_p, implementation):
    """Soft cap and/or sinks on (B, Hq, L, E) / (B, Hk, S, E|Ev) tensors -> (B, Hq, L, Ev)."""
    amp = autocast_dtype(query.device) if isinstance(query, torch.Tensor) else None
    if amp is not None:  # torch's SDPA policy under autocast (autocast.py); sinks keep their dtype
        kind = query.device.type
        with autocast_off(kind):
            return _with_features(*(cast(amp, kind, t) for t in (query, key, value, mask)), sinks, causal=causal,
                                  scale=scale, softcap=softcap, dropout_p=dropout_p, implementation=implementation)
    check_qkv(query, key, value, enable_gqa=True)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise AttentionInputError(f"softcap={softcap!r}: expected a positive float or None.")
    hq = query.shape[1]
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dim() not in (1, 2) or sinks.shape[0] != hq:
            raise AttentionInputError(f"s_aux: expected a (Hq,) or (Hq, n) tensor with Hq={hq}, got {_short(sinks)}.")
        if not sinks.dtype.is_floating_point or sinks.device != query.device:
            raise AttentionInputError(
                f"s_aux: expected a float tensor on {query.device}, got {sinks.dtype} on {sinks.device}."
            )
    if mask is not None:
        want = (query.shape[0], hq, query.shape[2], key.shape[2])
        ok = mask.dim() == 4 and all(m in (1, w) for m, w in zip(mask.shape, want))
        if not ok:
            raise AttentionInputError(
                f"attention_mask: shape {tuple(mask.shape)} does not broadcast to (B, Hq, L, S) = {want}."
            )
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            raise AttentionInputError(
                f"attention_mask: dtype {mask.dtype}; expected bool or the query's {query.dtype} (additive)."
            )
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise AttentionInputError(f"dropout={dropout_p!r}: expected a float in [0, 1).")
    check_finite({"query": query, "key": key, "value": value})
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (2,), dtype=torch.int32, device=query.device)
    native = native_config(tuple(query.shape), tuple(key.shape), value.shape[3], query.dtype, query.device,
                           implementation, causal=causal, softcap=softcap, sinks=sinks is not None,
                           mask=None if mask is None else mask.dtype, dropout_p=dropout_p, scale=scale,
                           grad=reverse_grad(query, key, value, sinks))
    if native is not None:
        is_bool = mask is not None and mask.dtype == torch.bool
        out, _ = flash_forward(query, key, value, native, bias=None if is_bool else mask, mask=mask if is_bool else None,
                               sinks=sinks, seed=seed, need_lse=False)
        return out
    return _features_jax(
        query, key, value, mask, sinks, seed, causal=causal, scale=None if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap), dropout_p=float(dropout_p),
        implementation=implementation, platform="cpu" if query.device.type == "cpu" else "gpu",
    )


def register_transformers(name: str = DEFAULT_NAME, implementation: Union[None, str, Sequence[str]] = None) -> str:
    """Registers jaxattn with transformers as `attn_implementation=name`.

    Adds the attention function (`make_attention_function(implementation)`) to
    `transformers.AttentionInterface` and transformers' own "sdpa" mask function to
    `transformers.AttentionMaskInterface`, both under `name`. Calling it again replaces both.

    Args:
        name: the `attn_implementation` string to register.
        implementation: JAX implementation(s) the function runs; None selects automatically.
            Register several names to compare implementations, e.g.
            `register_transformers("jaxattn_vanilla", "vanilla")`.

    Returns:
        `name`, to pass as `attn_implementation`.

    Raises:
        ImportError: transformers is not installed (the hf extra: `pip install -e ".[hf]"` in the jaxattn
            checkout), or it has no AttentionInterface / AttentionMaskInterface (transformers >= 4.56 has both).
        ValueError: `name` is one of transformers' own implementations or contains "flash" (transformers
            reads such names as flash-attention requests), or `implementation` is unknown.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name={name!r}: expected a non-empty str.")
    try:
        import transformers
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    except ImportError as exc:
        raise ImportError(
            "register_transformers needs transformers with AttentionInterface and AttentionMaskInterface "
            f"(>= 4.56): {exc}. Install it with the hf extra: pip install -e '.[hf]' in the jaxattn checkout."
        ) from exc
    if not hasattr(transformers, "AttentionInterface") or not hasattr(transformers, "AttentionMaskInterface"):
        raise ImportError(
            f"transformers {transformers.__version__} lacks AttentionInterface/AttentionMaskInterface; "
            "upgrade it (pip install -U 'transformers>=4.56', or pip install -e '.[hf]' in the jaxattn "
            "checkout)."
        )
    if name in ("eager", "sdpa", "flex_attention", "paged|eager"):
        raise ValueError(f"name={name!r}: that is one of transformers' own implementations; pick another name.")
    if "flash" in name:
        # transformers.utils.generic.is_flash_attention_requested: any name containing "flash" is taken for
        # flash-attention, and loading a model with it looks for flash-attn or a hub kernel instead of ours.
        raise ValueError(
            f"name={name!r}: transformers treats every attn_implementation containing 'flash' as a request for its "
            "flash-attention kernels (flash-attn or a hub kernel), not for a registered function. Pick a name "
            "without 'flash', e.g. register_transformers('jaxattn_tiled', 'flash')."
        )
    function = make_attention_function(implementation)
    transformers.AttentionInterface.register(name, function)
    transformers.AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name
