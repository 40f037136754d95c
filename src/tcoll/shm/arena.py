"""The shared-memory arena of a communicator whose ranks share one host.

Every rank maps one segment. It holds, per rank, a *counter* (the number of
steps the rank has published), a *descriptor* (what the current call is, and
where the rank's zero-copy buffer lies), and two *slots* of `shm_slot` bytes
that the rank writes and every other rank reads. The direct collectives
(`tcoll.shm.vector`, `tcoll.shm.blocks`) run as a sequence of steps, numbered alike on every
rank; step k uses slot set k % 2:

    writer:  claim(k)     wait until every rank has published step k-1, i.e.
                          has finished reading step k-2, the last user of set k % 2
             write its slot of set k % 2
             publish(k)   counter = k + 1, then wake the ranks that sleep
    reader:  wait_all(k) / wait_rank(q, k), then read the slots of step k

Publishing step k also says "I have finished reading every earlier step", so
one counter per rank orders everything: no locks, no atomic read-modify-write
(a counter has one writer), and two slot sets let a fast rank run one step
ahead of a slow one. Waiting is adaptive, like the engine's: poll the counters
for the self-tuned spin budget (yielding the CPU at each poll when ranks
outnumber cores), then sleep on this rank's doorbell, which the publisher of
a step rings only when its owner sleeps; the same doorbell serves
point-to-point traffic, so a sleeping rank still moves its messages.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.stamps import describe, disagreement
from ..errors import MismatchError, PeerLostError, TcollError, TimeoutError, fresh
from ..p2p import notice, status
from ..p2p.waiting import FENCE_LOCK, FUTEX_AVAILABLE, Doorbell
from ..segments import Segment

from .kernel_abi import DESC_WORDS, KERNEL_DTYPES, KERNEL_OPS, PROGRESS_LINE, SETS, kernel_module
from .lending import ZERO_COPY_BYTES, Lending

if TYPE_CHECKING:
    from ..p2p.engine import Engine

__all__ = ["Arena", "KERNEL_DTYPES", "KERNEL_OPS", "SETS", "ZERO_COPY_BYTES", "arena_bytes"]

_POLLS_PER_PROGRESS = 32  # while waiting, one round of point-to-point progress per so many polls
_WORD = (1 << 64) - 1
_fence_acquire, _fence_release = FENCE_LOCK.acquire, FENCE_LOCK.release  # a full fence: see p2p.waiting.fence
# Steps a kernel step took, by the state it returned: a call that may lend (DONE: with the lenders' step); run_split.
LENDING_STEPS = {kernel_module.PUBLISHED: 1, kernel_module.DONE: 2} if kernel_module is not None else {}
_SPLIT_STEPS_TAKEN = ({kernel_module.PUBLISHED: 1, kernel_module.REDUCED: 2, kernel_module.DONE: 3}
                      if kernel_module is not None else {})


class Arena(Lending):
    """One communicator's shared-memory arena (see the module docstring).

    The dispatcher makes it at the communicator's first direct call (rank 0
    creates the segment, the others open it, see `create_segment`), hands it
    to the direct algorithms, and closes it with the communicator.

    Attributes:
        rank: this rank in the communicator.
        size: the number of ranks.
        slot_bytes, piece_bytes: bytes of one slot; of a piece of an all_reduce/reduce larger than one.
        step: the next step number (equal on every rank between calls).
        timeout: seconds a wait may take before TimeoutError (the caller's timeout).
        heap: this process's zero-copy heap (tcoll.shm.heap), or None.
    """

    def __init__(self, engine: Engine, world: list[int], rank: int, segment: Segment, slot_bytes: int,
                 heap: Any, one_step_bytes: int, piece_bytes: int) -> None:
        buf = segment.map
        self.rank = rank
        self.size = len(world)
        self.slot_bytes = slot_bytes
        self.one_step_bytes = one_step_bytes  # rank 0's limit of one-step reductions (tcoll.shm.vector)
        self.piece_bytes = piece_bytes  # and its pieces of larger ones (agreed_piece)
        self.step = 0
        self.timeout = engine.settings.timeout
        self.heap = heap
        self._engine = engine
        self._world = world
        self._segment: Segment | None = segment
        desc_at, data_at = _layout(self.size)
        self._counters = memoryview(buf)[:8 * self.size].cast("Q")
        self._desc = memoryview(buf)[desc_at:desc_at + 8 * DESC_WORDS * SETS * self.size].cast("Q")
        data = np.frombuffer(buf, dtype=np.uint8, offset=data_at)
        self._slots = [[data[(s * self.size + q) * slot_bytes:(s * self.size + q + 1) * slot_bytes]
                        for q in range(self.size)] for s in range(SETS)]
        bells = [engine.channels[w].peer_doorbell() for w in world if w != engine.rank]  # type: ignore[union-attr]
        self._bells: list[Doorbell] = [bell for bell in bells if bell is not None]
        self._typed: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        self.broken: BaseException | None = None
        self.stamp, self.sequence, self.label = 0, 0, "collective"  # the call under way (see begin)
        self.first = 0  # its first step
        self.alarm: BaseException | None = None  # what the dispatcher learnt meanwhile: the wait raises it
        self.writable = False  # this rank lent its buffer to the call under way, which may write into it (settle)
        # An express call that could not finish (tcoll.shm.express): sequence * 4 + the kernel's state, which
        # the call's run_small / run_split takes instead of running the kernel again; 0: none.
        self.pending = 0
        self.kernel = self._make_kernel(buf, desc_at, data_at)
        self._desc_address = np.frombuffer(buf, dtype=np.uint64, count=1, offset=desc_at).ctypes.data
        self.single_copy = False  # every rank reads every other's memory in one copy (decide_single_copy)
        self.reduce_by_single_copy = False  # and a large all_reduce does (TCOLL_SHM_SINGLE_COPY=on on rank 0)
        self._scratch: np.ndarray | None = None
        spin = engine.spin  # the C kernel polls at most this long (then Python waits, as _wait does)
        self.kernel_spin_ns = int((spin.max_s if spin.oversubscribed else spin.fast_s) * 1e9)
        self.kernel_yields = spin.oversubscribed
        self.oversubscribed = spin.oversubscribed  # its host's ranks outnumber its cores (tcoll.shm.large)

    def _make_kernel(self, buf: Any, desc_at: int, data_at: int) -> Any:
        """The C kernel of the small reduction step over this mapping, or None (not built, no futex, or off)."""
        if kernel_module is None or not FUTEX_AVAILABLE or len(self._bells) != self.size - 1 or \
                self._engine.settings.shm_kernel == "off":
            return None
        # It holds exports of the mapping and of the doorbells: a call under way in one thread keeps them
        # mapped while another thread closes the communicator (the mappings go with the kernel).
        return kernel_module.Kernel(buf, desc_at, data_at, self.size, self.rank, self.slot_bytes,
                                    [bell.memory for bell in self._bells])

    # -- setup --------------------------------------------------------------------

    @staticmethod
    def usable(engine: Engine, world: list[int]) -> bool:
        """Whether every rank of `world` can share an arena with this one (one host, doorbells reachable)."""
        for peer in world:
            if peer == engine.rank:
                continue
            channel = engine.channels[peer]
            if channel is None or channel.peer_doorbell() is None:
                return False
        return True

    def close(self) -> None:
        """Release the mapping (idempotent)."""
        segment, self._segment = self._segment, None
        if segment is None:
            return
        retire = getattr(self.kernel, "retire", None)
        if retire is not None:  # express calls made for it stop; it lets go of the mapping after its last step
            retire()
        self.kernel = None
        self._counters.release()
        self._desc.release()
        self._slots = []
        self._typed = {}
        segment.close()

    # -- steps ----------------------------------------------------------------------

    def slot(self, rank: int, step: int) -> np.ndarray:
        """The slot (uint8) of `rank` for `step`."""
        return self._slots[step % SETS][rank]

    def typed_slots(self, step: int, dtype: np.dtype, nbytes: int) -> list[np.ndarray]:
        """Every rank's slot for `step` as `dtype` views of its first `nbytes` bytes (cached: calls repeat)."""
        key = (step % SETS, dtype, nbytes)
        views = self._typed.get(key)
        if views is None:
            if len(self._typed) >= 256:
                self._typed.clear()
            views = self._typed[key] = [slot[:nbytes].view(dtype) for slot in self._slots[step % SETS]]
        return views

    def claim(self) -> int:
        """Take the next step number, waiting until its slot set is free to write.

        Returns:
            The step number k (every rank gets the same k for the same step).
        """
        step = self.step
        self.step = step + 1
        if step >= 1 and min(self._counters) < step:
            self._wait(step, None)
        return step

    def skip(self) -> int:
        """Take the next step number without writing anything in it (no wait)."""
        step = self.step
        self.step = step + 1
        return step

    def publish(self, step: int) -> None:
        """Say this rank wrote its part of `step` and read everything before it; wake sleepers."""
        self._counters[self.rank] = step + 1
        _fence_acquire()  # _ring(), inline: every Python step passes here
        _fence_release()
        for bell in self._bells:
            if bell.sleepers:
                bell.wake()

    def _ring(self) -> None:
        """Make this rank's last word visible, then wake the ranks that sleep."""
        _fence_acquire()  # fence(), inline
        _fence_release()
        for bell in self._bells:
            if bell.sleepers:
                bell.wake()

    def wait_all(self, step: int) -> None:
        """Wait until every rank has published `step`."""
        if min(self._counters) <= step:
            self._wait(step + 1, None)

    def wait_rank(self, rank: int, step: int) -> None:
        """Wait until `rank` has published `step`."""
        if self._counters[rank] <= step:
            self._wait(step + 1, rank)

    # -- descriptors: what each rank's call is, and where its zero-copy buffer lies -----
    # A call's descriptors sit in set (its first step % 2), written only in a
    # claimed step: a rank that starts the next call cannot overwrite what a
    # slower rank still checks for this one. Every direct algorithm opens its
    # call with `first_step` and, once its part of that step is published,
    # `agree`: every rank waits for every rank's first step and compares the
    # call stamps and sequence numbers, so that any disagreement is an error
    # on every rank before any data is used.

    def begin(self, stamp: int, sequence: int, label: str) -> None:
        """Set the call the next steps belong to (the dispatcher does, before the algorithm runs)."""
        self.stamp, self.sequence, self.label, self.alarm, self.writable = stamp, sequence, label, None, False

    def first_step(self, heap_ref: tuple[int, int, int] | None = None) -> int:
        """Claim the call's first step and describe the call (and this rank's zero-copy buffer) in it."""
        step = self.step  # claim(), inline: every call passes here
        self.step = step + 1
        if step >= 1 and min(self._counters) < step:
            self._wait(step, None)
        self.first = step
        at = ((step % SETS) * self.size + self.rank) * DESC_WORDS
        desc = self._desc
        desc[at] = self.stamp & _WORD
        desc[at + 1] = self.stamp >> 64
        desc[at + 2] = self.sequence
        if heap_ref is None:
            desc[at + 3] = 0
        else:
            desc[at + 3], desc[at + 4], desc[at + 5] = heap_ref
        return step

    def run_small(self, buf: np.ndarray, dtype: int, op: int, want: bool) -> int:
        """The call's one step in the C kernel: claim, describe, copy in, publish, and if every rank
        comes within the kernel's spin, agree and reduce into `buf` (if `want`).

        Returns:
            kernel_module.DONE; PUBLISHED: the step is published, and `agree` and the reduction are
            left to the caller; NOT_STARTED: nothing happened (the caller runs the step in Python).
        """
        return self.kernel_step("run", (buf, dtype, op), (want,))

    def run_split(self, buf: np.ndarray, dtype: int, op: int, want: bool) -> int:
        """A call that fits a slot, in the kernel's three steps (tcoll.shm.vector._reduce_split).

        Returns:
            kernel_module.DONE (its three steps taken); REDUCED: two steps published, the other ranks' parts
            not yet copied out; PUBLISHED: only the first step is (`agree` and the rest are the caller's);
            NOT_STARTED.
        """
        return self.kernel_step("run_split", (buf, dtype, op), (want,), _SPLIT_STEPS_TAKEN)

    def run_broadcast(self, buf: np.ndarray, root: int, lending: bool = False) -> int:
        """A broadcast that fits a slot, in the kernel's one step (tcoll.shm.vector.broadcast); `lending`: of
        ZERO_COPY_BYTES or more, root's buffer not lent. Returns DONE (with the lenders' step if `lending`);
        PUBLISHED: `agree`, the copy and finish_lending are the caller's; NOT_STARTED."""
        return self.kernel_step("run_broadcast", (buf, root, lending), (), LENDING_STEPS if lending else None)

    def kernel_step(self, method: str | None, head: tuple[Any, ...], tail: tuple[Any, ...],
                    taken: dict[int, int] | None = None) -> int:
        """Run the kernel's `method` (head, the step and the call, tail; None: none) from this step, or take the state
        an express call of this call left; move the step on by the steps taken (`taken` by state; else one)."""
        step = self.step
        # An exception landing between the kernel's return and the next line leaves self.step behind the
        # counters; the call then fails, and a failed call makes the dispatcher open a fresh arena.
        state = self._take_pending() if self.pending else 0 if method is None else getattr(self.kernel, method)(
            *head, step, self.stamp, self.sequence, self.kernel_spin_ns, self.kernel_yields, *tail)
        if state:
            self.step, self.first = step + (taken[state] if taken else 1), step
        return state

    def _take_pending(self) -> int:
        """The kernel's state that an express call of this call left (it ran the kernel already).

        Raises:
            TcollError: the state is another call's (a defect of tcoll's: the steps would not pair).
        """
        pending, self.pending = self.pending, 0
        if pending >> 2 != self.sequence:
            raise self._fail(TcollError(f"{self.label} #{self.sequence} (shm): the arena holds the state of call "
                                        f"#{pending >> 2}, an express call's that did not finish"))
        return pending & 3

    def agree(self, step: int) -> None:
        """Wait until every rank published the call's first `step`; raise MismatchError if one described another."""
        if min(self._counters) <= step:  # wait_all(step), inline
            self._wait(step + 1, None)
        desc = self._desc
        base = (step % SETS) * self.size * DESC_WORDS
        low, high, sequence = self.stamp & _WORD, self.stamp >> 64, self.sequence
        for q in range(self.size):
            at = base + q * DESC_WORDS
            if desc[at] != low or desc[at + 1] != high or desc[at + 2] != sequence:
                raise self._fail(self._mismatch(q, desc[at] | desc[at + 1] << 64, desc[at + 2]))

    def _mismatch(self, rank: int, theirs: int, sequence: int) -> MismatchError:
        what = f"{self.label} #{self.sequence} (shm)"
        if sequence != self.sequence:
            text = (f"rank {rank} is at its call #{sequence}, {describe(theirs)}, where rank {self.rank} is at "
                    f"#{self.sequence}; a rank skipped a call, or failed one the others did not")
        else:
            text = disagreement(rank, theirs, self.rank, self.stamp)
        return MismatchError(f"{what}: {text}", ranks=[rank], mine=self.stamp, theirs=theirs)

    def _desc_at(self, step: int, rank: int) -> int:
        return ((step % SETS) * self.size + rank) * DESC_WORDS

    # -- failure ----------------------------------------------------------------------

    def check_usable(self) -> None:
        """Raise if an earlier call failed here: the ranks' step numbers may no longer agree."""
        if self.broken is not None:
            raise TcollError(f"an earlier shared-memory collective on this communicator failed ({self.broken}); "
                             "its ranks are out of step, so the communicator cannot run more of them")

    def _fail(self, exc: BaseException) -> BaseException:
        self.broken = fresh(exc).with_traceback(None)  # kept for the message only: not the caller's frames
        return exc

    def _wait(self, target: int, rank: int | None) -> None:
        """Wait until the counter of `rank` (None: every counter) reaches `target`: poll, then sleep."""
        counters = self._counters
        engine = self._engine
        spin = engine.spin
        start = time.monotonic()
        budget, fast = spin.budget_s, spin.fast_s
        if rank is None:
            def ready() -> bool:
                return min(counters) >= target or self.alarm is not None
        else:
            def ready() -> bool:
                return counters[rank] >= target or self.alarm is not None
        polls = 0
        waited = 0.0
        while waited < budget:
            if ready():
                spin.record(waited, False)
                if self.alarm is not None:
                    raise self._fail(self.alarm)
                return
            polls += 1
            if polls % _POLLS_PER_PROGRESS == 0:
                engine.poll()  # point-to-point too: a notice or late message about this call raises its alarm
            elif waited >= fast:
                os.sched_yield()  # past the first microseconds: let a rank that shares this core run
            waited = time.monotonic() - start
        deadline = start + self.timeout
        interval = engine.settings.liveness_interval
        next_probe = start + interval
        notice_at = start + notice.notice_after()  # a long wait says so, once
        while not ready():
            now = time.monotonic()
            if engine.closed:
                raise self._fail(TcollError("the communicator was closed"))
            if now >= deadline or now >= next_probe:
                self._check_behind(target, rank, now >= deadline)
                next_probe = now + interval
                engine.waiting = status.Waiting(  # for the hang report (tcoll.p2p.status): slow path only
                    f"{self.label} #{self.sequence} (shm)", [self._world[q] for q in range(self.size)
                                                             if (rank is None or q == rank) and counters[q] < target],
                    f"arena step {target}", start, ready)
                if now >= notice_at:
                    behind = [q for q in range(self.size) if (rank is None or q == rank) and counters[q] < target]
                    notice.say(self.rank, f"{self.label} #{self.sequence} (shm)", behind, now - start, self.timeout)
                    notice_at = float("inf")
            engine.block_unless(ready, min(next_probe, deadline) - now)
        spin.record(time.monotonic() - start, True)
        if self.alarm is not None:
            raise self._fail(self.alarm)

    def _check_behind(self, target: int, rank: int | None, timed_out: bool) -> None:
        """Fail if a rank we wait for is gone (PeerLostError) or the wait timed out (TimeoutError)."""
        behind = [q for q in range(self.size) if (rank is None or q == rank) and self._counters[q] < target]
        try:
            self._engine.probe_peers([self._world[q] for q in behind])
        except PeerLostError as exc:
            raise self._fail(exc) from None
        if timed_out:
            absent = [q for q in behind if self._counters[q] <= self.first]
            late = [q for q in behind if q not in absent]
            said = [f"rank(s) {absent} never entered it"] if absent else []
            said += [f"rank(s) {late} entered it but lag behind"] if late else []
            raise self._fail(TimeoutError(
                f"{self.label} #{self.sequence} (shm) did not complete within {self.timeout:g} s: "
                f"{'; '.join(said)}", absent or behind))


def _layout(size: int) -> tuple[int, int]:
    """Byte offsets of the descriptors and of the slots, for `size` ranks (counters first; before the slots, a
    progress line per rank that only the C kernel's streamed steps use: Python publishes whole steps)."""
    desc_at = (8 * size + 63) & ~63
    data_at = (((desc_at + 8 * DESC_WORDS * SETS * size + 63) & ~63) + PROGRESS_LINE * size + 4095) & ~4095
    return desc_at, data_at


def arena_bytes(size: int, slot: int) -> int:
    """Bytes of the segment of an arena of `size` ranks with slots of `slot` bytes."""
    return _layout(size)[1] + SETS * size * slot
