"""The behaviours torch's own distributed suite checks on gloo, on the tcoll backend (3 ranks, one spawn).

Each test is one check of tests/helpers/torch_parity.py; all run in the same
three processes (importing torch takes seconds), and each test reads whether
its check failed on any rank.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("torch")

from helpers import torch_parity, torch_workers  # noqa: E402
from helpers.procs import free_port  # noqa: E402

SIZE = 3


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """{check name: [what failed on each rank where it failed]} from one run of every check."""

    out = tmp_path_factory.mktemp("parity")
    torch_workers.spawn(torch_parity.run_all, SIZE, free_port(), str(out))
    found: dict[str, list[str]] = {}
    for rank in range(SIZE):
        with open(os.path.join(out, f"rank{rank}.json")) as handle:
            for name, text in json.load(handle).items():
                found.setdefault(name, []).append(f"rank {rank}: {text}")
    return found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("check", [c.__name__ for c in torch_parity.CHECKS])
def test_parity(check: str, failures: dict[str, list[str]]) -> None:
    assert check not in failures, "\n".join(failures[check])
