"""The TCP store's limits and its handshake: strangers are refused before anything of theirs is read or kept."""

from __future__ import annotations

import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tcoll.errors import RendezvousError
from tcoll.store import StoreLimitError, StoreLimits, TCPStore, TCPStoreServer
from tcoll.store import tcp as tcp_module
from tcoll.store.wire import ERROR, MAGIC, NONCE, OK, U32, Op, decode, encode, proof, recv_frame, send_frame

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_leftovers")]

KEY = b"s3cret"


def _wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _peak_rss() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def _closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Read until the server hangs up; return what it sent."""
    sock.settimeout(timeout)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


class _Bomb:
    """Unpickling this would create `path`: proof that a payload was executed."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.path,))


def _hello(sock: socket.socket) -> tuple[bytes, bytes]:
    """Send a well-formed HELLO; return (our nonce, the server's nonce)."""
    mine = os.urandom(NONCE)
    send_frame(sock, encode(Op.HELLO, MAGIC, mine))
    status, fields = decode(recv_frame(sock, 256) or b"")
    assert status == OK
    return mine, fields[0]


# -- strangers ----------------------------------------------------------------------------


def test_store_refuses_strangers_and_reads_nothing_of_theirs(tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    payload = pickle.dumps(_Bomb(str(marker)))
    with TCPStoreServer("127.0.0.1", 0, auth_key=KEY) as server:
        with pytest.raises(RendezvousError, match="wrong authentication key"):
            TCPStore("127.0.0.1", server.port, timeout=5)  # no key
        with pytest.raises(RendezvousError, match="refused"):
            TCPStore("127.0.0.1", server.port, timeout=5, auth_key="wrong")
        peak = _peak_rss()
        strangers = []
        for _ in range(8):  # the old server allocated up to 256 MiB for each of these
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(struct.pack("<I", 0xFFFF_FFF0) + payload)
            strangers.append(sock)
        for _ in range(4):  # a valid hello, then a huge frame instead of the proof
            sock = socket.create_connection(("127.0.0.1", server.port))
            _hello(sock)
            sock.sendall(struct.pack("<I", 256 << 20) + payload)
            strangers.append(sock)
        # A wrong proof, followed at once by a request carrying a pickle: refused, nothing stored.
        sock = socket.create_connection(("127.0.0.1", server.port))
        mine, theirs = _hello(sock)
        send_frame(sock, encode(Op.AUTH, proof(b"wrong", b"C", theirs, mine)))
        send_frame(sock, encode(Op.SET, b"evil", payload))
        status, fields = decode(recv_frame(sock, 256) or b"")
        assert status == ERROR and b"wrong authentication key" in fields[0]
        strangers.append(sock)
        for stranger in strangers:
            assert b"tcoll-store" not in _closed_by_server(stranger)  # dropped, after at most a refusal
            stranger.close()
        assert _peak_rss() - peak < 32 << 20
        _wait_until(lambda: server.stats()["handshakes"] == 0)
        with TCPStore("127.0.0.1", server.port, timeout=5, auth_key=KEY) as good:
            assert good.num_keys() == 0 and not good.check(["evil"])
            good.set("k", b"v")
            assert good.get("k") == b"v"
        assert server.stats()["keys"] == 1
    assert not marker.exists()


def test_client_refuses_a_store_that_cannot_prove_the_key() -> None:
    with TCPStoreServer("127.0.0.1", 0) as keyless:
        with pytest.raises(RendezvousError, match="it has no key"):
            TCPStore("127.0.0.1", keyless.port, timeout=5, auth_key=KEY)
    with TCPStoreServer("127.0.0.1", 0, auth_key=b"other") as impostor:
        with pytest.raises(RendezvousError, match="failed to prove it knows TCOLL_AUTH_KEY"):
            TCPStore("127.0.0.1", impostor.port, timeout=5, auth_key=KEY)


def test_an_older_client_gets_a_clear_answer() -> None:
    with TCPStoreServer("127.0.0.1", 0) as server, socket.create_connection(("127.0.0.1", server.port)) as sock:
        send_frame(sock, encode(Op.HELLO, b"tcoll-store/1"))
        status, fields = decode(recv_frame(sock, 256) or b"")
        assert status == ERROR and b"speaks tcoll-store/2" in fields[0]


# -- sizes ---------------------------------------------------------------------------------


def test_value_and_total_limits_are_named_errors() -> None:
    limits = StoreLimits(max_value=1 << 20, max_bytes=4 << 20)
    with TCPStoreServer("127.0.0.1", 0, limits=limits) as server, TCPStore("127.0.0.1", server.port,
                                                                            timeout=10) as store:
        with pytest.raises(StoreLimitError, match="TCOLL_STORE_MAX_VALUE"):
            store.set("big", bytes(2 << 20))
        with pytest.raises(StoreLimitError, match="nothing was stored"):
            store.set("huge", bytes(8 << 20))  # above one request's limit: read, thrown away, refused
        with pytest.raises(StoreLimitError, match="TCOLL_STORE_MAX_VALUE"):
            store.compare_set("big", b"", bytes(2 << 20))
        for i in range(4):
            store.set(f"v{i}", bytes(900 << 10))
        with pytest.raises(StoreLimitError, match="TCOLL_STORE_MAX_BYTES"):
            store.set("v4", bytes(900 << 10))
        assert not store.check(["big"]) and not store.check(["huge"]) and not store.check(["v4"])
        store.set("v0", b"smaller")  # replacing a value frees what it held
        store.set("v4", bytes(900 << 10))
        assert store.delete("v1")
        store.set("v5", bytes(900 << 10))
        assert store.get("v5") == bytes(900 << 10)  # the connection stayed in step through all of it
        assert server.stats()["bytes_held"] <= limits.max_bytes
        _wait_until(lambda: server.stats()["bytes_receiving"] == 0)  # released just after the reply went out


def test_connection_limit() -> None:
    limits = StoreLimits(max_connections=2)
    with TCPStoreServer("127.0.0.1", 0, limits=limits) as server:
        first = TCPStore("127.0.0.1", server.port, timeout=5)
        second = TCPStore("127.0.0.1", server.port, timeout=5)
        with pytest.raises(RendezvousError, match="TCOLL_STORE_MAX_CONNECTIONS"):
            TCPStore("127.0.0.1", server.port, timeout=5, connect_timeout=0.5)
        first.close()
        with TCPStore("127.0.0.1", server.port, timeout=5, connect_timeout=5) as third:
            third.set("k", b"v")
        second.close()


# -- time ----------------------------------------------------------------------------------


def test_handshake_cap_drops_the_oldest_stranger() -> None:
    with TCPStoreServer("127.0.0.1", 0, limits=StoreLimits(max_handshakes=4)) as server:
        silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
        _wait_until(lambda: server.stats()["handshakes"] == 4)
        assert _closed_by_server(silent[0], 5) == b""  # the oldest made room for the newest
        with TCPStore("127.0.0.1", server.port, timeout=5) as store:  # a rank still gets in
            store.set("k", b"v")
        for sock in silent:
            sock.close()
        _wait_until(lambda: server.stats()["handshakes"] == 0)


def test_a_slow_drip_does_not_extend_the_handshake_timeout() -> None:
    with TCPStoreServer("127.0.0.1", 0, limits=StoreLimits(handshake_timeout=0.5)) as server:
        slow = socket.create_connection(("127.0.0.1", server.port))
        hello = U32.pack(30) + encode(Op.HELLO, MAGIC, bytes(NONCE))
        dripped = threading.Event()

        def drip() -> None:  # a byte every 100 ms: the whole hello would take 3 s
            try:
                for byte in hello:
                    slow.sendall(bytes([byte]))
                    time.sleep(0.1)
            except OSError:
                pass
            dripped.set()

        thread = threading.Thread(target=drip)
        thread.start()
        try:
            assert _closed_by_server(slow, 10) == b""
            assert not dripped.is_set(), "the server waited for the whole drip"
        finally:
            thread.join(10)
            slow.close()
        _wait_until(lambda: server.stats()["handshakes"] == 0)


@pytest.mark.parametrize("race", [False, True], ids=["noticed", "raced"])
def test_idle_connections_are_closed_and_clients_reconnect(race: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if race:  # the client misses the GOODBYE before sending: the reply is GOODBYE, and it sends again
        monkeypatch.setattr(tcp_module, "_stale", lambda sock: "ok")
    limits = StoreLimits(idle_timeout=0.3)
    with TCPStoreServer("127.0.0.1", 0, limits=limits) as server, TCPStore("127.0.0.1", server.port,
                                                                            timeout=10) as store:
        assert store.add("counter", 1) == 1
        _wait_until(lambda: server.stats()["connections"] == 0)
        assert store.add("counter", 1) == 2  # executed exactly once, on a new connection
        _wait_until(lambda: server.stats()["connections"] == 0)
        assert store.get("counter") == b"2"
        got: list[bytes] = []
        waiter = threading.Thread(target=lambda: got.append(store.get("late", timeout=10)))
        waiter.start()
        _wait_until(lambda: b"late" in server._table.waiters)
        time.sleep(4 * limits.idle_timeout)  # a request waiting for a key is not idle
        with TCPStore("127.0.0.1", server.port, timeout=10) as other:
            other.set("late", b"here")
        waiter.join(10)
        assert got == [b"here"]


# -- file descriptors ------------------------------------------------------------------------

_EMFILE_CHILD = r"""
import json, os, resource, socket, sys, time
from tcoll.store import TCPStore, TCPStoreServer
server = TCPStoreServer("127.0.0.1", 0)
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
clients = []
while True:
    try:
        clients.append(socket.create_connection(("127.0.0.1", server.port), timeout=1))
    except OSError:
        break
time.sleep(0.3)  # let the server run into the limit
start = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
time.sleep(1.0)
cpu = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - start
for sock in clients:
    sock.close()
with TCPStore("127.0.0.1", server.port, timeout=10) as store:
    store.set("k", b"v")
    ok = store.get("k") == b"v"
server.close()
print(json.dumps({"clients": len(clients), "cpu": cpu, "ok": ok}))
"""


def test_accept_backs_off_when_descriptors_run_out() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", _EMFILE_CHILD], capture_output=True, text=True, timeout=50,
                         env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["clients"] >= 10 and result["ok"]
    assert result["cpu"] < 0.3, f"the accept loop burnt {result['cpu']:.2f} s of CPU in 1 s"
