"""jaxattn.torch_api: torch signatures and semantics, computed by jaxattn.jax_core through jaxattn.bridge."""

from .flash import flash_attention
from .sdpa import scaled_dot_product_attention
from .selection import current_implementation, sdpa_implementation
from .validation import AttentionInputError, set_finite_check

__all__ = [
    "AttentionInputError", "current_implementation", "flash_attention", "scaled_dot_product_attention", "sdpa_implementation",
    "set_finite_check",
]
