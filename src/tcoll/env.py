"""Every TCOLL_* tuning variable, parsed in one place.

Rendezvous variables (rank, size, master address) are read by
`tcoll.startup.rendezvous`; this module holds the knobs that shape how data moves.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Settings", "parse_bool", "parse_size", "read_variables", "TRANSPORT_CHOICES", "GPU_CHOICES"]

TRANSPORT_CHOICES = ("auto", "shm", "tcp", "mpi")
GPU_CHOICES = ("auto", "staging", "nccl")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)(i?[bB])?\s*$")
_SIZE_FIELDS = ("shm_ring", "shm_chunk", "eager_limit", "coll_chunk", "shm_slot", "shm_one_step")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def parse_size(text: str | int) -> int:
    """Parse a byte count such as ``4096``, ``"256K"``, ``"4MiB"`` or ``"1G"``.

    Args:
        text: an integer, or a number with an optional K/M/G suffix (powers of 1024).

    Returns:
        The number of bytes.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ValueError(f"not a byte size: {text!r} (examples: 4096, 256K, 4MiB, 1G)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def parse_size_or_auto(text: str | int) -> int:
    """A byte count as parse_size, or -1 for "auto" (or "-1"): the setting's measured default."""
    if isinstance(text, str) and text.strip().lower() in ("auto", "-1"):
        return -1
    return parse_size(text)


def parse_bool(text: str | bool) -> bool:
    """Parse a switch: ``1/true/yes/on`` or ``0/false/no/off`` (any case).

    Raises:
        ValueError: the text is neither.
    """
    if isinstance(text, bool):
        return text
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a switch: {text!r} (1/0, true/false, yes/no, on/off)")


def read_variables(spec: Mapping[str, tuple[str, Callable[[str], Any]]],
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Read the variables that are set (and not empty) into fields.

    Args:
        spec: {field: (variable name, converter)}.
        environ: the variables to read (default: os.environ).

    Returns:
        {field: converted value} for every variable set.

    Raises:
        ValueError: a variable has a bad value (the message names it).
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for field, (var, convert) in spec.items():
        raw = environ.get(var)
        if raw not in (None, ""):
            try:
                values[field] = convert(raw)
            except ValueError as exc:
                raise ValueError(f"{var}={raw!r}: {exc}") from None
    return values


@dataclasses.dataclass(frozen=True)
class Settings:
    """How tcoll moves data; defaults, overridden by TCOLL_* variables and keywords.

    Attributes:
        timeout: seconds any blocking wait may take before `tcoll.TimeoutError` (TCOLL_TIMEOUT).
        transport: "auto" (shm between ranks of one host, else tcp), "shm", "tcp" or "mpi" (TCOLL_TRANSPORT).
        interhost: what carries pairs of ranks on different hosts when transport is "auto":
            "tcp" (default) or "mpi" (TCOLL_INTERHOST).
        shm_ring: bytes of each shared-memory channel ring, per ordered pair of ranks; 0 sizes
            it from the number of ranks on the host (TCOLL_SHM_RING).
        shm_chunk: most bytes moved by one copy step through a ring; smaller chunks
            pipeline sooner, larger ones cost less Python per byte (TCOLL_SHM_CHUNK).
        eager_limit: unexpected messages up to this size are copied aside at once; larger
            ones wait in their channel until a matching receive is posted (TCOLL_EAGER_LIMIT).
        spin_us: most microseconds a waiting rank polls before it blocks (TCOLL_SPIN_US).
        spin_yield_us: microseconds a waiting rank polls flat out before each further poll yields
            the core (sched_yield) to whatever else is runnable on it (TCOLL_SPIN_YIELD_US).
        bind: "auto": when the ranks of a host (separate processes) are no more than its usable
            cores, each rank keeps to its own equal share of them, so that two ranks never share a
            core while another idles; "none": leave placement to the OS (TCOLL_BIND).
        liveness_interval: seconds between checks that blocked-on peers still live (TCOLL_LIVENESS).
        tcp_addr: address to advertise for TCP connections; empty: found from the route
            to the master (TCOLL_TCP_ADDR).
        socket_ifname: interfaces TCP may use, as NCCL_SOCKET_IFNAME spells them: "eth0",
            "=eth0" (exact), "^lo,docker0" (excluded) (TCOLL_SOCKET_IFNAME).
        algorithms: forced algorithm choices for algorithm="auto", e.g.
            "all_reduce=ring,broadcast=chain" (TCOLL_ALGO).
        coll_chunk: bytes per message of the pipelined collective algorithms (ring,
            chain); small values exercise the multi-chunk paths (TCOLL_COLL_CHUNK).
        shm_slot: bytes each rank stages per step of the shared-memory direct collectives;
            larger messages are pipelined through its two slots; -1: 1 MiB, or 2 MiB where the
            host's ranks outnumber its cores (TCOLL_SHM_SLOT).
        shm_one_step: the largest shared-memory all_reduce/reduce, in bytes, that runs in one arena
            step (every rank reduces every vector); -1: the measured default for the host's rank count
            (tcoll.shm.vector.ONE_STEP_LIMITS). Rank 0's value rules, as for shm_slot
            (TCOLL_SHM_ONE_STEP).
        shm_kernel: "auto": the arena's steps of reductions, and blocking sends and receives between
            ranks of one host, run in the package's C kernels where they were built; "off": always
            in Python (the same results; for comparing, or suspecting them) (TCOLL_SHM_KERNEL).
        shm_single_copy: where every rank of the host may read every other's memory (process_vm_readv,
            probed when the arena opens), "auto" (the default): a shared-memory all_gather or all_to_all of
            2 MiB or more reads the other ranks' arrays where they lie, one kernel copy instead of two through
            the arena's slots; "on": an all_reduce larger than a slot too (not faster on the CPUs measured:
            docs/performance.md); "off": every byte through the slots (TCOLL_SHM_SINGLE_COPY).
        auth_key: shared secret; when set, every TCP connection is authenticated with
            an HMAC challenge before any message is read from it (TCOLL_AUTH_KEY).
        gpu: how calls move CUDA buffers, ordered on the caller's stream (TCOLL_GPU): "staging" through
            pinned host memory (tcoll.comm.staging); "nccl" on NCCL where every rank has its own GPU
            (tcoll.comm.nccl; calls NCCL lacks are staged); "auto": NCCL where it can run, else staging.
        tcp_dead_after: seconds after which a TCP peer that answers nothing (its host gone
            without closing the connection: power, link, kernel) counts as lost, through TCP
            keep-alive probes while the connection is idle, and the age of unacknowledged data while
            it is busy (a live peer that only reads late is not lost); at least 1; 0 leaves the kernel's defaults (hours) (TCOLL_TCP_DEAD_AFTER).
        keep_going: the job runs on when a rank dies: set by `tcoll run --keep-going`, which then
            lets the survivors run to their end instead of stopping them (TCOLL_KEEP_GOING).
    """

    timeout: float = 300.0
    transport: str = "auto"
    interhost: str = "tcp"
    shm_ring: int = 0
    shm_chunk: int = 512 << 10
    eager_limit: int = 64 << 10
    spin_us: float = 100.0
    spin_yield_us: float = 50.0
    bind: str = "auto"
    liveness_interval: float = 1.0
    tcp_addr: str = ""
    socket_ifname: str = ""
    auth_key: str = ""
    coll_chunk: int = 1 << 20
    shm_slot: int = -1
    shm_one_step: int = -1
    shm_kernel: str = "auto"
    shm_single_copy: str = "auto"
    algorithms: str = ""
    gpu: str = "auto"
    tcp_dead_after: float = 5.0
    keep_going: bool = False

    _ENV = {
        "timeout": ("TCOLL_TIMEOUT", float),
        "transport": ("TCOLL_TRANSPORT", str),
        "interhost": ("TCOLL_INTERHOST", str),
        "shm_ring": ("TCOLL_SHM_RING", parse_size),
        "shm_chunk": ("TCOLL_SHM_CHUNK", parse_size),
        "eager_limit": ("TCOLL_EAGER_LIMIT", parse_size),
        "spin_us": ("TCOLL_SPIN_US", float),
        "spin_yield_us": ("TCOLL_SPIN_YIELD_US", float),
        "bind": ("TCOLL_BIND", str),
        "liveness_interval": ("TCOLL_LIVENESS", float),
        "tcp_addr": ("TCOLL_TCP_ADDR", str),
        "socket_ifname": ("TCOLL_SOCKET_IFNAME", str),
        "auth_key": ("TCOLL_AUTH_KEY", str),
        "coll_chunk": ("TCOLL_COLL_CHUNK", parse_size),
        "shm_slot": ("TCOLL_SHM_SLOT", parse_size_or_auto),
        "shm_one_step": ("TCOLL_SHM_ONE_STEP", parse_size_or_auto),
        "shm_kernel": ("TCOLL_SHM_KERNEL", str),
        "shm_single_copy": ("TCOLL_SHM_SINGLE_COPY", str),
        "algorithms": ("TCOLL_ALGO", str),
        "gpu": ("TCOLL_GPU", str),
        "tcp_dead_after": ("TCOLL_TCP_DEAD_AFTER", float),
        "keep_going": ("TCOLL_KEEP_GOING", parse_bool),
    }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from the environment, then apply keyword overrides.

        Args:
            environ: the variables to read (default: os.environ).
            **overrides: field values that win over the environment; None means "not given".

        Returns:
            Validated settings.

        Raises:
            ValueError: a variable or override has a bad value.
        """
        values = read_variables(cls._ENV, environ)  # type: ignore[attr-defined]
        for field, value in overrides.items():
            if value is not None:
                values[field] = parse_size(value) if field in _SIZE_FIELDS else value
        settings = cls(**values)
        settings.validate()
        return settings

    def forced_algorithms(self) -> dict[str, str]:
        """{collective: algorithm} from `algorithms` ("all_reduce=ring,broadcast=chain").

        Raises:
            ValueError: an entry is not "collective=algorithm".
        """
        forced = {}
        for entry in filter(None, (part.strip() for part in self.algorithms.split(","))):
            collective, sep, name = entry.partition("=")
            if not sep or not collective.strip() or not name.strip():
                raise ValueError(f"TCOLL_ALGO entries look like all_reduce=ring, not {entry!r}")
            forced[collective.strip()] = name.strip()
        return forced

    def validate(self) -> None:
        """Check the values are usable.

        Raises:
            ValueError: naming the bad field.
        """
        if self.interhost not in ("tcp", "mpi"):
            raise ValueError(f"interhost must be 'tcp' or 'mpi', not {self.interhost!r}")
        if self.transport not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, not {self.transport!r}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive, not {self.timeout}")
        if self.shm_chunk < 64:
            raise ValueError(f"shm_chunk must be at least 64 bytes, not {self.shm_chunk}")
        if self.shm_ring and self.shm_ring < 2 * self.shm_chunk:
            raise ValueError(f"shm_ring ({self.shm_ring}) must hold at least two chunks of {self.shm_chunk}")
        self.forced_algorithms()  # raises on a malformed TCOLL_ALGO
        if self.coll_chunk < 16:
            raise ValueError(f"coll_chunk must be at least 16 bytes, not {self.coll_chunk}")
        if self.shm_slot < 64 and self.shm_slot != -1:
            raise ValueError(f"shm_slot must be at least 64 bytes (or -1, the default), not {self.shm_slot}")
        if self.shm_one_step < -1:
            raise ValueError(f"shm_one_step must be a byte count (or -1, the default), not {self.shm_one_step}")
        if self.shm_kernel not in ("auto", "off"):
            raise ValueError(f"shm_kernel must be 'auto' or 'off', not {self.shm_kernel!r}")
        if self.shm_single_copy not in ("auto", "on", "off"):
            raise ValueError(f"shm_single_copy must be 'auto', 'on' or 'off', not {self.shm_single_copy!r}")
        if self.gpu not in GPU_CHOICES:
            raise ValueError(f"gpu (TCOLL_GPU) must be one of {GPU_CHOICES}, not {self.gpu!r}")
        if self.bind not in ("auto", "none"):
            raise ValueError(f"bind must be 'auto' or 'none', not {self.bind!r}")
        if self.spin_us < 0 or self.spin_yield_us < 0 or self.liveness_interval <= 0:
            raise ValueError("spin_us and spin_yield_us must be >= 0 and liveness_interval > 0")
        if self.tcp_dead_after != 0 and not 1 <= self.tcp_dead_after <= 86400:
            raise ValueError(f"tcp_dead_after must be 0 (off) or 1..86400 seconds, not {self.tcp_dead_after}")
