"""Going on without a dead rank: failed, revoke, agree and shrink (after MPI's ULFM).

A rank that dies makes the calls that wait on it fail with PeerLostError.
The survivors then need three things that no ordinary collective gives them:

- **revoke**: make every survivor leave the communicator, also those that
  wait on another survivor (a ring, a tree) and would otherwise wait on;
- **agree**: decide one value together (a bitwise AND of their flags) even
  while more ranks die;
- **shrink**: a new communicator of the survivors, the same on every one.

Each is built on the communicator's *notices* (tcoll.comm.agreement): small
messages that the engine hands over as they arrive, whatever the rank is
doing in tcoll, so a rank that already left an agreement still answers
questions about it while it waits in any later call.

Agreement, round k (every survivor numbers its agree calls alike):

```
  voter:        VOTE(k, flag, failed) -> the lowest rank it does not know dead (the coordinator)
                wait for DECIDE(k); if the coordinator dies first, vote again to the next one;
                pass the DECIDE on to every rank before returning
  coordinator:  COLLECT(k, failed) -> every rank it does not know dead
                wait for a VOTE or a DECIDE(k) from each (a rank that dies meanwhile is dropped)
                decision = a DECIDE that came back (an earlier coordinator's), else the AND of the votes
                DECIDE(k, decision) -> every rank; remember it, to answer late voters
```

Every vote says which call made it (agree, or one of shrink's two rounds):
a coordinator that collects votes of different calls decides that the ranks
disagree, and every rank raises MismatchError instead of mixing the votes.

Failures are definitive (a process that is gone stays gone), and every
message carries what its sender knows to be dead, so knowledge only grows.
A rank ignores a DECIDE from a rank it knows to be dead: once it has heard
of the coordinator's death it has voted (or will vote) with the next one,
which decides only after hearing from every live rank; a rank that took
the dead coordinator's decision answers it with that decision, so the next
coordinator repeats it. Every survivor therefore returns the same decision.
A voter passes the decision on before it returns, so that one that leaves
at once (its communicator closed: gone, to the others) has still told the
next coordinator, which takes in what came before it decides anew.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import MismatchError, PeerLostError, RevokedError, TcollError, TimeoutError, known_to_peers
from .parcels import parts_context

if TYPE_CHECKING:
    from collections.abc import Callable

    from .communicator import Communicator
    from .core import CommCore

__all__ = ["Decision", "Survival", "failed", "revoke", "agree", "shrink"]

_REVOKE, _VOTE, _COLLECT, _DECIDE = b"R", b"V", b"C", b"D"
KINDS = frozenset((_REVOKE, _VOTE, _COLLECT, _DECIDE))
# kind, the call that votes or decides (AGREE, SHRINK, CHECK; DISAGREE), round, flag, context offered or decided;
# then the failed ranks' bitmap
_HEAD = struct.Struct("<ccqqq")
AGREE, SHRINK, CHECK, _DISAGREE = b"a", b"s", b"c", b"!"  # what a round is for: comm.agree, shrink's two rounds
_CALLS = {AGREE: "agree()", SHRINK: "shrink()", CHECK: "shrink() (its second round)"}
_KEPT = 64  # decisions remembered to answer late voters
_FLUSH_S = 2.0  # seconds a revoke or a decision may take to leave this rank before the call returns
_FIRST_PROBE = 0.05  # seconds an agreement waits before it first asks whether the ranks it awaits live
_FLAG_MIN, _FLAG_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class Decision:
    """What the survivors agreed on in one round.

    Attributes:
        flag: the bitwise AND of the survivors' flags.
        context: the largest context offered (shrink's new communicator takes it).
        failed: the ranks found dead, in the communicator's numbering, sorted.
        purpose: the call every voter made (AGREE, SHRINK, CHECK); _DISAGREE if they made different
            ones (then flag is a rank whose call differs from the coordinator's, and context says who
            the coordinator was and both calls: see _disagreement).
    """

    flag: int
    context: int
    failed: tuple[int, ...]
    purpose: bytes = AGREE


class Survival:
    """One communicator's view of its dead ranks, its revocation and its agreements (see the module docstring).

    Args:
        core: the communicator's core (its engine, dispatcher, world ranks and contexts).
    """

    def __init__(self, core: CommCore) -> None:
        self._core = core
        self._dispatcher = dispatcher = core.dispatch
        self._engine = core.engine
        self._world = core.world
        self.rank = dispatcher.rank
        self.size = dispatcher.size
        self.known: set[int] = set()  # ranks of this communicator known to be dead
        self.round = 0  # agree calls begun here
        self._vote: tuple[int, int, int, bytes] | None = None  # (round, flag, context, purpose) of the agree here
        self.decided: dict[int, Decision] = {}
        # round -> rank -> its vote (flag, context, purpose)
        self._answers: dict[int, dict[int, tuple[int, int, bytes]]] = {}
        agreement = dispatcher.agreement
        agreement.control_kinds = KINDS
        agreement.on_control = self._receive
        agreement.on_lost = self._told_lost

    # -- what is known dead -------------------------------------------------------------

    def refresh(self) -> None:
        """Ask every rank not known dead whether it lives (and take in what came meanwhile)."""
        if self._engine.closed:
            raise TcollError("the communicator is closed")
        self._probe([rank for rank in range(self.size) if rank != self.rank])

    def _learn(self, ranks: set[int], told_by: int) -> None:
        """Ranks another rank found dead: dead here too (the engine fails what waits on them)."""
        for rank in ranks - self.known - {self.rank}:
            self.known.add(rank)
            peer = self._world[rank]
            if not self._engine.is_lost(peer):
                by = f"rank {told_by}" if told_by >= 0 else "another rank"
                self._engine.fail_peer(peer, PeerLostError(peer, f"{by} found it gone"))

    def _told_lost(self, peer: int) -> None:
        """Another rank's notice said world rank `peer` is lost."""
        if peer in self._world and peer != self._engine.rank:
            self._learn({self._world.index(peer)}, -1)

    # -- revoke -------------------------------------------------------------------------

    def revoke(self, by: int) -> None:
        """Revoke the communicator (see tcoll.comm.survival.revoke); `by` is the rank that did."""
        core = self._core
        if core.revoked is not None:
            return
        who = "this rank" if by == self.rank else f"rank {by}"
        error = RevokedError(f"the communicator was revoked by {who} (rank {self.rank} of {self.size}); only "
                             "failed(), agree(), shrink() and close() work on it", by)
        known_to_peers(error)  # a call it ends is not told to the others as failed here: they are revoked too
        core.revoked = error
        core.usable = False
        dispatcher = self._dispatcher  # no call runs any more: the ones under way end, the next ones do not start
        dispatcher.revoked, dispatcher.closed = error, True  # (closed: one test on the fast path; it raises error)
        dispatcher.lean.clear()
        dispatcher.agreement.stop_all(error)
        for ctx in (core.p2p_ctx, parts_context(core.p2p_ctx)):  # (objects' parts travel on a context of their own)
            self._engine.withdraw(ctx, error)
        sent = [self._send(rank, _REVOKE, 0, by, 0) for rank in range(self.size)  # every rank passes it on
                if rank != self.rank and rank != by]  # once: it reaches all even if `by` died sending it
        if by == self.rank:
            self._flush(sent)  # (a rank passing it on does so inside the engine's progress: it is not waited for)

    # -- agree --------------------------------------------------------------------------

    def agree(self, flag: int, context: int, timeout: float, purpose: bytes = AGREE) -> Decision:
        """One round of agreement over the ranks not known dead (see the module docstring).

        Args:
            purpose: the call this round is part of (AGREE, SHRINK, CHECK): every rank must make the same.

        Raises:
            tcoll.TimeoutError: the coordinator (or, coordinating, a live rank) did not answer in time.
            MismatchError: a rank voted in this round for another call (on every rank).
        """
        self.round += 1
        k = self.round
        deadline = time.monotonic() + timeout
        self._vote = (k, flag, context, purpose)
        try:
            decision = self._agree(k, flag, context, purpose, deadline)
        finally:
            self._vote = None
        if decision.purpose != purpose:
            raise self._disagreement(k, decision, purpose)
        return decision

    def _disagreement(self, k: int, decision: Decision, purpose: bytes) -> MismatchError:
        """The error of a round whose voters made different calls (every rank raises one)."""
        if decision.purpose == _DISAGREE:
            coordinator, theirs, mine = decision.context >> 16, bytes([decision.context >> 8 & 0xFF]), \
                bytes([decision.context & 0xFF])
            rank = decision.flag
        else:  # (a decision of another call than this rank's, relayed: it says which)
            coordinator, theirs, mine, rank = self.rank, decision.purpose, purpose, -1
        called = _CALLS.get(theirs, "?")
        who = f"rank {rank} called {called}" if rank >= 0 else f"the others called {called}"
        return MismatchError(f"agreement round #{k}: {who} where rank {coordinator} called {_CALLS.get(mine, '?')}; "
                             "every surviving rank must make the same calls (agree, shrink) in the same order",
                             ranks=[rank] if rank >= 0 else [])

    def _agree(self, k: int, flag: int, context: int, purpose: bytes, deadline: float) -> Decision:
        self.refresh()
        while k not in self.decided:
            coordinator = min(r for r in range(self.size) if r not in self.known)
            if coordinator == self.rank:
                return self._coordinate(k, flag, context, purpose, deadline)
            self._send(coordinator, _VOTE, k, flag, context, purpose)
            self._await(lambda: k in self.decided or coordinator in self.known, [coordinator], deadline,
                        f"agree #{k}: waiting for the decision of rank {coordinator}")
        decision = self.decided[k]
        # Pass it on before returning: should its coordinator have died having told only this rank, and this
        # rank leave at once, the next coordinator still learns it (it takes a DECIDE before it decides).
        self._flush([self._send(rank, _DECIDE, k, decision.flag, decision.context, decision.purpose, decision.failed)
                     for rank in range(self.size) if rank != self.rank and rank not in self.known])
        return decision

    def _coordinate(self, k: int, flag: int, context: int, purpose: bytes, deadline: float) -> Decision:
        """Collect every live rank's vote (or a decision it took already), decide, and tell everyone."""
        answers = self._answers.setdefault(k, {})
        answers[self.rank] = (flag, context, purpose)
        for rank in range(self.size):
            if rank != self.rank and rank not in self.known:
                self._send(rank, _COLLECT, k, 0, 0)

        def missing() -> list[int]:
            return [r for r in range(self.size) if r not in self.known and r not in answers]

        self._await(lambda: k in self.decided or not missing(), None, deadline, f"agree #{k}: collecting the votes",
                    missing)
        self._engine.poll()  # a decision a voter passed on before it left is taken in before deciding anew
        decision = self.decided.get(k)  # an earlier coordinator decided before it died, and a survivor took it
        if decision is None:
            decision = self._tally(list(answers.items()), purpose)  # (a late vote may come in on another thread)
        self._decide(k, decision)
        self._flush([self._send(rank, _DECIDE, k, decision.flag, decision.context, decision.purpose, decision.failed)
                     for rank in range(self.size) if rank != self.rank and rank not in self.known])
        return decision

    def _tally(self, votes: list[tuple[int, tuple[int, int, bytes]]], purpose: bytes) -> Decision:
        """The decision of the votes collected here: their AND, or that the voters made different calls."""
        failed = tuple(sorted(self.known))
        for rank, (_, _, theirs) in sorted(votes):
            if theirs != purpose:
                return Decision(rank, self.rank << 16 | theirs[0] << 8 | purpose[0], failed, _DISAGREE)
        value, ctx = -1, 0
        for _, (f, c, _) in votes:
            value, ctx = value & f, max(ctx, c)
        return Decision(value, ctx, failed, purpose)

    def _decide(self, k: int, decision: Decision) -> None:
        self.decided[k] = decision
        self._answers.pop(k, None)
        while len(self.decided) > _KEPT:
            del self.decided[next(iter(self.decided))]

    def _await(self, ready: Callable[[], bool], watched: list[int] | None, deadline: float, what: str,
               missing: Callable[[], list[int]] | None = None) -> None:
        """Make progress until ready(), asking every liveness period whether the awaited ranks live.

        Args:
            watched: the ranks whose death ends the wait too (None: every rank not known dead).
            missing: who is still awaited, for the timeout's message (default: `watched`).

        Raises:
            tcoll.TimeoutError: `deadline` passed first.
        """
        engine = self._engine
        interval = engine.settings.liveness_interval
        next_probe = time.monotonic() + min(interval, _FIRST_PROBE)
        while not ready():
            now = time.monotonic()
            if now >= deadline:
                late = missing() if missing is not None else watched or []
                raise TimeoutError(f"{what}: no answer from rank(s) {late} within the timeout",
                                   [self._world[r] for r in late])
            if now >= next_probe:
                self.refresh() if watched is None else self._probe(watched)
                next_probe = now + interval
                continue
            engine.block_unless(ready, min(next_probe, deadline) - now)

    def _probe(self, ranks: list[int]) -> None:
        """Ask `ranks` (those not known dead) whether they live; a lost one is known dead from now on."""
        for rank in ranks:
            if rank in self.known:
                continue
            try:
                self._engine.probe_peers([self._world[rank]])
            except PeerLostError:  # (probe_peers raises for a peer lost before, too)
                self.known.add(rank)

    # -- the wire -----------------------------------------------------------------------

    def _flush(self, sent: list[Any]) -> None:
        """Wait (at most _FLUSH_S in all) until `sent` left this rank: one that returns and closes at once must
        not take its last word with it."""
        deadline = time.monotonic() + _FLUSH_S
        for work in sent:
            try:
                if work is not None:
                    work.wait(max(0.0, deadline - time.monotonic()))
            except TcollError:  # its peer is lost, or the time is up: it was said as well as it can be
                pass

    def _send(self, rank: int, kind: bytes, k: int, flag: int, context: int, purpose: bytes = AGREE,
              failed: tuple[int, ...] | None = None) -> Any:
        """Send `rank` one of our notices; it carries `failed` (a decision's), else every rank known dead here.

        Returns:
            The send's Work, or None (not sent: the rank is known dead, or this rank closed).
        """
        if rank in self.known or self._engine.closed:
            return None
        bitmap = bytearray((self.size + 7) // 8)
        for dead in self.known if failed is None else failed:
            bitmap[dead >> 3] |= 1 << (dead & 7)
        return self._dispatcher.agreement.send_control(self._world[rank],
                                                       _HEAD.pack(kind, purpose, k, flag, context) + bytes(bitmap))

    def _receive(self, rank: int, payload: bytes) -> None:
        """A notice of ours came from `rank` (the engine's alarm, after a round of progress)."""
        if len(payload) < _HEAD.size or not 0 <= rank < self.size:
            return
        kind, purpose, k, flag, context = _HEAD.unpack_from(payload)
        bitmap = payload[_HEAD.size:]
        dead = tuple(r for r in range(min(self.size, 8 * len(bitmap))) if bitmap[r >> 3] >> (r & 7) & 1)
        self._learn(set(dead), rank)
        if kind == _REVOKE:  # (its flag: the rank that revoked; the sender may only pass it on)
            self.revoke(flag if 0 <= flag < self.size else rank)
        elif kind == _DECIDE:  # (from a rank known dead: ignored, this rank votes with the next coordinator)
            if rank not in self.known and k not in self.decided:
                self._decide(k, Decision(flag, context, dead, purpose))
        elif k in self.decided:  # a vote or a collect for a round decided here: tell the decision
            decision = self.decided[k]
            self._send(rank, _DECIDE, k, decision.flag, decision.context, decision.purpose, decision.failed)
        elif kind == _VOTE:
            self._answers.setdefault(k, {})[rank] = (flag, context, purpose)
        elif self._vote is not None and self._vote[0] == k:  # a COLLECT for the round this rank votes in:
            self._send(rank, _VOTE, *self._vote)  # (again: its first vote may have gone to a rank it thought led)
        # a COLLECT for a round not begun here: this rank votes to its sender as it begins it


# -- the Communicator's methods -----------------------------------------------------------


def failed(comm: Communicator) -> list[int]:
    """The ranks of this communicator known to be dead (or gone), as of now; each is asked first.

    Not collective: each rank answers from what it knows. A rank that closed
    its communicator reads as gone too.

    Returns:
        Sorted ranks of this communicator.
    """
    survival = comm.core.survival
    survival.refresh()
    return sorted(survival.known)


def revoke(comm: Communicator) -> None:
    """Make every rank's pending and later calls on this communicator raise tcoll.RevokedError.

    Not collective and returns at once: the other ranks learn it as they make
    progress in any tcoll call (a rank blocked in a call on this communicator
    leaves it with RevokedError, even one that waits on a live rank). Every
    rank that learns it passes it on, so it reaches all even if this rank
    dies meanwhile. Afterwards only failed(), agree(), shrink() and close()
    work on it. Revoking twice does nothing more.
    """
    comm.core.check_open(revoked_ok=True)
    comm.core.survival.revoke(comm.rank)


def agree(comm: Communicator, flag: int = 1, timeout: float | None = None) -> int:
    """The bitwise AND of `flag` over the ranks that live; collective over them.

    Every surviving rank gets the same value, even when more ranks die during
    the call (a rank that dies after it voted may or may not count). Works on
    a revoked communicator. This is the consensus that lets survivors decide
    together ("did every rank finish step k?").

    Args:
        flag: an integer that fits in 64 bits (signed); 1 and 0 make a vote.
        timeout: seconds to wait for the others (default: the communicator's).

    Returns:
        The AND of the flags.

    Raises:
        ValueError: flag is not an integer of 64 bits.
        tcoll.TimeoutError: a live rank did not take part in time.
    """
    if isinstance(flag, bool) or not isinstance(flag, int) or not _FLAG_MIN <= flag <= _FLAG_MAX:
        raise ValueError(f"agree takes an integer of 64 bits (signed), not {flag!r}")
    comm.core.check_open(revoked_ok=True)
    wait = comm.timeout if timeout is None else timeout
    return comm.core.survival.agree(flag, 0, wait).flag


def shrink(comm: Communicator, timeout: float | None = None) -> Communicator:
    """A new communicator of the ranks that live, in this one's order, renumbered; collective over them.

    The survivors agree on who is dead, then check that nobody found another
    death meanwhile (else they agree again), so a rank that dies during the
    shrink is left out like the others. Works on a revoked communicator (the
    usual way: catch PeerLostError, revoke, shrink). A rank that dies after
    the shrink is seen by the new communicator's calls (PeerLostError): shrink
    that one in turn. Closing the new communicator closes this one too.

    Args:
        timeout: seconds to wait for the others, per round (default: the communicator's).

    Returns:
        The survivors' communicator (this rank's rank in it may be lower).

    Raises:
        tcoll.TimeoutError: a live rank did not take part in time.
    """
    core = comm.core
    core.check_open(revoked_ok=True)
    survival = core.survival
    engine = core.engine
    wait = comm.timeout if timeout is None else timeout
    while True:
        decision = survival.agree(1, engine.next_context, wait, SHRINK)
        survival.refresh()
        unseen = int(not set(survival.known) - set(decision.failed))
        check = survival.agree(unseen, 0, wait, CHECK)
        if check.flag and check.failed == decision.failed:  # nobody found another death since: it holds
            break
    engine.next_context = max(engine.next_context, decision.context + 1)
    members = [core.world[r] for r in range(comm.size) if r not in decision.failed]
    return type(comm)(engine, core.transports, comm.run_id, world_ranks=members, context=decision.context,
                      parent=comm, replaces=True)
