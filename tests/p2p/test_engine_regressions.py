"""Regressions: each test reproduces a way the engine once went wrong."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import tcoll

pytestmark = pytest.mark.timeout(120)


def _callback_posts_a_send(comm: tcoll.Communicator) -> float:
    # A send's done-callback posts the next send: the shm ring must not be
    # overwritten by the outer push loop (callbacks run after the channel round).
    if comm.rank == 0:
        second: list[tcoll.Work] = []
        first = comm.isend(np.full(4096, 1.0), 1, tag=1)
        first.add_done_callback(lambda _: second.append(comm.isend(np.full(4096, 2.0), 1, tag=2)))
        first.wait()
        while not second:
            comm.core.engine.poll()
        second[0].wait()
        return 0.0
    a, b = np.zeros(4096), np.zeros(4096)
    comm.recv(a, 0, tag=1)
    comm.recv(b, 0, tag=2)
    return float(a.sum() + b.sum())


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_callback_may_post(transport: str) -> None:
    results = tcoll.spawn(_callback_posts_a_send, 2, threads=True, timeout=60, transport=transport,
                          shm_ring="16K", shm_chunk="4K")
    assert results[1] == 4096 * 3.0


def _finished_sender(comm: tcoll.Communicator) -> float:
    # Rank 2 sends and closes; rank 0 learns of the close while receiving from
    # rank 1, and must still get rank 2's message.
    if comm.rank == 2:
        comm.send(np.array([7.0]), 0, tag=3)
        return 0.0
    if comm.rank == 1:
        comm.send(np.array([1.0]), 0, tag=3)
        return 0.0
    got = np.zeros(1)
    comm.recv(got, 1, tag=3)
    # tcp learns of the close from the stream; shm only when it waits on rank 2
    deadline = time.monotonic() + 2
    while not comm.core.engine.is_lost(2) and time.monotonic() < deadline:
        comm.core.engine.poll()
    late = np.zeros(1)
    comm.recv(late, 2, tag=3, timeout=10)
    return float(late[0])


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_message_from_a_rank_that_already_left_is_delivered(transport: str) -> None:
    assert tcoll.spawn(_finished_sender, 3, threads=True, timeout=60, transport=transport)[0] == 7.0


def _adopted_then_lost(comm: tcoll.Communicator) -> str:
    # Rank 0 adopts a large message still arriving from rank 1, which then dies
    # (closes): the receive must fail with PeerLostError, not time out.
    if comm.rank == 1:
        comm.isend(np.ones(8 << 20, dtype=np.uint8), 0, tag=5)
        comm.send(np.zeros(1), 0, tag=6)
        comm.core.engine.poll()
        comm.close()
        return ""
    small = np.zeros(1)
    comm.recv(small, 1, tag=6)
    try:
        comm.recv(np.zeros(8 << 20, dtype=np.uint8), 1, tag=5, timeout=30)
    except tcoll.PeerLostError as exc:
        return f"lost {exc.rank}"
    return "received"


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_adopted_receive_fails_when_its_peer_is_lost(transport: str) -> None:
    outcome = tcoll.spawn(_adopted_then_lost, 2, threads=True, timeout=60, transport=transport,
                          eager_limit="1K")[0]
    assert outcome in ("lost 1", "received")  # "received" when the whole message made it first


def test_self_send_from_another_thread_wakes_the_waiter() -> None:
    comm = tcoll.spawn(lambda c: None, 1, threads=True)  # warm-up of the thread machinery
    assert comm == [None]
    world = tcoll.init(liveness_interval=30.0, spin_us=0)
    try:
        box = np.zeros(1)
        timer = threading.Timer(0.1, lambda: world.send(np.array([3.0]), 0, tag=9))
        start = time.monotonic()
        timer.start()
        world.recv(box, 0, tag=9, timeout=20)
        assert box[0] == 3.0 and time.monotonic() - start < 5.0
    finally:
        world.close()


def _close_while_blocked(comm: tcoll.Communicator) -> str:
    if comm.rank == 1:
        return ""
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            comm.recv(np.zeros(1), 1, tag=11, timeout=30)
        except BaseException as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    thread = threading.Thread(target=blocked)
    thread.start()
    deadline = time.monotonic() + 10
    while not (comm.core.engine.expects_from(1) or errors) and time.monotonic() < deadline:
        time.sleep(0.001)  # polling with a deadline for the receive to be posted (or to fail at once)
    comm.close()
    thread.join(10)
    # TcollError ("closed"), or PeerLostError when rank 1 finished and closed first: never a ValueError
    return "tcoll error" if errors and isinstance(errors[0], tcoll.TcollError) else repr(errors)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_close_while_another_thread_waits(transport: str) -> None:
    assert tcoll.spawn(_close_while_blocked, 2, threads=True, timeout=60, transport=transport)[0] == "tcoll error"


def _timeout_despite_traffic(comm: tcoll.Communicator) -> float:
    # Rank 2 keeps streaming to rank 0 while rank 0 waits, with a timeout, for silent rank 1.
    if comm.rank == 2:
        for i in range(4000):
            comm.send(np.array([float(i)]), 0, tag=12)
        return 0.0
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=13)  # released by rank 0 at the end
        return 0.0
    sink = [comm.irecv(np.zeros(1), 2, tag=12) for _ in range(4000)]
    start = time.monotonic()
    with pytest.raises(tcoll.TimeoutError):
        comm.recv(np.zeros(1), 1, tag=14, timeout=0.3)
    elapsed = time.monotonic() - start
    for work in sink:
        work.wait()
    comm.send(np.zeros(1), 1, tag=13)
    return elapsed


def test_timeout_fires_while_other_traffic_flows() -> None:
    assert tcoll.spawn(_timeout_despite_traffic, 3, threads=True, timeout=60, transport="shm")[0] < 2.0


def _peer_closes_while_we_wait(comm: tcoll.Communicator) -> str:
    if comm.rank == 1:
        comm.recv(np.zeros(1), 0, tag=15)
        comm.close()  # alive, but gone from the communicator
        return ""
    comm.send(np.zeros(1), 1, tag=15)
    start = time.monotonic()
    try:
        comm.recv(np.zeros(1), 1, tag=16, timeout=30)
    except tcoll.PeerLostError:
        return f"lost after {time.monotonic() - start:.1f} s"
    return "received"


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_peer_that_closes_is_lost_at_once(transport: str) -> None:
    outcome = tcoll.spawn(_peer_closes_while_we_wait, 2, threads=True, timeout=60, transport=transport)[0]
    assert outcome.startswith("lost after") and float(outcome.split()[2]) < 5.0


def _mappings(run_id: str) -> list[str]:
    with open("/proc/self/maps") as handle:
        return [line for line in handle if f"/dev/shm/tcoll-{run_id}-" in line]


def test_close_unmaps_the_segments() -> None:
    run_ids = tcoll.spawn(lambda comm: comm.run_id, 3, threads=True, transport="shm")
    assert len(set(run_ids)) == 1
    assert _mappings(run_ids[0]) == []  # (other jobs' segments may come and go meanwhile: only ours count)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"tcoll-{run_ids[0]}-")]
