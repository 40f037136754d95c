"""Shared-memory direct algorithms: every rank reads the others' data straight from the arena.

For ranks on one host, point-to-point algorithms pay a message latency per
step and copy every byte twice (into a ring, out of it). Here each rank
writes its data once into its slot of the communicator's arena
(`tcoll.shm.arena`), publishes the step, and every rank reads what it needs from
all slots at once: an all_reduce is one copy in, a reduction of this rank's
1/p of every input, one copy out, with two synchronisations per slot-sized
piece (so a large message is pipelined through cache-sized steps, and a fast
rank works one step ahead of a slow one). Reductions are NumPy ufuncs with
`out=` straight over the shared memory; nothing is allocated per call.

A rank whose buffer lives in shared memory (`Communicator.empty`) publishes
where it is instead of copying it in: the others read it in place (zero-copy),
and the rank waits at the end until they are done with it.

Source: the shared-memory collectives of MPICH's and Open MPI's "sm"/"xhc"
components and of oneCCL, reduced to a step counter per rank.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..algos.registry import Costs, algorithm
from ..algos.select import ARENA_COPY, ARENA_REDUCE, ARENA_SYNC
from ..algos.topology import part_bounds
from ..ops import Op
from .address import PIECE_BYTES, SLOT_BYTES
from .arena import KERNEL_DTYPES, KERNEL_OPS, ZERO_COPY_BYTES, Arena, kernel_module
from . import express
from .express import NOTHING
from .bridge import combine_all, copy_bytes, kernel_codes, may_fail, reduce_into

DONE, PUBLISHED, REDUCED = ((kernel_module.DONE, kernel_module.PUBLISHED, kernel_module.REDUCED)
                            if kernel_module is not None else (2, 1, 3))

__all__ = ["ONE_STEP_LIMITS", "ONE_STEP_LIMITS_SHARED", "one_step", "one_step_limit", "set_one_step_limit", "all_reduce", "reduce",
           "broadcast", "barrier"]

# An all_reduce/reduce up to this many bytes runs in one step, every rank reducing the whole vector from
# every slot, by the number of ranks on the host; larger, in three steps where each rank reduces 1/p. The
# one step reads p vectors where the three read about one, but synchronises once and writes the result
# straight into the caller's buffer, so its limit falls as ranks grow. Measured with
# benchmarks/shm_thresholds.py (docs/performance.md): with a core per rank on the 16-core Xeon (the 2-core
# Xeon agreed at 2 ranks); with more ranks than cores on the 2-core Xeon, where each synchronisation may
# wait for a rank to be scheduled, and one step wins far longer. A count between two entries takes the
# nearer one (by ratio).
ONE_STEP_LIMITS = {2: 8 << 10, 4: 2 << 10, 8: 1 << 10, 16: 1 << 10}
ONE_STEP_LIMITS_SHARED = {4: 8 << 10, 8: 32 << 10}  # more ranks than cores
_limit_override: int | None = None  # set_one_step_limit (benchmarks only)


def one_step_limit(size: int, oversubscribed: bool = False) -> int:
    """The largest all_reduce/reduce, in bytes, that runs in one step on `size` ranks of a host by default
    (ONE_STEP_LIMITS, or ONE_STEP_LIMITS_SHARED when they outnumber its cores; TCOLL_SHM_ONE_STEP replaces
    it, through rank 0's arena)."""
    table = ONE_STEP_LIMITS_SHARED if oversubscribed else ONE_STEP_LIMITS
    nearest = min(table, key=lambda ranks: abs(math.log(size / ranks)))
    return table[nearest]


def set_one_step_limit(limit: int | None) -> None:
    """Force the one-step limit of every arena of this process (None: each arena's own again).

    For benchmarks/shm_thresholds.py, which measures both sides of it: every rank must set the same
    value before the same call, since ranks that took different steps would read each other's slots
    wrongly (TCOLL_SHM_ONE_STEP, which rank 0's arena hands to all, is the setting for users).
    """
    global _limit_override
    _limit_override = limit
    express.forget_all()  # express calls chose their steps by the old limit


def one_step(nbytes: int, arena: Any) -> bool:
    """Whether an all_reduce/reduce of `nbytes` runs in one step of `arena` (the same on every rank)."""
    limit = arena.one_step_bytes if _limit_override is None else _limit_override
    return nbytes <= arena.slot_bytes and nbytes <= limit


def _raw(arr: np.ndarray) -> np.ndarray:
    return arr.view(np.uint8) if arr.ndim == 1 else arr.reshape(-1).view(np.uint8)


# -- all_reduce and reduce -----------------------------------------------------------------

def _reduce_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    if nbytes <= min(SLOT_BYTES, one_step_limit(size)):
        return ARENA_SYNC + nbytes * ARENA_COPY + (size - 1) * nbytes * ARENA_REDUCE
    # three steps within a slot; larger, per piece: the others' parts in, its own part's result (then out)
    steps = 3 if nbytes <= SLOT_BYTES else 2 * -(-nbytes // PIECE_BYTES)
    return steps * ARENA_SYNC + (2 * size - 1) / size * nbytes * ARENA_COPY + (size - 1) / size * nbytes * ARENA_REDUCE


@algorithm("all_reduce", "shm", cost=_reduce_cost, direct=True)
def all_reduce(arena: Arena, buf: np.ndarray, op: Op) -> None:
    """Shared-memory all_reduce: copy in, each rank reduces its 1/p of every slot, copy out.

    Steps: up to the one-step limit (one_step_limit: by rank count), one step in
    which every rank reduces all slots itself; up to a slot, three steps (write
    all but this rank's own 1/p, publish; reduce its 1/p over every rank's input,
    its own read in place, into its own part of its slot and of its buffer,
    publish; copy the other parts out, publish); larger, the same per piece (the
    arena's piece_bytes: tcoll.shm.address.agreed_piece), the result in this
    rank's slot of the next step, the pieces in the C kernel's loop. Memory traffic per
    rank: (p-1)/p n bytes in, n reduced from p inputs / p, n/p written twice,
    (p-1)/p n bytes out. Operands in rank order.
    """
    if 1 < arena.size and one_step(buf.nbytes, arena):
        _reduce_small(arena, buf, op, None)  # the common small call, one Python call sooner
    else:
        _reduce_direct(arena, buf, op, None)


@algorithm("reduce", "shm", cost=_reduce_cost, direct=True)
def reduce(arena: Arena, buf: np.ndarray, op: Op, root: int) -> None:
    """Shared-memory reduce: as the shm all_reduce, but only root copies the result out.

    Steps: as the shm all_reduce; the ranks other than root go on as soon as
    their share of the reduction is published (after the first step, in which
    every rank checks that every rank makes the same call).
    """
    _reduce_direct(arena, buf, op, root)


def _reduce_direct(arena: Arena, buf: np.ndarray, op: Op, root: int | None) -> None:
    if arena.size == 1:
        return
    if one_step(buf.nbytes, arena):
        _reduce_small(arena, buf, op, root)
    elif buf.nbytes <= arena.slot_bytes:
        _reduce_split(arena, buf, op, root)
    else:
        _reduce_large(arena, buf, op, root)


def _reduce_small(arena: Arena, buf: np.ndarray, op: Op, root: int | None) -> None:
    """One step: every rank writes its vector; each rank that wants the result reduces all slots.

    The C kernel runs the step when it is built and takes the dtype and op;
    where it stops (a late peer, a descriptor that differs), Python goes on.
    """
    want = root is None or arena.rank == root
    if arena.kernel is not None:
        dtype, code = KERNEL_DTYPES.get(buf.dtype), KERNEL_OPS.get(op)
        if dtype is not None and code is not None:
            state = arena.run_small(buf, dtype, code, want)
            if state == DONE:
                return
            if state == PUBLISHED:
                arena.agree(arena.first)
                if want:
                    combine_all(arena, op, arena.typed_slots(arena.first, buf.dtype, buf.nbytes), buf)
                return
    step = arena.first_step()
    slots = arena.typed_slots(step, buf.dtype, buf.nbytes)
    slots[arena.rank][...] = buf
    arena.publish(step)
    arena.agree(step)
    if want:
        combine_all(arena, op, slots, buf)
    if may_fail(op):  # the others hear of it in this call, as in the steps of _reduce_split and _reduce_large
        arena.publish(arena.skip())
        arena.wait_all(step + 1)


def _reduce_split(arena: Arena, buf: np.ndarray, op: Op, root: int | None) -> None:
    """A call that fits a slot, in three steps: write all but this rank's own 1/p into its slot, publish;
    reduce this rank's 1/p over every rank's input (its own read in place from its buffer) into its own
    part of its slot and of its buffer, publish; copy the other ranks' parts out, publish (done reading).

    Each rank reduces 1/p of the data, and no byte of its own part is copied in or out. The C kernel
    runs the steps when it is built and takes the dtype and op; where it stops (a late peer, a
    descriptor that differs), Python goes on.
    """
    want = root is None or arena.rank == root
    codes = kernel_codes(arena, buf.dtype, op)
    state = 0 if codes is None else arena.run_split(buf, *codes, want)  # 0: kernel_module.NOT_STARTED
    if state == DONE:
        return
    raw = _raw(buf)
    a, b = _own_part(arena, raw.nbytes, buf.dtype)
    if not state:
        step = arena.first_step()
        _copy_in_but_own_part(arena, arena.slot(arena.rank, step), raw, (a, b))
        arena.publish(step)
    if state != REDUCED:
        arena.agree(arena.first)
        _reduce_own_part(arena, op, raw, buf.dtype, arena.first, arena.first, 0, (a, b), want)
        arena.publish(arena.skip())
    if want or may_fail(op):
        arena.wait_all(arena.first + 1)
    if want:
        _copy_other_parts(arena, raw, buf.dtype, 0, raw.nbytes, arena.first)
    arena.publish(arena.skip())


def _own_part(arena: Arena, nbytes: int, dtype: np.dtype) -> tuple[int, int]:
    """Byte bounds of this rank's 1/p of `nbytes` of `dtype` (part_bounds, in bytes)."""
    first, last = part_bounds(nbytes // dtype.itemsize, arena.size, arena.rank)
    return first * dtype.itemsize, last * dtype.itemsize


def _copy_in_but_own_part(arena: Arena, slot: np.ndarray, piece: np.ndarray, part: tuple[int, int]) -> None:
    """Copy the piece into the slot but for bytes [a, b), this rank's own part (it reads those in place)."""
    a, b = part
    if a:
        copy_bytes(arena, slot[:a], piece[:a])
    if b < piece.nbytes:
        copy_bytes(arena, slot[b:piece.nbytes], piece[b:])


def _reduce_own_part(arena: Arena, op: Op, raw: np.ndarray, dtype: np.dtype, step: int, into_step: int, lo: int,
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


def _copy_other_parts(arena: Arena, raw: np.ndarray, dtype: np.dtype, lo: int, hi: int, step: int) -> None:
    """The other ranks' reduced parts of the piece raw[lo:hi], from their slots of `step`, into raw."""
    count = (hi - lo) // dtype.itemsize
    for q in range(arena.size):
        if q != arena.rank:
            first, last = part_bounds(count, arena.size, q)
            a, b = first * dtype.itemsize, last * dtype.itemsize
            copy_bytes(arena, raw[lo + a:lo + b], arena.slot(q, step)[a:b])


def _reduce_large(arena: Arena, buf: np.ndarray, op: Op, root: int | None) -> None:
    """Per piece (arena.piece_bytes): write all but this rank's own part of it, publish; reduce that part over every
    rank's input (its own in place) into this rank's slot of the next step and its buffer, publish; copy
    the other ranks' parts out. A buffer lent in place (comm.empty) is read there, not copied in.

    The C kernel runs the pieces (pieces.h) where it takes the dtype and op and nobody lent; where it stops
    (a wait past its spin, descriptors that differ, a peer that lent), Python takes that phase and calls it
    again for the rest. An all_reduce whose every rank lent its buffer goes on in place after the first step
    instead (_all_reduce_in_place): the descriptors say so alike on every rank, and nobody copied anything in.
    """
    raw = _raw(buf)
    call = _Pieces(arena, raw, buf.dtype, op, root, arena.lend(raw, raw.nbytes, anywhere=root is None))
    done = 0
    while done < call.phases:
        done = call.run_kernel(done)
        if done < call.phases:
            if call.run_phase(done):
                return  # went on in place
            done += 1


class _Pieces:
    """One large all_reduce / reduce in pieces of arena.piece_bytes, as phases (three per piece, pieces.h): 0, write
    the input and publish; 1, reduce this rank's part into its slot of the result step and publish; 2, copy
    the other ranks' parts out. Python runs any phase; the kernel runs as many as it can from one on."""

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
        part = _own_part(self.arena, hi - lo, self.dtype)
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
        if self.ref is None:
            _copy_in_but_own_part(arena, arena.slot(arena.rank, step), self.raw[lo:hi], part)
        arena.publish(step)

    def _reduce(self, index: int, lo: int, part: tuple[int, int]) -> bool:
        """Phase 1: wait for every rank's input (the first piece: agree, and go on in place if every rank lent,
        returning True; note who lent), reduce this rank's part into its slot of the result step, publish."""
        arena, step = self.arena, self.first + 2 * index
        if index == 0:
            arena.agree(step)
            if self.root is None and arena.all_lent(step):
                _all_reduce_in_place(arena, self.raw, self.dtype, self.op, step)
                return True
            self.sources = [None if q == arena.rank else arena.peer_buffer(step, q) for q in range(arena.size)]
            if any(source is not None for source in self.sources):
                self.codes = None  # the kernel reads slots only
        else:
            arena.wait_all(step)
        result = arena.claim()
        _reduce_own_part(arena, self.op, self.raw, self.dtype, step, result, lo, part, self.wants_result, self.sources)
        arena.publish(result)
        return False

    def _copy_out(self, index: int, lo: int, hi: int) -> None:
        """Phase 2: once every rank published its part, copy the others' out (if this rank wants the result)."""
        result = self.first + 2 * index + 1
        last = hi == self.total  # a lender waits until nobody reads it; with a user's op, until every part was
        if self.wants_result or (last and (self.ref is not None or may_fail(self.op))):  # reduced (may_fail)
            self.arena.wait_all(result)
        if self.wants_result:
            _copy_other_parts(self.arena, self.raw, self.dtype, lo, hi, result)


def _all_reduce_in_place(arena: Arena, raw: np.ndarray, dtype: np.dtype, op: Op, step: int) -> None:
    """The rest of an all_reduce whose every rank lent its buffer (`step`, its first, agreed), in two more
    steps whatever the size: reduce this rank's 1/p over every rank's input into its own buffer, a
    scratch-sized piece at a time (the others' read in place through the mapping, or by single copies
    into the scratch: tcoll.shm.single_copy), publish; read the other ranks' reduced parts straight from
    their buffers into this one, publish, and wait until nobody reads its own. Operands in rank order.

    No byte goes through a slot: every byte that crosses between ranks is read once where it lies.
    """
    size, me = arena.size, arena.rank
    sources = [None if q == me else arena.peer_source(step, q) for q in range(size)]
    a, b = _own_part(arena, raw.nbytes, dtype)
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
    reduced = arena.skip()
    arena.publish(reduced)
    arena.wait_all(reduced)
    count = raw.nbytes // dtype.itemsize
    for q in range(size):
        if q != me:
            first, last = part_bounds(count, size, q)
            arena.read_peer(q, sources[q], first * dtype.itemsize, raw[first * dtype.itemsize:last * dtype.itemsize])
    done = arena.skip()
    arena.publish(done)
    arena.wait_all(done)  # the others may still read this rank's part


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


# -- broadcast -----------------------------------------------------------------------------

def _broadcast_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return -(-max(nbytes, 1) // (1 << 20)) * ARENA_SYNC + 2 * nbytes * ARENA_COPY


@algorithm("broadcast", "shm", cost=_broadcast_cost, direct=True)
def broadcast(arena: Arena, buf: np.ndarray, root: int) -> None:
    """Shared-memory broadcast: root writes each piece once, every other rank copies it out.

    Steps: per slot-sized piece, root writes it into its slot and publishes;
    the others wait for root and copy it (in the C kernel, chunk by chunk as
    root writes it: pieces.h). The first step is every rank's: all check
    that all make the same call. With root's buffer in shared memory, the
    others copy straight from it (one copy in all).
    """
    if arena.size == 1:
        return
    raw = _raw(buf)
    total = raw.nbytes
    ref = arena.lend(raw, total) if arena.rank == root else None
    if ref is None and arena.kernel is not None and total <= arena.slot_bytes and \
            _broadcast_one_step(arena, raw, root):
        return
    kernel = ref is None and arena.kernel is not None and total > arena.slot_bytes  # (only root lends)
    first, phases, done = arena.step, 2 * max(1, -(-total // arena.slot_bytes)), 0
    while done < phases:
        if kernel:  # the pieces, streamed, as far as the kernel goes (pieces.h)
            done = arena.kernel.run_broadcast_pieces(raw, root, first, arena.stamp, arena.sequence,
                                                     arena.kernel_spin_ns, arena.kernel_yields, done)
            arena.first, arena.step = first, first + (done + 1) // 2
            if done == phases:
                break
        if _broadcast_phase(arena, raw, root, ref, first, done):
            break  # root lent its buffer: the others copied it whole from there
        done += 1
    arena.finish_lending(total, ref is not None)


def _broadcast_phase(arena: Arena, raw: np.ndarray, root: int, ref: Any, first: int, done: int) -> bool:
    """Phase `done` of a broadcast in Python, two per slot-sized piece as the kernel's (pieces.h): 0, claim
    (root) and write the piece (root) or publish (done with the piece before); 1, the check of the first
    step, and the copy out of root's slot (the others). True: root lent its buffer, read whole (the call is
    over but for finish_lending)."""
    index, phase = divmod(done, 2)
    me, piece = arena.rank, arena.slot_bytes
    lo = index * piece
    hi = min(raw.nbytes, lo + piece)
    if phase == 0:
        step = arena.first_step(ref) if index == 0 else arena.claim() if me == root else arena.skip()
        if me == root and ref is None:
            copy_bytes(arena, arena.slot(me, step)[:hi - lo], raw[lo:hi])
        arena.publish(step)
        return False
    step = first + index
    if index == 0:
        arena.agree(step)
        source = arena.peer_buffer(step, root) if me != root else None
        if source is not None:
            copy_bytes(arena, raw, source)
        if ref is not None or source is not None:
            return True
    elif me != root:
        arena.wait_rank(root, step)
    if me != root:
        copy_bytes(arena, raw[lo:hi], arena.slot(root, step)[:hi - lo])
    return False


def _broadcast_one_step(arena: Arena, raw: np.ndarray, root: int) -> bool:
    """A broadcast that fits a slot (root's buffer not lent) in the C kernel's one step, as the steps below take
    it (from 32 KiB streamed: the others copy each chunk as root writes it); whether it ran (False: nothing
    happened, the Python steps run it). Where the kernel stops (a late peer, descriptors that differ, a root
    in Python that lent its buffer), Python goes on: the check, then the copy out of root's slot or buffer."""
    lending = raw.nbytes >= ZERO_COPY_BYTES
    state = arena.run_broadcast(raw, root, lending)
    if state == DONE:
        return True
    if state != PUBLISHED:
        return False
    arena.agree(arena.first)
    if arena.rank != root:
        source = arena.peer_buffer(arena.first, root) if lending else None
        copy_bytes(arena, raw, arena.slot(root, arena.first)[:raw.nbytes] if source is None else source)
    arena.finish_lending(raw.nbytes, False)
    return True


# -- barrier ---------------------------------------------------------------------------------

def _barrier_cost(c: Costs, nbytes: int, size: int) -> float:
    return ARENA_SYNC if size > 1 else 0.0


@algorithm("barrier", "shm", cost=_barrier_cost, direct=True)
def barrier(arena: Arena) -> None:
    """Shared-memory barrier: publish one step, wait until every rank has published it.

    Steps: one counter store per rank, then a poll (or sleep) until all
    counters reach the step; a sleeping rank is woken by the last arrival.
    """
    if arena.size > 1 and not (arena.kernel is not None and _broadcast_one_step(arena, NOTHING, 0)):
        step = arena.first_step()
        arena.publish(step)
        arena.agree(step)

