"""Making sure the ranks of a communicator make the same calls: stamps checked, failures told, nothing shifted.

Every collective call takes the next sequence number on every rank and has
a stamp (tcoll.algos.stamps) that every message and arena descriptor of the
call carries. The receivers compare stamps (the engine, the arena); what no
receive takes is classified by the engine against the calls this rank runs
(tcoll.p2p.watch) and reported here as an alarm. A disagreement, or any
failure of a call on one rank, ends the call on every rank:

- the rank where it happened sends every other rank a *notice* for the call
  (a small message on the call's own tags: no message on the way when all
  is well);
- a rank still in the call fails it at once (MismatchError, or
  PeerFailedError naming the rank whose part failed), and passes that
  failure on to the others: it may leave and close before the failing
  rank's own notice reaches them (descheduled between its sends), and a
  rank that saw it gone would raise the loss instead of the cause;
- a rank that has not started it yet fails it as it starts;
- a rank that already finished it (its part only sent, say) learns it from
  the notice or from the late message itself, and its next call raises.

A call that fails its argument checks on one rank still takes its sequence
number there, and its notice tells the others, so that no later call ever
pairs with another rank's different call.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.stamps import NOTICE, describe, disagreement
from ..errors import (MismatchError, PeerFailedError, PeerLostError, TcollError, fresh, is_known_to_peers,
                      known_to_peers)
from ..p2p.watch import BLOCK_BITS, NOTICE_TAG, BlockWatch
from ..shm import express

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..p2p.engine import Engine

__all__ = ["Agreement", "Running"]

_FAILED, _MISMATCH, _LOST = b"F", b"M", b"L"  # a notice's first byte: what happened to the call at its sender
_PASSED = b"P"  # ... or at another rank, whose notice the sender passed on (Agreement.fail)
_ASK, _ANSWER = b"Q", b"A"  # a timed-out rank asks who is in the call; each rank answers with where it is
_WHERE = {b"r": "in it", b"d": "done with it", b"n": "not started"}  # an answer's last byte
_TEXT_BYTES = 4000  # a notice's text is cut to this
ARENA_TAGS = 48  # the tags of a block from which on the dispatcher opens an arena (phases 6 and 7)
RING = 64  # recent finished calls remembered, to name them in a late notice (express.h writes it too)
_CAUSE = struct.Struct("<q")  # after the kind byte: the sequence number of the call the trouble began with


class Running:
    """A call under way on this rank, as the engine's watch and the alarms see it.

    Attributes:
        sequence: its sequence number.
        label: the user's name for it ("all_reduce").
        stamp: what it is (tcoll.algos.stamps).
        quiet: this rank's part takes no point-to-point message (it runs on the arena).
        later: (first, end) of the tags of the call's later steps, whose messages a quiet step keeps
            for them (a program whose next step runs over point-to-point); (0, 0): none.
        work: the CollectiveWork of its current team step, if any (an alarm aborts it).
        told: an error that came from another rank's notice (so it is not told back).
    """

    __slots__ = ("sequence", "label", "stamp", "quiet", "later", "work", "told", "alarmed")

    def __init__(self, sequence: int, label: str, stamp: int, quiet: bool) -> None:
        self.sequence, self.label, self.stamp, self.quiet = sequence, label, stamp, quiet
        self.later = (0, 0)
        self.work: Any = None
        self.told: BaseException | None = None
        self.alarmed: BaseException | None = None  # an alarm about it, in case it finishes all the same


class Agreement:
    """One communicator's view of which calls its ranks agree on (see the module docstring).

    Args:
        engine: the rank's engine.
        world: the world rank of each rank of the communicator.
        ctx: the engine context of the communicator's collectives.
        on_alarm: called with an error for a call that runs on the arena (the arena's waits raise it).
        on_trouble: called whenever ranks learn of a failed call (told or telling): the steps of the
            arena may no longer agree.
    """

    def __init__(self, engine: Engine, world: list[int], ctx: int, on_alarm: Callable[[BaseException], None],
                 on_trouble: Callable[[], None]) -> None:
        self.engine, self.world, self.ctx = engine, world, ctx
        self.rank = world.index(engine.rank)
        self._ranks = {w: r for r, w in enumerate(world)}
        self._on_alarm = on_alarm
        self._on_trouble = on_trouble
        self.watch = BlockWatch(self._alarm)
        self._ahead: dict[int, tuple[str, int, int, int, bytes]] = {}  # notices for calls not started here
        self.poison: BaseException | None = None  # a finished call turned out to disagree: the next call raises
        # Recent finished calls, a ring of RING: sequence number, and (label, stamp); express calls write it too.
        self.ring_sequences: list[int] = [-1] * RING
        self.ring_calls: list[tuple[str, int] | None] = [None] * RING
        self._look_first = False  # the last call only sent: look for what came back before the next one
        self._look_after = False  # ... and once more when that next call is over (every peer took part in it)
        self._causes: deque[int] = deque(maxlen=256)  # the calls whose trouble was raised here already
        self._answers: dict[int, dict[int, tuple[bytes, int]]] = {}  # call asked about -> rank -> (where, last)
        self._failing: dict[int, Running] = {}  # recent calls failed here: a notice that comes later explains them
        # Notices of the communicator's own (revoke, agree), whose first byte is one of control_kinds: they
        # are handed to on_control(rank, payload) as they come (set by tcoll.comm.survival).
        self.control_kinds: frozenset[bytes] = frozenset()
        self.on_control: Callable[[int, bytes], None] = lambda rank, payload: None
        self.on_lost: Callable[[int], None] = lambda world_rank: None  # another rank told of a lost one
        self.stopped: BaseException | None = None  # the communicator was revoked: every call raises it
        # Shut (by the shut() calls here) whenever the next call must look at what came: express calls wait
        # for the Python path to open it again (tcoll.shm.express).
        self.gate = express.new_gate(self.watch.early, self._ahead)
        engine.watch(ctx, self.watch)

    @property
    def quiet(self) -> bool:
        """Whether nothing here stands in the way of the next call (express calls may run)."""
        return not (self._look_first or self._look_after or self.stopped is not None or self.poison is not None
                    or self._ahead or self.watch.early)

    # -- a call's life ---------------------------------------------------------------

    def begin(self, sequence: int, label: str, stamp: int, quiet: bool) -> Running:
        """Register call `sequence` as under way; raise if it is already known to fail.

        Raises:
            MismatchError, PeerFailedError: a message or notice for it came before it started, or an
                earlier call turned out to disagree.
        """
        watch = self.watch
        if self._look_first:
            self._look_first, self._look_after = False, True
            self.engine.poll()  # late messages of the call before raise their alarms now
        if self.stopped is not None:  # revoked, even while the poll above ran
            raise fresh(self.stopped)
        if sequence > watch.high:
            watch.high = sequence
        running = Running(sequence, label, stamp, quiet)
        watch.calls[sequence] = running
        ahead = self._ahead.pop(sequence, None) if self._ahead else None
        error = None if ahead is None else self._error(*ahead, running)
        if error is not None:  # a notice came before the call: its sender told every rank
            watch.calls.pop(sequence, None)
            raise self._raised(known_to_peers(error), sequence)
        if self.poison is not None:
            error, self.poison = self.poison, None
        elif watch.early:
            error = self._early_mismatch(running, watch.early.pop(sequence, ()))
        if error is not None:
            watch.calls.pop(sequence, None)  # it never starts: the caller tells the others
            raise self._raised(error, sequence)
        return running

    def _raised(self, error: BaseException, sequence: int) -> BaseException:
        """Note that `error` reaches the user here: later evidence of the same trouble is not raised again."""
        cause = getattr(error, "tcoll_cause", sequence)
        if cause not in self._causes:
            self._causes.append(cause)
        if self.poison is not None and getattr(self.poison, "tcoll_cause", None) in self._causes:
            self.poison = None
        return error

    def _early_mismatch(self, running: Running, arrivals: Any) -> BaseException | None:
        for peer, theirs in arrivals:
            if theirs != running.stamp:
                return self._mismatch(running, self._ranks.get(peer, peer), theirs)
        return None

    def end(self, running: Running, sent_only: bool = False) -> None:
        """Call `running` finished well here.

        Args:
            sent_only: this rank's part only sent (a root of a broadcast): what shows a disagreement
                has not come yet, so the next call takes in what arrived meanwhile before it starts.
        """
        if self._look_after:  # a peer that disagreed on the call before this one told so before it took part
            self._look_after = False  # in this one: its notice is in now (the next call raises it, see _alarm)
            self.engine.poll()
        self._look_first = sent_only
        if sent_only:
            self.gate.shut()
        self.watch.calls.pop(running.sequence, None)
        alarmed = running.alarmed
        if alarmed is not None and getattr(alarmed, "tcoll_cause", running.sequence) not in self._causes:
            # It finished before the alarm could stop it (its last message was out): the next call raises.
            self.watch.failed.append(running.sequence)
            alarmed.tcoll_cause = getattr(alarmed, "tcoll_cause", running.sequence)  # type: ignore[attr-defined]
            self.poison = self.poison or alarmed
        at = running.sequence % RING
        self.ring_sequences[at], self.ring_calls[at] = running.sequence, (running.label, running.stamp)

    def _finished(self, sequence: int) -> tuple[str, int]:
        """The (label, stamp) of a recent finished call, or ("a call", 0) if it is not in the ring any more."""
        at = sequence % RING
        said = self.ring_calls[at]
        return said if said is not None and self.ring_sequences[at] == sequence else ("a call", 0)

    def fail(self, running: Running, error: BaseException) -> None:
        """Call `running` failed here: forget it, drop its late messages, and tell the other ranks.

        An error that came from another rank's notice is not told back (a failure is passed on: see the
        module docstring), nor one that every rank of the call learns by itself (known_to_peers).
        """
        self.gate.shut()
        self.watch.calls.pop(running.sequence, None)
        self.watch.failed.append(running.sequence)
        if not isinstance(error, MismatchError):  # (its Work failed first: the notice of why may come next)
            self._failing[running.sequence] = running
        if len(self._failing) > 8:
            del self._failing[next(iter(self._failing))]
        self._raised(error, running.sequence)
        told = running.told is error or getattr(error, "tcoll_told", False) and error.tcoll_cause == running.sequence
        if not is_known_to_peers(error) and (isinstance(error, PeerFailedError) if told else True):
            self.tell(running.sequence, running.stamp, error, passed=told)  # (a late one: this call's failure)

    def fail_unstarted(self, sequence: int, label: str, stamp: int, error: BaseException) -> None:
        """A call that failed on this rank before it could start (a bad argument, a notice): tell the others."""
        self.gate.shut()
        self.watch.high = max(self.watch.high, sequence)
        self.watch.failed.append(sequence)
        self._ahead.pop(sequence, None)
        self._raised(error, sequence)
        if is_known_to_peers(error):
            self._on_trouble()
        else:  # (an earlier call's failure raised here: every rank fails this call with it, its origin too)
            self.tell(sequence, stamp, error)

    def close(self, linger: float = 0.0) -> BaseException | None:
        """Stop watching (the communicator closes); return a disagreement found and not raised yet.

        What arrived is taken in first. If this rank's last call only sent (a root
        of a broadcast), what would show that the ranks disagreed on it may still
        be on its way: it waits, up to `linger` seconds, until every peer has
        closed (so everything they sent is in) or something turned up.

        Args:
            linger: seconds to wait at most for the peers (0: take in only what is there).
        """
        engine = self.engine
        if not engine.closed:
            try:
                engine.poll()
                if self._look_first and linger > 0:
                    self._linger(linger)
            except TcollError:  # a peer lost meanwhile: it sent what it could
                pass
        engine.watch(self.ctx, None)
        found, self.poison = self.poison, None
        return found

    def _linger(self, linger: float) -> None:
        """Take in messages until every peer closed, a disagreement turned up, or `linger` seconds passed."""
        engine = self.engine
        deadline = time.monotonic() + linger
        peers = [w for w in self.world if w != engine.rank]
        while _unsettled(self.poison) and time.monotonic() < deadline:
            live = [w for w in peers if not engine.is_lost(w)]
            if not live:
                return
            for peer in live:  # a closed peer reads as lost (its socket's end, its segment's closed word)
                try:
                    engine.probe_peers([peer])
                except TcollError:
                    pass
            engine.block_unless(lambda: not _unsettled(self.poison), 0.02)

    # -- notices -----------------------------------------------------------------------

    def tell(self, sequence: int, stamp: int, error: BaseException, passed: bool = False) -> None:
        """Send every other rank a notice that call `sequence` failed here, and why (sends are not waited for);
        `passed`: `error` is another rank's failure (a PeerFailedError from its notice), passed on as that
        rank's to every rank but it."""
        self._on_trouble()
        if len(self.world) == 1 or self.engine.closed:
            return
        skip = -1
        if passed and isinstance(error, PeerFailedError) and 0 <= error.rank < len(self.world):  # (its cause)
            kind, said, skip = _PASSED, f"{error.rank}:{error.cause}", self.world[error.rank]
        elif isinstance(error, MismatchError):  # the sentence after "call #k (...): " says it all
            kind, said = _MISMATCH, str(error).split(": ", 1)[-1]
        elif isinstance(error, PeerLostError):  # the cause is the lost rank, not the rank that saw it first
            kind, said = _LOST, f"{error.rank}:{error.detail}"
        else:
            kind, said = _FAILED, f"{type(error).__name__}: {error}"
        text = said.encode(errors="replace")[:_TEXT_BYTES]
        cause = getattr(error, "tcoll_cause", sequence)  # the call the trouble began with
        payload = np.frombuffer(kind + _CAUSE.pack(cause) + text, dtype=np.uint8)
        tag = (sequence << BLOCK_BITS) + NOTICE_TAG
        for peer in self.world:
            if peer != self.engine.rank and peer != skip and not self.engine.is_lost(peer):
                try:
                    self.engine.isend(payload, peer, self.ctx, tag, None, stamp | NOTICE)
                except TcollError:  # lost meanwhile, or closing: it learns nothing more from us
                    pass

    # -- who is in a call (asked when one times out) -------------------------------------------

    def absent(self, sequence: int, stamp: int, wait: float) -> str:
        """Ask every other rank where it is with call `sequence`; say which ranks are not in it.

        A rank inside any tcoll call answers at once (its engine makes progress);
        a rank that does not answer within `wait` seconds is busy in its own code,
        or stuck. Used to name, in a timeout, the ranks that never entered the call.

        Returns:
            "" if every rank is in the call (or past it), else a clause naming the others.
        """
        peers = [w for w in self.world if w != self.engine.rank and not self.engine.is_lost(w)]
        answers = self._answers[sequence] = {}
        for peer in peers:
            self._send(peer, sequence, stamp, _ASK + _CAUSE.pack(sequence))
        deadline = time.monotonic() + wait
        try:
            while len(answers) < len(peers) and time.monotonic() < deadline and not self.engine.closed:
                self.engine.poll()
                self.engine.block_unless(lambda: len(answers) >= len(peers), min(0.02, wait))
        except TcollError:  # a peer went meanwhile: say what is known; the call's own error stands
            pass
        finally:
            del self._answers[sequence]
        never = [f"rank {self._ranks[w]} (its last call is #{answers[w][1]})" for w in peers
                 if w in answers and answers[w][0] == b"n"]
        silent = [self._ranks[w] for w in peers if w not in answers]
        said = [f"{', '.join(never)} never entered it"] if never else []
        if silent:
            said.append(f"rank(s) {silent} did not answer within {wait:g} s: not in any tcoll call "
                        "(busy in their own code, or stuck)")
        return "; ".join(said)

    def _send(self, peer: int, sequence: int, stamp: int, body: bytes) -> Any:
        """Send a notice about call `sequence` to world rank `peer` (not waited for); its Work, or None."""
        try:
            return self.engine.isend(np.frombuffer(body, dtype=np.uint8), peer, self.ctx,
                                     (sequence << BLOCK_BITS) + NOTICE_TAG, None, stamp | NOTICE)
        except TcollError:  # lost meanwhile, or closing
            return None

    def _query(self, peer_world: int, block: int, payload: bytes) -> None:
        """Answer a rank that asks where this rank is with call `block`; or note an answer."""
        if payload[:1] == _ASK:
            watch = self.watch
            where = b"r" if block in watch.calls else (b"n" if block > watch.high else b"d")
            self._send(peer_world, block, 0, _ANSWER + _CAUSE.pack(watch.high) + where)
        elif block in self._answers and len(payload) == 2 + _CAUSE.size:
            (last,) = _CAUSE.unpack_from(payload, 1)
            self._answers[block][peer_world] = (payload[-1:], last)

    # -- alarms (the engine calls them after a round of progress) -----------------------------

    def _alarm(self, kind: str, peer_world: int, tag: int, theirs: int, payload: bytes) -> None:
        self.gate.shut()  # whatever it is, the next call looks at it in Python
        peer = self._ranks.get(peer_world, peer_world)
        block = tag >> BLOCK_BITS
        if kind == "notice" and payload[:1] in self.control_kinds:  # revoke, agree (tcoll.comm.survival)
            self.on_control(peer, payload)
            return
        if kind == "notice" and payload[:1] in (_ASK, _ANSWER):
            self._query(peer_world, block, payload)
            return
        if kind == "quiet" and tag - (block << BLOCK_BITS) >= ARENA_TAGS:
            kind = "reopening"
        running = self.watch.calls.get(block)
        if running is None and kind == "notice" and block in self._failing:
            self._explain(self._failing.pop(block), peer, theirs, payload)
            return
        if running is None and block > self.watch.high:  # a notice for a call not started here: kept for it
            self._on_trouble()
            self._ahead.setdefault(block, (kind, peer, block, theirs & ~NOTICE, payload))
            return
        error = self._error(kind, peer, block, theirs & ~NOTICE, payload, running)
        if error is None:
            return
        self._on_trouble()
        if running is not None:  # the call under way here cannot complete: the sender does not take part
            if kind == "notice":
                running.told = error
            self._stop(running, error)
            return
        cause = getattr(error, "tcoll_cause", block)
        if cause in self._causes or (block in self.watch.failed and not (
                isinstance(error, MismatchError) and self._loss_held())):
            return  # this rank raised that trouble already, or failed that call itself
        if block not in self.watch.failed:
            self.watch.failed.append(block)  # a call that finished here turns out to have disagreed:
        error.tcoll_cause = cause  # type: ignore[attr-defined]
        self.poison = _cause_first(self.poison, error)  # the next call raises it

    def _loss_held(self) -> bool:
        """Whether the trouble held to raise is a rank's loss, which a disagreement told later may explain (the
        rank that found it closed, and was seen lost, before its notice was read here): that one is taken in."""
        return isinstance(self.poison, PeerLostError)

    def _explain(self, failed: Running, peer: int, theirs: int, payload: bytes) -> None:
        """A notice about a call that already failed here (its peer's connection closed first, say): it says why.

        The dispatcher raises the notice's error instead of its own, which was a consequence
        (tcoll.comm.dispatch, Dispatcher._cause).
        """
        if failed.told is None:
            failed.told = self._error("notice", peer, failed.sequence, theirs & ~NOTICE, payload, failed)

    def _error(self, kind: str, peer: int, block: int, theirs: int, payload: bytes,
               running: Running | None) -> BaseException | None:
        label, mine = (running.label, running.stamp) if running else self._finished(block)
        where = f"{label} #{block}"
        if kind == "notice":
            (cause,) = _CAUSE.unpack_from(payload, 1)
            if cause != block:  # told of an earlier call's trouble: its late messages are expected now
                self._accounted(cause)
            if block in self.watch.failed and running is None and not (payload[:1] == _MISMATCH and self._loss_held()):
                return None  # this rank failed the call too, or holds its error: nothing more to learn
            text = payload[1 + _CAUSE.size:].decode(errors="replace")
            error = self._told_error(payload[:1], where, peer, text, mine, theirs)
            error.tcoll_cause = cause  # type: ignore[attr-defined]
            error.tcoll_told = True  # type: ignore[attr-defined]  # (Agreement.fail: passed on, not told back)
            if isinstance(error, PeerLostError) and error.rank >= 0:
                self.on_lost(error.rank)  # it is gone for this rank too, seen or not (failed() names it)
            return error
        if kind == "late" or running is None:  # (a call that finished before its alarm ran: as late)
            late = MismatchError(f"{where} finished on rank {self.rank}, but rank {peer} made another call at "
                                 f"that point: {disagreement(peer, theirs, self.rank, mine)}; results of that call "
                                 "may differ between ranks", ranks=[peer], mine=mine, theirs=theirs)
            late.tcoll_cause = block  # type: ignore[attr-defined]
            return late
        if kind == "reopening":
            return MismatchError(f"{where}: rank {peer} opens a new shared-memory arena after a failed call, while "
                                 f"rank {self.rank} still uses the old one (it had not heard of the failure yet); "
                                 "the next call opens a new arena on every rank", ranks=[peer], mine=mine, theirs=theirs)
        return self._mismatch(running, peer, theirs)

    @staticmethod
    def _told_error(kind: bytes, where: str, peer: int, text: str, mine: int, theirs: int) -> BaseException:
        """The error a notice of kind `kind` from rank `peer` raises here."""
        if kind == _LOST:
            lost, _, detail = text.partition(":")
            return PeerLostError(int(lost) if lost.isdigit() else -1, detail)
        if kind == _MISMATCH:
            return MismatchError(f"{where}: rank {peer} found the ranks disagree: {text}", ranks=[peer], mine=mine,
                                 theirs=theirs)
        if kind == _PASSED:  # the failure of another rank, passed on by `peer`: it names that rank
            origin, _, text = text.partition(":")
            peer = int(origin) if origin.isdigit() else peer
        return PeerFailedError(f"{where}: rank {peer} failed this call ({text}), so it cannot complete here", peer,
                               text)

    def _accounted(self, cause: int) -> None:
        """A notice about the trouble that began with call `cause`: its late messages are expected now."""
        if cause not in self.watch.failed:
            self.watch.failed.append(cause)

    def _mismatch(self, running: Running, peer: int, theirs: int) -> MismatchError:
        where = f"{running.label} #{running.sequence}"
        if theirs == running.stamp:  # the same call, yet this rank runs it on the arena
            text = (f"rank {peer} runs {describe(theirs)} over point-to-point while rank {self.rank} runs it on "
                    "the shared-memory arena; make the call alike on every rank (blocking or async_op=True)")
        else:
            text = disagreement(peer, theirs, self.rank, running.stamp)
        return MismatchError(f"{where}: {text}", ranks=[peer], mine=running.stamp, theirs=theirs)

    def stop_all(self, error: BaseException) -> None:
        """End every call under way here with `error` (the communicator was revoked), and every later one."""
        self.stopped = error
        self.gate.shut()
        for running in list(self.watch.calls.values()):
            self._stop(running, error)

    def send_control(self, peer_world: int, body: bytes) -> Any:
        """Send world rank `peer_world` one of the communicator's own notices (see control_kinds); its Work or None."""
        return self._send(peer_world, 0, 0, body)

    def _stop(self, running: Running, error: BaseException) -> None:
        """End a call under way with `error`: abort its team step, or have the arena's waits raise it."""
        running.alarmed = running.alarmed or error
        if running.work is not None:
            running.work.abort(error)
        else:
            self._on_alarm(error)


def _cause_first(held: BaseException | None, new: BaseException) -> BaseException:
    """Of two troubles found after their calls, the one to raise: the first, unless it is a rank's loss and the
    new one says the ranks disagreed (a rank that raised a MismatchError may close, and be seen lost, before
    its notice is read here: the disagreement is the cause)."""
    if held is None or (isinstance(held, PeerLostError) and isinstance(new, MismatchError)):
        return new
    return held


def _unsettled(poison: BaseException | None) -> bool:
    """Whether a lingering close still waits: nothing found yet, or only a loss that a disagreement may explain."""
    return poison is None or isinstance(poison, PeerLostError)
