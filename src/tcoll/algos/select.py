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

from .registry import REGISTRY, AlgorithmInfo, Costs, Topology

__all__ = ["choose", "explain", "ranked", "eligible", "best_flat", "Costs", "Topology", "COSTS", "ARENA_SYNC", "ARENA_COPY", "ARENA_REDUCE"]

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


def explain(collective: str, nbytes: int, size: int | None = None, transport: str = "shm", *,
            ordered: bool = False, uneven: bool = False, blocking: bool = True, hosts: int = 1,
            ranks_per_host: int | None = None) -> str:
    """A table of the modelled time of each eligible algorithm, and the choice.

    Args:
        collective: e.g. "all_reduce".
        nbytes: bytes of one rank's input.
        size: ranks in the communicator (default: hosts * ranks_per_host).
        transport: whose costs to use: "shm", "tcp" or "loopback"; across hosts, the link between
            them ("tcp" unless another network transport is named).
        ordered: the reduce op is not commutative.
        uneven: ranks' counts differ.
        blocking: a blocking call (async_op=False): on one host ("shm") the
            shared-memory direct algorithms compete too.
        hosts: hosts the ranks are spread over; above 1 the hierarchical algorithms compete and the
            chosen one's steps are shown.
        ranks_per_host: ranks on each host (default: size / hosts, else 1).

    Returns:
        Text, one line per algorithm, the chosen one marked with "*".
    """
    per_host = ranks_per_host or (max(1, (size or hosts) // hosts))
    size = hosts * per_host if size is None else size
    topology = None
    if hosts > 1:
        inter = COSTS["tcp" if transport in ("shm", "loopback") else transport]
        topology = Topology(hosts, per_host, COSTS["shm"], inter)
        costs, direct = inter, False
        where = f"{hosts} hosts x {per_host} ranks, shm inside hosts and {inter_name(transport)} between them"
    else:
        costs = COSTS[transport]
        direct = blocking and transport in ("shm", "loopback")
        where = f"{size} ranks over {transport}"
    options = ranked(collective, nbytes, size, costs, ordered=ordered, uneven=uneven, direct=direct,
                     topology=topology)
    lines = [f"{collective}, {nbytes} B per rank, {where} "
             f"(alpha {costs.alpha * 1e6:g} us, beta {1 / costs.beta / 1e9:g} GB/s, "
             f"gamma {1 / costs.gamma / 1e9:g} GB/s):"]
    for index, (seconds, info) in enumerate(options):
        mark = "*" if index == 0 else " "
        lines.append(f" {mark} {info.name:<22} {_time(seconds):>12}  {info.summary}")
    if topology is None:
        for info in eligible(collective, ordered=ordered, uneven=uneven):
            if info.hierarchical:
                lines.append(f" - {info.name:<22} {'(hosts > 1)':>12}  {info.summary}")
    if options and topology is not None and options[0][1].hierarchical:
        lines.append(f"chosen hierarchy ({options[0][1].name}), predicted {_time(options[0][0])}:")
        for step, seconds in options[0][1].cost.plan(topology, nbytes):  # type: ignore[attr-defined]
            lines.append(f"    {step:<64} {_time(seconds):>12}")
    return "\n".join(lines)


def inter_name(transport: str) -> str:
    """The name of the link between hosts that `explain` assumes for `transport`."""
    return "tcp" if transport in ("shm", "loopback") else transport


def _time(seconds: float) -> str:
    """Seconds in the unit that reads best (us below 10 ms, else ms, else s)."""
    if seconds < 1e-2:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 10:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"
