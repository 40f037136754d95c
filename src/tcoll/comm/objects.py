"""Collectives and point-to-point on picklable Python objects.

Methods of Communicator: broadcast_object, all_gather_object,
gather_object, scatter_object (these four also take async_op=True), and
send_object / recv_object. How an object travels is `tcoll.comm.pickling`.
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
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ..algos.team import Algorithm, Team
from ..errors import MismatchError, TcollError, known_to_peers
from ..p2p.work import RecvWork
from .calls import numbered
from .checks import check_peer, check_tag
from .pickling import (FAILED, SLOTS, Parts, allocate, check_failed, copy_load, dump, exchange_parts, load,
                       overflow_for, size_record, try_dump)

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["broadcast_object", "all_gather_object", "gather_object", "scatter_object", "send_object", "recv_object"]


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

    return comm._dispatch.run_custom("broadcast_object", body, async_op, root)


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

    return comm._dispatch.run_custom("all_gather_object", body, async_op)


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

    return comm._dispatch.run_custom("gather_object", body, async_op, root)


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

    return comm._dispatch.run_custom("scatter_object", body, async_op, root)


def send_object(comm: Communicator, obj: Any, dst: int, tag: int = 0) -> None:
    """Send the object `obj` to rank `dst`, to be received by recv_object(src, tag).

    Messages on (dst, tag): an int64 size record (and, for more than seven
    parts, the remaining sizes), then the pickle stream and each large
    buffer straight from memory. Other sends from this rank on the same
    (dst, tag) must not run concurrently (from another thread), or the
    messages interleave.

    Args:
        obj: a picklable object.
        dst: the destination rank.
        tag: a non-negative integer that recv_object must name too.

    Raises:
        ValueError: dst out of range or bad tag.
        pickle.PicklingError, TypeError, ...: obj cannot be pickled (nothing is sent).
    """
    check_peer(dst, comm.size, "dst")
    check_tag(tag)
    parts = dump(obj)
    record, overflow = size_record(parts)
    works = [comm.isend(record, dst, tag)]
    if overflow.size:
        works.append(comm.isend(overflow, dst, tag))
    works += [comm.isend(part, dst, tag) for part in parts]
    for work in works:
        work.wait()


def recv_object(comm: Communicator, src: int, tag: int = 0) -> Any:
    """Receive an object that rank `src` sent with send_object(obj, dst, tag).

    Security: the object is unpickled (see the module docstring).

    Args:
        src: the source rank.
        tag: the tag the sender used.

    Returns:
        The unpickled object.

    Raises:
        ValueError: src out of range or bad tag.
        MismatchError: the message on (src, tag) was not sent by send_object.
    """
    record = np.zeros(SLOTS + 1, dtype=np.int64)
    _recv_exact(comm, [record], src, tag)
    if record[0] < 1:
        raise MismatchError(f"recv_object from rank {src} (tag {tag}): the message is not an object's")
    overflow = overflow_for(record)
    if overflow.size:
        _recv_exact(comm, [overflow], src, tag)
    parts = allocate(record, overflow) or []
    _recv_exact(comm, parts, src, tag)
    return load(parts)


def _recv_exact(comm: Communicator, bufs: list[np.ndarray], src: int, tag: int) -> None:
    """Receive one message into each of `bufs`, in order; each must fill its buffer exactly."""
    works = [cast(RecvWork, comm.irecv(buf, src, tag)) for buf in bufs]
    try:
        for work, buf in zip(works, bufs):
            work.wait()
            if work.nbytes != buf.nbytes:
                raise MismatchError(f"recv_object from rank {src} (tag {tag}): a message of {work.nbytes} "
                                    f"bytes arrived where {buf.nbytes} were expected; was it sent by send_object?")
    except BaseException:
        for work in works:
            if not work.done():
                work.cancel()
        raise


def _broadcast(comm: Communicator, team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Broadcast `buf` with the point-to-point algorithm the cost model picks for its size."""
    yield from comm._dispatch.choose("broadcast", "auto", buf.nbytes).run(team, buf, root)
