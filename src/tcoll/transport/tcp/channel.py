"""The TCP channel: one non-blocking socket per peer, between hosts (or on one host when forced).

Data moves only when the engine calls `progress()` (under its lock): queued
sends are pushed header and payload together with one `sendmsg`, and arriving
messages are read header first, then straight into the matched receive's
buffer. Neither direction ever blocks, so a rank that streams a large message
to one neighbour while another streams one to it makes progress both ways.

A channel asks its transport (`tcoll.transport.tcp.transport`) to arm its
socket before the engine sleeps, so that the transport's watcher wakes it.
"""

from __future__ import annotations

import os
import select
import socket
from collections import deque
from typing import TYPE_CHECKING

from ...errors import PeerLostError, TransportError, fresh
from ...keepalive import unacked_for
from ...p2p.channel import HEADER, Channel, pack_header, unpack_header

if TYPE_CHECKING:
    from ...p2p.engine import Engine
    from ...p2p.work import RecvWork, SendWork, Work
    from .transport import TcpTransport

__all__ = ["TcpChannel"]

_HDR = HEADER.size
_CHUNK = 256 << 20  # most bytes one send/recv call is offered: the kernel caps a call near 2 GiB
_SCRATCH = 64 << 10  # discard buffer for payloads that did not fit their receive
_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)  # EPIPE as an error, never SIGPIPE
_IN = select.EPOLLIN | select.EPOLLRDHUP
_OUT = select.EPOLLOUT
_HUNG_UP = getattr(select, "POLLRDHUP", 0x2000) | select.POLLHUP | select.POLLERR  # the peer closed, or the link failed


class TcpChannel(Channel):
    """Messages to and from one peer over a connected, non-blocking TCP socket.

    Args:
        engine: the engine to report to.
        peer: the peer's world rank.
        sock: the connected, handshaken socket.
        transport: the transport whose watcher wakes the engine for this socket.
    """

    transport_name = "tcp"

    def __init__(self, engine: Engine, peer: int, sock: socket.socket, transport: TcpTransport) -> None:
        super().__init__(engine, peer)
        self.sock = sock
        self.fd = sock.fileno()
        self._transport = transport
        self._send = sock.send
        self._sendmsg = sock.sendmsg
        self._recv_into = sock.recv_into
        self._sendq: deque[SendWork] = deque()
        self._hdr_out: bytes | memoryview = b""  # header bytes of the head send not yet sent
        self._hdr_in = bytearray(_HDR)  # reused for every arriving header
        self._hdr_view = memoryview(self._hdr_in)
        self._hdr_got = 0
        self._pending: tuple[int, int, int, int] | None = None  # a decoded header awaiting its receive
        self._target: RecvWork | None = None
        self._view: memoryview | None = None  # the target's buffer; None: discard the payload
        self._scratch: memoryview | None = None
        self._lost: PeerLostError | None = None
        self.closed = False

    # -- engine interface ------------------------------------------------------

    def post(self, send: SendWork) -> None:
        """Queue a send and, if nothing is ahead of it, start pushing it now."""
        queue = self._sendq
        queue.append(send)
        if len(queue) == 1 and self._lost is None:
            try:
                self._push()
            except PeerLostError as exc:  # reported by the next progress(), which the engine handles
                self._lost = exc.with_traceback(None)  # (kept: not the frames it was raised in)
        if queue and self.engine.doorbell.sleepers:
            # Another thread sleeps: it must wake when the socket takes more, or nobody pushes the rest.
            self._arm()

    def progress(self) -> bool:
        """Push queued sends and read arriving messages until the socket would block.

        Returns:
            True if any byte moved or any operation completed.

        Raises:
            PeerLostError: the connection closed or failed.
        """
        if self._lost is not None:
            raise fresh(self._lost)
        moved = self._push() if self._sendq else False
        if self._pull():
            moved = True
        elif not moved and self.engine.doorbell.sleepers:
            # The engine is about to sleep (it counts itself a sleeper before its last look).
            self._arm()
        return moved

    def _arm(self) -> None:
        """Have the watcher wake the engine when this socket can move more bytes."""
        # A header waiting for its receive stops reading: watching for input would only spin.
        self._transport.arm(self.fd, (_IN if self._pending is None else 0) | (_OUT if self._sendq else 0))

    def pending_works(self) -> list[Work]:
        """The queued sends and the receive being filled."""
        works: list[Work] = list(self._sendq)
        if self._target is not None:
            works.append(self._target)
        return works

    def check_alive(self) -> None:
        """Raise PeerLostError if the kernel reports the connection failed (e.g. keep-alive timed out) or closed.

        A close is seen even while unread bytes are ahead of it (a message waiting for its receive
        stops the reads): the kernel flags the peer's end of stream on the socket at once (POLLRDHUP).
        """
        if self.closed:
            return
        code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            raise PeerLostError(self.peer, f"connection failed: {os.strerror(code)}")
        poller = select.poll()
        poller.register(self.fd, _HUNG_UP)
        if poller.poll(0):
            raise PeerLostError(self.peer, "connection closed")
        limit = self.engine.settings.tcp_dead_after  # (keep-alive covers an idle connection; this, a busy one)
        silent = unacked_for(self.sock) if limit > 0 else 0.0
        if silent > limit:
            raise PeerLostError(self.peer, f"no acknowledgement for {silent:.1f} s of the data sent to it "
                                           f"(TCOLL_TCP_DEAD_AFTER={limit:g})")

    def round_trip(self) -> float:
        """The kernel's smoothed round-trip time of this connection, in seconds (0.0 if unknown)."""
        try:
            info = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        except (OSError, AttributeError):
            return 0.0
        # struct tcp_info: 8 bytes of u8 fields, then u32s; tcpi_rtt (microseconds) is the 16th u32.
        return int.from_bytes(info[68:72], "little") * 1e-6 if len(info) >= 72 else 0.0

    def close(self) -> None:
        """Stop watching the socket and close it (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._transport.forget(self.fd)
        self.sock.close()

    # -- data movement -------------------------------------------------------

    def _lost_error(self, exc: OSError | None) -> PeerLostError:
        """Remember that the connection is gone (EOF when `exc` is None) and return the error to raise."""
        detail = "connection closed" if exc is None else f"connection closed ({exc.strerror or exc})"
        self._lost = PeerLostError(self.peer, detail)
        return fresh(self._lost)  # (the kept one is never raised: it would keep the frames it went through)

    def _push(self) -> bool:
        """Send queued messages in order until the socket buffer fills; True if bytes moved."""
        queue = self._sendq
        moved = False
        try:
            while queue:
                send = queue[0]
                nbytes = send.nbytes
                if send.header_sent:
                    offered = min(nbytes - send.offset, _CHUNK)
                    sent = self._send(send.data.data[send.offset:send.offset + offered], _NOSIGNAL)
                    send.offset += sent
                else:
                    head = self._hdr_out or pack_header(send.ctx, send.tag, nbytes, send.stamp)
                    offered = min(nbytes, _CHUNK)
                    if nbytes:
                        sent = self._sendmsg([head, send.data.data[:offered]], (), _NOSIGNAL)
                    else:
                        sent = self._send(head, _NOSIGNAL)
                    moved = True
                    if sent < len(head):
                        self._hdr_out = memoryview(head)[sent:]
                        return True
                    self._hdr_out = b""
                    send.header_sent = True
                    sent -= len(head)
                    send.offset = sent
                moved = True
                if send.offset == nbytes:
                    queue.popleft()
                    self.engine.send_done(send)
                elif sent < offered:
                    return moved  # the socket buffer is full
        except (BlockingIOError, InterruptedError):
            return moved
        except OSError as exc:
            raise self._lost_error(exc) from None
        return moved

    def _pull(self) -> bool:
        """Read arriving messages until the socket is drained or a message must wait; True if bytes moved."""
        moved = False
        try:
            while True:
                target = self._target
                if target is None:
                    if self._pending is None:
                        got = self._hdr_got
                        count = self._recv_into(self._hdr_view[got:], _HDR - got)
                        if not count:
                            raise self._lost_error(None)
                        moved = True
                        got += count
                        if got < _HDR:
                            self._hdr_got = got
                            return True
                        self._hdr_got = 0
                        self._pending = self._decode()
                    if not self._begin():
                        return moved
                    moved = True
                    continue
                remaining = target.nbytes - target.offset
                asked = min(remaining, _CHUNK)
                view = self._view
                if view is None:  # discarding a message too large for its receive
                    asked = min(asked, _SCRATCH)
                    count = self._recv_into(self._scratch or self._make_scratch(), asked)
                else:
                    count = self._recv_into(view[target.offset:target.offset + asked], asked)
                if not count:
                    raise self._lost_error(None)
                moved = True
                target.offset += count
                if count == remaining:
                    self._target = self._view = None
                    self.engine.recv_done(target)
                elif count < asked:
                    return True  # drained: the next bytes are not here yet
        except (BlockingIOError, InterruptedError):
            return moved
        except PeerLostError:  # EOF, raised above: a ConnectionError, so not for the clause below
            raise
        except OSError as exc:
            raise self._lost_error(exc) from None

    def _decode(self) -> tuple[int, int, int, int]:
        """Decode the arrived header into (ctx, tag, nbytes, stamp).

        Raises:
            PeerLostError: not a tcoll header; the stream is out of step and the connection unusable.
        """
        try:
            return unpack_header(self._hdr_view, self.peer)
        except TransportError as exc:
            self._lost = PeerLostError(self.peer, str(exc))
            raise fresh(self._lost) from None

    def _begin(self) -> bool:
        """Ask the engine for the receive of the decoded header; False leaves the message waiting."""
        ctx, tag, nbytes, stamp = self._pending  # type: ignore[misc]
        target = self.engine.match(self.peer, ctx, tag, nbytes, stamp)
        if target is None:
            return False
        self._pending = None
        if nbytes == 0:
            self.engine.recv_done(target)
        else:
            self._target = target
            self._view = None if target.data is None else target.data.data
        return True

    def _make_scratch(self) -> memoryview:
        """Allocate the discard buffer on first use (most channels never need it)."""
        self._scratch = memoryview(bytearray(_SCRATCH))
        return self._scratch
