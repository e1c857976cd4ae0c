"""Greedy generation with a tiny random decoder: jaxattn's drop-in SDPA for the prefill, jaxattn's
`decode_attention` over a KV cache for every new token, checked token for token against the same
model recomputed from scratch with torch's own SDPA at each step.

    python examples/generate_tiny.py [--device cpu|cuda] [--paged] [--steps 24]

The prompts have different lengths and are left-padded: the cache's `starts` hold the padding
counts, so padded positions are never attended (and positions are counted from each prompt's first
real token). Nothing is downloaded; the weights are random (seeded).
"""

from __future__ import annotations

import argparse
import sys

from cli_options import add_device_option, positive_int, resolve_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    parser.add_argument("--steps", type=positive_int, default=24, help="tokens generated per prompt (default 24)")
    parser.add_argument("--paged", action="store_true", help="only the paged cache (default: both layouts)")
    return parser


if __name__ == "__main__":  # --help and bad options answer here, before the imports below (torch takes seconds)
    build_parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from jaxattn.torch_api import KVCache, scaled_dot_product_attention  # noqa: E402


class TinyDecoder(nn.Module):
    """Pre-norm decoder: RMSNorm, grouped-query attention with rotary positions, SiLU MLP.

    Attention is delegated to a callback `attend(layer, q, k, v)` taking (B, H, T, Dh) tensors
    (queries with Hq heads, keys/values with Hkv heads) and returning (B, Hq, T, Dh).
    """

    def __init__(self, vocab=97, dim=64, layers=2, q_heads=4, kv_heads=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.hq, self.hkv, self.dh = q_heads, kv_heads, dim // q_heads
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(dict(
                norm1=nn.RMSNorm(dim), qkv=nn.Linear(dim, (q_heads + 2 * kv_heads) * self.dh, bias=False),
                out=nn.Linear(q_heads * self.dh, dim, bias=False), norm2=nn.RMSNorm(dim),
                up=nn.Linear(dim, 4 * dim, bias=False), down=nn.Linear(4 * dim, dim, bias=False),
            )) for _ in range(layers)
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def rotate(self, x, positions):
        """Rotary embedding of (B, H, T, Dh) by (B, T) integer positions."""
        half = self.dh // 2
        freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angle = positions[:, None, :, None].float() * freq
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, tokens, positions, attend):
        """(B, T) tokens at (B, T) positions -> (B, T, vocab) logits."""
        b, t = tokens.shape
        h = self.embed(tokens)
        for i, blk in enumerate(self.blocks):
            qkv = blk["qkv"](blk["norm1"](h)).view(b, t, self.hq + 2 * self.hkv, self.dh).transpose(1, 2)
            q, k, v = qkv.split([self.hq, self.hkv, self.hkv], dim=1)
            q, k = self.rotate(q, positions), self.rotate(k, positions)
            a = attend(i, q, k, v).transpose(1, 2).reshape(b, t, self.hq * self.dh)
            h = h + blk["out"](a)
            h = h + blk["down"](F.silu(blk["up"](blk["norm2"](h))))
        return self.head(self.norm(h))


def padded_batch(prompts, device):
    """Left-padded (B, L) tokens, (B,) pad counts and (B, L) positions counted from the first real token."""
    width = max(len(p) for p in prompts)
    pads = torch.tensor([width - len(p) for p in prompts], device=device)
    tokens = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    positions = (torch.arange(width, device=device)[None, :] - pads[:, None]).clamp(min=0)
    return tokens, pads, positions


def visible_mask(pads, length, device):
    """(B, 1, L, L) bool: causal, padding never visible (a padding row sees itself so no row is empty)."""
    i = torch.arange(length, device=device)
    causal = i[None, :] <= i[:, None]
    real = i[None, None, :] >= pads[:, None, None]
    return ((causal[None] & real) | torch.eye(length, dtype=torch.bool, device=device)[None])[:, None]


@torch.no_grad()
def generate_reference(model, prompts, steps, device):
    """Greedy tokens, recomputing the whole sequence with torch's SDPA at every step."""
    tokens, pads, positions = padded_batch(prompts, device)
    out = []
    for _ in range(steps):
        mask = visible_mask(pads, tokens.shape[1], device)
        attend = lambda _i, q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        nxt = model(tokens, positions, attend)[:, -1].argmax(-1)
        out.append(nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return torch.stack(out, dim=1)


@torch.no_grad()
def generate_cached(model, prompts, steps, device, paged=False):
    """Greedy tokens: prefill with jaxattn's SDPA, then decode_attention against per-layer KV caches."""
    tokens, pads, positions = padded_batch(prompts, device)
    b, width = tokens.shape
    capacity = width + steps
    build = (lambda: KVCache.paged(b, capacity, model.hkv, model.dh, page_size=8, device=device)) if paged else (
        lambda: KVCache.contiguous(b, capacity, model.hkv, model.dh, device=device))
    caches = [build() for _ in model.blocks]
    for cache in caches:
        cache.set_starts(pads)
    mask = visible_mask(pads, width, device)

    def prefill(i, q, k, v):
        caches[i].append(k, v)
        return scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def decode(i, q, k, v):
        caches[i].append(k, v)
        return caches[i].attend(q)

    logits = model(tokens, positions, prefill)
    out, position = [], positions[:, -1:]
    for step in range(steps):
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        if step == steps - 1:
            break
        position = position + 1
        logits = model(nxt[:, None], position, decode)
    return torch.stack(out, dim=1)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.device = resolve_device(parser, args.device)
    model = TinyDecoder().to(args.device).eval()
    prompts = [[5, 17, 3], [9, 1, 44, 20, 61, 2, 7, 13], [30, 31, 32, 33, 34]]
    expected = generate_reference(model, prompts, args.steps, args.device)
    ok = True
    for paged in ([True] if args.paged else [False, True]):
        got = generate_cached(model, prompts, args.steps, args.device, paged=paged)
        same = torch.equal(got, expected)
        ok &= same
        print(f"{'paged' if paged else 'contiguous'} cache: {'tokens match torch SDPA' if same else 'MISMATCH'}")
        for row in got.tolist():
            print("  ", row)
    if not ok:
        print("expected:", expected.tolist())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
