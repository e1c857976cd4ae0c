"""Shared pytest setup: must run before anything imports jax."""

import os
import shutil

# Eight virtual CPU devices so that multi-device mesh tests run in-process.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# The Triton interpreter tests set TRITON_INTERPRET=1 for the whole process, which would turn the
# kernels jax-triton launches into interpreted ones; on a GPU machine the kernels are tested for
# real by test_gpu_flash.py instead.
_HAS_GPU = bool(shutil.which("nvidia-smi"))
collect_ignore = ["test_flash_triton_fwd.py", "test_flash_triton_bwd.py"] if _HAS_GPU else []
if not _HAS_GPU:
    # Without a GPU every @triton.jit kernel is decorated for the interpreter, whichever test
    # imports it first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis profiles (tests/test_reliability_randomized.py): "ci" (the default: few examples per test)
# and "thorough" (>= 1000 per test). Pick one with `--hypothesis-profile=thorough` or
# JAXATTN_HYPOTHESIS_PROFILE=thorough. Failing examples are kept under .pytest_cache/ (git-ignored).
import pathlib  # noqa: E402

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.database import DirectoryBasedExampleDatabase  # noqa: E402

settings.register_profile(
    "ci", max_examples=12, deadline=None, print_blob=True, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=DirectoryBasedExampleDatabase(pathlib.Path(__file__).parent.parent / ".pytest_cache" / "hypothesis"),
)
settings.register_profile("thorough", settings.get_profile("ci"), max_examples=1000)
settings.load_profile(os.environ.get("JAXATTN_HYPOTHESIS_PROFILE", "ci"))
