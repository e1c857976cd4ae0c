"""flash-attn 2's public functions over jaxattn, for `from jaxattn.flash_attn_interface import ...`
(the code lives in `jaxattn.torch_api.flash_attn_interface`; see its docstring)."""

from .torch_api.flash_attn_interface import *  # noqa: F401,F403 (the re-export is this module's purpose)
from .torch_api.flash_attn_interface import __all__  # noqa: F401
