"""Tests of the all_to_all algorithms (pairwise, bruck) and the barrier algorithms (dissemination, tree).

Each algorithm runs directly through `comm._call_algorithm` on flat buffers
(equal and uneven counts, counts of 0 and 1, several dtypes) and through
the Communicator methods. Expected blocks are computed from the ranks'
numbers: element i of the block rank s sends to rank d is value(s, d, i).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.algos.registry import lookup, names
from tcoll.algos.select import COSTS
from tcoll.algos.topology import displacements

A2A = ["pairwise", "bruck"]
BARRIERS = ["dissemination", "tree"]


def value(src: int, dst: int, index: np.ndarray, dtype: Any) -> np.ndarray:
    return ((src * 1000 + dst * 31 + index * 7) % 127).astype(dtype)


def uneven_counts(src: int, dst: int, salt: int) -> int:
    """How many elements rank src sends rank dst: 0-4, differing per pair."""
    return (3 * src + 5 * dst + salt) % 5


def run_all_to_all(comm: tcoll.Communicator, name: str, counts: Any, dtype: Any) -> None:
    """Run all_to_all `name` with counts(src, dst) and check out and the unchanged send buffer."""
    r, p = comm.rank, comm.size
    send_counts = [counts(r, j) for j in range(p)]
    recv_counts = [counts(i, r) for i in range(p)]
    parts = [value(r, j, np.arange(send_counts[j]), dtype) for j in range(p)]
    send = np.concatenate(parts) if parts else np.empty(0, dtype)
    before = send.copy()
    out = np.full(sum(recv_counts), 99, dtype=dtype)
    at, sat = displacements(recv_counts), displacements(send_counts)
    out[at[r]:at[r + 1]] = send[sat[r]:sat[r + 1]]
    comm.core.dispatch.call_algorithm("all_to_all", name, send, out, send_counts, recv_counts)
    expected = np.concatenate([value(i, r, np.arange(recv_counts[i]), dtype) for i in range(p)])
    np.testing.assert_array_equal(out, expected, err_msg=f"{name} rank {r} of {p}")
    np.testing.assert_array_equal(send, before, err_msg=f"{name} changed its send buffer")


def exchange_battery(comm: tcoll.Communicator, marks: str | None = None) -> bool:
    """Every all_to_all and barrier check on this communicator; `marks`: a directory for barrier files."""
    for name in A2A:
        for count in (0, 1, 6):
            for dtype in (np.int64, np.float32, np.uint8):
                run_all_to_all(comm, name, lambda s, d, c=count: c, dtype)
        if lookup("all_to_all", name).uneven:
            for salt in range(3):
                run_all_to_all(comm, name, lambda s, d, k=salt: uneven_counts(s, d, k), np.float64)
        check_all_to_all_method(comm, name)
    for name in BARRIERS:
        for _ in range(3):
            comm.barrier(algorithm=name)
        comm.barrier(algorithm=name, async_op=True).wait()
        if marks is not None:
            check_barrier_files(comm, name, marks)
    return True


def check_all_to_all_method(comm: tcoll.Communicator, name: str) -> None:
    r, p = comm.rank, comm.size
    x = np.stack([value(r, j, np.arange(6), np.float64).reshape(2, 3) for j in range(p)])
    expected = np.stack([value(i, r, np.arange(6), np.float64).reshape(2, 3) for i in range(p)])
    np.testing.assert_array_equal(comm.all_to_all(x, algorithm=name), expected)
    work = comm.all_to_all(x, algorithm=name, async_op=True)
    np.testing.assert_array_equal(work.wait(), expected)


def check_barrier_files(comm: tcoll.Communicator, name: str, marks: str) -> None:
    """Each rank leaves a file before the barrier; after it, every rank's file must exist."""
    for round_ in range(3):
        path = os.path.join(marks, f"{name}-{round_}-{comm.rank}")
        with open(path, "w"):
            pass
        comm.barrier(algorithm=name)
        missing = [r for r in range(comm.size) if not os.path.exists(os.path.join(marks, f"{name}-{round_}-{r}"))]
        assert not missing, f"{name} barrier let rank {comm.rank} through before ranks {missing} arrived"


def count_through_barrier(comm: tcoll.Communicator, name: str, arrived: list[int], lock: Any) -> bool:
    """Thread ranks count arrivals per round; nobody may leave a barrier before the count is full."""
    for round_ in range(20):
        with lock:
            arrived[round_] += 1
        comm.barrier(algorithm=name)
        with lock:
            assert arrived[round_] == comm.size, (name, round_, arrived[round_])
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", range(1, 9))
def test_exchange_threads(size: int) -> None:
    assert tcoll.spawn(exchange_battery, size, threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", BARRIERS)
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_barrier_holds_everyone(name: str, size: int) -> None:
    arrived = [0] * 20
    lock = threading.Lock()
    assert tcoll.spawn(count_through_barrier, size, (name, arrived, lock), threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 5), ("tcp", 3)])
def test_exchange_processes(transport: str, size: int, tmp_path: Any) -> None:
    result = tcoll.spawn(exchange_battery, size, (str(tmp_path),), timeout=120, transport=transport)
    assert result == [True] * size


def test_registered_with_costs() -> None:
    assert set(A2A) <= set(names("all_to_all"))
    assert set(BARRIERS) <= set(names("barrier"))
    assert lookup("all_to_all", "pairwise").uneven and not lookup("all_to_all", "bruck").uneven
    for collective, algos in (("all_to_all", A2A), ("barrier", BARRIERS)):
        for name in algos:
            info = lookup(collective, name)
            for costs in COSTS.values():
                assert info.cost(costs, 1 << 20, 1) == 0.0
                assert 0 < info.cost(costs, 1 << 20, 2) <= info.cost(costs, 1 << 20, 8)
    # Bruck trades bandwidth for latency: cheaper for small blocks on many ranks, dearer for large ones.
    costs = COSTS["shm"]
    bruck, pairwise = lookup("all_to_all", "bruck").cost, lookup("all_to_all", "pairwise").cost
    assert bruck(costs, 64 * 64, 64) < pairwise(costs, 64 * 64, 64)
    assert bruck(costs, 64 << 20, 64) > pairwise(costs, 64 << 20, 64)


def bruck_refuses_uneven(comm: tcoll.Communicator) -> str:
    try:
        comm.all_to_allv([np.zeros(j + 1) for j in range(comm.size)], algorithm="bruck")
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(30)
def test_bruck_is_not_offered_for_uneven_counts() -> None:
    messages = tcoll.spawn(bruck_refuses_uneven, 2, threads=True, timeout=30)
    assert all("equal counts" in m for m in messages)
