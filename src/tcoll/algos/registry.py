"""The registry of collective algorithms, and the contract each collective's algorithms follow.

Two families register here. *Team* algorithms (tcoll.algos) are generator
functions over point-to-point requests (see `tcoll.algos.team`) and take the
call's `Team` first. *Direct* algorithms (`direct=True`, tcoll.shm) run to
completion in the calling thread through an `Arena`, memory every rank of a
one-host communicator maps, which they take first instead; they serve
blocking calls only. The dispatcher (tcoll.comm.dispatch) imports both
families, which registers them, and is the only code that tells them apart.

Buffers are flat, contiguous, typed NumPy arrays; `counts[r]` is the number
of elements of rank r's block and blocks lie end to end in rank order
(`topology.displacements`). The signature per collective, after the team or
arena:

    all_reduce(buf, op)                        buf reduced in place on every rank
    reduce(buf, op, root)                      result in buf on root; others' buf unchanged
    broadcast(buf, root)                       root's buf copied into everyone's
    all_gather(out, counts)                    own block of out already filled; fill the rest
                                               (direct: own block not filled, passed as `source`)
    gather(send, out, counts, root)            out is None except on root, whose own block is filled
    scatter(send, out, counts, root)           send is None except on root; root's out is filled
    reduce_scatter(send, out, counts, op)      send is read-only; out gets this rank's reduced block
    all_to_all(send, out, send_counts, recv_counts)  own block already copied
    barrier()
    scan(buf, op)                              buf := op over ranks 0..rank, in place (rank order)
    exscan(buf, op)                            buf := op over ranks 0..rank-1; rank 0's buf unchanged
    all_to_allv(header, blocks, arrived)       direct only: the counts travel with the data; arrived(table
                                               of every rank's header) places the output and returns
                                               (out bytes, bytes from each rank, widest block in bytes)

Algorithms with `ordered=False` combine operands out of rank order and run
only commutative ops; `uneven=False` ones need equal counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["AlgorithmInfo", "Costs", "Topology", "algorithm", "REGISTRY", "COLLECTIVES", "lookup", "names"]

COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
               "reduce_scatter", "all_to_all", "barrier", "scan", "exscan", "all_to_allv", "scatter_described")


@dataclasses.dataclass(frozen=True)
class Costs:
    """The alpha-beta-gamma model of a link: time = alpha + bytes*beta (+ bytes*gamma to reduce).

    Attributes:
        alpha: seconds per message (latency, including Python overhead).
        beta: seconds per byte moved.
        gamma: seconds per byte reduced.
    """

    alpha: float
    beta: float
    gamma: float


@dataclasses.dataclass(frozen=True)
class Topology:
    """A job over several hosts, as the cost model sees it: two kinds of link.

    Attributes:
        hosts: the number of hosts.
        per_host: ranks on each host (the most on any one).
        intra: the link between ranks of one host (shared memory).
        inter: the link between hosts (the network).
    """

    hosts: int
    per_host: int
    intra: Costs
    inter: Costs


CostFn = Callable[..., float]  # (costs, nbytes, size) -> seconds; hierarchical: (topology, nbytes) -> seconds


@dataclasses.dataclass(frozen=True)
class AlgorithmInfo:
    """One registered algorithm.

    Attributes:
        collective: which collective it implements.
        name: the name `algorithm=` accepts.
        run: the generator function.
        cost: its modelled time, cost(costs, nbytes, size), nbytes being the
            size of one rank's input (the whole vector for all_reduce).
        ordered: safe for non-commutative ops (combines operands in rank order).
        uneven: works when ranks' counts differ.
        summary: one line for `tcoll.explain` and the docs.
        direct: runs through a shared-memory arena, not a Team (see the module docstring).
        hierarchical: composed of collectives inside hosts and between them (tcoll.algos.hierarchy);
            its cost is cost(topology, nbytes), and it competes only across several hosts.
    """

    collective: str
    name: str
    run: Callable[..., Any]
    cost: CostFn
    ordered: bool
    uneven: bool
    summary: str
    direct: bool = False
    hierarchical: bool = False


REGISTRY: dict[str, dict[str, AlgorithmInfo]] = {name: {} for name in COLLECTIVES}


def algorithm(collective: str, name: str, *, cost: CostFn, ordered: bool = True, uneven: bool = True,
              direct: bool = False, hierarchical: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as `name` for `collective` (a generator unless `direct`)."""
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in REGISTRY[collective]:
            raise ValueError(f"{collective} algorithm {name!r} registered twice")
        summary = (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else name
        REGISTRY[collective][name] = AlgorithmInfo(collective, name, fn, cost, ordered, uneven, summary, direct,
                                                       hierarchical)
        return fn

    return register


def names(collective: str) -> list[str]:
    """The algorithm names of `collective`, in registration order.

    Raises:
        ValueError: an unknown collective.
    """
    if collective not in REGISTRY:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    return list(REGISTRY[collective])


def lookup(collective: str, name: str) -> AlgorithmInfo:
    """The algorithm `name` of `collective`.

    Raises:
        ValueError: no such algorithm (the message lists the valid names).
    """
    found = REGISTRY[collective].get(name)
    if found is None:
        raise ValueError(f"unknown {collective} algorithm {name!r}; "
                         f"choose 'auto' or one of {', '.join(names(collective))}")
    return found
