"""A long wait says so: one line per waiting rank, naming what it waits for and on whom (TCOLL_NOTICE)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tcoll.p2p import notice

SRC = Path(__file__).resolve().parents[2] / "src"

JOB = """
    import os, pathlib, time, numpy as np, tcoll
    if os.environ["RANK"] == "2":                    # late to the rendezvous: 1.5 s after the others reach it
        while not all(pathlib.Path(f"meeting{r}").exists() for r in (0, 1)):
            time.sleep(0.01)
        time.sleep(1.5)                              # the delay under test, not a synchronisation
    else:
        pathlib.Path(f"meeting{os.environ['RANK']}").touch()
    comm = tcoll.init()
    x = np.ones(8, dtype=np.float32)
    comm.all_reduce(x)                               # opens the arena
    for algorithm in ("shm", "ring"):                # a direct wait, then a point-to-point one
        if comm.rank == 1:
            time.sleep(1.5)
        comm.all_reduce(x, algorithm=algorithm)
    comm.close()
"""


@pytest.mark.timeout(120)
def test_long_waits_are_reported_once_per_rank(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(textwrap.dedent(JOB))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCOLL_")}
    env.update(PYTHONPATH=str(SRC), TCOLL_NOTICE="0.5")
    result = subprocess.run([sys.executable, "-m", "tcoll", "run", "-n", "3", "job.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "has waited" in line]
    said = {(int(m[1]), m[2], m[3]) for m in (re.match(r"\[(\d)\] tcoll: rank \d has waited \d+ s for (.*?), "
                                                       r"on rank\(s\) ([\d, ]+); it gives up after", line)
                                              for line in lines) if m}
    assert len(said) == len(lines), lines  # every line says for what and on whom, none twice
    assert {(r, "2") for r in (0, 1)} <= {(r, on) for r, what, on in said if what.startswith("the rendezvous")}
    assert {(r, "1") for r in (0, 2)} <= {(r, on) for r, what, on in said if what == "all_reduce #2 (shm)"}
    assert any(what.startswith("all_reduce #3 (ring") for _, what, _ in said), lines


def test_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(notice.ENV, raising=False)
    assert notice.notice_after() == 30.0
    monkeypatch.setenv(notice.ENV, "0")
    assert notice.notice_after() == float("inf")
