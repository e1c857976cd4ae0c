"""Decode test helpers shared by the CPU, interpreter and GPU tests: ragged caches in every layout
(unwritten slots and unused pages hold NaN, so reading them shows). The oracle for them is
`attention_reference.decode_reference`."""

import dataclasses
from typing import Optional

import torch

from jaxattn.jax_core.kernels.decode_plan import DecodeConfig


def ragged_cache(gen, b, s, hkv, d, lengths, starts, *, dv=None, dtype=torch.float32, device="cpu"):
    """Dense (B, S, Hkv, D|Dv) keys/values: random in [start, length), NaN elsewhere."""
    dv = dv or d
    k = torch.randn(b, s, hkv, d, generator=gen, device=device).to(dtype)
    v = torch.randn(b, s, hkv, dv, generator=gen, device=device).to(dtype)
    starts = torch.zeros_like(lengths) if starts is None else starts
    j = torch.arange(s, device=device)
    written = (j[None] >= starts.to(device)[:, None]) & (j[None] < lengths.to(device)[:, None])
    nan = torch.tensor(float("nan"), dtype=dtype, device=device)
    return (torch.where(written[..., None, None], k, nan), torch.where(written[..., None, None], v, nan))


def layout_cache(k, v, layout, *, gen, page_size=8, spare_pages=3):
    """The dense cache in `layout`: (k, v, block_table or None). Paged: pages in a random order
    plus spare pages full of NaN."""
    if layout == "BSHD":
        return k, v, None
    if layout == "BHSD":
        return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), None
    b, s = k.shape[:2]
    per_seq = s // page_size
    total = b * per_seq + spare_pages
    order = torch.randperm(total, generator=gen, device=gen.device)[: b * per_seq].to(k.device)
    table = order.view(b, per_seq).to(torch.int32)
    pages = []
    for x in (k, v):
        p = torch.full((total, page_size, *x.shape[2:]), float("nan"), dtype=x.dtype, device=x.device)
        p[order] = x.reshape(b * per_seq, page_size, *x.shape[2:])
        pages.append(p)
    return pages[0], pages[1], table


@dataclasses.dataclass(frozen=True)
class SmallLaunch(DecodeConfig):
    """Decode settings with launch choices for tiny caches: key blocks of 16 positions and `programs`
    stream programs, each taking at least `min_share` key blocks (None: the product's rule), so that
    program slices cut segments into several partial results and span several segments."""

    programs: int = 3
    min_share: Optional[int] = None

    def launch_tiles(self, d, dv, dtype_bytes):
        return 16, 4, 2

    def stream_programs(self):
        return self.programs

    def stream_min_share(self, segments, max_blocks, programs):
        return self.min_share or super().stream_min_share(segments, max_blocks, programs)
