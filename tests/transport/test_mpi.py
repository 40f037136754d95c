"""The MPI transport under mpiexec: every collective over TCOLL_TRANSPORT=mpi, meeting through MPI itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import free_port

from tcoll.bench.compare import mpiexec
from tcoll.transport.mpi import MpiTransport

TESTS = Path(__file__).resolve().parents[1]
WORKER = str(TESTS / "hosts" / "host_worker.py")
MPIEXEC = mpiexec()  # MPICH's from PyPI beside this Python, else the one on PATH

pytestmark = pytest.mark.skipif(not (MPIEXEC and MpiTransport.available()),
                                reason="the optional extra tcoll[mpi] (mpi4py and mpiexec) is not installed")


def _mpiexec(n: int, args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TCOLL_", "MASTER_", "PMI", "OMPI_"))}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])
    return subprocess.run([MPIEXEC, "-n", str(n), sys.executable, *args], env=environ, capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


@pytest.mark.timeout(150)
def test_every_collective_over_mpi_under_mpiexec(tmp_path: Path) -> None:
    done = _mpiexec(4, [WORKER, str(tmp_path), "faults"], {"TCOLL_TRANSPORT": "mpi", "TCOLL_TIMEOUT": "60"}, 140)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["failures"] == [], f"rank {rank}: {found['failures']}"


@pytest.mark.timeout(120)
def test_bench_compares_tcoll_over_mpi() -> None:
    from tcoll.bench.plan import BenchConfig
    from tcoll.bench.runner import run_bench

    config = BenchConfig(cases=["all_reduce"], n=2, sizes=[4096], compare=["tcoll-mpi"], repeats=1, iters=3,
                         warmup=1, check=True, timeout=100)
    result = run_bench(config, note=pytest.fail)
    rows = [row for row in result["samples"] if row["impl"] == "tcoll-mpi"]
    assert rows and all(row["time"] and row["error"] is None and row["wrong"] == 0 for row in rows), rows
    assert result["info"]["tcoll-mpi"]["transports"] == ["mpi"]


@pytest.mark.timeout(90)
def test_torch_backend_over_mpi(tmp_path: Path) -> None:
    port = free_port()
    worker = str(Path(__file__).with_name("mpi_torch_worker.py"))
    done = _mpiexec(2, [worker, str(port), str(tmp_path)], {"TCOLL_TRANSPORT": "mpi", "TCOLL_TIMEOUT": "60"}, 80)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["ok", "ok"]
