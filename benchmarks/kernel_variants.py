"""Modified copies of a kernel module, loaded as members of the kernels' package (so that their
relative imports resolve) for the scripts that compare them with the kernel as is
(`hopper_kernels_gpu.py --part variant`, `hopper_module_counts.py --variant`)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys


def load_variant(path):
    """The module at `path`, as `jaxattn.jax_core.kernels._variant_<file stem>`."""
    name = "jaxattn.jax_core.kernels._variant_" + pathlib.Path(path).stem
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
