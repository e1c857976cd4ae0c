"""Where the Pallas Mosaic GPU kernel tests run: compiled on an sm90 GPU, else in Mosaic GPU's interpret
mode on the CPU (a GPU of another generation skips). Test modules import `MODE`, `pytestmark`,
`fresh_interpreter` (an autouse fixture) and `interpret_params` from here.
"""

import collections

import numpy as np
import pytest
from conftest import FAST_CPU_COMPILE_OPTIONS

jax = pytest.importorskip("jax")
try:
    from jax.experimental.pallas import mosaic_gpu  # noqa: F401 (the kernels need it importable)
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except Exception as exc:  # pragma: no cover - depends on the environment (Mosaic GPU needs absl-py)
    pytest.skip(f"Pallas Mosaic GPU or its interpreter cannot be imported ({exc!r})", allow_module_level=True)


def _mode():
    if jax.default_backend() == "cpu":
        return "interpret"
    device = jax.devices()[0]
    return "gpu" if getattr(device, "compute_capability", "") == "9.0" else None


MODE = _mode()
pytestmark = pytest.mark.skipif(MODE is None, reason="Mosaic GPU's wgmma kernels need an sm90 (Hopper) GPU")


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """A failed interpreted kernel leaves the interpreter's shared state behind; start each test clean."""
    if MODE == "interpret":
        gpu_callbacks.reset_gpu_interpret_mode_state()
    yield


def interpret_params():
    """The kernels' `interpret` argument: interpret-mode parameters on the CPU, None on the GPU."""
    return InterpretGPUParams() if MODE == "interpret" else None


# The interpreter's programs compile with conftest.py's cheap options (LLVM without its optimisation
# passes, the classic emitters) even under `--thorough`, which keeps XLA's default code generation for
# what users run on a CPU; the interpreter is not that, and compiling its programs is most of an
# interpreted kernel test's time (a thorough feature-grid case: 25-30 s with default code generation,
# 7-10 s with these, on a 2-core machine).
_KEPT_EXECUTABLES = 64
_EXECUTABLES = collections.OrderedDict()  # (body, argument types) -> its cheaply compiled executable
_COMPILES = [0]  # how many bodies were compiled through it


def _cheap_thread_compiles():
    """The interpreter compiles each warpgroup's body as an XLA program of its own, inside a callback,
    with the process's options (`_run_jaxpr` in jax/_src/pallas/mosaic/interpret/thread_map.py, jax
    0.10-0.11). Replace that step with one that asks for cheap compiles and keeps the last executables
    by body and argument types (the warpgroups and programs of a kernel share one). Where the private
    function is not there (another JAX), the interpreter keeps its own compiles."""
    try:
        from jax import core as jax_core
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:  # pragma: no cover - depends on the JAX release
        return
    if not callable(getattr(thread_map, "_run_jaxpr", None)) or getattr(thread_map, "_jaxattn_cheap", False):
        return
    def body(jaxpr, consts, *args):
        jax_core.eval_jaxpr(jaxpr, consts, *args)

    def run_jaxpr(jaxpr, consts, *args):
        key = (jaxpr, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in jax.tree.leaves((consts, args))))
        if key in _EXECUTABLES:
            _EXECUTABLES.move_to_end(key)
        else:
            lowered = jax.jit(body, static_argnums=(0,)).trace(jaxpr, consts, *args).lower()
            _EXECUTABLES[key] = lowered.compile(compiler_options=FAST_CPU_COMPILE_OPTIONS)
            _COMPILES[0] += 1
            if len(_EXECUTABLES) > _KEPT_EXECUTABLES:
                _EXECUTABLES.popitem(last=False)
        _EXECUTABLES[key](consts, *args)

    thread_map._run_jaxpr = run_jaxpr
    thread_map._jaxattn_cheap = True


if MODE == "interpret":
    _cheap_thread_compiles()


def feature_grid():
    """(L, S, alignment, window, causal) cases of the kernels' thorough feature grids: edge lengths both
    ways, each alignment, one-sided, two-sided and causal windows."""
    cases = []
    for l, s in ((97, 300), (300, 97), (255, 256), (64, 65)):
        for alignment in ("top_left", "bottom_right"):
            for window, causal in (((17, -1), False), ((-1, 0), False), ((3, 70), False), ((40, -1), True),
                                   (None, True)):
                cases.append(pytest.param(l, s, alignment, window, causal, id=f"{l}x{s}-{alignment}-{window}-{causal}"))
    return cases
