"""CommCore: the part of a Communicator that the other modules of tcoll.comm may touch.

The collectives, point-to-point helpers and sub-communicators are written as
functions of the communicator in modules of their own (reductions, movement,
uneven, objects, prefix, pairs, parcels, groups, plans, calls). What they
need of it beyond its public surface (rank, size, run_id, timeout,
world_ranks) is here, under public names, and nowhere else: a sibling
reads `comm.core.<name>`, never a private attribute of the Communicator.
The communicator builds its core once, in its constructor; only `closed`
changes afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import RevokedError, TcollError

if TYPE_CHECKING:
    from ..p2p.engine import Engine
    from ..transport.base import Transport
    from .dispatch import Dispatcher

__all__ = ["CommCore"]


class CommCore:
    """A communicator's engine, dispatcher, world ranks and contexts, for the modules of tcoll.comm.

    Attributes:
        engine: the rank's engine (tcoll.p2p.engine), shared by the world and every sub-communicator.
        dispatch: the communicator's dispatcher: every collective call goes through it.
        world: the world rank of each rank of the communicator (read-only by convention).
        p2p_ctx: the engine context of the communicator's point-to-point messages (its
            collectives use p2p_ctx + 1, inside the dispatcher).
        transports: the channels' transports (the world's; a sub-communicator shares them).
        closed: whether this communicator's close() has begun.
        revoked: the error its calls raise since it was revoked (tcoll.comm.survival), or None.
        usable: neither closed nor revoked (one test on the fast paths).
        survival: its view of dead ranks, revocation and agreements (a tcoll.comm.survival.Survival).
    """

    __slots__ = ("engine", "dispatch", "world", "p2p_ctx", "transports", "closed", "revoked", "usable", "survival")

    def __init__(self, engine: Engine, dispatch: Dispatcher, world: list[int], p2p_ctx: int,
                 transports: list[Transport]) -> None:
        self.engine = engine
        self.dispatch = dispatch
        self.world = world
        self.p2p_ctx = p2p_ctx
        self.transports = transports
        self.closed = False
        self.revoked: RevokedError | None = None
        self.usable = True
        self.survival: Any = None

    def check_open(self, revoked_ok: bool = False) -> None:
        """Raise unless the communicator is open (and, unless `revoked_ok`, not revoked).

        Raises:
            TcollError: close() was called.
            tcoll.RevokedError: the communicator was revoked.
        """
        if self.usable:
            return
        if self.closed:
            raise TcollError("the communicator is closed")
        if self.revoked is not None and not revoked_ok:
            raise RevokedError(str(self.revoked), self.revoked.rank)
