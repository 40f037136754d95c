"""Round trip of a blocking send/recv pair, per kind of buffer: NumPy, bfloat16, bytearray, torch tensors.

    tcoll run -n 2 benchmarks/p2p_buffers.py [--bytes 8] [--trips 20000] [--rounds 3]

Rank 0 prints the median over rounds of the mean round trip (us) of each kind;
the kinds are measured in turn within each round, so a machine that drifts
shifts them alike. torch is optional (its rows are left out without it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

import tcoll


def buffers(nbytes: int) -> dict[str, Any]:
    """One buffer of `nbytes` bytes of each kind."""
    kinds: dict[str, Any] = {
        "numpy float32": np.zeros(max(1, nbytes // 4), np.float32),
        "numpy bfloat16": np.zeros(max(1, nbytes // 2), ml_dtypes.bfloat16),
        "bytearray": bytearray(nbytes),
    }
    try:
        import torch
    except ImportError:
        return kinds
    kinds["torch float32"] = torch.zeros(max(1, nbytes // 4))
    kinds["torch bfloat16"] = torch.zeros(max(1, nbytes // 2), dtype=torch.bfloat16)
    return kinds


def round_trips(comm: tcoll.Communicator, buf: Any, trips: int) -> float:
    """Mean round trip in seconds over `trips` ping-pongs (after trips // 10 unmeasured ones)."""
    peer = 1 - comm.rank
    first: Callable[..., Any] = comm.send if comm.rank == 0 else comm.recv
    second: Callable[..., Any] = comm.recv if comm.rank == 0 else comm.send
    for _ in range(trips // 10):
        first(buf, peer)
        second(buf, peer)
    start = time.perf_counter()
    for _ in range(trips):
        first(buf, peer)
        second(buf, peer)
    return (time.perf_counter() - start) / trips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=8)
    parser.add_argument("--trips", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    comm = tcoll.init()
    if comm.size != 2:
        raise SystemExit("run it on 2 ranks: tcoll run -n 2 benchmarks/p2p_buffers.py")
    kinds = buffers(args.bytes)
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.rounds):
        for name, buf in kinds.items():
            times[name].append(round_trips(comm, buf, args.trips))
    if comm.rank == 0:
        print(f"| buffer ({args.bytes} B) | round trip (us) |\n| --- | --- |")
        for name, samples in times.items():
            print(f"| {name} | {statistics.median(samples) * 1e6:.2f} |")
    comm.close()


if __name__ == "__main__":
    main()
