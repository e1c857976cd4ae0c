"""jaxattn.torch_api: torch signatures and semantics, computed by jaxattn.jax_core through jaxattn.bridge."""

from .bucketing import current_sequence_buckets, sequence_buckets, set_sequence_buckets
from .decode import decode_attention
from .flash import flash_attention
from .flash_attn_kvcache import flash_attn_with_kvcache
from .kv_cache import KVCache
from .kvcache_call import kvcache_attention
from .launch import current_launcher, sdpa_launcher
from .ring import ring_attention
from .patch import install_sdpa_patch, is_sdpa_patched, patch_sdpa, uninstall_sdpa_patch
from .sdpa import scaled_dot_product_attention
from .selection import current_implementation, sdpa_implementation
from .transformers_plugin import register_transformers
from .validation import AttentionInputError, set_finite_check

__all__ = [
    "AttentionInputError", "KVCache", "current_implementation", "ring_attention", "decode_attention", "flash_attention", "flash_attn_with_kvcache", "kvcache_attention", "scaled_dot_product_attention", "sdpa_implementation",
    "set_finite_check", "sdpa_launcher", "current_launcher",
    "current_sequence_buckets", "sequence_buckets", "set_sequence_buckets",
    "install_sdpa_patch", "is_sdpa_patched", "patch_sdpa", "register_transformers", "uninstall_sdpa_patch",
]
