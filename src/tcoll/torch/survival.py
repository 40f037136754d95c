"""Going on without a dead rank in torch.distributed: `shrink_group`, `revoke`, `failed` and `agree` for tcoll groups.

The torch face of tcoll.comm.survival (after MPI's ULFM). The recipe:

    try:
        dist.all_reduce(t, group=group)
    except (tcoll.PeerLostError, tcoll.RevokedError):
        tcoll.torch.revoke(group)                  # the others leave their calls on `group` too
        group = tcoll.torch.shrink_group(group)    # the survivors, renumbered; collective over them

Why not torch's own `dist.shrink_group`. torch 2.13's shrink_group reaches the
backend through `group._get_backend(device)`, asks it `supports_shrinking`,
calls its `shrink(ranks_to_exclude, flags, options)`, and registers what that
returns on a new plain `ProcessGroup` with `_register_backend`, which takes
only a C++ `c10d::Backend` (NCCL's today). A Python backend cannot be one
(`torch._C._distributed_c10d.Backend` has no Python constructor; see
tcoll.torch.devices), so tcoll's group, a `ProcessGroup` subclass, cannot
pass through it. `shrink_group` here takes its place. It also differs in
what it asks: torch's wants the ranks to exclude, the same on every caller;
here the survivors agree on who is dead themselves (`Communicator.shrink`).

After a shrink. The new group is registered with torch.distributed like any
subgroup: `dist.get_rank(new)` is the rank among the survivors (the old
group's ranks in their order, renumbered from 0: old ranks 0, 2, 3 of 4 with
1 dead become 0, 1, 2), `dist.get_process_group_ranks(new)` the survivors'
global ranks (unchanged), and `dist.get_rank()` / `dist.get_world_size()`
still describe the default group. torch's default group is not replaced:
calls without `group=` go to the old, revoked group and raise RevokedError,
so pass `group=new` (and `process_group=new` to DDP, which must be built
anew). `dist.new_group` numbers ranks in the default group; make groups of
the survivors with `tcoll.torch.split_group(new, ...)`.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .process_group import ProcessGroupTcoll
from .work import run_held

__all__ = ["shrink_group", "revoke", "failed", "agree"]


def _tcoll_group(group: Any, what: str) -> ProcessGroupTcoll:
    """`group`, or the default group, checked to be tcoll's."""
    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, ProcessGroupTcoll):
        raise ValueError(f"tcoll.torch.{what} works on tcoll groups, not {type(pg).__name__}")
    return pg


def failed(group: Any = None) -> list[int]:
    """The ranks of `group` this rank knows to be dead (each is asked first); not collective.

    Args:
        group: a tcoll process group (default: the default group).

    Returns:
        Sorted ranks of `group` (group ranks, not global ones).

    Raises:
        ValueError: the group is not tcoll's.
    """
    return _tcoll_group(group, "failed").comm.failed()


def revoke(group: Any = None) -> None:
    """Make every rank's pending and later calls on `group` raise tcoll.RevokedError; returns at once.

    Not collective. The other ranks learn it while they make progress in any
    tcoll call, so a rank blocked in a collective of `group` that waits on a
    live rank (a ring, a tree) leaves it too, instead of waiting out its
    timeout. Afterwards only `failed`, `agree`, `shrink_group` and
    `destroy_process_group` work on the group.

    Args:
        group: a tcoll process group (default: the default group).

    Raises:
        ValueError: the group is not tcoll's.
    """
    _tcoll_group(group, "revoke").comm.revoke()


def agree(flag: int = 1, group: Any = None, timeout: float | None = None) -> int:
    """The bitwise AND of `flag` over the ranks of `group` that live; the same on every one of them.

    Collective over the survivors; works on a revoked group ("did every rank finish step k?").

    Args:
        flag: an integer of 64 bits (signed).
        group: a tcoll process group (default: the default group).
        timeout: seconds to wait for the others (default: the group's).

    Returns:
        The AND of the survivors' flags.

    Raises:
        ValueError: the group is not tcoll's, or flag is not an integer of 64 bits.
        tcoll.TimeoutError: a live rank did not take part in time.
    """
    return _tcoll_group(group, "agree").comm.agree(flag, timeout)


def shrink_group(group: Any = None, *, timeout: float | None = None, group_desc: str | None = None) -> Any:
    """A new tcoll process group of the ranks of `group` that live; collective over them.

    The survivors agree on who is dead (a rank that dies during the call is
    left out too), then make the new group from `group`'s communicator
    (`Communicator.shrink`), in the old rank order, renumbered, and register
    it with torch.distributed (see the module docstring for ranks and the
    default group). Works on a revoked group; the usual way is catch, revoke,
    shrink. Calls of `group` still held (async_op) run first, so they fail
    here rather than later. Destroying the new group closes the old one's
    communicator too; destroying the old one first (a subgroup: destroying
    the default group destroys every group) leaves the new one working.

    A group built with other devices' backends ("cpu:tcoll,cuda:nccl") keeps
    only tcoll: the new group carries CUDA tensors through tcoll (host staging).

    Args:
        group: the tcoll process group to shrink (default: the default group).
        timeout: seconds to wait for the other survivors, per round of agreement (default: the group's).
        group_desc: a description for the new group (default: the old one's, with ":shrunk").

    Returns:
        The survivors' process group; `dist.get_rank(new)` is this rank's place among them.

    Raises:
        ValueError: the group is not tcoll's.
        tcoll.TimeoutError: a live rank did not take part in time.
    """
    parent = _tcoll_group(group, "shrink_group")
    run_held()
    comm = parent.comm.shrink(timeout)
    comm.timeout = parent.comm.timeout
    child = ProcessGroupTcoll(comm)
    parent._shrinks += 1  # the same count on every survivor: each shrink of `parent` is collective over them
    name = f"{parent.getGroupName() or 'tcoll'}:shrink{parent._shrinks}"
    child._set_group_name(name)
    child._set_group_desc(group_desc or f"{parent.group_desc}:shrunk")
    parent._successor = child
    old_world = parent.comm.world_ranks
    kept = [old_world.index(w) for w in comm.world_ranks]  # each survivor's rank in `parent`
    to_global = {g: r for r, g in c10d._world.pg_group_ranks[parent].items()}
    c10d._register_pg_in_world(child, backend_name=dist.Backend("tcoll"), store=c10d._world.pg_map[parent][1],
                               group_name=name, backend_config="cpu:tcoll",
                               rank_mapping={to_global[old]: new for new, old in enumerate(kept)})
    return child
