"""The exception tree of tcoll.

Every failure that tcoll raises on purpose is a `TcollError`, so a caller can
catch them all in one place; the more specific classes also derive from the
matching builtin (`TimeoutError`, `ConnectionError`, `ValueError`) so code that
catches those keeps working.
"""

from __future__ import annotations

import builtins
import copy
from collections.abc import Iterable

__all__ = [
    "TcollError",
    "RendezvousError",
    "TimeoutError",
    "PeerLostError",
    "MessageSizeError",
    "MismatchError",
    "PeerFailedError",
    "TransportError",
    "SpawnError",
    "RevokedError",
    "fresh",
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
    """Ranks made different calls at the same point: another collective, op, dtype, size, root or algorithm.

    Attributes:
        ranks: the ranks (of the communicator) found to disagree with this one, when known.
        peer: the world rank whose message showed the disagreement (-1: none).
        mine, theirs: the two calls' stamps (tcoll.algos.stamps), when known.
    """

    def __init__(self, message: str, *, ranks: Iterable[int] = (), peer: int = -1, mine: int = 0,
                 theirs: int = 0) -> None:
        super().__init__(message)
        self.ranks = sorted(set(ranks))
        self.peer = peer
        self.mine = mine
        self.theirs = theirs

    def __reduce__(self) -> tuple:
        return _rebuild_mismatch, (self.args[0], self.ranks, self.peer, self.mine, self.theirs)


def _rebuild_mismatch(message: str, ranks: list[int], peer: int, mine: int, theirs: int) -> MismatchError:
    return MismatchError(message, ranks=ranks, peer=peer, mine=mine, theirs=theirs)


class PeerFailedError(TcollError):
    """Another rank's part of this call failed (a bad argument there, an exception in a user op, a timeout).

    Attributes:
        rank: the rank (of the communicator) whose part failed.
        cause: what failed there, as that rank reported it.
    """

    def __init__(self, message: str, rank: int = -1, cause: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.rank, self.cause)


class RevokedError(TcollError):
    """The communicator was revoked (`comm.revoke()`, on this rank or another): only failed, agree, shrink and
    close still work on it.

    Attributes:
        rank: the rank (of the communicator) that revoked it first, as far as this rank knows (-1: unknown).
    """

    def __init__(self, message: str, rank: int = -1) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple:
        return type(self), (self.args[0], self.rank)


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


def known_to_peers(error: BaseException) -> BaseException:
    """Mark `error` as one every rank of its call learns by itself (so nobody needs to be told); returns it."""
    try:
        error.tcoll_known_to_peers = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type with slots: it is told, which costs a few messages
        pass
    return error


def is_known_to_peers(error: BaseException) -> bool:
    """Whether `error` was marked by known_to_peers."""
    return bool(getattr(error, "tcoll_known_to_peers", False))


def fresh(error: BaseException) -> BaseException:
    """A copy of a kept `error` (a Work's, a lost peer's), to raise it once more.

    Raising the kept object itself would add the raising frames to its traceback
    each time, and a traceback holds its frames' locals: the caller's objects (a
    model, its buffers) would live as long as the error is kept. The copy has the
    kept error's traceback and cause, and goes when the caller lets it go.
    """
    try:
        copied = copy.copy(error)
    except Exception:  # noqa: BLE001 - an error that does not copy is raised as it is
        return error
    copied.__dict__.update(error.__dict__)  # (what tcoll notes on it: its cause's call, whether peers know it)
    copied.__cause__, copied.__suppress_context__ = error.__cause__, error.__suppress_context__
    return copied.with_traceback(error.__traceback__)
