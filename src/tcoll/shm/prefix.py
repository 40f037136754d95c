"""Shared-memory direct scan and exscan: every rank reads the slots of the ranks below it.

Per slot-sized piece: every rank writes its piece into its slot and
publishes; rank r then combines the slots of ranks 0..r (scan) or
0..r-1 (exscan) in rank order, straight out of shared memory, into its own
buffer. One synchronisation per piece and no message; rank r reduces r or
r+1 inputs, so the last rank's (p-1)·n bytes of reduction bound the time,
which the cost model weighs against the chain and recursive doubling.
"""

from __future__ import annotations

import numpy as np

from ..algos.registry import Costs, algorithm
from ..algos.select import ARENA_COPY, ARENA_REDUCE, ARENA_SYNC
from ..ops import Op
from .arena import Arena
from .bridge import combine_all, copy_bytes

__all__: list[str] = []


def _prefix_cost(c: Costs, nbytes: int, size: int, operands: int = 0) -> float:
    """The last rank's time: it combines `operands` (default: every rank's) pieces, operands - 1 reductions."""
    if size == 1:
        return 0.0
    reductions = max(0, (operands or size) - 1)
    return -(-max(nbytes, 1) // (1 << 20)) * ARENA_SYNC + nbytes * ARENA_COPY + reductions * nbytes * ARENA_REDUCE


def _exscan_cost(c: Costs, nbytes: int, size: int) -> float:
    return _prefix_cost(c, nbytes, size, size - 1)  # the last rank combines the p-1 ranks below it


@algorithm("scan", "shm", cost=_prefix_cost, direct=True)
def scan(arena: Arena, buf: np.ndarray, op: Op) -> None:
    """Shared-memory scan: write, publish, combine the slots of ranks 0..r into buf, in rank order.

    Steps: one per slot-sized piece. Memory traffic of rank r: n bytes in,
    (r+1)·n bytes read and reduced.
    """
    _prefix_direct(arena, buf, op, arena.rank + 1)


@algorithm("exscan", "shm", cost=_exscan_cost, direct=True)
def exscan(arena: Arena, buf: np.ndarray, op: Op) -> None:
    """Shared-memory exscan: write, publish, combine the slots of ranks 0..r-1 into buf (rank 0: untouched).

    Steps: one per slot-sized piece. Memory traffic of rank r: n bytes in,
    r·n bytes read and reduced.
    """
    _prefix_direct(arena, buf, op, arena.rank)


def _prefix_direct(arena: Arena, buf: np.ndarray, op: Op, upto: int) -> None:
    """Combine the pieces of ranks 0..upto-1 into buf (upto 0: leave buf as it is)."""
    if arena.size == 1:
        return
    dtype = buf.dtype
    raw = buf.reshape(-1).view(np.uint8)
    total = raw.nbytes
    piece = arena.slot_bytes // dtype.itemsize * dtype.itemsize
    for lo in range(0, total, piece):
        hi = min(total, lo + piece)
        step = arena.first_step() if lo == 0 else arena.claim()
        copy_bytes(arena, arena.slot(arena.rank, step)[:hi - lo], raw[lo:hi])
        arena.publish(step)
        if lo == 0:
            arena.agree(step)
        else:
            arena.wait_all(step)
        if upto:
            combine_all(arena, op, [arena.slot(q, step)[:hi - lo].view(dtype) for q in range(upto)],
                        raw[lo:hi].view(dtype))
