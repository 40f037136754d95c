"""The TCP store's server (the client is `tcoll.store.tcp`, the format `tcoll.store.wire`).

The server runs an accept thread and one thread per connection, inside the
process that hosts it (rank 0, or the launcher). A request that must wait for
keys parks its connection's thread on an event registered under each missing
key; `set` wakes exactly the waiters of that key, so hundreds of ranks waiting
for one another do not wake each other for nothing.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import math
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import RendezvousError
from .base import as_bytes, cas_result, parse_counter
from .wire import (
    ERROR,
    F64,
    I64,
    MAGIC,
    OK,
    TIMEOUT,
    Op,
    ProtocolError,
    decode,
    encode,
    format_address,
    recv_frame,
    send_frame,
)

__all__ = ["TCPStoreServer"]

_ABORT_CHECK = 1.0  # seconds between checks, while a request waits, that its client is still there
_HANDSHAKE_TIMEOUT = 30.0
_DRAIN = 2.0  # seconds close() lets requests in flight send their replies


def _peer_closed(sock: socket.socket) -> bool:
    """Whether the client hung up (checked while its request waits)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class _Table:
    """The key-value data, with per-key waiters."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[bytes, bytes] = {}
        self.waiters: dict[bytes, set[threading.Event]] = {}
        self.closed = False

    def put(self, key: bytes, value: bytes) -> None:
        """Store a value and wake the requests waiting for this key (lock held)."""
        self.data[key] = value
        for event in self.waiters.pop(key, ()):
            event.set()

    def close(self) -> None:
        """Wake every waiting request so that it returns (the server is stopping)."""
        with self.lock:
            self.closed = True
            for events in self.waiters.values():
                for event in events:
                    event.set()
            self.waiters.clear()

    def wait(self, keys: list[bytes], timeout: float, abort: Callable[[], bool]) -> tuple[int, list[bytes]]:
        """Wait until every key exists.

        Returns:
            (OK, values), (TIMEOUT, missing keys), or (ERROR, []) when aborted
            (client gone or server stopping).
        """
        deadline = time.monotonic() + timeout
        while True:
            event = threading.Event()
            with self.lock:
                missing = [k for k in keys if k not in self.data]
                if not missing:
                    return OK, [self.data[k] for k in keys]
                remaining = deadline - time.monotonic()
                if self.closed:
                    return ERROR, []
                if remaining <= 0:
                    return TIMEOUT, missing
                for key in missing:
                    self.waiters.setdefault(key, set()).add(event)
            event.wait(min(remaining, _ABORT_CHECK))
            with self.lock:
                for key in missing:
                    events = self.waiters.get(key)
                    if events is not None:
                        events.discard(event)
                        if not events:
                            del self.waiters[key]
            if not event.is_set() and abort():
                return ERROR, []


class TCPStoreServer:
    """Serves a store over TCP from daemon threads of this process.

    Args:
        host: the address to bind, exactly ("127.0.0.1" keeps the store private to
            this host; "0.0.0.0" or "" accepts any interface).
        port: the port; 0 picks a free one (see `.port`).
        auth_key: when given, clients must prove they know it.
        backlog: pending connections the kernel may queue (all ranks connect at once).

    Raises:
        RendezvousError: the address cannot be bound (port in use, unknown host).
    """

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, auth_key: bytes | str | None = None, backlog: int = 1024
    ) -> None:
        self.host = host
        self._auth_key = b"" if auth_key is None else as_bytes(auth_key)
        self._table = _Table()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when a request finishes
        self._busy = 0  # requests read and not yet answered
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._closing = False
        self._listener = self._bind(host, int(port), backlog)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._handlers: dict[int, Callable[[list[bytes], socket.socket], bytes | None]] = {
            Op.SET: self._op_set, Op.MGET: self._op_mget, Op.WAIT: self._op_wait, Op.ADD: self._op_add,
            Op.CAS: self._op_cas, Op.CHECK: self._op_check, Op.DELETE: self._op_delete, Op.NUM_KEYS: self._op_num_keys,
        }  # fmt: skip
        self._accepter = threading.Thread(target=self._accept_loop, name=f"tcoll-store-server:{self.port}", daemon=True)
        self._accepter.start()

    @staticmethod
    def _bind(host: str, port: int, backlog: int) -> socket.socket:
        where = f"{host or '*'}:{port}"
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
        except socket.gaierror as exc:
            raise RendezvousError(
                f"cannot host the tcoll store at {where}: unknown host ({exc})", address=f"tcp://{where}"
            ) from None
        sock = socket.socket(family, kind, proto)
        try:
            # SO_REUSEADDR lets a new job bind while old connections sit in TIME_WAIT;
            # it does not let two listeners share the port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(backlog)
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise RendezvousError(
                    f"cannot host the tcoll store at {where}: the port is already in use (another job, or a store "
                    "left running by an earlier one); pick another port, e.g. TCOLL_MASTER=host:PORT or MASTER_PORT",
                    address=f"tcp://{where}",
                ) from None
            raise RendezvousError(f"cannot host the tcoll store at {where}: {exc}", address=f"tcp://{where}") from None
        return sock

    @property
    def connect_host(self) -> str:
        """The address a client in this process should dial (loopback for a wildcard bind)."""
        return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)

    @property
    def address(self) -> str:
        """The listening address, as tcp://host:port."""
        return format_address(self.host, self.port)

    # -- threads ---------------------------------------------------------------------

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing:
                selector.select()
                if self._closing:
                    return
                try:
                    conn, _ = self._listener.accept()
                except OSError:
                    continue  # e.g. the client reset before we accepted
                with self._lock:
                    if self._closing:
                        conn.close()
                        return
                    self._conns.add(conn)
                    thread = threading.Thread(
                        target=self._serve, args=(conn,), name=f"tcoll-store-conn:{self.port}", daemon=True
                    )
                    self._threads.add(thread)
                    thread.start()  # under the lock, so close() never joins an unstarted thread

    def _serve(self, conn: socket.socket) -> None:
        """Answer one client's requests until it hangs up or the server closes."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(_HANDSHAKE_TIMEOUT)  # a silent peer must not pin a thread forever
            if not self._handshake(conn):
                return
            conn.settimeout(None)
            while not self._closing:
                body = recv_frame(conn)
                if body is None or not self._answer(conn, body):
                    return
        except (OSError, ProtocolError, ValueError, IndexError, struct.error):
            pass  # the client vanished or spoke nonsense: drop this connection only
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
                conn.close()

    def _answer(self, conn: socket.socket, body: bytes) -> bool:
        """Handle one request; return False when the connection must be dropped.

        While it runs the request counts as in flight, so that `close()` lets its
        reply go out: a rank whose wait was satisfied gets its answer even if the
        host closes the server right after its own wait returned.
        """
        with self._lock:
            self._busy += 1
        try:
            op, fields = decode(body)
            handler = self._handlers.get(op)
            if handler is None:
                raise ProtocolError(f"unknown operation {op}")
            reply = handler(fields, conn)
            if reply is None:
                return False
            send_frame(conn, reply)
            return True
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()

    def _handshake(self, conn: socket.socket) -> bool:
        body = recv_frame(conn)
        if body is None or decode(body) != (Op.HELLO, [MAGIC]):
            return False
        nonce = os.urandom(16)
        send_frame(conn, encode(OK, nonce))
        body = recv_frame(conn)
        if body is None:
            return False
        op, fields = decode(body)
        if op != Op.AUTH or len(fields) != 1:
            return False
        if self._auth_key and not hmac.compare_digest(
            fields[0], hmac.new(self._auth_key, nonce, hashlib.sha256).digest()
        ):
            send_frame(conn, encode(ERROR, b"wrong authentication key (check TCOLL_AUTH_KEY)"))
            return False
        send_frame(conn, encode(OK))
        return True

    # -- operations: each takes the request's fields and returns the reply body ------

    def _op_set(self, f: list[bytes], conn: socket.socket) -> bytes:
        with self._table.lock:
            self._table.put(f[0], f[1])
        return encode(OK)

    def _op_mget(self, f: list[bytes], conn: socket.socket) -> bytes | None:
        return self._wait_keys(f, conn, with_values=True)

    def _op_wait(self, f: list[bytes], conn: socket.socket) -> bytes | None:
        return self._wait_keys(f, conn, with_values=False)

    def _wait_keys(self, f: list[bytes], conn: socket.socket, with_values: bool) -> bytes | None:
        """Answer when the keys f[1:] exist (their values, if asked) or after f[0] seconds."""
        (timeout,) = F64.unpack(f[0])
        timeout = 0.0 if math.isnan(timeout) else min(max(timeout, 0.0), 1e9)
        status, result = self._table.wait(f[1:], timeout, lambda: self._closing or _peer_closed(conn))
        if status == ERROR:
            return None  # the client is gone or the server is stopping: nobody to answer
        return encode(status, *(result if with_values or status != OK else []))

    def _op_add(self, f: list[bytes], conn: socket.socket) -> bytes:
        (amount,) = I64.unpack(f[1])
        with self._table.lock:
            try:
                value = parse_counter(f[0].decode(errors="replace"), self._table.data.get(f[0])) + amount
            except ValueError as exc:
                return encode(ERROR, str(exc).encode())
            self._table.put(f[0], str(value).encode("ascii"))
        return encode(OK, I64.pack(value))

    def _op_cas(self, f: list[bytes], conn: socket.socket) -> bytes:
        with self._table.lock:
            swap, result = cas_result(self._table.data.get(f[0]), f[1], f[2])
            if swap:
                self._table.put(f[0], f[2])
        return encode(OK, result)

    def _op_check(self, f: list[bytes], conn: socket.socket) -> bytes:
        with self._table.lock:
            return encode(OK, b"\x01" if all(k in self._table.data for k in f) else b"\x00")

    def _op_delete(self, f: list[bytes], conn: socket.socket) -> bytes:
        with self._table.lock:
            return encode(OK, b"\x01" if self._table.data.pop(f[0], None) is not None else b"\x00")

    def _op_num_keys(self, f: list[bytes], conn: socket.socket) -> bytes:
        with self._table.lock:
            return encode(OK, I64.pack(len(self._table.data)))

    # -- shutdown --------------------------------------------------------------------

    def close(self) -> None:
        """Stop accepting, drop every connection, join the threads and free the port. Idempotent.

        Requests already read get their answer first (for up to `_DRAIN` seconds);
        requests still waiting for keys are dropped, and their clients see the
        connection close.
        """
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._table.close()  # waiting requests give up now
        with self._lock:
            self._idle.wait_for(lambda: self._busy == 0, timeout=_DRAIN)
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # wakes the connection's blocked recv
                except OSError:
                    pass
        self._wake_w.send(b"x")
        self._accepter.join(10)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(10)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> TCPStoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
