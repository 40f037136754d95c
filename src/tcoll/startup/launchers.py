"""The contracts tcoll is started under: launchers' variables and init_method URLs.

Each reader looks at one launcher's variables and returns a `Found` (rank,
size, node layout, run id) or None when that launcher did not start this
process. `LAUNCHERS` lists them in order of precedence; `parse_init_method`
reads "env://", "tcp://host:port" and "file:///path". `tcoll.startup.rendezvous`
puts explicit arguments on top and settles the master address.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = [
    "Found", "LAUNCHERS", "VARIABLE_NAMES", "DEFAULT_PORT", "InitMethod",
    "read_int", "find_launcher", "split_host_port", "parse_init_method",
]  # fmt: skip

DEFAULT_PORT = 29500
"""The rendezvous port when none is given (torch's default too)."""


@dataclass
class Found:
    """What one launcher's variables say, before the master address is settled."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    run_id: str = ""
    torch_agent_store: bool = False
    attempt: int = 0


# -- reading variables -----------------------------------------------------------------


def read_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """Read a non-negative integer variable.

    Raises:
        ValueError: missing (without default), not an integer, or negative; naming the variable.
    """
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise ValueError(f"{name} is not set")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


def node_guess(rank: int, local_rank: int, local_size: int) -> int:
    """Node index for launchers that do not export one (exact for block placement)."""
    return (rank - local_rank) // local_size if local_size > 0 else 0


def _from_tcoll(env: Mapping[str, str]) -> Found | None:
    if "TCOLL_RANK" not in env and "TCOLL_SIZE" not in env:
        return None
    rank, size = read_int(env, "TCOLL_RANK"), read_int(env, "TCOLL_SIZE")
    local_rank, local_size = read_int(env, "TCOLL_LOCAL_RANK", rank), read_int(env, "TCOLL_LOCAL_SIZE", size)
    node = read_int(env, "TCOLL_NODE_RANK", node_guess(rank, local_rank, local_size))
    return Found(rank, size, local_rank, local_size, node, env.get("TCOLL_RUN_ID", ""))


def _from_torchrun(env: Mapping[str, str]) -> Found | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank, size = read_int(env, "RANK"), read_int(env, "WORLD_SIZE")
    local_rank, local_size = read_int(env, "LOCAL_RANK", rank), read_int(env, "LOCAL_WORLD_SIZE", size)
    node = read_int(env, "GROUP_RANK", node_guess(rank, local_rank, local_size))
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    attempt = read_int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    return Found(rank, size, local_rank, local_size, node, "" if run_id == "none" else run_id, agent, attempt)


def _from_openmpi(env: Mapping[str, str]) -> Found | None:
    if "OMPI_COMM_WORLD_RANK" not in env:
        return None
    rank, size = read_int(env, "OMPI_COMM_WORLD_RANK"), read_int(env, "OMPI_COMM_WORLD_SIZE")
    local_rank = read_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", rank)
    local_size = read_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", size)
    run_id = env.get("PMIXVARIABLE_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid", "")
    return Found(rank, size, local_rank, local_size, node_guess(rank, local_rank, local_size), run_id)


def _from_pmi(env: Mapping[str, str]) -> Found | None:
    if "PMI_RANK" not in env:
        return None
    rank, size = read_int(env, "PMI_RANK"), read_int(env, "PMI_SIZE")
    local_rank, local_size = read_int(env, "MPI_LOCALRANKID", rank), read_int(env, "MPI_LOCALNRANKS", size)
    return Found(rank, size, local_rank, local_size, node_guess(rank, local_rank, local_size))


_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _slurm_tasks_per_node(name: str, text: str) -> list[int]:
    """Expand Slurm's compressed task counts, e.g. "4(x2),3" -> [4, 4, 3].

    Raises:
        ValueError: naming the variable, when the text is not in that form.
    """
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS_RE.match(part.strip())
        if not match:
            raise ValueError(f"{name}={text!r} is not a Slurm task count list such as '4(x2),3'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _from_slurm(env: Mapping[str, str]) -> Found | None:
    # Only srun exports a step id; an sbatch script run directly (no srun) also
    # sees SLURM_PROCID=0 and SLURM_NTASKS=N, but it is one process, not rank 0 of N.
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if "SLURM_PROCID" not in env or step is None:
        return None
    rank = read_int(env, "SLURM_PROCID")
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    size = read_int(env, size_var)
    node = read_int(env, "SLURM_NODEID", 0)
    local_rank = read_int(env, "SLURM_LOCALID", rank)
    local_size = size
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.get(var):
            counts = _slurm_tasks_per_node(var, env[var])
            local_size = counts[node] if node < len(counts) else counts[-1]
            break
    job = env.get("SLURM_JOB_ID", env.get("SLURM_JOBID", ""))
    return Found(rank, size, local_rank, local_size, node, f"slurm-{job}.{step}" if job else "")


# Precedence order: the first launcher whose variables are present wins.
LAUNCHERS: list[tuple[str, Callable[[Mapping[str, str]], Found | None]]] = [
    ("tcoll", _from_tcoll),
    ("torchrun", _from_torchrun),
    ("openmpi", _from_openmpi),
    ("pmi", _from_pmi),
    ("slurm", _from_slurm),
]


# Variable names used in messages, per source: rank, size, local rank, local size.
VARIABLE_NAMES = {
    "explicit": ("rank", "size", "local_rank", "local_size"),
    "tcoll": ("TCOLL_RANK", "TCOLL_SIZE", "TCOLL_LOCAL_RANK", "TCOLL_LOCAL_SIZE"),
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_TASKS_PER_NODE"),
}


def split_host_port(name: str, text: str) -> tuple[str, int]:
    """Split "host:port" / "[v6]:port" / "host" (port 29500) from variable `name`.

    Raises:
        ValueError: naming the variable.
    """
    try:
        parts = urlsplit("//" + text.strip())
        host, port = parts.hostname or "", parts.port or DEFAULT_PORT
    except ValueError:
        host, port = "", 0
    if not host or not 0 < port < 65536:
        raise ValueError(f"{name}={text!r} is not host:port (e.g. 10.0.0.1:29500)")
    return host, port


def find_launcher(env: Mapping[str, str]) -> tuple[Found | None, str]:
    """Return what the first launcher (by precedence) present in `env` says, and its name.

    Returns:
        (Found, name), or (None, "single") when no launcher started this process.

    Raises:
        ValueError: that launcher's variables are malformed.
    """
    for name, reader in LAUNCHERS:
        found = reader(env)
        if found is not None:
            return found, name
    return None, "single"


@dataclass
class InitMethod:
    """A parsed init_method: its scheme, address or path, and rank/size given in its query."""

    scheme: str  # "env", "tcp" or "file"
    host: str = ""
    port: int = 0
    path: str = ""
    rank: int | None = None
    size: int | None = None


def _query_int(init_method: str, query: dict[str, list[str]], *names: str) -> int | None:
    for name in names:
        if name in query:
            try:
                return int(query[name][-1])
            except ValueError:
                raise ValueError(f"init_method {init_method!r}: {name}={query[name][-1]!r} is not an integer") from None
    return None


def parse_init_method(init_method: str | None) -> InitMethod:
    """Parse "env://", "tcp://host:port" or "file:///path", each with an optional ?rank=&world_size=.

    Raises:
        ValueError: unknown scheme, or a missing host, port or path.
    """
    if not init_method:
        return InitMethod("env")
    parts = urlsplit(init_method)
    query = parse_qs(parts.query)
    method = InitMethod(parts.scheme, rank=_query_int(init_method, query, "rank"),
                     size=_query_int(init_method, query, "world_size", "size"))  # fmt: skip
    if parts.scheme == "tcp":
        try:
            method.host, method.port = parts.hostname or "", parts.port or 0
        except ValueError:
            method.port = 0
        if not method.host or not 0 < method.port < 65536:
            raise ValueError(f"init_method {init_method!r}: tcp:// needs host:port, e.g. tcp://10.0.0.1:29500")
    elif parts.scheme == "file":
        method.path = unquote(parts.path)
        if not method.path or parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"init_method {init_method!r}: file:// needs an absolute path, e.g. file:///shared/job.store"
            )
    elif parts.scheme != "env":
        raise ValueError(f"init_method {init_method!r}: use env://, tcp://host:port or file:///path")
    return method
