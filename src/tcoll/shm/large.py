"""Shared-memory all_reduce and reduce larger than a slot (tcoll.shm.vector hands them here), and the steps
of a rank's own part that the three-step path of a call within a slot shares with them.

A plain array goes in pieces (the arena's piece_bytes), two arena steps each: write all but this rank's own
part of the piece into its slot, publish; reduce that part over every rank's input into its slot of the next
step (and its buffer), publish; copy the others' parts out. The C kernel runs the pieces in one call
(src/tcoll/shm/pieces.h); Python takes any phase where it stops. Where every rank lent its buffer
(comm.empty), the call goes on in place instead, and no byte goes through a slot.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algos.topology import part_bounds
from ..ops import Op
from .arena import Arena
from .bridge import copy_bytes, kernel_codes, may_fail, reduce_into, run_phases

__all__ = ["own_part", "copy_in_but_own_part", "reduce_own_part", "copy_other_parts", "reduce_large",
           "all_reduce_in_place", "in_place_bytes", "IN_PLACE_BYTES", "IN_PLACE_BYTES_SHARED"]

# An all_reduce that fits a slot lends its buffer from this size, and goes on in place if every rank did; below it
# the slots' three steps in C are faster than the in-place path's Python (2-core Xeon, 2 ranks: 256 KiB ties,
# 512 KiB-1 MiB win 1.8-2.6x). Where ranks outnumber cores, from the larger size: 3 and 5 ranks on 2 cores ran
# 512 KiB-1 MiB 1.2-1.8x slower in place (4, 6 and 8 ran faster), 2 MiB faster at every count (docs/performance.md).
IN_PLACE_BYTES = 512 << 10
IN_PLACE_BYTES_SHARED = 2 << 20


def in_place_bytes(arena: Arena) -> int:
    """From how many bytes an all_reduce that fits a slot lends its buffer (IN_PLACE_BYTES, or _SHARED)."""
    return IN_PLACE_BYTES_SHARED if arena.oversubscribed else IN_PLACE_BYTES


def own_part(arena: Arena, nbytes: int, dtype: np.dtype) -> tuple[int, int]:
    """Byte bounds of this rank's 1/p of `nbytes` of `dtype` (part_bounds, in bytes)."""
    first, last = part_bounds(nbytes // dtype.itemsize, arena.size, arena.rank)
    return first * dtype.itemsize, last * dtype.itemsize


def copy_in_but_own_part(arena: Arena, slot: np.ndarray, piece: np.ndarray, part: tuple[int, int]) -> None:
    """Copy the piece into the slot but for bytes [a, b), this rank's own part (it reads those in place)."""
    a, b = part
    if a:
        copy_bytes(arena, slot[:a], piece[:a])
    if b < piece.nbytes:
        copy_bytes(arena, slot[b:piece.nbytes], piece[b:])


def reduce_own_part(arena: Arena, op: Op, raw: np.ndarray, dtype: np.dtype, step: int, into_step: int, lo: int,
                     part: tuple[int, int], want: bool, sources: list[np.ndarray | None] | None = None) -> None:
    """This rank's part [a, b) of the piece at raw[lo:], reduced in rank order over every rank's input (the
    others' slots of `step`, or their lent buffers in `sources`; this rank's own input read in place from
    raw) into its own slot of `into_step` at that part, and into raw there too if it wants the result."""
    a, b = part
    parts = [(raw[lo + a:lo + b] if q == arena.rank else
              arena.slot(q, step)[a:b] if sources is None or sources[q] is None else
              sources[q][lo + a:lo + b]).view(dtype) for q in range(arena.size)]
    outs = [arena.slot(arena.rank, into_step)[a:b].view(dtype)]
    if want:
        outs.append(raw[lo + a:lo + b].view(dtype))
    reduce_into(arena, op, parts, outs)


def copy_other_parts(arena: Arena, raw: np.ndarray, dtype: np.dtype, lo: int, hi: int, step: int) -> None:
    """The other ranks' reduced parts of the piece raw[lo:hi], from their slots of `step`, into raw."""
    count = (hi - lo) // dtype.itemsize
    for q in range(arena.size):
        if q != arena.rank:
            first, last = part_bounds(count, arena.size, q)
            a, b = first * dtype.itemsize, last * dtype.itemsize
            copy_bytes(arena, raw[lo + a:lo + b], arena.slot(q, step)[a:b])


def reduce_large(arena: Arena, raw: np.ndarray, dtype: np.dtype, op: Op, root: int | None) -> None:
    """An all_reduce (root None) or reduce of `raw` (the caller's buffer as bytes, of `dtype`) larger than a slot.

    Per piece (arena.piece_bytes): write all but this rank's own part of it, publish; reduce that part over every
    rank's input (its own in place) into this rank's slot of the next step and its buffer, publish; copy
    the other ranks' parts out. A buffer lent in place (comm.empty) is read there, not copied in.

    The C kernel runs the pieces (pieces.h) where it takes the dtype and op and nobody lent; where it stops
    (a wait past its spin, descriptors that differ, a peer that lent), Python takes that phase and calls it
    again for the rest. An all_reduce whose every rank lent its buffer goes on in place after the first step
    instead (all_reduce_in_place): the descriptors say so alike on every rank, and nobody copied anything in.
    """
    lent = arena.lend(raw, raw.nbytes, anywhere=root is None and arena.reduce_by_single_copy)
    run_phases(_Pieces(arena, raw, dtype, op, root, lent))


class _Pieces:
    """One large all_reduce / reduce in pieces of arena.piece_bytes, as phases (three per piece, as pieces.h's).

    0: write the input and publish; 1: reduce this rank's part into its slot of the result step and publish;
    2: copy the other ranks' parts out. Python runs any phase; the kernel runs as many as it can from one on.
    """

    def __init__(self, arena: Arena, raw: np.ndarray, dtype: np.dtype, op: Op, root: int | None,
                 ref: tuple[int, int, int] | None) -> None:
        self.arena, self.raw, self.dtype, self.op, self.root, self.ref = arena, raw, dtype, op, root, ref
        self.total = raw.nbytes
        self.piece = arena.piece_bytes // dtype.itemsize * dtype.itemsize
        self.phases = 3 * -(-self.total // self.piece)
        self.first = arena.step  # the call's first step; piece i's input step is first + 2i, its result's next
        self.wants_result = root is None or arena.rank == root
        self.sources: list[np.ndarray | None] = [None] * arena.size  # lent buffers, read in place
        self.codes = kernel_codes(arena, dtype, op) if ref is None and not may_fail(op) else None

    def run_kernel(self, done: int) -> int:
        """The phases from `done` on in the kernel, as far as it goes; how many are done (`done`: no kernel)."""
        if self.codes is None:
            return done
        arena = self.arena
        done = arena.kernel.run_pieces(self.raw, *self.codes, self.first, arena.stamp, arena.sequence,
                                       arena.kernel_spin_ns, arena.kernel_yields, self.wants_result, self.piece, done)
        index, phase = divmod(done, 3)
        arena.first, arena.step = self.first, self.first + 2 * index + phase
        return done

    def run_phase(self, done: int) -> bool:
        """Phase `done` in Python (after the phases before it); True: the call went on in place and is over."""
        index, phase = divmod(done, 3)
        lo = index * self.piece
        hi = min(self.total, lo + self.piece)
        part = own_part(self.arena, hi - lo, self.dtype)
        if phase == 0:
            self._write_input(index, lo, hi, part)
            return False
        if phase == 1:
            return self._reduce(index, lo, part)
        self._copy_out(index, lo, hi)
        return False

    def _write_input(self, index: int, lo: int, hi: int, part: tuple[int, int]) -> None:
        """Phase 0: claim the piece's input step (the first: describe the call), copy in all but this rank's own
        part (unless lent), publish."""
        arena = self.arena
        step = arena.first_step(self.ref) if index == 0 else arena.claim()
        if index == 0 and self.ref is not None and self.root is None:
            arena.writable = True  # an all_reduce in place may write into it (all_reduce_in_place)
        if self.ref is None:
            copy_in_but_own_part(arena, arena.slot(arena.rank, step), self.raw[lo:hi], part)
        arena.publish(step)

    def _reduce(self, index: int, lo: int, part: tuple[int, int]) -> bool:
        """Phase 1: wait for every rank's input (the first piece: agree, and go on in place if every rank lent,
        returning True; note who lent), reduce this rank's part into its slot of the result step, publish."""
        arena, step = self.arena, self.first + 2 * index
        if index == 0:
            arena.agree(step)
            if self.root is None and arena.all_lent(step):
                all_reduce_in_place(arena, self.raw, self.dtype, self.op, step)
                return True
            self.sources = [None if q == arena.rank else arena.peer_buffer(step, q) for q in range(arena.size)]
            if any(source is not None for source in self.sources):
                self.codes = None  # the kernel reads slots only
        else:
            arena.wait_all(step)
        result = arena.claim()
        reduce_own_part(arena, self.op, self.raw, self.dtype, step, result, lo, part, self.wants_result, self.sources)
        arena.publish(result)
        return False

    def _copy_out(self, index: int, lo: int, hi: int) -> None:
        """Phase 2: once every rank published its part, copy the others' out (if this rank wants the result)."""
        result = self.first + 2 * index + 1
        last = hi == self.total  # a lender waits until nobody reads it; with a user's op, until every part was
        if self.wants_result or (last and (self.ref is not None or may_fail(self.op))):  # reduced (may_fail)
            self.arena.wait_all(result)
        if self.wants_result:
            copy_other_parts(self.arena, self.raw, self.dtype, lo, hi, result)


def all_reduce_in_place(arena: Arena, raw: np.ndarray, dtype: np.dtype, op: Op, step: int) -> None:
    """The rest of an all_reduce whose every rank lent its buffer (`step`, its first, agreed): reduce this
    rank's 1/p over every rank's input, a scratch-sized piece at a time, into its own buffer. Operands in
    rank order. No byte goes through a slot.

    Where every buffer lies in shared memory, each piece of the result is written on into every other
    rank's buffer while it is in this rank's cache, then one step ends the call: once every rank has
    published it, every buffer holds every part and nobody reads or writes another's. This rank's part of
    another's buffer is read (its input) and written (the result) by this rank alone, so nothing overlaps.
    A rank that lent its buffer to such a call and fails it waits, before it raises, until nobody writes into
    its buffer any more (Lending.settle, from the dispatcher).
    Where some rank lent by its address instead (single copies, tcoll.shm.single_copy), which the others
    may read but not write, each rank publishes its part, reads the others' parts from their buffers into
    its own, and waits until nobody reads its own. The descriptors decide, alike on every rank.
    """
    size, me = arena.size, arena.rank
    sources = [None if q == me else arena.peer_source(step, q) for q in range(size)]
    push = arena.all_lent(step, mapped=True)
    _reduce_lent_part(arena, raw, dtype, op, sources, push)
    reduced = arena.skip()
    arena.publish(reduced)
    arena.wait_all(reduced)
    if push:
        return
    count = raw.nbytes // dtype.itemsize
    for q in range(size):
        if q != me:
            first, last = part_bounds(count, size, q)
            arena.read_peer(q, sources[q], first * dtype.itemsize, raw[first * dtype.itemsize:last * dtype.itemsize])
    done = arena.skip()
    arena.publish(done)
    arena.wait_all(done)  # the others may still read this rank's part


def _reduce_lent_part(arena: Arena, raw: np.ndarray, dtype: np.dtype, op: Op, sources: list[Any],
                      push: bool) -> None:
    """This rank's 1/p of every rank's lent input (`sources`: peer_source, None for this rank's own `raw`),
    reduced in rank order into `raw`, a scratch-sized piece at a time; with `push`, each piece of the
    result also copied into every other rank's buffer (then in this rank's cache: the others' copies out
    of this rank's buffer would read it from here)."""
    size, me = arena.size, arena.rank
    a, b = own_part(arena, raw.nbytes, dtype)
    scratch = arena.scratch()
    # p pieces of scratch: the p - 1 others' inputs (read by single copies) and the partial result
    piece = scratch.nbytes // size // 4096 * 4096 // dtype.itemsize * dtype.itemsize  # at least 64 KiB (a tiny
    # slot would make a piece of a few elements, and a Python loop of them)
    for lo in range(a, b, piece):
        hi = min(b, lo + piece)
        parts = [raw[lo:hi] if q == me else _lent_part(arena, q, sources[q], lo, hi, scratch[q * piece:])
                 for q in range(size)]
        _reduce_into_own(arena, op, [part.view(dtype) for part in parts], raw[lo:hi].view(dtype),
                         scratch[me * piece:][:hi - lo].view(dtype))
        if push:
            for q in range(size):
                if q != me:
                    copy_bytes(arena, sources[q][lo:hi], raw[lo:hi])


def _reduce_into_own(arena: Arena, op: Op, parts: list[np.ndarray], own: np.ndarray, scratch: np.ndarray) -> None:
    """own = parts[0] op ... op parts[-1], in rank order, where `own` is this rank's part (one of `parts`).

    The last combination writes straight into `own`: an output may be the very array of either operand of
    one combination (reduce_into), and by then this rank's part has been read. The others before it go into
    `scratch` (cached), which overlaps nothing.
    """
    if len(parts) > 2:
        reduce_into(arena, op, parts[:-1], [scratch])
        parts = [scratch, parts[-1]]
    reduce_into(arena, op, parts, [own])


def _lent_part(arena: Arena, rank: int, source: Any, lo: int, hi: int, scratch: np.ndarray) -> np.ndarray:
    """Bytes [lo, hi) of what `rank` lent: in place if it lies in shared memory, else read into `scratch`."""
    if isinstance(source, np.ndarray):
        return source[lo:hi]
    into = scratch[:hi - lo]
    arena.read_peer(rank, source, lo, into)
    return into
