"""Every code block of README.md runs as written, and prints what the README shows.

* Each ```` ```python ```` block runs alone, as a reader pastes it: in its own fresh
  Python process, twice in a row, from a scratch directory where ``tests`` points at
  the repository's tests (so ``tests/data/...`` paths resolve, as from a checkout's
  root); it must leave nothing behind in that directory (what it writes goes to a
  temporary directory). A block preceded by ``<!-- readme: needs X -->`` needs
  hardware or packages CI lacks (a GPU, torch, JAX): it is compiled, not run.
* Blocks of ``$ blobpipe ...`` lines (the command-line examples) run in a copy of
  ``tests/data/caffe/``, as the README says; the lines after each command are its
  output, compared line by line (``...`` stands for any lines).
* ``bash`` blocks (installing, the test suite, benchmarks) and ``$`` blocks of other
  programs (``torchrun``: torch is not a test dependency) are not run here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CAFFE = ROOT / "tests" / "data" / "caffe"
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
_NEEDS = re.compile(r"<!-- readme: needs ([^>]+?) -->\s*$")


@dataclass
class Block:
    lang: str
    code: str
    line: int  # where it starts in README.md
    needs: str | None


def blocks() -> list[Block]:
    text = README.read_text(encoding="utf-8")
    found = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        needs = _NEEDS.search(before)
        line = text.count("\n", 0, m.start()) + 1
        found.append(Block(m.group(1), m.group(2), line, needs.group(1) if needs else None))
    return found


def python_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang == "python"]


def cli_examples() -> list[tuple[str, list[str], int]]:
    """(command, the output shown, line) of every ``$ blobpipe`` line."""
    found = []
    for b in blocks():
        if b.lang or not b.code.startswith("$ blobpipe "):
            continue
        command, output = None, []
        for line in b.code.splitlines():
            if line.startswith("$ "):
                if command is not None:
                    found.append((command, output, b.line))
                command, output = line[2:], []
            else:
                output.append(line)
        assert command is not None
        found.append((command, output, b.line))
    return found


def test_the_readme_has_the_blocks_this_test_runs() -> None:
    assert len(python_blocks()) >= 5
    assert len(cli_examples()) >= 5
    skipped = [b for b in python_blocks() if b.needs]
    assert len(skipped) <= 2, [b.line for b in skipped]  # DLPack into torch and JAX, DDP


def test_the_readme_is_for_users() -> None:
    """The README's size, and its newcomer's path near the top."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 450
    assert len(text.split()) <= 4500
    first = "\n".join(text.splitlines()[:150])
    for step in ("list file", "convert_imageset", "Loader(", "for batch in loader"):
        assert step in first, step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", python_blocks(), ids=lambda b: f"line{b.line}")
def test_each_python_block_runs_alone_twice(tmp_path: Path, block: Block) -> None:
    code = compile(block.code, f"README.md:{block.line}", "exec")
    assert code is not None
    if block.needs:
        return  # compiled only: CI has no GPU, torch or JAX
    (tmp_path / "tests").symlink_to(ROOT / "tests")
    for run in (1, 2):
        proc = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, f"README.md:{block.line}, run {run}:\n{proc.stderr}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tests"], "the block left files"


def _line(shown: str) -> str:
    """A shown line as a pattern: exact, but for the size a file system gives a
    database (its blocks on disk), which is any number."""
    pattern = re.escape(shown.rstrip())
    return re.sub(
        r"\\\(\d+\\\.\d\\ (KiB|MiB)\\ on\\ disk", r"\\(\\d+\\.\\d\\ \1\\ on\\ disk", pattern
    )


def _matches(shown: list[str], printed: list[str]) -> bool:
    pattern = "".join(
        r"(?:.*\n)*?" if line.strip() == "..." else _line(line) + r"\n" for line in shown
    )
    return re.fullmatch(pattern, "".join(line.rstrip() + "\n" for line in printed)) is not None


@pytest.mark.timeout(120)
def test_command_line_examples_print_what_the_readme_shows(tmp_path: Path) -> None:
    work = tmp_path / "caffe"
    shutil.copytree(CAFFE, work)
    env = {**os.environ, "COLUMNS": "100"}
    for command, shown, line in cli_examples():
        args = shlex.split(command)
        assert args[0] == "blobpipe", line
        proc = subprocess.run(
            [sys.executable, "-m", "blobpipe", *args[1:]],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode == 0, f"README.md:{line}: {command}\n{proc.stderr}"
        printed = proc.stdout.splitlines()
        if shown:
            assert _matches(shown, printed), (
                f"README.md:{line}: {command}\nshown:\n"
                + "\n".join(shown)
                + "\nprinted:\n"
                + proc.stdout
            )


def test_the_documents_name_only_commands_that_exist() -> None:
    """docs/performance.md holds current results only (within 600 lines), and every
    script the README and it name is in the repository."""
    perf = ROOT / "docs" / "performance.md"
    assert len(perf.read_text(encoding="utf-8").splitlines()) <= 600
    for doc in (README, perf, ROOT / "docs" / "design.md"):
        text = doc.read_text(encoding="utf-8")
        named = set(re.findall(r"\b((?:bench|scripts|examples)/[\w./-]+\.(?:py|sh))\b", text))
        missing = sorted(p for p in named if not (ROOT / p).is_file())
        assert not missing, f"{doc.name} names {missing}"
