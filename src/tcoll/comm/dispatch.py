"""The one place a collective call is numbered, chosen and run: on a Team, or on the shared-memory arena.

Every collective method checks its arguments (`tcoll.comm.checks`), describes
the call as a `Call`, and hands it to its communicator's `Dispatcher`, which

1. numbers it: every call takes the next sequence number, alike on every rank;
2. chooses its algorithm: the one asked for (checked), or the cost model's
   choice (`tcoll.algos.select`), cached per call signature;
3. runs it: a *direct* algorithm on the communicator's arena (tcoll.shm,
   opened inside the first such call), or a *team* algorithm as a
   `CollectiveWork` over point-to-point (tcoll.algos), waited for unless the
   call is asynchronous.

A call made of several steps (scatter and the v-collectives learn sizes
first, then move the data) is a *program*: a generator that yields one Call
per step and receives each step's result. A blocking program runs each step
as above; an asynchronous one runs them all in one CollectiveWork. Either way
the whole program takes one sequence number, and step k talks on phases 2k
and 2k+1 of the call (phases 6 and 7 open the arena).

Importing this module registers both algorithm families.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from ..algos import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather,  # noqa: F401 - registers
                     reduce, reduce_scatter, scatter)
from ..algos import select
from ..algos.registry import AlgorithmInfo, lookup
from ..algos.team import Algorithm, CollectiveWork, Team
from ..errors import TcollError, TransportError
from ..ops import Op
from ..p2p.engine import Engine
from ..shm import blocks, vector  # noqa: F401 - registers the direct algorithms
from ..shm.arena import ADDRESS_BYTES, Arena, agreed_slot, create_segment, decode_address, encode_address, open_segment
from ..shm.heap import heap_of

__all__ = ["Call", "Dispatcher", "Program"]

_ARENA_PHASE = 6  # the phases of a call that open the arena: 6 (address) and 7 (barrier)
_MAX_STEPS = 3  # steps of a program: phases 0-5


class Call:
    """One collective call (or one step of a program), its arguments checked.

    Args:
        collective: the registry's name ("all_reduce", ...).
        args: the algorithm's arguments after the team or arena (see tcoll.algos.registry).
        nbytes: one rank's input in bytes, for the cost model.
        label: the user's name for the call, in messages (default: collective).
        op: the reduce op, if any (finish() applies its last touch, e.g. avg's division).
        itemsize: bytes per element of a reduction (a slot share must hold one per rank).
        uneven: the ranks' counts differ.
        algorithm: "auto" or the algorithm asked for.
        result: what the call returns.
        finish_buf: the reduced data op.finish touches (None: nothing to finish on this rank).
        staged: (place, block): this rank's own block, which team algorithms expect in
            place (copied there first) and direct ones take as their last argument.
    """

    __slots__ = ("collective", "args", "nbytes", "label", "op", "itemsize", "uneven", "algorithm", "result",
                 "finish_buf", "staged")

    def __init__(self, collective: str, args: tuple[Any, ...], nbytes: int, *, label: str | None = None,
                 op: Op | None = None, itemsize: int = 1, uneven: bool = False, algorithm: str = "auto",
                 result: Any = None, finish_buf: np.ndarray | None = None,
                 staged: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.collective = collective
        self.args = args
        self.nbytes = nbytes
        self.label = label or collective
        self.op = op
        self.itemsize = itemsize
        self.uneven = uneven
        self.algorithm = algorithm
        self.result = result
        self.finish_buf = finish_buf
        self.staged = staged

    def finish(self, size: int) -> Any:
        """The call's last touch on this rank (avg divides), and its result."""
        if self.finish_buf is not None and self.op is not None:
            self.op.finish(self.finish_buf, size)
        return self.result


Program = Generator[Call, Any, Any]  # yields a Call per step, gets its result, returns the call's


class Dispatcher:
    """Numbers, chooses and runs the collective calls of one communicator (see the module docstring).

    Args:
        engine: the rank's point-to-point engine.
        world: the world rank of each rank of the communicator.
        ctx: the engine context of the communicator's collective messages.
        run_id: the job's name, for the arena's file.
        timeout: seconds a blocking call may take (the communicator keeps it current).
    """

    def __init__(self, engine: Engine, world: list[int], ctx: int, run_id: str, timeout: float) -> None:
        self.engine = engine
        self.world = world
        self.rank = world.index(engine.rank)
        self.size = len(world)
        self.ctx = ctx
        self.run_id = run_id
        self.timeout = timeout
        self.sequence = 0  # collective calls so far
        self.arena: Arena | None = None
        self._forced = engine.settings.forced_algorithms()  # TCOLL_ALGO: {collective: algorithm} for "auto"
        self._choices: dict[tuple[Any, ...], AlgorithmInfo] = {}
        self._direct_ok: bool | None = None
        self._costs: select.Costs | None = None
        self.closed = False

    # -- running ---------------------------------------------------------------------

    def run(self, call: Call, async_op: bool = False) -> Any:
        """Run one call: its result, or (async_op) a Work whose result() it is."""
        sequence = self._next()
        info = self.choose(call.collective, call.algorithm, call.nbytes, call.op, call.uneven, not async_op,
                           call.itemsize)
        return self._execute(info, call, sequence, 0, async_op, [None])

    def run_program(self, program: Program, label: str, async_op: bool = False) -> Any:
        """Run a call made of steps (see the module docstring); its result, or a Work."""
        sequence = self._next()
        if async_op:
            team = self.team_for(sequence)
            return self.start(team, f"{label} #{sequence}", self._program_body(program, team), True)
        teams: list[Team | None] = [None]
        value: Any = None
        for step in range(_MAX_STEPS + 1):
            try:
                call = program.send(value)
            except StopIteration as stop:
                return stop.value
            if step == _MAX_STEPS:
                raise AssertionError(f"{label}: a program has at most {_MAX_STEPS} steps")
            info = self.choose(call.collective, call.algorithm, call.nbytes, call.op, call.uneven, True,
                               call.itemsize)
            value = self._execute(info, call, sequence, 2 * step, False, teams)
        raise AssertionError("unreachable")

    def _program_body(self, program: Program, team: Team) -> Algorithm:
        """An asynchronous program as one algorithm: each step on its own phases of `team`."""
        value: Any = None
        for step in range(_MAX_STEPS + 1):
            try:
                call = program.send(value)
            except StopIteration as stop:
                return stop.value
            info = self.choose(call.collective, call.algorithm, call.nbytes, call.op, call.uneven, False,
                               call.itemsize)
            value = yield from self._team_steps(info, call, team.phase(2 * step))
        raise AssertionError(f"a program has at most {_MAX_STEPS} steps")

    def _execute(self, info: AlgorithmInfo, call: Call, sequence: int, phase: int, async_op: bool,
                 teams: list[Team | None]) -> Any:
        """Run `call` with `info`: on the arena if direct, else on (phase of) the call's team."""
        if info.direct:
            self._on_arena(info, call, sequence, teams)
            return call.finish(self.size)
        team = teams[0] or self.team_for(sequence)
        teams[0] = team
        description = f"{call.label} #{sequence} ({info.name}, {call.nbytes} B per rank)"
        return self.start(team, description, self._team_steps(info, call, team.phase(phase)), async_op)

    def _team_steps(self, info: AlgorithmInfo, call: Call, team: Team) -> Algorithm:
        if call.staged is not None:
            place, block = call.staged
            place[...] = block
        yield from info.run(team, *call.args)
        return call.finish(team.size)

    def _on_arena(self, info: AlgorithmInfo, call: Call, sequence: int, teams: list[Team | None]) -> None:
        """Run a direct algorithm; a failure anywhere in it breaks the arena.

        Whatever interrupts a call (an exception from a user op, a timeout,
        Ctrl-C) leaves this rank's step number out of step with the others',
        so later direct calls must refuse at once instead of waiting on steps
        that will never come.
        """
        arena = self._arena(call.label, sequence, teams)
        try:
            if call.staged is None:
                info.run(arena, *call.args)
            else:
                info.run(arena, *call.args, call.staged[1])
        except BaseException as exc:
            if arena.broken is None:
                arena.broken = exc
            raise

    def team_for(self, sequence: int) -> Team:
        """The Team of call `sequence` (every rank numbers its calls alike)."""
        return Team(self.engine, self.world, self.rank, self.ctx, sequence, self.engine.settings.coll_chunk)

    def team(self) -> Team:
        """A Team for a call the caller runs itself (object collectives): takes the next sequence number."""
        return self.team_for(self._next())

    def start(self, team: Team, description: str, body: Algorithm, async_op: bool) -> Any:
        """Start `body` as a CollectiveWork named `description`; wait for it unless async_op."""
        work = CollectiveWork(self.engine, body, description, team).start()
        if async_op:
            return work
        try:
            return work.wait(self.timeout)
        except BaseException as exc:
            work.abort(exc)  # a timeout or interrupt: withdraw what is still posted
            raise

    def _next(self) -> int:
        if self.closed or self.engine.closed:
            raise TcollError("the communicator is closed")
        self.sequence += 1
        return self.sequence

    # -- choosing ----------------------------------------------------------------------

    def choose(self, collective: str, algorithm: str, nbytes: int, op: Op | None = None, uneven: bool = False,
               blocking: bool = False, itemsize: int = 1) -> AlgorithmInfo:
        """The algorithm to run: the one asked for (checked), or the cost model's choice (cached).

        Args:
            blocking: the call waits for its result here, so a direct algorithm may
                run it (when every rank shares this host).
            itemsize: bytes per element of a reduction (a share of a shared-memory
                slot must hold one element per rank).

        Raises:
            ValueError: an unknown algorithm, or one that cannot run this call.
        """
        ordered = op is not None and not op.commutative
        key = (collective, algorithm, nbytes, ordered, uneven, blocking, itemsize)
        info = self._choices.get(key)
        if info is None:
            direct = blocking and self.direct_capable()
            if direct and itemsize * self.size > self.engine.settings.shm_slot:
                if algorithm == "shm":
                    raise ValueError(f"{collective} algorithm 'shm': items of {itemsize} B do not fit the "
                                     f"shared-memory slot of {self.size} ranks; raise TCOLL_SHM_SLOT")
                direct = False
            info = self._resolve(collective, algorithm, nbytes, ordered, uneven, direct, blocking)
            if len(self._choices) >= 4096:
                self._choices.clear()
            self._choices[key] = info
        return info

    def _resolve(self, collective: str, algorithm: str, nbytes: int, ordered: bool, uneven: bool, direct: bool,
                 blocking: bool) -> AlgorithmInfo:
        if algorithm == "auto":
            forced = self._forced.get(collective, "auto")
            if forced != "auto" and (direct or not lookup(collective, forced).direct):
                algorithm = forced
        if algorithm == "auto":
            return select.choose(collective, nbytes, self.size, self.costs(), ordered=ordered, uneven=uneven,
                                 direct=direct)
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a name, not {type(algorithm).__name__}")
        info = lookup(collective, algorithm)
        if ordered and not info.ordered:
            raise ValueError(f"{collective} algorithm {algorithm!r} reorders operands; the op is not "
                             "commutative (choose one of "
                             f"{', '.join(i.name for i in select.eligible(collective, ordered=True))})")
        if uneven and not info.uneven:
            raise ValueError(f"{collective} algorithm {algorithm!r} needs equal counts on every rank")
        if not direct and info.direct:
            why = ("it runs only blocking calls (async_op=False)" if not blocking else
                   "it needs every rank of the communicator on this host, connected by shared memory")
            raise ValueError(f"{collective} algorithm {algorithm!r} cannot run this call: {why}")
        return info

    def costs(self) -> select.Costs:
        """The cost model of this communicator's slowest kind of link (found once: links do not change)."""
        if self._costs is None:
            kinds = {self.engine.transport_of(peer) for peer in self.world if peer != self.engine.rank}
            slowest = next((kind for kind in ("tcp", "shm", "loopback") if kind in kinds), "shm")
            self._costs = select.COSTS[slowest]
        return self._costs

    def direct_capable(self) -> bool:
        """Whether every rank shares this host, so that direct algorithms can run (found once)."""
        if self._direct_ok is None:
            self._direct_ok = Arena.usable(self.engine, self.world)
        return self._direct_ok

    # -- the arena ---------------------------------------------------------------------

    def _arena(self, label: str, sequence: int, teams: list[Team | None]) -> Arena:
        """The communicator's arena; the first direct call opens it, as part of that call."""
        arena = self.arena
        if arena is None:
            team = teams[0] or self.team_for(sequence)
            teams[0] = team
            arena = self.arena = self._open_arena(team, f"{label} #{sequence}")
            self.engine.closers.append(arena.close)
        elif arena.broken is not None or self.closed:
            if self.closed:
                raise TcollError("the communicator is closed")
            arena.check_usable()
        arena.timeout = self.timeout
        return arena

    def _open_arena(self, team: Team, description: str) -> Arena:
        """Open the arena (collective): rank 0 creates its segment and broadcasts the address.

        Every rank maps it; after a barrier (all have mapped) rank 0 unlinks
        the file, so nothing is left in /dev/shm even if the job is killed
        later. Rank 0's slot size rules, so a differing setting cannot skew
        the layout.

        Raises:
            TransportError: the segment cannot be created or mapped.
        """
        address = np.zeros(ADDRESS_BYTES, dtype=np.uint8)
        segment, failure = None, None
        if self.rank == 0:
            slot = agreed_slot(self.engine.settings.shm_slot, self.size)
            try:
                segment = create_segment(self.run_id, self.engine.rank, self.size, slot)
                address = encode_address(slot, segment.path)
            except TransportError as exc:
                failure = exc  # the others learn it from the empty address
        opening = f"{description}, opening the shared-memory arena"
        try:
            self.start(team.phase(_ARENA_PHASE), opening,
                       lookup("broadcast", "binomial").run(team.phase(_ARENA_PHASE), address, 0), False)
            if failure is not None:
                raise failure
            found = decode_address(address)
            if found is None:
                raise TransportError("rank 0 could not create the shared-memory collective arena")
            slot, path = found
            if segment is None:
                segment = open_segment(path)
            barrier_team = team.phase(_ARENA_PHASE + 1)
            self.start(barrier_team, opening, lookup("barrier", "dissemination").run(barrier_team), False)
        finally:
            if self.rank == 0 and segment is not None:
                segment.unlink()
        return Arena(self.engine, self.world, self.rank, segment, slot, heap_of(self.engine, self.run_id))

    def close(self) -> None:
        """Release the arena (a sub-communicator's goes with it, not with the world)."""
        self.closed = True
        arena, self.arena = self.arena, None
        if arena is not None:
            if arena.close in self.engine.closers:
                self.engine.closers.remove(arena.close)
            arena.close()

    # -- for tests and benchmarks --------------------------------------------------------

    def call_algorithm(self, collective: str, name: str, *args: Any, async_op: bool = False) -> Any:
        """Run one registered algorithm directly on prepared flat buffers.

        Args:
            collective: e.g. "all_gather".
            name: the algorithm's name.
            *args: the algorithm's arguments after the team or arena (see tcoll.algos.registry).
            async_op: return the Work instead of waiting.
        """
        blocking = not async_op
        info = self._resolve(collective, name, 0, False, False, blocking and self.direct_capable(), blocking)
        return self._execute(info, Call(collective, args, 0), self._next(), 0, async_op, [None])
