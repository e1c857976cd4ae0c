"""Shared pytest setup: must run before anything imports jax."""

import os
import pathlib
import shutil
import sys

import pytest

# Eight virtual CPU devices so that multi-device mesh tests run in-process.
_XLA_FLAGS = ["--xla_force_host_platform_device_count=8"]

# Most of the CPU suite's time is XLA:CPU compiling hundreds of small programs. Without a GPU the
# suite asks XLA for cheap compiles: LLVM without its optimisation passes, and the classic elemental
# emitters instead of the MLIR fusion emitters (the newer path, several times dearer to compile).
# XLA's graph passes still run, the programs compute the same operations, only their machine code
# is slower, which on the suite's tiny shapes is not noticeable; the JAX-heavy files take about half
# the time. Tolerances and oracles are unchanged. `--thorough` keeps XLA's default code generation
# (what users run), so CI's second command covers it. XLA_FLAGS set in the environment replace all
# of this (e.g. `XLA_FLAGS=--xla_force_host_platform_device_count=8 pytest`).
_FAST_CPU_COMPILES = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
# The same as per-compile options (`Lowered.compile(compiler_options=...)`), typed as XLA wants them.
FAST_CPU_COMPILE_OPTIONS = {name: {"false": False, "true": True}.get(value, value if not value.isdigit() else int(value))
                            for name, _, value in (f.lstrip("-").partition("=") for f in _FAST_CPU_COMPILES)}


def _xla_knows(flag):
    """Whether the installed jaxlib defines `flag`: XLA aborts the process on an unknown one, and
    flags come and go between releases. Looks for the name in jaxlib's libraries without loading them."""
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    name = flag.lstrip("-").split("=")[0].encode()
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in pathlib.Path(folder).glob("*.so"):
            with open(lib, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                if data.find(name) >= 0:
                    return True
    return False


# Triton picks the interpreter or the compiler once per process (@triton.jit reads TRITON_INTERPRET
# when a kernel is decorated), so the choice is made here, before anything imports triton, for the
# whole session: without a GPU every kernel runs under the interpreter on CPU tensors; with one,
# every kernel runs compiled, and the Triton kernel tests (test_flash_triton_fwd.py, ..._bwd.py,
# test_skip_table_triton.py, ...) use CUDA tensors. No test file sets TRITON_INTERPRET itself: one
# that did would switch every later kernel of a GPU session to the interpreter.
_HAS_GPU = bool(shutil.which("nvidia-smi"))
# The choice is read off the command line before pytest parses options (XLA may start sooner) and left
# in the environment: pytest-xdist's workers (`pytest -n 2`) do not get the command line, they
# inherit the environment of the run that started them.
_CHEAP_COMPILES = os.environ.setdefault(
    "JAXATTN_TESTS_CHEAP_COMPILES", "0" if _HAS_GPU or "--thorough" in sys.argv[1:] else "1") == "1"
if not _HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if _CHEAP_COMPILES:
    _XLA_FLAGS += [f for f in _FAST_CPU_COMPILES if _xla_knows(f)]
os.environ.setdefault("XLA_FLAGS", " ".join(_XLA_FLAGS))

# Hypothesis profiles (tests/test_reliability_randomized.py): "ci" (the default: few examples per test)
# and "thorough" (>= 1000 per test). Pick one with `--hypothesis-profile=thorough` or
# JAXATTN_HYPOTHESIS_PROFILE=thorough. Failing examples are kept under .pytest_cache/ (git-ignored).
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

settings.register_profile(
    "ci", max_examples=12, deadline=None, print_blob=True, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=DirectoryBasedExampleDatabase(pathlib.Path(__file__).parent.parent / ".pytest_cache" / "hypothesis"),
)
settings.register_profile("thorough", settings.get_profile("ci"), max_examples=1000)
settings.load_profile(os.environ.get("JAXATTN_HYPOTHESIS_PROFILE", "ci"))


# The default run is the quick suite (every implementation, launcher, API and feature on
# representative grids, the Triton interpreter on the smallest shapes); `--thorough` adds the tests
# and parametrisations marked `thorough`: exhaustive grids, randomized sweeps and long interpreter
# runs. `pytest --thorough` is the whole suite; `pytest --thorough -m thorough` only what the default
# run skips (CI runs both, with `-n 2 --dist loadfile`). The Hypothesis profile is chosen apart from this option:
# `--thorough` runs the randomized tests at the "ci" profile's counts.
pytest_plugins = ("pytester",)  # tests/test_thorough_option.py runs this file in a scratch project

THOROUGH_REASON = "thorough: exhaustive grid or long run; run with --thorough"


def pytest_addoption(parser):
    parser.addoption("--thorough", action="store_true", default=False,
                     help="also run the tests marked thorough (exhaustive grids, randomized sweeps, "
                          "long interpreter runs)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--thorough"):
        return
    skip = pytest.mark.skip(reason=THOROUGH_REASON)
    for item in items:
        if item.get_closest_marker("thorough") is not None:
            item.add_marker(skip)


@pytest.fixture
def registry_cleanup():
    """Implementations a test registers are gone after it (the registry as it was before)."""
    from jaxattn.jax_core import AttentionRegistry

    before = dict(AttentionRegistry._impls)
    yield
    AttentionRegistry._impls.clear()
    AttentionRegistry._impls.update(before)
