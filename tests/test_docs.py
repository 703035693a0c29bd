"""Every ```python block of README.md and docs/*.md runs as shown.

A block that cannot run alone (it needs several processes, or a model the page does not build) is
marked by a ``<!-- not-run: why -->`` line right above it, and is skipped by name, not silently.
"""

import logging
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?P<mark><!-- not-run[^\n]*-->\n)?```python\n(?P<code>.*?)```", re.S)


def blocks():
    for page in PAGES:
        text = page.read_text()
        for found in BLOCK.finditer(text):
            line = text[: found.start("code")].count("\n") + 1
            where = f"{page.relative_to(ROOT)}:{line}"
            marks = [pytest.mark.skip(reason=f"marked not-run in {where}")] if found["mark"] else []
            yield pytest.param(found["code"], where, id=where, marks=marks)


def test_the_pages_have_python_blocks_and_few_are_marked_not_run():
    found = list(blocks())
    skipped = [p for p in found if p.marks]
    assert len(found) >= 10 and len(skipped) <= len(found) // 5, [p.id for p in skipped]  # rare


@pytest.mark.parametrize(("code", "where"), list(blocks()))
def test_a_python_block_runs_as_shown(code, where, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes goes here
    package_logger = logging.getLogger("lightning_hooks")
    level = package_logger.level  # a block may route the package's logging: the other tests get it back
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    finally:
        package_logger.setLevel(level)
