"""A mixed torch/JAX pipeline: a torch encoder feeds a JAX function through the bridge, and back, with
gradients end to end.

    python examples/mixed_pipeline.py [--device cpu|cuda] [--steps 30]

    torch: token ids -> embedding -> transformer block (attention: jaxattn's drop-in, padding mask)
    JAX:   features -> attention pooling with learned per-head queries (jaxattn.jax_core.attention)
                    -> linear classifier                    (one `jax_op`: a differentiable torch op)
    torch: cross-entropy loss -> backward -> every parameter, torch's and the JAX head's, gets a gradient

The JAX head's parameters are torch `nn.Parameter`s passed in as arguments, so one torch optimizer
trains both halves. The script checks the logits and every gradient against a twin pipeline written
in plain torch (same weights), then trains a few steps on a toy task (does token 7 occur in the
sequence?) and checks that the loss goes down.
"""

from __future__ import annotations

import argparse
import copy
import sys

from cli_options import add_device_option, positive_int, resolve_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps after the check (default 30)")
    parser.add_argument("--batch", type=positive_int, default=32, help="sequences per batch (default 32)")
    parser.add_argument("--length", type=positive_int, default=24,
                        help="tokens per sequence before padding (default 24; at least 2)")
    return parser


if __name__ == "__main__":  # --help and bad options answer here, before the imports below (torch takes seconds)
    build_parser().parse_args()

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from jaxattn.bridge import jax_op  # noqa: E402
from jaxattn.jax_core import attention  # noqa: E402
from jaxattn.testing import compare  # noqa: E402
from jaxattn.torch_api import scaled_dot_product_attention  # noqa: E402

VOCAB, DIM, HEADS, CLASSES = 32, 32, 4, 2


@jax_op(name="examples.pool_and_classify")
def pool_and_classify(features, keep, queries, w_out, b_out, *, heads):
    """JAX: (B, T, D) features, (B, T) bool keep, (H, D/H) queries, (D, C) w_out, (C,) b_out -> (B, C)."""
    b, t, d = features.shape
    kv = features.reshape(b, t, heads, d // heads)  # (B, T, H, D/H): keys and values
    q = jnp.broadcast_to(queries[None, None], (b, 1, heads, d // heads))
    pooled = attention(q, kv, kv, mask=keep[:, None, None, :]).attention_outputs  # (B, 1, H, D/H)
    return pooled.reshape(b, d) @ w_out + b_out


def pool_and_classify_torch(features, keep, queries, w_out, b_out, *, heads):
    """The same head in plain torch (the twin's)."""
    b, t, d = features.shape
    kv = features.reshape(b, t, heads, d // heads).transpose(1, 2)  # (B, H, T, D/H)
    q = queries[None, :, None, :].expand(b, -1, -1, -1)
    pooled = F.scaled_dot_product_attention(q, kv, kv, attn_mask=keep[:, None, None, :])
    return pooled.reshape(b, d) @ w_out + b_out


class Pipeline(nn.Module):
    """(B, T) ids and (B, T) keep mask -> (B, CLASSES) logits: torch encoder, then the JAX (or torch) head."""

    def __init__(self, jax_head: bool = True):
        super().__init__()
        self.jax_head = jax_head
        self.embed = nn.Embedding(VOCAB, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.queries = nn.Parameter(0.5 * torch.randn(HEADS, DIM // HEADS))  # the JAX head's parameters
        self.w_out = nn.Parameter(torch.randn(DIM, CLASSES) / DIM**0.5)
        self.b_out = nn.Parameter(torch.zeros(CLASSES))

    def encode(self, ids, keep):
        x = self.embed(ids)
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        mask = keep[:, None, None, :]  # (B, 1, 1, T): padded keys are never attended
        attend = scaled_dot_product_attention if self.jax_head else F.scaled_dot_product_attention
        y = attend(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(y)
        return x + self.mlp(self.norm(x))  # (B, T, D) features

    def forward(self, ids, keep):
        head = pool_and_classify if self.jax_head else pool_and_classify_torch
        return head(self.encode(ids, keep), keep, self.queries, self.w_out, self.b_out, heads=HEADS)


def toy_batch(g: torch.Generator, batch: int, length: int, device: str):
    """Random sequences with random padding; label 1 when token 7 occurs among the real tokens."""
    ids = torch.randint(0, VOCAB, (batch, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=g)
    keep = torch.arange(length)[None, :] < lengths[:, None]
    labels = ((ids == 7) & keep).any(dim=1).long()
    return ids.to(device), keep.to(device), labels.to(device)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.length < 2:  # padding leaves at least length // 2 real tokens, so each sequence keeps one
        parser.error(f"--length {args.length}: expected at least 2")
    args.device = resolve_device(parser, args.device)
    torch.manual_seed(0)
    model = Pipeline(jax_head=True).to(args.device)
    twin = copy.deepcopy(model)
    twin.jax_head = False
    g = torch.Generator().manual_seed(1)

    # 1. one batch through both pipelines: logits and every gradient must agree
    ids, keep, labels = toy_batch(g, args.batch, args.length, args.device)
    reports = []
    grads = {}
    for name, m in (("mixed", model), ("torch", twin)):
        logits = m(ids, keep)
        F.cross_entropy(logits, labels).backward()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters()}
        reports.append(logits.detach())
    checks = [compare(reports[0], reports[1], name="logits")]
    checks += [compare(grads["mixed"][n], grads["torch"][n], name=f"grad {n}") for n in grads["torch"]]
    for report in checks:
        print(report)
    grads_ok = all(r.passed for r in checks) and all(g.abs().sum() > 0 for g in grads["mixed"].values())

    # 2. a few training steps of the mixed pipeline: one optimizer for the torch and JAX halves
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(args.steps):
        ids, keep, labels = toy_batch(g, args.batch, args.length, args.device)
        loss = F.cross_entropy(model(ids, keep), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    k = max(1, len(losses) // 5)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    decreased = last < first
    print(f"mean loss of the first {k} steps {first:.3f}, of the last {k} {last:.3f}")
    print(f"gradients end to end: {'match the torch twin' if grads_ok else 'MISMATCH'}; "
          f"training: {'loss decreasing' if decreased else 'loss NOT decreasing'}")
    return 0 if grads_ok and decreased else 1


if __name__ == "__main__":
    sys.exit(main())
