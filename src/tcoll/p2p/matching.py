"""Matching: which receive an arriving message belongs to, and where a message waits for its receive.

A message matches the oldest receive posted for its (peer, context, tag);
messages from one peer on one tag match in the order they were sent. A
receive may name ANY (-1) as its peer or tag (a wildcard, as MPI_ANY_SOURCE
and MPI_ANY_TAG): a message then goes to whichever matching receive was
posted first, specific or wildcard, so a wildcard never takes a message that
an earlier-posted specific receive would match; a wildcard posted after
messages arrived takes the earliest-arrived one that matches. Wildcards
match only in their own context (a communicator's point-to-point one), so
the collectives' traffic is never theirs. A
message that comes before its receive is taken in (copied aside if small,
or left in its channel if large and nothing else is expected from that
peer) and handed to the receive when it is posted. A receive that expects a
stamp (a collective's) fails with MismatchError when the message carries
another. Messages that no receive takes in a watched context are classified
by its watch (tcoll.p2p.watch). Every method runs with the engine's lock held.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from ..errors import MessageSizeError, MismatchError, TcollError
from .watch import NOTICE, BlockWatch
from .work import RecvWork

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Matcher", "ANY"]

ANY = -1  # a receive's peer or tag that matches every one (MPI_ANY_SOURCE, MPI_ANY_TAG)

_Key = tuple[int, int, int]  # (peer, ctx, tag)
_EMPTY = np.empty(0, dtype=np.uint8)
_ABANDONED_KEPT = 256  # failed collective calls whose late messages are discarded on arrival


class Matcher:
    """One engine's posted receives, the messages that came before theirs, and the watched contexts.

    Args:
        engine: the engine whose messages these are.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.posted: dict[_Key, deque[RecvWork]] = {}
        self.posted_from = [0] * engine.size
        self.unexpected: dict[_Key, deque[RecvWork]] = {}
        self.abandoned: deque[tuple[int, int, int]] = deque(maxlen=_ABANDONED_KEPT)  # (ctx, lo, hi) tags
        self.closed: dict[int, BaseException] = {}  # context -> why (revoked, closed): drained; probes raise
        self.watches: dict[int, BlockWatch] = {}  # context -> its owner's watch (collective contexts)
        self.alarms: list[tuple[BlockWatch, str, int, int, int, bytes]] = []  # run after the round of progress
        self.wild: dict[int, list[RecvWork]] = {}  # ctx -> receives with a wildcard peer or tag, in post order
        self.wild_any = 0  # wildcard receives with any peer: every channel may hold a message for one
        self.probing = 0  # probes under way: large messages are taken in so that they can be seen
        self.posts = 0  # receives posted so far: the order a message's candidates were posted in
        self.arrivals = 0  # unexpected messages so far: the order they came in

    # -- receives ----------------------------------------------------------------

    def post(self, work: RecvWork) -> bool:
        """Hand `work` a message that already came, if one did; False if none (then `queue` it)."""
        key = (work.peer, work.ctx, work.tag)
        if work.peer == ANY or work.tag == ANY:
            key = self.earliest(work.peer, work.ctx, work.tag)  # type: ignore[assignment]
            if key is None:
                return False
        early = self.unexpected.get(key)
        if not early:
            return False
        arrived = early.popleft()
        if not early:
            del self.unexpected[key]
        work.peer, work.tag = arrived.peer, arrived.tag
        if arrived._done:
            self.deliver(arrived, work)
        else:
            arrived.forward = work  # still arriving: it is copied over when complete
        return True

    def earliest(self, peer: int, ctx: int, tag: int) -> _Key | None:
        """The key of the earliest-arrived unexpected message that (peer, ctx, tag), wildcards allowed, matches."""
        best, first = None, -1
        for key, queue in self.unexpected.items():
            if key[1] == ctx and (peer == ANY or key[0] == peer) and (tag == ANY or key[2] == tag):
                order = queue[0].order
                if best is None or order < first:
                    best, first = key, order
        return best

    def queue(self, work: RecvWork) -> None:
        """Post `work` to wait for its message."""
        self.posts += 1
        work.order = self.posts
        if work.peer == ANY or work.tag == ANY:
            self.wild.setdefault(work.ctx, []).append(work)
            if work.peer == ANY:
                self.wild_any += 1
            else:
                self.posted_from[work.peer] += 1
            return
        self.posted.setdefault((work.peer, work.ctx, work.tag), deque()).append(work)
        self.posted_from[work.peer] += 1

    def _unwild(self, work: RecvWork) -> None:
        """Take a wildcard receive out of the posted ones."""
        wild = self.wild[work.ctx]
        wild.remove(work)
        if not wild:
            del self.wild[work.ctx]
        if work.peer == ANY:
            self.wild_any -= 1
        else:
            self.posted_from[work.peer] -= 1

    def cancel(self, work: RecvWork) -> bool:
        """Withdraw a posted receive that no message has matched yet.

        Returns:
            True if withdrawn (it fails, "cancelled"); False if a message already matched it.
        """
        if work in self.wild.get(work.ctx, ()):
            self._unwild(work)
            work._fail(TcollError(f"{work.description} was cancelled"))
            return True
        key = (work.peer, work.ctx, work.tag)
        posted = self.posted.get(key)
        if not posted or work not in posted:
            return False
        posted.remove(work)
        if not posted:
            del self.posted[key]
        self.posted_from[work.peer] -= 1
        work._fail(TcollError(f"{work.description} was cancelled"))
        return True

    def expects_from(self, peer: int) -> bool:
        """Whether a receive from `peer` (or from any peer, or a probe) is posted and not yet matched."""
        return self.posted_from[peer] > 0 or self.wild_any > 0 or self.probing > 0

    def abandon(self, ctx: int, lo: int, hi: int) -> None:
        """Discard messages with context `ctx` and a tag in [lo, hi): those of a call that failed here.

        What already arrived is dropped now; what arrives later is drained
        without being kept (the most recent failed calls are remembered).
        """
        self.abandoned.append((ctx, lo, hi))
        for key in [k for k in self.unexpected if k[1] == ctx and lo <= k[2] < hi]:
            del self.unexpected[key]

    def watch(self, ctx: int, watch: BlockWatch | None) -> None:
        """Classify the messages of `ctx` that no receive takes with `watch` (None: stop).

        Notices of `ctx` that came before it was watched (a rank that made the same new
        communicator a moment earlier, and already spoke on it) are handed over now.
        """
        if watch is None:
            self.watches.pop(ctx, None)
            return
        self.watches[ctx] = watch
        for key in [k for k in self.unexpected if k[1] == ctx]:
            kept = self.unexpected[key]
            for early in [w for w in kept if w.seen & NOTICE]:
                kept.remove(early)
                early.watch = watch
                if early.finished:  # arrived whole: its alarm runs after this round; else when it has
                    payload = b"" if early.data is None else early.data[:early.nbytes].tobytes()
                    self.alarms.append((watch, "notice", early.peer, early.tag, early.seen, payload))
            if not kept:
                del self.unexpected[key]

    def withdraw(self, ctx: int, error: BaseException | None = None) -> list[RecvWork]:
        """Take out every receive posted in context `ctx` that no message has matched yet, to fail them.

        Args:
            error: also close the context (a revoked communicator's): what came for it is dropped, what
                comes is drained without being kept (a sender blocked on it finishes), and a probe of it
                raises `error`.
        """
        if error is not None:
            self.closed[ctx] = error
            for key in [k for k in self.unexpected if k[1] == ctx]:
                del self.unexpected[key]
        works = [w for key in [k for k in self.posted if k[1] == ctx] for w in self.posted.pop(key)]
        for work in works:
            self.posted_from[work.peer] -= 1
        for work in list(self.wild.get(ctx, ())):
            self._unwild(work)
            works.append(work)
        return works

    def take(self, peer: int | None) -> list[RecvWork]:
        """Take out every receive and kept message of `peer` (None: of every peer), to fail them."""
        if peer is None:
            works = [w for queue in self.posted.values() for w in queue]
            works += [w for queue in self.unexpected.values() for w in queue]
            works += [w for wild in self.wild.values() for w in wild]
            self.posted.clear()
            self.unexpected.clear()
            self.wild.clear()
            self.wild_any = 0
            self.posted_from = [0] * len(self.posted_from)
            return works
        works = [w for key in [k for k in self.posted if k[0] == peer] for w in self.posted.pop(key)]
        for wild in list(self.wild.values()):  # a wildcard's peer fails it only if it names that peer
            for work in [w for w in wild if w.peer == peer]:
                self._unwild(work)
                works.append(work)
        self.posted_from[peer] = 0
        return works + [w for key, queue in self.unexpected.items() if key[0] == peer for w in queue]

    # -- called by channels ----------------------------------------------------------

    def match(self, peer: int, ctx: int, tag: int, nbytes: int, stamp: int = 0) -> RecvWork | None:
        """Find the receive for an arriving message, or say to leave it queued.

        Returns:
            The posted receive (oldest first); a private unexpected receive if
            none is posted and the message is small, or must be drained to reach
            others behind it; None to leave a large message in its channel.
        """
        key = (peer, ctx, tag)
        posted = self.posted.get(key)
        wild = self.wild.get(ctx) if self.wild else None
        if wild:
            work = self._wildcard(wild, peer, tag, posted[0] if posted else None)
            if work is not None:
                return self._matched(work, nbytes, stamp)
        if posted:
            work = posted.popleft()
            if not posted:
                del self.posted[key]
            self.posted_from[peer] -= 1
            return self._matched(work, nbytes, stamp)
        if self.abandoned and any(c == ctx and lo <= tag < hi for c, lo, hi in self.abandoned):
            return self.sink(peer, ctx, tag, nbytes, "late message of a failed call")
        if self.closed and ctx in self.closed:
            return self.sink(peer, ctx, tag, nbytes, "message on a closed or revoked communicator")
        watch = self.watches.get(ctx) if self.watches else None
        kind = None if watch is None else watch.classify(tag, stamp)
        if kind is not None:
            return watch.take(self, kind, peer, ctx, tag, nbytes, stamp)  # type: ignore[union-attr]
        engine = self.engine
        if (nbytes > engine.settings.eager_limit and self.posted_from[peer] == 0 and not self.wild_any
                and not self.probing and peer != engine.rank):
            return None
        if watch is not None:
            watch.note(peer, tag, stamp)
        return self.keep(peer, ctx, tag, nbytes, stamp)

    def _wildcard(self, wild: list[RecvWork], peer: int, tag: int, specific: RecvWork | None) -> RecvWork | None:
        """The first-posted wildcard receive that takes (peer, tag), unless `specific` was posted before it."""
        for work in wild:
            if (work.peer == ANY or work.peer == peer) and (work.tag == ANY or work.tag == tag):
                if specific is not None and specific.order < work.order:
                    return None
                self._unwild(work)
                work.peer, work.tag = peer, tag
                return work
        return None

    @staticmethod
    def _matched(work: RecvWork, nbytes: int, stamp: int) -> RecvWork:
        """A posted receive takes an arriving message: check its stamp and size."""
        work.nbytes = nbytes
        if work.stamp is not None and stamp != work.stamp:
            work.seen = stamp  # another call's message: discarded, and the receive fails
            work.data = None
        elif nbytes > work.capacity:
            work.data = None  # discard the payload; fail once it has streamed past
        return work

    def keep(self, peer: int, ctx: int, tag: int, nbytes: int, stamp: int) -> RecvWork:
        """Take in a message no receive waits for, into a buffer of its own, to hand to the receive to come."""
        early = RecvWork(self.engine, peer, ctx, tag, np.empty(nbytes, dtype=np.uint8) if nbytes else _EMPTY,
                         None, f"unexpected message from rank {peer} (tag {tag})")
        early.nbytes = nbytes
        early.seen = stamp
        self.arrivals += 1
        early.order = self.arrivals
        self.unexpected.setdefault((peer, ctx, tag), deque()).append(early)
        return early

    def sink(self, peer: int, ctx: int, tag: int, nbytes: int, what: str) -> RecvWork:
        """A receive that lets a message stream past and drops it; nobody waits for it."""
        sink = RecvWork(self.engine, peer, ctx, tag, None, None, f"{what} (tag {tag})")
        sink.nbytes = nbytes
        return sink

    def done(self, work: RecvWork) -> None:
        """A channel finished receiving `work`'s payload."""
        if work.watch is not None:  # a notice: its watch hears of it after this round
            payload = b"" if work.data is None else work.data.tobytes()
            self.alarms.append((work.watch, "notice", work.peer, work.tag, work.seen, payload))
            work._finish(None)
            return
        if work.data is None and work.stamp is not None and work.seen != work.stamp:
            work._fail(_another_call(work, work.seen))
        elif work.data is None and work.nbytes > 0:
            work._fail(MessageSizeError(
                f"{work.description}: the message has {work.nbytes} bytes but the receive buffer holds "
                f"only {work.capacity}; the message was discarded"))
        else:
            work._finish(work.user_buffer)
        if work.forward is not None:
            self.deliver(work, work.forward)

    @staticmethod
    def deliver(arrived: RecvWork, work: RecvWork) -> None:
        """Copy a message that came early into the receive that finally matched it."""
        work.nbytes = arrived.nbytes
        if arrived._error is not None:
            work._fail(arrived._error)
        elif work.stamp is not None and arrived.seen != work.stamp:
            work.seen = arrived.seen
            work._fail(_another_call(work, arrived.seen))
        elif arrived.nbytes > work.capacity:
            work._fail(MessageSizeError(
                f"{work.description}: the message has {arrived.nbytes} bytes but the receive buffer "
                f"holds {work.capacity}; the message was discarded"))
        else:
            if arrived.nbytes:
                work.data[:arrived.nbytes] = arrived.data  # type: ignore[index]
            work.offset = arrived.nbytes
            work._finish(work.user_buffer)

    def run_alarms(self) -> None:
        """Tell the watches what their contexts' messages revealed (after the channels are consistent)."""
        while self.alarms:
            watch, kind, peer, tag, stamp, payload = self.alarms.pop(0)
            watch.alarm(kind, peer, tag, stamp, payload)


def _another_call(work: RecvWork, theirs: int) -> MismatchError:
    """The raw error of a receive that got another call's message (the call describes it better)."""
    return MismatchError(f"{work.description}: rank {work.peer} sent a message of another call", peer=work.peer,
                         mine=work.stamp or 0, theirs=theirs)
