"""The TCP store's wire format, shared by the client (`tcp`) and the server (`tcp_server`).

All integers are little endian; the format is the same both ways:

    frame   = u32 body length, body
    request = op (u8), fields
    reply   = status (u8: 0 ok, 1 timeout, 2 error), fields
    fields  = (u32 length, bytes)*

Numbers travel as fields packed with `struct` (timeouts as f64, counters as
i64); nothing received is unpickled or evaluated. A connection opens with a
handshake: the client sends HELLO with `MAGIC`, the server answers with a
random nonce, the client sends AUTH with HMAC-SHA256(key, nonce) (empty when
there is no key), and the server answers OK or ERROR.
"""

from __future__ import annotations

import enum
import socket
import struct

__all__ = [
    "MAGIC", "OK", "TIMEOUT", "ERROR", "MAX_FRAME", "I64", "F64", "Op", "ProtocolError",
    "encode", "decode", "send_frame", "recv_frame", "format_address",
]  # fmt: skip

MAGIC = b"tcoll-store/1"
OK, TIMEOUT, ERROR = 0, 1, 2
MAX_FRAME = 256 << 20  # refuse absurd lengths instead of allocating them
_U32 = struct.Struct("<I")
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


def encode(code: int, *fields: bytes) -> bytes:
    """Build a request or reply body: a code byte, then length-prefixed fields."""
    parts = [bytes([code])]
    for field in fields:
        parts += (_U32.pack(len(field)), field)
    return b"".join(parts)


def decode(body: bytes) -> tuple[int, list[bytes]]:
    """Split a body into its code and fields.

    Raises:
        ProtocolError: the body is malformed.
    """
    if not body:
        raise ProtocolError("empty frame")
    fields, pos = [], 1
    while pos < len(body):
        if pos + 4 > len(body):
            raise ProtocolError("truncated field length")
        (n,) = _U32.unpack_from(body, pos)
        pos += 4
        if pos + n > len(body):
            raise ProtocolError("truncated field")
        fields.append(body[pos : pos + n])
        pos += n
    return body[0], fields


def send_frame(sock: socket.socket, body: bytes) -> None:
    """Send one length-prefixed frame.

    Raises:
        ValueError: the body exceeds MAX_FRAME.
        OSError: the connection failed.
    """
    if len(body) > MAX_FRAME:
        raise ValueError(f"store request of {len(body)} bytes exceeds the limit of {MAX_FRAME}")
    sock.sendall(_U32.pack(len(body)) + body)


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


def recv_frame(sock: socket.socket) -> bytes | None:
    """Receive one frame; None when the peer closed the connection between frames.

    Raises:
        ProtocolError: the announced length is absurd.
        OSError: the connection failed or closed mid-frame.
    """
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = _U32.unpack(head)
    if n == 0 or n > MAX_FRAME:
        raise ProtocolError(f"bad frame length {n}")
    body = _recv_exact(sock, n)
    if body is None:
        raise ConnectionResetError("connection closed in the middle of a frame")
    return body


def format_address(host: str, port: int) -> str:
    """Return "tcp://host:port", with brackets around an IPv6 host."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
