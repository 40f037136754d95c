"""Jobs across hosts that are really separate: network namespaces with their own hostname and /dev/shm.

Each test builds namespace-hosts (tests/helpers/netns.py) and runs
`tcoll run --nnodes N --node-rank R --master ADDR:PORT -n P` in each. The one
skip: where namespaces cannot be made (not root).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers import netns
from helpers.procs import wait_file
from tcoll.bench.compare import mpiexec as find_mpiexec

WORKER = str(Path(__file__).with_name("host_worker.py"))

# One worker runs every test that builds namespace hosts (scripts/test runs the suite on pytest-xdist workers
# with --dist loadgroup): two bridges on the same random subnet would route each other's traffic.
pytestmark = [pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable())),
              pytest.mark.xdist_group(netns.GROUP)]


def _run_job(tmp_path: Path, nhosts: int, nprocs: int, extra: list[str], timeout: float,
             env: dict[str, str] | None = None) -> None:
    with netns.namespace_hosts(nhosts) as hosts:
        procs = hosts.tcoll_run(nprocs, [WORKER, str(tmp_path), *extra], env={"TCOLL_TIMEOUT": "60", **(env or {})})
        results = netns.wait_all(procs, timeout)
    outputs = "\n".join(f"--- host {i} (exit {code}):\n{out[-3000:]}" for i, (code, out) in enumerate(results))
    assert all(code == 0 for code, _ in results), outputs
    for rank in range(nhosts * nprocs):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["failures"] == [], f"rank {rank}: {found['failures']}\n{outputs}"


@pytest.mark.timeout(150)
def test_two_hosts_of_two_ranks_every_collective_and_torch(tmp_path: Path) -> None:
    _run_job(tmp_path, 2, 2, ["torch"], 130)


@pytest.mark.timeout(120)
def test_three_hosts_of_one_rank_every_collective(tmp_path: Path) -> None:
    # Interfaces chosen as NCCL spells it: loopback excluded (the default route would give eth0 too).
    _run_job(tmp_path, 3, 1, [], 100, {"TCOLL_SOCKET_IFNAME": "^lo,docker0"})


@pytest.mark.timeout(90)
def test_link_down_is_peer_lost_within_ten_seconds_naming_the_hosts_ranks(tmp_path: Path) -> None:
    """A host's link goes down mid-collective: the other host's ranks get PeerLostError naming its ranks."""
    worker = str(Path(__file__).with_name("link_worker.py"))
    with netns.namespace_hosts(2) as hosts:
        hosts.tcoll_run(2, [worker, str(tmp_path)], env={"TCOLL_TIMEOUT": "40"})
        for rank in range(4):
            wait_file(tmp_path / f"ready{rank}", 60)
        down_at = time.time()
        hosts.link_down(1)
        for rank in (0, 1):
            wait_file(tmp_path / f"rank{rank}.json", 30)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["error"] in ("PeerLostError", "PeerFailedError"), found
        assert "ranks 2, 3" in found["text"], found
        assert found["at"] - down_at < 10, f"rank {rank} noticed after {found['at'] - down_at:.1f} s: {found}"


@pytest.mark.timeout(90)
def test_a_vanished_host_is_peer_lost_within_tcoll_tcp_dead_after_and_its_launcher_loses_the_store(
        tmp_path: Path) -> None:
    """Host 1 is cut off while rank 0 (host 0) waits, idle, to receive from it; no socket is closed.

    Keep-alive (TCOLL_TCP_DEAD_AFTER=2) fails rank 0's connection: PeerLostError naming rank 1, long
    before TCOLL_TIMEOUT (60). Host 1's launcher finds the store gone as fast (its store client has the
    same limit; before, a request had to time out after 15 s).
    """
    worker = str(Path(__file__).with_name("silent_worker.py"))
    dead_after, liveness = 2.0, 1.0
    with netns.namespace_hosts(2) as hosts:
        procs = hosts.tcoll_run(1, [worker, str(tmp_path)],
                                env={"TCOLL_TIMEOUT": "60", "TCOLL_TCP_DEAD_AFTER": str(dead_after)})
        for rank in range(2):
            wait_file(tmp_path / f"ready{rank}", 60)
        down_at = time.time()
        hosts.link_down(1)
        wait_file(tmp_path / "rank0.json", 30)
        [(code1, out1)] = netns.wait_all(procs[1:], 30)
        launcher_done = time.time()
    found = json.loads((tmp_path / "rank0.json").read_text())
    assert found["error"] == "PeerLostError" and "rank 1" in found["text"], found
    noticed = found["at"] - down_at
    assert noticed < dead_after + liveness + 4, f"rank 0 noticed after {noticed:.1f} s: {found}"
    assert code1 == 1 and "lost the tcoll store" in out1, out1[-3000:]
    # (its store client gives up after dead_after, then tries to reconnect for 10 s before it stops its ranks)
    took = launcher_done - down_at
    assert took < dead_after + 10 + 5, f"host 1's launcher took {took:.1f} s:\n{out1[-3000:]}"


@pytest.mark.timeout(90)
def test_the_survivors_of_a_dead_host_shrink_and_run_every_collective(tmp_path: Path) -> None:
    """Host 1 of 2 dies whole (its launcher and ranks killed) mid all_reduce; host 0's ranks go on.

    They get a named error within 5 s, revoke, shrink to the two of them, and run every collective
    on the new communicator against NumPy (tests/hosts/survivor_worker.py).
    """
    worker = str(Path(__file__).with_name("survivor_worker.py"))
    with netns.namespace_hosts(2) as hosts:
        procs = hosts.tcoll_run(2, ["--keep-going", worker, str(tmp_path)], env={"TCOLL_TIMEOUT": "40"})
        for rank in range(4):
            wait_file(tmp_path / f"ready{rank}", 60)
        killed_at = time.time()
        os.killpg(procs[1].pid, signal.SIGKILL)  # the host's whole session: its launcher, and so its ranks
        for rank in (0, 1):
            wait_file(tmp_path / f"rank{rank}.json", 40)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["error"] in ("PeerLostError", "PeerFailedError", "RevokedError"), found
        assert found["at"] - killed_at < 5, f"rank {rank} noticed after {found['at'] - killed_at:.1f} s: {found}"
        assert found["checks"] is None, found["checks"]
        assert (found["rank"], found["size"]) == (rank, 2), found
        assert found["failed"] and set(found["failed"]) <= {2, 3}, found  # (the other may still be dying then)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["TCOLL_INTERHOST", "TCOLL_TRANSPORT"])
def test_mpiexec_across_hosts_every_collective_over_mpi(tmp_path: Path, mode: str) -> None:
    """MPICH's mpiexec starts 2 ranks in each of 2 hosts; they meet through MPI; MPI carries (inter-host) pairs."""
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip("the optional extra tcoll[mpi] (mpi4py and MPICH's mpiexec) is not installed")
    # TCOLL_INTERHOST=mpi: shared memory inside each host, MPI between them; TCOLL_TRANSPORT=mpi: MPI for all.
    env = {mode: "mpi", "TCOLL_TIMEOUT": "60", "EXPECT_HOSTS": "2", "EXPECT_PER_HOST": "2"}
    with netns.namespace_hosts(2) as hosts:
        proc = hosts.mpiexec(2, [sys.executable, WORKER, str(tmp_path), "faults"], env, tmp_path, mpiexec)
        [(code, out)] = netns.wait_all([proc], 130)
    assert code == 0, out[-3000:]
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["failures"] == [], f"rank {rank}: {found['failures']}\n{out[-3000:]}"


@pytest.mark.timeout(120)
def test_slurm_environment_across_hosts(tmp_path: Path) -> None:
    """The same script under Slurm's variables (as srun sets them), 2 tasks on each of 2 hosts."""
    with netns.namespace_hosts(2) as hosts:
        procs = []
        for node in range(2):
            tasks = []
            for local in range(2):
                env = {"SLURM_PROCID": 2 * node + local, "SLURM_NTASKS": 4, "SLURM_LOCALID": local,
                       "SLURM_NODEID": node, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": 77,
                       "SLURM_STEP_ID": 0}
                assigned = " ".join(f"{k}='{v}'" for k, v in env.items())
                tasks.append(f"{assigned} {sys.executable} {WORKER} {tmp_path}")
            script = f"{tasks[0]} & first=$!; {tasks[1]}; second=$?; wait $first; exit $(($? | second))"
            procs.append(hosts.start(node, ["sh", "-c", script],
                                     {"TCOLL_MASTER": f"{hosts.addrs[0]}:29500", "TCOLL_TIMEOUT": "60",
                                      "EXPECT_HOSTS": "2", "EXPECT_PER_HOST": "2"}))
        results = netns.wait_all(procs, 100)
    outputs = "\n".join(f"--- host {i} (exit {code}):\n{out[-3000:]}" for i, (code, out) in enumerate(results))
    assert all(code == 0 for code, _ in results), outputs
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert found["failures"] == [], f"rank {rank}: {found['failures']}\n{outputs}"
