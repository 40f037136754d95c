"""The TCP store's wire format, shared by the client (`tcp`) and the server (`tcp_server`).

All integers are little endian; the format is the same both ways:

    frame   = u32 body length, body
    request = op (u8), fields
    reply   = status (u8), fields
    fields  = (u32 length, bytes)*

Numbers travel as fields packed with `struct` (timeouts as f64, counters as
i64); nothing received is unpickled or evaluated.

Handshake (version 2, named by `MAGIC`), before any request:

    client -> server  HELLO(MAGIC, client nonce)
    server -> client  OK(server nonce, HMAC(key, "tcoll-store/S" + client nonce + server nonce))
                    | ERROR(reason)                       (another protocol version)
    client -> server  AUTH(HMAC(key, "tcoll-store/C" + server nonce + client nonce))
    server -> client  OK | ERROR(reason) (wrong key) | GOODBYE(reason) (connection limit: retry)

Each side proves it knows the key (empty proofs when there is none), and the
role letter in each HMAC keeps a proof from being reflected back. Until the
client has proved the key, the server reads frames of at most
`HANDSHAKE_FRAME` bytes and allocates nothing from a length prefix.

Reply statuses: OK, TIMEOUT (fields: the missing keys), ERROR (a message; the
request was wrong), LIMIT (a message; the request exceeds one of the store's
limits, nothing was stored), GOODBYE (a message; the server closed this
connection without executing anything on it: idle, or too many connections;
the client may reconnect and send the request again).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import socket
import struct

__all__ = [
    "MAGIC", "OK", "TIMEOUT", "ERROR", "LIMIT", "GOODBYE", "MAX_FRAME", "HANDSHAKE_FRAME", "NONCE",
    "I64", "F64", "U32", "Op", "ProtocolError", "encode", "encode_parts", "decode", "send_frame", "recv_frame",
    "proof", "format_address",
]  # fmt: skip

MAGIC = b"tcoll-store/2"
OK, TIMEOUT, ERROR, LIMIT, GOODBYE = 0, 1, 2, 3, 4
MAX_FRAME = (1 << 32) - 1  # what the u32 prefix can say; the server's own limits are lower
HANDSHAKE_FRAME = 256
"""The longest frame either side reads before the other side has proved the key."""
NONCE = 16
U32 = struct.Struct("<I")
I64 = struct.Struct("<q")
"""Counters and counts on the wire."""
F64 = struct.Struct("<d")
"""Timeouts on the wire (seconds)."""


class Op(enum.IntEnum):
    """Request codes."""

    HELLO = 1
    AUTH = 2
    SET = 3
    MGET = 4
    WAIT = 5
    ADD = 6
    CAS = 7
    CHECK = 8
    DELETE = 9
    NUM_KEYS = 10


class ProtocolError(Exception):
    """The bytes received do not follow the store's wire format."""


def proof(key: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """The handshake proof that the side playing `role` (b"S" server, b"C" client) knows `key`.

    Returns:
        HMAC-SHA256 over the role and both nonces; b"" when there is no key.
    """
    if not key:
        return b""
    return hmac.new(key, b"tcoll-store/" + role + first + second, hashlib.sha256).digest()


def encode_parts(code: int, *fields: bytes) -> list[bytes]:
    """A whole frame, length prefix included, as buffers that reference large fields instead of copying them.

    Raises:
        ValueError: the frame exceeds what the u32 prefix can say.
    """
    parts: list[bytes] = []
    run = bytearray([code])  # small pieces are joined; large fields travel as they are
    total = 1
    for field in fields:
        run += U32.pack(len(field))
        total += 4 + len(field)
        if len(field) > 4096:
            parts += (bytes(run), field)
            run = bytearray()
        else:
            run += field
    if total > MAX_FRAME:
        raise ValueError(f"store message of {total} bytes exceeds the wire's limit of {MAX_FRAME}")
    if run:
        parts.append(bytes(run))
    return [U32.pack(total), *parts]


def encode(code: int, *fields: bytes) -> bytes:
    """Build a request or reply body: a code byte, then length-prefixed fields."""
    parts = [bytes([code])]
    for field in fields:
        parts += (U32.pack(len(field)), field)
    return b"".join(parts)


def decode(body: bytes | bytearray) -> tuple[int, list[bytes]]:
    """Split a body into its code and fields.

    Raises:
        ProtocolError: the body is malformed.
    """
    if not body:
        raise ProtocolError("empty frame")
    view = memoryview(body)
    fields, pos = [], 1
    while pos < len(body):
        if pos + 4 > len(body):
            raise ProtocolError("truncated field length")
        (n,) = U32.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ProtocolError("truncated field")
        fields.append(bytes(view[pos : pos + n]))
        pos += n
    return body[0], fields


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send one length-prefixed frame.

    Raises:
        ValueError: the body exceeds what a frame can carry.
        OSError: the connection failed.
    """
    if len(body) > MAX_FRAME:
        raise ValueError(f"store message of {len(body)} bytes exceeds the wire's limit of {MAX_FRAME}")
    sock.sendall(U32.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Read exactly n bytes; None on a clean end of stream before the first byte."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionResetError("connection closed in the middle of a frame")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> bytes | None:
    """Receive one frame; None when the peer closed the connection between frames.

    Args:
        sock: a blocking socket.
        limit: the longest body accepted (`HANDSHAKE_FRAME` before the peer proved the key).

    Raises:
        ProtocolError: the announced length is 0 or above `limit` (nothing is allocated for it).
        OSError: the connection failed or closed mid-frame.
    """
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = U32.unpack(head)
    if n == 0 or n > limit:
        raise ProtocolError(f"bad frame length {n} (limit {limit})")
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionResetError("connection closed in the middle of a frame")
    return body


def format_address(host: str, port: int) -> str:
    """Return "tcp://host:port", with brackets around an IPv6 host."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
