"""Shared-memory direct algorithms that move blocks: all_gather, gather, scatter, reduce_scatter, all_to_all.

They follow tcoll.shm.vector: per slot-sized step, the writers copy
their pieces into their slots (or lend their shared buffer, see
`Communicator.empty`) and publish; the readers copy (or reduce) straight
out of the slots. Counts may differ per rank except in all_to_all (all_to_allv has its own).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..algos.registry import Costs, algorithm
from ..algos.select import ARENA_COPY, ARENA_REDUCE, ARENA_SYNC
from ..algos.topology import displacements
from ..ops import Op
from .arena import LENDING_STEPS, ZERO_COPY_BYTES, Arena
from .bridge import combine_all, copy_bytes, kernel_codes, may_fail, run_phases
from .kernel_abi import kernel_module
from .lending import by_address, read_lent

# How far the kernel's one step of a call got (its run_blocks); without the kernel, never started.
NOT_STARTED, PUBLISHED, DONE = ((kernel_module.NOT_STARTED, kernel_module.PUBLISHED, kernel_module.DONE)
                                if kernel_module is not None else (0, 1, 2))

__all__: list[str] = []


def _steps(counts: list[int], per_step: int) -> int:
    """Steps to move blocks of `counts` bytes, `per_step` at a time: at least one, in which the ranks agree."""
    return max(1, -(-max(counts, default=0) // max(per_step, 1)))


def _share(arena: Arena, item: int = 1) -> int:
    """Bytes of each rank's share of a slot: whole items (item 1: data that is only moved, any bytes)."""
    share = arena.slot_bytes // arena.size // item * item
    if share == 0:  # the communicator's choice keeps reductions of such items off the arena
        raise ValueError(f"items of {item} B do not fit the shared-memory slot ({arena.slot_bytes} B shared by "
                         f"{arena.size} ranks); raise TCOLL_SHM_SLOT")
    return share


def _in_kernel(arena: Arena, kind: str, send: np.ndarray, out: np.ndarray | None, nbytes: list[int], one_step: bool,
               root: int = 0, codes: tuple[int, int] = (0, 0)) -> int:
    """A call's one step in the arena's C kernel, where it takes it: every block alike (`nbytes`), one step
    (`one_step`), and this rank's buffer not lent. The kernel lays the slots out as the Python steps do, so
    ranks that take either way pair; a call large enough to lend (ZERO_COPY_BYTES in all, but an all_gather,
    which lends only by its address, read_lent, before it comes here) ends with the lenders' step there too,
    and one another rank lent in goes on in Python.

    Args:
        kind: "ALL_GATHER", "GATHER", "ALL_TO_ALL" or "REDUCE_SCATTER" (the kernel's BLOCKS_* codes).
        send, out: this rank's blocks, and where its result goes (None: a gather's other ranks), as bytes.
        codes: a reduce_scatter's dtype and op codes.

    Returns:
        DONE; PUBLISHED: the step is published, and `agree` and the copies out are the caller's; NOT_STARTED.
    """
    if arena.kernel is None or not one_step or not nbytes or min(nbytes) != max(nbytes):
        return NOT_STARTED
    lending = kind != "ALL_GATHER" and sum(nbytes) >= ZERO_COPY_BYTES
    if lending and arena.lend(send, sum(nbytes)) is not None:  # this rank lends its buffer: the Python steps
        return NOT_STARTED
    code = getattr(kernel_module, "BLOCKS_" + kind)
    return arena.kernel_step("run_blocks", (send, out, code, nbytes[0], root, *codes, lending), (),
                             LENDING_STEPS if lending else None)


def _write_shares(slot: np.ndarray, raw: np.ndarray, nbytes: list[int], disp: list[int], lo: int, share: int,
                  skip: int = -1) -> None:
    """Copy bytes [lo, lo + share) of every block q of `raw` (but `skip`) to share q of `slot`."""
    for q in range(len(nbytes)):
        hi = min(nbytes[q], lo + share)
        if q != skip and hi > lo:
            slot[q * share:q * share + hi - lo] = raw[disp[q] + lo:disp[q] + hi]


def _move_cost(c: Costs, nbytes: int, size: int, copies: float = 2) -> float:
    """Steps, and `copies` times nbytes copied on the longest chain of copies (see tests/shm/test_record_direct.py)."""
    if size == 1:
        return 0.0
    return (-(-max(nbytes, 1) // (1 << 20)) + 1) * ARENA_SYNC + copies * nbytes * ARENA_COPY


def _gather_cost(c: Costs, nbytes: int, size: int) -> float:
    # gather: p-1 ranks write a block each, root copies the p-1 blocks out; scatter the other way round
    return _move_cost(c, nbytes, size, size)


def _all_gather_cost(c: Costs, nbytes: int, size: int) -> float:
    # a rank writes its block, then copies all p blocks out of the slots (its own too: still in cache)
    return _move_cost(c, nbytes, size, size + 1)


def _a2a_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return (-(-max(nbytes, 1) // (1 << 20)) + 1) * ARENA_SYNC + 2 * (size - 1) / size * nbytes * ARENA_COPY


def _rs_cost(c: Costs, nbytes: int, size: int) -> float:
    # every rank copies its whole send buffer in once; the reduction writes its output itself
    return _move_cost(c, nbytes, size, 1) + (size - 1) / size * nbytes * ARENA_REDUCE if size > 1 else 0.0


@algorithm("all_gather", "shm", cost=_all_gather_cost, direct=True)
def all_gather(arena: Arena, out: np.ndarray, counts: list[int], source: np.ndarray | None = None) -> None:
    """Shared-memory all_gather: every rank writes its block once; every rank copies all blocks out.

    Steps: per slot-sized piece of the blocks, write this rank's piece,
    publish, wait for all, copy the pieces into place from the slots (this
    rank's own too when `source`, its block as the caller holds it, is
    given: the piece is still in cache). Blocks in shared memory are not read
    in place: every rank reads every block, and reading it from a slot still
    in cache costs less than a second pass over DRAM.
    """
    size, me, item = arena.size, arena.rank, out.dtype.itemsize
    raw = out.view(np.uint8)
    if size == 1:
        if source is not None:
            out[...] = source.reshape(-1)
        return
    disp = [d * item for d in displacements(counts)]
    nbytes = [n * item for n in counts]
    own = raw[disp[me]:disp[me] + nbytes[me]] if source is None else source.reshape(-1).view(np.uint8)
    if by_address(arena, sum(nbytes)):
        if source is not None:
            copy_bytes(arena, raw[disp[me]:disp[me] + nbytes[me]], own)
        read_lent(arena, own, sum(nbytes), [(q, 0, raw[disp[q]:disp[q] + nbytes[q]]) for q in range(size) if q != me])
        return
    piece = arena.slot_bytes  # bytes: blocks are only moved
    steps = _steps(nbytes, piece)
    state = _in_kernel(arena, "ALL_GATHER", own, raw, nbytes, steps == 1)
    if state == DONE:
        return
    for index in range(steps):
        lo = index * piece
        if state == PUBLISHED:  # the kernel took the first (only) step's part of this rank
            step = arena.first
        else:
            step = arena.first_step() if index == 0 else arena.claim()
            mine = own[lo:lo + piece]
            copy_bytes(arena, arena.slot(me, step)[:mine.nbytes], mine)
            arena.publish(step)
        if index == 0:
            arena.agree(step)
        else:
            arena.wait_all(step)
        for q in range(size):
            hi = min(nbytes[q], lo + piece)
            if hi > lo and (q != me or source is not None):
                copy_bytes(arena, raw[disp[q] + lo:disp[q] + hi], arena.slot(q, step)[:hi - lo])


@algorithm("gather", "shm", cost=_gather_cost, direct=True)
def gather(arena: Arena, send: np.ndarray, out: np.ndarray | None, counts: list[int], root: int) -> None:
    """Shared-memory gather: the others write their blocks into their slots; root copies them out.

    Steps: per slot-sized piece, every rank but root writes and publishes;
    root waits for all and copies. Blocks in shared memory are read in place.
    """
    size, me, item = arena.size, arena.rank, send.dtype.itemsize
    nbytes = [n * item for n in counts]
    total = sum(nbytes)
    if size == 1:
        return
    own = send.view(np.uint8)
    piece = arena.slot_bytes  # bytes: blocks are only moved
    steps = _steps(nbytes, piece)
    state = _in_kernel(arena, "GATHER", own, None if out is None else out.view(np.uint8), nbytes, steps == 1, root)
    if state == DONE:
        return
    if state == PUBLISHED:  # (one step, this rank's buffer not lent: the kernel took this rank's part of it)
        arena.agree(arena.first)
        if me == root:
            assert out is not None
            sources = [None if q == me else arena.peer_buffer(arena.first, q) for q in range(size)]
            _gather_out(arena, out.view(np.uint8), displacements(nbytes), nbytes, 0, piece, arena.first, sources)
        arena.finish_lending(total, False)
        return
    call = _GatherPieces(arena, own, None if out is None else out.view(np.uint8), nbytes, root)
    run_phases(call)
    arena.finish_lending(total, call.ref is not None)


class _GatherPieces:
    """A gather in slot-sized pieces, as phases (two per piece, as the kernel's streamed ones in pieces.h).

    0: claim and write the piece (the others; a lender writes nothing) or publish (root: done with the piece
    before); 1: the check of the first step, and root's copies out (a lent block whole, in the first). The
    kernel runs as many as it can where the blocks are alike and nobody lent.
    """

    def __init__(self, arena: Arena, own: np.ndarray, out: np.ndarray | None, nbytes: list[int], root: int) -> None:
        self.arena, self.own, self.out, self.nbytes, self.root = arena, own, out, nbytes, root
        self.disp = displacements(nbytes)
        self.piece = arena.slot_bytes  # bytes: blocks are only moved
        self.phases = 2 * _steps(nbytes, self.piece)
        self.first = arena.step
        self.ref = arena.lend(own, sum(nbytes)) if arena.rank != root else None  # a lender takes every step too
        self.sources: list[np.ndarray | None] = [None] * arena.size  # root: the lent blocks, read in place
        self.kernel = arena.kernel is not None and self.ref is None and min(nbytes) == max(nbytes)

    def run_kernel(self, done: int) -> int:
        """The phases from `done` on in the kernel, as far as it goes; how many are done (`done`: no kernel)."""
        if not self.kernel:
            return done
        arena = self.arena
        done = arena.kernel.run_gather_pieces(self.own, self.out, self.root, self.first, arena.stamp, arena.sequence,
                                              arena.kernel_spin_ns, arena.kernel_yields, done)
        arena.first, arena.step = self.first, self.first + (done + 1) // 2
        return done

    def run_phase(self, done: int) -> bool:
        """Phase `done` in Python (after the phases before it); never the call's end (False)."""
        arena, (index, phase) = self.arena, divmod(done, 2)
        lo, me = index * self.piece, arena.rank
        if phase == 0:
            if me == self.root:
                step = arena.first_step() if index == 0 else arena.skip()
            else:
                step = arena.first_step(self.ref) if index == 0 else arena.claim()
                if self.ref is None:
                    mine = self.own[lo:lo + self.piece]
                    copy_bytes(arena, arena.slot(me, step)[:mine.nbytes], mine)
            arena.publish(step)
            return False
        step = self.first + index
        if index == 0:
            arena.agree(step)
            if me == self.root:
                self.sources = [None if q == me else arena.peer_buffer(step, q) for q in range(arena.size)]
                self.kernel = self.kernel and not any(source is not None for source in self.sources)
        elif me == self.root:
            for q in range(arena.size):
                if q != me and self.sources[q] is None and self.nbytes[q] > lo:
                    arena.wait_rank(q, step)
        if me == self.root:
            assert self.out is not None
            _gather_out(arena, self.out, self.disp, self.nbytes, lo, self.piece, step, self.sources, index == 0)
        return False


def _gather_out(arena: Arena, raw: np.ndarray, disp: list[int], nbytes: list[int], lo: int, piece: int, step: int,
                sources: list[np.ndarray | None], first: bool = True) -> None:
    """Root of the shm gather, in step `step`: every other rank's piece at `lo` out of its slot into `raw` (or,
    in the first step, its whole lent block)."""
    for q in range(arena.size):
        if q == arena.rank:
            continue
        src = sources[q]
        if src is not None:
            if first:
                copy_bytes(arena, raw[disp[q]:disp[q] + nbytes[q]], src)
            continue
        hi = min(nbytes[q], lo + piece)
        if hi > lo:
            copy_bytes(arena, raw[disp[q] + lo:disp[q] + hi], arena.slot(q, step)[:hi - lo])


@algorithm("scatter", "shm", cost=_gather_cost, direct=True)
def scatter(arena: Arena, send: np.ndarray | None, out: np.ndarray, counts: list[int], root: int) -> None:
    """Shared-memory scatter: root writes every other rank's piece into its slot; each copies its own.

    Steps: per step, root writes a slot-sized share of every block (one
    p-th of its slot per rank) and publishes; rank r waits for root and
    copies its share. A root buffer in shared memory is read in place.
    """
    size, me, item = arena.size, arena.rank, out.dtype.itemsize
    nbytes = [n * item for n in counts]
    total = sum(nbytes)
    if size == 1:
        return
    share = _share(arena)
    disp = displacements(nbytes)
    if me == root:
        assert send is not None
        raw = send.view(np.uint8)
        ref = arena.lend(raw, total)
        for index in range(1 if ref is not None else _steps(nbytes, share)):
            lo = index * share
            step = arena.first_step(ref) if index == 0 else arena.claim()
            if ref is None:
                _write_shares(arena.slot(me, step), raw, nbytes, disp, lo, share, skip=me)
            arena.publish(step)
            if index == 0:
                arena.agree(step)
        arena.finish_lending(total, ref is not None)
        return
    _scatter_receive(arena, out.view(np.uint8), nbytes, disp, share, root)
    arena.finish_lending(total, False)


def _scatter_receive(arena: Arena, raw: np.ndarray, nbytes: list[int], disp: list[int], share: int,
                     root: int) -> None:
    """Not root: copy this rank's block out of root's slot step by step, or out of root's lent buffer."""
    me = arena.rank
    for index in range(_steps(nbytes, share)):
        lo = index * share
        if index == 0:
            step = arena.first_step()
            arena.publish(step)
            arena.agree(step)
            source = arena.peer_buffer(step, root)
            if source is not None:
                copy_bytes(arena, raw, source[disp[me]:disp[me] + nbytes[me]])
                return
        else:
            step = arena.skip()
            arena.publish(step)
            arena.wait_rank(root, step)
        hi = min(nbytes[me], lo + share)
        if hi > lo:
            raw[lo:hi] = arena.slot(root, step)[me * share:me * share + hi - lo]


@algorithm("reduce_scatter", "shm", cost=_rs_cost, direct=True)
def reduce_scatter(arena: Arena, send: np.ndarray, out: np.ndarray, counts: list[int], op: Op) -> None:
    """Shared-memory reduce_scatter: every rank writes a share of every block; rank r reduces block r.

    Steps: per step, each rank writes a slot-sized share of all its blocks
    (one p-th of the slot per block), publishes and waits for all; rank r
    then reduces its block's share from every slot straight into `out`, in
    rank order. A send buffer in shared memory is read in place.
    """
    size, me, dtype = arena.size, arena.rank, send.dtype
    item = dtype.itemsize
    nbytes = [n * item for n in counts]
    total = sum(nbytes)
    if size == 1:
        out[...] = send[:counts[0]]
        return
    raw = send.view(np.uint8)
    share = _share(arena, item)
    out_raw = out.view(np.uint8)
    steps = _steps(nbytes, share)
    codes = None if may_fail(op) else kernel_codes(arena, dtype, op)
    state = NOT_STARTED if codes is None else _in_kernel(arena, "REDUCE_SCATTER", raw, out_raw, nbytes, steps == 1,
                                                         0, codes)
    if state == DONE:
        return
    ref = None if state == PUBLISHED else arena.lend(raw, total)  # (the kernel lends nothing)
    disp = displacements(nbytes)
    sources: list[np.ndarray | None] = []
    for index in range(steps):
        lo = index * share
        if state == PUBLISHED:  # the kernel took this rank's part of the first (only) step
            step = arena.first
        else:
            step = arena.first_step(ref) if index == 0 else arena.claim()
            if ref is None:
                _write_shares(arena.slot(me, step), raw, nbytes, disp, lo, share)
            arena.publish(step)
        if index != 0:
            arena.wait_all(step)
        else:
            arena.agree(step)
            sources = [raw if (q == me and ref is not None) else (None if q == me else arena.peer_buffer(step, q))
                       for q in range(size)]
        hi = min(nbytes[me], lo + share)
        if hi > lo:
            at, end = me * share, me * share + hi - lo
            parts = [(arena.slot(q, step)[at:end] if src is None else src[disp[me] + lo:disp[me] + hi]).view(dtype)
                     for q, src in enumerate(sources)]
            combine_all(arena, op, parts, out_raw[lo:hi].view(dtype))
    arena.finish_lending(total, ref is not None)


@algorithm("all_to_all", "shm", cost=_a2a_cost, uneven=False, direct=True)
def all_to_all(arena: Arena, send: np.ndarray, out: np.ndarray, send_counts: list[int],
               recv_counts: list[int]) -> None:
    """Shared-memory all_to_all: each rank writes a share of every block; rank r copies block r of all.

    Steps: per step, every rank writes a slot-sized share of the blocks it
    sends (one p-th of its slot per destination), publishes, waits for all,
    and copies its own share out of every slot. Equal counts only.
    """
    size, me, item = arena.size, arena.rank, send.dtype.itemsize
    block = send_counts[0] * item
    total = block * size
    if size == 1:
        return
    raw, out_raw = send.view(np.uint8), out.view(np.uint8)
    if by_address(arena, total):
        reads = [(q, me * block, out_raw[q * block:(q + 1) * block]) for q in range(size) if q != me]
        read_lent(arena, raw, total, reads)
        return
    share = _share(arena)
    steps = _steps([block], share)
    state = _in_kernel(arena, "ALL_TO_ALL", raw, out_raw, [block] * size, steps == 1)
    if state == DONE:
        return
    ref = None if state == PUBLISHED else arena.lend(raw, total)  # (the kernel lends nothing)
    sources: list[np.ndarray | None] = []
    for index in range(steps):
        lo = index * share
        hi = min(block, lo + share)
        if state == PUBLISHED:  # the kernel took this rank's part of the first (only) step
            step = arena.first
        else:
            step = arena.first_step(ref) if index == 0 else arena.claim()
            if ref is None:
                slot = arena.slot(me, step)
                for q in range(size):
                    if q != me:
                        slot[q * share:q * share + hi - lo] = raw[q * block + lo:q * block + hi]
            arena.publish(step)
        if index != 0:
            arena.wait_all(step)
        else:
            arena.agree(step)
            sources = [None if q == me else arena.peer_buffer(step, q) for q in range(size)]
        for q in range(size):
            if q == me:
                continue
            src = sources[q]
            out_raw[q * block + lo:q * block + hi] = (arena.slot(q, step)[me * share:me * share + hi - lo]
                                                      if src is None else src[me * block + lo:me * block + hi])
    arena.finish_lending(total, ref is not None)


@algorithm("all_to_allv", "shm", cost=_a2a_cost, direct=True)
def all_to_allv(arena: Arena, header: np.ndarray, blocks: list[np.ndarray],
                arrived: Callable[[np.ndarray], tuple[np.ndarray, list[int], int]]) -> None:
    """Shared-memory all_to_allv in one go: the counts travel in the first step, with the data.

    Steps: in the first step every rank puts its header (its description and
    counts) at the head of its slot, and after it the first share of each
    block it sends (`blocks[d]`, flat bytes, for rank d); once all have
    published, each reads every header, learns the whole count matrix (so
    how many steps the widest block takes, alike on every rank) and where
    its output goes (`arrived` returns the output bytes, the bytes from each
    rank, and the widest block), and copies its shares out. Further steps
    move the rest with full shares, as all_to_all does. One synchronisation
    fewer than learning the counts first.
    """
    size, me, width = arena.size, arena.rank, header.size
    if size == 1:
        arrived(header)
        return
    share = arena.slot_bytes // size
    first = (arena.slot_bytes - width) // size  # the first step's shares: the headers come before them
    if first <= 0:
        raise ValueError(f"all_to_allv: the shared-memory slot ({arena.slot_bytes} B) cannot hold the counts of "
                         f"{size} ranks; raise TCOLL_SHM_SLOT")
    step = arena.first_step()
    slot = arena.slot(me, step)
    slot[:width] = header
    _put_shares(slot, width, first, blocks, 0, me)
    arena.publish(step)
    arena.agree(step)
    out, recv_bytes, widest = arrived(np.concatenate([arena.slot(q, step)[:width] for q in range(size)]))
    recv_at = displacements(recv_bytes)
    lo, base, piece = 0, width, first
    while True:
        for q in range(size):
            hi = min(recv_bytes[q], lo + piece)
            if q != me and hi > lo:
                at = base + me * piece
                out[recv_at[q] + lo:recv_at[q] + hi] = arena.slot(q, step)[at:at + hi - lo]
        lo += piece
        if lo >= widest:
            return
        base, piece = 0, share
        step = arena.claim()
        _put_shares(arena.slot(me, step), 0, share, blocks, lo, me)
        arena.publish(step)
        arena.wait_all(step)


def _put_shares(slot: np.ndarray, base: int, piece: int, blocks: list[np.ndarray], lo: int, skip: int) -> None:
    """Copy bytes [lo, lo + piece) of each block d (but `skip`) to slot[base + d * piece:]."""
    for d, block in enumerate(blocks):
        hi = min(block.size, lo + piece)
        if d != skip and hi > lo:
            slot[base + d * piece:base + d * piece + hi - lo] = block[lo:hi]
