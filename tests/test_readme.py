"""The README's Quickstart is examples/quickstart.py, which CI runs (make example)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _code_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


def test_readme_quickstart_is_examples_quickstart() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = _code_blocks(section)
    assert len(blocks) == 1, "the Quickstart section holds one python block"
    source = (ROOT / "examples" / "quickstart.py").read_text()
    assert source.startswith('"""'), "examples/quickstart.py opens with its docstring"
    body = source.split('"""', 2)[2].lstrip("\n")  # the README shows the code without it
    assert blocks[0] == body
