"""Every all_reduce, reduce and reduce_scatter algorithm against NumPy references.

Rank r's input is a known function of (r, index), so each rank computes the
expected result itself. A battery (`battery`) runs every registered
algorithm of the three collectives over several counts and ops, including a
non-commutative op (2x2 matrix product mod a prime, one matrix packed per
int64) for the algorithms registered ordered=True, and returns the failures
as text; thread ranks cover world sizes 1-8 and tiny chunks, and one slice
runs on processes over shm and tcp.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tcoll
from helpers.cases import runnable
from tcoll.algos.registry import Costs, lookup
from tcoll.ops import Op, as_op
from tcoll.algos.topology import split_counts

SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter")

# -- the non-commutative op: 2x2 matrices mod a prime, entries packed 15 bits apiece --------------

PRIME = 32749
_SHIFTS = np.array([0, 15, 30, 45], dtype=np.int64)


def _unpack(x: np.ndarray) -> np.ndarray:
    return (x[..., None] >> _SHIFTS) & 0x7FFF


def _pack(m: np.ndarray) -> np.ndarray:
    return (m << _SHIFTS).sum(axis=-1)


def matmul_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise product of the packed matrices a @ b (mod PRIME): associative, not commutative."""
    x, y = _unpack(a), _unpack(b)
    m = np.empty_like(x)
    m[..., 0] = (x[..., 0] * y[..., 0] + x[..., 1] * y[..., 2]) % PRIME
    m[..., 1] = (x[..., 0] * y[..., 1] + x[..., 1] * y[..., 3]) % PRIME
    m[..., 2] = (x[..., 2] * y[..., 0] + x[..., 3] * y[..., 2]) % PRIME
    m[..., 3] = (x[..., 2] * y[..., 1] + x[..., 3] * y[..., 3]) % PRIME
    return _pack(m)


MATMUL = Op(matmul_mod, commutative=False, name="matmul")

# -- inputs and references -------------------------------------------------------------------------


def data(kind: str, rank: int, n: int) -> np.ndarray:
    """Rank `rank`'s input of `n` elements for op `kind`."""
    i = np.arange(n, dtype=np.int64)
    if kind == "sum":
        return i * 1000 + rank * 7 - 3 * (i % 5) * rank
    if kind == "max":
        return ((i * 37 + rank * 11) % 101 - 50).astype(np.float64) / 4
    if kind == "prod":
        return np.array([-2, -1, 1, 2], dtype=np.int64)[(i * 3 + rank * 5 + i // 4) % 4]
    rng = np.random.default_rng([rank, n])
    return _pack(rng.integers(0, PRIME, size=(n, 4), dtype=np.int64))


OPS: dict[str, Op] = {"sum": as_op("sum"), "max": as_op("max"), "prod": as_op("prod"), "matmul": MATMUL}


def reference(kind: str, size: int, n: int) -> np.ndarray:
    """The reduction of every rank's input in rank order."""
    acc = data(kind, 0, n)
    for rank in range(1, size):
        nxt = data(kind, rank, n)
        if kind == "sum":
            acc = acc + nxt
        elif kind == "max":
            acc = np.maximum(acc, nxt)
        elif kind == "prod":
            acc = acc * nxt
        else:
            acc = matmul_mod(acc, nxt)
    return acc


def ops_for(collective: str, name: str) -> list[str]:
    """The ops to run: the non-commutative one only where the algorithm keeps rank order."""
    return ["sum", "max", "prod"] + (["matmul"] if lookup(collective, name).ordered else [])


# -- the battery ---------------------------------------------------------------------------------


def _check(failures: list[str], what: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        failures.append(f"{what}: got {got[:8]}... want {want[:8]}...")


def battery(comm: tcoll.Communicator, counts: tuple[int, ...] | None = None) -> list[str]:
    """Run every algorithm of the three collectives; return what went wrong (empty: all passed)."""
    p, r = comm.size, comm.rank
    counts = counts or (0, 1, 7, 13 * p + 3)
    failures: list[str] = []
    for n in counts:
        for name in runnable(comm, "all_reduce"):
            for kind in ops_for("all_reduce", name):
                x = data(kind, r, n)
                comm.all_reduce(x, OPS[kind], algorithm=name)
                _check(failures, f"all_reduce {name} {kind} n={n}", x, reference(kind, p, n))
        for name in runnable(comm, "reduce"):
            for kind in ops_for("reduce", name):
                for root in range(p):
                    x = data(kind, r, n)
                    comm.reduce(x, root, OPS[kind], algorithm=name)
                    want = reference(kind, p, n) if r == root else data(kind, r, n)
                    _check(failures, f"reduce {name} {kind} n={n} root={root} (rank {r})", x, want)
        for name in runnable(comm, "reduce_scatter"):
            for kind in ops_for("reduce_scatter", name):
                _reduce_scatter_checks(comm, failures, name, kind, n)
    return failures


def _reduce_scatter_checks(comm: tcoll.Communicator, failures: list[str], name: str, kind: str, n: int) -> None:
    """reduce_scatter `name`: the public method (equal parts), then uneven counts via _call_algorithm."""
    p, r = comm.size, comm.rank
    part = n // p if n >= p else n  # public method: n*p elements in p equal parts of n // p (or n)
    total = part * p
    got = comm.reduce_scatter(data(kind, r, total), OPS[kind], algorithm=name)
    _check(failures, f"reduce_scatter {name} {kind} part={part}", got,
           reference(kind, p, total)[r * part:(r + 1) * part])
    uneven = [split_counts(n, p), [(3 * q + n) % 5 for q in range(p)], [n if q == p - 1 else 0 for q in range(p)]]
    for counts in uneven:
        send = data(kind, r, sum(counts))
        before = send.copy()
        out = np.full(counts[r], -1, dtype=send.dtype)
        comm.core.dispatch.call_algorithm("reduce_scatter", name, send, out, counts, OPS[kind])
        start = sum(counts[:r])
        _check(failures, f"reduce_scatter {name} {kind} counts={counts}", out,
               reference(kind, p, sum(counts))[start:start + counts[r]])
        _check(failures, f"reduce_scatter {name} {kind} counts={counts}: send changed", send, before)


def averages(comm: tcoll.Communicator) -> list[str]:
    """avg through the public methods: the algorithms sum, the caller divides."""
    p, r = comm.size, comm.rank
    failures: list[str] = []
    want = np.arange(2 * p, dtype=np.float64) * (p * (p + 1) // 2) / p
    for name in runnable(comm, "all_reduce"):
        x = np.arange(2 * p, dtype=np.float64) * (r + 1)
        _check(failures, f"all_reduce {name} avg", comm.all_reduce(x, "avg", algorithm=name), want)
    for name in runnable(comm, "reduce"):
        x = np.arange(2 * p, dtype=np.float64) * (r + 1)
        comm.reduce(x, p - 1, "avg", algorithm=name)
        _check(failures, f"reduce {name} avg", x, want if r == p - 1 else np.arange(2 * p) * (r + 1.0))
    for name in runnable(comm, "reduce_scatter"):
        x = np.arange(2 * p, dtype=np.float64) * (r + 1)
        _check(failures, f"reduce_scatter {name} avg", comm.reduce_scatter(x, "avg", algorithm=name),
               want[2 * r:2 * r + 2])
    return failures


def refusals(comm: tcoll.Communicator) -> list[str]:
    """An unordered algorithm asked for by name with a non-commutative op: ValueError, nothing sent."""
    p, r = comm.size, comm.rank
    failures: list[str] = []
    calls: dict[str, Callable[[str], Any]] = {
        "all_reduce": lambda name: comm.all_reduce(data("matmul", r, 5), MATMUL, algorithm=name),
        "reduce": lambda name: comm.reduce(data("matmul", r, 5), 0, MATMUL, algorithm=name),
        "reduce_scatter": lambda name: comm.reduce_scatter(data("matmul", r, 2 * p), MATMUL, algorithm=name),
    }
    for collective, call in calls.items():
        for name in runnable(comm, collective):
            if lookup(collective, name).ordered:
                continue
            try:
                call(name)
            except ValueError:
                pass
            else:
                failures.append(f"{collective} {name} ran a non-commutative op")
    # Nothing was sent: the next collective still matches on every rank.
    x = np.full(3, r + 1, dtype=np.int64)
    _check(failures, "all_reduce after refusals", comm.all_reduce(x), np.full(3, p * (p + 1) // 2))
    return failures


def _report(results: list[list[str]]) -> None:
    bad = {rank: lines for rank, lines in enumerate(results) if lines}
    assert not bad, "\n".join(f"rank {rank}: " + "\n  ".join(lines[:10]) for rank, lines in bad.items())


# -- the tests -----------------------------------------------------------------------------------


def test_registered() -> None:
    assert set(tcoll.algorithms("all_reduce")) == {"naive", "ring", "recursive_doubling", "rabenseifner", "binomial",
                                                   "shm", "hierarchical", "hierarchical_sliced"}
    assert tcoll.algorithms("reduce") == ["binomial", "reduce_scatter_gather", "shm"]
    assert set(tcoll.algorithms("reduce_scatter")) == {"ring", "recursive_halving", "pairwise", "shm",
                                                       "hierarchical"}
    unordered = {(c, n) for c in COLLECTIVES for n in tcoll.algorithms(c) if not lookup(c, n).ordered}
    assert unordered == {("all_reduce", "ring"), ("reduce_scatter", "ring"), ("all_reduce", "hierarchical"),
                         ("all_reduce", "hierarchical_sliced"), ("reduce_scatter", "hierarchical")}
    costs = Costs(1e-5, 1e-9, 1e-9)
    for collective in COLLECTIVES:
        for name in tcoll.algorithms(collective):
            info = lookup(collective, name)
            assert info.run.__doc__ and len(info.run.__doc__.splitlines()) > 3
            if info.hierarchical:  # costed on a Topology: tests/algos/test_hierarchy.py
                continue
            assert info.cost(costs, 1 << 20, 1) == 0.0, (collective, name)
            assert all(info.cost(costs, 1 << 20, p) > 0 for p in range(2, 9)), (collective, name)


def test_matmul_op_is_associative_not_commutative() -> None:
    a, b, c = (data("matmul", rank, 50) for rank in range(3))
    assert np.array_equal(matmul_mod(matmul_mod(a, b), c), matmul_mod(a, matmul_mod(b, c)))
    assert not np.array_equal(matmul_mod(a, b), matmul_mod(b, a))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES)
def test_all_algorithms_threads(size: int) -> None:
    _report(tcoll.spawn(battery, size, threads=True, timeout=50))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [3, 5, 8])
def test_multi_chunk(size: int) -> None:
    # 64-byte chunks: 8 int64 per message, so the ring algorithms pipeline many chunks per block.
    _report(tcoll.spawn(battery, size, ((1, 13 * size + 3, 301),), threads=True, timeout=50, coll_chunk="64"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_avg(size: int) -> None:
    _report(tcoll.spawn(averages, size, threads=True, timeout=50))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 3, 4])
def test_unordered_algorithm_refuses_non_commutative_op(size: int) -> None:
    _report(tcoll.spawn(refusals, size, threads=True, timeout=50))


def process_battery(comm: tcoll.Communicator) -> list[str]:
    """The battery plus a count that goes past the eager limit, on process ranks."""
    return battery(comm, (0, 1, 7, 13 * comm.size + 3, 1000)) + averages(comm) + refusals(comm)


PROCESS_WORLDS: list[tuple[str, int, dict[str, Any]]] = [
    ("shm", 3, {}),
    ("shm", 4, {"eager_limit": "2K", "shm_ring": "8K", "shm_chunk": "1K"}),
    ("tcp", 3, {}),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport,size,knobs", PROCESS_WORLDS, ids=[f"{t}-{n}" for t, n, _ in PROCESS_WORLDS])
def test_processes(transport: str, size: int, knobs: dict[str, Any]) -> None:
    _report(tcoll.spawn(process_battery, size, timeout=120, transport=transport, coll_chunk="256", **knobs))
