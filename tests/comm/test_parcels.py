"""Non-blocking objects (isend_object / irecv_object, 100 in flight), sendrecv_object, all_to_all_object,
and completion over many requests (wait_all, wait_any, test_some)."""

from __future__ import annotations

import numpy as np
import pytest

import tcoll
from tcoll import ANY_SOURCE, ANY_TAG

from comm.test_objects import make, many_buffers, same


def _obj(src: int, i: int) -> object:
    """The i-th object rank src sends: small ones, and every 10th with large out-of-band buffers (and overflow)."""
    if i % 10 == 3:
        return many_buffers(src * 1000 + i, 9)
    return {"src": src, "i": i, "a": np.arange(i % 7) + src}


def hundred_in_flight(comm: tcoll.Communicator) -> bool:
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    receives = [comm.irecv_object(left, tag=i % 3) for i in range(100)]
    sends = [comm.isend_object(_obj(r, i), right, tag=i % 3) for i in range(100)]
    got = tcoll.wait_all(receives)
    assert all(same(got[i], _obj(left, i)) for i in range(100))
    assert all(w.source == left and w.tag == i % 3 for i, w in enumerate(receives))
    assert tcoll.wait_all(sends) == [None] * 100
    # Wildcards: every rank sends rank 0 ten objects; rank 0 takes them as they come.
    if r == 0:
        seen: dict[int, list[int]] = {}
        pending = [comm.irecv_object(ANY_SOURCE, ANY_TAG) for _ in range(10 * (p - 1))]
        for work in pending:
            obj = work.result()
            assert work.tag == 5 and same(obj, _obj(work.source, obj_index(obj)))
            seen.setdefault(work.source, []).append(obj_index(obj))
        assert all(seen[s] == list(range(10)) for s in range(1, p)), seen  # in the order each rank sent
    else:
        tcoll.wait_all([comm.isend_object(_obj(r, i), 0, tag=5) for i in range(10)])
    comm.barrier()
    return True


def obj_index(obj: object) -> int:
    if isinstance(obj, dict):
        return int(obj["i"])
    return int(obj[0][0]) // 100 % 1000  # many_buffers(src * 1000 + i): first value is (src*1000+i)*100


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_hundred_objects_in_flight_threads(size: int) -> None:
    assert tcoll.spawn(hundred_in_flight, size, threads=True, timeout=60) == [True] * size


def exchanges(comm: tcoll.Communicator) -> bool:
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    assert same(comm.sendrecv_object(make(r), right, left), make(left))
    work = comm.sendrecv_object(many_buffers(r, 3), right, ANY_SOURCE, sendtag=4, recvtag=ANY_TAG, async_op=True)
    assert same(work.result(), many_buffers(left, 3)) and (work.source, work.tag) == (left, 4)
    got = comm.all_to_all_object([(r, i, make(i) if i == r else None) for i in range(p)])
    assert all(got[i][:2] == (i, r) for i in range(p)) and same(got[r][2], make(r))
    work = comm.all_to_all_object([f"{r}->{i}" for i in range(p)], async_op=True)
    assert work.result() == [f"{i}->{r}" for i in range(p)]
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_sendrecv_object_and_all_to_all_object_threads(size: int) -> None:
    assert tcoll.spawn(exchanges, size, threads=True, timeout=60) == [True] * size


def completion(comm: tcoll.Communicator) -> bool:
    """wait_any returns the one that completed; test_some the indices done; neither waits on the rest."""
    r, p = comm.rank, comm.size
    if r == 0:
        bufs = [np.zeros(1) for _ in range(p - 1)]
        works = [comm.irecv(bufs[s - 1], s, tag=1) for s in range(1, p)]
        assert tcoll.test_some(works) == []
        comm.send(np.zeros(1), p - 1, tag=2)  # only the last rank may send now
        assert tcoll.wait_any(works) == p - 2 and bufs[p - 2][0] == p - 1
        assert tcoll.test_some(works) == [p - 2]
        for s in range(1, p - 1):
            comm.send(np.zeros(1), s, tag=2)
        tcoll.wait_all(works)
        assert sorted(tcoll.test_some(works)) == list(range(p - 1))
        never = comm.irecv(np.zeros(1), ANY_SOURCE, tag=3)
        with pytest.raises(tcoll.TimeoutError):
            tcoll.wait_any([never], timeout=0.05)
        assert never.cancel()
    else:
        comm.recv(np.zeros(1), 0, tag=2)
        comm.send(np.array([float(r)]), 0, tag=1)
    comm.barrier()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 4])
def test_wait_any_and_test_some(size: int) -> None:
    assert tcoll.spawn(completion, size, threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_objects_in_flight_processes(transport: str) -> None:
    assert tcoll.spawn(hundred_in_flight, 3, timeout=120, transport=transport) == [True] * 3
