"""all_to_allv at equal counts against all_to_all, in the same run, on one host (blocking: the shm arena).

    python benchmarks/all_to_allv.py                      # 4 ranks, 1 KiB .. 16 MiB per rank, 5 runs
    python benchmarks/all_to_allv.py --ranks 4 --sizes 65536 --runs 3

Each rank's send buffer holds `size` bytes (float32), one equal block per
rank. For every size a run times `iterations` back-to-back calls of each
collective after a warm-up and a barrier; the slowest rank's mean is the
run's time, and the table shows the median over the runs and the ratio
all_to_allv / all_to_all (all_to_allv also exchanges its counts first).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import tcoll


def measure(comm: tcoll.Communicator, sizes: list[int], runs: int) -> dict[int, tuple[float, float]]:
    p = comm.size
    table = {}
    for nbytes in sizes:
        count = max(p, nbytes // 4 // p * p)
        x = np.arange(count, dtype=np.float32).reshape(p, -1)
        chunks = list(x)
        iters = max(3, min(200, (64 << 20) // max(nbytes, 1) // 4))
        times: dict[str, list[float]] = {"all_to_all": [], "all_to_allv": []}
        for _ in range(runs):
            for name, call in (("all_to_all", lambda: comm.all_to_all(x)),
                               ("all_to_allv", lambda: comm.all_to_allv(chunks))):
                call()
                comm.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    call()
                mine = np.array([(time.perf_counter() - start) / iters])
                comm.all_reduce(mine, op="max")
                times[name].append(float(mine[0]))
        table[nbytes] = (statistics.median(times["all_to_all"]), statistics.median(times["all_to_allv"]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", default="1024,65536,1048576,16777216", help="bytes per rank, comma-separated")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    table = tcoll.spawn(measure, args.ranks, (sizes, args.runs), transport="shm")[0]
    print(f"| bytes per rank | all_to_all | all_to_allv | ratio |  ({args.ranks} ranks, shm, blocking)")
    print("| ---: | ---: | ---: | ---: |")
    for nbytes, (a2a, a2av) in table.items():
        print(f"| {nbytes} | {a2a * 1e6:.1f} us | {a2av * 1e6:.1f} us | {a2av / a2a:.2f} |")


if __name__ == "__main__":
    main()
