"""Large all_reduces that read the other ranks' arrays in place, one kernel copy each (tcoll.shm.single_copy,
TCOLL_SHM_SINGLE_COPY=on; the all_gathers and all_to_alls that do by default: test_single_copy_blocks.py).

Every result is NumPy's over every rank's input; the ranks take the single-copy path only if all can, and a
disagreement on the call is still a MismatchError on every rank before any data is read.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.errors import MismatchError
from tcoll.shm import single_copy

pytestmark = [pytest.mark.usefixtures("no_leftovers"),
              pytest.mark.skipif(not single_copy.available(), reason="no process_vm_readv here")]

COUNT = (1 << 20) // 4 + 4099  # float32 elements: above a 1 MiB slot, parts of uneven length


def _data(rank: int, count: int, dtype: Any) -> np.ndarray:
    return ((np.arange(count) * (rank + 3) + 7 * rank) % 251).astype(dtype)


def _expected(size: int, count: int, dtype: Any, op: str) -> np.ndarray:
    inputs = [_data(q, count, dtype) for q in range(size)]
    if op == "rank_order":  # associative, not commutative: the right operand, so rank p - 1's input
        return inputs[-1]
    return {"sum": np.add, "max": np.maximum, "prod": np.multiply}[op].reduce(np.stack(inputs)).astype(dtype)


def _reduce_and_check(comm: tcoll.Communicator, count: int, dtype: Any, op: str, shared: bool) -> dict[str, Any]:
    x = comm.empty(count, dtype) if shared else np.empty(count, dtype)
    x[...] = _data(comm.rank, count, dtype)
    the_op: Any = op
    if op == "rank_order":
        the_op = tcoll.Op(lambda a, b: b.copy(), commutative=False, name="right")
    comm.all_reduce(x, the_op, algorithm="shm")
    want = _expected(comm.size, count, dtype, op)
    return {"right": bool(np.array_equal(x, want)), "single_copy": comm.core.dispatch.arena.reduce_by_single_copy}


def every_case(comm: tcoll.Communicator) -> list[dict[str, Any]]:
    """float32, int64 and bfloat16 sums, a max and a product, a user op in rank order; the odd ranks lend
    comm.empty buffers in the last case (read in place through the mapping, the others by single copies)."""
    cases = [(np.float32, "sum", False), (np.int64, "sum", False), (ml_dtypes.bfloat16, "max", False),
             (np.float64, "prod", False), (np.float64, "rank_order", False), (np.float32, "sum", comm.rank % 2 == 1)]
    found = []
    for dtype, op, shared in cases:
        count = COUNT if np.dtype(dtype).itemsize >= 4 else 2 * COUNT
        found.append(dict(_reduce_and_check(comm, count, dtype, op, shared), case=f"{np.dtype(dtype)} {op}"))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3, 5])
def test_results_are_numpys_on_every_rank(size: int) -> None:
    # A 64 KiB slot: each rank reduces its part in many scratch-sized pieces.
    reports = tcoll.spawn(every_case, size, timeout=100, transport="shm", shm_slot=64 << 10, shm_single_copy="on")
    for rank, cases in enumerate(reports):
        assert all(case["single_copy"] for case in cases), (rank, cases)
        assert [case["case"] for case in cases if not case["right"]] == [], (rank, cases)


@pytest.mark.timeout(60)
def test_thread_ranks_read_their_own_process() -> None:
    reports = tcoll.spawn(every_case, 3, threads=True, timeout=50, shm_single_copy="on")
    assert all(case["right"] and case["single_copy"] for cases in reports for case in cases), reports


def refused_on_rank_1(comm: tcoll.Communicator) -> dict[str, Any]:
    """Rank 1 may not read the others (as where ptrace is refused): no rank takes the path; results right."""
    if comm.rank == 1:
        def refuse(pid: int, address: int, dest: np.ndarray) -> None:
            raise single_copy.ReadFailed(1, "process_vm_readv: Operation not permitted")
        single_copy.read_into = refuse  # (this process only, before the arena opens)
    return _reduce_and_check(comm, COUNT, np.float32, "sum", False)


@pytest.mark.timeout(60)
def test_one_rank_that_cannot_read_keeps_every_rank_on_the_arena() -> None:
    reports = tcoll.spawn(refused_on_rank_1, 3, timeout=50, transport="shm", shm_single_copy="on")
    assert reports == [{"right": True, "single_copy": False}] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["auto", "off"])
def test_all_reduce_stays_on_the_arena_unless_on(setting: str) -> None:
    reports = tcoll.spawn(_reduce_and_check, 2, (COUNT, np.float32, "sum", False), timeout=50, transport="shm",
                          shm_single_copy=setting)
    assert reports == [{"right": True, "single_copy": False}] * 2


def sizes_disagree(comm: tcoll.Communicator) -> str:
    """Rank 2 passes a longer array: every rank must get a MismatchError, none a result."""
    x = np.ones(COUNT + (4096 if comm.rank == 2 else 0), np.float32)
    try:
        comm.all_reduce(x, algorithm="shm")
    except MismatchError as exc:
        return f"MismatchError: {exc}"
    return "no error"


@pytest.mark.timeout(60)
def test_ranks_that_disagree_on_the_size_all_get_a_mismatch() -> None:
    reports = tcoll.spawn(sizes_disagree, 3, timeout=50, transport="shm", shm_single_copy="on")
    assert all(report.startswith("MismatchError") for report in reports), reports
