"""The express path of the block collectives: a repeated blocking all_gather, gather, all_to_all or reduce_scatter
into the caller's `out` (or a plan's; a gather's other ranks need none), whole in one C call.

NumPy's result every time (the input refilled between calls), the Python path
again whenever an array changes (another input, a read-only or reshaped out),
a late rank handed over to Python, and ranks that disagree all raise.
"""

from __future__ import annotations

import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import tcoll
from tcoll.shm.kernel_abi import kernel_module

from helpers.mismatch import assert_every_rank_raised, mismatch_said

pytestmark = pytest.mark.usefixtures("no_leftovers")
needs_kernel = pytest.mark.skipif(kernel_module is None, reason="the arena's C kernel is not built")


def _completed(comm: tcoll.Communicator, x: np.ndarray, out: np.ndarray | None, *key: Any) -> int:
    """How many calls the express call of (x, out, *key) ran whole in C (0: it has none)."""
    entry = comm.core.dispatch.lean.get((id(x), id(out), *key))
    made = None if entry is None else entry.express
    return getattr(made, "completed", 0)


ROOT = 1  # a gather's


def _expected(name: str, inputs: list[np.ndarray], rank: int) -> np.ndarray | None:
    if name == "all_gather" or (name == "gather" and rank == ROOT):
        return np.stack([x[0] for x in inputs])
    if name == "gather":
        return None
    if name == "all_to_all":
        return np.stack([x[rank] for x in inputs])
    total = inputs[0].copy()
    for x in inputs[1:]:
        np.add(total, x, out=total)
    return total[rank:rank + 1]


def _call(comm: tcoll.Communicator, name: str, x: np.ndarray, out: np.ndarray) -> Any:
    if name == "all_gather":
        return comm.all_gather(x, out=out)  # (x: the row, one array object every call)
    if name == "gather":
        return comm.gather(x, ROOT, out=out if comm.rank == ROOT else None)
    if name == "all_to_all":
        return comm.all_to_all(x, out=out)
    return comm.reduce_scatter(x, "sum", out=out)


def repeated(comm: tcoll.Communicator, name: str, count: int, dtype: str, calls: int) -> tuple[list[str], int, int]:
    """`calls` calls of `name` on the same arrays, the input refilled each time; (failures, calls run
    express, plan runs run express)."""
    kind = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    p, me = comm.size, comm.rank
    x = np.zeros((p, count), kind)
    out = np.zeros((p, count) if name != "reduce_scatter" else (1, count), kind)
    send = x[0] if name in ("all_gather", "gather") else x
    plan = (comm.reduce_scatter_init(x, "sum") if name == "reduce_scatter" else comm.gather_init(send, ROOT)
            if name == "gather" else getattr(comm, f"{name}_init")(send))
    bad = []
    for call in range(calls):
        inputs = [((np.arange(p * count) * (q + 3) + call) % 61).astype(kind).reshape(p, count) for q in range(p)]
        x[...] = inputs[me]
        got = _call(comm, name, send, out)
        want = _expected(name, inputs, me)
        if (got is not None or want is not None) and (got is not out or not np.array_equal(out, want)):
            bad.append(f"rank {me} call {call}: {name} {dtype} x{count}")
        planned = plan()
        if (planned is not None or want is not None) and not np.array_equal(planned, want):
            bad.append(f"rank {me} call {call}: the plan of {name}")
    keys = {"all_gather": ("all_gather", "auto"), "gather": ("gather", ROOT, "auto"), "all_to_all": (name, "auto"),
            "reduce_scatter": ("reduce_scatter", "sum", "auto")}
    entry = comm.core.dispatch.lean.get((id(send), id(out if name != "gather" or me == ROOT else None), *keys[name]))
    return bad, getattr(getattr(entry, "express", None), "completed", 0), getattr(plan.express, "completed", 0)


CASES = [("all_gather", 3, "float32"), ("all_gather", 700, "int64"), ("gather", 2, "float64"), ("gather", 900, "uint8"),
         ("all_to_all", 5, "uint8"),
         ("all_to_all", 300, "bfloat16"), ("reduce_scatter", 4, "float64"), ("reduce_scatter", 500, "int32"),
         # 64 KiB and more in all: calls that may lend, whose express call takes the lenders' step too
         ("gather", 9000, "float64"), ("all_to_all", 12000, "float32"), ("reduce_scatter", 10000, "float64")]


@needs_kernel
@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name,count,dtype", CASES, ids=[f"{n}-{c}-{d}" for n, c, d in CASES])
def test_repeated_block_calls_match_numpy(size: int, name: str, count: int, dtype: str) -> None:
    results = tcoll.spawn(repeated, size, (name, count, dtype, 30), timeout=100, transport="shm")
    assert not [f for bad, _, _ in results for f in bad], results


@needs_kernel
@pytest.mark.alone  # (a call runs whole in C only when every rank comes within the kernel's spin)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,count,dtype", CASES, ids=[f"{n}-{c}-{d}" for n, c, d in CASES])
def test_repeated_block_calls_on_two_ranks_run_express(name: str, count: int, dtype: str) -> None:
    results = tcoll.spawn(repeated, 2, (name, count, dtype, 30), timeout=100, transport="shm")
    assert not [f for bad, _, _ in results for f in bad], results
    assert all(express > 0 and planned > 0 for _, express, planned in results), results


def arrays_that_change(comm: tcoll.Communicator) -> list[str]:
    """After express calls, the same call on another input, a read-only out and a reshaped out: each takes the
    Python path (right result, or the checks' error), never a stale binding."""
    p, me = comm.size, comm.rank
    x, out = np.full(4, me, np.int64), np.zeros((p, 4), np.int64)
    said = []
    for _ in range(5):
        comm.all_gather(x, out=out)
    other = np.full(4, me + 10, np.int64)
    said.append(str(comm.all_gather(other, out=out)[:, 0].tolist()))
    out.flags.writeable = False
    try:
        comm.all_gather(x, out=out)
    except ValueError as exc:
        said.append(f"ValueError: {'read-only' in str(exc) or 'writ' in str(exc)}")
    out.flags.writeable = True
    out.shape = (p * 4,)
    try:
        comm.all_gather(x, out=out)
    except ValueError as exc:
        said.append(f"ValueError: {'shape' in str(exc)}")
    out.shape = (p, 4)
    x[...] = me + 20
    said.append(str(comm.all_gather(x, out=out)[:, 0].tolist()))
    return said


@needs_kernel
@pytest.mark.timeout(60)
def test_changed_arrays_take_the_python_path() -> None:
    results = tcoll.spawn(arrays_that_change, 2, timeout=50, transport="shm")
    for said in results:
        assert said == ["[10, 11]", "ValueError: True", "ValueError: True", "[20, 21]"], results


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def late(comm: tcoll.Communicator) -> tuple[bool, int]:
    """all_to_all into the same out with the last rank late by turns (past the kernel's spin): right results."""
    p, me = comm.size, comm.rank
    x, out = np.zeros((p, 3), np.float32), np.zeros((p, 3), np.float32)
    ok = True
    for call in range(30):
        x[...] = me * 100 + call + np.arange(p)[:, None]
        if me == p - 1 and call % 3 == 1:
            _busy(0.002)
        comm.all_to_all(x, out=out)
        ok &= bool(np.array_equal(out, np.array([[q * 100 + call + me] * 3 for q in range(p)], np.float32)))
    return ok, _completed(comm, x, out, "all_to_all", "auto")


@needs_kernel
@pytest.mark.timeout(60)
def test_a_late_peer_hands_a_block_call_over_to_python() -> None:
    results = tcoll.spawn(late, 3, timeout=50, transport="shm")
    assert all(ok for ok, _ in results), results


def another_call(comm: tcoll.Communicator, how: str) -> tuple[str, bool]:
    """Express all_gathers, then rank 0 alone makes another call; every rank must raise, and go on."""
    p, me = comm.size, comm.rank
    x, out = np.full(3, me, np.float32), np.zeros((p, 3), np.float32)
    for _ in range(5):
        comm.all_gather(x, out=out)
    if me == 0 and how == "size":
        said = mismatch_said(lambda: comm.all_gather(np.ones(4, np.float32), out=np.zeros((p, 4), np.float32)))
    elif me == 0:
        said = mismatch_said(lambda: comm.all_to_all(np.ones((p, 3), np.float32), out=np.zeros((p, 3), np.float32)))
    else:
        said = mismatch_said(lambda: comm.all_gather(x, out=out))
    got = comm.all_gather(x, out=out)
    return said, bool(np.array_equal(got[:, 0], np.arange(p, dtype=np.float32)))


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["size", "collective"])
def test_another_call_on_one_rank_is_an_error_on_every_rank(how: str) -> None:
    results = tcoll.spawn(another_call, 3, (how,), timeout=50, transport="shm")
    assert_every_rank_raised(results, how)


def new_outputs(comm: tcoll.Communicator, name: str) -> tuple[list[str], int]:
    """Calls without out: a new array every call (earlier results keep their values), NumPy's result, and the
    calls run express into the remembered call's own output."""
    p, me = comm.size, comm.rank
    x = np.zeros((p, 3), np.int32)
    send = x[0] if name in ("all_gather", "gather") else x
    kept, bad = [], []
    for call in range(12):
        x[...] = (np.arange(p * 3).reshape(p, 3) + 10 * me + call)
        inputs = [(np.arange(p * 3).reshape(p, 3) + 10 * q + call).astype(np.int32) for q in range(p)]
        got = (comm.gather(send, ROOT) if name == "gather" else comm.all_gather(send) if name == "all_gather"
               else comm.all_to_all(x) if name == "all_to_all" else comm.reduce_scatter(x))
        want = _expected(name, inputs, me)
        if want is None:
            if got is not None:
                bad.append(f"rank {me}: {name} off root gave {got!r}")
            continue
        if any(got is old or np.shares_memory(got, old) for old, _ in kept) or not np.array_equal(got, want):
            bad.append(f"rank {me} call {call}: {name}")
        kept.append((got, want.copy()))
    bad += [f"rank {me}: an earlier {name} result changed" for got, want in kept if not np.array_equal(got, want)]
    keys = {"all_gather": ("all_gather", "auto"), "gather": ("gather", ROOT, "auto"), "all_to_all": (name, "auto"),
            "reduce_scatter": ("reduce_scatter", "sum", "auto")}
    entry = comm.core.dispatch.lean.get((id(send), id(None), *keys[name]))
    return bad, getattr(getattr(entry, "express", None), "completed", 0)


@needs_kernel
@pytest.mark.alone  # (a call runs whole in C only when every rank comes within the kernel's spin)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["all_gather", "gather", "all_to_all", "reduce_scatter"])
def test_calls_without_out_return_a_new_array_each_time(name: str) -> None:
    results = tcoll.spawn(new_outputs, 2, (name,), timeout=50, transport="shm")
    assert not [f for bad, _ in results for f in bad], results
    assert all(express > 0 for _, express in results), results


def changed_in_place(comm: tcoll.Communicator, how: str) -> str:
    """Express all_gathers / all_to_alls, then one array changed in place (no other call in between): the next
    call sees it as the checks do."""
    p, me = comm.size, comm.rank
    x, out = np.arange(4, dtype=np.int64) + me, np.zeros((p, 4), np.int64)
    row = np.zeros(2, np.int64) + me
    for _ in range(6):
        comm.all_gather(x, out=out)
        got = comm.all_gather(row)  # (no out: the remembered call's own output, copied)
    try:
        if how == "out dtype":
            out.dtype = np.float64
            return repr(comm.all_gather(x, out=out).dtype)
        if how == "out shape":
            out.shape = (p * 4,)
            return repr(comm.all_gather(x, out=out).shape)
        if how == "x shape":
            row.shape = (2, 1)
            return repr(comm.all_gather(row).shape)
        return repr(got.shape)
    except ValueError as exc:
        return "ValueError: " + str(exc)[:60]


@needs_kernel
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how,want", [("out dtype", "ValueError"), ("out shape", "ValueError"),
                                      ("x shape", "(2, 2, 1)")])
def test_an_array_changed_in_place_is_seen(how: str, want: str) -> None:
    """A dtype or shape set in place on an array an express call was made for: the checks' error, or the
    result's new shape, never a run on the stale binding."""
    results = tcoll.spawn(changed_in_place, 2, (how,), timeout=50, transport="shm")
    assert all(said.startswith(want) for said in results), results
