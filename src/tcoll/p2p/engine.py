"""The point-to-point engine of one rank: matching, progress and waiting.

One engine per rank owns a channel per peer (whatever transport serves it),
the receives posted but not yet matched, and the messages that arrived before
their receive was posted. Progress is driven by the callers: whoever waits
moves data for everyone (as MPI does without a progress thread), under one
lock, so concurrent waiters on several threads are safe.

Waiting is adaptive (see `tcoll.p2p.waiting`): poll for a self-tuned budget
(yielding the CPU at each poll when ranks outnumber cores), then block on this
rank's doorbell, which every peer rings after it publishes
data or frees space for us. While blocked, the engine wakes every
`liveness_interval` seconds to ask the channels it waits on whether their
peers still live, so a dead peer fails its operations in seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..env import Settings
from ..errors import MessageSizeError, PeerLostError, TcollError, TimeoutError, TransportError
from .channel import Channel
from .waiting import Doorbell, SpinPolicy, cpu_count
from .work import RecvWork, SendWork, Work

__all__ = ["Engine"]

_Key = tuple[int, int, int]  # (peer, ctx, tag)
_EMPTY = np.empty(0, dtype=np.uint8)
_ABANDONED_KEPT = 256  # failed collective calls whose late messages are discarded on arrival


class Engine:
    """Point-to-point messaging for one rank.

    Args:
        rank: this rank in the world.
        size: the number of ranks in the world.
        settings: tuning knobs (timeout, eager limit, spin budget, ...).
        doorbell: what peers ring to wake this rank.
    """

    def __init__(self, rank: int, size: int, settings: Settings, doorbell: Doorbell) -> None:
        self.rank = rank
        self.size = size
        self.settings = settings
        self.doorbell = doorbell
        self.spin = SpinPolicy(settings.spin_us, oversubscribed=False)
        self.channels: list[Channel | None] = [None] * size
        self._active: list[Channel] = []
        self._lock = threading.RLock()
        self._posted: dict[_Key, deque[RecvWork]] = {}
        self._posted_from = [0] * size
        self._unexpected: dict[_Key, deque[RecvWork]] = {}
        self._lost: dict[int, PeerLostError] = {}
        self.closed = False
        self.in_progress = 0  # depth of _progress calls; callbacks wait until it is 0
        self.deferred: list[Work] = []  # works whose callbacks are due
        self.next_context = 1  # the lowest communicator context this rank has not used (0: the world)
        self._abandoned: deque[tuple[int, int, int]] = deque(maxlen=_ABANDONED_KEPT)  # (ctx, lo, hi) tags
        self.closers: list[Callable[[], None]] = []  # called by close(): what higher layers opened on it

    # -- setup ---------------------------------------------------------------

    def add_channel(self, channel: Channel) -> None:
        """Route messages to and from channel.peer through `channel`."""
        with self._lock:
            self.channels[channel.peer] = channel
            self._active.append(channel)

    def set_ranks_on_host(self, count: int) -> None:
        """Tune waiting for `count` ranks sharing this host: more ranks than cores poll less and yield."""
        self.spin = SpinPolicy(self.settings.spin_us, oversubscribed=count > cpu_count())

    def transport_of(self, peer: int) -> str:
        """The name of the transport that serves `peer` ("self" for this rank)."""
        channel = self.channels[peer]
        return "self" if channel is None else channel.transport_name

    def is_lost(self, peer: int) -> bool:
        """Whether `peer` is known to be gone."""
        return peer in self._lost

    def cancel(self, work: RecvWork) -> bool:
        """Withdraw a posted receive that no message has matched yet.

        Returns:
            True if withdrawn; False if a message already matched it (it completes as usual).
        """
        key = (work.peer, work.ctx, work.tag)
        with self._lock:
            posted = self._posted.get(key)
            if not posted or work not in posted:
                return False
            posted.remove(work)
            if not posted:
                del self._posted[key]
            self._posted_from[work.peer] -= 1
            work._fail(TcollError(f"{work.description} was cancelled"))
            self._wake_own()
            return True

    def abandon(self, ctx: int, lo: int, hi: int) -> None:
        """Discard messages with context `ctx` and a tag in [lo, hi): those of a call that failed here.

        What already arrived is dropped now; what arrives later is drained
        without being kept (the most recent failed calls are remembered).
        """
        with self._lock:
            self._abandoned.append((ctx, lo, hi))
            for key in [k for k in self._unexpected if k[1] == ctx and lo <= k[2] < hi]:
                del self._unexpected[key]

    def _is_abandoned(self, ctx: int, tag: int) -> bool:
        return any(c == ctx and lo <= tag < hi for c, lo, hi in self._abandoned)

    def expects_from(self, peer: int) -> bool:
        """Whether a receive from `peer` is posted and not yet matched."""
        return self._posted_from[peer] > 0

    # -- posting -------------------------------------------------------------

    def isend(self, data: np.ndarray, peer: int, ctx: int, tag: int, user_buffer: Any = None) -> SendWork:
        """Start sending the bytes `data` to world rank `peer`; returns the SendWork."""
        work = SendWork(self, peer, ctx, tag, data, user_buffer)
        with self._lock:
            self._check_peer(peer)
            if peer == self.rank:
                self._send_to_self(work)
            else:
                self.channels[peer].post(work)  # type: ignore[union-attr]
        return work

    def irecv(self, data: np.ndarray, peer: int, ctx: int, tag: int, user_buffer: Any = None) -> RecvWork:
        """Post a receive of at most data.nbytes bytes from world rank `peer`."""
        work = RecvWork(self, peer, ctx, tag, data, user_buffer)
        key = (peer, ctx, tag)
        with self._lock:
            early = self._unexpected.get(key)
            if not early:
                self._check_peer(peer)  # what a lost peer sent before it went is still delivered
            if early:
                arrived = early.popleft()
                if not early:
                    del self._unexpected[key]
                self._adopt(arrived, work)
            else:
                self._posted.setdefault(key, deque()).append(work)
                self._posted_from[peer] += 1
        return work

    def _check_peer(self, peer: int) -> None:
        if self.closed:
            raise TcollError("the communicator is closed")
        lost = self._lost.get(peer)
        if lost is not None:
            raise PeerLostError(peer, str(lost).partition(": ")[2])

    def _send_to_self(self, send: SendWork) -> None:
        """Deliver a message to this rank: copy it aside (eager), then match it."""
        target = self.match(self.rank, send.ctx, send.tag, send.nbytes)
        assert target is not None  # self-messages are never deferred
        if target.data is not None:
            target.data[:send.nbytes] = send.data
        target.offset = send.nbytes
        self.recv_done(target)
        self.send_done(send)
        self._wake_own()

    # -- called by channels (lock held) --------------------------------------

    def match(self, peer: int, ctx: int, tag: int, nbytes: int) -> RecvWork | None:
        """Find the receive for an arriving message, or say to leave it queued.

        Returns:
            The posted receive (oldest first); a private unexpected receive if
            none is posted and the message is small, or must be drained to reach
            others behind it; None to leave a large message in its channel.
        """
        key = (peer, ctx, tag)
        posted = self._posted.get(key)
        if posted:
            work = posted.popleft()
            if not posted:
                del self._posted[key]
            self._posted_from[peer] -= 1
            work.nbytes = nbytes
            if nbytes > work.capacity:
                work.data = None  # discard the payload; fail once it has streamed past
            return work
        if self._abandoned and self._is_abandoned(ctx, tag):
            sink = RecvWork(self, peer, ctx, tag, None, None, f"late message of a failed call (tag {tag})")
            sink.nbytes = nbytes  # streamed past and dropped; nobody waits for it
            return sink
        if nbytes > self.settings.eager_limit and self._posted_from[peer] == 0 and peer != self.rank:
            return None
        early = RecvWork(self, peer, ctx, tag, np.empty(nbytes, dtype=np.uint8) if nbytes else _EMPTY, None,
                         f"unexpected message from rank {peer} (tag {tag})")
        early.nbytes = nbytes
        self._unexpected.setdefault(key, deque()).append(early)
        return early

    def recv_done(self, work: RecvWork) -> None:
        """A channel finished receiving `work`'s payload."""
        if work.data is None and work.nbytes > 0:
            work._fail(MessageSizeError(
                f"{work.description}: the message has {work.nbytes} bytes but the receive buffer holds "
                f"only {work.capacity}; the message was discarded"))
        else:
            work._finish(work.user_buffer)
        if work.forward is not None:
            self._deliver(work, work.forward)

    def send_done(self, work: SendWork) -> None:
        """A channel handed over the last byte of `work`."""
        work._finish(work.user_buffer)

    def _adopt(self, arrived: RecvWork, work: RecvWork) -> None:
        """Match a posted receive with a message that arrived before it."""
        if arrived._done:
            self._deliver(arrived, work)
        else:
            arrived.forward = work

    @staticmethod
    def _deliver(arrived: RecvWork, work: RecvWork) -> None:
        """Copy an unexpected message into the receive that finally matched it."""
        work.nbytes = arrived.nbytes
        if arrived._error is not None:
            work._fail(arrived._error)
        elif arrived.nbytes > work.capacity:
            work._fail(MessageSizeError(
                f"{work.description}: the message has {arrived.nbytes} bytes but the receive buffer "
                f"holds {work.capacity}; the message was discarded"))
        else:
            if arrived.nbytes:
                work.data[:arrived.nbytes] = arrived.data  # type: ignore[index]
            work.offset = arrived.nbytes
            work._finish(work.user_buffer)

    # -- progress and waiting ------------------------------------------------

    def poll(self) -> bool:
        """Make one round of progress on every channel; True if anything moved."""
        with self._lock:
            return self._progress()

    def _wake_own(self) -> None:
        """Wake this rank's threads sleeping on its doorbell: one may wait for what just completed."""
        if self.doorbell.sleepers:
            self.doorbell.wake()

    def _progress(self) -> bool:
        """One round over every channel (lock held); completion callbacks run after it.

        Channels complete works in the middle of their loops; a callback that
        posted or polled from there would re-enter a channel mid-update, so
        callbacks are collected by Work._finish / _fail and run here, last.
        """
        self.in_progress += 1
        try:
            moved = self._progress_channels()
        finally:
            self.in_progress -= 1
        if self.in_progress == 0 and self.deferred:
            self._run_deferred()
        return moved

    def _run_deferred(self) -> None:
        while self.deferred:
            work = self.deferred.pop(0)
            work._run_callbacks()

    def _progress_channels(self) -> bool:
        moved = False
        for channel in tuple(self._active):
            try:
                if channel.progress():
                    moved = True
            except PeerLostError as exc:
                self.fail_peer(channel.peer, exc)
                moved = True
            except TransportError as exc:  # the stream is unusable: as good as lost
                self.fail_peer(channel.peer, PeerLostError(channel.peer, str(exc)))
                moved = True
        if moved and self.doorbell.sleepers:
            self.doorbell.wake()  # another thread of this rank may sleep waiting for what moved
        return moved

    def wait(self, work: Work, timeout: float | None = None) -> None:
        """Drive progress until `work` is done: poll for the spin budget, then block.

        Raises:
            tcoll.TimeoutError: naming the operation and the ranks it waits on.
        """
        if work._done:
            return
        limit = self.settings.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        next_liveness = start + self.settings.liveness_interval
        spin_start = start
        blocked = False
        while not work._done:
            with self._lock:
                moved = self._progress()
            if work._done:
                break
            now = time.monotonic()
            if now >= next_liveness:  # checked even while other traffic keeps flowing
                self._check_liveness(work)
                next_liveness = now + self.settings.liveness_interval
                if work._done:
                    break
            if now >= deadline:
                raise self._timeout_error(work, limit)
            if moved:
                spin_start = now  # a pipeline is flowing: the next piece comes soon
                continue
            if now - spin_start < self.spin.budget_s:
                if self.spin.yield_while_polling:
                    os.sched_yield()
                continue
            blocked = True
            self._block(work, min(deadline, next_liveness) - now)
            spin_start = time.monotonic()
        self.spin.record(time.monotonic() - start, blocked)

    def _block(self, work: Work, timeout: float) -> None:
        """Sleep on the doorbell unless progress is possible or `work` is done (re-checked after announcing)."""
        self.block_unless(lambda: work._done, timeout)

    def block_unless(self, ready: Callable[[], bool], timeout: float) -> None:
        """Sleep on this rank's doorbell for up to `timeout` s, unless progress is possible or ready().

        Both are re-checked after the sleep is announced, so a peer that
        publishes and rings in between is never missed. Peers ring the
        doorbell for point-to-point traffic and for shared-memory collectives
        alike, so one sleep serves both.
        """
        bell = self.doorbell  # the same one throughout, even if close() swaps it meanwhile
        with self._lock:
            seq = bell.prepare_sleep()
            if self._progress() or ready() or self.closed:
                bell.end_sleep()
                return
        try:
            bell.sleep(seq, timeout)
        finally:
            with self._lock:
                bell.end_sleep()

    def _check_liveness(self, work: Work) -> None:
        """Ask the channels of the peers `work` waits on whether those peers live.

        What a peer sent before it died is taken in first: its last message
        must not be lost because the check came before the progress.
        """
        with self._lock:
            self._progress()
            for peer in work.peers():
                channel = self.channels[peer] if 0 <= peer < self.size else None
                if channel is None or peer in self._lost:
                    continue
                try:
                    channel.check_alive()
                except PeerLostError as exc:
                    self._progress()  # it may have written its last message just before it went
                    if peer in work.peers():
                        self.fail_peer(peer, exc)

    def probe_peers(self, peers: list[int]) -> None:
        """Check that the world ranks `peers` live; a lost one is failed here and raised.

        Raises:
            PeerLostError: naming the first peer found gone.
        """
        with self._lock:
            self._progress()
            for peer in peers:
                lost = self._lost.get(peer)
                if lost is not None:
                    raise lost
                channel = self.channels[peer]
                if channel is None:
                    continue
                try:
                    channel.check_alive()
                except PeerLostError as exc:
                    self.fail_peer(peer, exc)
                    raise

    def _timeout_error(self, work: Work, limit: float) -> TimeoutError:
        peers = work.peers()
        waiting = f"; still waiting on rank(s) {peers}" if peers else ""
        return TimeoutError(f"{work.description} did not complete within {limit:g} s{waiting}", peers)

    # -- failure and shutdown ------------------------------------------------

    def fail_peer(self, peer: int, error: PeerLostError) -> None:
        """Fail every operation pending on `peer` and refuse new ones."""
        with self._lock:
            if peer in self._lost:
                return
            self._lost[peer] = error
            channel = self.channels[peer]
            if channel is not None:
                if channel in self._active:
                    self._active.remove(channel)
                for pending in channel.pending_works():
                    pending._fail(error)
                channel.close()
            # Failing a work runs callbacks that may cancel other receives: take everything out first.
            posted = [work for key in [k for k in self._posted if k[0] == peer] for work in self._posted.pop(key)]
            self._posted_from[peer] = 0
            early = [work for key, queue in self._unexpected.items() if key[0] == peer for work in queue]
            for work in posted + early:
                if not work._done:
                    work._fail(error)
            self._wake_own()

    def close(self) -> None:
        """Close every channel; pending operations fail."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            error = TcollError("the communicator was closed")
            for channel in self._active:
                for pending in channel.pending_works():
                    pending._fail(error)
                channel.close()
            self._active.clear()
            # Failing a work runs callbacks that may cancel other receives: take everything out first.
            posted = [work for queue in self._posted.values() for work in queue]
            early = [work for queue in self._unexpected.values() for work in queue]
            self._posted.clear()
            self._unexpected.clear()
            self._posted_from = [0] * self.size
            for work in posted + early:
                if not work._done:
                    work._fail(error)
            self.channels = [None] * self.size
            self.doorbell.wake()  # threads blocked in wait() see the failures now
        for closer in self.closers:
            closer()
        self.closers.clear()
