"""How ranks find each other: the launchers' environment contracts, the store, the meeting.

`detect()` reads rank, size and the master address from the variables of the
launcher that started the process, in this order of precedence:

=========  ================================================================
explicit   `detect(rank=..., size=...)` or `init_method="...?rank=0&world_size=4"`
tcoll      TCOLL_RANK, TCOLL_SIZE, TCOLL_LOCAL_RANK, TCOLL_LOCAL_SIZE,
           TCOLL_NODE_RANK, TCOLL_MASTER=host:port, TCOLL_RUN_ID,
           TCOLL_STORE_HOSTED=1 (the launcher serves the store; rank 0 must not)
torchrun   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
           MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID,
           TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE=True
           (the agent serves a *torch* TCPStore at MASTER_ADDR:MASTER_PORT)
openmpi    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
pmi        PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS (MPICH Hydra)
slurm      SLURM_PROCID, SLURM_STEP_NUM_TASKS or SLURM_NTASKS, SLURM_LOCALID,
           SLURM_NODEID, SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE or
           SLURM_NTASKS_PER_NODE ("4(x2),3"), SLURM_JOB_ID, SLURM_STEP_ID
=========  ================================================================

The master comes from `init_method="tcp://host:port"`, else TCOLL_MASTER, else
MASTER_ADDR / MASTER_PORT; with none of them, a job on one node meets at
127.0.0.1:29500 and a multi-node job is an error. With no launcher at all the
process is a world of one rank, so `tcoll.init()` works in a plain script.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import RendezvousError, TimeoutError
from ..p2p import notice
from ..store.base import PrefixStore, Store
from ..store.file import FileStore
from ..store.memory import MemoryStore
from ..store.tcp import TCPStore
from .launchers import (
    DEFAULT_PORT,
    VARIABLE_NAMES,
    Found,
    InitMethod,
    find_launcher,
    parse_init_method,
    read_int,
    split_host_port,
)

__all__ = ["LaunchInfo", "detect", "open_store", "exchange_cards", "store_barrier", "store_leave", "safe_run_id",
           "DEFAULT_PORT"]

_LOOPBACK = "127.0.0.1"
_RUN_ID = re.compile(r"[A-Za-z0-9_.]{1,64}")


def safe_run_id(run_id: str) -> str:
    """The run id as it may appear in file names (/dev/shm/tcoll-<run id>-...): the same on every rank."""
    if _RUN_ID.fullmatch(run_id) and run_id.strip("."):  # ("." and ".." would name a directory above)
        return run_id
    return hashlib.sha1(run_id.encode()).hexdigest()[:12]


@dataclass
class LaunchInfo:
    """Who this process is in the job, and where the ranks meet.

    Attributes:
        rank: this process's rank, 0..size-1.
        size: the number of ranks.
        local_rank: rank among the ranks of this node (as the launcher tells it).
        local_size: ranks on this node (as the launcher tells it).
        node_rank: this node's index (best effort when the launcher does not tell it).
        master_addr: host of the TCP store; "" when none is used (file store, one rank).
        master_port: port of the TCP store; 0 when none is used.
        run_id: a name shared by the ranks of this job, for naming shared resources.
        store_hosted: someone else (the launcher) already serves the store: rank 0 must not.
        source: whose variables gave rank and size: "tcoll", "torchrun", "openmpi",
            "pmi", "slurm", "explicit", or "single" (no launcher: a world of one).
        torch_agent_store: the store at the master is torchrun's agent store, a torch TCPStore.
        attempt: torchelastic restart count; each attempt meets under its own keys.
        auth_key: TCOLL_AUTH_KEY as read; `init` replaces it with the job's key (see `keys`) (hidden from repr).
    """

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    store_hosted: bool
    source: str
    torch_agent_store: bool = False
    attempt: int = 0
    auth_key: str = field(default="", repr=False)

    @property
    def master(self) -> str:
        """ "host:port" of the master ("[v6addr]:port" for IPv6), or "" when there is none."""
        if not self.master_addr:
            return ""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"{host}:{self.master_port}"


def _master(env: Mapping[str, str], method: InitMethod, found: Found) -> tuple[str, int, bool, bool]:
    """Settle the store address.

    Returns:
        (host, port, store_hosted, torch_agent_store); ("", 0, False, False) when no TCP store is used.

    Raises:
        RendezvousError: a multi-node job without any master address.
        ValueError: a malformed address variable.
    """
    hosted = env.get("TCOLL_STORE_HOSTED", "") == "1"
    if method.scheme == "file":
        return "", 0, False, False
    if method.scheme == "tcp":
        # The launcher's store counts only if init_method names that very store.
        launcher_store = split_host_port("TCOLL_MASTER", env["TCOLL_MASTER"]) if env.get("TCOLL_MASTER") else None
        same = launcher_store == (method.host, method.port)
        return method.host, method.port, hosted and same, False
    if env.get("TCOLL_MASTER"):
        return (*split_host_port("TCOLL_MASTER", env["TCOLL_MASTER"]), hosted, False)
    if env.get("MASTER_ADDR"):
        port = read_int(env, "MASTER_PORT", DEFAULT_PORT)
        if not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT={port} is not a port number")
        return env["MASTER_ADDR"], port, found.torch_agent_store, found.torch_agent_store
    if found.size == 1:
        return "", 0, False, False
    if found.local_size >= found.size:
        return _LOOPBACK, DEFAULT_PORT, False, False
    raise RendezvousError(
        f"this job spans several nodes ({found.size} ranks, {found.local_size} on this node) but no rendezvous "
        "address is set: set TCOLL_MASTER=host:port to an address of the node of rank 0 that every node can reach "
        "(under Slurm: TCOLL_MASTER=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n1):29500)"
    )


def _check_arg(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    if value < 0:
        raise ValueError(f"{name}={value} must not be negative")
    return value


def _validate(found: Found, source: str) -> None:
    """Raise ValueError, naming the variables, if rank/size/local values do not fit together."""
    rank_n, size_n, lrank_n, lsize_n = VARIABLE_NAMES[source]
    if found.size < 1:
        raise ValueError(f"{size_n}={found.size}: a world needs at least one rank")
    if found.rank >= found.size:
        raise ValueError(f"{rank_n}={found.rank} is out of range for {size_n}={found.size}")
    if not 1 <= found.local_size <= found.size:
        raise ValueError(f"{lsize_n}={found.local_size} must be between 1 and {size_n}={found.size}")
    if found.local_rank >= found.local_size:
        raise ValueError(f"{lrank_n}={found.local_rank} is out of range for {lsize_n}={found.local_size}")


def _default_run_id(source: str, host: str, port: int, method: InitMethod, attempt: int) -> str:
    """A run id every rank derives alike: two live jobs cannot share a master address."""
    where = f"file-{method.path}" if method.scheme == "file" else f"{source}-{host}-{port}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", where) + (f".{attempt}" if attempt else "")


def detect(
    environ: Mapping[str, str] | None = None,
    *,
    rank: int | None = None,
    size: int | None = None,
    init_method: str | None = None,
) -> LaunchInfo:
    """Find out this process's rank, the world size and where the ranks meet.

    Args:
        environ: the variables to read (default: os.environ).
        rank: this rank, overriding the environment.
        size: the world size, overriding the environment.
        init_method: "env://" (default), "tcp://host:port" or "file:///path";
            may carry "?rank=R&world_size=N".

    Returns:
        The launch information (see the module docstring for the precedence).

    Raises:
        ValueError: inconsistent or malformed values, naming the variable or argument.
        RendezvousError: a multi-node job with no master address.
    """
    env = os.environ if environ is None else environ
    method = parse_init_method(init_method)
    rank = _check_arg("rank", rank if rank is not None else method.rank)
    size = _check_arg("size", size if size is not None else method.size)
    found, source = find_launcher(env)
    if rank is not None and size is not None:
        if found is None or found.size != size:
            # The launcher's layout (if any) describes another world: assume one node.
            keep = found or Found(0, 1, 0, 1, 0)
            found = Found(rank, size, rank, size, 0, keep.run_id, keep.torch_agent_store, keep.attempt)
        found.rank, found.size, source = rank, size, "explicit"
    elif rank is not None or size is not None:
        if found is None:
            raise ValueError(f"rank and size must be given together (rank={rank}, size={size})")
        found.rank, found.size = (found.rank if rank is None else rank), (found.size if size is None else size)
    elif found is None:
        if method.scheme != "env":
            raise ValueError(f"init_method {init_method!r} needs rank and size: pass them or add ?rank=R&world_size=N")
        run_id = env.get("TCOLL_RUN_ID") or f"local-{os.getpid()}"
        return LaunchInfo(0, 1, 0, 1, 0, "", 0, run_id, False, "single", auth_key=env.get("TCOLL_AUTH_KEY", ""))
    _validate(found, source)
    host, port, hosted, agent = _master(env, method, found)
    run_id = env.get("TCOLL_RUN_ID") or found.run_id or _default_run_id(source, host, port, method, found.attempt)
    return LaunchInfo(
        found.rank, found.size, found.local_rank, found.local_size, found.node_rank, host, port, run_id,
        hosted, source, agent, found.attempt, env.get("TCOLL_AUTH_KEY", ""),
    )  # fmt: skip


def open_store(info: LaunchInfo, init_method: str | None = None, timeout: float = 300.0) -> Store:
    """Open the store the ranks of `info` meet through.

    file:// gives a FileStore; torchrun's agent store a TorchStore (keys under
    "tcoll/attempt<N>"); a master address a TCPStore, served by rank 0 unless the
    launcher already serves it; a world of one rank without a master a MemoryStore.

    Args:
        info: from `detect`.
        init_method: the same init_method given to `detect`.
        timeout: default seconds for the store's waits, and for connecting.

    Returns:
        The store; the caller closes it (closing rank 0's also stops its server).

    Raises:
        RendezvousError: the store cannot be hosted or reached.
    """
    method = parse_init_method(init_method)
    if method.scheme == "file":
        return FileStore(method.path, timeout)
    if info.torch_agent_store:
        from ..store.torch_store import TorchStore

        agent = TorchStore.connect_tcp(info.master_addr, info.master_port, timeout)
        # The agent's store outlives restarts: each attempt must not see the last one's keys.
        return PrefixStore(agent, f"tcoll/attempt{info.attempt}", own=True)
    if info.master_addr:
        is_server = info.rank == 0 and not info.store_hosted
        return TCPStore.create(
            info.master_addr, info.master_port, is_server=is_server, timeout=timeout, auth_key=info.auth_key or None
        )
    if info.size == 1:
        return MemoryStore(timeout)
    raise RendezvousError(f"no rendezvous address for a world of {info.size} ranks: set TCOLL_MASTER=host:port")


def _ranks_text(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 16 else f"[{', '.join(map(str, ranks[:16]))}, ...] ({len(ranks)} ranks)"


def _missing_ranks(store: Store, error: TimeoutError, template: str, size: int) -> list[int]:
    """The ranks whose key (template.format(rank)) is absent, from the error or by asking the store."""
    keys = getattr(error, "missing_keys", None)
    wanted = {template.format(r): r for r in range(size)}
    if keys:
        return sorted(wanted[k] for k in keys if k in wanted)
    return [r for key, r in wanted.items() if not store.check([key])]


def exchange_cards(store: Store, rank: int, size: int, card: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """Publish this rank's card and collect every rank's.

    Args:
        store: the job's store (or a prefixed view of it).
        rank: this rank.
        size: the number of ranks.
        card: JSON-serialisable facts about this rank (host identity, addresses).
        timeout: seconds to wait for the other ranks.

    Returns:
        The cards of ranks 0..size-1.

    Raises:
        RendezvousError: some ranks did not publish in time; names them and the store.
    """
    store.set(f"card/{rank}", json.dumps(card, separators=(",", ":")).encode())
    keys = [f"card/{r}" for r in range(size)]
    try:
        first = min(timeout, notice.notice_after())
        try:
            raw = store.multi_get(keys, first)
        except TimeoutError as exc:
            if first >= timeout:
                raise
            missing = _missing_ranks(store, exc, "card/{}", size)  # a long wait says so, once
            notice.say(rank, f"the rendezvous at {store.address}", missing, first, timeout)
            raw = store.multi_get(keys, timeout - first)
    except TimeoutError as exc:
        missing = _missing_ranks(store, exc, "card/{}", size)
        raise RendezvousError(
            f"rendezvous at {store.address} timed out after {float(timeout)}s: "
            f"ranks {_ranks_text(missing)} of {size} did not arrive",
            missing=missing, address=store.address,
        ) from None  # fmt: skip
    return [json.loads(value) for value in raw]


def store_barrier(store: Store, rank: int, size: int, name: str, timeout: float) -> None:
    """Wait until every rank has called `store_barrier` with this name.

    The same name may be reused: the arrival counter tells each call which
    round it belongs to (no rank can enter round k+1 before round k ends).

    Args:
        store: the job's store.
        rank: this rank.
        size: the number of ranks.
        name: the barrier's name; every rank must use the same.
        timeout: seconds to wait.

    Raises:
        tcoll.TimeoutError: some ranks did not arrive; `.peers` holds them.
    """
    count = store.add(f"barrier/{name}/count", 1)
    round_ = (count - 1) // size
    base = f"barrier/{name}/{round_}"
    store.set(f"{base}/arrived/{rank}", b"1")
    if count % size == 0:
        store.set(f"{base}/done", b"1")  # the last to arrive releases everyone
    try:
        store.wait([f"{base}/done"], timeout)
    except TimeoutError:
        missing = [r for r in range(size) if not store.check([f"{base}/arrived/{r}"])]
        raise TimeoutError(
            f"barrier {name!r} at {store.address} timed out after {float(timeout)}s: "
            f"ranks {_ranks_text(missing)} of {size} did not arrive",
            peers=missing,
        ) from None


def store_leave(store: Store, rank: int, size: int, timeout: float, host_rank: int = 0) -> None:
    """Say goodbye through the store, so that its host closes it last.

    Call as the last store operation of every rank, before closing the store:
    the other ranks announce they are done; the rank hosting the TCP server
    waits for all of them, so its server never vanishes under a rank whose
    final request is still on the wire (a barrier cannot promise that: its
    last waiter may still be sending when the host's wait returns).

    Args:
        store: the job's store.
        rank: this rank.
        size: the number of ranks.
        timeout: seconds the host waits.
        host_rank: the rank whose process serves the store.

    Raises:
        tcoll.TimeoutError: (host only) some ranks did not say goodbye; `.peers` holds them.
    """
    if rank != host_rank:
        store.set(f"leave/{rank}", b"1")
        return
    try:
        store.wait([f"leave/{r}" for r in range(size) if r != host_rank], timeout)
    except TimeoutError as exc:
        missing = _missing_ranks(store, exc, "leave/{}", size)
        raise TimeoutError(
            f"closing the store at {store.address}: ranks {_ranks_text(missing)} of {size} still use it "
            f"after {float(timeout)}s",
            peers=missing,
        ) from None
