"""The TCP store against clients that are refused or slow: refusals hold nothing, a request has one deadline
for all of its bytes, and one slow client never stalls another's small request. Loopback only."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest
from helpers.procs import hung_up

from tcoll.errors import RendezvousError
from tcoll.store import StoreLimits, TCPStore, TCPStoreServer
from tcoll.store.limits import SMALL_REQUEST
from tcoll.store.wire import ERROR, MAGIC, NONCE, OK, U32, Op, decode, encode, proof, recv_frame, send_frame

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftovers")]

KEY = b"s3cret"
_LINGER_WAS = 5.0  # seconds a refused connection used to stay open, waiting for its client to hang up


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _handshake(sock: socket.socket, key: bytes) -> tuple[int, list[bytes]]:
    """HELLO, then AUTH with a proof made with `key`; the server's answer to the proof."""
    mine = os.urandom(NONCE)
    send_frame(sock, encode(Op.HELLO, MAGIC, mine))
    status, fields = decode(recv_frame(sock, 256) or b"")
    assert status == OK
    send_frame(sock, encode(Op.AUTH, proof(key, b"C", fields[0], mine)))
    return decode(recv_frame(sock, 256) or b"")


def test_refused_connections_are_closed_at_once_and_hold_nothing() -> None:
    with TCPStoreServer("127.0.0.1", 0, auth_key=KEY, limits=StoreLimits(max_handshakes=16)) as server:
        refused = []
        for _ in range(64):  # four times the handshake cap: none of them may pile up
            sock = socket.create_connection(("127.0.0.1", server.port))
            status, fields = _handshake(sock, b"wrong")
            assert status == ERROR and b"wrong authentication key" in fields[0]
            refused.append(sock)  # kept open on our side: the server must not wait for us to hang up
        for sock in refused:
            assert hung_up(sock, _LINGER_WAS / 2), "a refused connection lingered"
        _wait_until(lambda: server.stats()["open"] == 0, _LINGER_WAS / 2)
        with pytest.raises(RendezvousError, match="wrong authentication key"):
            TCPStore("127.0.0.1", server.port, timeout=5)  # the ordinary client still reads why
        with TCPStore("127.0.0.1", server.port, timeout=5, auth_key=KEY) as good:
            good.set("k", b"v")
            assert server.stats()["open"] == 1
        for sock in refused:
            sock.close()


def _drip(sock: socket.socket, data: bytes, every: float, stop: threading.Event) -> threading.Thread:
    """Send `data` a byte every `every` seconds in a thread, until done, refused, or `stop`."""
    def run() -> None:
        for byte in data:
            if stop.wait(every):
                return
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                return

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_request_has_one_deadline_for_all_its_bytes() -> None:
    limits = StoreLimits(idle_timeout=0.5)
    with TCPStoreServer("127.0.0.1", 0, auth_key=KEY, limits=limits) as server:
        slow = socket.create_connection(("127.0.0.1", server.port))
        assert _handshake(slow, KEY) == (OK, [])
        frame = encode(Op.SET, b"key", b"v" * 30)
        stop = threading.Event()
        started = time.monotonic()
        thread = _drip(slow, U32.pack(len(frame)) + frame, 0.1, stop)  # a byte every 0.1 s: the whole takes 4 s
        try:
            assert hung_up(slow, 10)
            assert time.monotonic() - started < 3, "each byte restarted the clock"
        finally:
            stop.set()
            thread.join(10)
            slow.close()
        with TCPStore("127.0.0.1", server.port, timeout=5, auth_key=KEY) as store:
            assert not store.check(["key"])


def test_a_slow_client_holding_the_budget_stalls_no_one() -> None:
    budget = 1 << 20
    limits = StoreLimits(max_bytes=budget, idle_timeout=1.0)
    with TCPStoreServer("127.0.0.1", 0, auth_key=KEY, limits=limits) as server:
        slow = socket.create_connection(("127.0.0.1", server.port))
        assert _handshake(slow, KEY) == (OK, [])
        slow.sendall(U32.pack(budget))  # announces a request the size of the whole budget...
        _wait_until(lambda: server.stats()["bytes_receiving"] >= budget)
        stop = threading.Event()
        thread = _drip(slow, bytes(100), 0.1, stop)  # ...and drips it: 10 s at this pace
        done: dict[str, float] = {}
        started = time.monotonic()

        def put(name: str, size: int) -> None:
            with TCPStore("127.0.0.1", server.port, timeout=20, auth_key=KEY) as store:
                store.set(name, bytes(size))
            done[name] = time.monotonic() - started

        putters = [threading.Thread(target=put, args=("small", 200)),
                   threading.Thread(target=put, args=("large", 4 * SMALL_REQUEST))]
        try:
            for putter in putters:
                putter.start()
            for putter in putters:
                putter.join(20)
            assert set(done) == {"small", "large"}
            assert done["small"] < 0.9, f"a small set waited {done['small']:.1f} s for a slow client"
            # A large one may wait for the budget, but only until the slow request's deadline cuts it off.
            assert done["large"] < 5, f"a large set waited {done['large']:.1f} s: the drip kept its budget"
            assert hung_up(slow, 5)
        finally:
            stop.set()
            thread.join(10)
            slow.close()
        _wait_until(lambda: server.stats()["bytes_receiving"] == 0)
