"""The README's "Implementation names" table lists every registered name and alias, and only those,
each with the implementation it is an alias of (so that the table cannot drift from the registry)."""

from __future__ import annotations

import pathlib
import re

from jaxattn.jax_core import AttentionRegistry

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Implementation names"


def _table() -> dict[str, str]:
    """name -> the "alias of" column ("–" for a canonical name), from the section's table."""
    text = README.read_text()
    assert SECTION in text, f"README.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([A-Za-z0-9_]+)`", cells[0]) if line.startswith("|") else None
        if name:
            assert name.group(1) not in rows, f"{name.group(1)!r} is listed twice"
            rows[name.group(1)] = cells[1].strip("`")
    return rows


def test_every_registered_name_and_alias_is_in_the_readme_table():
    listed = _table()
    registered = AttentionRegistry.list_implementations()
    assert sorted(listed) == registered, (
        f"README {SECTION!r} lists {sorted(listed)}; the registry has {registered}: add or remove rows")


def test_the_table_says_which_implementation_each_alias_is():
    for name, alias_of in _table().items():
        canonical = AttentionRegistry.get(name).canonical_name()
        expected = "–" if canonical == name else canonical
        assert alias_of == expected, f"README row {name!r}: 'alias of' is {alias_of!r}, the registry says {expected!r}"
