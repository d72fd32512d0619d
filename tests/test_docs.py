"""The tutorials run as written: every ```bash and ```python block of docs/tutorials/*.md, in order,
in a fresh folder, as a reader would paste them (```text blocks are shown, not run).

Conventions a tutorial may use:
- a ```python block whose first line is a comment naming a .py file (`# my_tasks.py`) is that
  file's content: it is written there, not run;
- `<!-- test: run by tests/test_x.py ... -->` on a page hands the page to that test (it needs
  what this one cannot give, such as network namespaces), and this test only checks its syntax;
- a page that calls a tool that is not installed here (kubectl, podman, ...) is skipped, saying
  which.

The syntax check of every block is fast; running a page starts real processes and is marked slow.
Everything runs on loopback, in a temporary folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((ROOT / "docs" / "tutorials").glob("*.md"))
_BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
_HANDED_OVER = re.compile(r"<!--\s*test:\s*run by (\S+)")
_FILE_COMMENT = re.compile(r"#\s*([\w./-]+\.py)\s*$")
TOOLS = ("kubectl", "podman", "docker", "helm", "kind", "minikube", "buildah")
RUN_LIMIT_S = 600


@dataclass(frozen=True)
class Block:
    language: str  # "bash" or "python"
    code: str
    line: int  # where it starts in the page, for messages


def blocks(page: Path) -> list[Block]:
    """The page's runnable blocks, in order."""
    text = page.read_text()
    found = []
    for match in _BLOCK.finditer(text):
        language = match.group(1).lower()
        if language in ("bash", "sh", "shell", "console"):
            language = "bash"
        if language in ("bash", "python"):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(language, match.group(2), line))
    return found


def handed_over(page: Path) -> str | None:
    found = _HANDED_OVER.search(page.read_text())
    return found.group(1) if found else None


def missing_tools(page: Path) -> list[str]:
    code = "\n".join(b.code for b in blocks(page))
    called = [t for t in TOOLS if re.search(rf"(^|[\s;|&(]){t}\s", code, re.M)]
    return [t for t in called if not shutil.which(t)]


def file_name(block: Block) -> str | None:
    """`# my_tasks.py` as a python block's first line: the block is that file."""
    first = block.code.split("\n", 1)[0]
    found = _FILE_COMMENT.fullmatch(first.strip())
    return found.group(1) if block.language == "python" and found else None


def test_there_are_tutorials_with_code():
    assert TUTORIALS and any(blocks(p) for p in TUTORIALS)


@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.name)
def test_every_block_parses(page: Path):
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if block.language == "python":
            compile(block.code, where, "exec")
        else:
            done = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
            assert done.returncode == 0, (where, done.stderr)


def test_a_file_block_is_written_not_run():
    assert file_name(Block("python", "# my_tasks.py\nimport torch\n", 1)) == "my_tasks.py"
    assert file_name(Block("python", "import geotrain\n", 1)) is None
    assert file_name(Block("bash", "# setup.py\n", 1)) is None


@pytest.mark.slow
@pytest.mark.parametrize("page", TUTORIALS, ids=lambda p: p.name)
def test_the_tutorial_runs_as_written(page: Path, tmp_path: Path):
    if not blocks(page):
        pytest.skip(f"{page.name} has no bash or python block")
    if handed_over(page):
        pytest.skip(f"{page.name} is run by {handed_over(page)}")
    if missing_tools(page):
        pytest.skip(f"{page.name} needs {', '.join(missing_tools(page))}, not installed here")
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # a page may name the clone's examples
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # as a reader's shell: geotrain as installed
    for block in blocks(page):
        where = f"{page.relative_to(ROOT)}:{block.line}"
        name = file_name(block)
        if name:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(block.code)
            continue
        argv = (["bash", "-euo", "pipefail", "-c", block.code] if block.language == "bash"
                else [sys.executable, "-c", block.code])  # fmt: skip
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=RUN_LIMIT_S, stdin=subprocess.DEVNULL)  # fmt: skip
        assert done.returncode == 0, (where, done.stdout[-3000:], done.stderr[-3000:])
