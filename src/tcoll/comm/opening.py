"""Opening a communicator's shared-memory arena: collective, inside the first call that runs on it.

The dispatcher (tcoll.comm.dispatch) calls `open_arena` from the call that
needs the arena first, or first after a failed call made the old one stale;
the opening talks point-to-point on phases 6 and 7 of that call's team.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..algos.registry import lookup
from ..errors import TransportError
from ..shm.address import (ADDRESS_BYTES, agreed_piece, agreed_slot, create_segment, decode_address, encode_address,
                           open_segment)
from ..shm.arena import Arena
from ..shm.heap import heap_of
from ..shm.vector import one_step_limit

if TYPE_CHECKING:
    from ..algos.team import Team
    from .agreement import Running
    from .dispatch import Dispatcher

__all__ = ["open_arena"]

_ARENA_PHASE = 6  # the phases of a call that open the arena: 6 (barriers) and 7 (the address)


def open_arena(dispatcher: Dispatcher, team: Team, description: str, running: Running) -> Arena:
    """Open the arena (collective): rank 0 creates its segment and broadcasts the address.

    A barrier comes first: a rank that still runs the call on an old
    arena (it has not heard of a failure yet) gets one of its messages,
    raises a mismatch, and tells the others, instead of leaving them
    waiting for it. Every rank then maps the segment; after a second
    barrier (all have mapped) rank 0 unlinks the file, so nothing is left
    in /dev/shm even if the job is killed later. Rank 0's slot size and
    one-step limit rule, so a differing setting cannot skew the layout or
    the steps.

    Args:
        dispatcher: the communicator's dispatcher (its start() runs the opening's steps).
        team: the call's team.
        description: the call, for errors ("all_reduce #3").
        running: the call under way (an alarm about it aborts the opening).

    Returns:
        The arena, mapped on every rank.

    Raises:
        TransportError: the segment cannot be created or mapped.
    """
    engine = dispatcher.engine
    opening = f"{description}, opening the shared-memory arena"
    _arena_barrier(dispatcher, team, opening, running)
    address = np.zeros(ADDRESS_BYTES, dtype=np.uint8)
    segment, failure, arena = None, None, None
    if dispatcher.rank == 0:
        slot = agreed_slot(engine.settings.shm_slot, dispatcher.size, engine.spin.oversubscribed)
        one_step = engine.settings.shm_one_step
        one_step = one_step_limit(dispatcher.size, engine.spin.oversubscribed) if one_step < 0 else one_step
        try:
            segment = create_segment(dispatcher.run_id, engine.rank, dispatcher.size, slot, engine.host_shares_pids)
            piece = agreed_piece(slot, engine.spin.oversubscribed)
            address = encode_address(slot, one_step, piece, segment, engine.settings.shm_single_copy)
        except TransportError as exc:
            failure = exc  # the others learn it from the empty address
    try:
        address_team = team.phase(_ARENA_PHASE + 1)
        dispatcher.start(address_team, opening, lookup("broadcast", "binomial").run(address_team, address, 0), False,
                         step_of=running)
        if failure is not None:
            raise failure
        found = decode_address(address)
        if found is None:
            raise TransportError("rank 0 could not create the shared-memory collective arena")
        slot, one_step, piece, single_copy, path, name = found
        if segment is None:
            segment = open_segment(path, name)
        arena = Arena(engine, dispatcher.world, dispatcher.rank, segment, slot, heap_of(engine, dispatcher.run_id),
                      one_step, piece)
        if single_copy != "off":  # rank 0 tries them (its TCOLL_SHM_SINGLE_COPY): this rank's setting has its say
            arena.write_identity(engine.settings.shm_single_copy != "off" and engine.host_shares_pids)
        _arena_barrier(dispatcher, team, opening, running)
    except BaseException:
        if arena is not None:
            arena.close()
        raise
    finally:
        if dispatcher.rank == 0 and segment is not None:
            segment.unlink()
    if single_copy != "off":  # (every rank alike: rank 0's word)
        _decide_single_copy(dispatcher, team, opening, running, arena)
        arena.reduce_by_single_copy = arena.single_copy and single_copy == "on"
    return arena


def _decide_single_copy(dispatcher: Dispatcher, team: Team, description: str, running: Running, arena: Arena) -> None:
    """Every rank probes whether it reads every other's memory in one copy; all use it only if all can
    (tcoll.shm.single_copy). The barrier before it: every rank wrote its identity; the one here: its verdict."""
    try:
        arena.probe_single_copy()
        _arena_barrier(dispatcher, team, description, running)
    except BaseException:
        arena.close()
        raise
    arena.decide_single_copy()


def _arena_barrier(dispatcher: Dispatcher, team: Team, description: str, running: Running) -> None:
    """A barrier among the ranks opening the arena, on phase 6 (twice: FIFO keeps the rounds apart)."""
    barrier_team = team.phase(_ARENA_PHASE)
    dispatcher.start(barrier_team, description, lookup("barrier", "dissemination").run(barrier_team), False,
                     step_of=running)
    running.work = None
