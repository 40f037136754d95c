"""Tests of the object collectives and send_object / recv_object.

Objects are built from the rank's number (make(r, salt)), so every rank
knows what any other rank's object must equal. They nest dicts, lists and
tuples around NumPy arrays small (pickled in-band) and large (out-of-band
buffers, sent as messages of their own), plus None, empty containers and
zero-length arrays.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

import tcoll
from tcoll import TcollError
from tcoll.comm.pickling import INLINE_BYTES, dump, load
from tcoll.algos.team import Team

BIG = INLINE_BYTES // 8 + 5  # float64 elements: just over the in-band limit


def make(r: int, salt: int = 0) -> Any:
    """Rank r's object: nested containers, small and large arrays, odd corners."""
    return {
        "rank": r,
        "salt": salt,
        "text": "x" * (r + salt),
        "none": None,
        "empty": [],
        "nothing": np.zeros(0, dtype=np.int32),
        "small": np.arange(r + 3, dtype=np.int16) * (salt + 1),
        "big": np.arange(BIG, dtype=np.float64) + r * 1000 + salt,
        "nested": [(r, [np.full((r % 3, 2), salt)]), {"deep": {"er": (salt,)}}],
        "fortran": np.asfortranarray(np.arange(BIG, dtype=np.float64).reshape(-1, 1).repeat(2, axis=1)) + r,
    }


def many_buffers(r: int, n: int = 11) -> list[np.ndarray]:
    """More out-of-band buffers than a size record holds (their sizes overflow into a second message)."""
    return [np.full(BIG + i, r * 100 + i, dtype=np.float64) for i in range(n)]


def same(a: Any, b: Any) -> bool:
    """Deep equality that compares arrays by shape, dtype and value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and bool(np.array_equal(a, b)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


# -- checks, run on every rank ----------------------------------------------------------------


def check_broadcast_object(comm: tcoll.Communicator) -> None:
    r, p = comm.rank, comm.size
    for root in sorted({0, p - 1, p // 2}):
        for salt, obj in enumerate([make(root, 1), None, [], many_buffers(root), "text", np.zeros((0, 3))]):
            mine = obj if r == root else "not sent"
            got = comm.broadcast_object(mine, root=root)
            assert same(got, obj), (root, salt)
            if r == root:
                assert got is obj  # the root keeps its own object


def check_all_gather_object(comm: tcoll.Communicator) -> None:
    r, p = comm.rank, comm.size
    mine = make(r, 2)
    got = comm.all_gather_object(mine)
    assert all(same(got[i], make(i, 2)) for i in range(p))
    assert got[r] is not mine and not np.shares_memory(got[r]["big"], mine["big"])  # a copy, own one included
    assert comm.all_gather_object(None) == [None] * p
    got = comm.all_gather_object(many_buffers(r, 3 + r))  # ranks differ in how many buffers they send
    assert all(same(got[i], many_buffers(i, 3 + i)) for i in range(p))
    got = comm.all_gather_object([(r, i, f"s{i}") for i in range(20_000)])  # many small objects: one stream
    assert all(g == [(i, j, f"s{j}") for j in range(20_000)] for i, g in enumerate(got))


def check_gather_object(comm: tcoll.Communicator) -> None:
    r, p = comm.rank, comm.size
    for root in sorted({0, p - 1}):
        got = comm.gather_object(make(r, 3), root=root)
        if r == root:
            assert all(same(got[i], make(i, 3)) for i in range(p))
        else:
            assert got is None
        got = comm.gather_object(many_buffers(r) if r % 2 else None, root=root)
        if r == root:
            assert all(same(got[i], many_buffers(i) if i % 2 else None) for i in range(p))


def check_scatter_object(comm: tcoll.Communicator) -> None:
    r, p = comm.rank, comm.size
    for root in sorted({0, p - 1}):
        objs = [make(i, 4) for i in range(p)] if r == root else None
        assert same(comm.scatter_object(objs, root=root), make(r, 4))
        objs = [[] if i % 2 else many_buffers(i) for i in range(p)] if r == root else "ignored"
        assert same(comm.scatter_object(objs, root=root), [] if r % 2 else many_buffers(r))


def check_send_recv_object(comm: tcoll.Communicator) -> None:
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    sent = [make(r, 5), None, many_buffers(r), [np.arange(i) for i in range(50)]]
    if r % 2 == 0:  # even ranks send first, so that blocking sends to a peer that sends too never wait on each other
        for i, obj in enumerate(sent):
            comm.send_object(obj, right, tag=7 + i % 2)
    got = [comm.recv_object(left, tag=7 + i % 2) for i in range(len(sent))]
    if r % 2:
        for i, obj in enumerate(sent):
            comm.send_object(obj, right, tag=7 + i % 2)
    expected = [make(left, 5), None, many_buffers(left), [np.arange(i) for i in range(50)]]
    assert all(same(g, e) for g, e in zip(got, expected))


def check_pickling_failures(comm: tcoll.Communicator) -> None:
    """A rank that cannot pickle raises its error; the others raise TcollError; the communicator goes on."""
    r, p = comm.rank, comm.size
    if p == 1:
        return
    bad = lambda: None  # lambdas do not pickle
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError) if r == 1 else TcollError):
        comm.all_gather_object(bad if r == 1 else make(r))
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError) if r == 0 else TcollError,
                       match=None if r == 0 else "root 0 could not pickle"):
        comm.broadcast_object(bad, root=0)
    objs = [bad if i == p - 1 else i for i in range(p)]
    if r in (0, p - 1):
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError) if r == 0 else TcollError):
            comm.scatter_object(objs, root=0)
    else:
        assert comm.scatter_object(objs, root=0) == r
    if r == 0:
        with pytest.raises(TcollError, match="rank 1 could not pickle"):
            comm.gather_object(None, root=0)
    elif r == 1:
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            comm.gather_object(bad, root=0)
    else:
        assert comm.gather_object(r, root=0) is None
    assert comm.all_gather_object(r) == list(range(p))


def check_bad_arguments(comm: tcoll.Communicator) -> None:
    p = comm.size
    with pytest.raises(ValueError, match="root"):
        comm.broadcast_object(1, root=p)
    with pytest.raises(ValueError, match="root"):
        comm.gather_object(1, root=-1)
    with pytest.raises(ValueError, match="dst"):
        comm.send_object(1, p)
    with pytest.raises(ValueError, match="tag"):
        comm.recv_object(0, tag=-2)  # -1 is ANY_TAG


def object_battery(comm: tcoll.Communicator) -> bool:
    for check in (check_broadcast_object, check_all_gather_object, check_gather_object, check_scatter_object,
                  check_send_recv_object, check_pickling_failures, check_bad_arguments):
        check(comm)
    return True


def huge_objects(comm: tcoll.Communicator, mib: int) -> bool:
    """A 64 MiB array inside an object, by broadcast, all-gather and point-to-point."""
    r, p = comm.rank, comm.size
    n = mib << 17  # float64 elements
    obj = {"a": np.arange(n, dtype=np.float64) + r, "r": r} if r == 0 else None
    got = comm.broadcast_object(obj, root=0)
    assert got["r"] == 0 and got["a"][-1] == n - 1 and got["a"].flags.writeable
    del got, obj
    if p > 1:
        if r == 0:
            comm.send_object(("tail", np.full(n, 3.0)), p - 1, tag=3)
        elif r == p - 1:
            label, arr = comm.recv_object(0, tag=3)
            assert label == "tail" and arr.shape == (n,) and arr[0] == arr[-1] == 3.0
    got = comm.all_gather_object(np.full(n // 4, r, dtype=np.int64))
    assert [int(g[-1]) for g in got] == list(range(p))
    return object_battery(comm)


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", range(1, 9))
def test_objects_threads(size: int) -> None:
    assert tcoll.spawn(object_battery, size, threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 3), ("tcp", 3)])
def test_objects_processes(transport: str, size: int) -> None:
    assert tcoll.spawn(huge_objects, size, (64,), timeout=120, transport=transport) == [True] * size


def test_dump_keeps_large_buffers_out_of_band() -> None:
    big = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
    small = np.arange(10)
    parts = dump({"big": big, "small": small, "again": big})
    assert len(parts) == 2  # the stream, then big's memory once (pickle memoizes the second reference)
    assert parts[0].nbytes < 1024  # the stream holds no copy of big
    assert parts[1].nbytes == big.nbytes and np.shares_memory(parts[1], big)
    copy = load([parts[0], parts[1].copy()])
    assert same(copy, {"big": big, "small": small, "again": big}) and copy["big"] is copy["again"]
    assert len(dump(np.arange(100))) == 1  # small arrays stay in the stream
    assert len(dump(big[::2])) == 1  # not contiguous: numpy pickles it in-band


@pytest.mark.timeout(60)
def test_buffers_travel_as_their_own_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The array's memory is sent as one message of exactly its size, from the array itself."""
    nbytes = 1 << 20
    sends: list[tuple[int, int, np.ndarray]] = []
    recvs: list[tuple[int, np.ndarray]] = []
    real_send, real_recv = Team.send, Team.recv

    def send(self: Team, arr: np.ndarray, peer: int, sub: int = 0) -> Any:
        sends.append((self.rank, arr.nbytes, arr))
        return real_send(self, arr, peer, sub)

    def recv(self: Team, arr: np.ndarray, peer: int, sub: int = 0) -> Any:
        recvs.append((self.rank, arr))
        return real_recv(self, arr, peer, sub)

    monkeypatch.setattr(Team, "send", send)
    monkeypatch.setattr(Team, "recv", recv)
    payload = np.arange(nbytes // 8, dtype=np.float64)

    def run(comm: tcoll.Communicator) -> Any:
        got = comm.broadcast_object({"payload": payload, "label": "x"} if comm.rank == 0 else None, root=0)
        return got["payload"]

    results = tcoll.spawn(run, 2, threads=True, timeout=60)
    assert np.array_equal(results[1], payload)
    assert max(n for _, n, _ in sends) == nbytes  # nothing bigger: the array was not copied into the stream
    assert any(rank == 0 and n == nbytes and np.shares_memory(arr, payload) for rank, n, arr in sends)
    landed = [arr for rank, arr in recvs if rank == 1 and arr.nbytes == nbytes]
    assert len(landed) == 1 and np.shares_memory(results[1], landed[0])  # unpickled in place, no further copy


def scatter_bad_list(comm: tcoll.Communicator) -> str:
    try:
        comm.scatter_object([1, 2])
    except ValueError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(30)
def test_scatter_object_checks_its_list() -> None:
    assert "needs 1 objects" in tcoll.spawn(scatter_bad_list, 1, threads=True, timeout=30)[0]


def test_security_note_is_documented() -> None:
    import tcoll.comm.objects

    assert "unpickle" in (tcoll.comm.objects.__doc__ or "") and "Security" in (tcoll.comm.objects.__doc__ or "")
    assert "unpickle" in (tcoll.Communicator.recv_object.__doc__ or "")


def async_objects(comm: tcoll.Communicator) -> bool:
    r, p = comm.rank, comm.size
    works = [
        comm.broadcast_object(make(0) if r == 0 else None, root=0, async_op=True),
        comm.all_gather_object(make(r, 6), async_op=True),
        comm.gather_object(many_buffers(r, 2), root=p - 1, async_op=True),
        comm.scatter_object([make(i, 7) for i in range(p)] if r == 0 else None, async_op=True),
    ]
    results = [work.wait() for work in reversed(works)][::-1]  # several in flight, waited out of order
    assert same(results[0], make(0))
    assert all(same(results[1][i], make(i, 6)) for i in range(p))
    assert (results[2] is None) if r != p - 1 else all(same(results[2][i], many_buffers(i, 2)) for i in range(p))
    assert same(results[3], make(r, 7))
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_objects_async(size: int) -> None:
    assert tcoll.spawn(async_objects, size, threads=True, timeout=60) == [True] * size
