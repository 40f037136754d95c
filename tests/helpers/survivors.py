"""What survivors do after a death, for the tests of tcoll.comm.survival: recover, then prove the new communicator.

`recover` is the recipe of docs/faults.md (catch, revoke, shrink); `every_collective`
runs every collective on the shrunk communicator with each rank's data made from its
rank in the *old* communicator, so a result computed over the wrong members differs
from NumPy's.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

import tcoll


def die() -> None:
    """End this process at once, as a crash would: no exit handler, no close."""
    os.kill(os.getpid(), signal.SIGKILL)


def recover(comm: tcoll.Communicator, step: Any) -> tuple[tcoll.Communicator, dict[str, Any]]:
    """Run step(comm); when it fails on a death, revoke and shrink. Returns the communicator to go on with.

    Returns:
        (the new communicator, what happened: the error's type and how long it took to come).
    """
    began = time.monotonic()
    seen: dict[str, Any] = {"error": None}
    try:
        step(comm)
    except tcoll.TcollError as exc:
        seen = {"error": type(exc).__name__, "after_s": time.monotonic() - began, "text": str(exc)[:300]}
        comm.revoke()
    seen["failed"] = comm.failed()
    new = comm.shrink()
    seen["old_rank"], seen["rank"], seen["size"] = comm.rank, new.rank, new.size
    return new, seen


def _value(old: int, count: int, salt: int = 0) -> np.ndarray:
    """Rank `old`'s (its rank before the shrink) data: distinct per rank, exact in float64 sums."""
    return (np.arange(count, dtype=np.float64) * 3 + 100 * old + salt) % 997


def every_collective(comm: tcoll.Communicator, olds: list[int], count: int = 40) -> None:
    """Run every collective on `comm` and compare with NumPy; `olds[r]` is rank r's rank before the shrink.

    Raises:
        AssertionError: a result differs from NumPy's.
    """
    me, size = comm.rank, comm.size
    assert comm.all_gather_object(olds[me]) == olds, "the ranks are not the survivors, in order"
    rows = [_value(old, count) for old in olds]
    x = rows[me].copy()
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, np.sum(rows, axis=0))
    m = rows[me].copy()
    comm.all_reduce(m, op="max")
    np.testing.assert_array_equal(m, np.max(rows, axis=0))
    big = np.tile(rows[me], 2000)  # 640 KB: the pipelined (split, ring) paths
    comm.all_reduce(big)
    np.testing.assert_array_equal(big, np.tile(np.sum(rows, axis=0), 2000))
    r = rows[me].copy()
    comm.reduce(r, root=size - 1)
    if me == size - 1:
        np.testing.assert_array_equal(r, np.sum(rows, axis=0))
    b = rows[me].copy()
    comm.broadcast(b, root=0)
    np.testing.assert_array_equal(b, rows[0])
    np.testing.assert_array_equal(comm.all_gather(rows[me]), np.stack(rows))
    gathered = comm.gather(rows[me], root=0)
    if me == 0:
        np.testing.assert_array_equal(gathered, np.stack(rows))
    np.testing.assert_array_equal(comm.scatter(np.stack(rows) if me == 0 else None, root=0), rows[me])
    blocks = np.stack([_value(olds[me], 4, salt=j) for j in range(size)])
    np.testing.assert_array_equal(comm.all_to_all(blocks), np.stack([_value(o, 4, salt=me) for o in olds]))
    full = np.concatenate([_value(o, 4 * size) for o in olds]).reshape(size, 4 * size)
    np.testing.assert_array_equal(comm.reduce_scatter(full[me].copy()), full.sum(axis=0)[4 * me:4 * me + 4])
    np.testing.assert_array_equal(comm.scan(rows[me].copy()), np.sum(rows[:me + 1], axis=0))
    uneven = comm.all_gatherv(_value(olds[me], me + 1))
    for r, old in enumerate(olds):
        np.testing.assert_array_equal(uneven[r], _value(old, r + 1))
    comm.barrier()
    token = np.array([olds[me]], dtype=np.int64)
    got = np.empty(1, dtype=np.int64)
    comm.sendrecv(token, (me + 1) % size, got, (me - 1) % size)
    assert int(got[0]) == olds[(me - 1) % size]
