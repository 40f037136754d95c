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
from .explaining import describe_choice
from .registry import REGISTRY, AlgorithmInfo, Costs

__all__ = ["choose", "explain", "ranked", "eligible", "COSTS", "ARENA_SYNC", "ARENA_COPY", "ARENA_REDUCE"]

# Per-message and per-byte costs of point-to-point over each transport
# (`tcoll bench p2p`); gamma is NumPy's in-place add over data fresh in cache.
COSTS = {
    "shm": Costs(alpha=12e-6, beta=1 / 8e9, gamma=1 / 6e9),
    "tcp": Costs(alpha=40e-6, beta=1 / 4e9, gamma=1 / 6e9),
    "loopback": Costs(alpha=8e-6, beta=1 / 8e9, gamma=1 / 6e9),
}

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
           uneven: bool = False, direct: bool = False) -> list[tuple[float, AlgorithmInfo]]:
    """Every eligible algorithm with its modelled time, cheapest first (ties: registration order)."""
    candidates = eligible(collective, ordered=ordered, uneven=uneven, direct=direct)
    timed = [(info.cost(costs, nbytes, size), index, info) for index, info in enumerate(candidates)]
    return [(seconds, info) for seconds, _, info in sorted(timed, key=lambda item: item[:2])]


def choose(collective: str, nbytes: int, size: int, costs: Costs, *, ordered: bool = False,
           uneven: bool = False, direct: bool = False) -> AlgorithmInfo:
    """The cheapest eligible algorithm for this call.

    Args:
        collective: e.g. "all_reduce".
        nbytes: bytes of one rank's input.
        size: ranks in the communicator.
        costs: the link model (see COSTS).
        ordered: the reduce op is not commutative.
        uneven: ranks' counts differ.
        direct: shared-memory direct algorithms may run.

    Raises:
        ValueError: no algorithm is eligible.
    """
    options = ranked(collective, nbytes, size, costs, ordered=ordered, uneven=uneven, direct=direct)
    if not options:
        raise ValueError(f"no {collective} algorithm supports this call (ordered={ordered}, uneven={uneven})")
    return options[0][1]


def explain(collective: str, nbytes: int | str, size: int, transport: str = "shm", *, ordered: bool = False,
            uneven: bool = False, blocking: bool = True, hosts: int = 1) -> str:
    """A table of each eligible algorithm's modelled time, messages and bytes, the choice, and why.

    Args:
        collective: e.g. "all_reduce".
        nbytes: bytes of one rank's input (an int, or text such as "64MiB" or "1G").
        size: ranks in the communicator.
        transport: whose costs to use: "shm", "tcp" or "loopback".
        ordered: the reduce op is not commutative.
        uneven: ranks' counts differ.
        blocking: a blocking call (async_op=False): on one host ("shm") the
            shared-memory direct algorithms compete too.
        hosts: hosts the ranks span; above 1 the ranks talk over tcp and the
            direct algorithms cannot run.

    Returns:
        Text: a header, one line per algorithm (the chosen one marked with "*"; messages
        and bytes are those of the rank that sends most, "-" for the direct ones, which
        send no messages), and a line saying why.
    """
    nbytes = parse_size(nbytes)
    if hosts > 1:
        transport = "tcp"
    costs = COSTS[transport]
    direct = blocking and hosts == 1 and transport in ("shm", "loopback")
    options = ranked(collective, nbytes, size, costs, ordered=ordered, uneven=uneven, direct=direct)
    return describe_choice(collective, nbytes, size, transport, costs, options, hosts)
