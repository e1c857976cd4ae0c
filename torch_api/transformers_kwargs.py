"""The keyword arguments transformers' models pass to an attention function, as the jaxattn plug-in treats them.

Three kinds: arguments that carry nothing the attention needs (`NO_EFFECT_KWARGS`), arguments that
transformers' own "sdpa" folds into the float mask (`position_bias`, `indices`; folded the same way here
by `fold_into_mask`), and arguments whose meaning jaxattn cannot compute (`REFUSED_KWARGS`, each with what
it means, raised as NotImplementedError). Anything else raises TypeError, unless its value is None or False.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .selection import Choice
from .validation import AttentionInputError

#: Keyword arguments transformers' models pass to attention functions that need no handling here.
NO_EFFECT_KWARGS = frozenset({
    "position_ids",  # rotary positions are applied to q/k before the call
    "cache_position", "past_key_values", "past_key_value", "use_cache",  # the cache is updated before the call
    "output_hidden_states", "return_dict", "num_items_in_batch", "output_router_logits",
    # flash-attn's description of packed sequences; the mask function derives the same packing from
    # position_ids, so they are accepted only together with a mask (checked below)
    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
})
_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")

#: Arguments some models pass whose effect jaxattn does not compute, and what they mean.
REFUSED_KWARGS = {
    # Inkling 2: one extra logit per (batch, head, query) with a zero value, computed from the hidden
    # states. Not `s_aux`, which is one learned logit per head; jaxattn's sinks are per head only.
    "sinks": "per-query attention sink logits of shape (B, Hq, L, 1) (Inkling 2); jaxattn supports per-head "
             "sinks only (`s_aux`, shape (Hq,))",
    # MiniMax-M3-VL: block-sparse attention; for "eager"/"sdpa" the model turns the selected blocks into
    # the mask itself, for any other implementation it leaves the mask without them.
    "block_indices": "the key blocks each query attends to (MiniMax-M3 block-sparse attention); the model builds "
                     "the matching mask only for attn_implementation 'eager' or 'sdpa', so use one of those",
}

#: Implementations whose forward and backward are run-to-run deterministic on CUDA: the Triton flash
#: kernels write dQ, dK, dV (and the bias gradient) from one program each, with no floating-point atomics.
DETERMINISTIC_ON_GPU = ("flash", "flash_attn2")


def check_extra_kwargs(kwargs: dict[str, Any], attention_mask: Optional[torch.Tensor]) -> None:
    """Raises for keyword arguments whose meaning the jaxattn attention function would lose."""
    for name, value in kwargs.items():
        if name in NO_EFFECT_KWARGS or value is None or value is False:
            continue
        if name == "output_attentions":
            raise NotImplementedError(
                "output_attentions=True: the jaxattn attention function does not return attention weights "
                "(load the model with attn_implementation='eager' to get them)."
            )
        if name in REFUSED_KWARGS:
            raise NotImplementedError(
                f"{name}={short(value)}: {REFUSED_KWARGS[name]}. jaxattn cannot compute it; load the model with "
                "attn_implementation='eager'."
            )
        raise TypeError(
            f"{name}={short(value)}: the jaxattn attention function does not support this keyword argument "
            "(its meaning would be lost); use attn_implementation='eager' or 'sdpa' for this model, or ask for "
            "the feature in jaxattn."
        )
    if attention_mask is None and any(kwargs.get(n) is not None for n in _PACKING_KWARGS):
        raise AttentionInputError(
            "cu_seq_lens_q/cu_seq_lens_k: packed sequences without an attention mask; the jaxattn attention "
            "function takes packing from the mask its registered mask function builds (from position_ids). "
            "Register both with register_transformers() and pass position_ids."
        )


def short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}, dtype {value.dtype}>"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def fold_into_mask(query: torch.Tensor, key: torch.Tensor, mask: Optional[torch.Tensor], causal: bool,
                   position_bias: Optional[torch.Tensor], indices: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`mask` with the key selection `indices` and the additive `position_bias` folded in, as transformers does.

    query (B, Hq, L, E), key (B, Hk, S, E); mask None or (B|1, 1|Hq, L, S) bool or additive float;
    `causal` says whether a None mask means top-left causal. indices (B, L, k) int: the keys each query
    attends to (DeepSeek-V3.2's sparse attention; negative entries select nothing), folded like the model does
    for "sdpa". position_bias broadcastable to (B, Hq, L, S), float: added to the logits like
    transformers' `create_position_bias_mask` (keys the mask hides get the dtype's minimum), so the bias
    keeps its gradient. Returns None only when both are None and mask is None.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if (indices is not None or position_bias is not None) and mask is None and causal:
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if indices is not None:
        mask = _fold_indices(indices, mask, query, kv_len)
    if position_bias is None:
        return mask
    want = (query.shape[0], query.shape[1], q_len, kv_len)
    if not isinstance(position_bias, torch.Tensor) or position_bias.dim() != 4 or not all(
            b in (1, w) for b, w in zip(position_bias.shape, want)):
        raise AttentionInputError(
            f"position_bias={short(position_bias)}: expected a float tensor broadcastable to (B, Hq, L, S) = {want}; "
            "it is added to the attention logits."
        )
    if not position_bias.dtype.is_floating_point:
        raise AttentionInputError(
            f"position_bias: dtype {position_bias.dtype}; expected a float dtype (the query's, {query.dtype})."
        )
    if mask is None:
        return position_bias.contiguous()
    if mask.dtype == torch.bool:
        return torch.where(mask, position_bias, torch.finfo(key.dtype).min).contiguous()
    return (position_bias + mask).contiguous()


def _fold_indices(indices: Any, mask: Optional[torch.Tensor], query: torch.Tensor, kv_len: int) -> torch.Tensor:
    batch, q_len = query.shape[0], query.shape[2]
    if (not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.shape[1] != q_len
            or indices.shape[0] not in (1, batch) or indices.dtype.is_floating_point or indices.dtype == torch.bool):
        raise AttentionInputError(
            f"indices={short(indices)}: expected an integer tensor (B, L, k) with B={batch}, L={q_len}: the keys "
            "each query attends to (sparse attention)."
        )
    # A slot past the last key collects the negative ("nothing selected") entries and is dropped.
    if indices.numel() and int(indices.max()) >= kv_len:
        raise AttentionInputError(
            f"indices: entry {int(indices.max())} is not below the number of keys, {kv_len}; expected key positions "
            "(negative for none)."
        )
    slots = torch.where(indices < 0, kv_len, indices).long()
    keep = torch.zeros(*indices.shape[:2], kv_len + 1, dtype=torch.bool, device=query.device)
    keep = keep.scatter(-1, slots, True)[..., :kv_len].unsqueeze(1)  # (B, 1, L, S)
    if mask is None:
        return keep
    if mask.dtype == torch.bool:
        return mask & keep
    return mask.masked_fill(~keep, torch.finfo(mask.dtype).min)


def deterministic_choice(choice: Choice, device: torch.device) -> Choice:
    """The implementation choice honouring `deterministic=True` on `device`.

    On CPU every implementation runs through XLA's CPU backend, deterministic run to run: `choice` is kept.
    Elsewhere only the Triton flash kernels are known deterministic (`DETERMINISTIC_ON_GPU`): cuDNN's fused
    attention backward (`sdpa` on CUDA) accumulates dQ with atomics, and the XLA paths' order of floating
    point reductions is not guaranteed across runs. None selects flash; a choice naming no deterministic
    implementation raises.
    """
    if device.type == "cpu":
        return choice
    if choice is None:
        return DETERMINISTIC_ON_GPU[0]
    names = (choice,) if isinstance(choice, str) else choice
    kept = tuple(n for n in names if n in DETERMINISTIC_ON_GPU)
    if not kept:
        raise AttentionInputError(
            f"deterministic=True with implementation={choice!r} on {device}: no deterministic implementation among "
            f"them; on GPUs only {DETERMINISTIC_ON_GPU[0]!r} (jaxattn's Triton kernels, no floating-point atomics) is. "
            "Register the plug-in with implementation='flash' or None."
        )
    return kept if len(kept) > 1 else kept[0]
