"""The docs stay true to the code: every runnable ```python block of docs/*.md and README.md runs.

The rule, also stated in docs/index.md:

- a ```python block that is valid Python on its own is a complete program: it runs as it stands,
  in its own interpreter, and must exit with status 0. A page's programs run in order in one
  fresh temporary directory, as a reader would run them: a later one may read what an earlier
  one wrote;
- a block that is not valid Python on its own (top-level ``await`` or ``async with``, signatures
  with ``...``) is an excerpt and is not run;
- a block right after a ``<!-- fragment -->`` line is an excerpt too, whatever it holds
  (a module meant to live in a package, a snippet that needs names from the page).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
FRAGMENT = "<!-- fragment -->"
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    source: str
    marked_fragment: bool

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    def is_program(self) -> bool:
        if self.marked_fragment:
            return False
        try:
            compile(self.source, self.id, "exec")
        except SyntaxError:
            return False
        return True


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(page, line, m.group(1), before == FRAGMENT))
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PROGRAMS = [b for b in ALL if b.is_program()]


def test_the_rule_finds_the_pages_and_their_programs() -> None:
    """Guards the fence pattern itself: a change that matched nothing would pass vacuously."""
    assert (REPO / "docs" / "index.md") in PAGES
    assert any(b.page.name == "index.md" for b in PROGRAMS)
    sample = "text\n<!-- fragment -->\n```python\nx = 1\n```\n\n```python\nawait f()\n```\n"
    page = REPO / "docs" / "_sample.md"
    found = [
        Block(page, 0, m.group(1), i == 0)
        for i, m in enumerate(_FENCE.finditer(sample))  # same pattern the pages go through
    ]
    assert [b.source for b in found] == ["x = 1\n", "await f()\n"]
    assert [b.is_program() for b in found] == [False, False]
    assert Block(page, 0, "x = 1\n", False).is_program()


PAGES_WITH_PROGRAMS = sorted({b.page for b in PROGRAMS})


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page", PAGES_WITH_PROGRAMS, ids=[str(p.relative_to(REPO)) for p in PAGES_WITH_PROGRAMS]
)
def test_doc_programs_run(page: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("AIOCKPT_ROOT", None)  # the program decides where it writes
    work = tmp_path / "work"
    work.mkdir()
    for i, block in enumerate(b for b in PROGRAMS if b.page == page):
        script = tmp_path / f"block{i}.py"  # outside the work dir: programs may list it
        script.write_text(block.source)
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, (
            f"the program at {block.id} exited with {proc.returncode}\n--- stdout\n"
            f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
        )
