"""Data-movement algorithms: every broadcast, all_gather, gather and scatter algorithm, checked against NumPy.

Rank r's data is a known function of (r, index), so every rank can compute
what it must end up with. Thread ranks cover the breadth (world sizes 1-8, 13 and 16,
every algorithm, counts 0, 1, 5 and 3*size+2, several roots, four dtypes,
uneven counts, tiny pipeline chunks); one process slice runs everything
over shm and tcp. Each rank returns a list of what went wrong, so a failure
names the algorithm, the arguments and the rank.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from helpers.cases import runnable
from tcoll.algos.registry import COLLECTIVES, REGISTRY, Costs

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
DTYPES = [np.dtype(np.float32), np.dtype(np.int8), np.dtype(np.complex128), np.dtype(np.bool_)]
MOVEMENT = ("broadcast", "all_gather", "gather", "scatter")


def data(rank: int, count: int, dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s `count` elements: a function of (rank, index, salt) that differs between ranks."""
    index = np.arange(count, dtype=np.int64)
    values = (rank * 37 + index * 11 + salt * 5 + 3) % 101
    if dtype.kind == "b":
        return ((values + rank) % 3 == 0).astype(dtype)
    if dtype.kind == "c":
        return (values + 1j * (rank - index)).astype(dtype)
    return (values - 50).astype(dtype)


def blocks(counts: list[int], dtype: np.dtype, salt: int = 0) -> np.ndarray:
    """Every rank's block, end to end in rank order."""
    parts = [data(r, n, dtype, salt) for r, n in enumerate(counts)]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


def _roots(size: int) -> list[int]:
    return sorted({0, size - 1, size // 2})


def _read_only(arr: np.ndarray) -> np.ndarray:
    arr.flags.writeable = False  # an algorithm that writes into its input fails loudly
    return arr


def _check(errors: list[str], got: Any, want: np.ndarray, what: str) -> None:
    if got is None or got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        errors.append(f"{what}: got {got!r}, want {want!r}")


# -- the flat algorithms, run directly --------------------------------------------------------


def run_broadcast(comm: tcoll.Communicator, name: str, count: int, dtype: np.dtype, root: int,
                  errors: list[str]) -> None:
    buf = data(root, count, dtype, 1) if comm.rank == root else np.zeros(count, dtype=dtype)
    comm.core.dispatch.call_algorithm("broadcast", name, buf, root)
    _check(errors, buf, data(root, count, dtype, 1), f"broadcast {name} count={count} {dtype} root={root}")


def run_all_gather(comm: tcoll.Communicator, name: str, counts: list[int], dtype: np.dtype,
                   errors: list[str]) -> None:
    want = blocks(counts, dtype, 2)
    start = sum(counts[:comm.rank])
    out = np.zeros(sum(counts), dtype=dtype)
    out[start:start + counts[comm.rank]] = data(comm.rank, counts[comm.rank], dtype, 2)
    comm.core.dispatch.call_algorithm("all_gather", name, out, counts)
    _check(errors, out, want, f"all_gather {name} counts={counts} {dtype}")


def run_gather(comm: tcoll.Communicator, name: str, counts: list[int], dtype: np.dtype, root: int,
               errors: list[str]) -> None:
    send = _read_only(data(comm.rank, counts[comm.rank], dtype, 3))
    out = None
    if comm.rank == root:
        start = sum(counts[:root])
        out = np.zeros(sum(counts), dtype=dtype)
        out[start:start + counts[root]] = send
    comm.core.dispatch.call_algorithm("gather", name, send, out, counts, root)
    what = f"gather {name} counts={counts} {dtype} root={root}"
    _check(errors, send, data(comm.rank, counts[comm.rank], dtype, 3), f"{what} (send changed)")
    if comm.rank == root:
        _check(errors, out, blocks(counts, dtype, 3), what)


def run_scatter(comm: tcoll.Communicator, name: str, counts: list[int], dtype: np.dtype, root: int,
                errors: list[str]) -> None:
    mine = data(comm.rank, counts[comm.rank], dtype, 4)
    send = _read_only(blocks(counts, dtype, 4)) if comm.rank == root else None
    out = mine.copy() if comm.rank == root else np.zeros(counts[comm.rank], dtype=dtype)
    comm.core.dispatch.call_algorithm("scatter", name, send, out, counts, root)
    what = f"scatter {name} counts={counts} {dtype} root={root}"
    _check(errors, out, mine, what)
    if send is not None:
        _check(errors, send, blocks(counts, dtype, 4), f"{what} (send changed)")


def uneven_counts(size: int) -> list[list[int]]:
    """Per-rank counts that differ, with zeros among them (and one all-zero case)."""
    return [[(r * 3) % 4 for r in range(size)], [(r * 3 + 1) % 4 * 3 for r in range(size)],
            [0] * size, [5 if r == size - 1 else 0 for r in range(size)]]


def sweep(comm: tcoll.Communicator, dtypes: list[np.dtype] = DTYPES) -> list[str]:
    """Every algorithm of the four collectives, every count, dtype and root; returns what failed."""
    size, errors = comm.size, []
    counts_list = [0, 1, 5, 3 * size + 2]
    for dtype in dtypes:
        for count in counts_list:
            for root in _roots(size):
                for name in runnable(comm, "broadcast"):
                    run_broadcast(comm, name, count, dtype, root, errors)
                for name in runnable(comm, "gather"):
                    run_gather(comm, name, [count] * size, dtype, root, errors)
                for name in runnable(comm, "scatter"):
                    run_scatter(comm, name, [count] * size, dtype, root, errors)
            for name in runnable(comm, "all_gather"):
                run_all_gather(comm, name, [count] * size, dtype, errors)
    for counts in uneven_counts(size):
        for dtype in dtypes[:2]:
            for name in runnable(comm, "all_gather"):
                run_all_gather(comm, name, counts, dtype, errors)
            for root in range(size):
                for name in runnable(comm, "gather"):
                    run_gather(comm, name, counts, dtype, root, errors)
                for name in runnable(comm, "scatter"):
                    run_scatter(comm, name, counts, dtype, root, errors)
    return [f"rank {comm.rank}: {e}" for e in errors]


def sweep_large(comm: tcoll.Communicator) -> list[str]:
    """Counts spanning many pipeline chunks (run with a tiny coll_chunk)."""
    size, errors = comm.size, []
    for dtype in (np.dtype(np.float32), np.dtype(np.int8)):
        for root in _roots(size):
            for name in runnable(comm, "broadcast"):
                run_broadcast(comm, name, 301 * size + 7, dtype, root, errors)
        counts = [40 + 13 * r for r in range(size)]
        for name in runnable(comm, "all_gather"):
            run_all_gather(comm, name, counts, dtype, errors)
        for name in runnable(comm, "gather"):
            run_gather(comm, name, counts, dtype, size - 1, errors)
        for name in runnable(comm, "scatter"):
            run_scatter(comm, name, counts, dtype, size // 2, errors)
    return [f"rank {comm.rank}: {e}" for e in errors]


# -- the public methods, on 2-D arrays --------------------------------------------------------


def public_api(comm: tcoll.Communicator) -> list[str]:
    """comm.broadcast / all_gather / gather / scatter with algorithm=name on (3, 4) arrays."""
    size, rank, errors = comm.size, comm.rank, []
    shape = (3, 4)

    def mat(r: int, salt: int) -> np.ndarray:
        return data(r, 12, np.dtype(np.float32), salt).reshape(shape)

    for root in _roots(size):
        for name in runnable(comm, "broadcast"):
            x = mat(root, 5) if rank == root else np.zeros(shape, dtype=np.float32)
            _check(errors, comm.broadcast(x, root, algorithm=name), mat(root, 5), f"comm.broadcast {name} {root}")
        stacked = np.stack([mat(r, 6) for r in range(size)])
        for name in runnable(comm, "gather"):
            got = comm.gather(mat(rank, 6), root, algorithm=name)
            if rank == root:
                _check(errors, got, stacked, f"comm.gather {name} root={root}")
            elif got is not None:
                errors.append(f"comm.gather {name} root={root}: non-root got {got!r}")
        for name in runnable(comm, "scatter"):
            chunks = stacked if rank == root else None
            _check(errors, comm.scatter(chunks, root, algorithm=name), mat(rank, 6), f"comm.scatter {name} {root}")
    for name in runnable(comm, "all_gather"):
        got = comm.all_gather(mat(rank, 7), algorithm=name)
        _check(errors, got, np.stack([mat(r, 7) for r in range(size)]), f"comm.all_gather {name}")
    return [f"rank {rank}: {e}" for e in errors]


def everything(comm: tcoll.Communicator) -> list[str]:
    """The process slice: the sweep (two dtypes), the chunked sweep and the public methods."""
    return sweep(comm, DTYPES[1:3]) + sweep_large(comm) + public_api(comm)


def _failures(results: list[list[str]]) -> str:
    lines = [line for rank_errors in results for line in rank_errors]
    return "\n".join(lines[:40]) + (f"\n... and {len(lines) - 40} more" if len(lines) > 40 else "")


# -- tests -----------------------------------------------------------------------------------


def test_registered_names() -> None:
    assert set(tcoll.algorithms("broadcast")) == {"binomial", "scatter_allgather", "chain", "shm", "hierarchical"}
    assert set(tcoll.algorithms("all_gather")) == {"ring", "recursive_doubling", "bruck", "shm", "hierarchical"}
    assert tcoll.algorithms("gather") == ["linear", "binomial", "shm"]
    assert tcoll.algorithms("scatter") == ["linear", "binomial", "shm"]
    assert all(info.uneven and info.ordered for c in MOVEMENT for info in REGISTRY[c].values())
    assert set(MOVEMENT) <= set(COLLECTIVES)


def test_costs() -> None:
    costs = Costs(alpha=1e-5, beta=1e-9, gamma=1e-9)
    for collective in MOVEMENT:
        for info in REGISTRY[collective].values():
            if info.hierarchical:  # costed on a Topology: tests/algos/test_hierarchy.py
                continue
            assert info.cost(costs, 1 << 20, 1) == 0.0, info.name
            for size in (2, 3, 8, 64):
                small, large = info.cost(costs, 8, size), info.cost(costs, 1 << 24, size)
                assert 0 < small < large, (collective, info.name, size)
            assert info.summary and info.run.__doc__.count("\n") >= 3, info.name
    # the large-message broadcasts beat the binomial tree on big data, not on small
    by_name = REGISTRY["broadcast"]
    assert by_name["scatter_allgather"].cost(costs, 1 << 26, 8) < by_name["binomial"].cost(costs, 1 << 26, 8)
    assert by_name["binomial"].cost(costs, 8, 8) < by_name["scatter_allgather"].cost(costs, 8, 8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [*SIZES, 13, 16])
def test_sweep_threads(size: int) -> None:
    results = tcoll.spawn(sweep, size, threads=True, timeout=100)
    assert not any(results), _failures(results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_multi_chunk_threads(size: int) -> None:
    results = tcoll.spawn(sweep_large, size, threads=True, timeout=100, coll_chunk="64")
    assert not any(results), _failures(results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [1, 2, 5, 8])
def test_public_methods_threads(size: int) -> None:
    results = tcoll.spawn(public_api, size, threads=True, timeout=100, coll_chunk="64")
    assert not any(results), _failures(results)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport,size", [("shm", 3), ("shm", 5), ("tcp", 4)])
def test_processes(transport: str, size: int) -> None:
    results = tcoll.spawn(everything, size, timeout=150, transport=transport, coll_chunk="256")
    assert not any(results), _failures(results)
