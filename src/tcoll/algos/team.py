"""How a collective algorithm runs: the Team it talks through and the Work that steps it.

An algorithm is a generator over point-to-point requests. It posts sends and
receives through its `Team`, then `yield`s them (a Work, or a list of Works)
to wait until all are complete, and finally returns its result:

    def swap(team, buf, tmp):
        yield [team.send(buf, peer), team.recv(tmp, peer)]
        return tmp

`CollectiveWork` steps the generator: each time what it yielded completes
(from the completion callbacks that progress runs, on whichever thread makes
progress), it resumes it. Several collectives can therefore be in flight on
one communicator, and on its sub-communicators, without threads: whoever
waits moves all of them along.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from ..errors import MismatchError
from ..p2p.engine import Engine
from ..p2p.hosts import HostMap
from ..p2p.watch import BLOCK_BITS
from ..p2p.work import RecvWork, Work
from .stamps import disagreement

__all__ = ["Team", "CollectiveWork", "Algorithm", "SUBTAGS"]

Algorithm = Generator[Any, None, Any]
SUBTAGS = 1 << BLOCK_BITS  # message streams per collective call: tag = sequence * SUBTAGS + phase * 8 + sub
_PHASES = 8


class Team:
    """What an algorithm sees of its communicator during one collective call.

    Ranks are the communicator's ranks (0 <= rank < size); every message of
    the call carries the call's own tag, so concurrent collectives never match
    each other's messages, and the call's stamp (tcoll.algos.stamps), so a
    receive that gets a message of another call fails with MismatchError.

    Attributes:
        rank: this rank in the communicator.
        size: the number of ranks.
        chunk_bytes: the message size pipelined algorithms cut their data into.
        stamp: what the call is (the same on every rank that makes the same call).
    """

    __slots__ = ("rank", "size", "chunk_bytes", "sequence", "stamp", "_engine", "_world", "_ctx", "_tag",
                 "_receives")

    def __init__(self, engine: Engine, world_ranks: list[int], rank: int, ctx: int, sequence: int,
                 chunk_bytes: int, stamp: int = 0) -> None:
        self.rank = rank
        self.size = len(world_ranks)
        self.chunk_bytes = chunk_bytes
        self.stamp = stamp
        self._engine = engine
        self._world = world_ranks
        self._ctx = ctx
        self.sequence = sequence
        self._tag = sequence * SUBTAGS
        self._receives: list[RecvWork] = []  # every receive of the call, all phases: withdrawn if it fails

    def phase(self, index: int) -> Team:
        """This Team with separate message streams, for phase `index` of a composite call.

        Phases nest: phase k of a phase-j Team is phase j + k of the call.
        Algorithms use streams (`sub`) 0-7 within a phase.

        Raises:
            ValueError: the call's 8 phases are used up.
        """
        offset = self._tag - self.sequence * SUBTAGS + index * 8
        if index < 0 or offset >= SUBTAGS:
            raise ValueError(f"phase {index} goes beyond the {_PHASES} phases of a collective call")
        other = Team(self._engine, self._world, self.rank, self._ctx, self.sequence, self.chunk_bytes, self.stamp)
        other._tag += offset
        other._receives = self._receives
        return other

    def sub(self, members: list[int], index: int) -> Team:
        """A Team of some of this Team's ranks (`members`, this rank among them) on phase `index`.

        The steps of a hierarchical algorithm (inside a host, between hosts) run on sub-Teams;
        each step on its own phase, so their messages never meet. Receives are withdrawn with the call's.
        """
        other = self.phase(index)
        other._world = [self._world[m] for m in members]
        other.rank = members.index(self.rank)
        other.size = len(members)
        return other

    def hosts(self) -> HostMap:
        """Which of this Team's ranks share a host (in Team rank numbering)."""
        return self._engine.hosts.restrict(self._world)

    def withdraw(self) -> None:
        """Cancel the call's receives that no message matched yet, and drop its late messages.

        After a failed call, messages of it that peers still send are discarded
        on arrival instead of landing in the user's buffers or piling up.
        """
        for work in self._receives:
            if not work.finished:
                self._engine.cancel(work)
        self._receives = []
        base = self.sequence * SUBTAGS
        self._engine.abandon(self._ctx, base, base + SUBTAGS)

    def send(self, arr: np.ndarray, peer: int, sub: int = 0) -> Work:
        """Start sending the contiguous array `arr` to team rank `peer` (stream `sub`, 0-7).

        Messages to one peer on one stream arrive in the order they were sent.
        """
        return self._engine.isend(_raw(arr), self._world[peer], self._ctx, self._tag + sub, arr, self.stamp)

    def recv(self, arr: np.ndarray, peer: int, sub: int = 0) -> Work:
        """Start receiving exactly arr.nbytes bytes from team rank `peer` into `arr` (stream `sub`, 0-7).

        Raises:
            ValueError: `arr` is read-only (an algorithm bug: caught here, not mid-copy in a transport).
        """
        if not arr.flags.writeable:
            raise ValueError(f"collective #{self.sequence}: receive into a read-only buffer")
        work = self._engine.irecv(_raw(arr), self._world[peer], self._ctx, self._tag + sub, arr, self.stamp)
        self._receives.append(work)  # type: ignore[arg-type]
        return work

    def rank_of(self, world_rank: int) -> int:
        """The communicator rank of a world rank (as messages name their peers)."""
        return self._world.index(world_rank) if world_rank in self._world else world_rank

    def chunk_count(self, itemsize: int) -> int:
        """Elements per pipelined message for items of `itemsize` bytes (at least 1)."""
        return max(1, self.chunk_bytes // max(1, itemsize))


def _raw(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a contiguous array (the engine moves bytes)."""
    if arr.dtype == np.uint8 and arr.ndim == 1:
        return arr
    return arr.reshape(-1).view(np.uint8)


class CollectiveWork(Work):
    """The Work of one collective call: steps its algorithm as requests complete.

    Args:
        engine: the engine whose progress completes the requests.
        algorithm: the generator to run (already created, not started).
        description: names the call in errors, e.g. "all_reduce #7 (ring, 4096 B)".
        team: the call's Team (its receives are withdrawn if the call fails).
    """

    __slots__ = ("_algorithm", "_pending", "_stepping", "_team", "received")

    def __init__(self, engine: Engine, algorithm: Algorithm, description: str, team: Team) -> None:
        super().__init__(engine, description)
        self._algorithm = algorithm
        self._pending: list[Work] = []
        self._stepping = False
        self._team = team
        self.received = False  # whether this rank's part took any message (a root of a broadcast takes none)

    def start(self) -> CollectiveWork:
        """Run the algorithm up to its first wait."""
        self._step()
        return self

    def peers(self) -> list[int]:
        """The world ranks that the requests still pending wait on."""
        return sorted({peer for work in self._pending if not work.finished for peer in work.peers()})

    def _step(self, _completed: Work | None = None) -> None:
        """Resume the algorithm while what it waits on is complete; never re-entered."""
        if self._stepping or self._done:
            return
        engine = self._engine
        assert engine is not None
        with engine.lock:  # completions happen under this lock: no missed callback
            self._stepping = True
            try:
                self._advance()
            except BaseException as exc:  # noqa: BLE001 - the algorithm's failure is the call's failure
                self.abort(exc)
            finally:
                self._stepping = False

    def _advance(self) -> None:
        while True:
            for work in self._pending:
                if not work.finished:
                    work.add_done_callback(self._step)
                    return
                error = work.failure
                if isinstance(error, MismatchError):
                    raise self._explained(error)
                if type(work) is RecvWork and work.nbytes != work.capacity and work.nbytes >= 0:
                    peer = self._team.rank_of(work.peer)
                    raise MismatchError(
                        f"{self._description}: rank {peer} sent {work.nbytes} bytes where {work.capacity} were "
                        "expected; do all ranks call it with the same sizes?", ranks=[peer]) from error
                if error is not None:
                    raise error
            try:
                waited = self._algorithm.send(None)
            except StopIteration as stop:
                self._pending = []
                self.received = bool(self._team._receives)
                self._team._receives = []
                self._finish(stop.value)
                return
            self._pending = [waited] if isinstance(waited, Work) else list(waited)

    def _explained(self, error: BaseException) -> BaseException:
        """A receive's raw stamp mismatch, said in terms of this call and the communicator's ranks."""
        if not isinstance(error, MismatchError) or error.peer < 0 or not error.mine:
            return error
        peer = self._team.rank_of(error.peer)
        text = disagreement(peer, error.theirs, self._team.rank, error.mine)
        explained = MismatchError(f"{self._description}: {text}", ranks=[peer], peer=error.peer, mine=error.mine,
                                  theirs=error.theirs)
        explained.__cause__ = error
        return explained

    def abort(self, error: BaseException) -> None:
        """Fail the call: withdraw its receives not yet matched, drop its late messages, stop the algorithm.

        A receive that a message already started to fill completes as usual.
        """
        engine = self._engine
        assert engine is not None
        with engine.lock:  # another thread may be stepping this call
            if self._done:
                return
            self._pending = []
            self._fail(error)  # first, so that the cancellations below find the call over
            self._team.withdraw()
            try:
                self._algorithm.close()
            except ValueError:  # aborted from within the algorithm's own step: it is ending anyway
                pass
