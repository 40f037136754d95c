"""The TCP store's server (the client is `tcoll.store.tcp`, the format `tcoll.store.wire`).

One thread runs a `selectors` event loop over non-blocking sockets, inside the
process that hosts the store (rank 0, or the launcher). Everything it holds is
bounded by `StoreLimits`:

- before a client has proved the key it reads frames of at most
  `wire.HANDSHAKE_FRAME` bytes, gives it `handshake_timeout` seconds from
  accept, and keeps at most `max_handshakes` such connections (the oldest goes);
  one it refuses gets its answer and is closed at once;
- after it, one request is at most `max_request` bytes (larger ones are read
  and thrown away, then answered LIMIT), requests being received share a
  budget of `max_bytes` (which a `SMALL_REQUEST` never waits for), stored keys
  and values another `max_bytes`, and `max_connections` clients may connect;
- a request must arrive whole within `idle_timeout` of its first byte (one
  deadline for the message, not one per byte), and a connection without a
  request for `idle_timeout` seconds is closed with a GOODBYE, after which the
  client reconnects by itself;
- when file descriptors run out, accepting pauses with a growing back-off
  instead of spinning.

A request that must wait for keys parks on the first missing key; `set`
rechecks exactly that key's waiters.
"""

from __future__ import annotations

import collections
import errno
import heapq
import hmac
import itertools
import os
import selectors
import socket
import struct
import threading
import time

from .base import as_bytes
from .limits import SMALL_REQUEST, StoreLimits
from .listener import bind_listener
from .table import Table
from .wire import (
    ERROR, GOODBYE, HANDSHAKE_FRAME, LIMIT, MAGIC, NONCE, OK, U32, Op, ProtocolError, decode,
    encode_parts, format_address, proof,
)  # fmt: skip

__all__ = ["TCPStoreServer"]

_DRAIN = 2.0  # seconds close() lets replies already computed go out
_LINGER = 5.0  # seconds a GOODBYE or refusal waits for its client to read it and hang up
_ACCEPT_BATCH = 64
_BACKOFF = (0.05, 1.0)  # first and longest pause of accepting when file descriptors run out
_FD_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_CHUNK = 1 << 20
HELLO, AUTH, READY, PARKED, CLOSING = range(5)
_WAKE = object()
_BAD_REQUEST = (ProtocolError, struct.error, IndexError, ValueError, KeyError)


class _Conn:
    """One client connection and where its current frame stands."""

    __slots__ = ("sock", "state", "events", "nonce", "peer_nonce", "head", "body", "got", "want", "discard",
                 "out", "deadline", "queued", "authed", "closed", "reserved")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.state = HELLO
        self.events = 0
        self.nonce = self.peer_nonce = b""
        self.head = bytearray()  # the length prefix being read
        self.body: bytearray | None = None  # the frame being read
        self.got = 0
        self.want = 0  # a frame length waiting for budget (0: none)
        self.discard = 0  # bytes of an oversized request still to throw away
        self.out: collections.deque[memoryview] = collections.deque()
        self.deadline: float | None = deadline
        self.queued: float | None = None  # the deadline of this connection's entry in the timer heap
        self.authed = False
        self.closed = False
        self.reserved = 0  # bytes of the receive budget this connection's frame holds

    def mid_frame(self) -> bool:
        return bool(self.head) or self.body is not None or self.discard > 0 or self.want > 0


class TCPStoreServer:
    """Serves a store over TCP from one daemon thread of this process.

    Args:
        host: the address to bind, exactly ("127.0.0.1" keeps the store private to
            this host; "0.0.0.0" or "" accepts any interface).
        port: the port; 0 picks a free one (see `.port`).
        auth_key: when given, clients must prove they know it (and the server proves it to them).
        backlog: pending connections the kernel may queue (all ranks connect at once).
        limits: sizes, connection counts and timeouts (default: `StoreLimits.from_env()`).

    Raises:
        RendezvousError: the address cannot be bound (port in use, unknown host).
        ValueError: a TCOLL_STORE_* variable has a bad value.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, auth_key: bytes | str | None = None,
                 backlog: int = 1024, limits: StoreLimits | None = None) -> None:
        self.host = host
        self.limits = limits if limits is not None else StoreLimits.from_env()
        self._auth_key = b"" if auth_key is None else as_bytes(auth_key)
        self._table = Table(self.limits, self._answer)
        self._conns: set[_Conn] = set()
        self._handshakes: dict[_Conn, None] = {}  # oldest first
        self._authed = 0
        self._inflight = 0  # bytes reserved by requests being received
        self._starved: collections.deque[_Conn] = collections.deque()  # waiting for that budget
        self._timers: list[tuple[float, int, _Conn]] = []
        self._seq = itertools.count()
        self._backoff = _BACKOFF[0]
        self._accept_resume: float | None = None
        self._scratch = bytearray(64 << 10)
        self._closing = False
        self._listener = bind_listener(host, int(port), backlog)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._loop, name=f"tcoll-store-server:{self.port}", daemon=True)
        self._thread.start()

    @property
    def connect_host(self) -> str:
        """The address a client in this process should dial (loopback for a wildcard bind)."""
        return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    @property
    def address(self) -> str:
        """The listening address, as tcp://host:port."""
        return format_address(self.host, self.port)

    def stats(self) -> dict[str, int]:
        """What the server holds now: connections (authenticated), handshakes, sockets open (in any state), keys,
        bytes held and being received."""
        return {"connections": self._authed, "handshakes": len(self._handshakes), "open": len(self._conns),
                "keys": len(self._table.data), "bytes_held": self._table.held, "bytes_receiving": self._inflight}

    # -- the event loop ------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while not self._closing:
                due = [t for t in (self._timers[0][0] if self._timers else None, self._accept_resume) if t is not None]
                timeout = max(0.0, min(due) - time.monotonic()) if due else None
                for key, mask in self._sel.select(timeout):
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        self._wake_r.recv(64)
                    else:
                        self._service(key.data, mask)
                self._expire(time.monotonic())
            self._drain()
        finally:
            for conn in list(self._conns):
                self._close(conn)
            self._sel.close()

    def _service(self, conn: _Conn, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE and not conn.closed:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.closed and conn.events & selectors.EVENT_READ:
                self._readable(conn)
        except (BlockingIOError, InterruptedError):
            pass
        except (OSError, *_BAD_REQUEST):
            self._close(conn)  # the client vanished or spoke nonsense: drop this connection only

    def _accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRORS:  # out of descriptors: pause accepting instead of spinning
                    self._sel.unregister(self._listener)
                    self._accept_resume = time.monotonic() + self._backoff
                    self._backoff = min(2 * self._backoff, _BACKOFF[1])
                    return
                continue  # e.g. the client reset before we accepted
            self._backoff = _BACKOFF[0]
            if len(self._handshakes) >= self.limits.max_handshakes:
                self._close(next(iter(self._handshakes)))  # the oldest stranger makes room
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                sock.close()
                continue
            conn = _Conn(sock, time.monotonic() + self.limits.handshake_timeout)
            self._conns.add(conn)
            self._handshakes[conn] = None
            self._watch(conn, selectors.EVENT_READ)
            self._timer(conn, conn.deadline)  # type: ignore[arg-type]

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.closed or events == conn.events:
            return
        if not conn.events:
            self._sel.register(conn.sock, events, conn)
        elif not events:
            self._sel.unregister(conn.sock)
        else:
            self._sel.modify(conn.sock, events, conn)
        conn.events = events

    # -- timers ----------------------------------------------------------------------------

    def _timer(self, conn: _Conn, deadline: float | None) -> None:
        """Set the connection's deadline; the heap gets an entry only when it must fire earlier."""
        conn.deadline = deadline
        if deadline is not None and (conn.queued is None or deadline < conn.queued):
            conn.queued = deadline
            heapq.heappush(self._timers, (deadline, next(self._seq), conn))

    def _active(self, conn: _Conn) -> None:
        """Restart the idle clock of an authenticated connection (at a request's first byte and its reply)."""
        if conn.state in (READY,) and self.limits.idle_timeout:
            self._timer(conn, time.monotonic() + self.limits.idle_timeout)

    def _expire(self, now: float) -> None:
        if self._accept_resume is not None and now >= self._accept_resume:
            self._accept_resume = None
            self._sel.register(self._listener, selectors.EVENT_READ, None)
        while self._timers and self._timers[0][0] <= now:
            when, _, conn = heapq.heappop(self._timers)
            if conn.closed or conn.queued != when:
                continue
            conn.queued = None
            if conn.deadline is None:
                continue
            if conn.deadline > now:
                self._timer(conn, conn.deadline)
                continue
            conn.deadline = None
            self._on_deadline(conn)

    def _on_deadline(self, conn: _Conn) -> None:
        if conn.state == PARKED:
            conn.state = READY
            self._reply(conn, self._table.expire(conn))
        elif conn.state == READY and conn.want:
            pass  # waiting for budget that other requests hold: our delay, not the client's
        elif conn.state == READY and not conn.mid_frame() and not conn.out:
            self._goodbye(conn, f"closed after {self.limits.idle_timeout:g} s without a request; reconnect")
        else:
            self._close(conn)  # a handshake out of time, a stalled frame or reader, a lingering goodbye

    # -- reading -----------------------------------------------------------------------------

    def _readable(self, conn: _Conn) -> None:
        sock = conn.sock
        if conn.state == CLOSING:
            if not sock.recv_into(self._scratch):  # throw away whatever comes until the client hangs up
                self._close(conn)
            return
        if conn.state == PARKED:  # clients never send while they wait: this is a hang-up or nonsense
            self._close(conn)
            return
        if conn.discard:
            n = sock.recv_into(self._scratch, min(conn.discard, len(self._scratch)))
            if not n:
                return self._close(conn)
            conn.discard -= n
            if not conn.discard:
                self._reply(conn, encode_parts(LIMIT, (
                    f"a store request above {self.limits.max_request} bytes (2 x TCOLL_STORE_MAX_VALUE + 1 MiB) "
                    "was refused; nothing was stored").encode()))
            return
        if conn.body is None:
            data = sock.recv(4 - len(conn.head))
            if not data:
                return self._close(conn)
            if not conn.head:
                self._active(conn)  # a request begins: all of it must arrive within idle_timeout from now
            conn.head += data
            if len(conn.head) == 4:
                (length,) = U32.unpack(conn.head)
                conn.head = bytearray()
                self._start_frame(conn, length)
            return
        n = sock.recv_into(memoryview(conn.body)[conn.got:], min(len(conn.body) - conn.got, _CHUNK))
        if not n:
            return self._close(conn)
        conn.got += n
        if conn.got == len(conn.body):
            body, conn.body = conn.body, None
            try:
                self._handle(conn, body)
            finally:
                reserved, conn.reserved = conn.reserved, 0
                self._release(reserved)

    def _start_frame(self, conn: _Conn, length: int) -> None:
        """Decide, from a length prefix alone, whether and where to read the frame."""
        if conn.state in (HELLO, AUTH):
            if not 0 < length <= HANDSHAKE_FRAME:
                raise ProtocolError(f"handshake frame of {length} bytes")  # nothing allocated for it
            conn.body, conn.got = bytearray(length), 0
            return
        if length == 0:
            raise ProtocolError("empty frame")
        if length > self.limits.max_request:
            conn.discard = length
            return
        if length > SMALL_REQUEST and self._inflight and self._inflight + length > self.limits.max_bytes:
            conn.want = length  # wait, without reading, until other requests free the budget
            self._watch(conn, 0)
            self._starved.append(conn)
            return
        self._inflight += length
        conn.body, conn.got, conn.reserved = bytearray(length), 0, length

    def _release(self, length: int) -> None:
        """Return a request's bytes to the budget and let waiting connections read theirs."""
        self._inflight -= length
        while self._starved:
            conn = self._starved[0]
            if conn.closed:
                self._starved.popleft()
                continue
            if self._inflight and self._inflight + conn.want > self.limits.max_bytes:
                return
            self._starved.popleft()
            self._inflight += conn.want
            conn.body, conn.got, conn.reserved, conn.want = bytearray(conn.want), 0, conn.want, 0
            self._watch(conn, selectors.EVENT_READ)
            self._active(conn)  # it waited for us: the rest of its request has the whole idle_timeout again

    # -- requests --------------------------------------------------------------------------

    def _handle(self, conn: _Conn, body: bytearray) -> None:
        op, fields = decode(body)
        if conn.state == HELLO:
            return self._hello(conn, op, fields)
        if conn.state == AUTH:
            return self._auth(conn, op, fields)
        reply, wait = self._table.request(conn, op, fields)
        if reply is not None:
            self._reply(conn, reply)
        else:
            conn.state = PARKED
            self._timer(conn, time.monotonic() + wait)

    def _answer(self, conn: _Conn, reply: list[bytes]) -> None:
        """A parked request got its keys."""
        conn.state = READY
        self._reply(conn, reply)

    def _hello(self, conn: _Conn, op: int, fields: list[bytes]) -> None:
        if op != Op.HELLO or len(fields) != 2 or len(fields[1]) != NONCE:
            if op == Op.HELLO and fields and fields[0].startswith(b"tcoll-store/") and fields[0] != MAGIC:
                theirs = fields[0].decode(errors="replace")
                return self._refuse(conn, f"this store speaks {MAGIC.decode()}, the client {theirs} "
                                          "(mixed tcoll versions in one job?)", status=ERROR)
            raise ProtocolError("not a tcoll store client")
        if fields[0] != MAGIC:
            raise ProtocolError("not a tcoll store client")
        conn.peer_nonce, conn.nonce = fields[1], os.urandom(NONCE)
        conn.state = AUTH
        self._reply(conn, encode_parts(OK, conn.nonce, proof(self._auth_key, b"S", conn.peer_nonce, conn.nonce)))

    def _auth(self, conn: _Conn, op: int, fields: list[bytes]) -> None:
        if op != Op.AUTH or len(fields) != 1:
            raise ProtocolError("expected the client's proof")
        del self._handshakes[conn]
        if self._auth_key and not hmac.compare_digest(
                fields[0], proof(self._auth_key, b"C", conn.nonce, conn.peer_nonce)):
            return self._refuse(conn, "wrong authentication key (check TCOLL_AUTH_KEY)", status=ERROR)
        if self._authed >= self.limits.max_connections:
            return self._refuse(conn, f"the store has {self._authed} connections, its limit "
                                      "(TCOLL_STORE_MAX_CONNECTIONS); retry later", status=GOODBYE)
        conn.authed, conn.state = True, READY
        self._authed += 1
        self._reply(conn, encode_parts(OK))

    def _refuse(self, conn: _Conn, message: str, status: int) -> None:
        """Answer a connection that may not come in, and close it now: a refusal holds nothing afterwards."""
        try:
            conn.sock.send(b"".join(encode_parts(status, message.encode())))  # a few bytes: they go at once
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.recv_into(self._scratch)  # unread input would turn the close into a reset, losing the answer
        except OSError:
            pass  # (BlockingIOError included) the answer is best effort; the close is not
        self._close(conn)

    def _goodbye(self, conn: _Conn, message: str, status: int = GOODBYE) -> None:
        """Send a last frame to an authenticated client, then close once it hung up (or after `_LINGER`)."""
        self._handshakes.pop(conn, None)
        if conn.authed:
            conn.authed = False
            self._authed -= 1
        conn.state = CLOSING
        self._timer(conn, time.monotonic() + _LINGER)
        self._reply(conn, encode_parts(status, message.encode()))

    # -- writing and closing -------------------------------------------------------------

    def _reply(self, conn: _Conn, parts: list[bytes]) -> None:
        conn.out.extend(memoryview(p) for p in parts)
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Send what is queued; read again (never while a reply waits) once it is out.

        A connection that fails here is closed here: the caller may be serving another one.
        """
        if conn.closed:
            return
        try:
            while conn.out:
                sent = conn.sock.sendmsg(list(itertools.islice(conn.out, 64)))
                while sent:
                    first = conn.out[0]
                    if sent >= len(first):
                        sent -= len(first)
                        conn.out.popleft()
                    else:
                        conn.out[0], sent = first[sent:], 0
            if conn.state == CLOSING:
                conn.sock.shutdown(socket.SHUT_WR)  # our last word is out; wait for the client to hang up
        except (BlockingIOError, InterruptedError):
            self._watch(conn, selectors.EVENT_WRITE)
            return
        except OSError:
            self._close(conn)
            return
        self._watch(conn, selectors.EVENT_READ)
        self._active(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        if conn.state == PARKED:
            self._table.forget(conn)
        if conn.authed:
            self._authed -= 1
        self._watch(conn, 0)
        conn.closed = True
        conn.body = None
        if conn.reserved:
            reserved, conn.reserved = conn.reserved, 0
            self._release(reserved)
        conn.sock.close()
        self._conns.discard(conn)
        self._handshakes.pop(conn, None)

    def _drain(self) -> None:
        """Stop accepting and let computed replies go out for up to `_DRAIN` seconds (the server is closing)."""
        if self._accept_resume is None:
            self._sel.unregister(self._listener)
        self._listener.close()
        deadline = time.monotonic() + _DRAIN
        for conn in list(self._conns):
            if not conn.out:
                self._close(conn)
        while self._conns and time.monotonic() < deadline:
            for key, mask in self._sel.select(max(0.0, deadline - time.monotonic())):
                if isinstance(key.data, _Conn):
                    self._flush(key.data)
                    if not key.data.out:
                        self._close(key.data)

    # -- shutdown ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, drop every connection, stop the thread and free the port. Idempotent.

        Replies already computed go out first (for up to `_DRAIN` seconds);
        requests still waiting for keys are dropped, and their clients see the
        connection close.
        """
        if self._closing:
            return
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(_DRAIN + 10)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
