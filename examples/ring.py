"""Pass a 64 MiB array around the ring of ranks with isend/irecv, and check every hop.

Run it with the launcher (ranks on this host talk through shared memory):

    tcoll run -n 4 examples/ring.py            # 64 MiB
    tcoll run -n 8 examples/ring.py --mib 16   # 8 ranks, 16 MiB

After size - 1 hops every rank has held every other rank's array once.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tcoll


def fill(origin: int, count: int) -> np.ndarray:
    """The array that rank `origin` starts with: distinct per rank and per position."""
    return np.arange(count, dtype=np.float32) % 1000 + origin * 1000


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

    moving = 0.0  # seconds spent moving data, checks excluded
    for hop in range(1, size):
        start = time.perf_counter()
        send = comm.isend(current, right, tag=hop)
        comm.irecv(incoming, left, tag=hop).wait()
        send.wait()
        moving += time.perf_counter() - start
        origin = (rank - hop) % size
        if not np.array_equal(incoming, fill(origin, count)):
            raise SystemExit(f"rank {rank}: hop {hop} brought wrong data (expected rank {origin}'s array)")
        current, incoming = incoming, current
    hops = size - 1
    rate = hops * current.nbytes / moving / 1e9 if hops else 0.0
    print(f"ok: {hops} hops, every one checked; {moving * 1e3:.1f} ms moving data ({rate:.2f} GB/s per rank)")
    comm.close()


if __name__ == "__main__":
    main()
