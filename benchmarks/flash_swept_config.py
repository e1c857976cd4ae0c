"""A FlashConfig whose launch choices are given, for the benchmarks that compare them with the tuned ones.

The product launches the flash kernels with its tuned tiles and always skips fully masked tiles
(`FlashConfig.forward_tile`, `backward_tiles`, `skips_masked_blocks`); the tile sweeps and the
block-skip benchmark override those choices here, in benchmark code. Run the benchmarks as scripts
(`python benchmarks/flash_fwd_tiles.py`): Python then finds this module next to them.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from jaxattn.jax_core.kernels.flash_plan import FlashCall, FlashConfig, Tile


@dataclasses.dataclass(frozen=True)
class SweptFlashConfig(FlashConfig):
    """FlashConfig's settings, plus:

    Attributes:
        fwd_tile: the forward (BLOCK_M, BLOCK_N, num_warps, num_stages); None: the tuned one.
        bwd_tiles: (dK/dV tile, dQ tile); None: the tuned ones.
        skip_masked_blocks: False launches the kernels without the block-visibility table (the
            baseline of `flash_block_skip.py`).
    """

    fwd_tile: Optional[Tile] = None
    bwd_tiles: Optional[tuple[Tile, Tile]] = None
    skip_masked_blocks: bool = True

    def forward_tile(self, call: FlashCall) -> Tile:
        return self.fwd_tile or super().forward_tile(call)

    def backward_tiles(self, call: FlashCall) -> tuple[Tile, Tile]:
        return self.bwd_tiles or super().backward_tiles(call)

    def skips_masked_blocks(self) -> bool:
        return self.skip_masked_blocks
