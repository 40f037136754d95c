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

import weakref
from collections.abc import Callable
from typing import Any

from ..algos import (all_gather, all_reduce, all_to_all, barrier, broadcast, gather,  # noqa: F401 - registers
                     reduce, reduce_scatter, scan, scatter)
from ..algos.registry import AlgorithmInfo, lookup
from ..algos.team import Algorithm, CollectiveWork, Team
from ..errors import MismatchError, RevokedError, TcollError, fresh
from ..ops import OPS
from ..p2p import timeline
from ..p2p.engine import Engine
from ..shm import blocks, described, prefix, vector  # noqa: F401 - registers the direct algorithms
from ..shm.arena import Arena
from .agreement import ARENA_TAGS, Agreement, Running
from .calls import Call, Prepared, Program
from .choice import Chooser
from .opening import open_arena

__all__ = ["Dispatcher"]

_MAX_STEPS = 3  # steps of a program: phases 0-5
_CONFIRM_PHASE = 2  # a single call with a user's op: every rank says its part went well (a call uses phases 0-1)


def _traced(call: Call, algorithm: str, sequence: int) -> dict[str, Any]:
    """What the timeline (TCOLL_TRACE) shows of a call."""
    return {"collective": call.collective, "bytes": call.nbytes, "algorithm": algorithm, "sequence": sequence}


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
        self._stale = False  # a call failed since the arena was opened: the next direct call opens a new one
        self.chooser = Chooser(engine, world)
        # Bound once: every call asks (tcoll.comm.choice).
        self.choose, self.costs, self.direct_capable = (self.chooser.choose, self.chooser.costs,
                                                        self.chooser.direct_capable)
        self.agreement = Agreement(engine, world, ctx, self._arena_alarm, self._arena_stale)
        self.gate = self.agreement.gate  # whether express calls may run (tcoll.shm.express; open_gate opens it)
        self.closed = False
        self.revoked: RevokedError | None = None  # set with closed by revoke (tcoll.comm.survival)
        self.capturing = False  # a plan is being made: run() hands back the call instead of running it
        self.lean: dict[Any, Any] = {}  # the lean path's prepared calls (tcoll.comm.plans.lean_call)
        self.current: tuple[int, Prepared] | None = None  # the last call run through _run_prepared
        engine.callers.append(weakref.ref(self))  # the hang report reads its calls (tcoll.comm.progress)
        self.record: Callable[[int, Prepared], None] | None = None  # the flight recorder's, with TCOLL_DUMP

    # -- running ---------------------------------------------------------------------

    def run(self, call: Call, async_op: bool = False) -> Any:
        """Run one call: its result, or (async_op) a Work whose result() it is."""
        if self.capturing:
            return Prepared(call, None, 0, async_op)  # a plan takes the call (tcoll.comm.plans)
        return self._run_numbered(self._next(), call, None, async_op)

    def prepare(self, call: Call, async_op: bool = False) -> Prepared:
        """Choose `call`'s algorithm and stamp it, once, to run it any number of times (run_prepared).

        Raises:
            ValueError: an unknown algorithm, or one that cannot run this call.
        """
        info = self.choose(call.collective, call.algorithm, call.nbytes, call.op, call.uneven, not async_op,
                           call.itemsize)
        return Prepared(call, info, call.stamp(info.name), async_op)

    def run_prepared(self, prepared: Prepared) -> Any:
        """Run a prepared call once more: a new sequence number, the same checks across ranks, no new choice."""
        return self._run_numbered(self._next(), prepared.call, prepared, prepared.async_op)

    def resume(self, prepared: Prepared) -> Any:
        """Go on with a call its express call began and handed over (tcoll.shm.express): numbered already,
        its kernel state in arena.pending."""
        return self._run_numbered(self.sequence, prepared.call, prepared, False)

    def _fail_abandoned(self) -> None:
        """Before a new number: fail an express call that handed over and that Python never took (an
        exception, e.g. KeyboardInterrupt, came in between). Its number is taken and its step may be
        published; it failed here, as a call does: the others are told (their part raises, or their next
        call), and the arena is renewed."""
        arena = self.arena
        if arena is None or not arena.pending:
            return
        sequence, arena.pending = arena.pending >> 2, 0
        self.agreement.fail_unstarted(sequence, "collective", Call("collective", (), 0).stamp(None), TcollError(
            f"call #{sequence} was interrupted on rank {self.rank} after its shared-memory step began "
            "(an exception between the step and the rest of the call)"))

    def _run_numbered(self, sequence: int, call: Call, prepared: Prepared | None, async_op: bool,
                      body: Callable[[Running], Any] | None = None) -> Any:
        """THE path of every numbered call: prepare, begin, run, and on any failure tell the other ranks.

        Args:
            sequence: the call's number (taken already, alike on every rank).
            call: the call; for a program or a custom call, what its stamp says of it.
            prepared: the call prepared (None: prepare it here, as part of the call).
            body: a program or custom call's own way to run (given the Running); None: run `prepared`.

        Raises:
            whatever the call raised here, or the notice of another rank that explains it (see _cause).
        """
        running = None
        try:
            if prepared is None:
                prepared = self.prepare(call, async_op)
            self.current = (sequence, prepared)  # what the hang report names (tcoll.comm.progress): no call made
            if self.record is not None:  # TCOLL_DUMP (tcoll.comm.recorder); None otherwise
                self.record(sequence, prepared)
            if body is not None:
                running = self.agreement.begin(sequence, call.label, prepared.stamp, False)
                return body(running)
            info = prepared.info
            running = self.agreement.begin(sequence, call.label, prepared.stamp, info.direct)
            for place, block in call.copies:
                place[...] = block
            line, arena = self.engine.timeline, self.arena
            if line is None and info.direct and arena is not None and not self._stale and call.staged is None:
                arena.timeout = self.timeout  # the common case, inline: an open arena, one step
                arena.begin(prepared.stamp, sequence, call.label)
                info.run(arena, *call.args)
                self.agreement.end(running)
                return call.finish(self.size) if prepared.finishes else call.result
            began = timeline.now_us() if line is not None else 0.0
            result = self._execute(info, call, running, 0, async_op, [None], settle=True)
            if line is not None:
                line.call(call.label, began, result, _traced(call, info.name, sequence))
            return result
        except BaseException as exc:
            cause = self._cause(running, exc)
            arena = self.arena
            if arena is not None:  # (before the others are told: a rank that waits for it need not wait long)
                arena.leave(sequence)
            self._failed(sequence, call.label, call.stamp(None), running, cause)
            if arena is not None:  # the others may still write into its buffer: see Lending.settle
                arena.settle(sequence, cause)
            if cause is not exc:
                raise fresh(cause) from exc  # (the cause is kept, as a notice's: not with this caller's frames)
            raise

    def run_program(self, program: Program, head: Call, async_op: bool = False) -> Any:
        """Run a call made of steps (see the module docstring); its result, or a Work.

        Args:
            program: the steps.
            head: what the stamp says of the whole call: label, collective and op of its data step, root,
                and the algorithm asked for (the messages of every step carry it).
        """
        if self.capturing:
            return None  # a plan of several steps runs the method anew each time (tcoll.comm.plans)
        sequence = self._next()
        requested = head.algorithm if head.algorithm != "auto" else self.chooser.forced(head.collective)
        prepared = Prepared(head, None, head.stamp(requested), async_op)
        return self._run_numbered(sequence, head, prepared, async_op,
                                  lambda running: self._program(program, head, requested or "auto", running, async_op))

    def _program(self, program: Program, head: Call, algorithm: str, running: Running, async_op: bool) -> Any:
        """A program's body (run_program): its steps one by one, or all in one Work (async_op)."""
        began = timeline.now_us() if self.engine.timeline is not None else 0.0
        if async_op:
            team = self.team_for(running.sequence, running.stamp)
            result = self.start(team, f"{head.label} #{running.sequence}", self._program_body(program, team), True,
                                running)
        else:
            result = self._program_steps(program, running)
        if self.engine.timeline is not None:
            self.engine.timeline.call(head.label, began, result, _traced(head, algorithm, running.sequence))
        if not async_op:
            self.agreement.end(running)
        return result

    def _program_steps(self, program: Program, running: Running) -> Any:
        """A blocking program: each step dispatched on its own (it may run on the arena)."""
        teams: list[Team | None] = [None]
        value: Any = None
        for step in range(_MAX_STEPS + 1):
            try:
                call = program.send(value)
            except StopIteration as stop:
                return stop.value
            if step == _MAX_STEPS:
                raise AssertionError(f"{running.label}: a program has at most {_MAX_STEPS} steps")
            info = self.choose(call.collective, call.algorithm, call.nbytes, call.op, call.uneven, True,
                               call.itemsize)
            began = timeline.now_us() if self.engine.timeline is not None else 0.0
            value = self._execute(info, call, running, 2 * step, False, teams)
            if self.engine.timeline is not None:  # a program's steps: phases 2k, 2k+1 of the call
                self.engine.timeline.call(f"step {step}: {call.collective}", began, None,
                                          {**_traced(call, info.name, running.sequence), "phase": 2 * step})
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

    def run_custom(self, label: str, body: Callable[[Team], Algorithm], async_op: bool = False,
                   root: int = 0) -> Any:
        """Run a call that talks through its Team in its own way (the object collectives)."""
        if self.capturing:
            return None  # as run_program
        head = Call(label, (), 0, root=root)
        prepared = Prepared(head, None, head.stamp(None), async_op)
        return self._run_numbered(self._next(), head, prepared, async_op,
                                  lambda running: self._custom(label, body, running, async_op))

    def _custom(self, label: str, body: Callable[[Team], Algorithm], running: Running, async_op: bool) -> Any:
        """A custom call's body (run_custom): one Work on the call's team, settled when it ends."""
        team = self.team_for(running.sequence, running.stamp)
        began = timeline.now_us() if self.engine.timeline is not None else 0.0
        result = self.start(team, f"{label} #{running.sequence}", body(team), async_op, running)
        if self.engine.timeline is not None:
            self.engine.timeline.call(label, began, result, {"algorithm": "custom", "sequence": running.sequence})
        return result

    def _execute(self, info: AlgorithmInfo, call: Call, running: Running, phase: int, async_op: bool,
                 teams: list[Team | None], settle: bool = False) -> Any:
        """Run `call` with `info`: on the arena if direct, else on (phase of) the call's team.

        Args:
            settle: the call is this one step: when it ends, tell the agreement (a program does it itself).
        """
        running.quiet = info.direct
        # A step of a program on the arena keeps what peers already send for its later steps
        # (phases 2k and 2k+2 begin steps k and k+1: 8 tags a phase), up to the arena's own tags.
        running.later = (0, 0) if settle else ((phase + 2) * 8, ARENA_TAGS)
        if info.direct:
            self._on_arena(info, call, running, teams)
            if settle:
                self.agreement.end(running)
            return call.finish(self.size)
        team = teams[0] or self.team_for(running.sequence, running.stamp)
        teams[0] = team
        description = f"{call.label} #{running.sequence} ({info.name}, {call.nbytes} B per rank)"
        # A user's op may fail on one rank after the others' parts are done: in a call of its own, they
        # wait for every rank's word that its part went well, and so fail in the same call if one did not.
        user_op = call.op is not None and getattr(OPS.get(call.op.name), "fn", None) is not call.op.fn
        confirm = team.phase(_CONFIRM_PHASE) if settle and user_op else None
        body = self._team_steps(info, call, team.phase(phase), confirm)
        return self.start(team, description, body, async_op, running if settle else None, running)

    def _team_steps(self, info: AlgorithmInfo, call: Call, team: Team, confirm: Team | None = None) -> Algorithm:
        if call.staged is not None:
            place, block = call.staged
            place[...] = block
        yield from info.run(team, *call.args)
        if confirm is not None:
            yield from lookup("barrier", "dissemination").run(confirm)
        return call.finish(team.size)

    def _on_arena(self, info: AlgorithmInfo, call: Call, running: Running, teams: list[Team | None]) -> None:
        """Run a direct algorithm on the arena (opened, or opened anew, first if need be)."""
        arena = self._arena(running, teams)
        arena.begin(running.stamp, running.sequence, call.label)
        if call.staged is None:
            info.run(arena, *call.args)
        else:
            info.run(arena, *call.args, call.staged[1])

    def _cause(self, running: Running | None, error: BaseException) -> BaseException:
        """The error to raise for a failed call: another rank's notice about it, if one came, else `error`.

        When a call fails on several ranks, the first failure is the cause and the others its
        consequences (a file already removed, a peer that left): the notice of the first says why.
        """
        if running is None or running.told is not None or isinstance(error, MismatchError):
            return error if running is None or running.told is None else running.told
        self.engine.poll()  # a notice that came meanwhile raises its alarm, which sets running.told
        return running.told or error

    def _failed(self, sequence: int, label: str, stamp: int, running: Running | None, error: BaseException) -> None:
        """Call `sequence` failed on this rank: the other ranks are told (unless they learn it by themselves)."""
        if running is None:
            self.agreement.fail_unstarted(sequence, label, stamp, error)
        elif running.sequence in self.agreement.watch.calls:  # not settled yet (a Work's callback may have)
            self.agreement.fail(running, error)

    def _arena_stale(self) -> None:
        """Ranks learn of a failed call: the next direct call opens a new arena (all ranks do, at the same call)."""
        self._stale = True
        self.gate.shut()

    def open_gate(self) -> bool:
        """Let express calls run from now on, if nothing stands in their way; whether they may.

        Called after a call ran well in Python (tcoll.comm.plans): everything the express
        path skips is checked here, once, and whatever changes it later shuts the gate.
        """
        arena, engine = self.arena, self.engine
        if (arena is None or arena.kernel is None or arena.broken is not None or arena.pending or self._stale
                or self.closed or engine.closed or self.capturing or self.record is not None
                or engine.timeline is not None or not self.agreement.quiet):
            self.gate.shut()
            return False
        return self.gate.open(arena.kernel)  # (False for anything but the arena's C kernel)

    def _arena_alarm(self, error: BaseException) -> None:
        """What an alarm says of a call that runs on the arena: its waits raise it."""
        if self.arena is not None:
            self.arena.alarm = error

    def failed_unnumbered(self, label: str, error: BaseException) -> None:
        """A call failed its argument checks on this rank: it takes its sequence number all the same.

        The other ranks are told, so that their part of it fails too, and no
        later call of this rank pairs with an earlier call of theirs.
        """
        if self.closed or self.engine.closed:
            return
        self._fail_abandoned()
        self.sequence += 1
        self.agreement.fail_unstarted(self.sequence, label, Call(label, (), 0).stamp(None), error)

    def team_for(self, sequence: int, stamp: int = 0) -> Team:
        """The Team of call `sequence` (every rank numbers its calls alike), its messages stamped `stamp`."""
        return Team(self.engine, self.world, self.rank, self.ctx, sequence, self.engine.settings.coll_chunk, stamp)

    def start(self, team: Team, description: str, body: Algorithm, async_op: bool, settle: Running | None = None,
              step_of: Running | None = None) -> Any:
        """Start `body` as a CollectiveWork named `description`; wait for it unless async_op.

        Args:
            settle: the call whose end this work is: the agreement hears of it when it completes or fails.
            step_of: the call this work is a step of: an alarm about that call aborts it.
        """
        work = CollectiveWork(self.engine, body, description, team)
        if settle is not None or step_of is not None:
            (settle or step_of).work = work  # type: ignore[union-attr]
        if settle is not None:
            work.add_done_callback(lambda done: self._settle(settle, done))
        work.start()
        if async_op:
            return work
        try:
            return work.wait(self.timeout)
        except BaseException as exc:
            if isinstance(exc, TimeoutError) and step_of is not None:
                self._name_absent(exc, step_of)
            work.abort(exc)  # a timeout or interrupt: withdraw what is still posted
            raise

    def _name_absent(self, error: TimeoutError, running: Running) -> None:
        """Add to a call's timeout which ranks never entered the call (they are asked: see Agreement.absent)."""
        said = self.agreement.absent(running.sequence, running.stamp, min(1.0, self.timeout or 1.0))
        if said:
            error.args = (f"{error.args[0] if error.args else error}; {said}", *error.args[1:])

    def _settle(self, running: Running, work: CollectiveWork) -> None:
        """A call's (last) Work completed or failed: tell the agreement."""
        error = work.failure
        if error is None:
            self.agreement.end(running, sent_only=not work.received)
        else:
            self.agreement.fail(running, error)

    def _next(self) -> int:
        if self.closed or self.engine.closed:
            raise self._closed_error()
        self._fail_abandoned()
        self.sequence += 1
        return self.sequence

    # -- the arena ---------------------------------------------------------------------

    def _arena(self, running: Running, teams: list[Team | None]) -> Arena:
        """The communicator's arena; the first direct call opens it, as part of that call.

        After a call failed (here, or on another rank: its notice says so), the
        ranks' steps may no longer agree, so the next direct call opens a new
        arena; every rank learns of the failure before its next call, so all
        open it at the same call.
        """
        arena = self.arena
        if arena is None or self._stale:
            if arena is not None:
                self.arena = None
                if arena.close in self.engine.closers:
                    self.engine.closers.remove(arena.close)
                arena.close()
            team = teams[0] or self.team_for(running.sequence, running.stamp)
            teams[0] = team
            running.quiet = False  # the opening talks point-to-point
            arena = open_arena(self, team, f"{running.label} #{running.sequence}", running)
            running.quiet = True
            self.arena, self._stale = arena, False
            self.engine.closers.append(arena.close)
        arena.timeout = self.timeout
        return arena

    def _closed_error(self) -> TcollError:
        if self.revoked is not None and not self.engine.closed:
            return RevokedError(str(self.revoked), self.revoked.rank)
        return TcollError("the communicator is closed")

    def close(self, linger: float = 0.0) -> BaseException | None:
        """Release the arena (a sub-communicator's goes with it, not with the world), stop watching.

        Args:
            linger: seconds to wait at most for what shows a disagreement on the last call (Agreement.close).

        Returns:
            A disagreement found and not raised yet (the caller raises it once all is released), or None.
        """
        self.closed = True
        self.gate.shut()
        self.lean.clear()
        found = self.agreement.close(linger)
        arena, self.arena = self.arena, None
        if arena is not None:
            if arena.close in self.engine.closers:
                self.engine.closers.remove(arena.close)
            arena.close()
        return found

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
        info = self.chooser.resolve(collective, name, 0, False, False, blocking and self.direct_capable(), blocking)
        return self.run(Call(collective, args, 0, algorithm=info.name), async_op)

