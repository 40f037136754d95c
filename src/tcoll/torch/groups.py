"""How torch's groups become tcoll process groups: torch's creator for "tcoll", `split_group`, and `empty`.

`create_backend` is what torch calls for `init_process_group("tcoll")` and
`new_group`: the default group becomes a tcoll world, a later group a
sub-communicator of it (`worlds`).

`tcoll.torch.split_group` is torch's `dist.split_group` for tcoll groups on CPU-only hosts.
`tcoll.torch.empty` makes a tensor in a group's shared memory.

torch 2.13's `dist.split_group` refuses every process group of a host
without an accelerator before it reaches the backend ("No backend for the
parent process group or its backend does not support splitting"), gloo's
too. This function takes the same arguments and does what dist.split_group
does after those checks: the parent group's `split_group` (here, a tcoll
`Communicator.split`), then the new group's registration with
torch.distributed, so that `group=` arguments, `get_rank(group)` and
`destroy_process_group(group)` work with it as with any group.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..store.torch_store import TorchStore
from . import devices, worlds
from .work import seconds

if TYPE_CHECKING:
    from .process_group import ProcessGroupTcoll

__all__ = ["create_backend", "empty", "split_group"]


def split_group(parent_pg: Any = None, split_ranks: list[list[int]] | None = None, timeout: Any = None,
                pg_options: Any = None, group_desc: str | None = None) -> Any:
    """Split a tcoll process group into disjoint groups; collective over the parent group.

    Args:
        parent_pg: the group to split (default: the default group); a tcoll group.
        split_ranks: the new groups, as lists of ranks of the parent group; they must not overlap.
            A rank in none of them joins no group.
        timeout: the new groups' timeout (default: the parent's).
        pg_options: unused (accepted as dist.split_group accepts it).
        group_desc: a description for the new group.

    Returns:
        This rank's new group, or None if it is in none of `split_ranks`.

    Raises:
        ValueError: empty, overlapping or out-of-range splits; a parent group that is not tcoll's.
    """
    from .process_group import ProcessGroupTcoll  # noqa: F811

    parent = parent_pg if parent_pg is not None else c10d._get_default_group()
    if not isinstance(parent, ProcessGroupTcoll):
        raise ValueError(f"tcoll.torch.split_group splits tcoll groups, not {type(parent).__name__}")
    if not split_ranks:
        raise ValueError("split_ranks cannot be None or empty")
    mine, seen = None, set()
    for split in split_ranks or []:
        if not split or len(set(split)) != len(split) or not all(0 <= r < parent.size() for r in split):
            raise ValueError(f"split_group: {split} is not a non-empty list of distinct ranks of the group")
        if seen & set(split):
            raise ValueError(f"split_group: the splits {split_ranks} overlap")
        seen |= set(split)
        if parent.rank() in split:
            mine = sorted(split)
    members = mine if mine is not None else sorted(split_ranks[0])
    name = c10d._process_group_name(members, use_hashed_name=True)
    child = parent.split_group(members, timeout=timeout, group_name=name,  # returns None if this rank is not in it
                               group_desc=group_desc or f"{parent.group_desc}:split")
    if child is None:
        return None
    to_global = {g: r for r, g in c10d._world.pg_group_ranks[parent].items()}
    store = c10d._world.pg_map[parent][1]
    c10d._register_pg_in_world(child, backend_name=dist.Backend("tcoll"), store=store, group_name=name,
                               backend_config="cpu:tcoll",
                               rank_mapping={to_global[r]: i for i, r in enumerate(members)})
    return child


def _master_host(store: Any) -> str | None:
    """The host of the TCPStore under torch's prefix stores, else MASTER_ADDR: where TCP finds its interface."""
    for _ in range(16):
        if isinstance(store, dist.TCPStore):
            return str(store.host)
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return os.environ.get("MASTER_ADDR") or None


def create_backend(options: Any, backend_options: Any = None) -> ProcessGroupTcoll:
    """torch's creator for "tcoll" (extended API): the group's process group over a tcoll communicator.

    For a backend string that gives other devices to other backends ("cpu:tcoll,cuda:nccl"), the group
    also builds those backends and routes their devices' tensors to them (tcoll.torch.devices).

    Args:
        options: torch's _DistributedBackendOptions (store, group_rank, group_size, timeout, group_id,
            global_ranks_in_group).
        backend_options: pg_options given to init_process_group / new_group (unused).
    """
    timeout = seconds(options.timeout) or 1800.0
    store = TorchStore(options.store, timeout, address=f"torch://{options.group_id}")
    rank, size = int(options.group_rank), int(options.group_size)
    global_ranks = list(options.global_ranks_in_group)
    master = _master_host(options.store)
    from .process_group import ProcessGroupTcoll  # noqa: F811 - imported here: it imports this module's users

    others, pg_options = devices.other_devices()  # "cpu:tcoll,cuda:nccl": the devices torch leaves to tcoll
    if not global_ranks or not dist.is_initialized():  # the default group: a world of its own
        pg = ProcessGroupTcoll(worlds.open_world(store, rank, size, timeout, master, default=True))
    else:
        pg = ProcessGroupTcoll(worlds.open_group(store, rank, size, global_ranks, timeout, master))
    if others:
        pg._routes = devices.attach(pg, others, options, pg_options if backend_options is None else backend_options)
    return pg


def empty(shape: int | Sequence[int], dtype: torch.dtype = torch.float32, group: Any = None) -> torch.Tensor:
    """A new zero-filled CPU tensor in shared memory, which tcoll's collectives read in place.

    When every rank of the group shares this host, tcoll's shared-memory
    collectives read such a tensor where it lies instead of copying it into
    their arena first (`tcoll.Communicator.empty`). For a group that is not
    tcoll's, or spans hosts, it is an ordinary tensor.

    Args:
        shape: the tensor's shape.
        dtype: its dtype (any).
        group: the process group it is for (default: the default group).
    """
    dims = (shape,) if isinstance(shape, int) else tuple(int(n) for n in shape)
    from .process_group import ProcessGroupTcoll  # noqa: F811

    pg = group if group is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupTcoll):
        return torch.zeros(dims, dtype=dtype)
    count = 1
    for n in dims:
        count *= n
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(pg.comm.empty(count * itemsize, "uint8"))
    return raw.view(dtype).view(dims)
