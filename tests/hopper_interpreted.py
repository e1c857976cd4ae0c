"""The Hopper flash kernels of `torch_api.hopper_flash` on CPU tensors, in Mosaic GPU's interpret mode:
`use_interpreted_kernels(monkeypatch)` puts `InterpretedKernel`s in place of its `MosaicKernel`s."""

import numpy as np
import torch

from jaxattn.bridge.mosaic_launch import MosaicKernel
from jaxattn.jax_core import calls
from jaxattn.torch_api import hopper_flash


class InterpretedKernel(MosaicKernel):
    """A `MosaicKernel` of `calls.flash_hopper` (`which` = "forward") or `calls.flash_hopper_backward`
    whose launch runs the same kernel entry and tiles interpreted on CPU tensors (its shapes-only
    answers are the real class's: `jax.eval_shape` of the same function)."""

    def __init__(self, which: str):
        super().__init__(calls.flash_hopper if which == "forward" else calls.flash_hopper_backward)
        self.which = which

    def launch(self, tensors, static):
        import jax.numpy as jnp
        from jaxattn.jax_core.kernels.flash_bwd_mgpu import flash_backward_mgpu_tiles
        from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu_tiles
        from mosaic_gpu_mode import interpret_params

        dtype = {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32}
        arrays = [jnp.asarray(t.contiguous().float().numpy(), dtype[t.dtype]) for t in tensors]
        fn = flash_forward_mgpu_tiles if self.which == "forward" else flash_backward_mgpu_tiles
        extra = dict(sinks=arrays.pop()) if self.which == "forward" and len(arrays) == 4 else {}
        results = fn(*arrays, **static, **extra, **calls.hopper_tiles(self.which, arrays[0].shape[-1], arrays[1].shape[1]),
                     interpret=interpret_params())
        back = {jnp.dtype(jnp.float16): torch.float16, jnp.dtype(jnp.bfloat16): torch.bfloat16,
                jnp.dtype(jnp.float32): torch.float32}
        return tuple(torch.from_numpy(np.array(r.astype(jnp.float32))).to(back[r.dtype]) for r in results)


def use_interpreted_kernels(monkeypatch) -> None:
    monkeypatch.setattr(hopper_flash, "_FORWARD", InterpretedKernel("forward"))
    monkeypatch.setattr(hopper_flash, "_BACKWARD", InterpretedKernel("backward"))
