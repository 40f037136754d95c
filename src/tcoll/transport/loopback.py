"""Loopback transport: ranks that are threads of one process.

A send is handed to the peer's channel as a reference. Small messages are
copied at once (eager) so the send completes immediately; large ones are
copied straight from the sender's buffer into the receiver's when the
receive matches (one copy), and the sender learns of it on its next progress.
Each side only changes its own engine's state; the other side is told through
its doorbell.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from typing import Any

from ..errors import PeerLostError
from ..p2p.channel import Channel
from ..p2p.work import SendWork, Work
from .base import Card, Transport

__all__ = ["LoopbackTransport", "LoopbackChannel"]

_HUB_LOCK = threading.Lock()
_HUB: dict[str, dict[int, Any]] = {}  # run id -> world rank -> engine, while connecting
_INBOXES: dict[tuple[str, int, int], deque[Any]] = {}  # (run id, src, dst) -> messages, while connecting


def _inbox(run_id: str, src: int, dst: int) -> deque[Any]:
    """The queue of messages from src to dst; both ends get the same object."""
    with _HUB_LOCK:
        return _INBOXES.setdefault((run_id, src, dst), deque())


class LoopbackTransport(Transport):
    """Channels between ranks that live in the same process."""

    name = "loopback"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._channels: list[LoopbackChannel] = []

    def prepare(self) -> dict[str, Any]:
        with _HUB_LOCK:
            _HUB.setdefault(self.run_id, {})[self.engine.rank] = self.engine
        return {"pid": os.getpid()}

    def can_connect(self, me: Card, peer: Card) -> bool:
        return "loopback" in peer and peer["loopback"]["pid"] == me["loopback"]["pid"]

    def connect(self, peers: list[int], cards: list[Card], store: Any, timeout: float) -> dict[int, Channel]:
        me = self.engine.rank
        with _HUB_LOCK:
            engines = dict(_HUB.get(self.run_id, {}))
        channels: dict[int, Channel] = {}
        for peer in peers:
            channel = LoopbackChannel(self.engine, peer, engines[peer], _inbox(self.run_id, peer, me),
                                      _inbox(self.run_id, me, peer))
            self._channels.append(channel)
            channels[peer] = channel
        # The hub entry may go once every rank of this process has looked the others up.
        store.set(f"connected/{me}", b"1")
        store.wait([f"connected/{peer}" for peer in peers], timeout)
        with _HUB_LOCK:
            hub = _HUB.get(self.run_id, {})
            hub.pop(me, None)
            if not hub:
                _HUB.pop(self.run_id, None)
            for peer in peers:
                _INBOXES.pop((self.run_id, peer, me), None)
        return channels

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        me = self.engine.rank
        with _HUB_LOCK:  # left over when setup failed between prepare and connect
            hub = _HUB.get(self.run_id)
            if hub is not None and hub.get(me) is self.engine:
                del hub[me]
                if not hub:
                    del _HUB[self.run_id]
            for key in [k for k in _INBOXES if k[0] == self.run_id and k[2] == me]:
                del _INBOXES[key]


class LoopbackChannel(Channel):
    """Messages to and from one peer thread."""

    transport_name = "loopback"

    def __init__(self, engine: Any, peer: int, peer_engine: Any, inbox: deque[Any], outbox: deque[Any]) -> None:
        super().__init__(engine, peer)
        self._peer_engine = peer_engine
        self._inbox: deque[tuple[int, int, int, Any, SendWork | None]] = inbox  # filled by the peer
        self._outbox = outbox  # the peer's inbox
        self._in_flight: deque[SendWork] = deque()  # our large sends, until the peer copied them
        self._closed = False

    def _check_peer(self) -> None:
        if self._peer_engine.closed:
            raise PeerLostError(self.peer, "its communicator was closed")

    def post(self, send: SendWork) -> None:
        self._check_peer()
        if send.nbytes <= self.engine.settings.eager_limit:
            self._outbox.append((send.ctx, send.tag, send.stamp, send.data.copy(), None))
            self.engine.send_done(send)
        else:
            self._in_flight.append(send)
            self._outbox.append((send.ctx, send.tag, send.stamp, send.data, send))
        self._peer_engine.doorbell.ring()

    def progress(self) -> bool:
        if self._closed:
            return False
        moved = False
        while self._in_flight and self._in_flight[0].offset == self._in_flight[0].nbytes:
            self.engine.send_done(self._in_flight.popleft())
            moved = True
        inbox = self._inbox
        while inbox:
            ctx, tag, stamp, data, send = inbox[0]
            recv = self.engine.match(self.peer, ctx, tag, data.nbytes, stamp)
            if recv is None:
                break
            inbox.popleft()
            if recv.data is not None and data.nbytes:
                recv.data[:data.nbytes] = data
            recv.offset = data.nbytes
            self.engine.recv_done(recv)
            if send is not None:
                send.offset = send.nbytes  # tells the sender; it completes the send itself
                self._peer_engine.doorbell.ring()
            moved = True
        if not moved and (self._in_flight or self.engine.expects_from(self.peer)):
            self._check_peer()  # raises if the peer closed while we wait on it
        return moved

    def pending_works(self) -> list[Work]:
        return list(self._in_flight)

    def peer_doorbell(self) -> Any:
        return self._peer_engine.doorbell

    def check_alive(self) -> None:
        self._check_peer()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._peer_engine.doorbell.wake()  # let a peer blocked on us notice
