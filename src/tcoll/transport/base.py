"""What every transport implements to set up its channels (the channels' contract is `tcoll.p2p.channel`).

A *transport* (loopback, shm, tcp) serves the peers it can reach with one
channel each. Life cycle: `prepare()` creates local resources and returns
what peers need in this rank's card; once every card is known,
`connect(peers, cards, store, timeout)` returns a channel for each peer
assigned to it; `close()` frees everything.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ..env import Settings
    from ..p2p.channel import Channel
    from ..p2p.engine import Engine
    from ..store import Store

__all__ = ["Transport", "Card"]

Card = dict[str, Any]
"""What a rank publishes at rendezvous: host identity, pid, and each transport's address."""


class Transport(abc.ABC):
    """Creates channels of one kind.

    Args:
        engine: the engine channels report to.
        settings: tuning knobs.
        run_id: a name unique to this job, for naming shared resources.
        master_host: the rendezvous master's host (None: a job on one host, or
            unknown); TCP listens on the interface that reaches it.
    """

    name: ClassVar[str] = "?"

    def __init__(self, engine: Engine, settings: Settings, run_id: str, master_host: str | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.run_id = run_id
        self.master_host = master_host
        # Called now and then while `connect` waits for peers: raises if one of them died.
        self.peer_check: Callable[[], None] = _nothing_to_check

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


def _nothing_to_check() -> None:
    """The default `Transport.peer_check`: no peer is known to have died."""
