"""Choosing an algorithm: a pure function of the call and a cost model, with every measured constant.

Each registered algorithm carries its cost formula (Thakur, Rabenseifner and
Gropp, "Optimization of Collective Communication Operations in MPICH", 2005);
`choose` evaluates them for the call's size and world and takes the cheapest
algorithm that is eligible (rank order kept for a non-commutative op, uneven
counts supported when the call has them). `explain` prints the reckoning.

The constants below are the only measured numbers the choice rests on: the
alpha-beta-gamma model of each transport, for algorithms over point-to-point,
and the step, copy and reduce costs of the shared-memory arena, for the
direct algorithms (`tcoll.shm`). All were fitted to `tcoll bench` runs on a
2-core machine (docs/performance.md).
"""

from __future__ import annotations

from ..env import parse_size
from .explaining import describe_choice, format_seconds
from .registry import REGISTRY, AlgorithmInfo, Costs, Topology

__all__ = ["choose", "explain", "ranked", "eligible", "best_flat", "Costs", "Topology", "COSTS", "ARENA_SYNC",
           "ARENA_COPY", "ARENA_REDUCE"]

# Per-message and per-byte costs of point-to-point over each transport
# (`tcoll bench p2p`); gamma is NumPy's in-place add over data fresh in cache.
COSTS = {
    "shm": Costs(alpha=12e-6, beta=1 / 8e9, gamma=1 / 6e9),
    "tcp": Costs(alpha=40e-6, beta=1 / 4e9, gamma=1 / 6e9),
    "loopback": Costs(alpha=8e-6, beta=1 / 8e9, gamma=1 / 6e9),
    # Not measured here (this machine has no fabric): a 100 Gb/s InfiniBand or EFA link reached through
    # mpi4py, whose Python call overhead (~25 us per message) dominates the fabric's ~2 us.
    "mpi": Costs(alpha=25e-6, beta=1 / 12e9, gamma=1 / 6e9),
}

_BOUNDARY_ONCE = ("ring", "chain")  # flat algorithms whose traffic crosses a host boundary once per step

# The shared-memory arena (`tcoll bench all_reduce`, ..., with algorithm shm):
ARENA_SYNC = 2e-6  # seconds per step: a counter in shared memory seen by a polling rank, plus Python
ARENA_COPY = 1 / 30e9  # seconds per byte copied into or out of a slot (pieces stay in cache)
ARENA_REDUCE = 1 / 12e9  # seconds per byte combined by a ufunc over slots in cache


def eligible(collective: str, *, ordered: bool = False, uneven: bool = False,
             direct: bool = False) -> list[AlgorithmInfo]:
    """The algorithms of `collective` that can run a call needing rank order / uneven counts.

    Args:
        direct: whether shared-memory direct algorithms may run (a blocking call, every rank on one host).
    """
    return [info for info in REGISTRY[collective].values()
            if (info.ordered or not ordered) and (info.uneven or not uneven) and (direct or not info.direct)]


def ranked(collective: str, nbytes: int, size: int, costs: Costs, *, ordered: bool = False,
           uneven: bool = False, direct: bool = False,
           topology: Topology | None = None) -> list[tuple[float, AlgorithmInfo]]:
    """Every eligible algorithm with its modelled time, cheapest first (ties: registration order).

    Args:
        topology: the hosts of a job over several (None: one host); flat algorithms are costed with
            `costs` (the slowest link), hierarchical ones with both kinds of link, and only then compete.
    """
    candidates = eligible(collective, ordered=ordered, uneven=uneven, direct=direct)
    timed = []
    shared = costs
    if topology is not None and topology.hosts > 1 and topology.per_host > 1:
        # A host's ranks share its network link: a flat algorithm whose ranks all talk across hosts at
        # once gets 1/per_host of it each. A ring or chain over ranks numbered host by host crosses
        # each host boundary with one block per step, so it keeps the whole link.
        shared = Costs(costs.alpha, costs.beta * topology.per_host, costs.gamma)
    for index, info in enumerate(candidates):
        if not info.hierarchical:
            link = costs if info.name in _BOUNDARY_ONCE else shared
            timed.append((info.cost(link, nbytes, size), index, info))
        elif topology is not None and topology.hosts > 1 and topology.per_host > 1:
            timed.append((info.cost(topology, nbytes), index, info))
    return [(seconds, info) for seconds, _, info in sorted(timed, key=lambda item: item[:2])]


def best_flat(collective: str, costs: Costs, nbytes: int, size: int) -> tuple[float, AlgorithmInfo]:
    """The cheapest algorithm over point-to-point on one kind of link (for the steps of a hierarchy)."""
    return ranked(collective, nbytes, size, costs, ordered=False, uneven=True)[0]


def choose(collective: str, nbytes: int, size: int, costs: Costs, *, ordered: bool = False,
           uneven: bool = False, direct: bool = False, topology: Topology | None = None) -> AlgorithmInfo:
    """The cheapest eligible algorithm for this call.

    Args:
        collective: e.g. "all_reduce".
        nbytes: bytes of one rank's input.
        size: ranks in the communicator.
        costs: the link model (see COSTS).
        ordered: the reduce op is not commutative.
        uneven: ranks' counts differ.
        direct: shared-memory direct algorithms may run.
        topology: the hosts of a job over several (None: one host).

    Raises:
        ValueError: no algorithm is eligible.
    """
    options = ranked(collective, nbytes, size, costs, ordered=ordered, uneven=uneven, direct=direct,
                     topology=topology)
    if not options:
        raise ValueError(f"no {collective} algorithm supports this call (ordered={ordered}, uneven={uneven})")
    return options[0][1]


# The collectives that CUDA buffers run on NCCL when the path is "nccl" (tcoll.comm.nccl); the rest are staged.
NCCL_COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all")


def _gpu_lines(collective: str, nbytes: int, gpu: str, ordered: bool) -> list[str]:
    """What a call on CUDA buffers does on path `gpu` ("nccl" or "staging"), before the CPU reckoning."""
    if gpu == "nccl" and collective in NCCL_COLLECTIVES and not ordered:
        return [f"CUDA buffers, path nccl: NCCL runs this {collective} on the caller's stream, with its own "
                "algorithm (NCCL_ALGO and NCCL_PROTO choose it; tcoll does not model it).",
                "Before it is queued, the ranks check the call on the CPU: an all_reduce of 96 bytes per rank "
                "(the table below is that check's; ops, dtypes or a named algorithm NCCL lacks are staged)."]
    why = "the path is staging" if gpu == "staging" else "NCCL has no such call or op"
    return [f"CUDA buffers, staged as {why}: a device-to-host copy of {nbytes} bytes on the caller's stream, the CPU "
            "call below on pinned shared memory (comm.empty's, read in place), a host-to-device copy back."]


def explain(collective: str, nbytes: int | str, size: int | None = None, transport: str = "shm", *,
            ordered: bool = False, uneven: bool = False, blocking: bool = True, hosts: int = 1,
            ranks_per_host: int | None = None, gpu: str | None = None) -> str:
    """A table of each eligible algorithm's modelled time, messages and bytes, the choice, and why.

    Args:
        collective: e.g. "all_reduce".
        nbytes: bytes of one rank's input (an int, or text such as "64MiB" or "1G").
        size: ranks in the communicator (default: hosts * ranks_per_host).
        transport: whose costs to use: "shm", "tcp" or "loopback"; across hosts, the link between
            them ("tcp" unless "mpi" is named).
        ordered: the reduce op is not commutative.
        uneven: ranks' counts differ.
        blocking: a blocking call (async_op=False): on one host ("shm") the
            shared-memory direct algorithms compete too.
        hosts: hosts the ranks span; above 1 the direct algorithms cannot run, the hierarchical
            ones compete (shm inside hosts, the network between them) and the chosen one's steps
            are shown with their predicted times.
        ranks_per_host: ranks on each host (default: size / hosts, else 1).
        gpu: for CUDA buffers, the communicator's path ("nccl" or "staging", docs/gpu.md): lines first
            say what runs on the GPU; None: CPU buffers.

    Returns:
        Text: a header, one line per algorithm (the chosen one marked with "*"; messages
        and bytes are those of the rank that sends most, "-" for the direct and hierarchical
        ones), and a line saying why.
    """
    nbytes = parse_size(nbytes)
    if gpu is not None:
        if gpu not in ("nccl", "staging"):
            raise ValueError(f"gpu must be 'nccl' or 'staging', not {gpu!r}")
        preface = _gpu_lines(collective, nbytes, gpu, ordered)
        staged = not preface[0].startswith("CUDA buffers, path nccl")
        body = explain(collective if staged else "all_reduce", nbytes if staged else 96, size, transport,
                       ordered=ordered, uneven=uneven, blocking=blocking, hosts=hosts, ranks_per_host=ranks_per_host)
        return "\n".join(preface + [body])
    per_host = ranks_per_host or max(1, (size or hosts) // hosts)
    size = hosts * per_host if size is None else size
    topology = None
    if hosts > 1:
        transport = transport if transport == "mpi" else "tcp"
        topology = Topology(hosts, per_host, COSTS["shm"], COSTS[transport])
    costs = COSTS[transport]
    direct = blocking and hosts == 1 and transport in ("shm", "loopback")
    options = ranked(collective, nbytes, size, costs, ordered=ordered, uneven=uneven, direct=direct,
                     topology=topology)
    lines = [describe_choice(collective, nbytes, size, transport, costs, options, hosts)]
    if topology is not None and options[0][1].hierarchical:
        seconds, best = options[0]
        lines.append(f"chosen hierarchy ({best.name}, {hosts} hosts x {per_host} ranks), predicted "
                     f"{format_seconds(seconds)}:")
        lines += [f"    {step:<64} {format_seconds(took):>10}"
                  for step, took in best.cost.plan(topology, nbytes)]  # type: ignore[attr-defined]
    if collective == "scatter" and direct and size > 1:  # (tcoll.comm.movement: the other ranks learn the chunks there)
        seconds, info = ranked("scatter_described", nbytes, size, costs, direct=True)[0]
        lines.append(f"runs: scatter_described {info.name}, predicted {format_seconds(seconds)}: on one host a "
                     "blocking scatter is one arena call with root's description of the chunks in its first step; the table "
                     "is a scatter's across hosts or with async_op=True, after a broadcast of the description.")
    return "\n".join(lines)
