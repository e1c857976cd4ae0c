"""Install hints in messages and skip reasons name installs that exist: the README installs jaxattn from
its checkout (`pip install -e ".[<extra>]"`), so a hint must name an extra pyproject.toml declares, the
same way, and never a package index name that nothing publishes."""

import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SOURCE_DIRS = ("jax_core", "bridge", "torch_api", "jaxattn", "examples", "tests", "benchmarks", "docs")
# `pip install -e ".[hf]"`, `pip install -e '.[gpu,bench]'`: the extras named after ".[".
LOCAL_EXTRAS = re.compile(r"""pip install (?:-U )?-e ["']\.\[([\w,]+)\]["']""")
# An install from a package index under the project's name, which the README never does.
INDEX_INSTALL = re.compile("jaxattn" r"\[\w")


def _declared_extras() -> set[str]:
    """The names in pyproject.toml's [project.optional-dependencies] table."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^(\w+)\s*=", table, flags=re.MULTILINE))


def _text_files():
    paths = [os.path.join(ROOT, name) for name in ("README.md", "BENCHMARKS.md")]
    for folder in SOURCE_DIRS:
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(dirpath, n) for n in names if n.endswith((".py", ".md", ".sh"))]
    for path in paths:
        with open(path, encoding="utf-8") as f:
            yield os.path.relpath(path, ROOT), f.read()


def test_hints_name_declared_extras_installed_from_the_checkout():
    declared = _declared_extras()
    assert {"gpu", "hf", "bench", "test"} <= declared, declared
    index_hints, unknown = [], []
    for path, text in _text_files():
        for number, line in enumerate(text.splitlines(), 1):
            if INDEX_INSTALL.search(line):
                index_hints.append(f"{path}:{number}: {line.strip()}")
            for extras in LOCAL_EXTRAS.findall(line):
                unknown += [f"{path}:{number}: extra {e!r}" for e in extras.split(",") if e not in declared]
    assert not index_hints, ("install hints naming the package index's 'jaxattn[...]', which the README does "
                             "not install from; write pip install -e '.[<extra>]' (from the checkout):\n"
                             + "\n".join(index_hints))
    assert not unknown, f"hints naming extras pyproject.toml does not declare ({sorted(declared)}):\n" + "\n".join(unknown)


def test_missing_gpu_packages_say_how_to_install_them(monkeypatch):
    from jaxattn.jax_core import capabilities, decode

    monkeypatch.setattr(capabilities, "has_module", lambda name: False)
    reasons = decode.kernel_reasons("triton", "gpu", "float32")
    for package in ("triton", "jax-triton"):
        assert any(r.startswith(f"{package} is not installed") and "pip install -e '.[gpu]'" in r
                   for r in reasons), reasons
    monkeypatch.setattr(capabilities, "has_module", lambda name: True)
    assert capabilities.missing_gpu_packages() == []


def test_register_transformers_without_transformers_says_how_to_install_it(monkeypatch):
    from jaxattn.torch_api import register_transformers

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install -e '.[hf]' in the jaxattn checkout")):
        register_transformers("jaxattn_hint_check")
