"""Triton's compiler reads a module global inside a `@triton.jit` function only when it is a
`tl.constexpr(...)` instance (or a module, or another jitted function); its CPU interpreter, which runs
the kernels in the CPU suite, reads any global. This checks every kernel module for globals the
compiler would refuse, so the rule is kept where no GPU runs the compiler."""

import builtins
import dis
import importlib
import pkgutil
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from jaxattn.jax_core import kernels  # noqa: E402

# `triton.jit` makes a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction.
_JITTED = tuple(t for t in (getattr(triton.runtime, "JITFunction", None),
                            getattr(getattr(triton.runtime, "interpreter", None), "InterpretedFunction", None)) if t)


def _triton_modules():
    for info in pkgutil.iter_modules(kernels.__path__):
        if info.name.endswith("_triton"):
            yield importlib.import_module(f"{kernels.__name__}.{info.name}")


def _refused_globals(module) -> list[str]:
    refused = []
    for name, fn in vars(module).items():
        if not isinstance(fn, _JITTED) or fn.fn.__module__ != module.__name__:
            continue
        # Global loads only (co_names holds attribute names too: `k.T`, `tl.load`).
        for used in {i.argval for i in dis.get_instructions(fn.fn) if i.opname == "LOAD_GLOBAL"}:
            if used not in vars(module):
                continue  # a builtin
            value = vars(module)[used]
            if isinstance(value, (types.ModuleType, tl.constexpr, *_JITTED)):
                continue
            if used in vars(builtins):
                continue
            refused.append(f"{module.__name__}.{name} reads global {used} = {value!r}")
    return refused


def test_kernels_read_only_globals_the_compiler_accepts():
    modules = list(_triton_modules())
    assert len(modules) >= 5, [m.__name__ for m in modules]
    refused = [line for m in modules for line in _refused_globals(m)]
    assert not refused, "make them tl.constexpr(...) instances:\n" + "\n".join(refused)


def test_the_check_sees_a_plain_global():
    """A module with a float global read by a kernel, the case the compiler refuses (written to a file:
    triton.jit reads its function's source)."""
    source = ("import triton\nimport triton.language as tl\nSCALE = 2.0\n"
              "@triton.jit\ndef kernel(X):\n    tl.store(X, tl.load(X) * SCALE)\n")
    import os
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "probe_triton.py")
        with open(path, "w") as f:
            f.write(source)
        sys.path.insert(0, folder)
        try:
            module = importlib.import_module("probe_triton")
            assert _refused_globals(module) == ["probe_triton.kernel reads global SCALE = 2.0"]
        finally:
            sys.path.remove(folder)
            sys.modules.pop("probe_triton", None)
