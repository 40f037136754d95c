"""The TCP transport: a listener per rank, a connection per peer, and the watcher that wakes a sleeping engine.

One watcher thread per transport waits in epoll over every socket and rings
the engine's doorbell when one becomes ready. Sockets are registered one-shot
and armed only while the engine is about to sleep (its doorbell counts a
sleeper): while the engine polls, the watcher stays asleep and does not
compete with it for the GIL on every packet.

The channels are `tcoll.transport.tcp.channel`'s; connection set-up and the
handshake live in `tcoll.transport.tcp.connect`.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from typing import TYPE_CHECKING, Any

from ...errors import TransportError
from ..base import Card, Transport
from ..interfaces import choose_address
from .channel import TcpChannel
from .connect import connect_all, open_listener

if TYPE_CHECKING:
    from ...env import Settings
    from ...p2p.channel import Channel
    from ...p2p.engine import Engine
    from ...store import Store

__all__ = ["TcpTransport", "choose_address"]

_ONESHOT = select.EPOLLONESHOT


class TcpTransport(Transport):
    """TCP channels to peers on any host; `master_host` decides which local address to listen on."""

    name = "tcp"

    def __init__(self, engine: Engine, settings: Settings, run_id: str, master_host: str | None = None) -> None:
        super().__init__(engine, settings, run_id, master_host)
        self._listener: socket.socket | None = None
        self._channels: list[TcpChannel] = []
        self._epoll: select.epoll | None = None
        self._stop_fd = -1
        self._watcher: threading.Thread | None = None
        self._armed: dict[int, int] = {}  # fd -> events armed; the watcher zeroes it when they fire
        self._closed = False

    @classmethod
    def available(cls) -> bool:
        """TCP works wherever epoll does (Linux)."""
        return hasattr(select, "epoll")

    def can_connect(self, me: Card, peer: Card) -> bool:
        """True when the peer published a TCP listener."""
        return isinstance(peer.get("tcp"), dict)

    def prepare(self) -> dict[str, Any]:
        """Open the listener; returns {"addr", "port"} for this rank's card.

        Raises:
            TransportError: no usable address.
        """
        if self._listener is None:
            self._listener = open_listener(choose_address(self.settings.tcp_addr, self.master_host,
                                                                self.settings.socket_ifname))
        host, port = self._listener.getsockname()[:2]
        return {"addr": host, "port": port}

    def connect(self, peers: list[int], cards: list[Card], store: Store, timeout: float) -> dict[int, Channel]:
        """Connect to every peer (higher ranks dial lower ones) and start the watcher.

        Returns:
            A TcpChannel per peer.

        Raises:
            tcoll.TimeoutError: some peers did not connect in time (named with their addresses).
            TransportError: a handshake was refused (authentication, another job).
        """
        if self._closed:
            raise TransportError("tcp transport: connect() after close()")
        if self._listener is None:
            raise TransportError("tcp transport: connect() before prepare()")
        try:
            socks = connect_all(self.engine.rank, peers, cards, self._listener, self.run_id,
                                self.settings.auth_key, timeout, self.peer_check,
                                self.settings.tcp_dead_after) if peers else {}
        finally:
            self._listener.close()  # every peer is connected (or failed): refuse later strangers
        channels: dict[int, Channel] = {}
        for peer, sock in socks.items():
            channel = TcpChannel(self.engine, peer, sock, self)
            self._channels.append(channel)  # from here on close() closes its socket
            channels[peer] = channel
        if self._channels:
            self._start_watcher()
        return channels

    def arm(self, fd: int, events: int) -> None:
        """Have the watcher wake the engine once `fd` is ready for `events` (no-op if already armed)."""
        if events and self._armed.get(fd, events) != events:
            self._armed[fd] = events
            self._epoll.modify(fd, events | _ONESHOT)  # type: ignore[union-attr]

    def forget(self, fd: int) -> None:
        """Stop watching `fd` (its channel is closing)."""
        if self._armed.pop(fd, None) is not None and self._epoll is not None:
            try:
                self._epoll.unregister(fd)
            except (OSError, ValueError):
                pass

    def _start_watcher(self) -> None:
        """Register every channel's socket, disarmed, with a new epoll and start the watcher thread."""
        self._epoll = select.epoll()
        self._stop_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._epoll.register(self._stop_fd, select.EPOLLIN)
        for channel in self._channels:
            self._armed[channel.fd] = 0
            self._epoll.register(channel.fd, _ONESHOT)  # disarmed until the engine is about to sleep
        self._watcher = threading.Thread(target=_watch, args=(self._epoll, self._stop_fd, self._armed, self.engine),
                                         name=f"tcoll-tcp-watch-{self.engine.rank}", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Close the channels, stop and join the watcher, close every descriptor (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._watcher is not None:
            os.eventfd_write(self._stop_fd, 1)
            self._watcher.join()
            self._watcher = None
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        if self._stop_fd >= 0:
            os.close(self._stop_fd)
            self._stop_fd = -1
        if self._listener is not None:
            self._listener.close()


def _watch(epoll: select.epoll, stop_fd: int, armed: dict[int, int], engine: Engine) -> None:
    """The watcher thread: ring the engine's doorbell whenever an armed socket becomes ready."""
    while True:
        events = epoll.poll()
        for fd, _ in events:
            if fd == stop_fd:
                return
            if fd in armed:
                armed[fd] = 0  # one-shot: the event disarmed it
        engine.doorbell.ring()
