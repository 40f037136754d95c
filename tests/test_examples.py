"""The README's demo runs under the launcher and cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "tcoll", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def _tcoll_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("tcoll-")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nprocs,mib", [(1, "1"), (3, "4"), (8, "8")])
def test_ring_example(nprocs: int, mib: str) -> None:
    before = _tcoll_segments()
    result = _run("-n", str(nprocs), "examples/ring.py", "--mib", mib)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for rank in range(nprocs):
        assert any(line.startswith(f"[{rank}] ok: {nprocs - 1} hops checked") for line in lines), result.stdout
    if nprocs > 1:
        assert "transport shm" in result.stdout
    assert _tcoll_segments() <= before
