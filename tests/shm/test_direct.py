"""The shared-memory direct algorithms beyond the matrix: zero-copy buffers, step
bookkeeping across mixed calls, selection, oversubscription and faults.

The matrix in test_collectives.py runs every op and dtype through the "shm"
algorithms on thread ranks (which share an arena too) and on processes; here
the process ranks use `comm.empty` buffers (read in place by the others), mix
them with ordinary ones, and run long random sequences of different
collectives with a tiny slot, so that every step-counter path is taken.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np
import pytest
from helpers.procs import rank_report, write_report

import tcoll
from tcoll.shm.arena import ZERO_COPY_BYTES

pytestmark = pytest.mark.usefixtures("no_leftovers")

COUNT = ZERO_COPY_BYTES // 8 + 1001  # float64 elements: large enough to lend, not a multiple of anything
SLOT = "4096"  # many steps per call


def _data(rank: int, count: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(count) * (rank + 3) + salt) % 1013).astype(np.float64)


def _buffer(comm: tcoll.Communicator, shared: bool, values: np.ndarray) -> np.ndarray:
    out = comm.empty(values.shape, values.dtype) if shared else np.empty_like(values)
    out[...] = values
    return out


def every_collective_zero_copy(comm: tcoll.Communicator, lenders: list[int]) -> list[str]:
    """Each collective with the ranks in `lenders` passing comm.empty buffers; returns the failures."""
    p, r = comm.size, comm.rank
    shared = r in lenders
    bad: list[str] = []

    def check(what: str, got: Any, want: np.ndarray) -> None:
        if got is None or not np.array_equal(np.asarray(got), want):
            bad.append(f"rank {r} lenders {lenders}: {what}")

    inputs = [_data(q, COUNT) for q in range(p)]
    x = _buffer(comm, shared, inputs[r])
    check("all_reduce", comm.all_reduce(x, algorithm="shm"), sum(inputs))
    x = _buffer(comm, shared, inputs[r])
    comm.reduce(x, p - 1, algorithm="shm")
    check("reduce", x, sum(inputs) if r == p - 1 else inputs[r])
    for root in range(p):
        x = _buffer(comm, shared, inputs[r] if r == root else np.zeros(COUNT))
        check(f"broadcast root {root}", comm.broadcast(x, root, algorithm="shm"), inputs[root])
    x = _buffer(comm, shared, inputs[r])
    check("all_gather", comm.all_gather(x, algorithm="shm"), np.stack(inputs))
    check("gather", comm.gather(x, 1 % p, algorithm="shm"), np.stack(inputs)) if r == 1 % p else \
        comm.gather(x, 1 % p, algorithm="shm")
    check("input unchanged", x, inputs[r])
    blocks = _buffer(comm, shared, np.stack([_data(r, COUNT // p, salt=q) for q in range(p)]))
    check("all_to_all", comm.all_to_all(blocks, algorithm="shm"), np.stack([_data(q, COUNT // p, salt=r)
                                                                            for q in range(p)]))
    scatter_root = p // 2
    chunks = _buffer(comm, shared, np.stack([_data(q, COUNT // p, 7) for q in range(p)])) \
        if r == scatter_root else None
    check("scatter", comm.scatter(chunks, scatter_root, algorithm="shm"), _data(r, COUNT // p, 7))
    rs_in = [np.stack([_data(q, COUNT // p, salt=j) for j in range(p)]) for q in range(p)]
    y = _buffer(comm, shared, rs_in[r])
    check("reduce_scatter", comm.reduce_scatter(y, algorithm="shm"), sum(a[r:r + 1] for a in rs_in))
    check("reduce_scatter input unchanged", y, rs_in[r])
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size,lenders,slot", [(2, [0, 1], SLOT), (3, [1], SLOT), (4, [0, 2, 3], SLOT),
                                               (3, [0], "192K")])  # pieces the C kernel copies
def test_zero_copy_buffers_are_read_in_place(size: int, lenders: list[int], slot: str) -> None:
    failures = tcoll.spawn(every_collective_zero_copy, size, (lenders,), timeout=100, transport="shm",
                           shm_slot=slot)
    assert not [f for rank in failures for f in rank], failures


def random_mix(comm: tcoll.Communicator, calls: int, seed: int) -> list[str]:
    """A long seeded sequence of different shm collectives, roots and sizes, some lent, back to back."""
    rng = np.random.default_rng(seed)  # the same sequence on every rank
    p, r = comm.size, comm.rank
    bad = []
    for call in range(calls):
        kind = rng.integers(0, 5)
        count = int(rng.choice([1, 3, 200, 700, COUNT]))
        root = int(rng.integers(0, p))
        lend = bool(rng.integers(0, 2)) and (r + call) % 2 == 0
        inputs = [_data(q, count, call) for q in range(p)]
        x = _buffer(comm, lend, inputs[r])
        if kind == 0:
            comm.all_reduce(x, algorithm="shm")
            ok = np.array_equal(x, sum(inputs))
        elif kind == 1:
            got = comm.broadcast(x if r == root else _buffer(comm, lend, np.zeros(count)), root, algorithm="shm")
            ok = np.array_equal(got, inputs[root])
        elif kind == 2:
            ok = np.array_equal(comm.all_gather(x, algorithm="shm"), np.stack(inputs))
        elif kind == 3:
            comm.reduce(x, root, algorithm="shm")
            ok = np.array_equal(x, sum(inputs) if r == root else inputs[r])
        else:
            comm.barrier(algorithm="shm")
            ok = True
        if not ok:
            bad.append(f"rank {r}: call {call} kind {kind} count {count} root {root} lend {lend}")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 5])
def test_random_sequences_keep_every_rank_in_step(size: int) -> None:
    failures = tcoll.spawn(random_mix, size, (120, size), timeout=100, transport="shm", shm_slot="512")
    assert not [f for rank in failures for f in rank], failures


def oversubscribed(comm: tcoll.Communicator) -> bool:
    """8 ranks on a 2-core machine: small and large calls, mixed with point-to-point traffic."""
    p, r = comm.size, comm.rank
    x = np.zeros(2, dtype=np.float32)
    for i in range(300):
        x[:] = r + i
        comm.all_reduce(x)
        assert x[0] == sum(range(p)) + p * i
    pending = comm.isend(np.full(300_000, r, dtype=np.int64), (r + 1) % p)  # larger than an eager copy
    big = np.full(300_000, r, dtype=np.int64)
    comm.all_reduce(big)  # blocks while the isend still needs this rank to push it
    got = comm.recv(np.empty(300_000, dtype=np.int64), (r - 1) % p)
    pending.wait()
    return bool((big == sum(range(p))).all() and (got == (r - 1) % p).all())


@pytest.mark.timeout(120)
def test_more_ranks_than_cores() -> None:
    assert tcoll.spawn(oversubscribed, 8, timeout=100, transport="shm") == [True] * 8


def choices(comm: tcoll.Communicator) -> dict[str, Any]:
    x = np.ones(8)
    out: dict[str, Any] = {"auto": comm.core.dispatch.choose("all_reduce", "auto", 8, blocking=True).name,
                           "async": comm.core.dispatch.choose("all_reduce", "auto", 8, blocking=False).name}
    try:
        comm.all_reduce(x, algorithm="shm", async_op=True)
        out["async_shm"] = "ran"
    except ValueError as exc:
        out["async_shm"] = str(exc)
    work = comm.all_reduce(x, async_op=True)  # "auto" async: a point-to-point algorithm
    out["async_result"] = work.wait(timeout=30).tolist()
    buf = comm.zeros((3, 5), np.int16)
    out["zeros"] = [buf.shape, str(buf.dtype), int(np.abs(buf).sum()), buf.flags.writeable, buf.flags.c_contiguous]
    import torch

    tensor = torch.from_numpy(comm.empty(6, np.float32))
    tensor.fill_(comm.rank + 1)
    comm.all_reduce(tensor)
    out["torch"] = tensor.tolist()
    return out


@pytest.mark.timeout(60)
def test_selection_async_and_buffers() -> None:
    pytest.importorskip("torch")
    results = tcoll.spawn(choices, 2, timeout=50, transport="shm")
    for got in results:
        assert got["auto"] == "shm" and got["async"] != "shm"
        assert "only blocking calls" in got["async_shm"]
        assert got["async_result"] == [2.0] * 8
        assert got["zeros"] == [(3, 5), "int16", 0, True, True]
        assert got["torch"] == [3.0] * 6
    assert "* shm" in tcoll.explain("all_reduce", 8, 4)
    assert "* shm" not in tcoll.explain("all_reduce", 8, 4, transport="tcp")


def tcp_buffers(comm: tcoll.Communicator) -> tuple[bool, bool]:
    buf = comm.empty(4)
    return isinstance(buf, np.ndarray), buf.sum() == 0


@pytest.mark.timeout(60)
def test_empty_without_shared_memory_is_an_ordinary_array() -> None:
    assert tcoll.spawn(tcp_buffers, 2, timeout=50, transport="tcp") == [(True, True)] * 2


# -- faults -------------------------------------------------------------------------------------


def mismatched(comm: tcoll.Communicator) -> list[str]:
    seen = []
    x = np.ones(4 if comm.rank == 0 else 8)
    try:
        comm.all_reduce(x, algorithm="shm")
        seen.append("no error")
    except tcoll.MismatchError as exc:
        seen.append(f"MismatchError: {exc}")
    y = np.ones(4)
    comm.all_reduce(y, algorithm="shm")  # the ranks agree again: a new arena serves the call, rightly
    seen.append(f"then {y.tolist()}")
    return seen


@pytest.mark.timeout(60)
def test_a_mismatched_call_is_an_error_on_every_rank_and_the_next_call_is_right() -> None:
    for seen in tcoll.spawn(mismatched, 3, timeout=50, transport="shm"):
        assert seen[0].startswith("MismatchError: all_reduce #1"), seen
        assert "rank 0 called all_reduce(4 elements) where rank" in seen[0] or \
            "called all_reduce(8 elements) where rank 0 called all_reduce(4 elements)" in seen[0], seen
        assert seen[1] == "then [3.0, 3.0, 3.0, 3.0]"


def late_rank(comm: tcoll.Communicator) -> dict[str, Any]:
    comm.barrier(algorithm="shm")  # the arena exists (its setup is collective)
    if comm.rank == 2:
        for peer in (0, 1):
            comm.recv(np.zeros(1), peer, tag=9)  # arrives only after that rank gave up
        return {}
    comm.timeout = 0.5
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(3), algorithm="shm")
        outcome: dict[str, Any] = {"type": None}
    except tcoll.TimeoutError as exc:
        outcome = {"type": "TimeoutError", "peers": exc.peers, "message": str(exc)}
    except tcoll.PeerFailedError as exc:  # the other waiting rank timed out first, and said so
        outcome = {"type": "PeerFailedError", "peers": [2], "message": str(exc)}
    outcome["elapsed"] = time.monotonic() - start
    comm.send(np.zeros(1), 2, tag=9)
    return outcome


@pytest.mark.timeout(60)
def test_a_timeout_names_the_missing_rank() -> None:
    results = tcoll.spawn(late_rank, 3, timeout=50, transport="shm")
    assert "TimeoutError" in {got["type"] for got in results[:2]}
    for got in results[:2]:
        assert got["peers"] == [2], got
        assert "all_reduce #2 (shm) did not complete within 0.5 s: rank(s) [2] never entered it" in got["message"]
        assert got["elapsed"] < 10


def killed_during_all_reduce(comm: tcoll.Communicator, report_dir: str) -> None:
    x = np.ones(1000)
    comm.all_reduce(x, algorithm="shm")
    if comm.rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # tcoll.spawn stops the survivors: report first
    start = time.monotonic()
    try:
        comm.all_reduce(x, algorithm="shm")
        report: dict[str, Any] = {"type": None}
    except tcoll.PeerLostError as exc:
        report = {"type": "PeerLostError", "rank": exc.rank}
    report["elapsed"] = time.monotonic() - start
    write_report(report_dir, comm.rank, report)


@pytest.mark.timeout(60)
def test_a_killed_peer_is_named_within_seconds(tmp_path: Any) -> None:
    with pytest.raises(tcoll.SpawnError):
        tcoll.spawn(killed_during_all_reduce, 3, (str(tmp_path),), timeout=50, transport="shm")
    for rank in (1, 2):
        report = rank_report(tmp_path, rank)
        assert report["type"] == "PeerLostError" and report["rank"] == 0, report
        assert report["elapsed"] < 10, report


# -- regressions ----------------------------------------------------------------------------------

BIG_ITEM = np.dtype([("a", "f8", 16)])  # 128 B: more than a 64-byte slot's share


def big_items(comm: tcoll.Communicator) -> list[str]:
    """Items larger than a slot: moved byte-wise by shm; reductions of them fall back to point-to-point."""
    p, r = comm.size, comm.rank
    bad = []
    mine = np.zeros(3, BIG_ITEM)
    mine["a"] = r + 1
    want = np.stack([np.full((3, 16), q + 1.0) for q in range(p)])
    for algorithm in ("auto", "shm"):
        if not np.array_equal(comm.all_gather(mine, algorithm=algorithm)["a"], want):
            bad.append(f"all_gather {algorithm}")
        got = comm.gather(mine, 0, algorithm=algorithm)
        if r == 0 and not np.array_equal(got["a"], want):
            bad.append(f"gather {algorithm}")
        if not np.array_equal(comm.scatter(np.stack([mine] * p) if r == 0 else None, 0, algorithm=algorithm)["a"],
                              np.full((3, 16), 1.0)):
            bad.append(f"scatter {algorithm}")
    add = tcoll.Op(lambda a, b: np.rec.fromarrays([a["a"] + b["a"]], dtype=BIG_ITEM), name="add")
    total = mine.copy()
    comm.all_reduce(total, add)  # auto: not shm (the items do not fit), so it works
    if not np.array_equal(total["a"], np.full((3, 16), p * (p + 1) / 2)):
        bad.append("all_reduce auto")
    try:
        comm.all_reduce(mine.copy(), add, algorithm="shm")
        bad.append("all_reduce shm accepted items larger than its slot")
    except ValueError as exc:
        if "TCOLL_SHM_SLOT" not in str(exc):
            bad.append(f"all_reduce shm: {exc}")
    comm.barrier(algorithm="shm")  # the arena is still in step
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [True, False])
def test_items_larger_than_a_slot(threads: bool) -> None:
    kwargs: dict[str, Any] = {"threads": True} if threads else {"transport": "shm"}
    failures = tcoll.spawn(big_items, 3, timeout=50, shm_slot="64", **kwargs)
    assert not [f for rank in failures for f in rank], failures


def failing_user_op(comm: tcoll.Communicator) -> list[str]:
    def explode(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        raise RuntimeError("user op failed")

    outcome = []
    try:
        comm.all_reduce(np.ones(5000), tcoll.Op(explode), algorithm="shm")  # the large path: raises mid-call
    except RuntimeError as exc:
        outcome.append(str(exc))
    except tcoll.PeerFailedError as exc:  # another rank's op failed first, and it said so
        outcome.append("user op failed" if "RuntimeError: user op failed" in str(exc) else str(exc))
    x = np.full(3, comm.rank + 1.0)
    comm.all_reduce(x, algorithm="shm")  # a new arena serves the ranks, in step again
    outcome.append(str(x.tolist()))
    return outcome


@pytest.mark.timeout(60)
def test_a_call_that_fails_midway_leaves_the_next_call_right() -> None:
    for outcome in tcoll.spawn(failing_user_op, 3, timeout=50, transport="shm", shm_slot="4096"):
        assert outcome == ["user op failed", "[6.0, 6.0, 6.0]"], outcome


def arenas_mapped() -> int:
    with open("/proc/self/maps") as handle:
        return sum(1 for line in handle if "arena" in line)  # one mapping per arena


def sub_communicators(comm: tcoll.Communicator) -> tuple[int, int, int, int]:
    comm.barrier(algorithm="shm")
    before, closers = arenas_mapped(), len(comm.core.engine.closers)
    for _ in range(10):
        sub = comm.dup()
        sub.all_reduce(np.ones(4), algorithm="shm")
        sub.close()
    return before, arenas_mapped(), closers, len(comm.core.engine.closers)


@pytest.mark.timeout(60)
def test_a_closed_sub_communicator_releases_its_arena() -> None:
    for before, after, closers_before, closers_after in tcoll.spawn(sub_communicators, 2, timeout=50,
                                                                    transport="shm"):
        assert after == before and closers_after == closers_before
