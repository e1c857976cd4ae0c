"""jaxattn.jax_core: attention in pure JAX (this package never imports torch).

Implementations register in `AttentionRegistry`; `attention()` selects and runs one (`run_call`
runs an already built `AttentionCall` on its `CallArrays`). Layout is
(B, T, H, D) throughout; bias and masks broadcast to (B, Hq, T, S). `jax_core.calls` holds the
functions the torch API runs through the bridge, in the layouts it passes.
"""

from . import decode as _decode  # noqa: F401  (registers "decode", "autoregressive_decodeattn")
from . import flash as _flash  # noqa: F401  (registers "flash", "flash_attn2")
from . import flash_hopper as _flash_hopper  # noqa: F401  (registers "flash_hopper", "flash_mgpu"; by name only)
from . import sdpa as _sdpa  # noqa: F401  (registers "sdpa", "cudnn")
from . import vanilla as _vanilla  # noqa: F401  (registers "vanilla")
from . import ring as _ring  # noqa: F401  (registers "ring"; chosen when metadata.mesh has the sequence axis)
from .blockwise import blockwise_attn
from .ring import ring_attention
from .base import DECODE_MAX_QUERY_LEN, AttentionImpl, AttentionOutput, Layout, mode_for
from .call import AttentionCall, CallArrays, build_call
from .capabilities import FEATURES, AttentionInputs, Capabilities
from .decode import DecodeAttn, decode_attention
from .dispatch import Implementation, attention, run_call
from .masks import positional_mask
from .metadata import AttentionMetadata, PartitionAxis, backend_of, platform_of
from .registry import MODE_PRIORITIES, PRIORITIES, AttentionRegistry, ImplementationUnavailableError
from .vanilla import reference_attention

__all__ = [
    "AttentionCall", "AttentionImpl", "AttentionInputs", "AttentionMetadata", "AttentionOutput", "AttentionRegistry",
    "Capabilities", "FEATURES", "ImplementationUnavailableError", "Implementation", "Layout", "PRIORITIES", "PartitionAxis", "attention",
    "CallArrays", "backend_of", "build_call", "platform_of", "run_call", "positional_mask", "reference_attention",
    "DECODE_MAX_QUERY_LEN", "DecodeAttn", "MODE_PRIORITIES", "decode_attention", "mode_for",
    "blockwise_attn", "ring_attention",
]
