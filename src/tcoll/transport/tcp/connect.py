"""Connection set-up for the TCP transport: listener, dialling, accepting, handshake.

Every pair of ranks shares one TCP connection: the higher rank dials the
lower rank's listener, the lower one accepts. All dials and accepts of a rank
run at once in one non-blocking event loop, so no rank waits for another to
finish its own set-up, and a silent or foreign connection only costs a slot.

Handshake (integers little-endian), before any message travels:

    dialler  -> acceptor  HELLO: b"TCOLLTCP", version u16, flags u16 (1: auth),
                          own rank u32, acceptor's rank u32, run-id length u16, run id
    acceptor -> dialler   b"R" + u16 length + reason   (rejected, then closed)
                        | b"A"                         (accepted, no auth key)
                        | b"C" + 32-byte challenge      (auth key set)
    with an auth key:
    dialler  -> acceptor  HMAC(key, "C", challenge, context) + own 32-byte challenge
    acceptor -> dialler   b"R" ... | b"A" + HMAC(key, "A", dialler's challenge, context)

The context (run id and both ranks) and the role letter go into every HMAC,
so an answer cannot be replayed on another connection or reflected back.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import hmac
import os
import selectors
import socket
import struct
import time
from collections.abc import Callable, Generator
from typing import Any

from ...keepalive import DEFAULT_DEAD_AFTER, set_dead_after
from ...errors import TimeoutError, TransportError

__all__ = ["connect_all", "open_listener", "tune_socket"]

_HELLO = struct.Struct("<8sHHIIH")
_MAGIC = b"TCOLLTCP"
_VERSION = 1
_FLAG_AUTH = 1
_NONCE = 32
_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn; hundreds of peers may dial at once
_MIN_PENDING = 64  # accepted connections still in their handshake, at least; more for a large world

# A handshake step: bytes to send, or the number of bytes to receive next.
_Proto = Generator[Any, Any, Any]


class _Refused(Exception):
    """The handshake failed for a reason worth telling the other side."""


def open_listener(addr: str) -> socket.socket:
    """Listen on `addr` (exactly that address, never the wildcard), on a port the kernel picks.

    Raises:
        TransportError: the address cannot be bound.
    """
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise TransportError(f"tcp transport: cannot resolve listen address {addr!r}: {exc}") from None
    try:
        listener.bind(sockaddr)
        listener.listen(_BACKLOG)
        listener.setblocking(False)
    except OSError as exc:
        listener.close()
        raise TransportError(f"tcp transport: cannot listen on {addr!r}: {exc}; check TCOLL_TCP_ADDR") from None
    return listener


def tune_socket(sock: socket.socket, dead_after: float = DEFAULT_DEAD_AFTER) -> None:
    """Set the options every data connection uses (no Nagle delay, keep-alive, non-blocking).

    Args:
        sock: a connected TCP socket.
        dead_after: seconds after which a peer that answers nothing fails the connection
            (TCOLL_TCP_DEAD_AFTER; see `tcoll.keepalive`): a host that vanished without a
            FIN or RST is then a PeerLostError, not a wait until TCOLL_TIMEOUT.
    """
    sock.setblocking(False)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # SO_SNDBUF / SO_RCVBUF stay unset: fixed sizes (1-16 MiB) measured no better than the
    # kernel's autotuning on loopback, and setting them turns the autotuning off.
    set_dead_after(sock, dead_after)


def _digest(key: bytes, role: bytes, nonce: bytes, context: bytes) -> bytes:
    """The proof that the side playing `role` ("C" dialler, "A" acceptor) knows `key`."""
    return hmac.new(key, b"tcoll-tcp-auth/" + role + nonce + context, hashlib.sha256).digest()


def _context(run_id: bytes, dialler: int, acceptor: int) -> bytes:
    """What a proof is bound to: this job and this pair of ranks."""
    return struct.pack("<II", dialler, acceptor) + run_id


def _dialler(me: int, peer: int, run_id: bytes, key: bytes) -> _Proto:
    """The dialling side of the handshake (see the module docstring)."""
    yield _HELLO.pack(_MAGIC, _VERSION, _FLAG_AUTH if key else 0, me, peer, len(run_id)) + run_id
    kind = yield 1
    if kind == b"C" and key:
        challenge = yield _NONCE
        mine = os.urandom(_NONCE)
        yield _digest(key, b"C", challenge, _context(run_id, me, peer)) + mine
        kind = yield 1
        if kind == b"A":
            proof = yield 32
            if not hmac.compare_digest(proof, _digest(key, b"A", mine, _context(run_id, me, peer))):
                raise _Refused(f"rank {peer} failed to prove it knows TCOLL_AUTH_KEY")
            return peer
    if kind == b"R":
        length = struct.unpack("<H", (yield 2))[0]
        raise _Refused(f"rank {peer} refused the connection: {(yield length).decode(errors='replace')}")
    if kind == b"A" and not key:
        return peer
    raise _Refused(f"rank {peer} answered the handshake with {kind!r}; is TCOLL_AUTH_KEY set on both ranks?")


def _acceptor(me: int, expected: set[int], run_id: bytes, key: bytes) -> _Proto:
    """The accepting side of the handshake; returns the dialler's rank."""
    magic, version, flags, rank, target, id_len = _HELLO.unpack((yield _HELLO.size))
    if magic != _MAGIC:
        raise _Refused("not a tcoll connection")
    if version != _VERSION:
        raise _Refused(f"tcoll tcp protocol version {version}, expected {_VERSION}")
    if (yield id_len) != run_id:
        raise _Refused("the connection belongs to another tcoll job (run id differs)")
    if target != me or rank not in expected:
        raise _Refused(f"rank {rank} is not expected to dial rank {me} (it dialled rank {target})")
    if bool(flags & _FLAG_AUTH) != bool(key):
        raise _Refused(f"TCOLL_AUTH_KEY is set on rank {me if key else rank} only")
    if not key:
        yield b"A"
        return rank
    challenge = os.urandom(_NONCE)
    yield b"C" + challenge
    answer = yield 2 * _NONCE
    if not hmac.compare_digest(answer[:32], _digest(key, b"C", challenge, _context(run_id, rank, me))):
        raise _Refused(f"authentication of rank {rank} failed: TCOLL_AUTH_KEY differs")
    yield b"A" + _digest(key, b"A", answer[32:], _context(run_id, rank, me))
    return rank


@dataclasses.dataclass(slots=True)
class _Link:
    """One connection during the handshake: its socket, protocol and buffers."""

    sock: socket.socket
    proto: _Proto
    peer: int  # the dialled rank, or -1 for an accepted connection
    where: str  # host:port, for messages
    dialling: bool  # True until a dial's TCP connect completes
    need: int = 0  # bytes the protocol waits for
    inbuf: bytearray = dataclasses.field(default_factory=bytearray)
    out: bytes = b""
    result: int | None = None  # the peer's rank once the handshake succeeded


class _Rendezvous:
    """Dials the lower peers and accepts the higher ones, all at once, until every link is up."""

    def __init__(self, me: int, peers: list[int], cards: list[dict[str, Any]], listener: socket.socket,
                 run_id: str, key: str) -> None:
        self.me = me
        self.cards = cards
        self.listener = listener
        self.run_id = run_id.encode()
        self.key = key.encode()
        self.expected = {p for p in peers if p > me}
        self.wanted = set(peers)
        self.to_dial = {p: 0.0 for p in peers if p < me}  # peer -> when to (re)try
        self.attempts = dict.fromkeys(self.to_dial, 0)
        self.last_error: dict[int, str] = {}
        self.notes: list[str] = []
        self.done: dict[int, socket.socket] = {}
        # Accepted connections not yet identified, oldest first: when a stranger's silent connections fill
        # them, the oldest is dropped (a rank that dialled it retries), so strangers cannot take every descriptor.
        self.pending: dict[int, _Link] = {}
        self.max_pending = max(_MIN_PENDING, 4 * len(self.expected))
        self.sel = selectors.DefaultSelector()

    def run(self, timeout: float, check: Callable[[], None] | None = None) -> dict[int, socket.socket]:
        """Drive every dial and accept until all peers are connected, calling `check` every 0.25 s.

        Raises:
            TimeoutError: some peers did not connect in time (named, with addresses).
            TransportError: a peer refused the handshake (wrong key, other job).
        """
        deadline = time.monotonic() + timeout
        if self.expected:
            self.sel.register(self.listener, selectors.EVENT_READ, None)
        next_check = time.monotonic()
        while len(self.done) < len(self.wanted):
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                next_check = now + 0.25
            for peer, when in list(self.to_dial.items()):
                if when <= now:
                    self._dial(peer)
            if now >= deadline:
                raise self._timeout_error(timeout)
            wake = min([deadline, next_check, *self.to_dial.values()])
            for key, mask in self.sel.select(max(0.0, wake - now)):
                if key.data is None:
                    self._accept()
                else:
                    self._service(key.data, mask)
        return self.done

    def close(self) -> None:
        """Close every socket that is not a finished link, and the selector."""
        for key in list(self.sel.get_map().values()):
            if key.data is not None:
                key.data.sock.close()
        self.sel.close()

    def _dial(self, peer: int) -> None:
        """Start a non-blocking connect to `peer`'s listener."""
        del self.to_dial[peer]
        entry = self.cards[peer]["tcp"]
        where = f"{entry['addr']}:{entry['port']}"
        try:
            family, _, _, _, sockaddr = socket.getaddrinfo(entry["addr"], entry["port"], type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self._retry(peer, str(exc))
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex(sockaddr)
        link = _Link(sock, _dialler(self.me, peer, self.run_id, self.key), peer, where, True)
        if code not in (0, errno.EINPROGRESS):
            self._drop(link, os.strerror(code), register=False)
            return
        self.sel.register(sock, selectors.EVENT_WRITE, link)

    def _accept(self) -> None:
        """Accept every pending connection and start its handshake."""
        while True:
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: note it, keep serving the links we have
                self.notes.append(f"accept failed: {exc}")
                return
            if len(self.pending) >= self.max_pending:
                self._drop(next(iter(self.pending.values())), "dropped: too many connections in their handshake")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(sock, _acceptor(self.me, self.expected, self.run_id, self.key), -1, f"{addr[0]}:{addr[1]}",
                         False)
            self.sel.register(sock, selectors.EVENT_READ, link)
            self.pending[id(link)] = link
            self._advance(link, None)

    def _service(self, link: _Link, mask: int) -> None:
        """Handle readiness of one link: finish its TCP connect, send, or receive."""
        try:
            if link.dialling:
                code = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise OSError(code, os.strerror(code))
                link.dialling = False
                self._advance(link, None)
                return
            if mask & selectors.EVENT_WRITE and link.out:
                self._flush(link)
            if mask & selectors.EVENT_READ and link.need:
                chunk = link.sock.recv(link.need - len(link.inbuf))  # never past the handshake
                if not chunk:
                    raise OSError(errno.ECONNRESET, "closed during the handshake")
                link.inbuf += chunk
                if len(link.inbuf) == link.need:
                    self._advance(link, bytes(link.inbuf))
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._drop(link, exc.strerror or str(exc))

    def _advance(self, link: _Link, value: bytes | None) -> None:
        """Run the link's protocol until it waits for input; queue what it sends."""
        try:
            while True:
                step = link.proto.send(value)
                value = None
                if isinstance(step, bytes):
                    link.out += step
                elif step == 0:
                    value = b""
                else:
                    link.need, link.inbuf = step, bytearray()
                    break
        except StopIteration as stop:
            link.result, link.need = stop.value, 0
        except _Refused as exc:
            self._refuse(link, str(exc))
            return
        try:
            self._flush(link)
        except OSError as exc:
            self._drop(link, exc.strerror or str(exc))

    def _flush(self, link: _Link) -> None:
        """Send what the link's protocol queued; finish the link once its last bytes are out."""
        if link.out:
            sent = link.sock.send(link.out)
            link.out = link.out[sent:]
        if link.out:
            self.sel.modify(link.sock, selectors.EVENT_WRITE, link)
        elif link.result is not None:
            self._finish(link)
        else:
            self.sel.modify(link.sock, selectors.EVENT_READ, link)

    def _finish(self, link: _Link) -> None:
        """Hand over a link whose handshake succeeded."""
        self.sel.unregister(link.sock)
        self.pending.pop(id(link), None)
        rank = link.result
        assert rank is not None
        if rank in self.done:  # a second connection from one rank: keep the first
            link.sock.close()
            self.notes.append(f"{link.where}: duplicate connection from rank {rank}")
            return
        self.done[rank] = link.sock
        self.expected.discard(rank)

    def _refuse(self, link: _Link, reason: str) -> None:
        """End a handshake that failed on purpose: tell an acceptor's peer why; a dialler's failure is fatal."""
        if link.peer >= 0:
            self._drop(link, reason)
            raise TransportError(f"tcp transport: rank {self.me} cannot connect to rank {link.peer} at "
                                 f"{link.where}: {reason}")
        text = reason.encode()[:1000]
        try:
            # Unread input would turn our close into a reset that discards the reason on its way.
            for _ in range(16):
                if not link.sock.recv(65536):
                    break
        except OSError:
            pass
        try:
            link.sock.send(b"R" + struct.pack("<H", len(text)) + text)
        except OSError:
            pass
        self._drop(link, reason)

    def _drop(self, link: _Link, reason: str, register: bool = True) -> None:
        """Close a failed link; a dial is retried later, an accepted stranger is only noted."""
        if register:
            self.sel.unregister(link.sock)
        self.pending.pop(id(link), None)
        link.sock.close()
        if link.peer < 0:
            if len(self.notes) < 20:
                self.notes.append(f"{link.where}: {reason}")
        else:
            self._retry(link.peer, reason)

    def _retry(self, peer: int, reason: str) -> None:
        """Dial `peer` again after a back-off (5 ms doubling up to 0.5 s)."""
        self.last_error[peer] = reason
        self.attempts[peer] += 1
        self.to_dial[peer] = time.monotonic() + min(0.5, 0.005 * 2 ** self.attempts[peer])

    def _timeout_error(self, timeout: float) -> TimeoutError:
        """The error naming the ranks not connected, the addresses tried, and the strangers refused."""
        missing = sorted(self.wanted - set(self.done))
        parts = []
        for peer in missing[:8]:
            if peer < self.me:
                entry = self.cards[peer]["tcp"]
                last = self.last_error.get(peer, "no answer to the handshake")
                parts.append(f"rank {peer}: dialled {entry['addr']}:{entry['port']} "
                             f"{self.attempts[peer] + 1} time(s), last error: {last}")
            else:
                host, port = self.listener.getsockname()[:2]
                parts.append(f"rank {peer}: never completed a handshake with our listener {host}:{port}")
        if len(missing) > 8:
            parts.append(f"and {len(missing) - 8} more")
        rejected = f"; rejected connections: {'; '.join(self.notes)}" if self.notes else ""
        mine = "{}:{}".format(*self.listener.getsockname()[:2])
        return TimeoutError(f"tcp transport: rank {self.me} (listening at {mine}) timed out after {timeout:g} s "
                            f"connecting to "
                            f"rank(s) {missing} ({'; '.join(parts)}){rejected}", missing)


def connect_all(me: int, peers: list[int], cards: list[dict[str, Any]], listener: socket.socket, run_id: str,
                auth_key: str, timeout: float, check: Callable[[], None] | None = None,
                dead_after: float = DEFAULT_DEAD_AFTER) -> dict[int, socket.socket]:
    """Connect this rank to every peer: dial the lower ranks, accept the higher ones.

    Args:
        me: this rank.
        peers: the ranks to connect to.
        cards: every rank's card; `cards[p]["tcp"]` holds p's "addr" and "port".
        listener: this rank's listening socket (non-blocking).
        run_id: the job's id; connections from other jobs are refused.
        auth_key: the shared secret ("" for none).
        timeout: seconds for the whole set-up.
        check: called about every 0.25 s while waiting; raises if a peer is known to have died.
        dead_after: seconds of silence after which a connection fails (see `tune_socket`).

    Returns:
        A handshaken, tuned, non-blocking socket per peer.

    Raises:
        TimeoutError: some peers did not connect in time.
        TransportError: a peer refused the handshake.
    """
    rendezvous = _Rendezvous(me, peers, cards, listener, run_id, auth_key)
    try:
        links = rendezvous.run(timeout, check)
    except BaseException:
        for sock in rendezvous.done.values():
            sock.close()
        raise
    finally:
        rendezvous.close()
    for sock in links.values():
        tune_socket(sock, dead_after)
    return links
