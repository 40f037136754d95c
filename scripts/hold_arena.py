"""A tcoll job that holds a shared-memory arena (and zero-copy buffers) for a while, then checks itself.

Run it beside the test suite to show that tests only look at the files of their own job:

    tcoll run -n 4 scripts/hold_arena.py --seconds 600 &
    bash scripts/test
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import tcoll


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to hold the arena")
    args = parser.parse_args()
    comm = tcoll.init()
    lent = comm.zeros(1 << 17, np.float64)  # a zero-copy buffer: a file of this job's in /dev/shm
    deadline = time.monotonic() + args.seconds
    calls = 0
    while time.monotonic() < deadline:
        lent[:] = comm.rank + 1
        comm.all_reduce(lent)  # the arena is opened by the first call and used by every one
        expected = comm.size * (comm.size + 1) / 2
        assert np.all(lent == expected), (lent[:4], expected)
        calls += 1
        time.sleep(0.05)  # a job that mostly computes: the arena stays mapped meanwhile
    comm.barrier()
    if comm.rank == 0:
        print(f"held the arena for {args.seconds:g} s: {calls} all_reduce calls, all right")
    comm.close()


if __name__ == "__main__":
    main()
