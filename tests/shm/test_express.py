"""The express path: a repeated blocking all_reduce or reduce on one array, whole in one C call.

It must give NumPy's result every time, say nothing different from the
Python path when ranks disagree (a MismatchError or the failing rank's error
on every rank, never a wrong answer or a hang), and leave behind what the
Python path records: the sequence number, the last call for the hang report,
and the agreement's ring of recent calls.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.comm import progress
from tcoll.shm import vector
from tcoll.shm.kernel_abi import kernel_module

needs_kernel = pytest.mark.skipif(kernel_module is None, reason="the arena's C kernel is not built")
SLOT = 64 << 10  # the three steps from the one-step limit up to 64 KiB


def _express(comm: tcoll.Communicator, x: np.ndarray, key: tuple[Any, ...]) -> Any:
    """The express call the lean path keeps for `x` under `key` (its arguments after the buffer)."""
    entry = comm.core.dispatch.lean.get((id(x), *key))
    return None if entry is None else entry.express


def repeated_calls(comm: tcoll.Communicator, count: int, dtype: str, calls: int) -> dict[str, int]:
    """all_reduce and reduce on the same arrays, refilled each call, against NumPy; how many ran whole in C."""
    kind = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x, y = np.zeros(count, dtype=kind), np.zeros(count, dtype=kind)
    plan_buf = np.zeros(count, dtype=kind)
    plan = comm.all_reduce_init(plan_buf, op="max")
    before = comm.core.dispatch.sequence
    for call in range(calls):
        inputs = [((np.arange(count) * (q + 3) + call) % 13 - 6).astype(kind) for q in range(comm.size)]
        x[...] = inputs[comm.rank]
        y[...] = inputs[comm.rank]
        plan_buf[...] = inputs[comm.rank]
        assert comm.all_reduce(x) is x
        root = call % comm.size
        comm.reduce(y, root, "min")
        plan()
        total = inputs[0].copy()
        for part in inputs[1:]:
            total = (total + part).astype(kind)  # in rank order, in the dtype, as NumPy's ufunc loop
        np.testing.assert_array_equal(x, total)
        want = np.minimum.reduce(inputs) if comm.rank == root else inputs[comm.rank]
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(plan_buf, np.maximum.reduce(inputs))
    assert comm.core.dispatch.sequence == before + 3 * calls  # every call numbered, however it ran
    counts = {"all_reduce": getattr(_express(comm, x, ("all_reduce", "sum", "auto")), "completed", 0),
              "plan": getattr(plan.express, "completed", 0)}
    counts["reduce"] = sum(getattr(_express(comm, y, ("reduce", root, "min", "auto")), "completed", 0)
                           for root in range(comm.size))
    return counts


CASES = ([(2, count, dtype) for count in (3, 3000) for dtype in ("float32", "int64", "bfloat16")]
         + [(size, count, "float32") for size in (3, 5) for count in (3, 3000)])


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,count,dtype", CASES, ids=[f"{s}-{'one-step' if c == 3 else 'three-steps'}-{d}"
                                                          for s, c, d in CASES])
def test_repeated_calls_match_numpy(size: int, count: int, dtype: str) -> None:
    tcoll.spawn(repeated_calls, size, (count, dtype, 24), timeout=100, transport="shm", shm_slot=SLOT,
                shm_one_step=1024)


@needs_kernel
@pytest.mark.alone  # (a call runs whole in C only when every rank comes within the kernel's spin)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("count,dtype", [(count, dtype) for size, count, dtype in CASES if size == 2])
def test_repeated_calls_on_two_ranks_run_whole_in_c(count: int, dtype: str) -> None:
    results = tcoll.spawn(repeated_calls, 2, (count, dtype, 24), timeout=100, transport="shm", shm_slot=SLOT,
                          shm_one_step=1024)
    assert all(counts["all_reduce"] > 0 and counts["plan"] > 0 and counts["reduce"] > 0
               for counts in results), results


def late_peers(comm: tcoll.Communicator, count: int) -> tuple[int, int]:
    """Rank 1 is late (busy for 3 ms) before every 4th call: the others' express calls hand over to Python
    midway; every result is NumPy's and nothing is left pending. (handed over or not, calls run whole)"""
    x = np.zeros(count, dtype=np.float32)
    for call in range(16):
        if comm.rank == 1 and call % 4 == 3:
            _busy(0.003)
        x[...] = np.arange(count) + comm.rank + call
        comm.all_reduce(x)
        np.testing.assert_array_equal(x, sum(np.arange(count, dtype=np.float32) + q + call for q in range(comm.size)))
    dispatcher = comm.core.dispatch
    assert dispatcher.arena.pending == 0 and dispatcher.sequence == 16
    return _express(comm, x, ("all_reduce", "sum", "auto")).completed, dispatcher.sequence


def _busy(seconds: float) -> None:
    """Keep this rank busy (not asleep) for `seconds`."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [3, 3000], ids=["one-step", "three-steps"])
def test_a_late_peer_hands_the_call_over_to_python(count: int) -> None:
    results = tcoll.spawn(late_peers, 3, (count,), timeout=50, transport="shm", shm_slot=SLOT, shm_one_step=1024)
    assert all(sequence == 16 for _, sequence in results), results


def interrupted(comm: tcoll.Communicator) -> list[str]:
    """Rank 0's express call hands over (rank 1 is late) and an exception comes before Python takes the call
    over; rank 0 goes on calling. What each call said: never a wrong result, and every rank raises."""
    from tcoll.comm import plans

    comm.timeout = 20.0
    if comm.rank == 0:
        again = plans.lean_again

        def interrupt_once(dispatcher: Any, entry: Any, x: Any, handed_over: bool = False) -> Any:
            if handed_over and "KeyboardInterrupt" not in said:
                raise KeyboardInterrupt  # where a signal during the kernel's spin would land
            return again(dispatcher, entry, x, handed_over)

        plans.lean_again = interrupt_once
    x, said = np.zeros(4), []
    for call in range(12):
        if comm.rank == 1 and call == 8:
            _busy(0.01)
        x[...] = comm.rank + call
        try:
            comm.all_reduce(x)
            said.append("right" if (x == sum(range(comm.size)) + comm.size * call).all() else "WRONG")
        except (KeyboardInterrupt, tcoll.TcollError) as exc:
            said.append(type(exc).__name__)
    return said


@needs_kernel
@pytest.mark.timeout(60)
def test_an_exception_before_python_takes_a_handed_over_call_is_no_silent_shift() -> None:
    said = tcoll.spawn(interrupted, 2, timeout=50, transport="shm")
    assert "WRONG" not in said[0] + said[1], said
    assert "KeyboardInterrupt" in said[0], said
    assert all(any(s.endswith("Error") for s in ours) for ours in said), said


def another_call_at(comm: tcoll.Communicator, how: str) -> str:
    """Ranks run express calls; at the 8th call rank 1 makes another call (`how`); what each rank raised."""
    x = np.ones(5, dtype=np.float32)
    comm.timeout = 20.0
    for call in range(12):
        try:
            if comm.rank == 1 and call == 8:
                if how == "op":
                    comm.all_reduce(x, "max")
                elif how == "size":
                    comm.all_reduce(np.ones(6, dtype=np.float32))
                elif how == "collective":
                    comm.barrier()
                elif how == "bad argument":
                    comm.all_reduce(x, "no such op")
            else:
                comm.all_reduce(x)
        except (tcoll.TcollError, ValueError) as exc:
            return f"{type(exc).__name__} at call {call}: {exc}"
    return "no error"


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["op", "size", "collective", "bad argument"])
def test_another_call_on_one_rank_is_an_error_on_every_rank(how: str) -> None:
    said = tcoll.spawn(another_call_at, 3, (how,), timeout=100, transport="shm")
    if how == "bad argument":  # rank 1 raises its ValueError; the others are told of it
        assert said[1].startswith("ValueError at call 8"), said
        assert all(s.startswith("PeerFailedError at call 8") and "rank 1" in s for s in (said[0], said[2])), said
    else:
        assert all(s.startswith("MismatchError at call 8") for s in said), said


def mixed_calls(comm: tcoll.Communicator, rounds: int) -> None:
    """Express calls between broadcasts (their roots only send: the gate shuts), plans and a changed limit."""
    x, b = np.zeros(4), np.zeros(3, dtype=np.int64)
    for call in range(rounds):
        root = call % comm.size
        b[...] = call if comm.rank == root else -1
        comm.broadcast(b, root)
        assert (b == call).all()
        x[...] = comm.rank + call
        comm.all_reduce(x)
        assert (x == sum(range(comm.size)) + comm.size * call).all()
        if call == rounds // 2:  # a call after this takes the other steps, on every rank
            made = _express(comm, x, ("all_reduce", "sum", "auto"))
            vector.set_one_step_limit(16)
            try:
                for _ in range(3):
                    x[...] = comm.rank
                    comm.all_reduce(x)
                    assert (x == sum(range(comm.size))).all()
            finally:
                vector.set_one_step_limit(None)
            assert _express(comm, x, ("all_reduce", "sum", "auto")) is not made  # made anew for the new limit


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 4])
def test_express_calls_between_other_calls(size: int) -> None:
    tcoll.spawn(mixed_calls, size, (20,), timeout=100, transport="shm")


def what_the_report_says(comm: tcoll.Communicator) -> tuple[int, dict[str, Any], tuple[str, int]]:
    """After express calls: the sequence, what the hang report reads, and the agreement's ring entry."""
    x = np.ones(2)
    for _ in range(10):
        comm.all_reduce(x)
    dispatcher = comm.core.dispatch
    assert _express(comm, x, ("all_reduce", "sum", "auto")).completed > 0
    state = progress.calls(dispatcher.engine)[0]
    assert dispatcher.agreement.watch.high == dispatcher.sequence
    plan = comm.all_reduce_init(x)
    plan()
    plan()
    ring = dispatcher.agreement._finished(dispatcher.sequence - 2)
    comm.close()
    with pytest.raises(tcoll.TcollError, match="closed"):
        plan()
    return 10, state, ring


@needs_kernel
@pytest.mark.alone  # (both ranks must come within the kernel's spin at least once)
@pytest.mark.timeout(60)
def test_express_calls_leave_what_the_python_path_records() -> None:
    for sequence, state, (label, stamp) in tcoll.spawn(what_the_report_says, 2, timeout=50, transport="shm"):
        assert sequence == 10 and state["sequence"] == 10 and state["last"] == "all_reduce", state
        assert label == "all_reduce" and stamp != 0


def dies_in_express(comm: tcoll.Communicator) -> str:
    """Rank 2 dies after 10 express calls; what the others raise."""
    comm.timeout = 20.0
    x = np.ones(8)
    for call in range(1000):
        if comm.rank == 2 and call == 10:
            os._exit(3)
        try:
            comm.all_reduce(x)
        except tcoll.TcollError as exc:
            return type(exc).__name__
    return "no error"


@needs_kernel
@pytest.mark.timeout(60)
def test_a_rank_that_dies_between_express_calls_is_named() -> None:
    with pytest.raises(tcoll.SpawnError) as raised:
        tcoll.spawn(dies_in_express, 3, timeout=50, transport="shm", keep_going=True)
    results = raised.value.results
    assert results[0] == results[1] == "PeerLostError", results


def read_only_elsewhere(comm: tcoll.Communicator, count: int) -> list[float]:
    """A reduce whose ranks other than the root pass read-only arrays, twice (the second call remembered)."""
    got = []
    for _ in range(2):
        x = np.full(count, comm.rank + 1.0)
        if comm.rank != 0:
            x.flags.writeable = False
        comm.reduce(x, 0)
        got.append(float(x[0]))
    return got


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("count", [3, 3000], ids=["one-step", "three-steps"])
def test_a_reduce_takes_read_only_arrays_on_the_other_ranks(count: int) -> None:
    results = tcoll.spawn(read_only_elsewhere, 3, (count,), timeout=50, transport="shm", shm_slot=SLOT,
                          shm_one_step=1024)
    assert results == [[6.0, 6.0], [2.0, 2.0], [3.0, 3.0]], results


def repeated_broadcasts(comm: tcoll.Communicator, count: int, calls: int) -> dict[str, Any]:
    """Broadcasts from every root in turn on the same arrays, refilled each call, against root's data; how many
    ran whole in C, and whether the numbering is the Python path's."""
    x = np.zeros(count, dtype=np.float64)
    b = np.zeros(count, dtype=ml_dtypes.bfloat16)
    before, wrong = comm.core.dispatch.sequence, 0
    for call in range(calls):
        root = call % comm.size
        sent = ((np.arange(count) * (comm.rank + 3) + call) % 251).astype(np.float64)
        x[...] = sent
        b[...] = sent
        assert comm.broadcast(x, root) is x
        comm.broadcast(b, root)
        want = ((np.arange(count) * (root + 3) + call) % 251).astype(np.float64)
        wrong += not np.array_equal(x, want) or not np.array_equal(b, want.astype(ml_dtypes.bfloat16))
    completed = sum(getattr(_express(comm, arr, ("broadcast", root, "auto")), "completed", 0)
                    for arr in (x, b) for root in range(comm.size))
    return {"wrong": wrong, "numbered": comm.core.dispatch.sequence - before == 2 * calls, "completed": completed}


@needs_kernel
@pytest.mark.alone  # (on 2 ranks every rank must come within the kernel's spin)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,count", [(2, 5), (2, 3000), (3, 5), (5, 3000)])
def test_repeated_broadcasts_match_roots_data(size: int, count: int) -> None:
    results = tcoll.spawn(repeated_broadcasts, size, (count, 30), timeout=100, transport="shm")
    assert all(r["wrong"] == 0 and r["numbered"] for r in results), results
    if size == 2:  # (more ranks than cores: a call runs whole only when every rank comes within the spin)
        assert all(r["completed"] > 0 for r in results), results


def broadcast_then_another(comm: tcoll.Communicator, how: str) -> str:
    """Express broadcasts; at the 8th call rank 1 says another root, or another size; what each rank raised."""
    x = np.ones(5, dtype=np.float32)
    comm.timeout = 20.0
    for call in range(12):
        try:
            if comm.rank == 1 and call == 8:
                comm.broadcast(x, 1) if how == "root" else comm.broadcast(np.ones(6, dtype=np.float32), 0)
            else:
                comm.broadcast(x, 0)
        except tcoll.TcollError as exc:
            return f"{type(exc).__name__} at call {call}: {exc}"
    return "no error"


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["root", "size"])
def test_a_broadcast_that_differs_on_one_rank_is_an_error_on_every_rank(how: str) -> None:
    said = tcoll.spawn(broadcast_then_another, 3, (how,), timeout=50, transport="shm")
    assert all(s.startswith("MismatchError at call 8") for s in said), said


def late_broadcasts(comm: tcoll.Communicator) -> tuple[bool, int]:
    """Rank 2 is late at some calls (its peers' kernels give up and Python goes on); roots' data every time."""
    x, right = np.zeros(7), True
    for call in range(16):
        if comm.rank == 2 and call % 5 == 4:
            _busy(0.01)
        x[...] = comm.rank * 10 + call
        comm.broadcast(x, call % 3)
        right = right and bool((x == (call % 3) * 10 + call).all())
    return right, comm.core.dispatch.sequence


@needs_kernel
@pytest.mark.timeout(60)
def test_a_late_peer_hands_a_broadcast_over_to_python() -> None:
    results = tcoll.spawn(late_broadcasts, 3, timeout=50, transport="shm")
    assert results == [(True, 16)] * 3, results


def barriers_in_order(comm: tcoll.Communicator, path: str) -> dict[str, Any]:
    """Each rank writes its round number into its word of a file, then barrier()s, then reads every word: no
    rank may be behind that round (a barrier that let a rank through early would show it)."""
    early, fd = 0, os.open(path, os.O_RDWR)
    try:
        for round_ in range(1, 301):
            if comm.rank == 1 and round_ % 60 == 0:
                _busy(0.005)  # late now and then: the others' kernels hand the call over
            os.pwrite(fd, round_.to_bytes(8, "little"), 8 * comm.rank)
            assert comm.barrier() is None
            words = os.pread(fd, 8 * comm.size, 0)
            early += any(int.from_bytes(words[8 * q:8 * q + 8], "little") < round_ for q in range(comm.size))
    finally:
        os.close(fd)
    entry = comm.core.dispatch.lean.get(("barrier", "auto"))
    return {"early": early, "completed": getattr(getattr(entry, "express", None), "completed", 0),
            "sequence": comm.core.dispatch.sequence}


@needs_kernel
@pytest.mark.alone  # (on 2 ranks every rank must come within the kernel's spin)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_express_barriers_hold_every_rank_until_all_came(size: int, tmp_path: Any) -> None:
    path = tmp_path / "rounds"
    path.write_bytes(bytes(8 * size))
    results = tcoll.spawn(barriers_in_order, size, (str(path),), timeout=50, transport="shm")
    assert all(r["early"] == 0 and r["sequence"] == 300 for r in results), results
    if size == 2:
        assert all(r["completed"] > 0 for r in results), results


def barrier_then_another(comm: tcoll.Communicator) -> str:
    """Express barriers; at the 8th call rank 1 broadcasts instead: every rank must raise, none go on."""
    comm.timeout = 20.0
    for call in range(12):
        try:
            comm.broadcast(np.ones(3), 0) if comm.rank == 1 and call == 8 else comm.barrier()
        except tcoll.TcollError as exc:
            return f"{type(exc).__name__} at call {call}"
    return "no error"


@needs_kernel
@pytest.mark.timeout(60)
def test_a_broadcast_against_express_barriers_is_an_error_on_every_rank() -> None:
    said = tcoll.spawn(barrier_then_another, 3, timeout=50, transport="shm")
    assert said == ["MismatchError at call 8"] * 3, said
