"""Quickstart: jaxattn's drop-in `scaled_dot_product_attention` on random tensors, checked against torch.

    python examples/quickstart.py [--device cpu|cuda] [--seq 512]

1. The drop-in, called exactly like torch's F.scaled_dot_product_attention (GQA, causal, awkward
   sizes), forward and backward, compared with torch by the parity kit (`jaxattn.testing`).
2. Picking a JAX implementation for a block of code (`sdpa_implementation`).
3. A bool padding mask.
4. `patch_sdpa`: code that calls torch's F.scaled_dot_product_attention runs jaxattn unchanged.
"""

from __future__ import annotations

import argparse
import sys

from cli_options import add_device_option, positive_int, resolve_device


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_option(parser)
    parser.add_argument("--seq", type=positive_int, default=257, help="query length L (keys: L + 33; default 257)")
    return parser


if __name__ == "__main__":  # --help and bad options answer here, before the imports below (torch takes seconds)
    build_parser().parse_args()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from jaxattn.testing import compare  # noqa: E402
from jaxattn.torch_api import patch_sdpa, scaled_dot_product_attention, sdpa_implementation  # noqa: E402


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    dev, seq = resolve_device(parser, args.device), args.seq
    torch.manual_seed(0)

    # (N, Hq, L, E) queries; (N, Hk, S, E) keys and values with Hk = Hq / 4 (grouped-query attention)
    q = torch.randn(2, 8, seq, 80, device=dev, requires_grad=True)
    k = torch.randn(2, 2, seq + 33, 80, device=dev, requires_grad=True)
    v = torch.randn(2, 2, seq + 33, 80, device=dev, requires_grad=True)
    grad_out = torch.randn(2, 8, seq, 80, device=dev)

    # 1. the drop-in: same call as torch's
    out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (2, 8, L, 80)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad_out)
    reports = [compare(out, want, name="output")]
    reports += [compare(g, w, name=f"grad {n}") for n, g, w in zip("qkv", grads, want_grads)]

    # 2. a chosen implementation ("vanilla": the XLA reference with every feature)
    with sdpa_implementation("vanilla"):
        out_vanilla = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    reports.append(compare(out_vanilla, want, name="output, vanilla"))

    # 3. a padding mask: (N, 1, 1, S) bool, True = attend; the last 40 keys of sequence 1 are padding
    mask = torch.ones(2, 1, 1, seq + 33, dtype=torch.bool, device=dev)
    mask[1, ..., -40:] = False
    out_masked = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    reports.append(compare(out_masked, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),
                           name="output, padding mask"))

    # 4. code written against torch's function, unchanged
    def torch_code(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with patch_sdpa():
        out_patched = torch_code(q, k, v)
    reports.append(compare(out_patched, want, name="output, patch_sdpa"))

    for report in reports:
        print(report)
    ok = all(r.passed for r in reports)
    print("all match torch" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
