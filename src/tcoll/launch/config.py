"""What `tcoll run` is asked to do: the `LaunchConfig` and the environment of each rank.

The environment contract (set for every rank, on top of the inherited one):

==========================  ================================================
variable                    value
==========================  ================================================
TCOLL_RANK                  global rank: node_rank * nprocs + local rank
TCOLL_SIZE                  world size: nnodes * nprocs
TCOLL_LOCAL_RANK            rank among the ranks of this launcher
TCOLL_LOCAL_SIZE            nprocs
TCOLL_NODE_RANK             node_rank
TCOLL_NNODES                nnodes
TCOLL_MASTER                "host:port" of the tcoll store (already running)
TCOLL_STORE_HOSTED          "1": the launcher hosts the store, ranks only connect
TCOLL_RUN_ID                the run id (names shared-memory segments)
RANK, WORLD_SIZE            torchrun's names for the global rank and world size
LOCAL_RANK                  torchrun's local rank
LOCAL_WORLD_SIZE            nprocs
GROUP_RANK                  node_rank
MASTER_ADDR                 host of the store
MASTER_PORT                 a port for torch's own TCPStore, different from
                            the tcoll store's: a free port on one node, the
                            store port + 1 with several nodes (every launcher
                            must agree without talking, and torch's rank 0
                            binds it itself)
PYTHONUNBUFFERED            "1", so output reaches the launcher at once
OMP_NUM_THREADS             "1" when several ranks start and it is not set
                            (as torchrun does: a thread pool per core in every
                            rank would oversubscribe the cores many times over)
TCOLL_KEEP_GOING            "1" with --keep-going (the survivors of a dead rank
                            run on), else unset
==========================  ================================================
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import socket
import sys

__all__ = ["RUN_ID_PATTERN", "LaunchConfig", "free_port", "new_run_id", "parse_master"]

# No "-": the launcher removes /dev/shm/tcoll-<run_id>-*, so run "a" must not
# match the segments of a run called "a-b".
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.]{1,64}$")


def new_run_id() -> str:
    """Make a fresh run id.

    Returns:
        12 random hexadecimal characters (safe in file names).
    """
    return secrets.token_hex(6)


def parse_master(text: str) -> tuple[str, int]:
    """Split a ``HOST:PORT`` address (``[v6addr]:PORT`` for IPv6).

    Args:
        text: the address, e.g. ``"10.0.0.1:29500"``.

    Returns:
        (host, port).

    Raises:
        ValueError: the text has no port, or the port is not in 0..65535.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range in {text!r}")
    return host.strip("[]"), port


def free_port(host: str = "127.0.0.1", avoid: int = 0) -> int:
    """Find a TCP port that is free now on `host` (it may be taken later: callers accept the race).

    Args:
        host: the address to probe.
        avoid: a port that must not be returned (e.g. one just chosen for another use).

    Returns:
        A port number.
    """
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != avoid:
            return port


@dataclasses.dataclass
class LaunchConfig:
    """Everything `tcoll run` needs to start the ranks of one node.

    Attributes:
        command: what each rank runs after ``python -u``: ``[script, *args]`` or
            ``["-m", module, *args]``.
        nprocs: ranks on this node.
        nnodes: nodes in the job, each with its own launcher.
        node_rank: this node's index, 0..nnodes-1; node 0 hosts the store.
        master_addr: host of the store; default loopback on one node.
        master_port: port of the store; 0 picks a free one (one node only).
        run_id: job id shared by all nodes; empty: node 0 makes one, others take node 0's.
        env: extra variables for every rank (win over the inherited ones, not over the contract).
        prefix: prefix each output line with ``[rank] ``.
        stop_timeout: seconds between SIGTERM (or a forwarded SIGINT) and SIGKILL.
        tail_lines: lines of each rank's stderr kept to show when it fails.
        join_timeout: seconds a launcher waits for the store and for the other nodes.
        python: the interpreter that runs the ranks.
        keep_going: when a rank fails, report it and let the others run to their own end
            (every node of a job must agree); False: stop the whole job (fail fast).
    """

    command: list[str]
    nprocs: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 0
    run_id: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    prefix: bool = True
    stop_timeout: float = 3.0
    tail_lines: int = 20
    join_timeout: float = 300.0
    python: str = sys.executable
    keep_going: bool = False

    @property
    def world_size(self) -> int:
        """The number of ranks on all nodes."""
        return self.nnodes * self.nprocs

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.nprocs

    def argv(self) -> list[str]:
        """The command line of one rank.

        Returns:
            ``[python, "-u", *command]``.
        """
        return [self.python, "-u", *self.command]

    def validate(self) -> None:
        """Check the configuration before anything starts.

        Raises:
            ValueError: naming the bad field.
        """
        if not self.command or (self.command[0] == "-m" and len(self.command) < 2):
            raise ValueError("no script or module to run")
        if self.nprocs < 1 or self.nnodes < 1:
            raise ValueError("nprocs and nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node rank {self.node_rank} is not in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and not (self.master_addr and 0 < self.master_port < 65535):
            raise ValueError("several nodes need --master HOST:PORT with a fixed port below 65535")
        if self.run_id and not RUN_ID_PATTERN.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must be 1-64 of [A-Za-z0-9_.] (no '-')")
        if self.stop_timeout < 0 or self.tail_lines < 0 or self.join_timeout <= 0:
            raise ValueError("stop_timeout and tail_lines must be >= 0, join_timeout > 0")

    def rank_env(self, local_rank: int, store: tuple[str, int], torch_port: int,
                 base: dict[str, str]) -> dict[str, str]:
        """Build the environment of one rank.

        Args:
            local_rank: the rank's index on this node.
            store: (host, port) of the running tcoll store.
            torch_port: the port given to torch scripts as MASTER_PORT.
            base: the inherited environment.

        Returns:
            A new dict: `base`, then `self.env`, then the contract in the module docstring.
        """
        host, port = store
        rank = self.first_rank + local_rank
        env = {**base, **self.env}
        env.update({
            "TCOLL_RANK": str(rank), "TCOLL_SIZE": str(self.world_size),
            "TCOLL_LOCAL_RANK": str(local_rank), "TCOLL_LOCAL_SIZE": str(self.nprocs),
            "TCOLL_NODE_RANK": str(self.node_rank), "TCOLL_NNODES": str(self.nnodes),
            "TCOLL_MASTER": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            "TCOLL_STORE_HOSTED": "1", "TCOLL_RUN_ID": self.run_id,
            "RANK": str(rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.nprocs),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": host, "MASTER_PORT": str(torch_port),
            "PYTHONUNBUFFERED": "1",
        })
        if self.nprocs > 1:  # as torchrun does: ranks sharing a host's cores must not each start a thread pool per core
            env.setdefault("OMP_NUM_THREADS", "1")
        if self.keep_going:
            env["TCOLL_KEEP_GOING"] = "1"
        else:
            env.pop("TCOLL_KEEP_GOING", None)  # the launcher's choice, not an inherited one
        return env
