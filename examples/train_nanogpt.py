"""A nanoGPT-style character model trained a few steps with jaxattn's attention, next to torch's SDPA.

    python examples/train_nanogpt.py [--device cpu|cuda] [--steps 50] [--layers 2] [--dim 64]

Two copies of the same GPT (same initial weights, same batches, AdamW) are trained side by side:
one computes attention with `jaxattn.torch_api.scaled_dot_product_attention`, the other with
`torch.nn.functional.scaled_dot_product_attention`. Everything else is plain torch. The script
checks that jaxattn's loss goes down and that both loss curves agree step by step.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

from cli_options import add_device_option, positive_int, resolve_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    parser.add_argument("--steps", type=positive_int, default=50, help="training steps of each copy (default 50)")
    parser.add_argument("--batch", type=positive_int, default=16, help="sequences per batch (default 16)")
    parser.add_argument("--block", type=positive_int, default=64, help="context length T (default 64)")
    parser.add_argument("--dim", type=positive_int, default=64, help="model width, a multiple of --heads (default 64)")
    parser.add_argument("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--heads", type=positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    return parser


if __name__ == "__main__":  # --help and bad options answer here, before the imports below (torch takes seconds)
    build_parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from jaxattn.torch_api import scaled_dot_product_attention  # noqa: E402

TEXT = (
    "Attention weighs every earlier token by how well its key matches the current query, then mixes "
    "their values. A causal model may only look back, so each position predicts the next character "
    "from the ones before it. Small models learn the frequent letters first, then common pairs, "
    "then whole words that repeat, like attention, query, key and value. "
) * 4


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on (B, T, C); `attend(q, k, v)` takes (B, H, T, C/H) tensors."""

    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.heads, self.attend = heads, attend
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attend):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, attend)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, tied output head: (B, T) ids -> (B, T, vocab) logits."""

    def __init__(self, vocab: int, block: int, dim: int, layers: int, heads: int, attend):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attend) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        for m in self.modules():  # GPT-2's initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def set_attention(self, attend) -> None:
        for blk in self.blocks:
            blk.attn.attend = attend

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.T


def jaxattn_attend(q, k, v):
    return scaled_dot_product_attention(q, k, v, is_causal=True)


def torch_attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def batches(data: torch.Tensor, steps: int, batch: int, block: int, seed: int):
    """`steps` (inputs, targets) pairs of (batch, block) windows, the same for both runs."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        start = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + block] for s in start.tolist()])
        y = torch.stack([data[s + 1:s + block + 1] for s in start.tolist()])
        yield x, y


def train(model: GPT, steps: int, batch: int, block: int, data: torch.Tensor, device: str, lr: float) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    losses = []
    for x, y in batches(data, steps, batch, block, seed=1):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.dim % args.heads:
        parser.error(f"--dim {args.dim}: expected a multiple of --heads {args.heads} (each head gets dim / heads)")
    if args.block > len(TEXT) - 2:
        parser.error(f"--block {args.block}: expected at most {len(TEXT) - 2}, the training text's length minus 2")
    args.device = resolve_device(parser, args.device)

    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT])
    torch.manual_seed(0)
    ours = GPT(len(chars), args.block, args.dim, args.layers, args.heads, jaxattn_attend).to(args.device)
    ref = copy.deepcopy(ours)
    ref.set_attention(torch_attend)

    train_args = (args.steps, args.batch, args.block, data, args.device, args.lr)
    loss_ours = train(ours, *train_args)
    loss_ref = train(ref, *train_args)

    print(f"{'step':>4}  {'jaxattn':>8}  {'torch':>8}")
    for i in sorted({0, *range(0, args.steps, max(1, args.steps // 10)), args.steps - 1}):
        print(f"{i:>4}  {loss_ours[i]:8.4f}  {loss_ref[i]:8.4f}")
    first, last = loss_ours[0], loss_ours[-1]
    # The runs diverge only by float32 rounding in attention, which training slowly amplifies.
    gap = max(abs(a - b) / b for a, b in zip(loss_ours, loss_ref))
    decreased = last < 0.9 * first and math.isfinite(last)
    agree = gap < 1e-3
    print(f"loss {first:.3f} -> {last:.3f} ({'decreasing' if decreased else 'NOT decreasing'}); "
          f"largest relative gap to torch's run {gap:.1e} ({'agree' if agree else 'DIFFER'})")
    return 0 if decreased and agree else 1


if __name__ == "__main__":
    sys.exit(main())
