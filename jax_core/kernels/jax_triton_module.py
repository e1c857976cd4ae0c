"""jax-triton, imported without its process-wide side effect on Triton's compile cache.

jax-triton sets ``TRITON_CACHE_DIR=""`` for the whole process when it is imported. Triton kernels
compiled outside JAX afterwards then have no cache directory: Triton's own launcher raises "Could
not create or locate cache dir", and torch.compile fails with "Cubin file saved by TritonBundler
not found" (Inductor collects the compiled kernels from that directory). The import below puts the
variable back as it was; jax-triton compiles as before.
"""

from __future__ import annotations

import os
import sys
import types


def jax_triton() -> types.ModuleType:
    """The `jax_triton` module (whatever `sys.modules` holds, e.g. a test's stand-in)."""
    found = sys.modules.get("jax_triton")
    if found is not None:
        return found
    before = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton as module

    if before is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = before
    return module
