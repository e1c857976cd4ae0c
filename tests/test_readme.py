"""Every ```python block of README.md runs as written, each alone in a fresh Python process.

A block stands on its own: it imports what it uses and builds its inputs (tiny shapes, tiny models
from configs, nothing downloaded), so a reader can paste any one of them. A block that cannot run on
a CPU says so in its first lines with a comment `# needs: cuda`; it is skipped, with that reason,
where torch sees no CUDA device. Blocks run with the environment a user would have: the variables
this suite sets for itself (TRITON_INTERPRET, XLA_FLAGS' simulated devices) are removed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import pytest

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")
OPEN = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*$")
NEEDS = re.compile(r"^#\s*needs:\s*(?P<what>.+?)\s*$")
KNOWN_NEEDS = ("cuda",)
SUITE_ONLY_ENV = ("TRITON_INTERPRET", "XLA_FLAGS")
TIMEOUT_S = 600


@dataclasses.dataclass(frozen=True)
class Block:
    number: int  # 1-based, in reading order
    line: int  # README line of the opening fence
    code: str

    @property
    def first_line(self) -> str:
        return next((text for text in self.code.splitlines() if text.strip()), "")

    @property
    def needs(self) -> list[str]:
        """What the leading `# needs: ...` comments ask for."""
        found = []
        for text in self.code.splitlines():
            if text.strip() and not text.startswith("#"):
                break
            match = NEEDS.match(text)
            if match:
                found += [w.strip() for w in match["what"].split(",")]
        return found


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a Markdown text, dedented by their fence's indent (blocks in list items)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        close = match["indent"] + "```"
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == close), None)
        if end is None:
            raise ValueError(f"README.md line {i + 1}: ```python block never closed (expected {close!r})")
        code = textwrap.dedent("\n".join(lines[i + 1:end])) + "\n"
        blocks.append(Block(number=len(blocks) + 1, line=i + 1, code=code))
        i = end + 1
    return blocks


with open(README, encoding="utf-8") as _f:
    BLOCKS = python_blocks(_f.read())


def test_the_readme_has_its_python_blocks():
    # a broken extractor would make the test below pass vacuously
    assert len(BLOCKS) >= 8, [b.first_line for b in BLOCKS]
    for block in BLOCKS:
        unknown = [w for w in block.needs if w not in KNOWN_NEEDS]
        assert not unknown, (f"README.md python block {block.number} (line {block.line}): unknown "
                             f"'# needs: {', '.join(unknown)}'; expected one of {KNOWN_NEEDS}")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# The quickstart block runs by default; every block runs under --thorough (CI), each a fresh process.
@pytest.mark.parametrize("block", [pytest.param(b, marks=() if b.number == 1 else pytest.mark.thorough) for b in BLOCKS],
                         ids=[f"block{b.number}-line{b.line}" for b in BLOCKS])
def test_readme_python_block_runs_alone(block, tmp_path):
    if "cuda" in block.needs and not _cuda_available():
        pytest.skip(f"README.md python block {block.number} needs: cuda (torch sees no CUDA device)")
    script = tmp_path / f"readme_block_{block.number}.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if k not in SUITE_ONLY_ENV}
    # run from an empty folder: a block may rely only on the installed jaxattn, not on files of the checkout
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"README.md python block {block.number} (line {block.line}, first line {block.first_line!r}) exited "
        f"with status {proc.returncode}; run alone, as written:\n{proc.stderr[-3000:]}")
