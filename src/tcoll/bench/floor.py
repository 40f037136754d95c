"""The floor: the same exchange as a tcoll call, written as bare Python over one shared-memory flag per rank.

`tcoll bench p2p` and `tcoll bench all_reduce` time it in the same rank
processes, right after tcoll, so that tcoll's ratio to it shows how much of
a call's time is tcoll's own and how much is Python, NumPy and the machine.

The segment holds one 64-byte line per rank with its flag (a step counter
that only that rank writes), then two data slots per rank. The all_reduce
floor is the protocol of tcoll's arena without the library around it: step k
writes slot set k % 2 once every rank has published step k-1, copies the
rank's vector in, publishes k, waits until every rank has, and reduces every
slot into the buffer with one ufunc per rank. The p2p floor is a ping-pong of
the flags alone (the data rides in the slot). Waiting is a bare poll of the
flags, with os.sched_yield() per poll when ranks outnumber cores; there is no
fence, timeout, error check or sleep.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any

import numpy as np

__all__ = ["FLOOR_BYTES", "FloorSegment", "all_reduce_floor", "pingpong_floor", "measure_floor"]

FLOOR_BYTES = 4 << 20  # the floor is measured up to this size (its segment holds two whole vectors per rank)
_LINE = 64


class FloorSegment:
    """A /dev/shm file of flags and slots that every rank maps (rank 0 creates it, the others open it).

    Args:
        comm: the communicator whose ranks share it (only to agree on the file's name).
        slot_bytes: bytes of one slot (the largest vector measured).
    """

    def __init__(self, comm: Any, slot_bytes: int) -> None:
        self.rank, self.size = comm.rank, comm.size
        self.slot_bytes = slot_bytes = max(64, (slot_bytes + 63) & ~63)
        flags = _LINE * self.size
        total = flags + 2 * self.size * slot_bytes
        path = f"/dev/shm/tcoll-floor-{os.getpid()}-{secrets.token_hex(4)}" if self.rank == 0 else None
        if self.rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)
        path = comm.broadcast_object(path, 0)
        if self.rank != 0:
            fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        comm.barrier()
        if self.rank == 0:
            os.unlink(path)
        self.flags = memoryview(self.map)[:flags].cast("Q")  # rank q's flag is word q * 8
        data = np.frombuffer(self.map, dtype=np.uint8, offset=flags)
        self.slots = [[data[(s * self.size + q) * slot_bytes:(s * self.size + q + 1) * slot_bytes]
                       for q in range(self.size)] for s in range(2)]
        self.step = 0

    def close(self) -> None:
        """Unmap (the file is already gone), unless a view is still alive.

        A view outlives the floor where an exception's traceback holds the frame that made it; the
        mapping then goes with the last view, and the exception itself is what the caller sees.
        """
        self.slots = []
        try:
            self.flags.release()
            self.map.close()
        except BufferError:
            pass


def _spin(flags: memoryview, index: int, target: int, polite: bool) -> None:
    if polite:
        while flags[index] < target:
            os.sched_yield()
    else:
        while flags[index] < target:
            pass


def all_reduce_floor(seg: FloorSegment, buf: np.ndarray, iters: int, polite: bool) -> float:
    """Seconds per bare all_reduce (sum) of `buf` over the segment's ranks."""
    flags, me, size = seg.flags, seg.rank, seg.size
    mine, others = me * 8, [q * 8 for q in range(size) if q != me]
    views = [[slot[:buf.nbytes].view(buf.dtype) for slot in seg.slots[s]] for s in range(2)]
    add = np.add
    step = seg.step
    start = time.perf_counter()
    for _ in range(iters):
        for q in others:  # set step % 2 is free once every rank published step - 1
            _spin(flags, q, step, polite)
        slots = views[step & 1]
        slots[me][...] = buf
        step += 1
        flags[mine] = step
        for q in others:
            _spin(flags, q, step, polite)
        add(slots[0], slots[1], out=buf)
        for part in slots[2:]:
            add(buf, part, out=buf)
    elapsed = time.perf_counter() - start
    seg.step = step
    return elapsed / iters


def pingpong_floor(seg: FloorSegment, buf: np.ndarray, iters: int, polite: bool) -> float:
    """Seconds per bare round trip of `buf` between ranks 0 and 1 (a copy into a slot, a flag, a copy out)."""
    flags, me = seg.flags, seg.rank
    peer = 1 - me
    out_slot = seg.slots[0][me][:buf.nbytes]
    in_slot = seg.slots[0][peer][:buf.nbytes]
    step = seg.step
    start = time.perf_counter()
    for _ in range(iters):
        step += 1
        if me == 0:
            out_slot[...] = buf
            flags[me * 8] = step
            _spin(flags, peer * 8, step, polite)
            buf[...] = in_slot
        else:
            _spin(flags, peer * 8, step, polite)
            buf[...] = in_slot
            out_slot[...] = buf
            flags[me * 8] = step
    elapsed = time.perf_counter() - start
    seg.step = step
    return elapsed / iters


def measure_floor(comm: Any, kind: str, buf: np.ndarray, iters: int, seg: FloorSegment) -> float:
    """The floor of one call of `kind` ("all_reduce" or "p2p") on this rank; the max over ranks on every rank.

    Both ranks enter at a barrier; a short warm-up comes first. Returns seconds per call.
    """
    polite = comm.size > _cores()
    fn = all_reduce_floor if kind == "all_reduce" else pingpong_floor
    flat = buf.reshape(-1)
    comm.barrier()
    fn(seg, flat, max(1, iters // 10), polite)
    comm.barrier()
    seconds = fn(seg, flat, iters, polite)
    return float(comm.all_reduce(np.array([seconds]), "max")[0])


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
