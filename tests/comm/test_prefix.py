"""scan, exscan, scan_object and exscan_object against NumPy / Python references.

Every rank's input is a function of its rank (helpers.cases), so each rank
computes the prefix it must get with NumPy, in rank order: every op and
dtype pair, user ops, and a non-commutative 2x2 matrix product, with each
algorithm and the cost model's choice, blocking and async.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import tcoll
from helpers.cases import MATMUL, SOME_DTYPES, assert_reduced, make_input, op_of, runnable, valid_pairs

PAIRS = valid_pairs(SOME_DTYPES)


def _check(comm: tcoll.Communicator, collective: str, algorithm: str, count: int, async_op: bool = False) -> None:
    r, p = comm.rank, comm.size
    for name, dtype in PAIRS:
        x = make_input(r, count, dtype, name)
        before = x.copy()
        method = getattr(comm, collective)
        got = method(x, op_of(name), algorithm=algorithm, async_op=async_op)
        got = got.wait() if async_op else got
        assert got is x
        upto = r + 1 if collective == "scan" else r
        if upto == 0:
            assert np.array_equal(x.view(np.uint8), before.view(np.uint8)), "exscan changed rank 0's buffer"
            continue
        stacked = [make_input(i, count, dtype, name) for i in range(upto)]
        assert_reduced(x, stacked, name, f"{collective} {algorithm} {name} {dtype} rank {r} of {p}")


def prefix_battery(comm: tcoll.Communicator, count: int) -> bool:
    for collective in ("scan", "exscan"):
        for algorithm in ["auto", *runnable(comm, collective)]:
            _check(comm, collective, algorithm, count)
        _check(comm, collective, "auto", count, async_op=True)
    return True


def objects_battery(comm: tcoll.Communicator) -> bool:
    r, p = comm.rank, comm.size
    assert comm.scan_object(r + 1) == sum(range(1, r + 2))
    assert comm.exscan_object(r + 1) == (sum(range(1, r + 1)) if r else None)
    assert comm.scan_object([r], op=lambda a, b: a + b) == list(range(r + 1))  # rank order kept
    assert comm.exscan_object(str(r), op="sum") == ("".join(map(str, range(r))) if r else None)
    assert comm.scan_object(r % 3, op="max") == max(i % 3 for i in range(r + 1))
    assert comm.scan_object((r % 2, r), op="minloc") == (0, 0)
    matrices = [make_input(i, 2, MATMUL_DTYPE, "matmul") for i in range(p)]
    got = comm.scan_object(matrices[r], op=MATMUL)
    assert np.array_equal(got, functools.reduce(MATMUL.fn, matrices[:r + 1]))
    work = comm.exscan_object({"rank": r}, op=lambda a, b: {"rank": max(a["rank"], b["rank"])}, async_op=True)
    assert work.result() == ({"rank": r - 1} if r else None)
    return True


MATMUL_DTYPE = make_input(0, 1, np.dtype("int64"), "matmul").dtype


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_prefix_threads(size: int) -> None:
    assert tcoll.spawn(prefix_battery, size, (7,), threads=True, timeout=120) == [True] * size


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3, 4])
def test_prefix_objects_threads(size: int) -> None:
    assert tcoll.spawn(objects_battery, size, threads=True, timeout=60) == [True] * size


def pipelined(comm: tcoll.Communicator) -> bool:
    """Many chunks through the chain, and an uneven tail (coll_chunk is tiny)."""
    r = comm.rank
    for collective in ("scan", "exscan"):
        for algorithm in runnable(comm, collective):
            x = np.arange(1001, dtype=np.float64) + r
            getattr(comm, collective)(x, algorithm=algorithm)
            ranks = range(r + 1) if collective == "scan" else range(r)
            want = sum((np.arange(1001, dtype=np.float64) + i for i in ranks), np.zeros(1001)) if ranks else \
                np.arange(1001, dtype=np.float64)
            assert np.array_equal(x, want), (collective, algorithm)
    y = np.full(5, r + 1, dtype=np.int32)
    work = comm.exscan(y, "prod", async_op=True)  # async: over point-to-point, on every transport
    assert work.wait() is y and (y == (np.prod(np.arange(1, r + 1)) if r else r + 1)).all()
    for algorithm in runnable(comm, "scan"):
        m = make_input(r, 300, MATMUL_DTYPE, "matmul")
        comm.scan(m, MATMUL, algorithm=algorithm)
        want = functools.reduce(MATMUL.fn, [make_input(i, 300, MATMUL_DTYPE, "matmul") for i in range(r + 1)])
        assert np.array_equal(m, want), algorithm
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 4), ("tcp", 3)])
def test_prefix_processes(transport: str, size: int) -> None:
    # Tiny chunks and slots: many pieces through the chain and through the arena.
    assert tcoll.spawn(pipelined, size, timeout=120, transport=transport, coll_chunk=256,
                       shm_slot=4096) == [True] * size


def _outcome(call: Any) -> str:
    try:
        call()
        return "ok"
    except tcoll.TcollError as exc:
        return f"{type(exc).__name__}: {exc}"


def mismatched(comm: tcoll.Communicator) -> list[str]:
    """Rank 0 only sends in a chain: like a broadcast's root, it may learn of it at its next call."""
    comm.timeout = 20.0
    x = np.zeros(4, dtype=np.float32)
    collective = comm.scan if comm.rank == 0 else comm.exscan
    seen = [_outcome(lambda: collective(x, "sum", algorithm="linear"))]
    seen.append(_outcome(comm.barrier))
    seen.append(_outcome(lambda: comm.all_reduce(np.ones(2))))
    return seen


@pytest.mark.timeout(60)
def test_scan_against_exscan_is_a_mismatch_on_every_rank() -> None:
    for rank, seen in enumerate(tcoll.spawn(mismatched, 3, threads=True, timeout=60)):
        said = next(text for text in seen if text != "ok")
        assert said.startswith("MismatchError") and "scan(" in said and "exscan(" in said, (rank, seen)


def test_cost_model_picks_the_chain_for_large_and_doubling_for_small() -> None:
    from tcoll.algos import select

    costs = select.COSTS["shm"]
    assert select.choose("scan", 64, 8, costs).name == "recursive_doubling"
    assert select.choose("scan", 64 << 20, 8, costs).name == "linear"
    assert select.choose("exscan", 64, 8, costs).name == "recursive_doubling"
    assert select.choose("scan", 64, 8, costs, direct=True).name == "shm"  # blocking, on one host
