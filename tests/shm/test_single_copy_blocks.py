"""All_gathers and all_to_alls of SINGLE_COPY_BYTES (2 MiB) or more that read the other ranks' arrays where they
lie, one kernel copy each (tcoll.shm.lending.read_lent, TCOLL_SHM_SINGLE_COPY=auto, the default).

Every result is NumPy's; every call refills the same input at once after it returns, so a rank that returned
before the others read its input would show in their next results; the ranks take the path only if all can.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.errors import MismatchError, PeerFailedError, TcollError
from tcoll.shm import single_copy
from tcoll.shm.lending import SINGLE_COPY_BYTES

pytestmark = [pytest.mark.usefixtures("no_leftovers"),
              pytest.mark.skipif(not single_copy.available(), reason="no process_vm_readv here")]

CALLS = 6
ROWS = (SINGLE_COPY_BYTES // 8) // 2 + 1001  # float64 items of each rank's block: 2 ranks' blocks are above the limit


def _block(rank: int, call: int, count: int) -> np.ndarray:
    return (np.arange(count, dtype=np.float64) * (rank + 2) + 1000.0 * call + rank) % 8191


def gathers_and_exchanges(comm: tcoll.Communicator) -> dict[str, Any]:
    """all_gather, all_gatherv (uneven: rank r has ROWS + 517 r items) and all_to_all, CALLS times each on
    the same arrays, refilled at once after each call; returns which results differed from NumPy's."""
    size, rank, wrong = comm.size, comm.rank, []
    mine, uneven = np.empty(ROWS), np.empty(ROWS + 517 * rank)
    out = np.empty((size, ROWS))
    send, received = np.empty((size, ROWS)), np.empty((size, ROWS))
    for call in range(CALLS):
        mine[...] = _block(rank, call, ROWS)
        comm.all_gather(mine, out)
        mine[...] = -1.0  # (at once: a peer still reading it would see this)
        if not np.array_equal(out, np.stack([_block(q, call, ROWS) for q in range(size)])):
            wrong.append(f"all_gather {call}")
        uneven[...] = _block(rank, call, uneven.size)
        gathered = comm.all_gatherv(uneven)
        uneven[...] = -1.0
        if not all(np.array_equal(gathered[q], _block(q, call, ROWS + 517 * q)) for q in range(size)):
            wrong.append(f"all_gatherv {call}")
        for q in range(size):
            send[q] = _block(rank * size + q, call, ROWS)
        comm.all_to_all(send, received)
        send[...] = -1.0
        if not np.array_equal(received, np.stack([_block(q * size + rank, call, ROWS) for q in range(size)])):
            wrong.append(f"all_to_all {call}")
    return {"wrong": wrong, "single_copy": comm.core.dispatch.arena.single_copy}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 5])
def test_blocks_read_where_they_lie_are_numpys(size: int) -> None:
    reports = tcoll.spawn(gathers_and_exchanges, size, timeout=100, transport="shm")
    assert reports == [{"wrong": [], "single_copy": True}] * size


@pytest.mark.timeout(60)
def test_thread_ranks_read_their_own_process() -> None:
    reports = tcoll.spawn(gathers_and_exchanges, 3, threads=True, timeout=50)
    assert reports == [{"wrong": [], "single_copy": True}] * 3


@pytest.mark.timeout(60)
def test_off_moves_them_through_the_slots() -> None:
    reports = tcoll.spawn(gathers_and_exchanges, 3, timeout=50, transport="shm", shm_single_copy="off")
    assert reports == [{"wrong": [], "single_copy": False}] * 3


def refused_on_rank_2(comm: tcoll.Communicator) -> dict[str, Any]:
    """Rank 2 may not read the others (as where ptrace is refused): no rank takes the path."""
    if comm.rank == 2:
        def refuse(pid: int, address: int, dest: np.ndarray) -> None:
            raise single_copy.ReadFailed(1, "process_vm_readv: Operation not permitted")
        single_copy.read_into = refuse  # (this process only, before the arena opens)
    return gathers_and_exchanges(comm)


@pytest.mark.timeout(60)
def test_one_rank_that_cannot_read_keeps_every_rank_on_the_slots() -> None:
    reports = tcoll.spawn(refused_on_rank_2, 3, timeout=50, transport="shm")
    assert reports == [{"wrong": [], "single_copy": False}] * 3


def sizes_disagree(comm: tcoll.Communicator) -> list[str]:
    """Rank 1's blocks are below SINGLE_COPY_BYTES in all where the others' are above it (so it takes the
    slots where they read by address): every rank must get a MismatchError from both calls, none a result."""
    rows = ROWS // 4 if comm.rank == 1 else ROWS
    found = []
    for call in (lambda: comm.all_gather(np.ones(rows)), lambda: comm.all_to_all(np.ones((comm.size, rows)))):
        try:
            call()
            found.append("no error")
        except MismatchError as exc:
            found.append(type(exc).__name__)
    return found


@pytest.mark.timeout(60)
def test_ranks_whose_sizes_disagree_across_the_limit_all_get_a_mismatch() -> None:
    reports = tcoll.spawn(sizes_disagree, 3, timeout=50, transport="shm")
    assert reports == [["MismatchError", "MismatchError"]] * 3


def a_read_fails_on_rank_1(comm: tcoll.Communicator) -> tuple[str, int, bool]:
    """After the arena agreed on single copies, rank 1's reads fail (memory the kernel cannot copy from): every
    rank must raise, naming rank 1 (it: its own error), none return; what each raised, the rank it names, and
    whether a later call with readable memory is right."""
    comm.all_gather(np.ones(8))  # (the arena is open: every rank said it can read every other)
    if comm.rank == 1:
        def refuse(pid: int, address: int, dest: np.ndarray) -> None:
            raise single_copy.ReadFailed(14, "process_vm_readv: Bad address")
        saved, single_copy.read_into = single_copy.read_into, refuse
    try:
        comm.all_gather(np.full(ROWS, float(comm.rank)))
        raised, named = "no error", -1
    except PeerFailedError as exc:
        raised, named = type(exc).__name__, exc.rank
    except TcollError as exc:
        raised, named = type(exc).__name__, comm.rank
    if comm.rank == 1:
        single_copy.read_into = saved
    again = comm.all_gather(np.full(ROWS, float(comm.rank)))
    return raised, named, bool(np.array_equal(again, np.repeat(np.arange(comm.size, dtype=float), ROWS).reshape(
        comm.size, ROWS)))


@pytest.mark.timeout(60)
def test_a_read_that_fails_on_one_rank_fails_the_call_on_every_rank() -> None:
    reports = tcoll.spawn(a_read_fails_on_rank_1, 3, timeout=50, transport="shm")
    assert reports[1] == ("TcollError", 1, True), reports
    assert reports[0] == reports[2] == ("PeerFailedError", 1, True), reports
