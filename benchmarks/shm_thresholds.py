"""Where one arena step stops paying: all_reduce in one step against three, by size and rank count.

    python benchmarks/shm_thresholds.py                         # 2 and 4 ranks, 1 KiB to 512 KiB
    python benchmarks/shm_thresholds.py --ranks 2,4,8,16 --markdown

A shared-memory all_reduce that fits a slot runs either in one step (every rank reduces every rank's
whole vector) or in three (each rank reduces 1/p of it); tcoll.shm.vector.ONE_STEP_LIMITS says up to
which size the one step runs, by rank count. For each rank count and size this times the same blocking
all_reduce (float32 sum, a plain array written before timing) forced each way (set_one_step_limit, the
same on every rank), the slowest rank's median per call over three rounds, and prints which was faster,
what tcoll chooses now, and the largest size up to which the one step was never slower: the limit the
measurement suggests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import tcoll
from tcoll.bench.machine import describe_machine
from tcoll.shm import vector

ONE, THREE = 1 << 30, 0  # limits that force one step / three steps


def _time_call(comm, x: np.ndarray, iters: int) -> float:
    """Seconds per blocking all_reduce of x, the slowest rank's median over three rounds."""
    rounds = []
    for _ in range(3):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            comm.all_reduce(x)
        rounds.append((time.perf_counter() - start) / iters)
    mine = np.array([statistics.median(rounds)])
    comm.all_reduce(mine, op="max")
    return float(mine[0])


def _rank(comm, sizes: list[int]) -> list[tuple[int, float, float]]:
    """Every size forced each way on this rank: (bytes, one step s, three steps s) per size."""
    rows = []
    for nbytes in sizes:
        x = np.arange(nbytes // 4, dtype=np.float32)
        iters = max(20, min(2000, (64 << 20) // max(nbytes, 1) // comm.size))
        times = []
        for limit in (ONE, THREE):
            vector.set_one_step_limit(limit)
            for _ in range(5):
                comm.all_reduce(x)
            times.append(_time_call(comm, x, iters))
        vector.set_one_step_limit(None)
        rows.append((nbytes, *times))
    return rows


def suggested_limit(rows: list[tuple[int, float, float]]) -> int:
    """The largest size up to which the one step was never slower than the three (0: never faster)."""
    limit = 0
    for nbytes, one, three in rows:
        if one > three:
            break
        limit = nbytes
    return limit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts (default %(default)s)")
    parser.add_argument("--minbytes", type=int, default=1 << 10)
    parser.add_argument("--maxbytes", type=int, default=512 << 10)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    sizes = [1 << k for k in range(args.minbytes.bit_length() - 1, args.maxbytes.bit_length())]
    print(f"# machine: {describe_machine()}")
    for size in (int(r) for r in args.ranks.split(",")):
        rows = tcoll.spawn(_rank, size, (sizes,), timeout=600, transport="shm")[0]
        limit = vector.one_step_limit(size)
        print(f"\n{size} ranks: tcoll's one-step limit {limit >> 10} KiB; measured best up to "
              f"{suggested_limit(rows) >> 10} KiB\n")
        print("| bytes | one step (us) | three steps (us) | faster | tcoll takes |\n|---|---|---|---|---|"
              if args.markdown else f"{'bytes':>8} {'one step':>10} {'three':>10}  faster  tcoll takes")
        for nbytes, one, three in rows:
            faster = "one" if one <= three else "three"
            takes = "one" if nbytes <= vector.one_step_limit(size) else "three"
            cells = (nbytes, f"{one * 1e6:.1f}", f"{three * 1e6:.1f}", faster, takes)
            print("| " + " | ".join(map(str, cells)) + " |" if args.markdown
                  else f"{nbytes:>8} {cells[1]:>10} {cells[2]:>10}  {faster:>6}  {takes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
