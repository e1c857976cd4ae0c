"""The examples' shared command-line pieces: `--device`, parsed without torch and checked against what
torch sees once torch is imported, and a positive-integer option type.

Parsing stays free of torch so that `--help` and mistyped options answer at once (importing torch
takes seconds); `resolve_device` imports torch and refuses a device this machine lacks with one line
(`parser.error`: usage, the reason, exit status 2) instead of a traceback from deep inside torch.
"""

from __future__ import annotations

import argparse
import re

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def _device_name(text: str) -> str:
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, cuda or cuda:N")
    return text


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def add_device_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=_device_name, default="auto",
                        help="auto (default: cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N")


def resolve_device(parser: argparse.ArgumentParser, device: str) -> str:
    """The device to run on: `device` itself, or cuda/cpu for "auto"; exits through parser.error when
    torch cannot use it here."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(device.partition(":")[2] or 0)
        if index >= count:
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
            parser.error(f"--device {device}: torch {torch.__version__} ({build} build) sees {count} CUDA "
                         f"device(s) here; use --device cpu (or auto)")
    return device
