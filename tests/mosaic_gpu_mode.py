"""Where the Pallas Mosaic GPU kernel tests run: compiled on an sm90 GPU, else in Mosaic GPU's interpret
mode on the CPU (a GPU of another generation skips). Test modules import `MODE`, `pytestmark`,
`fresh_interpreter` (an autouse fixture) and `interpret_params` from here.
"""

import pytest

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
