"""Ranks that disagree about a call get a named error, every one of them; later calls are right or fail.

Each scenario makes one call on which the ranks disagree (an op, a root, a
dtype, the collective itself, a bad argument on one rank, blocking against
async), then a check call and a final call on which they agree. The
expectations, for every rank:

- the disagreeing call raises MismatchError (PeerFailedError for a bad
  argument on another rank), never returns silently different data; except
  that a rank whose part of a rooted call over point-to-point is only to
  send may finish before the disagreement reaches it: then a later call
  raises, naming the call that disagreed (the next one, unless the late
  message was still on its way);
- the final call is right (NumPy reference): nothing shifted.

One world per (transport, size) runs every scenario, blocking and async.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tcoll

Scenario = Callable[[tcoll.Communicator, bool], Any]


def _op_differs(comm: tcoll.Communicator, async_op: bool) -> Any:
    op = "max" if comm.rank == comm.size - 1 else "sum"
    return comm.all_reduce(np.full(4, comm.rank + 1.0), op, async_op=async_op)


def _root_differs(comm: tcoll.Communicator, async_op: bool) -> Any:
    root = comm.size - 1 if comm.rank == comm.size - 1 else 0
    return comm.broadcast(np.full(4, comm.rank + 1.0), root=root, async_op=async_op)


def _dtype_differs(comm: tcoll.Communicator, async_op: bool) -> Any:
    dtype = np.float32 if comm.rank == comm.size - 1 else np.int32  # the same item size
    return comm.all_reduce(np.ones(4, dtype=dtype), async_op=async_op)


def _collective_differs(comm: tcoll.Communicator, async_op: bool) -> Any:
    x = np.full(4, comm.rank + 1.0)
    if comm.rank == 0:
        return comm.broadcast(x, root=1, async_op=async_op)
    return comm.all_reduce(x, async_op=async_op)


def _count_differs(comm: tcoll.Communicator, async_op: bool) -> Any:
    return comm.all_gather(np.ones(3 if comm.rank == 0 else 5), async_op=async_op)


def _bad_argument_on_one_rank(comm: tcoll.Communicator, async_op: bool) -> Any:
    x = np.ones(8)
    return comm.all_reduce(x[::2] if comm.rank == 0 else x[:4], async_op=async_op)


SCENARIOS: dict[str, Scenario] = {
    "op": _op_differs, "root": _root_differs, "dtype": _dtype_differs, "collective": _collective_differs,
    "count": _count_differs, "bad_argument": _bad_argument_on_one_rank,
}


def _outcome(call: Callable[[], Any]) -> str:
    try:
        result = call()
        if isinstance(result, tcoll.Work):
            result.wait()
        return "ok"
    except (tcoll.TcollError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def run_scenarios(comm: tcoll.Communicator, blocking_only: bool) -> dict[str, list[str]]:
    """Every scenario, blocking then async; per scenario: [the call, the check call, the final call's result]."""
    comm.timeout = 20.0
    report = {}
    for name, scenario in SCENARIOS.items():
        for async_op in (False,) if blocking_only else (False, True):
            seen = [_outcome(lambda: scenario(comm, async_op))]
            seen.append(_outcome(lambda: comm.barrier()))
            seen.append(_outcome(lambda: comm.all_reduce(np.ones(2))))
            final = np.full(3, comm.rank + 1.0)
            seen.append(_outcome(lambda: comm.all_reduce(final)))
            seen.append(str(final.tolist()))
            report[f"{name}-{'async' if async_op else 'blocking'}"] = seen
    return report


def mixed_blocking_and_async(comm: tcoll.Communicator) -> list[str]:
    """Rank 0 starts the call async, the others make it blocking: on one host, arena against point-to-point."""
    comm.timeout = 20.0
    x = np.ones(6)
    seen = [_outcome(lambda: comm.all_reduce(x, async_op=comm.rank == 0))]
    final = np.full(2, 1.0)
    seen.append(_outcome(lambda: comm.barrier()))
    seen.append(_outcome(lambda: comm.all_reduce(final)))
    return seen + [str(final.tolist())]  # the ranks agree again, so the final call is right


_worlds: dict[tuple[str, int], list[dict[str, list[str]]]] = {}


def _reports(transport: str, size: int) -> list[dict[str, list[str]]]:
    if (transport, size) not in _worlds:
        _worlds[transport, size] = tcoll.spawn(run_scenarios, size, (False,), timeout=150, transport=transport)
    return _worlds[transport, size]


WORLDS = [("shm", 2), ("shm", 4), ("tcp", 2), ("tcp", 4)]
CASES = [f"{name}-{mode}" for name in SCENARIOS for mode in ("blocking", "async")]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}-{n}" for t, n in WORLDS])
def test_disagreement_is_an_error_on_every_rank(transport: str, size: int, case: str) -> None:
    reports = _reports(transport, size)
    want = [float(size * (size + 1) / 2)] * 3
    for rank, report in enumerate(reports):
        call, check, later, final, value = report[case]
        if case.startswith("bad_argument") and rank == 0:
            assert call.startswith("ValueError") and "contiguous" in call, (rank, report[case])
        elif call == "ok":  # only a rank that only sends in a rooted call may finish; a later call says so
            said = check if check != "ok" else later
            assert case.startswith(("root", "collective")) and said.startswith("MismatchError"), (rank, report[case])
            # what disagreed, or that a rank reopens the arena after it (the failure it heard of first)
            assert "broadcast(root=" in said or "new shared-memory arena" in said, (rank, report[case])
        else:
            expected = "PeerFailedError" if case.startswith("bad_argument") else "MismatchError"
            assert call.startswith((expected, "MismatchError")), (rank, report[case])
            assert "where rank" in call or "failed this call" in call or "disagree" in call, (rank, report[case])
        assert final == "ok" and value == str(want), (rank, report[case])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("size", [2, 4])
def test_the_message_says_what_each_side_called(size: int) -> None:
    call = _reports("tcp", size)[0]["op-blocking"][0]
    assert f"rank {size - 1} called all_reduce(op=max) where rank 0 called all_reduce(op=sum)" in call or \
        "found the ranks disagree" in call, call


@pytest.mark.timeout(120)
def test_blocking_against_async_on_one_host_is_a_mismatch_not_garbage() -> None:
    for rank, seen in enumerate(tcoll.spawn(mixed_blocking_and_async, 3, timeout=100, transport="shm")):
        assert seen[0].startswith(("MismatchError", "PeerFailedError")), (rank, seen)
        assert seen[2] == "ok" and seen[3] == "[3.0, 3.0]", (rank, seen)


def overlapping(comm: tcoll.Communicator, algorithm: str, collective: str) -> list[float]:
    p, r = comm.size, comm.rank
    if collective == "all_to_all":
        x = np.array([10.0 * r + j for j in range(p)])
        comm.all_to_all(x, out=x, algorithm=algorithm)  # in place, as MPI_IN_PLACE
        return x.tolist()
    x = np.array([10.0 * r + j for j in range(p)])
    out = x[:1]  # rank r's part lands over the front of its own input
    comm.reduce_scatter(x, out=out, algorithm=algorithm)
    return out.tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["all_to_all", "reduce_scatter"])
def test_overlapping_input_and_output_give_the_right_answer(collective: str) -> None:
    size = 3
    for algorithm in ["auto", *tcoll.algorithms(collective)]:
        kwargs: dict[str, Any] = {"threads": True} if algorithm != "shm" else {"threads": True}
        results = tcoll.spawn(overlapping, size, (algorithm, collective), timeout=60, **kwargs)
        for r, got in enumerate(results):
            if collective == "all_to_all":
                want = [10.0 * q + r for q in range(size)]
            else:
                want = [float(sum(10.0 * q + r for q in range(size)))]
            assert got == want, (algorithm, r, got, want)


def absent_rank(comm: tcoll.Communicator, flag: str, busy: bool) -> str:
    """Rank 2 is not in the collective: inside a receive (busy=False) or in its own code (busy=True)."""
    import os

    x = np.ones(1000)
    if comm.rank != 2:
        comm.timeout = 2.0
        said = _outcome(lambda: comm.all_reduce(x, algorithm="ring"))
        if comm.rank == 0:
            comm.timeout = 20.0
            open(flag, "w").close()
            comm.send(np.ones(1), 2, tag=7)  # let rank 2 go on
        return said
    comm.timeout = 20.0
    if busy:
        while not os.path.exists(flag):  # not a tcoll call: its engine makes no progress
            pass
    comm.recv(np.empty(1), src=0, tag=7)
    return "ok"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("busy", [False, True], ids=["in_another_call", "in_its_own_code"])
def test_a_timeout_names_the_rank_that_never_entered_the_call(tmp_path: Any, busy: bool) -> None:
    flag = str(tmp_path / "flag")
    results = tcoll.spawn(absent_rank, 3, (flag, busy), timeout=60, transport="tcp")
    for rank in (0, 1):
        said = results[rank]
        assert said.startswith(("TimeoutError", "PeerFailedError")), said
        if busy:
            assert "rank(s) [2] did not answer" in said and "not in any tcoll call" in said, said
        else:
            assert "rank 2 (its last call is #0) never entered it" in said, said
