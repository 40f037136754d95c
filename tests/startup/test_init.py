"""Tests of `tcoll.init()` under each way a job can be started, in real processes.

Each rank is a plain ``python`` subprocess running RANK_SCRIPT: it joins the
world, passes a number around a ring, sends a message to itself, and prints a
JSON report; rank 0 also says whether it is the process listening on the
rendezvous port (the store's host). Failures that need one process only run
in the test process itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.procs import clean_env, free_port

import tcoll
from tcoll import RendezvousError

pytestmark = pytest.mark.usefixtures("no_leftovers")

RANK_SCRIPT = r"""
    import json, os, sys
    import numpy as np
    import tcoll
    from tcoll.startup.rendezvous import detect


    def listening_here(port):
        # Whether this process owns the socket listening on `port` (/proc/net/tcp*, /proc/self/fd).
        inodes = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                with open(table) as handle:
                    rows = handle.read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                fields = row.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
        mine = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                mine.add(target[8:-1])
        return bool(inodes & mine)


    init_kwargs, store_port = json.loads(sys.argv[1]), int(sys.argv[2])
    source = detect(rank=init_kwargs.get("rank"), size=init_kwargs.get("size"),
                    init_method=init_kwargs.get("init_method")).source
    comm = tcoll.init(**init_kwargs)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.full(1, -1, dtype=np.int64)
    work = comm.irecv(got, left, tag=1)
    comm.send(np.array([100 + comm.rank], dtype=np.int64), right, tag=1)
    work.wait()
    mine = np.zeros(1)
    work = comm.irecv(mine, comm.rank, tag=2)
    comm.send(np.array([2.5]), comm.rank, tag=2)
    work.wait()
    report = {
        "rank": comm.rank, "size": comm.size, "source": source, "got": int(got[0]), "self": float(mine[0]),
        "transports": sorted({comm.transport(p) for p in range(comm.size) if p != comm.rank}),
        "hosts_store": listening_here(store_port) if store_port else None,
    }
    print(json.dumps(report), flush=True)
    comm.close()
"""

RING_JOB = """
    import numpy as np
    import tcoll

    comm = tcoll.init()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = np.full(1, -1, dtype=np.int64)
    work = comm.irecv(got, left)
    comm.send(np.array([comm.rank * 10], dtype=np.int64), right)
    work.wait()
    print(f"rank {comm.rank} of {comm.size} got {int(got[0])} from rank {left}")
    comm.close()
"""




def _init_ranks(popen: Any, tmp_path: Path, ranks: list[tuple[dict[str, str], dict[str, Any]]],
               store_port: int = 0, timeout: float = 40) -> list[dict[str, Any]]:
    """Start one RANK_SCRIPT process per (env, init kwargs); return their reports in rank order."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    procs = [popen([sys.executable, str(script), json.dumps(kwargs), str(store_port)], env=clean_env(**env),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for env, kwargs in ranks]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"a rank exited with {proc.returncode}:\n{err}"
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return sorted(reports, key=lambda report: report["rank"])


def _check_world(reports: list[dict[str, Any]], source: str, store_port: int = 0) -> None:
    size = len(reports)
    for rank, report in enumerate(reports):
        assert (report["rank"], report["size"], report["source"]) == (rank, size, source), report
        assert report["got"] == 100 + (rank - 1) % size, "the ring message came from the wrong rank"
        assert report["self"] == 2.5
        assert report["transports"] == ([] if size == 1 else ["shm"])  # one host: shared memory
        if store_port:
            assert report["hosts_store"] == (rank == 0), f"rank {rank}: hosts_store={report['hosts_store']}"


@pytest.fixture
def bare_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """This process's environment without launcher variables (for the tests that init in-process)."""
    for name in list(os.environ):
        if name not in clean_env():
            monkeypatch.delenv(name)
    yield monkeypatch


# -- how a job can be started ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_no_launcher_is_a_world_of_one(popen: Any, tmp_path: Path) -> None:
    reports = _init_ranks(popen, tmp_path, [({}, {})])
    _check_world(reports, "single")


@pytest.mark.timeout(60)
def test_explicit_tcp_init_method(popen: Any, tmp_path: Path) -> None:
    port = free_port()
    method = f"tcp://127.0.0.1:{port}"
    reports = _init_ranks(popen, tmp_path, [({}, {"rank": r, "size": 3, "init_method": method, "timeout": 30})
                                           for r in range(3)], store_port=port)
    _check_world(reports, "explicit", store_port=port)


@pytest.mark.timeout(60)
def test_explicit_file_init_method(popen: Any, tmp_path: Path) -> None:
    method = f"file://{tmp_path}/rendezvous.store"
    reports = _init_ranks(popen, tmp_path, [({}, {"rank": r, "size": 3, "init_method": method, "timeout": 30})
                                           for r in range(3)])
    _check_world(reports, "explicit")


@pytest.mark.timeout(60)
def test_rank_and_size_in_the_init_method_query(popen: Any, tmp_path: Path) -> None:
    port = free_port()
    reports = _init_ranks(popen, tmp_path, [({}, {"init_method": f"tcp://127.0.0.1:{port}?rank={r}&world_size=2"})
                                           for r in range(2)], store_port=port)
    _check_world(reports, "explicit", store_port=port)


def _torchrun(rank: int, size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _openmpi(rank: int, size: int, port: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "TCOLL_MASTER": f"127.0.0.1:{port}"}


def _pmi(rank: int, size: int, port: int) -> dict[str, str]:
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(rank),
            "TCOLL_MASTER": f"127.0.0.1:{port}"}


def _slurm(rank: int, size: int, port: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_LOCALID": str(rank),
            "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


LAUNCHERS = {"torchrun": _torchrun, "openmpi": _openmpi, "pmi": _pmi, "slurm": _slurm}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_launcher_environment(popen: Any, tmp_path: Path, launcher: str) -> None:
    # Rank 0 must serve the store on the port the launcher's variables name.
    port, size = free_port(), 2 if launcher == "torchrun" else 3
    reports = _init_ranks(popen, tmp_path, [(LAUNCHERS[launcher](r, size, port), {}) for r in range(size)],
                         store_port=port)
    _check_world(reports, launcher, store_port=port)


# -- ranks that cannot meet ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_missing_rank_over_tcp(bare_env: pytest.MonkeyPatch) -> None:
    port = free_port()
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        tcoll.init(rank=0, size=3, init_method=f"tcp://127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - start < 2 + 3
    assert info.value.missing == [1, 2]
    assert f"127.0.0.1:{port}" in info.value.address
    assert "[1, 2]" in str(info.value) and f"127.0.0.1:{port}" in str(info.value)


@pytest.mark.timeout(30)
def test_missing_rank_under_torchrun_env(bare_env: pytest.MonkeyPatch) -> None:
    port = free_port()
    for name, value in _torchrun(0, 2, port).items():
        bare_env.setenv(name, value)
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        tcoll.init(timeout=2)
    assert time.monotonic() - start < 2 + 3
    assert info.value.missing == [1] and "[1]" in str(info.value)
    assert f"127.0.0.1:{port}" in str(info.value)


@pytest.mark.timeout(30)
def test_missing_rank_over_file(bare_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "rendezvous.store"
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        tcoll.init(rank=1, size=3, init_method=f"file://{path}", timeout=2)
    assert time.monotonic() - start < 2 + 3
    assert info.value.missing == [0, 2]
    assert str(path) in str(info.value)


@pytest.mark.timeout(30)
def test_store_host_never_arrives(bare_env: pytest.MonkeyPatch) -> None:
    port = free_port()  # nobody serves it
    start = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        tcoll.init(rank=1, size=2, init_method=f"tcp://127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - start < 2 + 3
    assert f"127.0.0.1:{port}" in str(info.value)


# -- bad input: refused before anything is sent ----------------------------------------------


@pytest.fixture
def fake_store() -> Iterator[socket.socket]:
    """A listening socket where a store would be: the test checks nobody connected to it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        yield listener


def _nobody_connected(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return True
    conn.close()
    return False


@pytest.mark.parametrize("rank,size", [(3, 3), (5, 2), (-1, 2), (0, 0)])
def test_bad_rank_or_size_is_a_value_error_before_anything_is_sent(
        bare_env: pytest.MonkeyPatch, fake_store: socket.socket, rank: int, size: int) -> None:
    port = fake_store.getsockname()[1]
    with pytest.raises(ValueError):
        tcoll.init(rank=rank, size=size, init_method=f"tcp://127.0.0.1:{port}", timeout=2)
    assert _nobody_connected(fake_store)


def test_bad_launcher_rank_names_the_variable(bare_env: pytest.MonkeyPatch, fake_store: socket.socket) -> None:
    for name, value in _torchrun(2, 2, fake_store.getsockname()[1]).items():
        bare_env.setenv(name, value)
    with pytest.raises(ValueError, match="RANK=2"):
        tcoll.init(timeout=2)
    assert _nobody_connected(fake_store)


# -- tcoll run -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_tcoll_run_ring(popen: Any, tmp_path: Path) -> None:
    (tmp_path / "ring.py").write_text(textwrap.dedent(RING_JOB))
    proc = popen([sys.executable, "-m", "tcoll", "run", "-n", "3", "ring.py"], cwd=tmp_path, env=clean_env(),
                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=45)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    for rank in range(3):
        left = (rank - 1) % 3
        assert f"[{rank}] rank {rank} of 3 got {left * 10} from rank {left}" in lines, out
    assert len(lines) == 3, out
