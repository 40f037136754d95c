"""The exact schedule of an algorithm: run it on a recording stand-in for the Team, no data moved.

`record` runs every rank's generator of one algorithm in this process, on a
`RecordingTeam` whose sends and receives only note what they would move. A
send completes at once; a receive completes when its message was sent. Steps
count the chain of messages: a message sent at step t is received at step
t + 1, and a rank resumed by receives continues at the latest of them, so
step t holds what happens in parallel after t message latencies (a ring
all-reduce on p ranks takes 2(p-1) steps). Reductions are noted, not
computed: the buffers the algorithm is given are never read or written.

The result, a `Schedule`, is what `tcoll trace` draws and what the tests
compare with the cost model's message and byte counts (tcoll.algos.traffic).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from typing import Any

import numpy as np

from ..ops import Op, as_op
from .registry import lookup

__all__ = ["Message", "Reduction", "Schedule", "RecordingTeam", "record"]

_NO_CHUNKS = 1 << 62  # chunk_bytes that cuts nothing


@dataclasses.dataclass(frozen=True)
class Message:
    """One point-to-point message of a schedule.

    Attributes:
        step: when it was sent (it arrives at step + 1).
        src, dst: team ranks.
        nbytes: its size.
        tag: phase * 8 + stream, within the call.
        block: which block of the collective's data it carries (offset * blocks // length in the
            sender's main buffer, else the receiver's), or -1 for scratch data.
    """

    step: int
    src: int
    dst: int
    nbytes: int
    tag: int
    block: int


@dataclasses.dataclass(frozen=True)
class Reduction:
    """One local combine: `rank` reduced `nbytes` bytes at `step`."""

    step: int
    rank: int
    nbytes: int


@dataclasses.dataclass
class Schedule:
    """Everything one collective call does, per step and rank.

    Attributes:
        collective, algorithm: what ran.
        size: ranks.
        nbytes: bytes of one rank's input, as the cost model counts them.
        messages: every message, in the order they were sent.
        reductions: every combine.
    """

    collective: str
    algorithm: str
    size: int
    nbytes: int
    messages: list[Message] = dataclasses.field(default_factory=list)
    reductions: list[Reduction] = dataclasses.field(default_factory=list)

    @property
    def steps(self) -> int:
        """Message latencies from start to end (0 when nothing is sent)."""
        return max((m.step + 1 for m in self.messages), default=0)

    def sent(self, rank: int) -> tuple[int, int]:
        """(messages, bytes) that `rank` sends."""
        mine = [m.nbytes for m in self.messages if m.src == rank]
        return len(mine), sum(mine)

    def busiest(self) -> tuple[int, int]:
        """(most messages, most bytes) any one rank sends."""
        counts = [0] * self.size
        volume = [0] * self.size
        for m in self.messages:
            counts[m.src] += 1
            volume[m.src] += m.nbytes
        return max(counts, default=0), max(volume, default=0)


class _Work:
    """A request of the recording: done at once (send) or when its message was sent (receive)."""

    __slots__ = ("done", "step", "owner", "waited")

    def __init__(self, done: bool, step: int, owner: int) -> None:
        self.done = done
        self.step = step
        self.owner = owner
        self.waited = False  # the owner is blocked on it


class _Recorder:
    """The shared state of one recording: matching of sends and receives, and the schedule."""

    def __init__(self, schedule: Schedule, bases: list[list[np.ndarray]], blocks: int) -> None:
        self.schedule = schedule
        self.bases = bases
        self.blocks = blocks
        self.clock = [0] * schedule.size
        self.unmatched: dict[tuple[int, int, int], deque[Message]] = defaultdict(deque)
        self.posted: dict[tuple[int, int, int], deque[_Work]] = defaultdict(deque)
        self.blocked = [0] * schedule.size  # requests each rank waits for that are not done
        self.ready: deque[int] = deque(range(schedule.size))

    def block(self, rank: int, arr: np.ndarray) -> int:
        """Which block of rank's main buffer `arr` lies in, or -1."""
        start = arr.__array_interface__["data"][0]
        for base in self.bases[rank]:
            lo = base.__array_interface__["data"][0]
            if base.nbytes and lo <= start < lo + base.nbytes:
                return (start - lo) * self.blocks // base.nbytes
        return -1

    def send(self, src: int, dst: int, tag: int, arr: np.ndarray) -> _Work:
        block = self.block(src, arr) if self.blocks else -1
        message = Message(self.clock[src], src, dst, arr.nbytes, tag, block)
        self.schedule.messages.append(message)
        waiting = self.posted[(src, dst, tag)]
        if waiting:
            work = waiting.popleft()
            work.done, work.step = True, message.step + 1
            if work.waited:
                self.blocked[dst] -= 1
                if not self.blocked[dst]:
                    self.ready.append(dst)
        else:
            self.unmatched[(src, dst, tag)].append(message)
        return _Work(True, self.clock[src], src)

    def recv(self, dst: int, src: int, tag: int, arr: np.ndarray) -> _Work:
        queue = self.unmatched[(src, dst, tag)]
        if queue:
            message = queue.popleft()
            if message.nbytes != arr.nbytes:
                raise AssertionError(f"rank {dst} expects {arr.nbytes} B from {src}, gets {message.nbytes}")
            return _Work(True, message.step + 1, dst)
        work = _Work(False, 0, dst)
        self.posted[(src, dst, tag)].append(work)
        return work


class RecordingTeam:
    """The Team interface (tcoll.algos.team.Team) over a recorder: requests are noted, no data moves."""

    def __init__(self, recorder: _Recorder, rank: int, size: int, chunk_bytes: int, tag: int = 0) -> None:
        self.rank = rank
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.sequence = 0
        self.stamp = 0
        self._recorder = recorder
        self._tag = tag

    def phase(self, index: int) -> RecordingTeam:
        return RecordingTeam(self._recorder, self.rank, self.size, self.chunk_bytes, self._tag + index * 8)

    def send(self, arr: np.ndarray, peer: int, sub: int = 0) -> _Work:
        return self._recorder.send(self.rank, peer, self._tag + sub, arr)

    def recv(self, arr: np.ndarray, peer: int, sub: int = 0) -> _Work:
        return self._recorder.recv(self.rank, peer, self._tag + sub, arr)

    def chunk_count(self, itemsize: int) -> int:
        return max(1, self.chunk_bytes // max(1, itemsize))

    def rank_of(self, world_rank: int) -> int:
        return world_rank


class _RecordingOp:
    """An op whose combines are noted at the rank's current step, not computed."""

    def __init__(self, op: Op, recorder: _Recorder) -> None:
        self._op = op
        self._recorder = recorder
        self.rank = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._op, name)

    def combine(self, lower: np.ndarray, higher: np.ndarray, out: np.ndarray) -> None:
        self._recorder.schedule.reductions.append(Reduction(self._recorder.clock[self.rank], self.rank, out.nbytes))

    def combine_all(self, parts: list[np.ndarray], out: np.ndarray) -> None:
        for _ in parts[1:]:
            self.combine(out, out, out)

    def finish(self, result: np.ndarray, size: int) -> None:
        pass


def _arguments(collective: str, rank: int, size: int, count: int, dtype: np.dtype, op: Any,
               root: int) -> tuple[tuple[Any, ...], list[np.ndarray], int]:
    """(the algorithm's arguments after the team, the rank's main buffers, nbytes as the cost model counts)."""
    itemsize = dtype.itemsize
    counts = [count] * size
    whole = np.empty(count * size, dtype=dtype)  # never read nor written: empty, not zeros
    own = np.empty(count, dtype=dtype)
    if collective in ("scan", "exscan"):
        return (own, op), [own], own.nbytes
    if collective in ("all_reduce", "reduce", "broadcast"):
        args: tuple[Any, ...] = {"all_reduce": (own, op), "reduce": (own, op, root),
                                 "broadcast": (own, root)}[collective]
        return args, [own], own.nbytes
    if collective == "all_gather":
        return (whole, counts), [whole], count * itemsize
    if collective == "gather":
        return (own, whole if rank == root else None, counts, root), [whole if rank == root else own], count * itemsize
    if collective == "scatter":
        return (whole if rank == root else None, own, counts, root), [whole if rank == root else own], count * itemsize
    if collective == "reduce_scatter":
        return (whole, own, counts, op), [whole, own], whole.nbytes
    if collective == "all_to_all":
        out = np.empty(count * size, dtype=dtype)
        return (whole, out, counts, counts), [whole, out], whole.nbytes
    if collective == "barrier":
        return (), [], 0
    raise ValueError(f"unknown collective {collective!r}")


def record(collective: str, algorithm: str, size: int, count: int = 1, *, dtype: Any = np.float32,
           op: str | Op = "sum", root: int = 0, chunk_bytes: int = _NO_CHUNKS, blocks: bool = True) -> Schedule:
    """Run `algorithm` of `collective` on `size` recording ranks and return its schedule.

    Args:
        collective: e.g. "all_reduce".
        algorithm: a registered point-to-point algorithm (not a direct one).
        size: ranks.
        count: elements per rank (per block for the block collectives).
        dtype: the element type.
        op: the reduce op (only its properties matter: nothing is computed).
        root: the root of rooted collectives.
        chunk_bytes: bytes per message of pipelined algorithms (default: no cutting).
        blocks: note which block each message carries (False: a third faster, every block -1).

    Raises:
        ValueError: a direct algorithm, or an unknown name.
        RuntimeError: the ranks deadlock (a receive that no rank ever sends).
    """
    info = lookup(collective, algorithm)
    if info.direct:
        raise ValueError(f"{collective} {algorithm} runs on the shared-memory arena, not on messages")
    dtype = np.dtype(dtype)
    schedule = Schedule(collective, algorithm, size, 0)
    recorder = _Recorder(schedule, [[] for _ in range(size)], size if blocks else 0)
    ops = [_RecordingOp(as_op(op), recorder) for _ in range(size)]
    runs = []
    for rank in range(size):
        ops[rank].rank = rank
        args, bases, schedule.nbytes = _arguments(collective, rank, size, count, dtype, ops[rank], root)
        recorder.bases[rank] = bases
        runs.append(info.run(RecordingTeam(recorder, rank, size, chunk_bytes), *args))
    _drive(runs, recorder)
    return schedule


def _drive(runs: list[Any], recorder: _Recorder) -> None:
    """Step every rank's generator until all end; raise RuntimeError on a deadlock."""
    waited: list[list[_Work]] = [[] for _ in runs]
    ended = 0
    while recorder.ready:
        rank = recorder.ready.popleft()
        recorder.clock[rank] = max([recorder.clock[rank], *(work.step for work in waited[rank])])
        try:
            got = runs[rank].send(None)
        except StopIteration:
            ended += 1
            continue
        waited[rank] = [got] if isinstance(got, _Work) else list(got)
        for work in waited[rank]:
            if not work.done:
                work.waited = True
                recorder.blocked[rank] += 1
        if not recorder.blocked[rank]:
            recorder.ready.append(rank)
    if ended < len(runs):
        stuck = [rank for rank, count in enumerate(recorder.blocked) if count]
        raise RuntimeError(f"ranks {stuck} wait for messages that no rank sends")
