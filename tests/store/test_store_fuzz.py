"""A fuzz test of the TCP store server: random, truncated, oversized and slow frames, before and after the
handshake, against a server in its own process whose peak memory (VmHWM) is measured."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tcoll.store import TCPStore  # noqa: E402
from tcoll.store.wire import MAGIC, NONCE, U32, Op, decode, encode, proof, recv_frame, send_frame  # noqa: E402

pytestmark = pytest.mark.timeout(120)

KEY = b"fuzz-key"
_SERVER = r"""
import sys
from tcoll.store import StoreLimits, TCPStoreServer
limits = StoreLimits(max_value=256 << 10, max_bytes=2 << 20, max_connections=64, max_handshakes=32,
                     handshake_timeout=1.0, idle_timeout=2.0)
server = TCPStoreServer("127.0.0.1", 0, auth_key=sys.argv[1], limits=limits)
print(server.port, flush=True)
sys.stdin.read()  # serve until the test closes our stdin
server.close()
"""


def _peak(pid: int) -> int:
    """A process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[subprocess.Popen[str], int]]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, KEY.decode()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        yield proc, port
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- what a connection sends ------------------------------------------------------------------

_small = st.binary(max_size=64)
_field = st.one_of(_small, st.integers(0, 3 << 20).map(bytes))  # up to twice a request's limit
_request = st.builds(lambda op, fields: encode(op, *fields), st.one_of(st.sampled_from(list(Op)), st.integers(0, 255)),
                     st.lists(_field, max_size=4))
_frame = st.one_of(
    st.binary(max_size=300),  # noise
    st.builds(lambda n, body: U32.pack(n) + body, st.integers(0, 2**32 - 1), st.binary(max_size=300)),  # any prefix
    st.builds(lambda body: U32.pack(len(body)) + body, _request),  # a well-formed frame
    st.builds(lambda body, cut: (U32.pack(len(body)) + body)[:cut], _request, st.integers(0, 64)),  # truncated
)
_fill = st.builds(lambda key, n: U32.pack(n + len(key) + 9) + encode(Op.SET, key, bytes(n)),
                  st.binary(min_size=8, max_size=12), st.integers(100 << 10, 300 << 10))
_script = st.one_of(
    st.fixed_dictionaries({
        "prelude": st.sampled_from(["none", "hello", "wrong-key", "key"]),
        "frames": st.lists(_frame, max_size=6),
        "slow": st.booleans(),
    }),
    st.fixed_dictionaries({"prelude": st.just("key"), "frames": st.lists(_fill, min_size=8, max_size=16),
                           "slow": st.just(False)}),  # a client with the key that tries to fill the store
)


def _prelude(sock: socket.socket, kind: str) -> None:
    """Open the connection as the script says: not at all, half-way, with a wrong key, or properly."""
    if kind == "none":
        return
    mine = os.urandom(NONCE)
    send_frame(sock, encode(Op.HELLO, MAGIC, mine))
    _, fields = decode(recv_frame(sock, 256) or b"\0")
    if kind == "hello":
        return
    theirs = fields[0]
    send_frame(sock, encode(Op.AUTH, proof(KEY if kind == "key" else b"wrong", b"C", theirs, mine)))
    recv_frame(sock, 256)


def _play(port: int, script: dict) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            _prelude(sock, script["prelude"])
            data = b"".join(script["frames"])
            if script["slow"]:  # a drip of small pieces first
                for i in range(0, min(len(data), 24), 3):
                    sock.sendall(data[i:i + 3])
                    time.sleep(0.002)
                data = data[24:]
            sock.sendall(data)
            sock.settimeout(0.02)
            while sock.recv(1 << 20):
                pass
        except OSError:
            pass  # the server may hang up on nonsense at any point: that is its right


def test_fuzzed_frames_leave_the_server_bounded_and_serving(server: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = server
    with TCPStore("127.0.0.1", port, timeout=10, auth_key=KEY) as warm:  # reach the steady state first
        warm.set("warm", bytes(200 << 10))
        assert warm.delete("warm")
    baseline = _peak(proc.pid)

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_script, min_size=1, max_size=3))
    def fuzz(scripts: list[dict]) -> None:
        for script in scripts:
            _play(port, script)

    fuzz()
    assert proc.poll() is None, "the server died"
    growth = _peak(proc.pid) - baseline
    print(f"peak memory growth: {growth / 2**20:.1f} MiB")
    assert growth < 24 << 20, f"the server's peak memory grew by {growth >> 20} MiB"
    with TCPStore("127.0.0.1", port, timeout=10, auth_key=KEY) as store:
        store.set("after", b"fuzzing")
        assert store.get("after") == b"fuzzing"
