"""Meeting through MPI: under mpiexec, with MPI chosen, `tcoll.init()` needs no rendezvous address.

When a job is started by mpiexec (MPICH's Hydra or Open MPI), asks for MPI
(TCOLL_TRANSPORT=mpi or TCOLL_INTERHOST=mpi) and names no master
(TCOLL_MASTER, MASTER_ADDR, init_method), rank 0 of MPI_COMM_WORLD hosts
tcoll's store on a port the kernel picks, on loopback when every rank shares
its node, else on the first interface TCOLL_SOCKET_IFNAME allows (any that is
up and not loopback by default), and broadcasts its address and a run id
through MPI. Ranks are MPI_COMM_WORLD's ranks.

The store is hosted with the job's key from the start (derived, as `keys`
says, from the user's secret and the run id that MPI carried), so a local
user who finds its port is refused like any other stranger.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping

from ..env import Settings
from ..errors import RendezvousError
from ..store.tcp import TCPStore
from ..transport.interfaces import list_interfaces, select_interfaces
from ..transport.mpi import mpi_module
from . import keys
from .rendezvous import safe_run_id

__all__ = ["wants_mpi_meeting", "meet_through_mpi"]

_MPIEXEC_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")
_MASTER_VARS = ("TCOLL_MASTER", "MASTER_ADDR")


def wants_mpi_meeting(settings: Settings, init_method: str | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process should meet its job through MPI (see the module docstring)."""
    env = os.environ if environ is None else environ
    wants_mpi = settings.transport == "mpi" or settings.interhost == "mpi"
    under_mpiexec = any(name in env for name in _MPIEXEC_VARS)
    named = init_method is not None or any(env.get(name) for name in _MASTER_VARS)
    return wants_mpi and under_mpiexec and not named


def _store_address(MPI: object, ifname: str) -> str:  # noqa: N803 - the module's own name
    """Where rank 0 hosts the store: loopback if every rank shares this node, else a reachable interface."""
    world = MPI.COMM_WORLD  # type: ignore[attr-defined]
    node = world.Split_type(MPI.COMM_TYPE_SHARED)  # type: ignore[attr-defined]
    one_node = node.Get_size() == world.Get_size()
    node.Free()
    if one_node and not ifname:
        return "127.0.0.1"
    if world.Get_rank() != 0:
        return ""
    usable = [i for i in (select_interfaces(ifname, list_interfaces()) if ifname else list_interfaces())
              if i.up and (ifname or not i.loopback)]
    if not usable:
        raise RendezvousError("meeting through MPI: no interface to host the store on; set TCOLL_SOCKET_IFNAME")
    return usable[0].addr


def meet_through_mpi(settings: Settings, run_id: str | None = None) -> tuple[TCPStore, int, int, str, str]:
    """Host or join the job's store at the address rank 0 broadcasts through MPI.

    The run id comes first (`run_id`, else TCOLL_RUN_ID, else rank 0's random choice, through
    MPI), then the job's key from it (`keys.job_key`), and only then the store, which is
    hosted with that key from its first connection: a keyless stranger is never let in.

    Args:
        settings: the rank's settings (the transport, the interface, the timeout).
        run_id: the run id asked for by the caller, if any.

    Returns:
        (store, rank, size, run id, the job's key); the caller closes the store.

    Raises:
        RendezvousError: mpi4py is missing, the user's secret cannot be read, or the store cannot be
            hosted or reached.
    """
    MPI = mpi_module()
    if MPI is None:
        raise RendezvousError("TCOLL_TRANSPORT=mpi or TCOLL_INTERHOST=mpi needs mpi4py: pip install 'tcoll[mpi]'")
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    chosen = world.bcast(f"mpi-{secrets.token_hex(6)}" if rank == 0 else None, root=0)
    run_id = safe_run_id(run_id or os.environ.get("TCOLL_RUN_ID") or chosen)
    try:  # every rank derives it alike, before any socket opens
        key, problem = keys.job_key(run_id, "mpi"), ""
    except RendezvousError as exc:
        key, problem = "", str(exc)
    failed = [(r, text) for r, text in enumerate(world.allgather(problem)) if text]
    if failed:  # every rank stops here, none waits in a broadcast for a rank that gave up
        raise RendezvousError(f"meeting through MPI: rank {failed[0][0]} has no key for the job: {failed[0][1]}")
    host = _store_address(MPI, settings.socket_ifname)
    store, error = None, ""
    if rank == 0:
        try:
            store = TCPStore.create(host, 0, is_server=True, timeout=settings.timeout, auth_key=key or None)
        except RendezvousError as exc:
            error = str(exc)
    error, host, port = world.bcast((error, host, store.port if store else 0), root=0)
    if error:
        raise RendezvousError(f"meeting through MPI: rank 0 could not host the store: {error}")
    if store is None:
        store = TCPStore.create(host, port, is_server=False, timeout=settings.timeout, auth_key=key or None)
    return store, rank, size, run_id, key
