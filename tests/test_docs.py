"""The docs show what the code prints: every `>>>` sample and every `$ tcoll ...` console sample of README.md
and docs/*.md is run, and its output compared with the text (`...` matches anything, as in doctest)."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tcoll
from helpers.procs import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Console samples that start no ranks: these are run (in a scratch directory, for the files trace writes).
RUNNABLE = ("tcoll explain ", "tcoll trace ", "tcoll --version")
_CONSOLE = re.compile(r"```console\n(.*?)```", re.S)


def _console_samples(path: Path) -> list[tuple[str, str]]:
    """(command, expected output) of each `$ tcoll ...` line of the file's console blocks."""
    samples = []
    for block in _CONSOLE.findall(path.read_text()):
        for chunk in re.split(r"^(?=\$ )", block, flags=re.M):
            if chunk.startswith("$ "):
                command, _, output = chunk[2:].partition("\n")
                samples.append((command.strip(), output))
    return samples


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_samples(path: Path) -> None:
    text = re.sub(r"^```.*$", "", path.read_text(), flags=re.M)  # a fence ends a sample's output
    test = doctest.DocTestParser().get_doctest(text, {"tcoll": tcoll, "np": np}, path.name, str(path), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0, f"{path.name}: {runner.failures} sample(s) print something else (see above)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_console_samples(path: Path, tmp_path: Path) -> None:
    checker = doctest.OutputChecker()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    for command, want in _console_samples(path):
        if not command.startswith(RUNNABLE):
            continue
        argv = [sys.executable, "-m", "tcoll", *command.split()[1:]]
        got = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path).stdout
        assert checker.check_output(want, got, doctest.ELLIPSIS), f"{path.name}: `{command}` prints\n{got}"


def test_the_samples_are_found() -> None:
    """The README's explain sample and docs/collectives.md's explain samples are among those run."""
    assert any(cmd.startswith("tcoll explain") for cmd, _ in _console_samples(ROOT / "README.md"))
    text = (ROOT / "docs" / "collectives.md").read_text()
    assert len(doctest.DocTestParser().get_examples(text)) >= 2


def test_api_reference_is_built_from_the_docstrings() -> None:
    """Rendering fails on a public name without a docstring; docs/api.md has every name and member of the code."""
    page = load_script(ROOT / "scripts" / "api_reference.py", "api_reference").render()
    for name in tcoll.__all__:
        assert f"`{name}" in page, name
    for member in ("timeout", "closed", "world_ranks", "zeros(", "add_done_callback(", "TransportError",
                   "start_method: str | None = None", "env: dict[str, str] | None = None"):
        assert member in page, member
    headings = [line for line in page.splitlines() if line.startswith("#")]
    written = [line for line in (ROOT / "docs" / "api.md").read_text().splitlines() if line.startswith("#")]
    assert written == headings, "docs/api.md is out of date: run scripts/api_reference.py"
