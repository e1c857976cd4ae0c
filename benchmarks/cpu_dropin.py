"""What a CPU user should expect: the drop-in against torch's own SDPA on the CPU, float32.

    python benchmarks/cpu_dropin.py [--shape 4,8,256,64] [--rounds 15] [--out cpu.json]

Three cells, all causal at (B, H, L, D) = --shape:
  attention fwd      the attention call alone, forward under `torch.no_grad()`
  attention fwd+bwd  the attention call alone, forward and backward (`torch.autograd.grad` of the output)
  block step         one training step of a pre-norm transformer block (LayerNorm, attention with H heads of
                     width D, 4x MLP; model width H*D), loss, backward and an AdamW step
The attention cells are also timed for JAX alone (`jax.nn.dot_product_attention` jitted, on the
same values in JAX's (B, L, H, D) layout, its VJP for fwd+bwd) against torch: what XLA:CPU itself
costs with no torch on the path, a floor for the drop-in. A last cell times the drop-in's forward
with its NaN/inf input check off against the same with the check on (set_finite_check). The other cells run the same work with
`jaxattn.torch_api.scaled_dot_product_attention` and with `torch.nn.functional.scaled_dot_product_attention`
(the block: two copies with the same weights).
Timing: after warm-up (the drop-in's compilation), --rounds rounds of one timed loop per side, the
order alternating between rounds; ratio = ours / torch time per round (ours: the drop-in, or JAX
alone; > 1: ours slower), reported as the median over rounds with its quartiles. A round's two loops
run back to back, so they share whatever else the machine is doing; the median of per-round ratios
is steadier than the ratio of medians on a shared machine.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4,8,256,64", help="B,H,L,D of the attention call (default 4,8,256,64)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per cell (default 15)")
    parser.add_argument("--calls", type=int, default=5, help="calls per timed loop (default 5)")
    parser.add_argument("--finite-check", default="cpu", choices=("cpu", "off"),
                        help="the drop-in's NaN/inf input check (jaxattn.torch_api.set_finite_check): cpu "
                             "(the default: on for CPU tensors) or off")
    parser.add_argument("--out", default=None, help="write the results as JSON to this file")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(x) for x in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        parser.error(f"--shape {args.shape!r}: expected four positive integers B,H,L,D, e.g. 4,8,256,64")
    args.shape = shape
    return args


def paired(fn_a, fn_b, rounds: int, calls: int) -> dict:
    """Per-call ms of two functions timed in alternating order, and the per-round ratio a / b."""
    for _ in range(3):  # warm-up: compilation, allocator, thread pools
        fn_a(), fn_b()
    a_ms, b_ms, ratios = [], [], []
    for r in range(rounds):
        order = ((0, fn_a), (1, fn_b)) if r % 2 == 0 else ((1, fn_b), (0, fn_a))
        ms = [0.0, 0.0]
        for side, fn in order:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            ms[side] = (time.perf_counter() - t0) / calls * 1e3
        a_ms.append(ms[0]), b_ms.append(ms[1]), ratios.append(ms[0] / ms[1])
    q = statistics.quantiles(ratios, n=4)
    return {"ours_ms": statistics.median(a_ms), "torch_ms": statistics.median(b_ms),
            "ratio": statistics.median(ratios), "ratio_quartiles": [q[0], q[2]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import torch
    import torch.nn.functional as F
    from torch import nn

    import jaxattn
    from jaxattn.torch_api import scaled_dot_product_attention as jax_sdpa
    from jaxattn.torch_api import set_finite_check

    set_finite_check(args.finite_check)

    b, h, seq, d = args.shape
    torch.manual_seed(0)

    q, k, v = (torch.randn(b, h, seq, d, requires_grad=True) for _ in range(3))
    cot = torch.randn(b, h, seq, d)

    def attention_fwd(sdpa):
        def call():
            with torch.no_grad():
                return sdpa(q, k, v, is_causal=True)
        return call

    def attention_step(sdpa):
        return lambda: torch.autograd.grad(sdpa(q, k, v, is_causal=True), (q, k, v), cot)

    jq, jk, jv, jcot = (jax.numpy.asarray(t.detach().transpose(1, 2).numpy()) for t in (q, k, v, cot))
    jax_fwd = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    jax_fwd_bwd = jax.jit(lambda q, k, v, cot: jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True),
                                                        q, k, v)[1](cot))

    class Block(nn.Module):
        def __init__(self, sdpa):
            super().__init__()
            width = h * d
            self.sdpa = sdpa
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x):
            qkv = self.qkv(self.ln1(x)).view(b, seq, 3, h, d).permute(2, 0, 3, 1, 4)
            y = self.sdpa(qkv[0], qkv[1], qkv[2], is_causal=True).transpose(1, 2).reshape(b, seq, h * d)
            x = x + self.proj(y)
            return x + self.mlp(self.ln2(x))

    x = torch.randn(b, seq, h * d)
    target = torch.randn(b, seq, h * d)

    def block_step(sdpa, template=None):
        block = Block(sdpa) if template is None else copy.deepcopy(template)
        block.sdpa = sdpa
        opt = torch.optim.AdamW(block.parameters(), lr=1e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            F.mse_loss(block(x), target).backward()
            opt.step()
        return step, block

    results = {"shape": list(args.shape), "dtype": "float32", "causal": True, "finite_check": args.finite_check,
               "rounds": args.rounds,
               "calls_per_loop": args.calls, "date": time.strftime("%Y-%m-%d"),
               "versions": {"jaxattn": jaxattn.__version__, "python": platform.python_version(),
                            "torch": torch.__version__, "jax": jax.__version__},
               "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, "
                          f"{len(jax.devices())} JAX CPU device(s)"}
    results["attention fwd"] = paired(attention_fwd(jax_sdpa), attention_fwd(F.scaled_dot_product_attention),
                                      args.rounds, args.calls)
    results["attention fwd+bwd"] = paired(attention_step(jax_sdpa), attention_step(F.scaled_dot_product_attention),
                                          args.rounds, args.calls)
    def with_check(mode, fn):
        def call():
            set_finite_check(mode)
            try:
                return fn()
            finally:
                set_finite_check(args.finite_check)
        return call

    # what the NaN/inf input check costs the drop-in: "torch" here is the drop-in with the check on
    results["check off/on: dropin fwd"] = paired(with_check("off", attention_fwd(jax_sdpa)),
                                                 with_check("cpu", attention_fwd(jax_sdpa)), args.rounds, args.calls)
    results["JAX alone: attention fwd"] = paired(lambda: jax_fwd(jq, jk, jv).block_until_ready(),
                                                 attention_fwd(F.scaled_dot_product_attention), args.rounds, args.calls)
    results["JAX alone: attention fwd+bwd"] = paired(lambda: jax.block_until_ready(jax_fwd_bwd(jq, jk, jv, jcot)),
                                                     attention_step(F.scaled_dot_product_attention),
                                                     args.rounds, args.calls)
    jax_step, template = block_step(jax_sdpa)
    torch_step, _ = block_step(F.scaled_dot_product_attention, template)
    results["block train step (AdamW)"] = paired(jax_step, torch_step, args.rounds, args.calls)

    print(f"B{b} H{h} L{seq} D{d} causal float32 on CPU, finite check {args.finite_check}; {results['machine']}; "
          f"{results['versions']}")
    for cell in ("attention fwd", "attention fwd+bwd", "block train step (AdamW)", "JAX alone: attention fwd",
                 "JAX alone: attention fwd+bwd", "check off/on: dropin fwd"):
        r = results[cell]
        print(f"{cell:30s} ours {r['ours_ms']:8.2f} ms  torch {r['torch_ms']:8.2f} ms  "
              f"ours/torch {r['ratio']:.2f}x (quartiles {r['ratio_quartiles'][0]:.2f}-{r['ratio_quartiles'][1]:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
