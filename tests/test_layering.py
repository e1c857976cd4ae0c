"""The package layering, read from the source: jax_core is pure JAX (never torch), bridge knows
nothing of attention (neither jax_core nor torch_api), and torch_api only translates torch calls
(no JAX of its own: its JAX functions live in jax_core and run through the bridge).

Imports are read statement by statement with `ast`, so a docstring or comment that mentions a
package does not count, and an import inside a function does."""

from __future__ import annotations

import ast
import pathlib
import re

import jaxattn.bridge as bridge
import jaxattn.jax_core as jc
import jaxattn.torch_api as torch_api

#: torch_api modules allowed to import jax, each with the reason (none may need to).
TORCH_API_JAX_ALLOWED: dict[str, str] = {}


def _sources(package) -> list[pathlib.Path]:
    return sorted(pathlib.Path(package.__file__).parent.rglob("*.py"))


def imported_modules(source: str) -> list[str]:
    """Every module a source imports, as written: absolute names, relative ones with their leading
    dots, and string arguments of `importlib.import_module` / `__import__` calls."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                names.append(node.args[0].value)
    return names


def _imports_package(names: list[str], package: str) -> list[str]:
    return [n for n in names if n == package or n.startswith(package + ".")]


def _imports_sibling(names: list[str], sibling: str) -> list[str]:
    """Imports of a sibling subpackage of jaxattn, relative (..sibling) or absolute (jaxattn.sibling)."""
    pattern = re.compile(rf"^(\.\.+|jaxattn\.){sibling}(\.|$)")
    return [n for n in names if pattern.match(n)]


def test_imported_modules_reads_statements_not_text():
    source = '"""import jax"""\n# import jax\nfrom jax import numpy\nimport jax.numpy as jnp\nimport torch, os\n' \
             'def f():\n    import jax.sharding\n    importlib.import_module("jax")\n    from ..jax_core import calls\n'
    names = imported_modules(source)
    assert _imports_package(names, "jax") == ["jax", "jax.numpy", "jax.sharding", "jax"]
    assert _imports_package(names, "torch") == ["torch"]
    assert _imports_sibling(names, "jax_core") == ["..jax_core"]
    assert _imports_package(["jaxattn", "jax_triton", "jaxlib"], "jax") == []


def test_jax_core_never_imports_torch():
    files = _sources(jc)
    assert len(files) >= 9
    pattern = re.compile(r"^\s*(import\s+torch\b|from\s+torch\b)", re.MULTILINE)
    offenders = [str(f) for f in files if pattern.search(f.read_text()) or "import torch" in f.read_text()
                 or _imports_package(imported_modules(f.read_text()), "torch")]
    assert offenders == []


def test_torch_api_never_imports_jax():
    """torch_api runs JAX only through the bridge, on functions that jax_core defines."""
    files = _sources(torch_api)
    assert len(files) >= 10
    offenders = {f.name: _imports_package(imported_modules(f.read_text()), "jax") for f in files}
    offenders = {name: found for name, found in offenders.items() if found and name not in TORCH_API_JAX_ALLOWED}
    assert offenders == {}, f"torch_api modules import jax (move the JAX code to jax_core): {offenders}"


def test_bridge_imports_neither_jax_core_nor_torch_api():
    files = _sources(bridge)
    assert len(files) >= 10
    offenders = {f.name: _imports_sibling(imported_modules(f.read_text()), "jax_core")
                 + _imports_sibling(imported_modules(f.read_text()), "torch_api") for f in files}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_allowed_torch_api_jax_imports_still_exist():
    """An allow-list entry that no longer imports jax is dropped from the list."""
    for name in TORCH_API_JAX_ALLOWED:
        source = (pathlib.Path(torch_api.__file__).parent / name).read_text()
        assert _imports_package(imported_modules(source), "jax"), name


def test_no_import_path_manipulation():
    """The three layers are found by the installed package's mapping (`[tool.setuptools.package-dir]`),
    never by editing `sys.path` or a package's `__path__` at import time."""
    import jaxattn

    roots = [pathlib.Path(m.__file__).parent for m in (jaxattn, jc, bridge, torch_api)]
    pattern = re.compile(r"\b(sys\.path|__path__)\b")
    offenders = [str(f) for root in roots for f in sorted(root.glob("*.py")) if pattern.search(f.read_text())]
    assert offenders == []
