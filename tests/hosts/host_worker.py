"""A rank of a job across namespace-hosts (started by `tcoll run` in each host; see tests/hosts).

Usage: host_worker.py OUT_DIR [torch] [faults]

Checks the host map against the launcher's layout (nodes of TCOLL_LOCAL_SIZE
ranks), the transport of every pair, split_type("host") and leaders(); runs
every algorithm of every collective, the uneven and object collectives, and
(with "torch") the torch backend's all_reduce, all against NumPy. Writes its
failures to OUT_DIR/rank<R>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

import tcoll
import tcoll.ops
from comm.test_collectives import run_every_algorithm


def check_topology(comm: tcoll.Communicator) -> list[str]:
    """The host map, transports, host-local and leaders' communicators match the launcher's layout."""
    # tcoll run says how it laid the ranks out; under mpiexec the test does (EXPECT_*).
    per_host = int(os.environ.get("TCOLL_LOCAL_SIZE") or os.environ.get("EXPECT_PER_HOST", comm.size))
    nhosts = int(os.environ.get("TCOLL_NNODES") or os.environ.get("EXPECT_HOSTS", 1))
    forced = os.environ.get("TCOLL_TRANSPORT", "auto")
    between = "mpi" if "mpi" in (os.environ.get("TCOLL_INTERHOST"), forced) else "tcp"
    failures = []
    hosts = comm.hosts
    want = [r // per_host for r in range(comm.size)]
    if hosts.count != nhosts or hosts.host_of != want:
        failures.append(f"host map {hosts!r}, want hosts {want}")
    for peer in range(comm.size):
        if peer != comm.rank:
            kind = forced if forced != "auto" else "shm" if want[peer] == want[comm.rank] else between
            if comm.transport(peer) != kind:
                failures.append(f"rank {peer} is reached over {comm.transport(peer)}, want {kind}")
    local = comm.split_type("host")
    if local.size != per_host or local.rank != comm.rank % per_host:
        failures.append(f"split_type('host') gave rank {local.rank} of {local.size}")
    total = local.all_reduce(np.array([comm.rank], dtype=np.int64))
    if total[0] != sum(r for r in range(comm.size) if want[r] == want[comm.rank]):
        failures.append(f"host-local all_reduce gave {total}")
    if nhosts > 1 and per_host > 1 and between == "tcp":  # the cost model sees both links, picks a hierarchy
        chosen = comm.core.dispatch.choose("all_reduce", "auto", 1 << 20, tcoll.ops.OPS["sum"], blocking=True, itemsize=4)
        if not chosen.hierarchical:
            failures.append(f"all_reduce of 1 MiB across hosts chose {chosen.name}")
    if nhosts > 1 and forced == "auto" and between == "tcp" and not comm.core.engine.link_latency > 0:
        failures.append("no latency between hosts was measured at connect")
    leaders = comm.leaders()
    if (leaders is not None) != (comm.rank % per_host == 0):
        failures.append(f"leaders() gave {leaders} on local rank {comm.rank % per_host}")
    if leaders is not None:
        got = leaders.all_gather(np.array([comm.rank], dtype=np.int64))
        if got.ravel().tolist() != [h * per_host for h in range(nhosts)]:
            failures.append(f"leaders are {got.ravel().tolist()}")
    return failures


def check_uneven_and_objects(comm: tcoll.Communicator) -> list[str]:
    """The v-collectives and the object collectives."""
    failures = []
    p, rank = comm.size, comm.rank
    rows = [r + 1 for r in range(p)]
    blocks = [np.full((rows[r], 2), r, dtype=np.float64) for r in range(p)]
    if not np.array_equal(np.concatenate(comm.all_gatherv(blocks[rank])), np.concatenate(blocks)):
        failures.append("all_gatherv")
    gathered = comm.gatherv(blocks[rank], root=p - 1)
    if rank == p - 1 and not np.array_equal(np.concatenate(gathered), np.concatenate(blocks)):
        failures.append("gatherv")
    got = comm.scatterv(blocks if rank == 0 else None, root=0)
    if not np.array_equal(got, blocks[rank]):
        failures.append("scatterv")
    chunks = [np.full(r + rank + 1, rank * 10 + r, dtype=np.int32) for r in range(p)]
    got = comm.all_to_allv(chunks)
    if not all(np.array_equal(got[s], np.full(rank + s + 1, s * 10 + rank, dtype=np.int32)) for s in range(p)):
        failures.append("all_to_allv")
    x = np.arange(sum(rows), dtype=np.int64) * (rank + 1)
    part = comm.reduce_scatterv(x, rows)
    lo = sum(rows[:rank])
    if not np.array_equal(part, np.arange(lo, lo + rows[rank], dtype=np.int64) * (p * (p + 1) // 2)):
        failures.append("reduce_scatterv")
    if comm.broadcast_object({"from": 0, "rank": rank}, root=0) != {"from": 0, "rank": 0}:
        failures.append("broadcast_object")
    if comm.all_gather_object(("rank", rank)) != [("rank", r) for r in range(p)]:
        failures.append("all_gather_object")
    return failures


def check_faults(comm: tcoll.Communicator) -> list[str]:
    """A disagreement is a MismatchError on every rank; a rank that does not come is a TimeoutError."""
    failures = []
    try:
        comm.all_reduce(np.ones(10 + (comm.rank == 1)))
        failures.append("all_reduce of differing sizes passed")
    except (tcoll.MismatchError, tcoll.PeerFailedError):
        pass
    comm.barrier()
    if comm.rank == 0:
        try:
            comm.recv(np.empty(4), src=1, tag=77, timeout=0.5)
            failures.append("a receive nobody sends to completed")
        except tcoll.TimeoutError:
            pass
    comm.barrier()
    return failures


def check_torch(comm: tcoll.Communicator) -> list[str]:
    """The torch backend's all_reduce across the hosts."""
    import torch
    import torch.distributed as dist

    import tcoll.torch  # noqa: F401 - registers the backend

    dist.init_process_group("tcoll")
    try:
        t = torch.arange(1000, dtype=torch.float32) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        p = dist.get_world_size()
        want = np.arange(1000, dtype=np.float32) * (p * (p + 1) / 2)
        return [] if np.allclose(t.numpy(), want) else [f"torch all_reduce gave {t[:4]}"]
    finally:
        dist.destroy_process_group()


def main() -> None:
    out_dir = sys.argv[1]
    comm = tcoll.init()
    failures: list[str] = []
    for check in (check_topology, run_every_algorithm, check_uneven_and_objects):
        try:
            failures += check(comm)
        except Exception:  # noqa: BLE001 - reported to the test with its traceback
            failures.append(f"{check.__name__}: {traceback.format_exc()}")
    if "faults" in sys.argv[2:]:
        failures += check_faults(comm)
    if "torch" in sys.argv[2:]:
        try:
            failures += check_torch(comm)
        except Exception:  # noqa: BLE001
            failures.append(f"check_torch: {traceback.format_exc()}")
    with open(os.path.join(out_dir, f"rank{comm.rank}.json"), "w") as handle:
        json.dump({"failures": failures, "hosts": comm.hosts.host_of}, handle)
    comm.close()


if __name__ == "__main__":
    main()
