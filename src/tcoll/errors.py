"""The exception tree of tcoll.

Every failure that tcoll raises on purpose is a `TcollError`, so a caller can
catch them all in one place; the more specific classes also derive from the
matching builtin (`TimeoutError`, `ConnectionError`, `ValueError`) so code that
catches those keeps working.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable

__all__ = [
    "TcollError",
    "RendezvousError",
    "TimeoutError",
    "PeerLostError",
    "MessageSizeError",
    "TransportError",
    "SpawnError",
]


class TcollError(Exception):
    """Base class of every error tcoll raises on purpose."""


class RendezvousError(TcollError):
    """The ranks could not meet: a rank did not arrive, or the store is unreachable.

    Attributes:
        missing: the ranks that did not arrive (empty when unknown).
        address: the rendezvous address that was used.
    """

    def __init__(self, message: str, missing: Iterable[int] = (), address: str = "") -> None:
        super().__init__(message)
        self.missing = sorted(missing)
        self.address = address

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.missing, self.address)


class TimeoutError(TcollError, builtins.TimeoutError):
    """An operation did not complete within its timeout.

    Attributes:
        peers: the ranks that never answered, when the operation knows them.
    """

    def __init__(self, message: str, peers: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.peers = sorted(set(peers))

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.peers)


class PeerLostError(TcollError, ConnectionError):
    """A peer's process is gone or its connection closed.

    Attributes:
        rank: the rank (in the world communicator) that was lost.
    """

    def __init__(self, rank: int, detail: str = "") -> None:
        text = f"peer rank {rank} is lost"
        super().__init__(f"{text}: {detail}" if detail else text)
        self.rank = rank
        self.detail = detail

    def __reduce__(self) -> tuple:  # pickled across processes (tcoll.spawn) with its fields, not its text
        return type(self), (self.rank, self.detail)


class MessageSizeError(TcollError, ValueError):
    """A message is larger than the buffer posted to receive it."""


class MismatchError(TcollError):
    """Ranks made different calls: a collective's sizes, or its kind, disagree between ranks."""


class TransportError(TcollError):
    """A transport failed to connect or to move data (not a lost peer)."""


class SpawnError(TcollError):
    """A rank started by `tcoll.spawn` failed.

    Attributes:
        rank: the first rank that failed.
        remote_traceback: the traceback text printed by that rank, if any.
    """

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.message, self.remote_traceback)
