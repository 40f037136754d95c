"""The copy rate: how fast each rank copies a row's bytes between its own buffers while every rank does.

`tcoll bench all_reduce` measures it in tcoll's rank processes, right after
the collectives, at each size of the sweep, so that a row's busbw can be read
against what this machine's memory gives in the same minute: "copy GB/s" is
the row's bytes over the time of one `np.copyto` between two private arrays
that were written first (so their pages exist), with every rank copying at
once (the collective's ranks compete for the same memory); "busbw/copy" is
the row's busbw over it. A shared-memory all_reduce copies each rank's vector
in and the result out besides reducing, so busbw/copy near 1 is near what
the machine allows. Small sizes measure NumPy's per-call cost, not memory.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

__all__ = ["TRIALS", "copy_seconds"]

TRIALS = 3  # timed blocks per size; their median is the size's time


def copy_seconds(comm: Any, nbytes: int, iters: int) -> float:
    """Seconds per copy of `nbytes` on this rank with every rank copying; the max over ranks, on every rank.

    Args:
        comm: the ranks' communicator (barriers and the maximum only).
        nbytes: bytes per copy.
        iters: copies per timed block; the median of TRIALS blocks counts.
    """
    src = np.empty(nbytes, np.uint8)
    dst = np.empty(nbytes, np.uint8)
    src.fill(7)  # both written: a page never written reads as the kernel's shared zero page
    dst.fill(0)
    copy = np.copyto
    comm.barrier()
    for _ in range(max(1, iters // 10)):  # warm-up
        copy(dst, src)
    blocks = []
    for _ in range(TRIALS):
        comm.barrier()  # every rank copies at once, as in the collective
        start = time.perf_counter()
        for _ in range(iters):
            copy(dst, src)
        blocks.append((time.perf_counter() - start) / iters)
    return float(comm.all_reduce(np.array([statistics.median(blocks)]), "max")[0])
