"""The `jaxattn` command: `jaxattn --version`, `jaxattn doctor`, `jaxattn bench`, `jaxattn parity`."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Optional, Sequence

from . import bench
from . import parity
from ._version import __version__
from .jax_core.kernels.jax_triton_module import jax_triton


def _versions() -> list[tuple[str, str]]:
    rows = [("jaxattn", __version__), ("python", platform.python_version())]
    for name in ("jax", "jaxlib", "torch", "numpy", "triton", "jax_triton"):
        try:
            module = jax_triton() if name == "jax_triton" else __import__(name)
            rows.append((name, getattr(module, "__version__", "?")))
        except Exception as exc:  # a broken optional install should not stop the report
            rows.append((name, f"not available ({type(exc).__name__})"))
    return rows


def _memory_settings() -> list[tuple[str, str]]:
    """The XLA_PYTHON_CLIENT_* variables in effect and what they make JAX do on a GPU."""
    import os

    from .gpu_memory import _USER_VARS

    env = {name: os.environ.get(name) for name in _USER_VARS}
    rows = [(name, value if value is not None else "(unset)") for name, value in env.items()]
    if (env["XLA_PYTHON_CLIENT_ALLOCATOR"] or "").lower() == "platform":
        effect = "allocates exactly what it needs and frees it at once (slow; for debugging)"
    elif (env["XLA_PYTHON_CLIENT_PREALLOCATE"] or "true").lower() in ("false", "0"):
        effect = "allocates on demand, keeps what it allocated (room left for torch)"
    else:
        fraction = env["XLA_PYTHON_CLIENT_MEM_FRACTION"] or ".75"
        effect = f"reserves {float(fraction):.0%} of GPU memory at start-up (little room for torch)"
    rows.append(("JAX on a GPU", effect))
    return rows


def doctor() -> int:
    """Prints versions, devices, which implementations can run on each platform here, and what automatic
    selection picks for a typical prefill and decoding call."""
    from . import bridge  # noqa: F401  (applies the GPU memory policy before JAX starts)
    import jax
    import torch

    from .jax_core import AttentionInputs, AttentionRegistry, backend_of

    print("versions")
    for name, version in _versions():
        print(f"  {name:<11} {version}")
    print("devices")
    print(f"  jax default backend: {jax.default_backend()}")
    for d in jax.devices():
        print(f"  jax   {d.platform}:{d.id}  {getattr(d, 'device_kind', '')}")
    print(f"  torch cuda available: {torch.cuda.is_available()} ({torch.cuda.device_count()} devices)")
    print("JAX memory settings (torch and JAX share a GPU: see README, GPU memory)")
    for name, value in _memory_settings():
        print(f"  {name:<31} {value}")
    print("implementations (prefill probe: B=1, T=S=128, H=8, D=128, causal, backward; "
          "decode probe: B=1, T=1, S=4096, Hq=8, Hk=2, D=128)")
    platforms = sorted({"cpu", *("gpu" if d.platform in ("gpu", "cuda", "rocm") else d.platform for d in jax.devices())})
    probes = (("prefill", (1, 128, 128, 8, 8, 128, 128), {"causal", "backward"}),
              ("decode", (1, 1, 4096, 8, 2, 128, 128), {"gqa"}))
    for plat in platforms:
        for probe, sizes, features in probes:
            for dtype in ("bfloat16", "float32"):
                inputs = AttentionInputs(*sizes, dtype, plat, backend_of(plat), frozenset(features))
                for name in AttentionRegistry.canonical_names():
                    reasons = AttentionRegistry.get(name).not_supported_reasons(inputs)
                    status = "ok" if not reasons else "no: " + "; ".join(reasons)
                    print(f"  {plat:<4} {probe:<8} {dtype:<9} {name:<10} {status}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for line in automatic_choices(device):
        print(line)
    return 0


LAUNCHER_WORDS = {"native": "native Triton launch", "xla": "XLA bridge"}


def automatic_choices(device: str) -> list[str]:
    """Lines saying which implementation and launcher `scaled_dot_product_attention` picks on `device`
    for a typical prefill and decoding call, and why (the selection code's own reasons)."""
    import textwrap

    from .torch_api.explain import describe_call, explain_sdpa, typical_calls

    lines = [f"automatic selection on {device} (scaled_dot_product_attention, implementation=None)"]
    for label, q_shape, k_shape, dtype, causal in typical_calls(device):
        call = describe_call(q_shape, k_shape, dtype, causal)
        try:
            choice = explain_sdpa(q_shape, k_shape, dtype, device, is_causal=causal)
        except (ValueError, NotImplementedError) as exc:
            lines.append(f"  {label:<8} {call}: no implementation: {' '.join(str(exc).split())}")
            continue
        lines.append(f"  {label:<8} {call}: {choice.implementation} via the {LAUNCHER_WORDS[choice.launcher]}")
        lines += textwrap.wrap(f"why: {choice.reason}", 100, initial_indent=" " * 11, subsequent_indent=" " * 16,
                               break_long_words=False, break_on_hyphens=False)
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxattn", description="JAX attention kernels for PyTorch users.")
    parser.add_argument("--version", action="version", version=f"jaxattn {__version__}")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("doctor", help="versions, devices and which implementations can run here")
    bench.add_arguments(sub.add_parser("bench", help=bench.HELP, description=bench.__doc__,
                                       formatter_class=argparse.RawDescriptionHelpFormatter))
    parity.add_arguments(sub.add_parser("parity", help="every implementation x dtype x shape against torch here",
                                        description=parity.__doc__,
                                        formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    if args.command == "parity":
        return parity.main(args.implementations, args.dtypes, args.shapes, grad=not args.no_grad)
    if args.command == "doctor":
        return doctor()
    if args.command == "bench":
        return bench.main(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
