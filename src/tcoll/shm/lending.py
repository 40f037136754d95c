"""What an Arena does with buffers its ranks lend: zero-copy buffers in shared memory (comm.empty), read in place,
single copies between processes (tcoll.shm.single_copy), and the settling of a failed call that wrote into them.

`Lending` is a part of `tcoll.shm.arena.Arena` (its base class), kept in a module of its own: it works on the
arena's descriptors, counters and doorbells, as the steps do.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..errors import PeerLostError, TcollError, TimeoutError

from . import single_copy

__all__ = ["Lending", "ZERO_COPY_BYTES", "SINGLE_COPY_BYTES", "by_address", "read_lent"]

ZERO_COPY_BYTES = 64 << 10  # calls from this size look for buffers in shared memory
# Words of a rank's descriptors that no call writes: set 0's hold its pid and the address of that word in its
# own memory, set 1's its verdict on single copies (0: not yet, 1: it reads every peer, 2: it cannot) and the
# sequence number of the last call it left, having failed it (leave).
_PID_WORD, _ADDRESS_WORD, _VERDICT_WORD, _CAN, _CANNOT, _QUIT_WORD = 6, 7, 6, 1, 2, 7  # (_CAN, _CANNOT: verdicts)
_SINGLE_COPY_FLAG = 1 << 63  # a descriptor's heap-id word with this bit: the buffer is read by single copies


# From this many bytes in all (each rank's blocks together), an all_gather or all_to_all (tcoll.shm.blocks)
# reads every other rank's blocks where they lie, one kernel copy each (process_vm_readv), where the arena
# reads by single copies (Arena.single_copy): the slots cost each byte two copies. 2-core Xeon, 2 ranks, one
# block read against two copies: 1 MiB 118 / 150 us, 4 MiB 444 / 686, 16 MiB 1722 / 3022. But the path's steps
# run in Python, about 30 us a call more than the slots' C kernel: all_gather and all_to_all of 128-512 KiB
# took 49-94 us against 20-77, 1 MiB tied (184-310 against 186-192), 2 MiB won (342-420 against 437-486)
# (docs/performance.md).
SINGLE_COPY_BYTES = 2 << 20


def by_address(arena: Any, total: int) -> bool:
    """Whether a block collective of `total` bytes reads the others' blocks by single copies (the same answer
    on every rank: the arena's single_copy is agreed, and so is the call's size)."""
    return arena.single_copy and total >= SINGLE_COPY_BYTES


def read_lent(arena: Any, own: np.ndarray, total: int, reads: list[tuple[int, int, np.ndarray]]) -> None:
    """A block collective in one step and a closing one: lend `own` (this rank's blocks, where they lie), agree,
    copy each (rank, offset in what it lent, destination) of `reads` out of the others' buffers, and wait in
    the closing step until every rank has read this one's (finish_lending), so the caller may change it.
    Every rank lends (by_address is the same everywhere; peer_source names a rank that did not: a defect).
    """
    step = arena.first_step(arena.lend(own, total, anywhere=True))
    arena.publish(step)
    arena.agree(step)
    for rank, lo, into in reads:
        arena.read_peer(rank, arena.peer_source(step, rank), lo, into)
    arena.finish_lending(total, True)


class Lending:
    """The lending part of an Arena (see the module docstring): it has no state of its own, and works on the
    Arena's attributes below and its _desc_at, _fail, _ring, skip, publish and wait_all."""

    rank: int
    size: int
    heap: Any
    timeout: float
    slot_bytes: int
    single_copy: bool
    label: str
    sequence: int
    first: int
    writable: bool
    _desc: Any
    _counters: Any
    _segment: Any
    _desc_address: int
    _scratch: np.ndarray | None
    _world: list[int]
    _engine: Any

    def peer_buffer(self, step: int, rank: int) -> np.ndarray | None:
        """The zero-copy buffer (uint8) `rank` described for the call starting at `step`, or None."""
        at = self._desc_at(step, rank)
        heap_id = self._desc[at + 3]
        if not heap_id or self.heap is None:
            return None
        return self.heap.view(self._world[rank], heap_id, self._desc[at + 4], self._desc[at + 5])

    # -- single copies between processes (tcoll.shm.single_copy) -------------------------
    # Decided once, while the arena opens (tcoll.comm.opening), in three moves separated by barriers.

    def write_identity(self, allowed: bool) -> None:
        """Write this rank's pid and the address of that word in its memory (pid 0: it will not read nor lend)."""
        at = self._desc_at(0, self.rank)
        self._desc[at + _PID_WORD] = os.getpid() if allowed and single_copy.available() else 0
        self._desc[at + _ADDRESS_WORD] = self._desc_address + 8 * (at + _PID_WORD)

    def probe_single_copy(self) -> None:
        """Read every other rank's pid word through its memory (single_copy.reads_back); write the verdict."""
        ids = [(int(self._desc[at + _PID_WORD]), int(self._desc[at + _ADDRESS_WORD]))
               for at in (self._desc_at(0, q) for q in range(self.size))]
        verdict = _CAN if single_copy.reads_back(ids, self.rank) else _CANNOT
        self._desc[self._desc_at(1, self.rank) + _VERDICT_WORD] = verdict

    def decide_single_copy(self) -> None:
        """Use single copies if every rank's verdict is yes (every rank reads the same verdicts: the same choice)."""
        self.single_copy = self.size > 1 and all(
            self._desc[self._desc_at(1, q) + _VERDICT_WORD] == _CAN for q in range(self.size))

    def scratch(self) -> np.ndarray:
        """A private buffer (made at first use): p pieces of a slot's share, at least 64 KiB (tcoll.shm.large)."""
        if self._scratch is None:
            self._scratch = np.empty(self.size * max(64 << 10, self.slot_bytes // self.size), dtype=np.uint8)
        return self._scratch

    def all_lent(self, step: int, mapped: bool = False) -> bool:
        """Whether every rank lent its buffer for the call at `step` (`mapped`: all in shared memory). Agreed."""
        flags = [self._desc[self._desc_at(step, q) + 3] for q in range(self.size)]
        return all(flags) and not (mapped and _SINGLE_COPY_FLAG in flags)  # by address: single copies

    def peer_source(self, step: int, rank: int) -> np.ndarray | tuple[int, int]:
        """What `rank` lent for the call starting at `step` (lend): a view of its shared buffer, or
        (pid, address) to read by single copies."""
        at = self._desc_at(step, rank)
        if self._desc[at + 3] != _SINGLE_COPY_FLAG:
            view = self.peer_buffer(step, rank)
            if view is None:
                raise self._fail(TcollError(f"{self.label} #{self.sequence} (shm): rank {rank} lent no buffer"))
            return view
        return int(self._desc[self._desc_at(0, rank) + _PID_WORD]), int(self._desc[at + 4])

    def read_peer(self, rank: int, source: np.ndarray | tuple[int, int], lo: int, into: np.ndarray) -> None:
        """Copy bytes [lo, lo + into.nbytes) of what `rank` lent (peer_source) into `into`.

        Raises:
            PeerLostError: its process is gone (a defect of tcoll's if it is there: TcollError).
        """
        if isinstance(source, np.ndarray):
            np.copyto(into, source[lo:lo + into.nbytes])
            return
        pid, address = source
        try:
            single_copy.read_into(pid, address + lo, into)
        except OSError as exc:
            try:
                self._engine.probe_peers([self._world[rank]])
            except PeerLostError as lost:  # gone: that is the error
                raise self._fail(lost) from None
            raise self._fail(TcollError(f"{self.label} #{self.sequence} (shm): reading rank {rank}'s buffer in "
                                        f"place failed: {exc} (memory the kernel cannot copy from: "
                                        f"TCOLL_SHM_SINGLE_COPY=off moves it through the arena)")) from None

    # -- zero-copy buffers -------------------------------------------------------------

    def lend(self, raw: np.ndarray, total: int, anywhere: bool = False) -> tuple[int, int, int] | None:
        """What the others read of `raw`, if a call of `total` bytes is large enough to lend it: where it lies in
        this rank's shared buffers; else, if `anywhere` and the arena reads by single copies, its address here
        (peer_source tells the two apart); else None (it is copied into the slots)."""
        if total < ZERO_COPY_BYTES:
            return None
        ref = None if self.heap is None else self.heap.locate(raw)
        if ref is None and anywhere and self.single_copy:
            ref = (_SINGLE_COPY_FLAG, raw.__array_interface__["data"][0], raw.nbytes)
        return ref

    def finish_lending(self, total: int, lent: bool) -> None:
        """The closing step of a call that may have read buffers in place: lenders wait for every reader.

        Every rank takes the step when the call is large enough to lend (the
        same decision everywhere); only the lenders wait in it.
        """
        if total < ZERO_COPY_BYTES:
            return
        step = self.skip()
        self.publish(step)
        if lent:
            self.wait_all(step)


    # -- a failed call that may write into the others' buffers --------------------------

    def leave(self, sequence: int) -> None:
        """Say that this rank is out of call `sequence` (it failed here): it writes into no other rank's buffer
        any more, and waits for none (settle). Every failed call says so, whatever ran it."""
        if self._segment is None:  # (closed meanwhile)
            return
        self._desc[self._desc_at(1, self.rank) + _QUIT_WORD] = sequence
        self._ring()

    def settle(self, sequence: int, error: BaseException) -> None:
        """If this rank lent its buffer to call `sequence`, which failed here with `error` and may write into it
        (all_reduce_in_place): wait until no other rank writes into it any more (each published the step after
        the call's first, where its writes end, left the call, or was lost), at most the timeout.

        Otherwise a caller that refills its buffer at once could have a late write of this call land in the
        input of its next call. After a timeout it does not wait again: the ranks it waited for are stuck.
        The words that say who left lie in this arena, which a failed call retires.
        """
        if not self.writable or isinstance(error, TimeoutError) or self._segment is None:
            return
        done = self.first + 2  # a rank's counter once it published the first step's next (its writes are over)
        gone: set[int] = set()

        def writing() -> list[int]:
            return [q for q in range(self.size) if q != self.rank and q not in gone and self._counters[q] < done
                    and self._desc[self._desc_at(1, q) + _QUIT_WORD] != sequence]

        engine = self._engine
        deadline = time.monotonic() + self.timeout
        try:
            while writing() and time.monotonic() < deadline and not engine.closed:
                for q in writing():
                    try:
                        engine.probe_peers([self._world[q]])
                    except PeerLostError:
                        gone.add(q)
                engine.block_unless(lambda: not writing(),
                                    max(0.0, min(engine.settings.liveness_interval, deadline - time.monotonic())))
        except TcollError:  # (the engine failed meanwhile: `error` is what the caller gets)
            return
