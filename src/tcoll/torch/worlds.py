"""Which tcoll communicator serves a torch.distributed process group.

torch creates a backend once per group, on the group's members only, and
hands it the group's store. The default group meets through that store and
becomes a tcoll world of its own. A later group of ranks of that world
(`new_group`, `new_subgroups`) becomes a sub-communicator of it: it shares the
world's channels and gets a communicator context that its members agree on
through the group's store (`Communicator.create_group`). A non-member never
hears of the group, and needs not.

A group whose ranks are not all in the current world (the default group is
not tcoll, or was destroyed) meets as a world of its own.

Nothing here imports torch: the store is a tcoll `Store` (the torch store
wrapped in `tcoll.store.torch_store.TorchStore`).
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from collections.abc import Sequence

from ..comm.communicator import Communicator
from ..env import Settings
from ..startup import keys
from ..startup.init import connect
from ..store.base import Store
from ..store.signed import SignedStore

__all__ = ["open_world", "open_group", "current_world", "forget_world"]

_SAFE = re.compile(r"[A-Za-z0-9_.]{1,64}")  # what world.init accepts as a run id unchanged
_lock = threading.Lock()
_world: Communicator | None = None  # the world of the current default group, if it is tcoll's


def current_world() -> Communicator | None:
    """The world made for the current default group, or None."""
    with _lock:
        if _world is not None and _world.closed:
            return None
        return _world


def forget_world(comm: Communicator) -> None:
    """Stop treating `comm` as the default group's world (it is being shut down)."""
    global _world
    with _lock:
        if _world is comm:
            _world = None


def open_world(store: Store, rank: int, size: int, timeout: float, master_host: str | None, *,
               default: bool) -> Communicator:
    """Meet the group's other ranks through `store` and connect a new tcoll world.

    Args:
        store: the group's store (every rank of the group passes the same one).
        rank: this rank in the group.
        size: the group's size.
        timeout: seconds for the rendezvous and, later, for every blocking call.
        master_host: the host of the store's server (TCP listens on the interface that reaches it).
        default: this is torch's default group: later groups become its sub-communicators.

    Returns:
        The world communicator (closed at interpreter exit if nobody closes it first).

    Raises:
        tcoll.RendezvousError: the ranks did not all arrive in time.
    """
    run_id = _agree_run_id(store, rank, timeout)
    # torch's store checks no key: what the ranks read from it must carry the job's signature.
    key = keys.job_key(run_id, "torch")
    settings = Settings.from_env(timeout=timeout, auth_key=key)
    comm = connect(SignedStore(store, key) if key else store, rank, size, settings, run_id, master_host)
    comm.timeout = timeout
    if default:
        global _world
        with _lock:
            _world = comm
    return comm


def _agree_run_id(store: Store, rank: int, timeout: float) -> str:
    """The run id every rank of the group uses for its shared-memory names: rank 0's choice.

    Under `tcoll run` it is the launcher's TCOLL_RUN_ID (the launcher removes
    that run's leftovers if it crashes); otherwise the torchelastic run id, or
    "torch", with a random suffix.
    """
    if rank == 0:
        chosen = os.environ.get("TCOLL_RUN_ID", "")
        if not _SAFE.fullmatch(chosen):
            base = re.sub(r"[^A-Za-z0-9_.]", "_", os.environ.get("TORCHELASTIC_RUN_ID", ""))[:40] or "torch"
            chosen = f"{base}.{secrets.token_hex(3)}"
        store.set("tcoll/run_id", chosen.encode())
        return chosen
    return store.get("tcoll/run_id", timeout).decode()


def open_group(store: Store, rank: int, size: int, global_ranks: Sequence[int], timeout: float,
               master_host: str | None) -> Communicator:
    """The communicator of a torch subgroup: a sub-communicator of the world when it can be.

    Args:
        store: the group's store.
        rank: this rank in the group.
        size: the group's size.
        global_ranks: the group's ranks in the default group, in group-rank order.
        timeout: seconds for every blocking call.
        master_host: as for `open_world`.

    Returns:
        A sub-communicator of the current world, or a new world if the group
        is not made of the current world's ranks.
    """
    world = current_world()
    ranks = [int(r) for r in global_ranks]
    if world is None or len(ranks) != size or not all(0 <= r < world.size for r in ranks) or \
            ranks[rank] != world.rank:
        return open_world(store, rank, size, timeout, master_host, default=False)
    key = keys.job_key(world.run_id, "torch")
    comm = world.create_group(ranks, SignedStore(store, key) if key else store, timeout)
    comm.timeout = timeout
    return comm
