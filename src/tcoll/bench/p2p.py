"""Point-to-point benchmark: ping-pong latency and one-way bandwidth between 2 ranks.

For each transport asked for (shm, tcp), two rank processes measure, for every
message size, the round trip of a ping-pong and the bandwidth of a stream of
messages (a window of isends, then a 1-byte acknowledgement, as osu_bw does).
A plain TCP loopback socket between two processes is measured in the same run
as the reference the shm transport is compared with.
"""

from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["P2PRow", "measure_pair", "raw_tcp_pair", "run_p2p", "sizes_between"]

_WINDOW_BYTES = 8 << 20  # bytes in flight per bandwidth window
_ACK_TAG, _DATA_TAG, _PING_TAG = 3, 1, 2


@dataclass
class P2PRow:
    """Results for one message size on one transport (medians over repetitions)."""

    transport: str
    nbytes: int
    rtt_us: float
    bandwidth_gbs: float
    samples: dict[str, list[float]] = field(default_factory=dict)


def sizes_between(begin: int, end: int, factor: int) -> list[int]:
    """Message sizes begin, begin*factor, ... below end, then end itself (always measured, as nccl-tests)."""
    if begin <= 0 or end < begin or factor < 2:
        raise ValueError("need 0 < begin <= end and factor >= 2")
    sizes = []
    size = begin
    while size < end:
        sizes.append(size)
        size *= factor
    return [*sizes, end]


def _iterations(nbytes: int, budget_bytes: int = 512 << 20) -> int:
    return max(5, min(5000, budget_bytes // max(nbytes, 1)))


def _pingpong(comm: Any, buf: np.ndarray, iters: int) -> float:
    """Seconds per round trip of `buf` between ranks 0 and 1."""
    peer = 1 - comm.rank
    start = time.perf_counter()
    for _ in range(iters):
        if comm.rank == 0:
            comm.send(buf, peer, _PING_TAG)
            comm.recv(buf, peer, _PING_TAG)
        else:
            comm.recv(buf, peer, _PING_TAG)
            comm.send(buf, peer, _PING_TAG)
    return (time.perf_counter() - start) / iters


def _stream(comm: Any, buf: np.ndarray, iters: int) -> float:
    """Bytes per second from rank 0 to rank 1, a window of messages at a time."""
    window = max(1, min(64, _WINDOW_BYTES // max(buf.nbytes, 1)))
    ack = np.zeros(1, dtype=np.uint8)
    rounds = max(2, iters // window)
    start = time.perf_counter()
    for _ in range(rounds):
        if comm.rank == 0:
            works = [comm.isend(buf, 1, _DATA_TAG) for _ in range(window)]
            for work in works:
                work.wait()
            comm.recv(ack, 1, _ACK_TAG)
        else:
            works = [comm.irecv(buf, 0, _DATA_TAG) for _ in range(window)]
            for work in works:
                work.wait()
            comm.send(ack, 0, _ACK_TAG)
    elapsed = time.perf_counter() - start
    return rounds * window * buf.nbytes / elapsed


def measure_pair(comm: Any, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Run on both ranks of a 2-rank communicator; rank 0 returns the rows.

    Buffers are filled before timing: an untouched np.zeros buffer maps the
    kernel's zero page and reads unrealistically fast.
    """
    rows = []
    for nbytes in sizes:
        buf = np.full(nbytes, 7, dtype=np.uint8)
        iters = _iterations(nbytes)
        _pingpong(comm, buf, 3)  # warm-up: first touches, spin policy
        rtts = [_pingpong(comm, buf, iters) for _ in range(repeats)]
        rates = [_stream(comm, buf, iters) for _ in range(repeats)]
        rows.append({"nbytes": nbytes, "rtt": rtts, "bw": rates})
    return rows if comm.rank == 0 else []


def _raw_tcp_receiver(port_queue: Any, sizes: list[int], repeats: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn, server:
        for nbytes in sizes:
            buf = memoryview(bytearray(max(nbytes, 1)))
            for _ in range(repeats + 1):
                total = _iterations(nbytes) * nbytes
                while total > 0:
                    got = conn.recv_into(buf[:min(nbytes, total)])
                    if not got:
                        return
                    total -= got
                conn.sendall(b"k")


def raw_tcp_pair(sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    """Stream bandwidth of a plain TCP loopback socket between two processes."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    ports = context.Queue()
    receiver = context.Process(target=_raw_tcp_receiver, args=(ports, sizes, repeats), daemon=True)
    receiver.start()
    try:
        sock = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rows = []
        with sock:
            for nbytes in sizes:
                payload = np.full(max(nbytes, 1), 7, dtype=np.uint8)[:nbytes]
                rates = []
                for attempt in range(repeats + 1):
                    iters = _iterations(nbytes)
                    start = time.perf_counter()
                    for _ in range(iters):
                        sock.sendall(payload)
                    sock.recv(1)
                    if attempt:  # the first pass warms up
                        rates.append(iters * nbytes / (time.perf_counter() - start))
                rows.append({"nbytes": nbytes, "rtt": [], "bw": rates})
        return rows
    finally:
        receiver.join(30)
        if receiver.is_alive():
            receiver.kill()


def run_p2p(transports: list[str], sizes: list[int], repeats: int = 3, raw_tcp: bool = True,
            timeout: float = 600) -> list[P2PRow]:
    """Measure every transport (2 rank processes each) and, optionally, a raw TCP socket."""
    from ..startup.spawn import spawn

    rows: list[P2PRow] = []
    for transport in transports:
        results = spawn(measure_pair, 2, (sizes, repeats), timeout=timeout, transport=transport)
        for item in results[0]:
            rows.append(P2PRow(transport, item["nbytes"], statistics.median(item["rtt"]) * 1e6,
                               statistics.median(item["bw"]) / 1e9, {"rtt": item["rtt"], "bw": item["bw"]}))
    if raw_tcp:
        for item in raw_tcp_pair([n for n in sizes if n >= 1024], repeats):
            rows.append(P2PRow("raw-tcp-socket", item["nbytes"], float("nan"),
                               statistics.median(item["bw"]) / 1e9, {"bw": item["bw"]}))
    return rows
