"""Decode test helpers shared by the CPU, interpreter and GPU tests: ragged caches in every layout
(unwritten slots and unused pages hold NaN, so reading them shows) and a float64 oracle built on
torch's SDPA (math backend) with an explicit mask from starts / lengths."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attention_reference import reference


def decode_mask(lengths, starts, t, s, window=None):
    """(B, 1, T, S) bool: query t (at position length - T + t) sees position j."""
    lengths = lengths.long().cpu()
    starts = torch.zeros_like(lengths) if starts is None else starts.long().cpu()
    j = torch.arange(s)
    pos = lengths[:, None] - t + torch.arange(t)[None, :]
    mask = (j >= starts[:, None, None]) & (j < lengths[:, None, None]) & (j <= pos[..., None])
    if window is not None:
        mask &= j >= pos[..., None] - window
    return mask[:, None]


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


def oracle(q, k, v, lengths, starts, *, window=None, softcap=None, sinks=None, scale=None, dtype=torch.float64):
    """(out (B, Hq, T, Dv), lse (B, Hq, T)) in `dtype` from dense (B, S, Hkv, D) caches (NaN outside
    the valid region is zeroed first). The output comes from torch's SDPA math backend with the
    explicit mask when it can express the call (no soft cap, no sinks), else from plain torch ops;
    the LSE always from plain torch ops."""
    mask = decode_mask(lengths, starts, q.shape[2], k.shape[1], window).to(q.device)
    kk, vv = (torch.nan_to_num(x, nan=0.0).transpose(1, 2).to(dtype) for x in (k, v))
    out, lse = reference(q.to(dtype), kk, vv, mask=mask, softcap=softcap, sinks=sinks, scale=scale, dtype=dtype)
    if softcap is None and sinks is None:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q.to(dtype), kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
    return out, lse
