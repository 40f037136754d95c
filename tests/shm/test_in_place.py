"""All_reduces from tcoll.shm.large.in_place_bytes whose every rank lent its buffer (comm.empty): each rank
reduces its part of every rank's input and writes the result into every rank's buffer (all_reduce_in_place).

Every result is NumPy's over every rank's input, on every rank, after the call's two steps, for calls
larger than a slot and within one; a call right after it, with fresh data, sees none of the last call's
writes; ranks that lend beside ranks that do not (whose calls run in C) get NumPy's result too; a user's
op that fails on one rank fails the call on every rank.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.shm.large import IN_PLACE_BYTES_SHARED

pytestmark = pytest.mark.usefixtures("no_leftovers")

SLOT = 64 << 10  # each rank reduces its part in many scratch-sized pieces (64 KiB)
COUNT = 300_001  # float32 elements: above a slot, parts of uneven length
BIG_SLOT = 4 << 20
WITHIN = IN_PLACE_BYTES_SHARED + 4099 * 8  # bytes of a call within BIG_SLOT that goes in place (any rank count)


def _data(rank: int, count: int, dtype: Any, salt: int = 0) -> np.ndarray:
    return ((np.arange(count) * (rank + 3) + 7 * rank + salt) % 251).astype(dtype)


def _twice_then_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Not commutative: folded in rank order, rank q's input weighs 2 ** (p - 1 - q)."""
    return a * 2 + b


CASES = [(np.float32, "sum"), (np.int64, "sum"), (ml_dtypes.bfloat16, "max"), (np.float64, "prod"),
         (np.int64, "twice_then_add")]


def _expected(size: int, count: int, dtype: Any, op: str, salt: int = 0) -> np.ndarray:
    inputs = [_data(q, count, dtype, salt) for q in range(size)]
    if op == "twice_then_add":
        return functools.reduce(_twice_then_add, inputs)
    ufunc = {"sum": np.add, "max": np.maximum, "prod": np.multiply}[op]
    return ufunc.reduce(np.stack(inputs).astype(np.float64 if op == "prod" else dtype)).astype(dtype)


def every_case(comm: tcoll.Communicator, nbytes: int) -> list[str]:
    """Each case in a comm.empty buffer of about `nbytes`; what came out wrong, and how many arena steps each
    call took."""
    comm.barrier(algorithm="shm")  # (the arena opens at its first call)
    arena = comm.core.dispatch.arena
    bad = []
    for dtype, op in CASES:
        count = nbytes // np.dtype(dtype).itemsize
        x = comm.empty(count, dtype)
        x[...] = _data(comm.rank, count, dtype)
        the_op: Any = tcoll.Op(_twice_then_add, commutative=False, name="twice") if op == "twice_then_add" else op
        before = arena.step
        comm.all_reduce(x, the_op, algorithm="shm")
        steps = arena.step - before
        if steps != 2:
            bad.append(f"{np.dtype(dtype)} {op}: {steps} arena steps")
        wrong = np.flatnonzero(x != _expected(comm.size, count, dtype, op))
        if wrong.size:
            bad.append(f"{np.dtype(dtype)} {op}: {wrong.size} wrong, from element {wrong[0]}")
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("nbytes,slot", [(4 * COUNT, SLOT), (WITHIN, BIG_SLOT)], ids=["larger", "within"])
def test_every_buffer_holds_numpys_result(size: int, nbytes: int, slot: int) -> None:
    reports = tcoll.spawn(every_case, size, (nbytes,), timeout=170, transport="shm", shm_slot=slot)
    assert reports == [[]] * size


@pytest.mark.timeout(60)
def test_thread_ranks_lend_alike() -> None:
    assert tcoll.spawn(every_case, 3, (4 * COUNT,), threads=True, timeout=50, shm_slot=SLOT) == [[]] * 3


def some_lend(comm: tcoll.Communicator, lenders: list[int], calls: int) -> list[int]:
    """Calls within a slot on the same arrays, the ranks in `lenders` lending theirs: the others' calls run
    whole in C from the second on (express), and must not read a lender's slot; the wrong calls."""
    count = WITHIN // 4
    x = comm.empty(count, np.float32) if comm.rank in lenders else np.empty(count, np.float32)
    wrong = []
    for call in range(calls):
        x[...] = _data(comm.rank, count, np.float32, salt=call)
        comm.all_reduce(x, algorithm="shm")
        if not np.array_equal(x, _expected(comm.size, count, np.float32, "sum", salt=call)):
            wrong.append(call)
    return wrong


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size,lenders", [(2, [1]), (3, [0]), (4, [1, 2, 3])])
def test_ranks_that_lend_beside_ranks_that_do_not(size: int, lenders: list[int]) -> None:
    reports = tcoll.spawn(some_lend, size, (lenders, 20), timeout=50, transport="shm", shm_slot=BIG_SLOT)
    assert reports == [[]] * size


def back_to_back(comm: tcoll.Communicator, calls: int) -> list[int]:
    """Calls one after another, each on fresh data written the moment the last returned; the wrong calls."""
    x = comm.empty(COUNT // 3, np.float32)
    wrong = []
    for call in range(calls):
        x[...] = _data(comm.rank, x.size, np.float32, salt=call)
        comm.all_reduce(x, algorithm="shm")
        if not np.array_equal(x, _expected(comm.size, x.size, np.float32, "sum", salt=call)):
            wrong.append(call)
    return wrong


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [3, 5])
def test_no_write_of_a_call_lands_in_the_next(size: int) -> None:
    assert tcoll.spawn(back_to_back, size, (40,), timeout=110, transport="shm", shm_slot=SLOT) == [[]] * size


def failing_on_rank_1(comm: tcoll.Communicator) -> list[str]:
    """A user's op that raises on rank 1 only, then an ordinary call; what each rank saw."""
    comm.timeout = 30.0

    def add_unless_rank_1(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if comm.rank == 1:
            raise RuntimeError("the op refuses on rank 1")
        return a + b

    # a large buffer: the others write into rank 1's long after its op raised
    return _fail_then_refill(comm, tcoll.Op(add_unless_rank_1), 16 * COUNT)


def _fail_then_refill(comm: tcoll.Communicator, op: tcoll.Op, count: int) -> list[str]:
    """An all_reduce with `op` on a comm.empty buffer of `count` float32, then, refilled at once, an ordinary
    one: the first's error type (or "ok") and the values the second left."""
    x = comm.empty(count, np.float32)
    x[...] = 1
    seen = []
    try:
        comm.all_reduce(x, op, algorithm="shm")
        seen.append("ok")
    except (tcoll.TcollError, RuntimeError) as exc:
        seen.append(type(exc).__name__)
    x[...] = comm.rank + 1
    comm.all_reduce(x, algorithm="shm")
    seen.append(str(np.unique(x).tolist()))
    return seen


@pytest.mark.timeout(60)
def test_an_op_that_fails_on_one_rank_fails_the_call_on_every_rank() -> None:
    seen = tcoll.spawn(failing_on_rank_1, 3, timeout=50, transport="shm", shm_slot=SLOT)
    assert seen == [["PeerFailedError", "[6.0]"], ["RuntimeError", "[6.0]"], ["PeerFailedError", "[6.0]"]]


def failing_everywhere(comm: tcoll.Communicator) -> list[str]:
    """A user's op that raises on every rank (each stops writing into the others' buffers at once), then an
    ordinary call; what each rank saw. Nobody may wait for another's writes that will never come."""
    comm.timeout = 100.0  # (past the test's timeout: a rank that waited for them would fail the test)

    def refuse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise RuntimeError(f"the op refuses on rank {comm.rank}")

    return _fail_then_refill(comm, tcoll.Op(refuse), COUNT)


@pytest.mark.timeout(40)
def test_ranks_that_all_fail_do_not_wait_for_each_other() -> None:
    for seen in tcoll.spawn(failing_everywhere, 3, timeout=35, transport="shm", shm_slot=SLOT):
        assert seen[0] in ("RuntimeError", "PeerFailedError") and seen[1] == "[6.0]", seen


def rank_2_fails_before_writing(comm: tcoll.Communicator) -> int:
    """Rank 2 fails the call after it lent its buffer, before it reduces (it cannot see the others' buffers), and
    refills its buffer at once; the others write their parts into it all the same. The elements of rank 2's
    buffer that a late write changed, once every rank has raised (0 on the others)."""
    comm.timeout = 100.0  # (past the test's timeout: a rank that waited that long would fail the test)
    if comm.rank == 2:
        from tcoll.shm.lending import Lending

        def cannot_map(self: Any, step: int, rank: int) -> Any:
            raise tcoll.TcollError(f"injected: rank {rank}'s buffer cannot be mapped")

        Lending.peer_source = cannot_map  # (this process only)
    x = comm.empty(16 * COUNT, np.float32)
    x[...] = 1
    try:
        comm.all_reduce(x, algorithm="shm")
    except tcoll.TcollError:
        pass
    if comm.rank != 2:
        comm.send(np.zeros(1), 2)  # (once this rank raised: its writes are over)
        return 0
    x[...] = 100
    for peer in (0, 1):
        comm.recv(np.zeros(1), peer)
    return int(np.count_nonzero(x != 100))


@pytest.mark.timeout(40)
def test_a_rank_that_fails_before_writing_gets_no_late_write() -> None:
    assert tcoll.spawn(rank_2_fails_before_writing, 3, timeout=35, transport="shm", shm_slot=SLOT) == [0, 0, 0]
