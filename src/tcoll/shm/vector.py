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
from ..ops import Op
from .address import PIECE_BYTES, SLOT_BYTES
from .arena import KERNEL_DTYPES, KERNEL_OPS, ZERO_COPY_BYTES, Arena, kernel_module
from . import express
from .express import NOTHING
from .bridge import combine_all, copy_bytes, kernel_codes, may_fail, run_phases
from .large import (all_reduce_in_place, in_place_bytes, copy_in_but_own_part, copy_other_parts, own_part,
                    reduce_large, reduce_own_part)

DONE, PUBLISHED, REDUCED = ((kernel_module.DONE, kernel_module.PUBLISHED, kernel_module.REDUCED)
                            if kernel_module is not None else (2, 1, 3))

__all__ = ["ONE_STEP_LIMITS", "ONE_STEP_LIMITS_SHARED", "one_step", "one_step_limit", "set_one_step_limit", "all_reduce", "reduce",
           "broadcast", "barrier"]

# An all_reduce/reduce up to this many bytes runs in one step, every rank reducing the whole vector from
# every slot, by the number of ranks on the host; larger, in three steps where each rank reduces 1/p. The
# one step reads p vectors where the three read about one, but synchronises once and writes the result
# straight into the caller's buffer, so its limit falls as ranks grow. Measured with
# benchmarks/shm_thresholds.py (docs/performance.md): with a core per rank on the 16-core Xeon (4-16 ranks;
# 2 ranks on the 2-core Xeon, where the three steps in C now win from 8 KiB: 3.2 against 3.6-3.7 us); with
# more ranks than cores on the 2-core Xeon, where each synchronisation may wait for a rank to be scheduled,
# and one step wins far longer. A count between two entries takes the nearer one (by ratio).
ONE_STEP_LIMITS = {2: 4 << 10, 4: 2 << 10, 8: 1 << 10, 16: 1 << 10}
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
        reduce_large(arena, _raw(buf), buf.dtype, op, root)


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
    if may_fail(op):  # the others hear of it in this call, as in the steps of _reduce_split and reduce_large
        arena.publish(arena.skip())
        arena.wait_all(step + 1)


def _reduce_split(arena: Arena, buf: np.ndarray, op: Op, root: int | None) -> None:
    """A call that fits a slot, in three steps: write all but this rank's own 1/p into its slot, publish;
    reduce this rank's 1/p over every rank's input (its own read in place from its buffer) into its own
    part of its slot and of its buffer, publish; copy the other ranks' parts out, publish (done reading).

    Each rank reduces 1/p of the data, and no byte of its own part is copied in or out. The C kernel
    runs the steps when it is built and takes the dtype and op; where it stops (a late peer, a
    descriptor that differs, a peer that lent), Python goes on.

    An all_reduce of in_place_bytes or more lends a buffer that lies in shared memory (comm.empty)
    instead of copying it in: if every rank did, the call goes on in place after its first step
    (all_reduce_in_place); else the others read a lender's input in its buffer.
    """
    want = root is None or arena.rank == root
    raw = _raw(buf)
    lent = None if arena.pending or root is not None or raw.nbytes < in_place_bytes(arena) else \
        arena.lend(raw, raw.nbytes)
    codes = kernel_codes(arena, buf.dtype, op) if lent is None else None
    state = 0 if codes is None else arena.run_split(buf, *codes, want)  # 0: kernel_module.NOT_STARTED
    if state == DONE:
        return
    a, b = own_part(arena, raw.nbytes, buf.dtype)
    if not state:
        step = arena.first_step(lent)
        if lent is None:
            copy_in_but_own_part(arena, arena.slot(arena.rank, step), raw, (a, b))
        else:
            arena.writable = True  # an all_reduce in place may write into it (all_reduce_in_place)
        arena.publish(step)
    if state != REDUCED:
        arena.agree(arena.first)
        if root is None and arena.all_lent(arena.first):
            all_reduce_in_place(arena, raw, buf.dtype, op, arena.first)
            return
        sources = [None if q == arena.rank else arena.peer_buffer(arena.first, q) for q in range(arena.size)]
        reduce_own_part(arena, op, raw, buf.dtype, arena.first, arena.first, 0, (a, b), want, sources)
        arena.publish(arena.skip())
    if want or may_fail(op):
        arena.wait_all(arena.first + 1)
    if want:
        copy_other_parts(arena, raw, buf.dtype, 0, raw.nbytes, arena.first)
    arena.publish(arena.skip())


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
    run_phases(_BroadcastPieces(arena, raw, root, ref))
    arena.finish_lending(total, ref is not None)


class _BroadcastPieces:
    """A broadcast in slot-sized pieces, as phases (two per piece, as the kernel's streamed ones in pieces.h).

    0: claim (root) and write the piece (root), or publish (done with the piece before); 1: the check of the
    first step, and the copy out of root's slot (the others). The kernel runs as many as it can where the call
    is larger than a slot and root did not lend.
    """

    def __init__(self, arena: Arena, raw: np.ndarray, root: int, ref: Any) -> None:
        self.arena, self.raw, self.root, self.ref = arena, raw, root, ref
        self.phases = 2 * max(1, -(-raw.nbytes // arena.slot_bytes))
        self.first = arena.step
        self.kernel = ref is None and arena.kernel is not None and raw.nbytes > arena.slot_bytes  # (only root lends)

    def run_kernel(self, done: int) -> int:
        """The phases from `done` on in the kernel, as far as it goes; how many are done (`done`: no kernel)."""
        if not self.kernel:
            return done
        arena = self.arena
        done = arena.kernel.run_broadcast_pieces(self.raw, self.root, self.first, arena.stamp, arena.sequence,
                                                 arena.kernel_spin_ns, arena.kernel_yields, done)
        arena.first, arena.step = self.first, self.first + (done + 1) // 2
        return done

    def run_phase(self, done: int) -> bool:
        """Phase `done` in Python; True: root lent its buffer, read whole (over but for finish_lending)."""
        arena, raw, root, (index, phase) = self.arena, self.raw, self.root, divmod(done, 2)
        me, lo = arena.rank, index * arena.slot_bytes
        hi = min(raw.nbytes, lo + arena.slot_bytes)
        if phase == 0:
            step = arena.first_step(self.ref) if index == 0 else arena.claim() if me == root else arena.skip()
            if me == root and self.ref is None:
                copy_bytes(arena, arena.slot(me, step)[:hi - lo], raw[lo:hi])
            arena.publish(step)
            return False
        step = self.first + index
        if index == 0:
            arena.agree(step)
            source = arena.peer_buffer(step, root) if me != root else None
            if source is not None:
                copy_bytes(arena, raw, source)
            if self.ref is not None or source is not None:
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

