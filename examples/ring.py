"""Pass a 64 MiB array around the ring of ranks with isend/irecv, and check every hop.

Run it with the launcher (ranks on this host talk through shared memory):

    tcoll run -n 4 examples/ring.py            # 64 MiB
    tcoll run -n 8 examples/ring.py --mib 16   # 8 ranks, 16 MiB

A first lap is timed; in a second, every rank checks each array it receives
against the one its origin started with, so every rank sees every other rank's data.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tcoll


def fill(origin: int, count: int) -> np.ndarray:
    """The array that rank `origin` starts with: distinct per rank and per position."""
    return np.arange(count, dtype=np.float32) % 1000 + origin * 1000


def lap(comm: tcoll.Communicator, current: np.ndarray, incoming: np.ndarray, hops: int,
        check: bool) -> tuple[np.ndarray, np.ndarray]:
    """Pass every rank's array `hops` hops to the right; returns (held array, spare buffer).

    Each array must start at its origin rank; after `size` hops it is home again.

    Raises:
        SystemExit: a hop brought data other than the array its origin started with.
    """
    rank, size = comm.rank, comm.size
    right, left = (rank + 1) % size, (rank - 1) % size
    for hop in range(1, hops + 1):
        send = comm.isend(current, right, tag=hop)
        comm.irecv(incoming, left, tag=hop).wait()
        send.wait()
        origin = (rank - hop) % size
        if check and not np.array_equal(incoming, fill(origin, incoming.size)):
            raise SystemExit(f"rank {rank}: hop {hop} brought wrong data (expected rank {origin}'s array)")
        current, incoming = incoming, current
    return current, incoming


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64, help="array size in MiB (default 64)")
    args = parser.parse_args()

    comm = tcoll.init()
    rank, size = comm.rank, comm.size
    count = int(args.mib * (1 << 20)) // 4
    right, left = (rank + 1) % size, (rank - 1) % size
    current = fill(rank, count)
    incoming = np.empty_like(current)
    transports = sorted({comm.transport(peer) for peer in (left, right) if peer != rank}) or ["none"]
    print(f"rank {rank} of {size}: {current.nbytes / 2**20:.0f} MiB, left {left}, right {right}, "
          f"transport {'/'.join(transports)}")

    # Lap 1, timed: every array goes once round the ring and back home, nothing else meanwhile.
    start = time.perf_counter()
    current, incoming = lap(comm, current, incoming, size, check=False)
    elapsed = time.perf_counter() - start
    # Lap 2, checked: each hop is compared with the array its origin started with.
    current, incoming = lap(comm, current, incoming, size - 1, check=True)
    rate = size * current.nbytes / elapsed / 1e9 if size > 1 else 0.0
    print(f"ok: {size - 1} hops checked; a timed lap of {size} hops took {elapsed * 1e3:.1f} ms "
          f"({rate:.2f} GB/s received per rank)")
    comm.close()


if __name__ == "__main__":
    main()
