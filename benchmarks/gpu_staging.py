"""A CUDA tensor's all_reduce through host staging, against the sum of its parts, in the same run.

    python benchmarks/gpu_staging.py                     # 2 ranks sharing GPU 0, 64 MiB, float32
    python benchmarks/gpu_staging.py --ranks 4 --sizes 1M,64M --iterations 10

Per size, every rank times, after a warm-up and a barrier, `iterations` back-to-back calls of:
  staged     comm.all_reduce(cuda_tensor), ended by torch.cuda.synchronize() (the call is ordered on
             the stream; the synchronize makes its copy back part of the time);
  d2h        cuda_tensor -> pinned host copy (non_blocking, then synchronize);
  cpu        comm.all_reduce of a `comm.empty` array of the same size (tcoll's CPU call, in place);
  h2d        pinned host -> cuda_tensor copy (non_blocking, then synchronize).
The slowest rank's mean is each figure; "staged / parts" is staged over d2h + cpu + h2d (issue 26's
target: at most 1.3 at 64 MiB, 2 ranks). Needs a CUDA device; ranks share GPU 0.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

import tcoll
from tcoll.env import parse_size


def _timed(comm: tcoll.Communicator, iterations: int, step: Any, torch: Any) -> float:
    """The slowest rank's mean seconds of `step()` followed by a device synchronize."""
    step()
    torch.cuda.synchronize()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        step()
        torch.cuda.synchronize()
    mean = (time.perf_counter() - start) / iterations
    return max(comm.all_gather_object(mean))


def _rank(comm: tcoll.Communicator, sizes: list[int], iterations: int) -> list[dict[str, Any]]:
    """Time the four figures for each size on this rank; rank 0's rows are the result."""
    import torch
    torch.cuda.set_device(0)
    rows = []
    for nbytes in sizes:
        count = nbytes // 4
        device = torch.ones(count, device="cuda")
        host = torch.empty(count, pin_memory=True)
        lent = comm.empty(count, np.float32)
        lent[:] = 1
        row = {"bytes": nbytes,
               "staged": _timed(comm, iterations, lambda: comm.all_reduce(device), torch),
               "d2h": _timed(comm, iterations, lambda: host.copy_(device, non_blocking=True), torch),
               "cpu": _timed(comm, iterations, lambda: comm.all_reduce(lent), torch),
               "h2d": _timed(comm, iterations, lambda: device.copy_(host, non_blocking=True), torch)}
        rows.append(row)
    return rows


def main() -> None:
    """Parse the arguments, run the ranks, print the table (and JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--sizes", default="64M", help="comma-separated byte sizes (K, M suffixes)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = tcoll.spawn(_rank, args.ranks, (sizes, args.iterations), env={"TCOLL_GPU": "staging"},
                       timeout=300)[0]
    if args.json:
        print(json.dumps(rows))
    print(f"| size, {args.ranks} ranks | staged (us) | d2h | cpu (comm.empty) | h2d | parts | staged / parts |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        parts = row["d2h"] + row["cpu"] + row["h2d"]
        cells = [row[k] * 1e6 for k in ("staged", "d2h", "cpu", "h2d")] + [parts * 1e6]
        print(f"| {row['bytes']:,} | " + " | ".join(f"{c:,.0f}" for c in cells) + f" | {row['staged'] / parts:.2f}x |")


if __name__ == "__main__":
    main()
