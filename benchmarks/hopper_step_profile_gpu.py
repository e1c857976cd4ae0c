"""Where a training step's time goes, the Hopper kernels through the torch drop-in against torch's
cuDNN attention, causal bf16: each kernel's GPU time, and the step under sustained load.

    python benchmarks/hopper_step_profile_gpu.py [--part kernels | --part sustained | --part both]
                                                 [--sustained-parts "fwd+bwd,fwd,bwd step"]
                                                 [--seconds 10] [--out step_profile.json]

* `kernels`: torch.profiler over 5 steps (after 3 unprofiled ones), at (2, 16, 8192, 128) and
  (16, 16, 1024, 64): forward + backward (`autograd.grad` of a fresh output) and the backward step
  alone (`autograd.grad` of one kept output, `retain_graph`). Per row: each kernel's GPU time per
  step, their sum, and the span from the first kernel's start to the last one's end per step (span
  minus sum: the GPU idle inside the steps; the first profiled step carries the profiler's own
  buffer set-up, so a few tens of µs per step is not the library's).
* `sustained`: at (2, 16, 8192, 128), forward + backward, the forward alone and the backward step
  alone (`--sustained-parts`), in chunks of 10 steps between CUDA events for `--seconds` (10) per
  row, each row twice in turn after a 3 s rest. Per row: the first chunk's step time (cool
  GPU, full clock), the median chunk's, the median SM clock, board power and temperature
  `nvidia-smi` reports over the last two thirds of the run, and the energy per step (NVML's energy
  counter over the whole run, mJ). Under a power cap the GPU lowers its
  clock to hold the power: a kernel that spends more energy per step runs at a lower clock than
  one doing the same work for less.

Our rows run the compiled launch programs (`triton_program`), waited for before anything is timed:
a step run while the extension builds, or with an output made before its signature's program was
registered, is the Python path.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import threading
import time
from typing import Optional

import jaxattn  # noqa: F401  (first: keeps JAX from preallocating GPU memory)
import torch

from gpu_timing import kernel_profile, write_report
from hopper_torch_gpu import ROWS
from jaxattn.bridge import triton_program

KERNEL_SHAPES = [(2, 16, 8192, 128), (16, 16, 1024, 64)]
SUSTAINED_SHAPE = (2, 16, 8192, 128)
NAMES = ("jaxattn hopper", "torch cudnn")


def _inputs(shape):
    b, h, l, d = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
              for _ in range(3)]
    return leaves, torch.randn(b, h, l, d, generator=gen, device="cuda", dtype=torch.bfloat16)


def _profiled(step, steps=5) -> dict:
    """Kernels' GPU time per step ({name: µs}), their sum and the span per step, over `steps` steps."""
    per_kernel, span = kernel_profile(step, calls=steps, warmup=3)
    return dict(kernels_us=per_kernel, kernel_sum_us=sum(per_kernel.values()), span_us=span)


def kernels(rows: list) -> None:
    for shape in KERNEL_SHAPES:
        leaves, cot = _inputs(shape)
        for name in NAMES:
            fn = ROWS[name]
            torch.autograd.grad(fn(*leaves, True), leaves, cot)  # registers our signature's program
            kept = fn(*leaves, True)
            parts = {"fwd+bwd": lambda fn=fn: torch.autograd.grad(fn(*leaves, True), leaves, cot),
                     "bwd step": lambda kept=kept: torch.autograd.grad(kept, leaves, cot, retain_graph=True)}
            for part, step in parts.items():
                row = dict(shape=list(shape), row=name, part=part, grad_fn=type(kept.grad_fn).__name__,
                           **_profiled(step))
                rows.append(row)
                print(f"{str(tuple(shape)):20} {name:15} {part:9} span {row['span_us']:8.1f} us/step, kernels "
                      f"{row['kernel_sum_us']:8.1f}", flush=True)
                for kernel, us in row["kernels_us"].items():
                    print(f"{'':46}{us:8.1f}  {kernel[:90]}", flush=True)


def _smi_samples(stop: threading.Event, samples: list) -> None:
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits"]
    while not stop.is_set():
        reply = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
        try:
            samples.append([float(x) for x in reply[0].split(",")])
        except (IndexError, ValueError):  # a reply nvidia-smi could not fill ("[N/A]"): skipped
            pass
        time.sleep(0.2)


class _EnergyMeter:
    """The GPU's energy counter (NVML's total energy since the driver loaded, mJ) through
    libnvidia-ml, which ships with the driver; `read()` is None where it cannot be had."""

    def __init__(self, device: int = 0):
        self.handle = self.lib = None
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            props = torch.cuda.get_device_properties(device)
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0".encode()
            handle = ctypes.c_void_p()
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByPciBusId_v2(bus, ctypes.byref(handle)) == 0:
                self.lib, self.handle = lib, handle
        except (OSError, AttributeError):  # no NVML library, or a torch without the PCI fields
            pass

    def read(self):
        if self.lib is None:
            return None
        energy = ctypes.c_ulonglong()
        if self.lib.nvmlDeviceGetTotalEnergyConsumption(self.handle, ctypes.byref(energy)) != 0:
            return None
        return energy.value


def _steps(name: str, leaves: list, cot: torch.Tensor) -> dict:
    """The sustained run's steps of row `name`: forward + backward, forward alone (no graph), and the
    backward step alone (`retain_graph` on one kept output of the settled path)."""
    fn = ROWS[name]
    torch.autograd.grad(fn(*leaves, True), leaves, cot)  # registers our signature's program
    kept = fn(*leaves, True)

    def forward():
        with torch.no_grad():
            fn(*leaves, True)  # (q, k, v, causal)
    return {"fwd+bwd": lambda: torch.autograd.grad(fn(*leaves, True), leaves, cot), "fwd": forward,
            "bwd step": lambda: torch.autograd.grad(kept, leaves, cot, retain_graph=True)}


def _sustained_run(step, seconds: float, meter: _EnergyMeter) -> tuple[list, list, Optional[float]]:
    """(µs per step of each 10-step chunk, nvidia-smi samples, mJ per step) of `step` run for `seconds`."""
    stop, samples, chunks = threading.Event(), [], []
    sampler = threading.Thread(target=_smi_samples, args=(stop, samples))
    sampler.start()
    began, energy_before = time.perf_counter(), meter.read()
    while time.perf_counter() - began < seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            step()
        end.record()
        end.synchronize()
        chunks.append(start.elapsed_time(end) * 100)  # ms per 10 steps -> µs per step
    energy_after = meter.read()
    stop.set()
    sampler.join()
    # The whole run's energy per step (the board's counter: every consumer on it included).
    energy = None if None in (energy_before, energy_after) else (energy_after - energy_before) / (10 * len(chunks))
    return chunks, samples, energy


def sustained(rows: list, parts: tuple, seconds: float, rounds: int = 2) -> None:
    leaves, cot = _inputs(SUSTAINED_SHAPE)
    meter = _EnergyMeter(torch.cuda.current_device())
    steps = {name: _steps(name, leaves, cot) for name in NAMES}
    for part in parts:
        for rnd in range(rounds):
            for name in NAMES:
                step = steps[name][part]
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                time.sleep(3)  # each row starts from a rested GPU
                chunks, samples, energy = _sustained_run(step, seconds, meter)
                late = samples[len(samples) // 3:]
                smi = {key: statistics.median(s[i] for s in late) if late else float("nan")
                       for i, key in enumerate(("sm_clock_mhz", "power_w", "temperature_c"))}
                row = dict(shape=list(SUSTAINED_SHAPE), row=name, part=part, round=rnd, first_chunk_step_us=chunks[0],
                           median_step_us=statistics.median(chunks), last_chunk_step_us=chunks[-1],
                           energy_per_step_mj=energy, **smi)
                rows.append(row)
                print(f"{part:8} round {rnd} {name:15} step: first chunk {chunks[0]:7.0f} us, median "
                      f"{row['median_step_us']:7.0f} | SM clock {smi['sm_clock_mhz']:.0f} MHz, power "
                      f"{smi['power_w']:.0f} W, {smi['temperature_c']:.0f} C"
                      + ("" if energy is None else f", {energy:.0f} mJ/step"), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("kernels", "sustained", "both"), default="both")
    parser.add_argument("--sustained-parts", default="fwd+bwd,fwd,bwd step",
                        help="comma-separated steps the sustained part runs: fwd+bwd, fwd, bwd step")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each sustained row runs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.sustained_parts.split(","))
    unknown = [p for p in parts if p not in ("fwd+bwd", "fwd", "bwd step")]
    if unknown:
        parser.error(f"--sustained-parts={args.sustained_parts!r}: unknown {unknown}; expected a comma-separated "
                     "list of fwd+bwd, fwd, bwd step")
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}", flush=True)
    print("compiled programs:", triton_program.wait(600), flush=True)
    rows: list = []
    if args.part in ("kernels", "both"):
        kernels(rows)
    if args.part in ("sustained", "both"):
        sustained(rows, parts, args.seconds)
    if args.out:
        write_report(args.out, rows)


if __name__ == "__main__":
    sys.exit(main())
