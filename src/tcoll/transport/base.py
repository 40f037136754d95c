"""The interface every transport implements, and the wire header they share.

A *transport* (shm, tcp, loopback) sets up *channels*, one per peer it serves.
A channel moves messages both ways between this rank and its peer:

- outbound: `post(send)` queues a `SendWork`; `progress()` pushes its header
  and payload, in order, and calls `engine.send_done(send)` when the last byte
  is handed over.
- inbound: when a header arrives, `progress()` asks `engine.match(...)` for the
  `RecvWork` it belongs to; None means "leave it in the channel for now" and the
  channel asks again on the next call. The payload is copied into
  `recv.data[recv.offset:]` (or skipped when `recv.data` is None), then
  `engine.recv_done(recv)`.

All channel methods are called with the engine's lock held, never block, and
return quickly. A channel that finds its peer gone raises `PeerLostError`;
the engine then fails every operation pending on that peer.
"""

from __future__ import annotations

import abc
import struct
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..waiting import Doorbell
    from ..engine import Engine
    from ..env import Settings
    from ..store import Store
    from ..work import SendWork, Work

__all__ = ["HEADER", "MAGIC", "Channel", "Transport", "Card", "pack_header", "unpack_header"]

# magic | ctx | tag | nbytes | fingerprint (reserved for mismatch detection)
HEADER = struct.Struct("<IIqQQ")
MAGIC = 0x7C011001  # "tcoll" wire format, version 1

Card = dict[str, Any]
"""What a rank publishes at rendezvous: host identity, pid, and each transport's address."""


def pack_header(ctx: int, tag: int, nbytes: int, fingerprint: int = 0) -> bytes:
    """Encode a message header (32 bytes)."""
    return HEADER.pack(MAGIC, ctx, tag, nbytes, fingerprint)


def unpack_header(raw: bytes | memoryview, peer: int) -> tuple[int, int, int, int]:
    """Decode a header into (ctx, tag, nbytes, fingerprint).

    Raises:
        TransportError: the bytes are not a tcoll header (stream out of sync).
    """
    magic, ctx, tag, nbytes, fingerprint = HEADER.unpack(raw)
    if magic != MAGIC:
        from ..errors import TransportError

        raise TransportError(f"corrupt message header from rank {peer} (magic {magic:#x})")
    return ctx, tag, nbytes, fingerprint


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


class Transport(abc.ABC):
    """Creates channels of one kind.

    Life cycle: `prepare()` creates local resources and returns what peers need
    in this rank's card; after every card is known, `connect(peers, cards,
    store, timeout)` returns a channel for each assigned peer; `close()` frees
    everything.

    Args:
        engine: the engine channels report to.
        settings: tuning knobs.
        run_id: a name unique to this job, for naming shared resources.
    """

    name: ClassVar[str] = "?"

    def __init__(self, engine: Engine, settings: Settings, run_id: str) -> None:
        self.engine = engine
        self.settings = settings
        self.run_id = run_id

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can work on this machine at all."""
        return True

    @abc.abstractmethod
    def can_connect(self, me: Card, peer: Card) -> bool:
        """Whether this transport can reach `peer` from `me` (both cards known)."""

    @abc.abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Create local resources; return the card entries peers need to connect."""

    @abc.abstractmethod
    def connect(self, peers: list[int], cards: list[Card], store: Store, timeout: float) -> dict[int, Channel]:
        """Connect to `peers` (world ranks assigned to this transport).

        Every rank calls connect at the same point, so the transport may use the
        store to coordinate (keys under its own prefix).

        Returns:
            A channel per peer.

        Raises:
            TransportError, RendezvousError, tcoll.TimeoutError.
        """

    def close(self) -> None:
        """Free the transport's resources (channels are closed by the engine first)."""
