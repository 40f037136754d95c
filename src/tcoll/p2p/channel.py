"""The contract between the engine and a transport's channels, and the header every message starts with.

A *channel* moves messages both ways between this rank and one peer. The
engine drives it; the channel reports back through four engine methods.

What a channel offers the engine (all called with the engine's lock held;
none blocks):

- `post(send)` queues a `SendWork`; `progress()` pushes its header and
  payload, in order, and calls `engine.send_done(send)` once the last byte is
  handed over.
- `progress()` moves what can move now, both ways; True if anything did.
  When a header arrives it asks `engine.match(peer, ctx, tag, nbytes, stamp)` for
  the `RecvWork` it belongs to; None means "leave it in the channel for now"
  and the channel asks again on the next call. The payload is copied into
  `recv.data[recv.offset:]` (or skipped when `recv.data` is None), then
  `engine.recv_done(recv)`.
- `check_alive()` raises `PeerLostError` if the peer is gone; so may
  `progress()`. The engine then fails every operation pending on that peer.
- `pending_works()`, `peer_doorbell()` and `close()`.
- Optionally, a lean path for blocking calls (`lean` is True): `send_now`
  writes a whole user message at once and `recv_now` takes the next one if
  it is the one asked for; both do nothing and return False otherwise, and
  the engine then goes the ordinary way. They bypass matching, so the engine
  calls them only when no other receive or probe could claim the message.

What a channel may call on the engine: `match`, `recv_done`, `send_done`,
`expects_from`, and read `rank`, `settings` and `doorbell`.
"""

from __future__ import annotations

import abc
import struct
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import TransportError

if TYPE_CHECKING:
    from .engine import Engine
    from .waiting import Doorbell
    from .work import SendWork, Work

__all__ = ["HEADER", "MAGIC", "Channel", "pack_header", "unpack_header"]

# magic | ctx | tag | nbytes | stamp (low word, high word): what call the message belongs to, so that a
# receiver can tell a message of another call at the same point (tcoll.algos.stamps); 0 for user messages.
HEADER = struct.Struct("<IIqQQQ")
MAGIC = 0x7C011002  # "tcoll" wire format, version 2
_WORD = (1 << 64) - 1


def pack_header(ctx: int, tag: int, nbytes: int, stamp: int = 0) -> bytes:
    """Encode a message header (40 bytes)."""
    return HEADER.pack(MAGIC, ctx, tag, nbytes, stamp & _WORD, stamp >> 64)


def unpack_header(raw: bytes | memoryview, peer: int) -> tuple[int, int, int, int]:
    """Decode a header into (ctx, tag, nbytes, stamp).

    Raises:
        TransportError: the bytes are not a tcoll header (stream out of sync).
    """
    magic, ctx, tag, nbytes, low, high = HEADER.unpack(raw)
    if magic != MAGIC:
        raise TransportError(f"corrupt message header from rank {peer} (magic {magic:#x})")
    return ctx, tag, nbytes, low | high << 64


class Channel(abc.ABC):
    """Moves messages between this rank and one peer. See the module docstring.

    Args:
        engine: the engine to report arrivals and completions to.
        peer: the peer's world rank.
    """

    transport_name: ClassVar[str] = "?"

    def __init__(self, engine: Engine, peer: int) -> None:
        self.engine = engine
        self.peer = peer

    @abc.abstractmethod
    def post(self, send: SendWork) -> None:
        """Queue a send; may push some of it at once, must not block."""

    @abc.abstractmethod
    def progress(self) -> bool:
        """Move what can be moved now, both ways.

        Returns:
            True if any byte moved or any operation completed.

        Raises:
            PeerLostError: the peer is gone.
        """

    @property
    def lean(self) -> bool:
        """Whether this channel has the lean blocking path (send_now, recv_now)."""
        return False

    def send_now(self, ctx: int, tag: int, buf: Any) -> bool:
        """Send a user message (ctx, tag) whole at once, if nothing is queued before it; False: nothing done."""
        return False

    def recv_now(self, ctx: int, tag: int, buf: Any, spin_ns: int, yields: bool) -> bool:
        """Take the channel's next message into `buf` if it is (ctx, tag), fits, and comes within `spin_ns`.

        Returns:
            True if taken (complete); False if nothing was taken (none came, or another message is next).
        """
        return False

    def pending_works(self) -> list[Work]:
        """The sends queued on this channel and the receive it is filling, if any."""
        return []

    def check_alive(self) -> None:
        """Raise PeerLostError if the peer is known to be gone (called while blocked)."""

    def peer_doorbell(self) -> Doorbell | None:
        """The doorbell that wakes the peer, if this rank can ring it directly (same host)."""
        return None

    def close(self) -> None:
        """Release the channel's resources."""
