"""The point-to-point conformance battery that every transport must pass.

Each check is a function of the communicator, run on every rank at once; it
raises AssertionError on a wrong result. Expected values are computed
independently from the ranks' numbers with NumPy. `run_battery` runs the
checks in order, separated by a fence so that checks cannot see each other's
messages, and returns {check name: None or the failure's traceback}.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable

import numpy as np

import tcoll

CHECKS: dict[str, Callable[[tcoll.Communicator], None]] = {}
FENCE_TAG = 1 << 40


def check(fn: Callable[[tcoll.Communicator], None]) -> Callable[[tcoll.Communicator], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def fence(comm: tcoll.Communicator) -> None:
    """Every rank reaches this point before any leaves it (gather to 0, then release)."""
    token = np.zeros(1, dtype=np.int64)
    if comm.rank == 0:
        for peer in range(1, comm.size):
            comm.recv(token, peer, FENCE_TAG)
        for peer in range(1, comm.size):
            comm.send(token, peer, FENCE_TAG)
    else:
        comm.send(token, 0, FENCE_TAG)
        comm.recv(token, 0, FENCE_TAG)


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """Bytes that differ per sender and per position, so misplaced data shows.

    Byte i is (i * 2654435761 + seed * 97) % 251, which repeats every 251 bytes: one period is computed
    and repeated (25x faster than the arithmetic on every byte, which cost seconds per world of 8).
    """
    period = ((np.arange(251, dtype=np.uint64) * 2654435761 + seed * 97) % 251).astype(np.uint8)
    return np.resize(period, nbytes)


def right(comm: tcoll.Communicator) -> int:
    return (comm.rank + 1) % comm.size


def left(comm: tcoll.Communicator) -> int:
    return (comm.rank - 1) % comm.size


@check
def check_ordering_per_tag(comm: tcoll.Communicator) -> None:
    count = 40
    sends = [comm.isend(np.array([comm.rank, i], dtype=np.int64), right(comm), tag=3) for i in range(count)]
    boxes = [np.full(2, -1, dtype=np.int64) for _ in range(count)]
    recvs = [comm.irecv(box, left(comm), tag=3) for box in boxes]
    for work in recvs + sends:
        work.wait()
    np.testing.assert_array_equal(np.stack(boxes), np.array([[left(comm), i] for i in range(count)]))


@check
def check_interleaved_tags(comm: tcoll.Communicator) -> None:
    # Small and large messages on two tags; the receiver takes tag 2 first, so
    # tag-1 messages (some larger than the eager limit) must wait aside in order.
    sizes = [10, 200_000, 7, 150_000, 0, 3]
    sends = [comm.isend(pattern(n, comm.rank * 10 + i), right(comm), tag=1 + i % 2) for i, n in enumerate(sizes)]
    got = {}
    for i in [1, 3, 5, 0, 2, 4]:
        buf = np.zeros(sizes[i], dtype=np.uint8)
        comm.recv(buf, left(comm), tag=1 + i % 2)
        got[i] = buf
    for work in sends:
        work.wait()
    for i, n in enumerate(sizes):
        np.testing.assert_array_equal(got[i], pattern(n, left(comm) * 10 + i))


@check
def check_zero_bytes(comm: tcoll.Communicator) -> None:
    empty = np.empty(0, dtype=np.float64)
    work = comm.isend(empty, right(comm), tag=9)
    out = comm.recv(np.empty(0, dtype=np.float64), left(comm), tag=9)
    work.wait()
    assert out.size == 0
    # a 0-byte message into a non-empty buffer leaves the buffer untouched
    work = comm.isend(b"", right(comm), tag=10)
    keep = np.arange(4, dtype=np.int32)
    comm.recv(keep, left(comm), tag=10)
    work.wait()
    np.testing.assert_array_equal(keep, np.arange(4))


@check
def check_hundred_concurrent_isends(comm: tcoll.Communicator) -> None:
    count = 100
    sends = [comm.isend(np.full(257, comm.rank * 1000 + i, dtype=np.int32), right(comm), tag=100 + i)
             for i in range(count)]
    boxes = {i: np.zeros(257, dtype=np.int32) for i in range(count)}
    recvs = [comm.irecv(boxes[i], left(comm), tag=100 + i) for i in reversed(range(count))]
    for work in recvs + sends:
        work.wait()
    for i in range(count):
        assert (boxes[i] == left(comm) * 1000 + i).all(), i


@check
def check_exchange_both_ways(comm: tcoll.Communicator) -> None:
    # Pairs (0,1), (2,3), ... exchange 8 MiB at the same time in both directions.
    partner = comm.rank ^ 1
    if partner >= comm.size:
        return
    nbytes = 8 << 20
    out = np.zeros(nbytes, dtype=np.uint8)
    recv = comm.irecv(out, partner, tag=5)
    send = comm.isend(pattern(nbytes, comm.rank), partner, tag=5)
    send.wait()
    recv.wait()
    np.testing.assert_array_equal(out, pattern(nbytes, partner))


@check
def check_ring_shift_large(comm: tcoll.Communicator) -> None:
    nbytes = 12 << 20
    out = np.zeros(nbytes // 8, dtype=np.float64)
    send = comm.isend(np.full(nbytes // 8, comm.rank + 0.5), right(comm), tag=6)
    comm.recv(out, left(comm), tag=6)
    send.wait()
    assert (out == left(comm) + 0.5).all()


@check
def check_every_dtype(comm: tcoll.Communicator) -> None:
    import ml_dtypes

    dtypes = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
              np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64, np.complex128]
    rng = np.random.default_rng(comm.rank)
    mine = [(rng.standard_normal((3, 5)) * 100).astype(dt) for dt in dtypes]
    sends = [comm.isend(arr, right(comm), tag=20 + i) for i, arr in enumerate(mine)]
    expected_rng = np.random.default_rng(left(comm))
    for i, dt in enumerate(dtypes):
        expect = (expected_rng.standard_normal((3, 5)) * 100).astype(dt)
        out = np.empty((3, 5), dtype=dt)
        comm.recv(out, left(comm), tag=20 + i)
        assert out.tobytes() == expect.tobytes(), dt
    for work in sends:
        work.wait()
    # Fortran-ordered arrays are contiguous too
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4) + comm.rank)
    send = comm.isend(fortran, right(comm), tag=40)
    out = np.empty((3, 4), order="F")
    comm.recv(out, left(comm), tag=40)
    send.wait()
    np.testing.assert_array_equal(out, np.arange(12.0).reshape(3, 4) + left(comm))


@check
def check_torch_tensors(comm: tcoll.Communicator) -> None:
    import torch  # the test skips this check where torch is missing

    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool,
                               torch.uint8, torch.complex64]):
        mine = (torch.arange(24, dtype=torch.float64).reshape(4, 6) * (comm.rank + 1)).to(dtype)
        send = comm.isend(mine, right(comm), tag=50 + i)
        out = torch.empty(4, 6, dtype=dtype)
        got = comm.recv(out, left(comm), tag=50 + i)
        send.wait()
        assert got is out
        expect = (torch.arange(24, dtype=torch.float64).reshape(4, 6) * (left(comm) + 1)).to(dtype)
        assert torch.equal(out, expect), dtype


@check
def check_message_too_large(comm: tcoll.Communicator) -> None:
    # A receive buffer that is too small fails that receive, drops the message,
    # and the stream stays usable for the next message.
    for nbytes in (100, 300_000):
        send = comm.isend(pattern(nbytes, 1), right(comm), tag=60)
        small = np.zeros(nbytes // 2, dtype=np.uint8)
        try:
            comm.recv(small, left(comm), tag=60)
        except tcoll.MessageSizeError as exc:
            assert str(nbytes) in str(exc)
        else:
            raise AssertionError("expected MessageSizeError")
        send.wait()
    send = comm.isend(np.arange(5, dtype=np.int64), right(comm), tag=61)
    out = np.zeros(5, dtype=np.int64)
    comm.recv(out, left(comm), tag=61)
    send.wait()
    np.testing.assert_array_equal(out, np.arange(5))


@check
def check_shorter_message(comm: tcoll.Communicator) -> None:
    send = comm.isend(np.arange(3, dtype=np.int32), right(comm), tag=62)
    out = np.full(8, -1, dtype=np.int32)
    work = comm.irecv(out, left(comm), tag=62)
    work.wait()
    send.wait()
    assert work.nbytes == 12
    np.testing.assert_array_equal(out, [0, 1, 2, -1, -1, -1, -1, -1])


@check
def check_send_to_self(comm: tcoll.Communicator) -> None:
    send = comm.isend(np.arange(6.0), comm.rank, tag=63)
    out = np.zeros(6)
    comm.recv(out, comm.rank, tag=63)
    send.wait()
    np.testing.assert_array_equal(out, np.arange(6.0))


@check
def check_bad_arguments(comm: tcoll.Communicator) -> None:
    import pytest

    strided = np.arange(10.0)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        comm.isend(strided, right(comm))
    with pytest.raises(ValueError, match="rank"):
        comm.isend(np.zeros(1), comm.size)
    with pytest.raises(ValueError, match="rank"):
        comm.irecv(np.zeros(1), -2)  # -1 is ANY_SOURCE
    with pytest.raises(ValueError, match="tag"):
        comm.isend(np.zeros(1), right(comm), tag=-1)
    with pytest.raises(ValueError, match="read-only"):
        comm.irecv(b"abc", left(comm))
    with pytest.raises(TypeError):
        comm.isend(object(), right(comm))


@check
def check_unexpected_large_before_recv(comm: tcoll.Communicator) -> None:
    # A large message arrives long before its receive is posted, while the
    # receiver waits for a later, small message on another tag from the same rank.
    big = 3 << 20
    first = comm.isend(pattern(big, comm.rank), right(comm), tag=70)
    second = comm.isend(np.array([comm.rank], dtype=np.int64), right(comm), tag=71)
    small = np.zeros(1, dtype=np.int64)
    comm.recv(small, left(comm), tag=71)
    out = np.zeros(big, dtype=np.uint8)
    comm.recv(out, left(comm), tag=70)
    first.wait()
    second.wait()
    assert small[0] == left(comm)
    np.testing.assert_array_equal(out, pattern(big, left(comm)))


@check
def check_no_files_of_this_run_in_dev_shm(comm: tcoll.Communicator) -> None:
    # Every segment is unlinked once its peers have mapped it: while the job runs, and
    # before any launcher sweeps, nothing of this run's is left in /dev/shm.
    if os.path.isdir("/dev/shm"):
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"tcoll-{comm.run_id}-")]


def run_battery(comm: tcoll.Communicator, names: list[str] | None = None) -> dict[str, str | None]:
    """Run the named checks (default: all) on this rank; return failures as tracebacks."""
    report: dict[str, str | None] = {}
    for name in names or list(CHECKS):
        if name == "torch_tensors" and not _has_torch():
            continue
        fence(comm)
        try:
            CHECKS[name](comm)
            report[name] = None
        except Exception:  # noqa: BLE001 - reported per check
            report[name] = traceback.format_exc()
    fence(comm)
    return report


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def check_one_gib(comm: tcoll.Communicator) -> None:
    """Rank 0 sends 1 GiB to rank 1 (the two first ranks only)."""
    nbytes = 1 << 30
    if comm.rank == 0:
        data = np.arange(nbytes // 8, dtype=np.int64)
        comm.send(data, 1, tag=80)
    elif comm.rank == 1:
        out = np.empty(nbytes // 8, dtype=np.int64)
        comm.recv(out, 0, tag=80)
        assert out[0] == 0 and out[-1] == nbytes // 8 - 1
        assert (np.diff(out[:: 1 << 16]) == 1 << 16).all()
        step = 1 << 23  # every element, a piece at a time (not a second GiB to fault in and compare)
        assert all(np.array_equal(out[at:at + step], np.arange(at, at + step, dtype=np.int64))
                   for at in range(0, nbytes // 8, step))
