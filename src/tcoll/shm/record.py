"""The exact schedule of a shared-memory direct algorithm: run it on a recording stand-in for the Arena.

`record_direct` runs one direct algorithm (tcoll.shm.vector, blocks, prefix)
for every rank on a `RecordingArena`: the same interface as `Arena`
(first_step/agree, claim/skip/publish, the waits, slot and typed_slots), but
its slots are `SlotView`s that hold no memory. Writing into one
(`slot[a:b] = x`) notes a write; NumPy reading one (`raw[a:b] = slot[c:d]`,
through `__array__`) or a reduction taking it as an operand notes a read,
and no byte moves. The result is a `tcoll.algos.record.Schedule` whose
`accesses` say, per arena step and rank, whose slot each rank copied how many
bytes into or out of, and whose `reductions` what each rank combined.

Nothing is shared between the ranks while they run: no data moves, so a wait
has nothing to wait for, and the ranks run one after another, each to its
end. What a wait would have ensured is checked afterwards instead: every
byte a rank reads from a slot was written in that slot's step, by ranks
whose publication of that step the reader waited for, and no rank writes a
step's slot after publishing the step, but its own slot of the call's first
step (a reduction's part rewritten in place): a rank that reads such bytes
must have waited for the writer's next publication. A schedule that breaks
this is a RuntimeError, so the recorder also tests the algorithms'
synchronisation.
No buffer is lent (the stand-in has no heap): the schedule is that of buffers
outside shared memory, which go through the slots; a buffer from
`Communicator.empty` is read in place instead, and the calls large enough to
lend take their closing step all the same (an all_reduce whose every rank lent
goes in place instead, tcoll.shm.large.all_reduce_in_place: not recorded). Nor
is anything read by single copies (the stand-in's single_copy is False): an
all_gather or all_to_all of 2 MiB or more is recorded on the slots, as with
TCOLL_SHM_SINGLE_COPY=off.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..algos.record import Reduction, Schedule, SlotAccess, call_arguments
from ..algos.registry import lookup
from ..ops import Op, as_op
from .address import agreed_piece, agreed_slot
from .arena import ZERO_COPY_BYTES
from .vector import one_step_limit

__all__ = ["RecordingArena", "SlotView", "record_direct", "HEADER_BYTES"]

HEADER_BYTES = 256  # a description (all_to_allv's before its counts; a scatter's): tcoll.comm.describe.META_BYTES


class SlotView:
    """Bytes [lo, hi) of one rank's slot of one step, seen as `dtype`; holds no memory."""

    def __init__(self, arena: RecordingArena, owner: int, step: int, lo: int, hi: int, dtype: Any) -> None:
        self.arena, self.owner, self.step = arena, owner, step
        self.lo, self.hi, self.dtype = lo, hi, np.dtype(dtype)

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __len__(self) -> int:
        return self.size

    def view(self, dtype: Any) -> SlotView:
        return SlotView(self.arena, self.owner, self.step, self.lo, self.hi, dtype)

    def __getitem__(self, key: Any) -> SlotView:
        if key is Ellipsis:
            return self
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError(f"a slot is cut with plain slices, not {key!r}")
        start, stop, _ = key.indices(self.size)
        item = self.dtype.itemsize
        return SlotView(self.arena, self.owner, self.step, self.lo + start * item,
                        self.lo + max(start, stop) * item, self.dtype)

    def __setitem__(self, key: Any, value: Any) -> None:
        part = self[key]
        given = value.nbytes if isinstance(value, SlotView) else np.asarray(value).nbytes
        if given != part.nbytes:
            raise RuntimeError(f"rank {self.arena.rank} copies {given} B into {part.nbytes} B of a slot")
        if isinstance(value, SlotView):
            value.note(write=False)
        part.note(write=True)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.note(write=False)
        return np.zeros(self.size, dtype=dtype or self.dtype)

    def note(self, write: bool, combine: bool = False) -> None:
        """Record that the running rank copies these bytes into (write) or out of this slot."""
        self.arena.noted(self, write, combine)


class RecordingArena:
    """The Arena interface (tcoll.shm.arena.Arena) for one rank of a recording: waits return at once.

    Attributes:
        rank, size, slot_bytes, piece_bytes, step, first, heap (None: nothing is lent), kernel (None), pending (0),
            oversubscribed (False), as on Arena.
        seen: per rank, the highest step this rank waited for it to publish (-1: none).
        published: the steps this rank published, so far.
    """

    def __init__(self, schedule: Schedule, rank: int, slot_bytes: int) -> None:
        self.schedule = schedule
        self.rank, self.size, self.slot_bytes = rank, schedule.size, slot_bytes
        self.one_step_bytes = one_step_limit(self.size)  # as rank 0 of a real arena hands it out
        self.piece_bytes = agreed_piece(slot_bytes)
        self.step = self.first = 0
        self.heap = None
        self.single_copy = self.reduce_by_single_copy = False  # (nothing is read by single copies either)
        self.kernel = None  # the schedule is the one the Python steps (which the C kernel mirrors) take
        self.pending = 0  # (no express call left a kernel state)
        self.oversubscribed = False
        self.timeout = 0.0
        self.seen = [-1] * self.size
        self.published = 0
        self.reads: list[tuple[SlotView, tuple[int, ...]]] = []  # with what this rank had seen: checked later
        self.writes: list[tuple[SlotView, int]] = []  # with the step whose publication makes them readable

    def noted(self, view: SlotView, write: bool, combine: bool) -> None:
        if write and view.step < self.published and (view.owner != self.rank or view.step != self.first):
            raise RuntimeError(f"rank {self.rank} writes a slot of step {view.step} after publishing it")
        self.schedule.accesses.append(SlotAccess(view.step, self.rank, view.owner, view.nbytes, write, combine))
        if write:  # its own slot of a step it published: readable once it publishes the next one
            self.writes.append((view, max(view.step, self.published)))
        else:
            self.reads.append((view, tuple(self.seen)))

    def slot(self, rank: int, step: int) -> SlotView:
        return SlotView(self, rank, step, 0, self.slot_bytes, np.uint8)

    def typed_slots(self, step: int, dtype: np.dtype, nbytes: int) -> list[SlotView]:
        return [SlotView(self, q, step, 0, nbytes, dtype) for q in range(self.size)]

    def claim(self) -> int:
        step = self.skip()
        if step >= 1:
            self._saw(None, step - 1)
        return step

    def skip(self) -> int:
        step = self.step
        self.step += 1
        return step

    def publish(self, step: int) -> None:
        self.published = step + 1
        self.seen[self.rank] = step

    def wait_all(self, step: int) -> None:
        self._saw(None, step)

    def wait_rank(self, rank: int, step: int) -> None:
        self._saw(rank, step)

    def _saw(self, rank: int | None, step: int) -> None:
        for q in range(self.size) if rank is None else [rank]:
            self.seen[q] = max(self.seen[q], step)

    def begin(self, stamp: int, sequence: int, label: str) -> None:
        pass

    def first_step(self, heap_ref: tuple[int, int, int] | None = None) -> int:
        self.first = self.claim()
        return self.first

    def agree(self, step: int) -> None:
        self.wait_all(step)

    def peer_buffer(self, step: int, rank: int) -> None:
        return None

    def lend(self, raw: np.ndarray, total: int, anywhere: bool = False) -> None:
        return None

    def all_lent(self, step: int, mapped: bool = False) -> bool:
        return False

    def finish_lending(self, total: int, lent: bool) -> None:
        if total >= ZERO_COPY_BYTES:  # as Arena: every rank takes the closing step of a large call
            self.publish(self.skip())

    def check_usable(self) -> None:
        pass


class _Op:
    """An op whose combines note their slot operands and outputs and a Reduction each, computing nothing."""

    def __init__(self, op: Op, arena: RecordingArena) -> None:
        self._op, self._arena = op, arena

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def combine_all(self, parts: list[Any], out: Any) -> None:
        for part in parts:
            if isinstance(part, SlotView):
                part.note(write=False, combine=True)
        if isinstance(out, SlotView):
            out.note(write=True, combine=True)
        step = max(0, self._arena.step - 1)
        self._arena.schedule.reductions.extend(Reduction(step, self._arena.rank, out.nbytes) for _ in parts[1:])

    def combine(self, lower: Any, higher: Any, out: Any) -> None:
        self.combine_all([lower, higher], out)

    def finish(self, result: np.ndarray, size: int) -> None:
        pass


def _all_to_allv_arguments(rank: int, size: int, count: int, dtype: np.dtype) -> tuple[tuple[Any, ...], int]:
    """all_to_allv with `count` elements from every rank to every rank; the header says nothing the recording reads."""
    block = count * dtype.itemsize
    out = np.empty(block * size, dtype=np.uint8)

    def arrived(table: np.ndarray) -> tuple[np.ndarray, list[int], int]:
        return out, [0 if q == rank else block for q in range(size)], block

    header = np.zeros(HEADER_BYTES + 8 * size, dtype=np.uint8)  # a description and the counts, as the communicator's
    blocks = [np.empty(block, dtype=np.uint8) for _ in range(size)]
    return (header, blocks, arrived), block * size


def _scatter_arguments(rank: int, size: int, count: int, dtype: np.dtype, root: int) -> tuple[tuple[Any, ...], int]:
    """scatter_described of `count` elements a chunk: root's description says nothing the recording reads."""
    block = count * dtype.itemsize
    if rank == root:
        return (np.empty(block * size, dtype=np.uint8), np.zeros(HEADER_BYTES, dtype=np.uint8), None, root,
                None), block
    out = np.empty(block, dtype=np.uint8)
    return (None, None, lambda header: out, root, None), block


def record_direct(collective: str, algorithm: str, size: int, count: int = 1, *, dtype: Any = np.float32,
                  op: str | Op = "sum", root: int = 0, slot_bytes: int = 1 << 20) -> Schedule:
    """Run direct `algorithm` of `collective` on `size` recording arenas and return its checked schedule.

    Args:
        collective, algorithm: a registered direct (shared-memory) algorithm.
        size: ranks.
        count: elements per rank (per block for the block collectives and all_to_allv).
        dtype: the element type.
        op: the reduce op (only its properties matter).
        root: the root of rooted collectives.
        slot_bytes: the TCOLL_SHM_SLOT setting (rounded as the communicator does).

    Raises:
        ValueError: not a direct algorithm, or an unknown name.
        RuntimeError: a rank reads bytes nobody wrote in that step, reads without waiting for their
            writer, or writes a step it has already published.
    """
    info = lookup(collective, algorithm)
    if not info.direct:
        raise ValueError(f"{collective} {algorithm} sends messages: tcoll.algos.record.record records it")
    dtype = np.dtype(dtype)
    schedule = Schedule(collective, algorithm, size, 0)
    arenas = [RecordingArena(schedule, rank, agreed_slot(slot_bytes, size)) for rank in range(size)]
    for rank, arena in enumerate(arenas):
        if collective == "all_to_allv":
            args, schedule.nbytes = _all_to_allv_arguments(rank, size, count, dtype)
        elif collective == "scatter_described":
            args, schedule.nbytes = _scatter_arguments(rank, size, count, dtype, root)
        else:
            args, bases, schedule.nbytes = call_arguments(collective, rank, size, count, dtype, _Op(as_op(op), arena),
                                                          root)
            if collective == "all_gather":
                args = (*args, np.empty(count, dtype=dtype))  # the caller's own block, as the dispatcher stages it
        info.run(arena, *args)
    schedule.arena_steps = max(arena.step for arena in arenas)
    _check(arenas)
    return schedule


def _check(arenas: list[RecordingArena]) -> None:
    """Raise RuntimeError unless every read byte was written in its step by writers the reader waited for."""
    written: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for arena in arenas:
        for view, readable in arena.writes:
            written.setdefault((view.owner, view.step), []).append((view.lo, view.hi, arena.rank, readable))
    for arena in arenas:
        for view, seen in arena.reads:
            at = view.lo
            for lo, hi, writer, readable in sorted(written.get((view.owner, view.step), [])):
                if hi <= view.lo or lo >= view.hi:
                    continue
                if lo > at:
                    break
                if writer != arena.rank and seen[writer] < readable:
                    raise RuntimeError(f"rank {arena.rank} reads step {view.step} of rank {view.owner}'s slot "
                                       f"before rank {writer} published it")
                at = max(at, hi)
            if at < view.hi:
                raise RuntimeError(f"rank {arena.rank} reads bytes {at}..{view.hi} of rank {view.owner}'s slot "
                                   f"in step {view.step}, which no rank wrote there")
