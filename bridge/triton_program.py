"""Compiled kernels run as a differentiable torch op whose autograd node is C++.

A `KernelLaunch` costs a few microseconds of Python per launch, and an `autograd.Function` adds
Python to every forward and backward. A model step that is bound by host time pays that per layer.
Once a call signature's kernels are compiled, its launches are fixed: the sizes, strides, tiles
and kernel handles no longer change, only the tensors' pointers. A *program* records them (the
buffers a forward allocates, its launches, what it returns and saves; the same for the backward),
and a small C++ extension (`triton_program.cpp`) replays it: the forward, the autograd node and
the backward run without Python, on torch's current stream, through the CUDA driver's
`cuLaunchKernel`, with torch's caching allocator. A program may also hold kernels launched by their
own compiled host program (`HostProgramLaunch`: JAX's Mosaic GPU kernels compiled for torch, see
`mosaic_launch`), called with torch's current stream and the buffers' pointers.

    >>> pid = register(num_inputs=3, forward_allocs=[...], forward_launches=[(launch, {"X": 0, ...})],
    ...                outputs=[3], saved=[0, 1, 2, 4], grad_layouts=[...], backward_allocs=[...],
    ...                backward_launches=[...], grads=[6, 7, -1], second_order_error="...")
    >>> out, = apply(pid, [x, y, z])       # same kernels, same results as the KernelLaunch path

The extension is built with torch's C++ extension tooling (a C++ compiler, no CUDA toolkit) the
first time a CUDA program is requested, in a background thread, in its own folder (`build_directory`)
and under an flock the system releases if the builder dies (`_builder_lock`: torch's own lock file,
left by a killed build, would stall every later one); until it is ready (or where it cannot be
built) `register` returns None and callers keep their Python path. Results are the same
either way: the same compiled kernels run with the same arguments. `wait()` blocks until the build
has finished (benchmarks, tests).

On by default (`JAXATTN_TRITON_PROGRAMS=0` keeps every launch on the Python path, e.g. on a host
without a C++ compiler, where the build would fail with a warning). The extension is compiled with -O3: built without
optimisation (torch's default for `cpp_extension.load`), its allocation and argument handling
cost as much host time as the Python path. Built with it, on the H100 host (B16 L512 causal GQA
forward): 15 µs per no-grad forward against 24 µs for torch's SDPA call, and a backward through
the C++ node 144 µs against torch's 223 µs (BENCHMARKS.md). Errors inside the extension come
back as values and are raised here (`_result`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from typing import Mapping, Optional, Sequence

import torch

from .triton_launch import KernelLaunch, _constexpr_names

ENV_SWITCH = "JAXATTN_TRITON_PROGRAMS"
#: Programs are never freed (the extension keeps them by id); past this many, new signatures (a
#: decoding loop meets a new cache length every step) keep the Python launch path.
MAX_PROGRAMS = 4096
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "triton_program.cpp")


class _Build:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.thread: Optional[threading.Thread] = None
        self.module = None
        self.error: Optional[BaseException] = None
        self.done = threading.Event()

    def start(self) -> None:
        with self.lock:
            if self.thread is not None:
                return
            self.thread = threading.Thread(target=self._run, name="jaxattn-triton-program-build", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        try:
            from torch.utils import cpp_extension

            directory = build_directory()
            os.makedirs(directory, exist_ok=True)
            with _builder_lock(directory):
                self.module = cpp_extension.load(name="jaxattn_triton_program", sources=[_SOURCE],
                                                 extra_cflags=["-O3"], extra_ldflags=["-ldl"],
                                                 build_directory=directory, verbose=False)
        except Exception as exc:  # no compiler, no headers: the Python path stays
            self.error = exc
            warnings.warn(f"jaxattn: the compiled launch path could not be built ({type(exc).__name__}: "
                          f"{str(exc)[:300]}); launches stay on the Python path.", RuntimeWarning, stacklevel=1)
        finally:
            self.done.set()


_build = _Build()


def build_directory() -> str:
    """Where the extension is built: under torch's extension root (`TORCH_EXTENSIONS_DIR`, else
    torch's per-user cache), one folder per Python, accelerator and torch version (a build made
    against another torch is not loaded)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    accelerator = "cpu" if torch.version.cuda is None else f"cu{torch.version.cuda.replace('.', '')}"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    torch_version = "".join(c if c.isalnum() or c in "._" else "_" for c in torch.__version__)
    return os.path.join(root, f"jaxattn_triton_program_{python}_{accelerator}_torch{torch_version}")


@contextlib.contextmanager
def _builder_lock(directory: str):
    """Held while this process builds or loads the extension. torch's own lock is a file that a builder
    removes when it finishes: one killed mid-build (Ctrl-C during a first call, a job's time limit)
    leaves it behind, and every later build waits on it forever (the programs never turn on). This
    lock is an flock, which the system releases when its holder dies: whoever holds it is the only
    live builder, so a torch lock file found then is stale and is removed."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): torch's lock alone, as torch has it
        yield
        return
    with open(os.path.join(directory, "jaxattn_build.flock"), "a+") as handle:  # closing it unlocks
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = os.path.join(directory, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        yield


def enabled() -> bool:
    """Whether compiled programs are used (the default; `JAXATTN_TRITON_PROGRAMS=0` switches them off)."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def module():
    """The extension if it is built, else None (starting its build on first request)."""
    if not enabled() or _build.error is not None:
        return None
    if _build.module is not None:
        return _build.module
    _build.start()
    return _build.module


def ready() -> bool:
    """Whether the extension is built (starting its build, in the background, on first request)."""
    return module() is not None


def wait(timeout: Optional[float] = None) -> bool:
    """Starts the build if needed and waits for it; whether the extension is usable."""
    if not enabled():
        return False
    _build.start()
    _build.done.wait(timeout)
    return _build.module is not None


def build_error() -> Optional[BaseException]:
    """Why the extension could not be built (None: built, building or not requested)."""
    return _build.error


def _launch(ext, launch: KernelLaunch, buffers: Mapping[str, int], constants: list):
    """A C++ launch of `launch` (whose compiled kernel is known) with its tensor arguments taken from
    `buffers` (kernel argument name -> buffer index), or None where the compiled path cannot run it."""
    k = launch._compiled
    if k is None:
        return None
    meta = k.metadata
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False)
            or getattr(meta, "launch_pdl", False) or getattr(meta, "global_scratch_size", 0)
            or getattr(meta, "profile_scratch_size", 0) or getattr(meta, "tensordesc_meta", None)):
        return None
    constexprs = _constexpr_names(launch.kernel)
    # Triton also compiles an integer equal to 1 as a constant: the compiled signature says which
    # arguments the kernel still takes.
    signature = getattr(getattr(k, "src", None), "signature", None) or {}
    args = []
    for name in launch.kernel.arg_names:
        if name in constexprs or signature.get(name) == "constexpr":
            continue
        if name in buffers and name in launch.tensors:
            args.append(buffers[name])
        elif name in launch.fixed:
            constants.append(launch.fixed[name].data_ptr())
            args.append(-len(constants))
        elif _is_int(launch.scalars.get(name)):
            # A runtime integer goes by value: the driver reads as many bytes as the kernel's
            # parameter has from the 64-bit slot (little-endian: an i32 is its low half). The
            # program then serves these values only, as its launch does.
            constants.append(launch.scalars[name] & 0xFFFF_FFFF_FFFF_FFFF)
            args.append(-len(constants))
        else:  # a runtime float: not taken
            return None
    if signature and sum(1 for t in signature.values() if t != "constexpr") != len(args):
        return None
    if k.function is None:
        return None
    return ext.Launch(int(k.function), list(launch.grid), 32 * int(meta.num_warps), int(meta.shared), args)


@dataclasses.dataclass(frozen=True)
class HostProgramLaunch:
    """A kernel launched by its compiled host program: `entry(function, stream, pointers)`, with
    `entry` and `function` addresses (the calling convention of JAX's Mosaic GPU kernels compiled
    for torch, `mosaic_launch.MosaicKernel.host_launch`). A program passes it its buffers' pointers
    in the order the launch lists them."""

    entry: int
    function: int


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def register(*, num_inputs: int, forward_allocs: Sequence[tuple], forward_launches: Sequence[tuple],
             outputs: Sequence[int], saved: Sequence[int], grad_layouts: Sequence[tuple],
             backward_allocs: Sequence[tuple], backward_launches: Sequence[tuple], grads: Sequence[int],
             second_order_error: str) -> Optional[int]:
    """Registers a program; its id, or None where it cannot run compiled (not built yet, a launch
    the C++ side does not take). Allocations and gradient layouts are (sizes, strides, dtype);
    launches are (KernelLaunch, {kernel tensor argument: buffer index}) with compiled kernels, or
    (HostProgramLaunch, [buffer index per pointer it takes]); see `triton_program.cpp` for how
    buffers are numbered."""
    ext = module()
    if ext is None or len(_inputs) >= MAX_PROGRAMS:
        return None
    constants: list = []
    built = []
    for group in (forward_launches, backward_launches):
        launches = [ext.host_launch(launch.entry, launch.function, [int(i) for i in buffers])
                    if isinstance(launch, HostProgramLaunch) else _launch(ext, launch, buffers, constants)
                    for launch, buffers in group]
        if any(l is None for l in launches):
            return None
        built.append(launches)

    def allocs(specs):
        return [ext.Alloc([int(n) for n in sizes], [int(s) for s in strides], dtype) for sizes, strides, dtype in specs]

    program_id = ext.register(num_inputs, allocs(forward_allocs), built[0], list(outputs), list(saved),
                              allocs(grad_layouts), allocs(backward_allocs), built[1], list(grads), constants,
                              second_order_error)
    _inputs.append(num_inputs)
    return program_id


#: Per registered program (by id), its number of inputs. Calls are checked here, not in C++: an
#: exception thrown inside the extension has been seen to crash the process on CUDA hosts whose
#: compiler differs from torch's, so the extension is only called with arguments it accepts.
_inputs: list = []


def _check(program_id: int, inputs: list) -> None:
    if not (type(program_id) is int and 0 <= program_id < len(_inputs)):
        raise ValueError(f"program_id={program_id!r}: unknown program (registered ids: 0 to {len(_inputs) - 1}).")
    if len(inputs) != _inputs[program_id]:
        raise ValueError(f"inputs: program {program_id} takes {_inputs[program_id]} tensors, got {len(inputs)}.")


def _result(got):
    """The extension's outputs, or its error (returned as ("oom" | "error", message)) raised."""
    if type(got) is tuple:
        kind, message = got
        raise (torch.OutOfMemoryError if kind == "oom" else RuntimeError)(f"triton_program: {message}")
    return got


def apply(program_id: int, inputs: list) -> list:
    """Runs a registered program on `inputs` (differentiable where they require grad)."""
    _check(program_id, inputs)
    return _result(_build.module.apply(program_id, inputs))


def forward_only(program_id: int, inputs: list) -> list:
    """Runs a registered program's forward on `inputs` without recording it for autograd (for calls
    where no input needs a gradient: no autograd node is built)."""
    _check(program_id, inputs)
    return _result(_build.module.forward_only(program_id, inputs))
