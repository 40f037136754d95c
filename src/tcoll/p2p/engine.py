"""The point-to-point engine of one rank: matching, progress and waiting.

One engine per rank owns a channel per peer (whatever transport serves it),
the receives posted but not yet matched, and the messages that arrived before
their receive was posted. Progress is driven by the callers: whoever waits
moves data for everyone (as MPI does without a progress thread), under one
lock, so concurrent waiters on several threads are safe.

Waiting is adaptive (see `tcoll.p2p.waiting`): poll for a self-tuned budget (yielding the CPU at each
poll when ranks outnumber cores), then block on this rank's doorbell, which every peer rings after it
publishes data or frees space for us. While blocked, the engine wakes every `liveness_interval` seconds
to ask the channels it waits on whether their peers still live, so a dead peer fails its operations in
seconds.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..env import Settings
from ..errors import PeerLostError, TcollError, TimeoutError, TransportError, fresh
from . import notice, status, timeline
from .channel import Channel
from .hosts import HostMap
from .waiting import Doorbell, SpinPolicy, bind_share, cpu_count
from .matching import Matcher
from .watch import BlockWatch
from .work import RecvWork, SendWork, Work

__all__ = ["Engine"]

_POLL_NAP = 50e-6  # seconds a waiter with MPI channels sleeps between polls once its spin budget is spent
_LEAN_SPIN_S = 20e-6  # a lean receive's most polling before the ordinary wait (it holds the engine's lock)


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
        self.spin = SpinPolicy(settings.spin_us, oversubscribed=False, yield_after_us=settings.spin_yield_us)
        self.channels: list[Channel | None] = [None] * size
        self.lean: list[Channel | None] = [None] * size  # the channels with a lean blocking path, by peer
        self._active: list[Channel] = []
        self.lock = threading.RLock()  # completions and their callbacks run under it: hold it to step a call
        self.matcher = Matcher(self)
        # Channels call these for every message: bound here, with no layer in between.
        self.match = self.matcher.match
        self.recv_done = self.matcher.done
        self.expects_from = self.matcher.expects_from
        self._lost: dict[int, PeerLostError] = {}
        self.closed = False
        self.in_progress = 0  # depth of _progress calls; callbacks wait until it is 0
        self.deferred: list[Work] = []  # works whose callbacks are due
        self.next_context = 1  # the lowest communicator context this rank has not used (0: the world)
        self.closers: list[Callable[[], None]] = []  # called by close(): what higher layers opened on it
        self.hosts = HostMap.single(size)  # which ranks share a host: set from the rendezvous cards
        self.link_latency = 0.0  # seconds a message takes between hosts, measured and agreed at connect
        self.poll_only = False  # a channel has nothing that could wake a sleeper (MPI): waits poll, never sleep
        self.host_shares_pids = True  # every rank of this host sees the others' pids (set when connecting)
        self.timeline = timeline.from_env(rank)  # TCOLL_TRACE: None when off, the only cost then
        self.waiting: status.Waiting | None = None  # what a long wait waits for: set on its slow path (status)
        self.callers: list[Any] = []  # weak references to what numbers calls on it (dispatchers), for reports
        self._lean_spin()

    def _lean_spin(self) -> None:
        """How long a lean receive polls before the ordinary wait takes over, and whether its polls yield."""
        spin = self.spin
        self.lean_spin_ns = int(min(spin.max_s if spin.oversubscribed else spin.fast_s, _LEAN_SPIN_S) * 1e9)
        self.lean_yields = spin.oversubscribed

    # -- setup ---------------------------------------------------------------

    def add_channel(self, channel: Channel) -> None:
        """Route messages to and from channel.peer through `channel`."""
        with self.lock:
            self.channels[channel.peer] = channel
            self._active.append(channel)
            if channel.lean and self.timeline is None:  # a traced run sees every message go through isend
                self.lean[channel.peer] = channel

    def set_ranks_on_host(self, count: int, index: int = 0, processes: bool = False) -> None:
        """Tune waiting for `count` ranks sharing this host: more ranks than cores poll less and yield.

        Args:
            index: this rank's place among them.
            processes: they are separate processes (not threads of one): with settings.bind "auto",
                each keeps to its own share of the cores when there are enough (waiting.bind_share).
        """
        oversubscribed = count > cpu_count()
        self.spin = SpinPolicy(self.settings.spin_us, oversubscribed=oversubscribed,
                               yield_after_us=self.settings.spin_yield_us)
        self._lean_spin()
        if processes and not oversubscribed and self.settings.bind == "auto":
            bind_share(index, count)

    def transport_of(self, peer: int) -> str:
        """The name of the transport that serves `peer` ("self" for this rank)."""
        channel = self.channels[peer]
        return "self" if channel is None else channel.transport_name

    def is_lost(self, peer: int) -> bool:
        """Whether `peer` is known to be gone."""
        return peer in self._lost

    def withdraw(self, ctx: int, error: BaseException) -> None:
        """Close context `ctx` with `error`: its unmatched receives and its probes fail with it, and what comes
        for it is drained and dropped (a peer blocked sending on it finishes; see Matcher.withdraw)."""
        with self.lock:
            self._fail_all(self.matcher.withdraw(ctx, error), error)
            self._wake_own()

    def cancel(self, work: RecvWork) -> bool:
        """Withdraw a posted receive that no message has matched yet (see Matcher.cancel)."""
        with self.lock:
            withdrawn = self.matcher.cancel(work)
            if withdrawn:
                self._wake_own()
            return withdrawn

    def abandon(self, ctx: int, lo: int, hi: int) -> None:
        """Discard messages with context `ctx` and a tag in [lo, hi): those of a call that failed here."""
        with self.lock:
            self.matcher.abandon(ctx, lo, hi)

    def watch(self, ctx: int, watch: BlockWatch | None) -> None:
        """Classify the messages of context `ctx` that no receive takes with `watch` (None: stop)."""
        with self.lock:
            self.matcher.watch(ctx, watch)

    # -- posting -------------------------------------------------------------

    def isend(self, data: np.ndarray, peer: int, ctx: int, tag: int, user_buffer: Any = None,
              stamp: int = 0) -> SendWork:
        """Start sending the bytes `data` to world rank `peer`, stamped `stamp`; returns the SendWork."""
        work = SendWork(self, peer, ctx, tag, data, user_buffer, stamp)
        if self.timeline is not None:
            self.timeline.sent(peer, ctx, tag, int(data.nbytes))
        with self.lock:
            self._check_peer(peer)
            if peer == self.rank:
                self._send_to_self(work)
            else:
                self.channels[peer].post(work)  # type: ignore[union-attr]
        return work

    def irecv(self, data: np.ndarray, peer: int, ctx: int, tag: int, user_buffer: Any = None,
              stamp: int | None = None) -> RecvWork:
        """Post a receive of at most data.nbytes bytes from world rank `peer` (of a message stamped `stamp`).

        A message with another stamp fails the receive with MismatchError (stamp None: any is taken).
        """
        work = RecvWork(self, peer, ctx, tag, data, user_buffer, stamp=stamp)
        if self.timeline is not None:
            work.add_done_callback(self._traced)
        with self.lock:
            if ctx in self.matcher.closed:  # revoked or closed meanwhile (by another thread): nothing will come
                work._fail(fresh(self.matcher.closed[ctx]))
            elif not self.matcher.post(work):
                self._check_peer(peer)  # what a lost peer sent before it went is still delivered
                self.matcher.queue(work)
        return work

    def send_now(self, buf: Any, peer: int, ctx: int, tag: int) -> bool:
        """Send a user message at once through the lean path of `peer`'s channel, if the common case holds.

        The common case: the channel has one (shared memory, with its C kernel), no other thread is in
        the engine, nothing is queued before the message and it fits in the ring now.

        Returns:
            True if sent (`buf` may be reused); False if nothing was done (then isend it).
        """
        channel = self.lean[peer]
        if channel is None or not self.lock.acquire(False):  # another thread in the engine: it waits its turn
            return False
        try:
            return channel.send_now(ctx, tag, buf)
        finally:
            self.lock.release()

    def recv_now(self, buf: Any, peer: int, ctx: int, tag: int) -> bool:
        """Receive a user message at once through the lean path of `peer`'s channel, if the common case holds.

        The common case: the channel has one, no other thread is in the engine, no posted receive,
        wildcard, probe or early message could claim the message first, and the channel's next
        message is (ctx, tag), fits `buf`, and comes within the lean spin.

        Returns:
            True if received into `buf`; False if nothing was taken (then irecv it).
        """
        channel = self.lean[peer]
        if channel is None or not self.lock.acquire(False):
            return False
        try:
            matcher = self.matcher
            if (matcher.posted_from[peer] or matcher.wild_any or matcher.probing
                    or (peer, ctx, tag) in matcher.unexpected):
                return False
            return channel.recv_now(ctx, tag, buf, self.lean_spin_ns, self.lean_yields)
        finally:
            self.lock.release()

    def _traced(self, work: Work) -> None:
        """Note a completed receive on the timeline (a failed one moved no message)."""
        if work._error is None and self.timeline is not None and isinstance(work, RecvWork):
            self.timeline.received(work.peer, work.ctx, work.tag, work.nbytes)

    def probe(self, peer: int, ctx: int, tag: int, timeout: float | None = None) -> RecvWork | None:
        """The earliest message that a receive (peer, ctx, tag), wildcards allowed, would take; not taken.

        Large messages still in their channels are taken in (copied aside) so that they can be seen.

        Args:
            timeout: None: look once (iprobe); else block up to `timeout` s until one comes (probe).

        Returns:
            The message's record (its peer, tag and nbytes are set), or None (looked once: none yet).

        Raises:
            tcoll.TimeoutError: blocking, and none came in time. The context's error: it was closed (withdraw).
        """
        matcher = self.matcher
        deadline = None if timeout is None else time.monotonic() + timeout

        def found() -> RecvWork | None:
            key = matcher.earliest(peer, ctx, tag)
            return None if key is None else matcher.unexpected[key][0]

        with self.lock:
            matcher.probing += 1
        try:
            while True:
                with self.lock:
                    self._progress()
                    message = found()
                    if message is None and ctx in matcher.closed:
                        raise fresh(matcher.closed[ctx])  # (revoked meanwhile)
                    if message is None and peer >= 0:
                        self._check_peer(peer)  # a lost peer sends nothing more
                if message is not None or deadline is None:
                    return message
                left = deadline - time.monotonic()
                if left <= 0:
                    what = f"{'any rank' if peer < 0 else f'rank {peer}'}, tag {'any' if tag < 0 else tag}"
                    raise TimeoutError(f"probe ({what}) found no message within {timeout:g} s",
                                       [peer] if peer >= 0 else [])
                self.block_unless(lambda: found() or ctx in matcher.closed, min(left, self.settings.liveness_interval))
        finally:
            with self.lock:
                matcher.probing -= 1

    def _check_peer(self, peer: int) -> None:
        if self.closed:
            raise TcollError("the communicator is closed")
        if peer in self._lost:
            raise PeerLostError(peer, str(self._lost[peer]).partition(": ")[2])

    def _send_to_self(self, send: SendWork) -> None:
        """Deliver a message to this rank: copy it aside (eager), then match it."""
        target = self.match(self.rank, send.ctx, send.tag, send.nbytes, send.stamp)
        assert target is not None  # self-messages are never deferred
        if target.data is not None:
            target.data[:send.nbytes] = send.data
        target.offset = send.nbytes
        self.recv_done(target)
        self.send_done(send)
        self._wake_own()

    def send_done(self, work: SendWork) -> None:
        """A channel handed over the last byte of `work`."""
        work._finish(work.user_buffer)

    # -- progress and waiting ------------------------------------------------

    def poll(self) -> bool:
        """Make one round of progress on every channel; True if anything moved."""
        with self.lock:
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
        if self.in_progress == 0:
            while self.deferred:
                self.deferred.pop(0)._run_callbacks()
            if self.matcher.alarms:
                self.matcher.run_alarms()
        return moved

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
        notice_at = start + notice.notice_after()  # a long wait says so, once
        spin_start = start
        blocked = False
        while not work._done:
            with self.lock:
                moved = self._progress()
            if work._done:
                break
            now = time.monotonic()
            if now >= next_liveness:  # checked even while other traffic keeps flowing
                self._check_liveness(work)
                next_liveness = now + self.settings.liveness_interval
                if work._done:
                    break
                notice_at = status.note_wait(self, self.rank, work, start, now, notice_at, limit)  # slow path only
            if now >= deadline:
                raise self._timeout_error(work, limit)
            if moved:
                spin_start = now  # a pipeline is flowing: the next piece comes soon
                continue
            if now - spin_start < self.spin.budget_s:
                if now - spin_start >= self.spin.fast_s:
                    os.sched_yield()  # past the first microseconds: let a rank that shares this core run
                continue
            if self.poll_only:  # nothing would wake a sleeper: nap briefly so oversubscribed peers get the core
                self._block(work, _POLL_NAP)
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
        with self.lock:
            seq = bell.prepare_sleep()
            if self._progress() or ready() or self.closed:
                bell.end_sleep()
                return
        try:
            bell.sleep(seq, timeout)
        finally:
            with self.lock:
                bell.end_sleep()

    def _check_liveness(self, work: Work) -> None:
        """Ask the channels of the peers `work` waits on whether those peers live.

        What a peer sent before it died is taken in first: its last message
        must not be lost because the check came before the progress.
        """
        with self.lock:
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
        with self.lock:
            self._progress()
            for peer in peers:
                if peer in self._lost:
                    raise fresh(self._lost[peer])
                channel = self.channels[peer]
                if channel is None:
                    continue
                try:
                    channel.check_alive()
                except PeerLostError as exc:
                    self._progress()  # its last messages came before its end (a notice, say): take them in first
                    self.fail_peer(peer, exc)
                    raise

    def _timeout_error(self, work: Work, limit: float) -> TimeoutError:
        peers = work.peers()
        waiting = f"; still waiting on rank(s) {peers}" if peers else ""
        return TimeoutError(f"{work.description} did not complete within {limit:g} s{waiting}", peers)

    # -- failure and shutdown ------------------------------------------------

    def fail_peer(self, peer: int, error: PeerLostError) -> None:
        """Fail every operation pending on `peer` and refuse new ones."""
        with self.lock:
            if peer in self._lost:
                return
            if self.hosts.count > 1 and "host " not in error.detail:
                # Between hosts a lost link usually means a lost host: say which, and who else was on it.
                error = PeerLostError(peer, f"{error.detail} ({self.hosts.describe([peer])})")
            self._lost[peer] = error = error.with_traceback(None)  # kept: not its frames (callers'); see errors.fresh
            self.lean[peer] = None
            channel = self.channels[peer]
            if channel is not None:
                if channel in self._active:
                    self._active.remove(channel)
                self._shut(channel, error)
            self._fail_all(self.matcher.take(peer), error)
            self._wake_own()

    @staticmethod
    def _shut(channel: Channel, error: BaseException) -> None:
        for pending in channel.pending_works():
            pending._fail(error)
        channel.close()

    @staticmethod
    def _fail_all(works: list[RecvWork], error: BaseException) -> None:
        """Fail `works`, taken out of the engine's queues first: failing runs callbacks that may cancel others."""
        for work in works:
            work._fail(error)  # (a work done already stays as it was: _fail does nothing then)

    def close(self) -> None:
        """Close every channel; pending operations fail."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            error = TcollError("the communicator was closed")
            for channel in self._active:
                self._shut(channel, error)
            self._active.clear()
            self._fail_all(self.matcher.take(None), error)
            self.channels = [None] * self.size
            self.lean = [None] * self.size
            self.doorbell.wake()  # threads blocked in wait() see the failures now
        for closer in self.closers:
            closer()
        self.closers.clear()
        if self.timeline is not None:
            self.timeline.write()
