"""Every collective x algorithm x reduce op x dtype against NumPy, world sizes 1 to 8.

Thread ranks (loopback) give the breadth: each (collective, algorithm,
size) is one spawn that runs every op and dtype the op accepts, counts 0, 1
and one that does not divide by the world size, with a 64-byte pipeline
chunk so that larger counts take the multi-chunk paths. Process ranks over
shm and tcp run a representative slice of every algorithm.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import tcoll
from helpers.cases import (
    ALL_DTYPES, LOC_DTYPES, MATRIX, SOME_DTYPES, assert_reduced, make_input, op_of, pattern, valid_pairs,
)
from tcoll.algos.registry import lookup

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
SMALL_CHUNK = "64"
SMALL_SLOT = "256"  # shared-memory direct algorithms: several steps even for small counts
REDUCTIONS = ["all_reduce", "reduce", "reduce_scatter"]
MOVEMENTS = ["broadcast", "all_gather", "gather", "scatter", "all_to_all"]


def _cases(collectives: list[str], direct: bool = True) -> list[tuple[str, str]]:
    return [(c, a) for c in collectives for a in tcoll.algorithms(c) if direct or not lookup(c, a).direct]


def _counts_of(index: int, size: int, counts: tuple[int, ...], rotate: bool) -> tuple[int, ...]:
    """The counts case `index` runs at world `size`: all of them, or with `rotate`, the last (the multi-chunk
    one, the costly one) only where index and size have the same parity, so that across the sizes every
    case still reaches the multi-chunk path at every algorithm, at half the cost."""
    return counts if not rotate or (index + size) % 2 == 0 else counts[:-1]


def run_reduction(comm: tcoll.Communicator, collective: str, algorithm: str, pairs: list[tuple[str, np.dtype]],
                  counts: tuple[int, ...], rotate: bool = False) -> list[str]:
    """Run `collective` with `algorithm` for every (op, dtype) and count; return the failures."""
    failures: list[str] = []
    p, rank = comm.size, comm.rank
    ordered_ok = lookup(collective, algorithm).ordered
    for index, (op_name, dtype) in enumerate(pairs):
        op = op_of(op_name)
        if not op.commutative and not ordered_ok:
            continue
        for count in _counts_of(index, p, counts, rotate):
            total = count * p if collective == "reduce_scatter" else count
            inputs = [make_input(r, total, dtype, op_name) for r in range(p)]
            x = inputs[rank].copy()
            what = f"{collective}/{algorithm} op={op_name} dtype={dtype} count={total} rank={rank}"
            try:
                if collective == "all_reduce":
                    comm.all_reduce(x, op, algorithm=algorithm)
                    assert_reduced(x, inputs, op_name, what)
                elif collective == "reduce":
                    root = index % p
                    comm.reduce(x, root, op, algorithm=algorithm)
                    if rank == root:
                        assert_reduced(x, inputs, op_name, what)
                    elif not np.array_equal(x.view(np.uint8), inputs[rank].view(np.uint8)):
                        raise AssertionError(f"{what}: a non-root buffer changed")
                else:
                    part = comm.reduce_scatter(x, op, algorithm=algorithm)
                    mine = slice(rank * count, (rank + 1) * count)
                    assert_reduced(part, [a[mine] for a in inputs], op_name, what)
                    if not np.array_equal(x.view(np.uint8), inputs[rank].view(np.uint8)):
                        raise AssertionError(f"{what}: the input changed")
            except AssertionError as exc:
                failures.append(str(exc))
    return failures


def run_movement(comm: tcoll.Communicator, collective: str, algorithm: str, dtypes: list[np.dtype],
                 counts: tuple[int, ...], rotate: bool = False) -> list[str]:
    """Run a data-movement collective for every dtype, count and a rotating root; return the failures."""
    failures: list[str] = []
    p, rank = comm.size, comm.rank
    for index, dtype in enumerate(dtypes):
        for count in _counts_of(index, p, counts, rotate):
            root = (index + count) % p
            what = f"{collective}/{algorithm} dtype={dtype} count={count} root={root} rank={rank}"
            data = [pattern(r, count * 2, dtype).reshape(count, 2) for r in range(p)]
            try:
                _one_movement(comm, collective, algorithm, data, root, what)
            except AssertionError as exc:
                failures.append(str(exc))
    return failures


def _same(got: np.ndarray | None, want: np.ndarray, what: str) -> None:
    if got is None or got.shape != want.shape or got.dtype != want.dtype or \
            not np.array_equal(np.ascontiguousarray(got).view(np.uint8), np.ascontiguousarray(want).view(np.uint8)):
        raise AssertionError(f"{what}: got {got!r:.200}, want {want!r:.200}")


def _one_movement(comm: tcoll.Communicator, collective: str, algorithm: str, data: list[np.ndarray], root: int,
                  what: str) -> None:
    p, rank = comm.size, comm.rank
    if collective == "broadcast":
        x = data[rank].copy()
        comm.broadcast(x, root, algorithm=algorithm)
        _same(x, data[root], what)
    elif collective == "all_gather":
        _same(comm.all_gather(data[rank], algorithm=algorithm), np.stack(data), what)
    elif collective == "gather":
        got = comm.gather(data[rank], root, algorithm=algorithm)
        if rank == root:
            _same(got, np.stack(data), what)
        elif got is not None:
            raise AssertionError(f"{what}: a non-root got {got!r:.100}")
    elif collective == "scatter":
        chunks = np.stack([d[::-1] for d in data]) if rank == root else None
        got = comm.scatter(chunks, root, algorithm=algorithm)
        _same(got, data[rank][::-1].copy(), what)
    elif collective == "all_to_all":
        # rank r sends part j = rows of data[r] shifted by j; what arrives from i is data[i] shifted by rank
        send = np.stack([np.roll(data[rank], j, axis=0) for j in range(p)])
        _same(comm.all_to_all(send, algorithm=algorithm), np.stack([np.roll(data[i], rank, axis=0)
                                                                    for i in range(p)]), what)


def _report(failures_per_rank: list[list[str]]) -> None:
    failures = [f for rank_failures in failures_per_rank for f in rank_failures]
    assert not failures, f"{len(failures)} failures, e.g.:\n" + "\n".join(failures[:8])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("collective,algorithm", _cases(REDUCTIONS))
def test_reductions_every_op_and_dtype(collective: str, algorithm: str, size: int) -> None:
    pairs = valid_pairs(SOME_DTYPES)
    _report(tcoll.spawn(run_reduction, size, (collective, algorithm, pairs, (0, 1, 5 * size + 3), size > 2),
                        threads=True, timeout=200, coll_chunk=SMALL_CHUNK, shm_slot=SMALL_SLOT))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("collective,algorithm", _cases(MOVEMENTS))
def test_data_movement_every_dtype(collective: str, algorithm: str, size: int) -> None:
    dtypes = ALL_DTYPES + [MATRIX] + [np.dtype([("value", d), ("index", np.int64)]) for d in LOC_DTYPES[:1]]
    _report(tcoll.spawn(run_movement, size, (collective, algorithm, dtypes, (0, 1, 2 * size + 1), size > 2),
                        threads=True, timeout=200, coll_chunk=SMALL_CHUNK, shm_slot=SMALL_SLOT))


def run_every_algorithm(comm: tcoll.Communicator) -> list[str]:
    """The process-rank slice: every algorithm of every collective on a few ops and dtypes."""
    failures: list[str] = []
    pairs = [("sum", np.dtype(np.float32)), ("max", np.dtype(np.int64)), ("sum", np.dtype("bfloat16")),
             ("matmul", MATRIX)]
    one_host = all(comm.transport(peer) == "shm" for peer in range(comm.size) if peer != comm.rank)
    for collective, algorithm in _cases(REDUCTIONS, direct=one_host):
        failures += run_reduction(comm, collective, algorithm, pairs, (1, 300))
    for collective, algorithm in _cases(MOVEMENTS, direct=one_host):
        failures += run_movement(comm, collective, algorithm, [np.dtype(np.float64), np.dtype(np.int8)], (1, 300))
    for collective, algorithm in _cases(["barrier"], direct=one_host):
        comm.barrier(algorithm=algorithm)
    if not one_host:  # ranks joined by tcp: the shared-memory algorithms refuse before anything is sent
        try:
            comm.all_reduce(np.ones(4), algorithm="shm")
            failures.append("all_reduce/shm ran over tcp")
        except ValueError as exc:
            if "on this host" not in str(exc):
                failures.append(f"all_reduce/shm over tcp: unexpected message {exc}")
    return failures


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport,size", [("shm", 3), ("shm", 4), ("tcp", 3)])
def test_every_algorithm_on_processes(transport: str, size: int) -> None:
    _report(tcoll.spawn(run_every_algorithm, size, timeout=240, transport=transport, coll_chunk="256",
                        shm_slot=SMALL_SLOT))


def run_barrier(comm: tcoll.Communicator, algorithm: str, arrived: list[int], lock: threading.Lock) -> list[str]:
    failures = []
    for round_ in range(3):
        with lock:
            arrived[round_] += 1
        comm.barrier(algorithm=algorithm)
        with lock:
            seen = arrived[round_]
        if seen != comm.size:
            failures.append(f"barrier/{algorithm} round {round_}: rank {comm.rank} left with {seen} arrivals")
    return failures


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("algorithm", tcoll.algorithms("barrier"))
def test_barrier_releases_only_after_everyone_arrived(algorithm: str, size: int) -> None:
    arrived = [0, 0, 0]
    _report(tcoll.spawn(run_barrier, size, (algorithm, arrived, threading.Lock()), threads=True, timeout=50))
