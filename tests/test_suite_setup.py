"""The XLA settings of tests/conftest.py: the cheap-compile flags are added only when the installed
jaxlib defines them (XLA aborts the process on an unknown flag), and they reach XLA, except under
`--thorough`, which runs XLA's default code generation."""

import os
import shutil
import sys

import conftest
import jax
import jax.numpy as jnp
import pytest


def test_flag_lookup_tells_known_flags_from_unknown_ones():
    assert conftest._xla_knows("--xla_force_host_platform_device_count=8")
    assert not conftest._xla_knows("--xla_cpu_no_such_flag_for_this_suite=1")


@pytest.mark.skipif(bool(shutil.which("nvidia-smi")), reason="the cheap-compile flags are for CPU-only runs")
def test_cheap_compile_flags_reach_xla():
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not set(conftest._XLA_FLAGS) <= set(flags):
        pytest.skip(f"XLA_FLAGS came from the environment: {flags}")
    if "--thorough" in sys.argv[1:]:
        assert not set(conftest._FAST_CPU_COMPILES) & set(flags), "--thorough runs XLA's default code generation"
        return
    known = [f for f in conftest._FAST_CPU_COMPILES if conftest._xla_knows(f)]
    assert known and set(known) <= set(flags)
    # XLA accepted them (it aborts the process on an unknown flag when its CPU backend starts)
    assert float(jax.jit(lambda x: jnp.exp(x).sum())(jnp.zeros(3))) == 3.0
