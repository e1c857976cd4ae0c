"""The XLA settings of tests/conftest.py: the cheap-compile flags are added only when the installed
jaxlib defines them (XLA aborts the process on an unknown flag), and they reach XLA, except under
`--thorough`, which runs XLA's default code generation."""

import os
import shutil

import conftest
import jax
import jax.numpy as jnp
import numpy as np
import pytest


def test_flag_lookup_tells_known_flags_from_unknown_ones():
    assert conftest._xla_knows("--xla_force_host_platform_device_count=8")
    assert not conftest._xla_knows("--xla_cpu_no_such_flag_for_this_suite=1")


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="the cheap-compile flags are for CPU-only runs")
def test_cheap_compile_flags_reach_xla(request):
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not set(conftest._XLA_FLAGS) <= set(flags):
        pytest.skip(f"XLA_FLAGS came from the environment: {flags}")
    if request.config.getoption("--thorough"):
        assert not conftest._CHEAP_COMPILES
        assert not set(conftest._FAST_CPU_COMPILES) & set(flags), "--thorough runs XLA's default code generation"
        return
    assert conftest._CHEAP_COMPILES
    known = [f for f in conftest._FAST_CPU_COMPILES if conftest._xla_knows(f)]
    assert known and set(known) <= set(flags)
    # XLA accepted them (it aborts the process on an unknown flag when its CPU backend starts)
    assert float(jax.jit(lambda x: jnp.exp(x).sum())(jnp.zeros(3))) == 3.0


def test_interpreted_kernels_compile_cheaply():
    """tests/mosaic_gpu_mode.py replaces the Mosaic GPU interpreter's per-warpgroup compile step with one
    that asks for the cheap options, also under `--thorough`: an interpreted kernel compiles through it.
    A JAX release without that step keeps its own (then this skips, and those tests only run slower)."""
    mode = pytest.importorskip("mosaic_gpu_mode")
    if mode.MODE != "interpret":
        pytest.skip("the kernels are compiled for the GPU here, not interpreted")
    from jax._src.pallas.mosaic.interpret import thread_map
    if not getattr(thread_map, "_jaxattn_cheap", False):
        pytest.skip("this JAX has no `thread_map._run_jaxpr` to replace")
    from jaxattn.jax_core.kernels.flash_fwd_mgpu import flash_forward_mgpu

    before = mode._COMPILES[0]
    q = jnp.asarray(np.random.default_rng().standard_normal((1, 3, 1, 64)), jnp.float16)  # one query block
    out, _ = flash_forward_mgpu(q, q, q, scale=0.125, causal=True, block_kv=64, interpret=mode.interpret_params())
    assert out.shape == q.shape
    assert mode._COMPILES[0] > before, "the interpreter compiled its warpgroups' bodies without the cheap options"
    assert conftest.FAST_CPU_COMPILE_OPTIONS == {"xla_backend_optimization_level": 0,
                                                 "xla_cpu_use_fusion_emitters": False}
