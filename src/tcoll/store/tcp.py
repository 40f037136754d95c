"""A store served over TCP: a server thread inside one process, clients in every rank.

The wire format is described in `tcoll.store.wire`; the server is in
`tcoll.store.tcp_server`. Blocking reads (`get`, `wait`) wait inside the
server, which answers when the keys appear or the timeout passes, so clients
never poll. A connection the server closed for being idle is replaced on the
next request, without the caller noticing.
"""

from __future__ import annotations

import hmac
import os
import select
import socket
import threading
import time

from ..keepalive import dead_after_from_env, dead_after_options, set_dead_after
from ..errors import RendezvousError
from ..errors import TimeoutError as StoreTimeoutError
from .base import DEFAULT_TIMEOUT, Store, as_bytes
from .limits import StoreLimitError
from .tcp_server import TCPStoreServer
from .wire import (
    ERROR, F64, GOODBYE, HANDSHAKE_FRAME, I64, LIMIT, MAGIC, NONCE, OK, TIMEOUT, Op, ProtocolError, decode, encode,
    format_address, proof, recv_frame, send_frame,
)  # fmt: skip

__all__ = ["TCPStore", "TCPStoreServer"]

_REPLY_GRACE = 30.0  # seconds a blocking request may outlast its own timeout before the server counts as hung
_MAX_BACKOFF = 1.0
# Extra connections are opened after the server is known to be up, so a short
# retry window suffices; it bounds the hang when the server has died meanwhile.
_RECONNECT_TIMEOUT = 10.0
_RESENDS = 3  # times a request is sent again on a new connection after the server said GOODBYE


class _Busy(ConnectionError):
    """The server turned this connection away without executing anything (GOODBYE): try another."""


def _stale(sock: socket.socket) -> str:
    """How an idle pooled connection stands: "ok", "idle" (the server said GOODBYE) or "closed" (it is gone)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)  # (recv would wait out the socket's timeout)
        if not readable:
            return "ok"
        head = sock.recv(5, socket.MSG_PEEK)  # between requests the server sends nothing but a GOODBYE
    except (OSError, ValueError):
        return "closed"
    return "idle" if len(head) == 5 and head[4] == GOODBYE else "closed"


def _key_bytes(auth_key: bytes | str | None) -> bytes:
    return b"" if auth_key is None else as_bytes(auth_key)


class TCPStore(Store):
    """A client of a `TCPStoreServer`; safe to use from several threads.

    Each request borrows a connection from a small pool (opening another one if
    every connection is busy), so a thread blocked in `get` never stalls another
    thread's `set` on the same client.

    Args:
        host: the server's host name or address.
        port: the server's port.
        timeout: default seconds for `get` and `wait`, and for connecting.
        server: a server this client owns: `close()` stops it too.
        auth_key: the shared secret, if the server requires one.
        connect_timeout: seconds to keep trying to connect (default: `timeout`).
        dead_after: seconds after which a server that answers nothing (its host gone without
            closing the connection) fails the request as a lost store (default:
            TCOLL_TCP_DEAD_AFTER, see `tcoll.keepalive`; 0: the kernel's defaults).

    Raises:
        ValueError: `dead_after` (or TCOLL_TCP_DEAD_AFTER) is out of range.
        RendezvousError: no store answered at the address within the connect timeout,
            or it refused the key.
    """

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        server: TCPStoreServer | None = None,
        auth_key: bytes | str | None = None,
        connect_timeout: float | None = None,
        dead_after: float | None = None,
    ) -> None:
        super().__init__(timeout)
        self.host, self.port = host, int(port)
        self._dead_after = dead_after_from_env() if dead_after is None else dead_after
        dead_after_options(self._dead_after)  # a bad value raises here, before any connection
        self._server = server
        self._auth_key = _key_bytes(auth_key)
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._socks: set[socket.socket] = set()
        self._closed = False
        try:
            self._release(self._connect(self.default_timeout if connect_timeout is None else connect_timeout))
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(
        cls,
        host: str,
        port: int,
        *,
        is_server: bool,
        timeout: float = DEFAULT_TIMEOUT,
        auth_key: bytes | str | None = None,
    ) -> TCPStore:
        """Host the server here if `is_server`, then return a client connected to it.

        Args:
            host: the address to bind (server) or to connect to (client).
            port: the port; 0 lets the server pick a free one.
            is_server: whether this process hosts the server.
            timeout: the client's default timeout.
            auth_key: shared secret required from every client (None: no check).

        Returns:
            A client; when it hosts the server, closing it stops the server.

        Raises:
            RendezvousError: the port is taken (server) or the server is unreachable (client).
        """
        if not is_server:
            return cls(host, port, timeout, auth_key=auth_key)
        server = TCPStoreServer(host, port, auth_key=auth_key)
        try:
            return cls(server.connect_host, server.port, timeout, server=server, auth_key=auth_key)
        except BaseException:
            server.close()
            raise

    @property
    def address(self) -> str:
        """The server's address, as tcp://host:port."""
        return format_address(self.host, self.port)

    @property
    def server(self) -> TCPStoreServer | None:
        """The server this client hosts, if any."""
        return self._server

    # -- connections -----------------------------------------------------------------

    def _connect(self, timeout: float) -> socket.socket:
        """Connect and authenticate, retrying with exponential backoff until `timeout`."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(0.1, min(remaining, 10.0)))
            except OSError as exc:
                last: Exception = exc
            else:
                try:
                    self._handshake(sock)
                    return sock
                except ProtocolError as exc:
                    sock.close()
                    raise RendezvousError(
                        f"the service at {self.address} is not a tcoll store: {exc}", address=self.address
                    ) from None
                except OSError as exc:  # the server went away mid-handshake, or has too many clients
                    sock.close()
                    last = exc
                except BaseException:  # refused (wrong key), interrupted
                    sock.close()
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousError(
                    f"cannot reach the tcoll store at {self.address} after {timeout:g}s ({last}); "
                    "is rank 0 (or the launcher) running, and is the address reachable from this host?",
                    address=self.address,
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_BACKOFF)

    def _handshake(self, sock: socket.socket) -> None:
        """Say hello, check the server's proof of the key, prove it ourselves (see `tcoll.store.wire`).

        Raises:
            RendezvousError: the server refused us, or failed to prove it knows our key.
            ProtocolError: the service is not a tcoll store.
            _Busy: the server has too many connections (worth retrying).
        """
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A store whose host vanished is a lost store, not a long wait (its server always reads: a user timeout too).
        set_dead_after(sock, self._dead_after, user_timeout=True)
        mine = os.urandom(NONCE)
        send_frame(sock, encode(Op.HELLO, MAGIC, mine))
        status, fields = self._read_reply(sock, HANDSHAKE_FRAME)  # nothing large from an unproven server
        if status == ERROR and fields:
            raise self._refused(fields)
        if status != OK or len(fields) != 2 or len(fields[0]) != NONCE:
            raise ProtocolError("unexpected handshake reply")
        theirs, server_proof = fields
        if self._auth_key and not hmac.compare_digest(server_proof, proof(self._auth_key, b"S", mine, theirs)):
            why = "it has no key" if not server_proof else "the keys differ"
            raise RendezvousError(f"refused the store at {self.address}: it failed to prove it knows TCOLL_AUTH_KEY "
                                  f"({why}, or another job or service holds this address)", address=self.address)
        send_frame(sock, encode(Op.AUTH, proof(self._auth_key, b"C", theirs, mine)))
        status, fields = self._read_reply(sock, HANDSHAKE_FRAME)
        if status == GOODBYE:
            raise _Busy(fields[0].decode(errors="replace") if fields else "the store turned the connection away")
        if status == ERROR:
            raise self._refused(fields)
        if status != OK:
            raise ProtocolError("unexpected authentication reply")

    def _refused(self, fields: list[bytes]) -> RendezvousError:
        message = fields[0].decode(errors="replace") if fields else "refused"
        return RendezvousError(f"the store at {self.address} refused this client: {message}", address=self.address)

    @staticmethod
    def _read_reply(sock: socket.socket, limit: int | None = None) -> tuple[int, list[bytes]]:
        body = recv_frame(sock) if limit is None else recv_frame(sock, limit)
        if body is None:
            raise ConnectionResetError("the store closed the connection")
        return decode(body)

    def _acquire(self) -> socket.socket:
        with self._lock:
            if self._closed:
                raise RendezvousError(f"store client for {self.address} is closed", address=self.address)
            while self._idle:
                sock = self._idle.pop()
                state = _stale(sock)
                if state == "ok":
                    return sock
                self._socks.discard(sock)
                sock.close()
                if state == "closed":  # not an idle close: the server is gone, as every request would find
                    raise RendezvousError(f"lost the connection to the store at {self.address}: it closed the "
                                          "connection", address=self.address)
        # Every connection is busy (another thread is blocked in a request): open one more.
        sock = self._connect(min(self.default_timeout, _RECONNECT_TIMEOUT))
        with self._lock:
            self._socks.add(sock)
        return sock

    def _release(self, sock: socket.socket, healthy: bool = True) -> None:
        with self._lock:
            self._socks.add(sock)
            if healthy and not self._closed:
                self._idle.append(sock)
                return
            self._socks.discard(sock)
        sock.close()

    def _request(self, op: Op, *fields: bytes, wait: float | None = None) -> list[bytes]:
        """Send one request and return the reply's fields.

        Args:
            op: the operation.
            *fields: its arguments.
            wait: for blocking operations, the seconds the server may wait.

        Raises:
            tcoll.TimeoutError: the server answered "timeout" (the caller builds the
                message) or did not answer at all.
            RendezvousError: the connection to the store broke.
            StoreLimitError: the request exceeds a limit of the server (nothing was stored).
            ValueError: the server rejected the request's values.
        """
        for _ in range(_RESENDS):
            status, reply = self._exchange(op, fields, wait)
            if status != GOODBYE:  # else: the server closed that connection unused; it executed nothing
                break
        if status == LIMIT:
            raise StoreLimitError(f"store {self.address}: {reply[0].decode(errors='replace') if reply else 'limit'}")
        if status == ERROR:
            raise ValueError(reply[0].decode(errors="replace") if reply else "store error")
        if status == TIMEOUT:
            raise self._timeout_error([k.decode(errors="replace") for k in reply], wait or 0.0)
        if status != OK:
            raise RendezvousError(f"the store at {self.address} keeps closing connections: "
                                  f"{reply[0].decode(errors='replace') if reply else status}", address=self.address)
        return reply

    def _exchange(self, op: Op, fields: tuple[bytes, ...], wait: float | None) -> tuple[int, list[bytes]]:
        """Send one request on a pooled connection and read its reply (see `_request`)."""
        sock = self._acquire()
        healthy, status = False, ERROR
        try:
            sock.settimeout(self.default_timeout if wait is None else wait + _REPLY_GRACE)
            send_frame(sock, encode(op, *fields))
            status, reply = self._read_reply(sock)
            healthy = True
        except TimeoutError:  # the builtin, i.e. socket.timeout: the server did not answer at all
            limit = self.default_timeout if wait is None else wait + _REPLY_GRACE
            error = StoreTimeoutError(f"store {self.address}: no reply within {limit:g}s (server hung or overloaded)")
            error.missing_keys = []  # type: ignore[attr-defined]
            raise error from None
        except (OSError, ProtocolError) as exc:
            raise RendezvousError(
                f"lost the connection to the store at {self.address}: {exc}", address=self.address
            ) from None
        finally:
            self._release(sock, healthy and status != GOODBYE)
        return status, reply

    # -- the Store interface ---------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        """See `Store.set`."""
        self._request(Op.SET, key.encode(), as_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """See `Store.get`."""
        return self.multi_get([key], timeout)[0]

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """See `Store.multi_get` (one round trip)."""
        limit = self._timeout(timeout)
        return self._request(Op.MGET, F64.pack(limit), *(k.encode() for k in keys), wait=limit)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """See `Store.wait`."""
        limit = self._timeout(timeout)
        self._request(Op.WAIT, F64.pack(limit), *(k.encode() for k in keys), wait=limit)

    def add(self, key: str, amount: int) -> int:
        """See `Store.add`."""
        (value,) = I64.unpack(self._request(Op.ADD, key.encode(), I64.pack(int(amount)))[0])
        return int(value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """See `Store.compare_set`."""
        return self._request(Op.CAS, key.encode(), as_bytes(expected), as_bytes(desired))[0]

    def check(self, keys: list[str]) -> bool:
        """See `Store.check`."""
        return self._request(Op.CHECK, *(k.encode() for k in keys))[0] == b"\x01"

    def delete(self, key: str) -> bool:
        """See `Store.delete`."""
        return self._request(Op.DELETE, key.encode())[0] == b"\x01"

    def num_keys(self) -> int:
        """See `Store.num_keys`."""
        (count,) = I64.unpack(self._request(Op.NUM_KEYS)[0])
        return int(count)

    def close(self) -> None:
        """Close every connection (interrupting requests in flight) and the owned server, if any."""
        with self._lock:
            self._closed = True
            socks, self._socks, self._idle = list(self._socks), set(), []
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._server is not None:
            self._server.close()
