"""The TCP transport, driven through Engine.isend / irecv / wait by ranks that are threads."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any

import numpy as np
import pytest
from helpers.procs import on_threads

from tcoll.p2p.channel import HEADER
from tcoll.p2p.engine import Engine
from tcoll.env import Settings
from tcoll.errors import MessageSizeError, PeerLostError, TimeoutError, TransportError
from tcoll.transport.tcp.transport import TcpTransport, choose_address
from tcoll.p2p.waiting import Doorbell

try:
    from tcoll.store.memory import MemoryStore
except ImportError:  # pragma: no cover - the store package is written in parallel
    class MemoryStore:  # type: ignore[no-redef]
        """A dict guarded by a condition: just enough store for these tests."""

        def __init__(self) -> None:
            self._data: dict[str, bytes] = {}
            self._cond = threading.Condition()

        def set(self, key: str, value: bytes) -> None:
            with self._cond:
                self._data[key] = value
                self._cond.notify_all()

        def get(self, key: str, timeout: float | None = None) -> bytes:
            with self._cond:
                if not self._cond.wait_for(lambda: key in self._data, timeout):
                    raise TimeoutError(f"key {key!r} missing")
                return self._data[key]


CTX = 1


class World:
    """N engines in this process, each with a TcpTransport; connected through a store."""

    def __init__(self, n: int, timeout: float = 10.0, keys: list[str] | None = None, run_id: str = "tcp-test",
                 connect: bool = True, **overrides: Any) -> None:
        self.n = n
        self.store = MemoryStore()
        self.engines: list[Engine] = []
        self.transports: list[TcpTransport] = []
        for rank in range(n):
            settings = Settings.from_env({}, timeout=timeout, auth_key=keys[rank] if keys else "", **overrides)
            engine = Engine(rank, n, settings, Doorbell.private())
            transport = TcpTransport(engine, settings, run_id)
            transport.master_host = None
            self.engines.append(engine)
            self.transports.append(transport)
        if connect:
            on_threads(n, lambda rank: self.connect_rank(rank, timeout))

    def connect_rank(self, rank: int, timeout: float) -> None:
        """What bootstrap does for one rank: publish the card, read everyone's, connect."""
        self.store.set(f"card/{rank}", json.dumps({"tcp": self.transports[rank].prepare()}).encode())
        cards = [json.loads(self.store.get(f"card/{r}", timeout)) for r in range(self.n)]
        peers = [p for p in range(self.n) if p != rank]
        channels = self.transports[rank].connect(peers, cards, self.store, timeout)
        assert sorted(channels) == peers
        for channel in channels.values():
            self.engines[rank].add_channel(channel)

    def close(self) -> None:
        for engine, transport in zip(self.engines, self.transports):
            engine.close()
            transport.close()


@pytest.fixture
def world2():
    world = World(2)
    yield world
    world.close()


def _u8(values: Any) -> np.ndarray:
    return np.ascontiguousarray(values).view(np.uint8).reshape(-1)


@pytest.mark.timeout(60)
def test_choose_address() -> None:
    assert choose_address("10.1.2.3", "example.org") == "10.1.2.3"
    assert choose_address("", None) == "127.0.0.1"
    assert choose_address("", "localhost") == "127.0.0.1"
    assert choose_address("", "127.0.0.5") == "127.0.0.1"
    assert choose_address("", "::1") == "127.0.0.1"


@pytest.mark.timeout(60)
def test_order_per_tag_and_interleaved_tags(world2: World) -> None:
    a, b = world2.engines
    count = 200
    sends = [a.isend(_u8(np.array([i], dtype=np.int64)), 1, CTX, 7) for i in range(count)]
    sends.append(a.isend(_u8(np.array([-1], dtype=np.int64)), 1, CTX, 9))
    # Tag 9 first: it must not swallow a tag-7 message; then tag 7 in posting order.
    other = np.zeros(1, dtype=np.int64)
    b.irecv(_u8(other), 0, CTX, 9).wait()
    assert other[0] == -1
    outs = [np.zeros(1, dtype=np.int64) for _ in range(count)]
    for out, work in [(out, b.irecv(_u8(out), 0, CTX, 7)) for out in outs]:
        work.wait()
    assert [int(o[0]) for o in outs] == list(range(count))
    for send in sends:
        send.wait()


@pytest.mark.timeout(60)
def test_zero_bytes_and_both_directions(world2: World) -> None:
    a, b = world2.engines
    empty = np.empty(0, dtype=np.uint8)
    recv = b.irecv(np.empty(0, dtype=np.uint8), 0, CTX, 3)
    a.isend(empty, 1, CTX, 3).wait()
    recv.wait()
    back = np.zeros(5, dtype=np.uint8)
    got = a.irecv(back, 1, CTX, 4)
    b.isend(np.arange(5, dtype=np.uint8), 0, CTX, 4).wait()
    got.wait()
    assert back.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_64mib_posted_and_deferred(world2: World) -> None:
    a, b = world2.engines
    size = 64 << 20
    data = np.tile(np.arange(251, dtype=np.uint8), size // 251 + 1)[:size]
    out = np.zeros(size, dtype=np.uint8)

    def rank(r: int) -> None:
        if r == 0:
            a.isend(data, 1, CTX, 1).wait()  # posted receive
            a.isend(data, 1, CTX, 2).wait()  # unexpected: waits in the socket until posted
            a.isend(_u8(np.array([42], dtype=np.int64)), 1, CTX, 3).wait()
        else:
            b.irecv(out, 0, CTX, 1).wait()
            assert np.array_equal(out, data)
            out[:] = 0
            small = np.zeros(1, dtype=np.int64)
            late_small = b.irecv(_u8(small), 0, CTX, 3)
            b.irecv(out, 0, CTX, 2).wait()
            late_small.wait()
            assert np.array_equal(out, data) and small[0] == 42

    on_threads(2, rank)


@pytest.mark.timeout(60)
def test_full_duplex_ring_shift_256mib() -> None:
    world = World(3)
    size = 256 << 20
    try:
        def rank(r: int) -> None:
            engine = world.engines[r]
            pattern = np.arange(4096, dtype=np.uint8) ^ np.uint8(r * 37)
            data = np.tile(pattern, size // 4096)
            out = np.empty(size, dtype=np.uint8)
            recv = engine.irecv(out, (r - 1) % 3, CTX, 5)
            send = engine.isend(data, (r + 1) % 3, CTX, 5)
            send.wait()
            recv.wait()
            expected = np.arange(4096, dtype=np.uint8) ^ np.uint8(((r - 1) % 3) * 37)
            assert (out.reshape(-1, 4096) == expected).all()

        on_threads(3, rank)
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_odd_sized_messages_stream_intact(world2: World) -> None:
    # Sizes straddle the header and the socket buffer so that headers and payloads split anywhere.
    a, b = world2.engines
    sizes = [[0, 1, 31, 33, 1000, 65_537, 300_001, 2_000_003][(i * 5) % 8] for i in range(160)]
    outs = [np.empty(n, dtype=np.uint8) for n in sizes]

    def rank(r: int) -> None:
        if r == 0:
            sends = [a.isend(np.full(n, i % 251, dtype=np.uint8), 1, CTX, i % 2) for i, n in enumerate(sizes)]
            for send in sends:
                send.wait()
        else:  # tag 1 first: the tag-0 messages ahead of them in the stream must be set aside
            for i in list(range(1, 160, 2)) + list(range(0, 160, 2)):
                b.irecv(outs[i], 0, CTX, i % 2).wait()

    on_threads(2, rank)
    assert all((out == i % 251).all() for i, out in enumerate(outs))


@pytest.mark.timeout(60)
def test_sleeping_engines_are_woken() -> None:
    # No polling and no liveness wake-ups: a single lost wake-up ends in TimeoutError.
    world = World(2, timeout=20.0, spin_us=0, liveness_interval=60.0)
    try:
        def rank(r: int) -> None:
            engine, peer = world.engines[r], 1 - r
            token = np.zeros(1, dtype=np.int64)
            for i in range(300):
                if (i + r) % 2 == 0:
                    token[0] = i
                    engine.isend(_u8(token), peer, CTX, 0).wait()
                else:
                    engine.irecv(_u8(token), peer, CTX, 0).wait()
                    assert token[0] == i
            big = np.full(8 << 20, r, dtype=np.uint8)  # more than the socket buffers: needs EPOLLOUT
            out = np.empty_like(big)
            works = [engine.isend(big, peer, CTX, 1), engine.irecv(out, peer, CTX, 1)]
            for work in works:
                work.wait()
            assert (out == peer).all()

        on_threads(2, rank)
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_oversized_message_is_discarded_and_stream_stays_in_sync(world2: World) -> None:
    a, b = world2.engines
    small = np.zeros(10, dtype=np.uint8)
    first = b.irecv(small, 0, CTX, 1)
    a.isend(np.ones(300_000, dtype=np.uint8), 1, CTX, 1)
    a.isend(np.full(4, 9, dtype=np.uint8), 1, CTX, 2)
    with pytest.raises(MessageSizeError):
        first.wait()
    after = np.zeros(4, dtype=np.uint8)
    b.irecv(after, 0, CTX, 2).wait()
    assert after.tolist() == [9, 9, 9, 9]


@pytest.mark.timeout(60)
def test_all_pairs_five_ranks() -> None:
    world = World(5)
    try:
        def rank(r: int) -> None:
            engine = world.engines[r]
            outs = {p: np.zeros(3, dtype=np.int64) for p in range(5) if p != r}
            recvs = [engine.irecv(_u8(out), p, CTX, 0) for p, out in outs.items()]
            sends = [engine.isend(_u8(np.array([r, p, r * p], dtype=np.int64)), p, CTX, 0) for p in outs]
            for work in recvs + sends:
                work.wait()
            for p, out in outs.items():
                assert out.tolist() == [p, r, r * p]

        on_threads(5, rank)
    finally:
        world.close()


def _stray_connections(host: str, port: int) -> list[socket.socket]:
    """Connections a rendezvous must survive: garbage, another job, an impostor rank, silence."""
    strays = [socket.create_connection((host, port)) for _ in range(4)]
    strays[0].sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40)
    other_job = b"another-run"
    strays[1].sendall(struct.pack("<8sHHIIH", b"TCOLLTCP", 1, 0, 1, 0, len(other_job)) + other_job)
    run_id = b"tcp-test"
    strays[2].sendall(struct.pack("<8sHHIIH", b"TCOLLTCP", 1, 0, 7, 0, len(run_id)) + run_id)
    return strays  # strays[3] says nothing


def _assert_linked(world: World) -> None:
    """Rank 0 of `world` reaches rank 1 over the links the handshake made."""
    a, b = world.engines
    out = np.zeros(3, dtype=np.uint8)
    recv = b.irecv(out, 0, CTX, 0)
    a.isend(np.array([1, 2, 3], dtype=np.uint8), 1, CTX, 0).wait()
    recv.wait()
    assert out.tolist() == [1, 2, 3]


def _read_all(sock: socket.socket) -> bytes:
    """Everything the other side sends until it closes."""
    sock.settimeout(5)
    chunks = []
    while chunk := sock.recv(1000):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(60)
def test_handshake_refuses_foreign_connections() -> None:
    world = World(2, connect=False)
    try:
        host, port = world.transports[0].prepare().values()
        strays = _stray_connections(host, port)
        on_threads(2, lambda rank: world.connect_rank(rank, 10.0))
        answers = [_read_all(stray) for stray in strays[:3]]
        assert [answer[:1] for answer in answers] == [b"R", b"R", b"R"]
        assert b"not a tcoll connection" in answers[0]
        assert b"another tcoll job" in answers[1]
        assert b"rank 7 is not expected" in answers[2]
        for stray in strays:
            stray.close()
        _assert_linked(world)
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_auth_key_match_and_mismatch() -> None:
    world = World(2, keys=["s3cret", "s3cret"])
    try:
        out = np.zeros(1, dtype=np.uint8)
        recv = world.engines[1].irecv(out, 0, CTX, 0)
        world.engines[0].isend(np.array([5], dtype=np.uint8), 1, CTX, 0).wait()
        recv.wait()
        assert out[0] == 5
    finally:
        world.close()

    bad = World(2, timeout=1.5, keys=["s3cret", "wrong"], connect=False)
    try:
        errors: list[BaseException | None] = [None, None]

        def rank(r: int) -> None:
            try:
                bad.connect_rank(r, 1.5)
            except (TransportError, TimeoutError) as exc:
                errors[r] = exc

        started = time.monotonic()
        on_threads(2, rank)
        assert time.monotonic() - started < 5
        assert isinstance(errors[1], TransportError) and "TCOLL_AUTH_KEY differs" in str(errors[1])
        assert isinstance(errors[0], TimeoutError) and errors[0].peers == [1]
        assert "TCOLL_AUTH_KEY differs" in str(errors[0])
    finally:
        bad.close()


@pytest.mark.timeout(60)
def test_connect_timeout_names_ranks_and_addresses() -> None:
    world = World(3, connect=False)
    try:
        for rank in (0, 2):
            world.store.set(f"card/{rank}", json.dumps({"tcp": world.transports[rank].prepare()}).encode())
        with pytest.raises(TimeoutError) as info:
            world.connect_rank(1, 0.5)  # rank 0 never accepts, rank 2 never dials
        message = str(info.value)
        host, port = world.transports[0].prepare().values()
        assert info.value.peers == [0, 2] and f"{host}:{port}" in message and "rank 2" in message
    finally:
        world.close()


@pytest.mark.timeout(60)
def test_peer_closed_fails_pending_recv_quickly(world2: World) -> None:
    a, b = world2.engines
    recv = a.irecv(np.zeros(8, dtype=np.uint8), 1, CTX, 0)
    started = time.monotonic()
    threading.Timer(0.2, lambda: (b.close(), world2.transports[1].close())).start()
    with pytest.raises(PeerLostError) as info:
        recv.wait(timeout=20)
    assert info.value.rank == 1 and str(info.value) == "peer rank 1 is lost: connection closed"
    assert time.monotonic() - started < 2.0
    with pytest.raises(PeerLostError):
        a.isend(np.zeros(1, dtype=np.uint8), 1, CTX, 0)


@pytest.mark.timeout(60)
def test_corrupt_stream_fails_the_peer(world2: World) -> None:
    recv = world2.engines[1].irecv(np.zeros(8, dtype=np.uint8), 0, CTX, 0)
    world2.transports[0]._channels[0].sock.send(b"\xff" * HEADER.size)  # bytes that are no header
    with pytest.raises(PeerLostError, match="corrupt message header from rank 0"):
        recv.wait(timeout=10)


@pytest.mark.timeout(60)
def test_close_leaves_no_threads_or_fds() -> None:
    threads_before = set(threading.enumerate())
    fds_before = set(os.listdir("/proc/self/fd"))
    world = World(3)
    out = np.zeros(4, dtype=np.uint8)
    recv = world.engines[2].irecv(out, 0, CTX, 0)
    world.engines[0].isend(np.arange(4, dtype=np.uint8), 2, CTX, 0).wait()
    recv.wait()
    world.close()
    world.close()  # idempotent
    assert set(threading.enumerate()) <= threads_before
    assert set(os.listdir("/proc/self/fd")) <= fds_before


class _Bomb:
    """Unpickling this would create `path`: proof that a stranger's payload was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


@pytest.mark.timeout(60)
def test_strangers_without_the_key_are_refused_before_their_payload(tmp_path) -> None:
    marker = tmp_path / "executed"
    payload = pickle.dumps(_Bomb(str(marker))) + b"\xff" * (200 << 10)
    world = World(2, keys=["s3cret", "s3cret"], connect=False)
    try:
        host, port = world.transports[0].prepare().values()
        run_id = b"tcp-test"
        hello = struct.pack("<8sHHIIH", b"TCOLLTCP", 1, 1, 1, 0, len(run_id)) + run_id
        strays = [socket.create_connection((host, port)) for _ in range(3)]
        strays[0].sendall(hello + os.urandom(64) + payload)  # claims rank 1, answers the challenge wrongly
        no_key = struct.pack("<8sHHIIH", b"TCOLLTCP", 1, 0, 1, 0, len(run_id)) + run_id
        strays[1].sendall(no_key + payload)  # claims rank 1 without a key
        strays[2].sendall(payload)  # a pickle straight away
        on_threads(2, lambda rank: world.connect_rank(rank, 10.0))
        answers = [_read_all(stray) for stray in strays]
        assert answers[0][:1] == b"C" and b"TCOLL_AUTH_KEY differs" in answers[0]
        assert answers[1][:1] == b"R" and b"TCOLL_AUTH_KEY is set on rank 0 only" in answers[1]
        assert answers[2][:1] == b"R" and b"not a tcoll connection" in answers[2]
        for stray in strays:
            stray.close()
        _assert_linked(world)
    finally:
        world.close()
    assert not marker.exists()
