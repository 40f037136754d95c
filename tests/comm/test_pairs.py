"""sendrecv, sendrecv_replace, the ANY_SOURCE / ANY_TAG wildcards, probe and iprobe.

The ordering rule is MPI's: messages of one source on one tag match in the
order they were sent; a wildcard never takes what an earlier-posted specific
receive would match; the collectives' own messages never match a user's
wildcard.
"""

from __future__ import annotations

import numpy as np
import pytest

import tcoll
from tcoll import ANY_SOURCE, ANY_TAG

MIB = 1 << 20


def ring(comm: tcoll.Communicator, sizes: tuple[int, ...]) -> bool:
    """Every rank sendrecvs right and left at once: it ends, whatever the size (no deadlock)."""
    r, p = comm.rank, comm.size
    right, left = (r + 1) % p, (r - 1) % p
    for n in sizes:
        x = np.full(n, r, dtype=np.uint8)
        y = np.full(n, 255, dtype=np.uint8)
        assert comm.sendrecv(x, right, y, left, sendtag=3, recvtag=3) is y
        assert (y == left).all()
        assert comm.sendrecv_replace(x, right, left) is x
        assert (x == left).all()
        work = comm.sendrecv(x, right, y, ANY_SOURCE, recvtag=ANY_TAG, async_op=True)
        assert work.wait() is y and (y == (left - 1) % p).all()
        assert (work.source, work.tag, work.nbytes) == (left, 0, n)
        work = comm.sendrecv_replace(x, right, left, async_op=True)
        assert work.result() is x and (x == (left - 1) % p).all()
        comm.barrier()  # the next size's ANY_TAG receive must not take this one's messages
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_sendrecv_ring_threads(size: int) -> None:
    assert tcoll.spawn(ring, size, ((0, 1, 4099, 3 * MIB + 1),), threads=True, timeout=60) == [True] * size


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 4), ("tcp", 3)])
def test_sendrecv_ring_64_mib(transport: str, size: int) -> None:
    assert tcoll.spawn(ring, size, ((0, 64 * MIB),), timeout=120, transport=transport) == [True] * size


def _length(i: int) -> int:
    return 20_000 if i % 3 == 2 else 1  # every third message is above the eager limit (160 KB)


def wildcards(comm: tcoll.Communicator, count: int) -> bool:
    """Concurrent senders, one wildcard receiver: per source and tag, the order they were sent in."""
    r, p = comm.rank, comm.size
    if r == 0:
        seen: dict[tuple[int, int], list[int]] = {}
        buf = np.empty(20_000, dtype=np.int64)
        for _ in range(count * (p - 1)):
            work = comm.irecv(buf, ANY_SOURCE, ANY_TAG)
            work.wait()
            i = int(buf[0])
            assert work.nbytes == 8 * _length(i) and 1 <= work.source < p and (buf[:_length(i)] == i).all()
            seen.setdefault((work.source, work.tag), []).append(i)
        for src in range(1, p):
            for tag in (1, 2):
                assert seen[src, tag] == [i for i in range(count) if i % 2 + 1 == tag], (src, tag)
    else:
        works = [comm.isend(np.full(_length(i), i), 0, tag=i % 2 + 1) for i in range(count)]
        tcoll.wait_all(works)
    comm.barrier()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_wildcards_keep_the_order_per_source_and_tag(size: int) -> None:
    assert tcoll.spawn(wildcards, size, (40,), threads=True, timeout=60) == [True] * size


def no_stealing(comm: tcoll.Communicator) -> bool:
    r = comm.rank
    if r == 0:
        specific = np.zeros(1, dtype=np.int64)
        wild = np.zeros(1, dtype=np.int64)
        first = comm.irecv(specific, 1, 7)
        second = comm.irecv(wild, ANY_SOURCE, ANY_TAG)  # posted later: must not take the first message
        comm.barrier()  # the collective's messages are not the wildcard's
        x = np.ones(3)
        comm.all_reduce(x)
        assert not second.done()
        comm.barrier()
        tcoll.wait_all([first, second])
        assert (specific[0], wild[0]) == (1, 2) and (second.source, second.tag) == (1, 7)
        # A wildcard posted after messages came takes the earliest that matches.
        comm.barrier()
        early = np.zeros(1, dtype=np.int64)
        work = comm.irecv(early, 1, ANY_TAG)
        work.wait()
        assert (early[0], work.tag) == (3, 9)
        status = comm.probe(ANY_SOURCE, ANY_TAG)
        assert (status.source, status.tag, status.nbytes) == (1, 4, 8)
        assert comm.iprobe(1, 99) is None
        comm.recv(early, 1, 4)
        assert early[0] == 4
        cancelled = comm.irecv(early, ANY_SOURCE)
        assert cancelled.cancel() and comm.iprobe() is None
    elif r == 1:
        comm.barrier()
        comm.all_reduce(np.ones(3))
        comm.barrier()
        comm.send(np.array([1]), 0, tag=7)
        comm.send(np.array([2]), 0, tag=7)
        comm.send(np.array([3]), 0, tag=9)  # taken in early, then matched by rank 0's ANY_TAG receive
        comm.send(np.array([4]), 0, tag=4)
        comm.barrier()
    else:
        comm.barrier()
        comm.all_reduce(np.ones(3))
        comm.barrier()
        comm.barrier()
    comm.barrier()
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_a_wildcard_never_steals_from_an_earlier_specific_receive(size: int) -> None:
    assert tcoll.spawn(no_stealing, size, threads=True, timeout=60) == [True] * size


def probe_then_receive(comm: tcoll.Communicator) -> bool:
    """Each rank sends rank 0 a message of its own size; rank 0 probes, allocates exactly, receives."""
    r, p = comm.rank, comm.size
    if r:
        comm.send(np.full(r * 300_000 + 5, r, dtype=np.int16), 0, tag=r + 10)  # above the eager limit too
    else:
        sources = set()
        for _ in range(p - 1):
            status = comm.probe()
            assert status.tag == status.source + 10 and status.nbytes == 2 * (status.source * 300_000 + 5)
            buf = np.empty(status.nbytes // 2, dtype=np.int16)
            work = comm.irecv(buf, status.source, status.tag)
            work.wait()
            assert work.nbytes == buf.nbytes and (buf == status.source).all()
            sources.add(status.source)
        assert sources == set(range(1, p))
        assert comm.iprobe() is None
    comm.barrier()
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport,size", [("shm", 4), ("tcp", 3)])
def test_probe_then_receive_exactly_processes(transport: str, size: int) -> None:
    assert tcoll.spawn(probe_then_receive, size, timeout=120, transport=transport) == [True] * size
    assert tcoll.spawn(wildcards, size, (20,), timeout=120, transport=transport) == [True] * size


@pytest.mark.timeout(60)
def test_probe_then_receive_threads() -> None:
    assert tcoll.spawn(probe_then_receive, 5, threads=True, timeout=60) == [True] * 5


def sub_communicator_sources(comm: tcoll.Communicator) -> bool:
    """In a sub-communicator, source is the rank in it, and the parent's messages are not matched."""
    sub = comm.split(color=comm.rank % 2, key=-comm.rank)
    buf = np.empty(1, dtype=np.int64)
    if sub.rank == 0:
        for _ in range(sub.size - 1):
            work = sub.irecv(buf, ANY_SOURCE)
            work.wait()
            assert sub.world_ranks[work.source] == int(buf[0])
    else:
        sub.send(np.array([comm.rank]), 0)
    sub.barrier()
    return True


@pytest.mark.timeout(60)
def test_wildcard_source_is_a_rank_of_the_sub_communicator() -> None:
    assert tcoll.spawn(sub_communicator_sources, 5, threads=True, timeout=60) == [True] * 5
