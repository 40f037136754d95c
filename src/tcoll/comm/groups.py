"""Sub-communicators: split, group and dup (MPI_Comm_split semantics), and create_group.

A sub-communicator shares its parent's channels and has a context of its
own, so its messages never meet the parent's or a sibling's: the context
is the largest "next free context" of the ranks that make it, which every
member then moves past. Two communicators that share a pair of ranks were
therefore made at different times by both of those ranks, and their
contexts differ. split, group and dup agree on it over the parent (all its
ranks call them); create_group agrees through a store, among the members
only (MPI_Comm_create_group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MismatchError, PeerFailedError
from .calls import numbered

if TYPE_CHECKING:
    from ..p2p.hosts import HostMap
    from ..store.base import Store
    from .communicator import Communicator

__all__ = ["split", "group", "dup", "create_group", "split_type", "leaders", "hosts"]

_NO_COLOR = -1
_FAILED = "failed"  # what a member of create_group publishes when its own checks fail


@numbered("split")
def split(comm: Communicator, color: int | None, key: int | None = None) -> Communicator | None:
    """Partition the ranks by `color`; collective over this communicator.

    Ranks passing the same color form a new communicator, ordered by
    `key` (ties by rank here), as MPI_Comm_split does.

    Args:
        color: a non-negative integer, or None to join no new communicator.
        key: orders the ranks of the new communicator (default: this rank).

    Returns:
        The new communicator, or None for color None.

    Raises:
        ValueError: a negative or non-integer color or key (on this rank; the call still counts, so
            the other ranks get tcoll.PeerFailedError from it and later calls pair up as they should).
    """
    if color is not None and (not isinstance(color, (int, np.integer)) or isinstance(color, bool) or color < 0):
        raise ValueError(f"color must be a non-negative integer or None, not {color!r}")
    key = comm.rank if key is None else key
    if not isinstance(key, (int, np.integer)) or isinstance(key, bool):
        raise ValueError(f"key must be an integer, not {key!r}")
    engine = comm.core.engine
    mine = np.array([_NO_COLOR if color is None else color, key, engine.next_context], dtype=np.int64)
    table = comm.all_gather(mine, algorithm="auto")
    context = int(table[:, 2].max())
    engine.next_context = max(engine.next_context, context + 1)
    if color is None:
        return None
    members = sorted((int(k), r) for r, (c, k, _) in enumerate(table.tolist()) if c == color)
    return _sub(comm, [comm.world_ranks[r] for _, r in members], context)


@numbered("split")
def group(comm: Communicator, ranks: Sequence[int]) -> Communicator | None:
    """A communicator of `ranks` (in that order); collective over this communicator.

    Every rank of this communicator calls it with the same list; the ones
    not in the list get None.

    Raises:
        ValueError: a rank out of range or listed twice.
    """
    ranks = _checked_ranks(ranks, comm.size, "group")
    if comm.rank not in ranks:
        return split(comm, None)
    return split(comm, 0, key=ranks.index(comm.rank))


def dup(comm: Communicator) -> Communicator:
    """A communicator of the same ranks with its own message space; collective."""
    child = split(comm, 0, key=comm.rank)
    assert child is not None
    return child


def create_group(comm: Communicator, ranks: Sequence[int], store: Store,
                 timeout: float | None = None) -> Communicator:
    """A communicator of `ranks` (in that order), made by those ranks alone.

    Like MPI_Comm_create_group, it is collective over the members only: the
    other ranks need not call it, nor know of it. The members agree on the
    new communicator's context through `store` (each publishes the lowest
    context it has not used; all take the largest and move past it), so the
    store must be one every member reaches, with keys of its own for this
    group (a fresh prefix, say).

    Args:
        ranks: distinct ranks of this communicator, this rank among them.
        store: where the members meet.
        timeout: seconds to wait for the other members (default: the communicator's).

    Returns:
        The new communicator.

    Raises:
        ValueError: a rank out of range or listed twice, or this rank not listed (this rank still
            publishes that it failed, so the members waiting for it fail too).
        tcoll.PeerFailedError: the checks failed on another member.
        tcoll.MismatchError: another member listed other ranks, or another order.
        tcoll.TimeoutError: a member did not arrive in time.
    """
    engine = comm.core.engine
    wait = comm.timeout if timeout is None else timeout
    try:
        ranks = _checked_ranks(ranks, comm.size, "create_group")
        if comm.rank not in ranks:
            raise ValueError(f"create_group: rank {comm.rank} is not one of the members {ranks}")
    except ValueError as exc:
        # Keys are by rank, so the members this rank names (where it can name them) learn it failed.
        store.set(f"tcoll/context/{comm.rank}", f"{_FAILED};{exc}".encode())
        raise
    listed = ",".join(map(str, ranks))
    store.set(f"tcoll/context/{comm.rank}", f"{engine.next_context};{listed}".encode())
    offered = store.multi_get([f"tcoll/context/{r}" for r in ranks], wait)
    contexts = []
    for member, value in zip(ranks, offered):
        said, _, theirs = bytes(value).decode().partition(";")
        if said == _FAILED:
            raise PeerFailedError(f"create_group: rank {member} failed this call: {theirs}", rank=member,
                                  cause=theirs)
        if theirs != listed:
            raise MismatchError(f"create_group: rank {member} listed the members [{theirs}] where rank "
                                f"{comm.rank} listed [{listed}]", ranks=[member])
        contexts.append(int(said))
    context = max(contexts)
    engine.next_context = max(engine.next_context, context + 1)
    return _sub(comm, [comm.world_ranks[r] for r in ranks], context)


def hosts(comm: Communicator) -> HostMap:
    """Which ranks of `comm` share a host (from the identities exchanged at rendezvous).

    Returns:
        A HostMap in this communicator's rank numbering: `host_of[r]` is rank r's host
        (0 for rank 0's), `members(h)` the ranks on host h, `count` the number of hosts.
    """
    return comm.core.engine.hosts.restrict(comm.world_ranks)


def split_type(comm: Communicator, kind: str | None = "host", key: int | None = None) -> Communicator | None:
    """The ranks of this communicator that share this rank's host; collective (MPI_Comm_split_type).

    A rank that passes kind None joins no new communicator (MPI_UNDEFINED,
    as split(color=None)); the others' communicators leave it out.

    Args:
        kind: "host" (or its MPI alias "shared"): ranks that share a kernel and /dev/shm; None: none.
        key: orders the ranks of the new communicator (default: this rank).

    Returns:
        The host-local communicator, or None for kind None.

    Raises:
        ValueError: an unknown kind.
    """
    if kind is None:
        return split(comm, None, key)
    if kind not in ("host", "shared"):
        raise ValueError(f"split_type kind must be 'host' (alias 'shared') or None, not {kind!r}")
    child = split(comm, hosts(comm).host_of[comm.rank], key)
    assert child is not None
    return child


def leaders(comm: Communicator) -> Communicator | None:
    """A communicator of one rank per host (the lowest rank of each); collective over this communicator.

    Returns:
        The leaders' communicator on the leaders (ordered by host: rank 0's host first), None elsewhere.
    """
    host_map = hosts(comm)
    firsts = [host_map.members(h)[0] for h in range(host_map.count)]
    return group(comm, firsts)


def _checked_ranks(ranks: Sequence[Any], size: int, what: str) -> list[int]:
    checked = [int(r) for r in ranks]
    if len(set(checked)) != len(checked) or any(not 0 <= r < size for r in checked):
        raise ValueError(f"{what} needs distinct ranks in [0, {size}); got {checked}")
    return checked


def _sub(comm: Communicator, world_ranks: list[int], context: int) -> Communicator:
    """A sub-communicator of `comm` over `world_ranks`, sharing its channels, in `context`."""
    return type(comm)(comm.core.engine, comm.core.transports, comm.run_id, world_ranks=world_ranks, context=context,
                      parent=comm)
