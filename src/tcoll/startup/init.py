"""`tcoll.init()`: from the environment (or explicit arguments) to a Communicator."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from ..comm import progress, recorder
from ..comm.communicator import Communicator, on_close, track
from ..env import Settings
from ..p2p import reporter
from ..store.base import Store
from ..store.signed import SignedStore
from . import keys, rendezvous
from .connect import connect_world
from .mpi_meet import meet_through_mpi, wants_mpi_meeting

__all__ = ["init", "default_communicator", "connect"]

_default: Communicator | None = None
_default_lock = threading.Lock()


def init(rank: int | None = None, size: int | None = None, init_method: str | None = None,
         timeout: float | None = None, *, store: Store | None = None, transport: str | None = None,
         run_id: str | None = None, **knobs: Any) -> Communicator:
    """Join the job's world and return its communicator.

    With no arguments, rank, size and the rendezvous address come from the
    environment of the launcher that started this process: `tcoll run`,
    torchrun, Slurm, Open MPI or MPICH (Hydra). A process started by none of
    them is a world of one rank.

    Args:
        rank: this process's rank (default: from the environment).
        size: the number of ranks (default: from the environment).
        init_method: "env://" (default), "tcp://host:port" (rank 0 serves the
            store there unless a launcher already does) or "file:///path".
        timeout: seconds for rendezvous and, later, for every blocking call
            (default: TCOLL_TIMEOUT, or 300).
        store: meet through this store instead (rank and size required); used
            by `tcoll.spawn` and tests.
        transport: "auto", "shm", "tcp" or "mpi" (default: TCOLL_TRANSPORT, or auto). With "mpi" (or
            TCOLL_INTERHOST=mpi) under mpiexec the ranks meet through MPI (tcoll.startup.mpi_meet).
        run_id: the job's name for shared resources (default: the launcher's).
        **knobs: other `tcoll.env.Settings` fields, e.g. shm_chunk="4K".

    Returns:
        The communicator of all ranks; the first one made in a process also
        becomes the default used by module-level functions.

    Raises:
        RendezvousError: the ranks could not meet (names the missing ranks).
        ValueError: inconsistent rank/size/environment.
    """
    settings = Settings.from_env(timeout=timeout, transport=transport, **knobs)
    own_store = store is None
    store, info, run_id, key, master_host = _meeting_place(store, rank, size, init_method, run_id, settings)
    settings = dataclasses.replace(settings, auth_key=key)
    # Every record the ranks read is signed with the job's key: a store may check no key (torchrun's), or be
    # a file others can write, and none of it (an address to dial, a segment to map) may come from a stranger.
    meeting = SignedStore(store, key) if key else store
    try:
        comm = connect(meeting, info.rank, info.size, settings, run_id, master_host)
    except BaseException:
        if own_store:
            store.close()
        raise
    if own_store:
        comm.own_store(store)
    global _default
    with _default_lock:
        if _default is None:
            _default = comm
    return comm


def _meeting_place(store: Store | None, rank: int | None, size: int | None, init_method: str | None,
                   run_id: str | None, settings: Settings) -> tuple[Store, rendezvous.LaunchInfo, str, str, str | None]:
    """Where and as whom this rank meets the others.

    Returns:
        (store, launch info, run id, the job's key, the master's host or None); the store is the
        caller's own unless one was given.

    Raises:
        RendezvousError: the store cannot be hosted or reached.
        ValueError: a store without rank and size, or inconsistent variables.
    """
    if store is None and rank is None and wants_mpi_meeting(settings, init_method):
        # Under mpiexec: the key is derived before the store opens, so the store is never keyless.
        store, rank, size, run_id, key = meet_through_mpi(settings, run_id)
        return store, rendezvous.detect({}, rank=rank, size=size), run_id, key, None
    if store is not None:
        if rank is None or size is None:
            raise ValueError("init(store=...) needs rank and size")
        info = rendezvous.detect({}, rank=rank, size=size)
    else:
        info = rendezvous.detect(rank=rank, size=size, init_method=init_method)
    run_id = rendezvous.safe_run_id(run_id or info.run_id)
    # A world of one rank needs no key of its own (nor the user's secret), but may meet a launcher's store.
    key = keys.job_key(run_id, info.master) if info.size > 1 else info.auth_key
    if store is not None:
        return store, info, run_id, key, None
    store = rendezvous.open_store(dataclasses.replace(info, auth_key=key), init_method, settings.timeout)
    return store, info, run_id, key, info.master_addr or None


def connect(store: Store, rank: int, size: int, settings: Settings, run_id: str,
            master_host: str | None) -> Communicator:
    """Make a communicator over `store`; each call in a job gets fresh keys.

    Every rank counts its own calls in the store, so the k-th world a rank
    joins meets the k-th world of every other rank, even on a reused store.
    """
    generation = store.add(f"tcoll/generation/{rank}", 1)
    scoped = store.prefix(f"tcoll/world{generation}")
    engine, transports = connect_world(scoped, rank, size, settings, run_id, master_host)
    comm = track(Communicator(engine, transports, run_id))
    reporter.watch(engine, run_id, progress.calls, _recording(engine))  # what `tcoll status` and reports read
    return comm


def _recording(engine: Any) -> Callable[[list[dict[str, Any]]], Any] | None:
    """With TCOLL_DUMP: keep the world's last calls (tcoll.comm.recorder); how to dump them, or None."""
    dispatcher = engine.callers[0]() if engine.callers else None
    kept = None if dispatcher is None else recorder.attach(dispatcher, list(range(engine.size)), engine.rank)
    if kept is None:
        return None

    def dump(frames: list[dict[str, Any]]) -> Any:
        return recorder.dump(kept, dispatcher, frames)

    engine.closers.insert(0, lambda: dump([]))  # at close too, before the world's file is removed
    return dump


def _forget_default(comm: Communicator) -> None:
    """A closed communicator stops being the default (and is no longer kept alive by it)."""
    global _default
    with _default_lock:
        if _default is comm:
            _default = None


on_close(_forget_default)


def default_communicator() -> Communicator:
    """The communicator made by the first `tcoll.init()` of this process.

    Raises:
        RuntimeError: tcoll.init() has not been called.
    """
    if _default is None or _default.closed:
        raise RuntimeError("no default communicator: call tcoll.init() first")
    return _default
