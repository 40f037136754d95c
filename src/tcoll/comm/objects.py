"""Collectives and point-to-point on picklable Python objects.

Methods of Communicator: broadcast_object, all_gather_object,
gather_object, scatter_object, all_to_all_object (all take async_op=True).
Point-to-point of objects is tcoll.comm.parcels. How an object travels is
`tcoll.comm.pickling`.
As with an array send, the object's arrays must not change until the call
(or, with async_op, its Work) completes.

Routes: broadcast_object broadcasts the record, then each part, with the
broadcast algorithm the cost model picks for that part's size.
gather_object and scatter_object send directly between the root and each
rank (no rank forwards another's parts, so nothing is copied), and
all_gather_object sends each rank's parts directly to every other rank:
each rank sends and receives p-1 objects' worth, as a ring all-gather
does, but in one step instead of p-1. A rank that cannot pickle its object
raises the pickling error; the ranks that expected its object raise
TcollError instead of waiting for it.

Security: these functions unpickle what peers send, and unpickling can run
arbitrary code. The peers are the authenticated ranks of the same job, so
this trusts them exactly as much as the job trusts its own ranks; do not
pass data that came from outside the job through object collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.team import Algorithm, Team
from ..errors import TcollError, known_to_peers
from .calls import numbered
from .checks import check_peer
from .pickling import (FAILED, SLOTS, Parts, allocate, check_failed, copy_load, exchange_parts, load,
                       overflow_for, size_record, try_dump)

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["broadcast_object", "all_gather_object", "gather_object", "scatter_object", "all_to_all_object"]


@numbered("broadcast_object")
def broadcast_object(comm: Communicator, obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
    """Send the object `obj` of `root` to every rank.

    The sizes are broadcast first, then the pickle stream and each large
    buffer, each with a broadcast algorithm chosen for its size.

    Args:
        obj: on root, a picklable object; ignored on the other ranks.
        root: the rank whose object is sent.
        async_op: return a Work (whose result() is the object) instead of waiting.

    Returns:
        On root, `obj` itself; elsewhere the unpickled copy.

    Raises:
        ValueError: root out of range.
        TcollError: (off root) root could not pickle its object; root raises the pickling error.
    """
    check_peer(root, comm.size, "root")
    at_root = comm.rank == root
    mine, error = try_dump(obj) if at_root else (None, None)
    record, mine_overflow = size_record(mine) if at_root else (np.zeros(SLOTS + 1, np.int64), None)

    def body(team: Team) -> Algorithm:
        yield from _broadcast(comm, team.phase(0), record, root)
        if record[0] == FAILED:
            if error is not None:
                raise known_to_peers(error)
            raise known_to_peers(TcollError(f"broadcast_object: root {root} could not pickle its object"))
        overflow = overflow_for(record) if mine_overflow is None else mine_overflow
        if overflow.size:
            yield from _broadcast(comm, team.phase(1), overflow, root)
        parts = mine if at_root else allocate(record, overflow)
        for part in parts or ():  # one after the other on phase 2's streams: FIFO keeps them apart
            yield from _broadcast(comm, team.phase(2), part, root)
        return obj if at_root else load(parts or [])

    return comm.core.dispatch.run_custom("broadcast_object", body, async_op, root)


@numbered("all_gather_object")
def all_gather_object(comm: Communicator, obj: Any, *, async_op: bool = False) -> Any:
    """Gather every rank's object on every rank.

    Each rank sends its parts directly to every other rank (each rank
    sends and receives p-1 copies, as a ring would, without its p-1 steps).

    Args:
        obj: a picklable object.
        async_op: return a Work (whose result() is the list) instead of waiting.

    Returns:
        The list of every rank's object (unpickled copies, this rank's own included).

    Raises:
        TcollError: another rank could not pickle its object (that rank raises the pickling error).
    """
    parts, error = try_dump(obj)

    def body(team: Team) -> Algorithm:
        peers = [(team.rank + k) % team.size for k in range(1, team.size)]
        received = yield from exchange_parts(team, {peer: parts for peer in peers}, peers)
        if error is not None:
            raise known_to_peers(error)
        check_failed("all_gather_object", received)
        received[team.rank] = parts
        return [(copy_load if r == team.rank else load)(received[r]) for r in range(team.size)]

    return comm.core.dispatch.run_custom("all_gather_object", body, async_op)


@numbered("gather_object")
def gather_object(comm: Communicator, obj: Any, root: int = 0, *, async_op: bool = False) -> Any:
    """Gather every rank's object on `root`.

    Args:
        obj: a picklable object.
        root: the rank that gets the objects.
        async_op: return a Work (whose result() is the list or None) instead of waiting.

    Returns:
        On root, the list of every rank's object (unpickled copies); None elsewhere.

    Raises:
        ValueError: root out of range.
        TcollError: (on root) a rank could not pickle its object (that rank raises the pickling error).
    """
    check_peer(root, comm.size, "root")
    parts, error = try_dump(obj)

    def body(team: Team) -> Algorithm:
        if team.rank != root:
            yield from exchange_parts(team, {root: parts}, [])
            if error is not None:
                raise known_to_peers(error)
            return None
        others = [r for r in range(team.size) if r != root]
        received = yield from exchange_parts(team, {}, others)
        if error is not None:
            raise known_to_peers(error)
        check_failed("gather_object", received)
        return [copy_load(parts or []) if r == root else load(received[r] or []) for r in range(team.size)]

    return comm.core.dispatch.run_custom("gather_object", body, async_op, root)


@numbered("scatter_object")
def scatter_object(comm: Communicator, objs: Sequence[Any] | None, root: int = 0, *,
                   async_op: bool = False) -> Any:
    """Send objs[r] of `root` to rank r.

    Args:
        objs: on root, a list of `size` picklable objects; ignored elsewhere.
        root: the rank that holds the objects.
        async_op: return a Work (whose result() is the object) instead of waiting.

    Returns:
        This rank's object (an unpickled copy, on root too).

    Raises:
        ValueError: root out of range; (on root) objs is not a list of `size` objects.
        TcollError: (off root) root could not pickle this rank's object; root raises the pickling error.
    """
    check_peer(root, comm.size, "root")
    outgoing: dict[int, Parts | None] = {}
    error: BaseException | None = None
    if comm.rank == root:
        if not isinstance(objs, (list, tuple)):
            raise ValueError(f"scatter_object needs a list of {comm.size} objects on the root, one per rank; "
                             f"got {type(objs).__name__}")
        if len(objs) != comm.size:
            raise ValueError(f"scatter_object needs {comm.size} objects on the root, one per rank; "
                             f"got {len(objs)}")
        for r in range(comm.size):
            outgoing[r], failure = try_dump(objs[r])
            error = error or failure

    def body(team: Team) -> Algorithm:
        if team.rank == root:
            mine = outgoing.pop(root)
            yield from exchange_parts(team, outgoing, [])
            if error is not None:
                raise known_to_peers(error)
            return copy_load(mine or [])
        received = yield from exchange_parts(team, {}, [root])
        check_failed("scatter_object", received)
        return load(received[root] or [])

    return comm.core.dispatch.run_custom("scatter_object", body, async_op, root)


@numbered("all_to_all_object")
def all_to_all_object(comm: Communicator, objs: Sequence[Any], *, async_op: bool = False) -> Any:
    """Send objs[r] to rank r and receive one object from every rank.

    Each rank sends each other rank its object directly (p-1 sends and
    receives per rank, all at once).

    Args:
        objs: a list of `size` picklable objects, one for each rank.
        async_op: return a Work (whose result() is the list) instead of waiting.

    Returns:
        The list of the objects the ranks sent this one, in rank order (unpickled copies, its own included).

    Raises:
        ValueError: objs is not a list of `size` objects.
        TcollError: a rank could not pickle its object for this one (that rank raises the pickling error).
    """
    if not isinstance(objs, (list, tuple)) or len(objs) != comm.size:
        raise ValueError(f"all_to_all_object needs a list of {comm.size} objects, one per rank; got "
                         f"{len(objs) if isinstance(objs, (list, tuple)) else type(objs).__name__}")
    outgoing: dict[int, Parts | None] = {}
    error: BaseException | None = None
    for r in range(comm.size):
        outgoing[r], failure = try_dump(objs[r])
        error = error or failure

    def body(team: Team) -> Algorithm:
        mine = outgoing.pop(team.rank)
        peers = [(team.rank + k) % team.size for k in range(1, team.size)]
        received = yield from exchange_parts(team, outgoing, peers)
        if error is not None:
            raise known_to_peers(error)
        check_failed("all_to_all_object", received)
        return [copy_load(mine or []) if r == team.rank else load(received[r] or []) for r in range(team.size)]

    return comm.core.dispatch.run_custom("all_to_all_object", body, async_op)


def _broadcast(comm: Communicator, team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Broadcast `buf` with the point-to-point algorithm the cost model picks for its size."""
    yield from comm.core.dispatch.choose("broadcast", "auto", buf.nbytes).run(team, buf, root)
