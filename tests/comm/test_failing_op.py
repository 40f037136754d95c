"""A user's op that raises on one rank fails that call on every rank, and the next call works everywhere.

In a one-step shared-memory all_reduce (32 B) every rank reduces all slots
itself, and over point-to-point the last exchange may be done before the op
runs: without more, the other ranks would return and hear of the failure one
or two calls later. A call with a user's op ends with every rank's word that
its part went well (one more arena step, or a barrier over point-to-point),
as the three-step arena call (64 KiB) does by its nature.
"""

from __future__ import annotations

import numpy as np
import pytest

import tcoll


def failing_op_then_more(comm: tcoll.Communicator, nbytes: int, reduce_root: int | None) -> list[str]:
    """An all_reduce (or reduce) whose op raises on rank 1 only; then two calls; what each raised or gave."""
    comm.timeout = 30.0

    def add_unless_rank_1(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if comm.rank == 1:
            raise RuntimeError("the op refuses on rank 1")
        return a + b

    x = np.ones(nbytes // 8)
    seen = []
    try:
        if reduce_root is None:
            comm.all_reduce(x, op=tcoll.Op(add_unless_rank_1))
        else:
            comm.reduce(x, root=reduce_root, op=tcoll.Op(add_unless_rank_1))
        seen.append("ok")
    except (tcoll.TcollError, RuntimeError) as exc:
        seen.append(f"{type(exc).__name__}: {exc}")
    for _ in range(2):
        y = np.full(3, comm.rank + 1.0)
        try:
            comm.all_reduce(y)
            seen.append(str(y.tolist()))
        except tcoll.TcollError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def _check(seen: list[list[str]], size: int) -> None:
    want = str([size * (size + 1) / 2] * 3)
    for rank, mine in enumerate(seen):
        if rank == 1:
            assert mine[0] == "RuntimeError: the op refuses on rank 1", (rank, seen)
        else:
            assert mine[0].startswith("PeerFailedError") and "rank 1 failed this call" in mine[0], (rank, seen)
        assert mine[1:] == [want, want], (rank, seen)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nbytes", [32, 64 << 10])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_failing_op_fails_the_call_everywhere_and_the_next_call_works(transport: str, nbytes: int) -> None:
    for size in (2, 4):  # (every rank applies the op: on 3 ranks, rank 1 of recursive doubling does not)
        _check(tcoll.spawn(failing_op_then_more, size, (nbytes, None), timeout=100, transport=transport), size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_root_whose_op_fails_fails_the_reduce_everywhere(transport: str) -> None:
    _check(tcoll.spawn(failing_op_then_more, 3, (32, 1), timeout=100, transport=transport), 3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nbytes", [64 << 10, 4 << 20])
def test_a_non_root_whose_op_fails_fails_the_shm_reduce_everywhere(nbytes: int) -> None:
    """In the arena's three steps (64 KiB) and pipelined pieces (4 MiB) every rank reduces its own part, so
    rank 1's op runs and fails; ranks that do not want the result (rank 2) must not return normally."""
    _check(tcoll.spawn(failing_op_then_more, 3, (nbytes, 0), timeout=100, transport="shm"), 3)
