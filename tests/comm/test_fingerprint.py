"""What the call stamp tells apart: every distinct dtype and every distinct user op.

Pure tests check the stamps; the multi-process ones make one call on which
the last rank disagrees (a datetime unit, a record layout, bytes against
int32, another lambda), over shm and tcp: every rank raises MismatchError,
and the next call is right on every rank (NumPy's answer).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll.algos import stamps


def _stamp(dtype: Any = np.float64, op: tcoll.Op | None = None) -> int:
    return stamps.stamp("all_gather", "all_gather", op, np.dtype(dtype), 4, 0, None)


PAIRS = [
    ("datetime64[s]", "datetime64[ms]"), ("timedelta64[D]", "timedelta64[h]"), ("datetime64[2s]", "datetime64[3s]"),
    ([("a", "<i4"), ("b", "<f4")], [("b", "<f4"), ("a", "<i4")]),  # the same item size, other fields
    ([("a", "<i4"), ("b", "<f4")], [("a", "<f4"), ("b", "<i4")]),
    ("S4", "int32"), ("S4", "V4"), ("S4", "U1"), ("<U2", ">U2"), (">M8[s]", "<M8[s]"),
]


@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_distinct_dtypes_have_distinct_stamps(pair: tuple[Any, Any]) -> None:
    mine, theirs = _stamp(pair[0]), _stamp(pair[1])
    assert mine != theirs
    said = stamps.disagreement(1, theirs, 0, mine)
    assert said.count("all_gather(") == 2 and "4 elements" not in said, said  # the dtype differs, nothing else


def test_datetime_units_are_named_in_the_message() -> None:
    said = stamps.disagreement(1, _stamp("datetime64[ms]"), 0, _stamp("datetime64[s]"))
    assert said == "rank 1 called all_gather(datetime64[ms]) where rank 0 called all_gather(datetime64[s])"


def test_the_same_dtype_has_the_same_stamp() -> None:
    assert _stamp([("a", "<i4"), ("b", "<f4")]) == _stamp(np.dtype([("a", "<i4"), ("b", "<f4")]))
    assert _stamp("S4") == _stamp(np.dtype("S4"))


def _scale(a: np.ndarray, b: np.ndarray, factor: float) -> np.ndarray:
    return a + factor * b


class _Adder:
    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b


def test_user_ops_differ_by_function_not_by_where_they_are_made() -> None:
    made = [tcoll.Op(lambda a, b: a + b), tcoll.Op(lambda a, b: a * b), tcoll.Op(lambda a, b: np.maximum(a, b)),
            tcoll.Op(functools.partial(_scale, factor=2.0)), tcoll.Op(functools.partial(_scale, factor=3.0)),
            tcoll.Op(_Adder()), tcoll.Op(np.add, name="mine"), tcoll.Op(np.multiply, name="mine"),
            tcoll.Op(lambda a, b: a + b, commutative=False)]
    seen = [_stamp(op=op) for op in made]
    assert len(set(seen)) == len(seen)
    again = [tcoll.Op(lambda a, b: a + b), tcoll.Op(functools.partial(_scale, factor=2.0)), tcoll.Op(_Adder())]
    assert [_stamp(op=op) for op in again] == [seen[0], seen[3], seen[5]]


def test_user_op_names_do_not_collide() -> None:
    """Names once went through 32 values; a thousand ops of different names now all differ."""
    ops = [tcoll.Op(np.add, name=f"op{i}") for i in range(1000)]
    assert len({_stamp(op=op) for op in ops}) == 1000
    assert len({op.identity for op in ops}) == 1000


def test_the_identity_does_not_depend_on_the_process() -> None:
    """Python's hash() is salted per process; the identity must not be."""
    import subprocess
    import sys

    code = "import tcoll; print(tcoll.Op(lambda a, b: a - b, name='x').identity)"
    seen = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**__import__("os").environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (1, 2, 3)}
    assert len(seen) == 1, seen


def test_two_lambdas_are_named_apart_in_the_message() -> None:
    add, mul = tcoll.Op(lambda a, b: a + b), tcoll.Op(lambda a, b: a * b)
    said = stamps.disagreement(1, _stamp(op=mul), 0, _stamp(op=add))
    assert said.startswith("rank 1 called all_gather(op=user op '<lambda>' #") and said.count("#") == 2, said


# -- the ranks disagree ------------------------------------------------------------------------


def _datetimes(comm: tcoll.Communicator) -> Any:
    unit = "ms" if comm.rank == comm.size - 1 else "s"
    return comm.all_gather(np.array(["2023-11-14T00:00:00"], dtype=f"datetime64[{unit}]"))


def _records(comm: tcoll.Communicator) -> Any:
    fields = [("b", "<f4"), ("a", "<i4")] if comm.rank == comm.size - 1 else [("a", "<i4"), ("b", "<f4")]
    return comm.all_gather(np.zeros(3, dtype=fields))


def _bytes(comm: tcoll.Communicator) -> Any:
    x = np.zeros(2, dtype=np.int32)
    return comm.all_gather(x.view("S4") if comm.rank == comm.size - 1 else x)


def _lambdas(comm: tcoll.Communicator) -> Any:
    op = tcoll.Op(lambda a, b: a * b) if comm.rank == comm.size - 1 else tcoll.Op(lambda a, b: a + b)
    return comm.all_reduce(np.full(4, 2.0), op=op)


def _counts(comm: tcoll.Communicator) -> Any:
    """reduce_scatterv of one vector, cut by another counts list on the last rank (the same total)."""
    counts = [1] * comm.size
    counts[0] += 1
    if comm.rank == comm.size - 1:
        counts[0], counts[-1] = counts[-1], counts[0]
    return comm.reduce_scatterv(np.arange(comm.size + 1, dtype=np.float32), counts)


SCENARIOS: dict[str, Callable[[tcoll.Communicator], Any]] = {
    "datetimes": _datetimes, "records": _records, "bytes": _bytes, "lambdas": _lambdas, "counts": _counts,
}


def _outcome(call: Callable[[], Any]) -> str:
    try:
        call()
        return "ok"
    except (tcoll.TcollError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def disagreeing(comm: tcoll.Communicator) -> dict[str, list[str]]:
    """Each scenario, then a call the ranks agree on: (the scenario's outcome, the next call's, its value)."""
    comm.timeout = 30.0
    report = {}
    for name, scenario in SCENARIOS.items():
        said = _outcome(lambda: scenario(comm))
        after = np.array(["2023-11-14"], dtype="datetime64[s]") + np.timedelta64(comm.rank, "D")
        got: list[Any] = []
        said_after = _outcome(lambda: got.append(comm.all_gather(after)))
        report[name] = [said, said_after, str(got[0].tolist()) if got else ""]
    return report


_worlds: dict[tuple[str, int], list[dict[str, list[str]]]] = {}


def _reports(transport: str, size: int) -> list[dict[str, list[str]]]:
    if (transport, size) not in _worlds:
        _worlds[transport, size] = tcoll.spawn(disagreeing, size, timeout=150, transport=transport)
    return _worlds[transport, size]


WORLDS = [("shm", 2), ("shm", 3), ("tcp", 2), ("tcp", 3)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", list(SCENARIOS))
@pytest.mark.parametrize("transport,size", WORLDS, ids=[f"{t}-{n}" for t, n in WORLDS])
def test_a_disagreement_is_a_mismatch_on_every_rank(transport: str, size: int, case: str) -> None:
    want = str((np.array(["2023-11-14"], dtype="datetime64[s]")
                + np.arange(size).astype("timedelta64[D]")).reshape(size, 1).tolist())
    for rank, report in enumerate(_reports(transport, size)):
        said, said_after, value = report[case]
        assert said.startswith("MismatchError"), (rank, said)
        assert said_after == "ok" and value == want, (rank, report[case])
