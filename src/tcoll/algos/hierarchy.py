"""Hierarchical collectives: steps inside each host (shared memory) and between hosts (the network).

A job over several hosts has two kinds of link: ranks of one host talk through
shared memory, ranks of different hosts through the network, which is slower
per message and per byte. These algorithms move as little as possible over
the network, in three steps on sub-Teams (each step on its own phase):

=================================  ==========================================================
all_reduce "hierarchical"          reduce to each host's leader; all_reduce among the leaders;
                                   broadcast inside each host
all_reduce "hierarchical_sliced"   reduce_scatter inside each host, so local rank i owns slice
                                   i; all_reduce of slice i among the ranks with local index i
                                   of every host (every rank uses the network, each for 1/L of
                                   the data); all_gather inside each host
all_gather "hierarchical"          gather to each host's leader; all_gather among the leaders;
                                   broadcast inside each host
reduce_scatter "hierarchical"      reduce to each host's leader; reduce_scatter among the
                                   leaders (a block per host); scatter inside each host
broadcast "hierarchical"           broadcast among one rank per host (the root on its own
                                   host); broadcast inside each host
=================================  ==========================================================

A host's leader is its lowest rank. Each step runs the cheapest flat
algorithm for its link and size (`select.best_flat`), the same choice on
every rank of the step. The cost model (`Topology`) prices each step on its
own link; `tcoll.explain(..., hosts=H, ranks_per_host=L)` prints the steps.
On one host they run as the flat step inside it. They combine operands out of
rank order, so they serve commutative ops only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ops import Op
from ..p2p.engine import Engine
from . import select
from .registry import Costs, Topology, algorithm
from .team import Algorithm, Team
from .topology import displacements, split_counts

__all__ = ["topology_of", "world_topology", "all_reduce_hierarchical", "all_reduce_sliced", "all_gather_hierarchical",
           "reduce_scatter_hierarchical", "broadcast_hierarchical"]

Step = tuple[str, str, str, int, int]  # (what, collective, link "intra"/"inter"/"inter, shared", nbytes, ranks)


def topology_of(hosts_count: int, per_host: int, link_latency: float = 0.0, link: str = "tcp") -> Topology | None:
    """The cost model's view of a job over `hosts_count` hosts (None for one host).

    Args:
        per_host: the most ranks on one host.
        link_latency: seconds one message takes between hosts, as measured when the job connected
            (agreed by every rank); the model's latency of the link is a floor.
        link: the transport between hosts ("tcp" or "mpi").
    """
    if hosts_count < 2:
        return None
    inter = select.COSTS[link if link in select.COSTS else "tcp"]
    if link_latency > inter.alpha:
        inter = dataclasses.replace(inter, alpha=link_latency)
    return Topology(hosts_count, per_host, select.COSTS["shm"], inter)


def world_topology(engine: Engine, world: list[int]) -> Topology | None:
    """The cost model's view of the communicator of world ranks `world` (None: all on one host).

    Every rank finds the same: the host map and the latency were agreed at connect, and one
    transport carries every pair of hosts.
    """
    hosts = engine.hosts.restrict(world)
    if hosts.count < 2:
        return None
    mine = hosts.host_of[world.index(engine.rank)]
    other = next(w for i, w in enumerate(world) if hosts.host_of[i] != mine)
    per_host = max(len(hosts.members(h)) for h in range(hosts.count))
    return topology_of(hosts.count, per_host, engine.link_latency, engine.transport_of(other))


def _plan_cost(steps: Callable[[Topology, int], list[Step]]) -> Callable[[Topology, int], float]:
    """A cost function summing the steps' cheapest flat algorithms; its `.plan` lists them for explain."""

    def plan(topology: Topology, nbytes: int) -> list[tuple[str, float]]:
        rows = []
        for number, (what, collective, link, size_bytes, ranks) in enumerate(steps(topology, nbytes), 1):
            costs = topology.intra if link == "intra" else topology.inter
            if link == "inter, shared":  # every local rank uses the host's link at once: 1/per_host each
                costs = Costs(costs.alpha, costs.beta * topology.per_host, costs.gamma)
            seconds, info = select.best_flat(collective, costs, size_bytes, ranks) if ranks > 1 else (0.0, None)
            how = f"{info.name}, {ranks} ranks, {size_bytes} B" if info else "nothing to do"
            rows.append((f"{number}. {what} ({link}: {how})", seconds))
        return rows

    def cost(topology: Topology, nbytes: int) -> float:
        return sum(seconds for _, seconds in plan(topology, nbytes))

    cost.plan = plan  # type: ignore[attr-defined]
    return cost


def _run(collective: str, link: Costs, team: Team, nbytes: int, *args: Any) -> Algorithm:
    """Run the cheapest flat `collective` for this link and size on `team` (a no-op for one rank)."""
    if team.size > 1:
        yield from select.best_flat(collective, link, nbytes, team.size)[1].run(team, *args)


class _Layout:
    """Where this rank stands among the hosts of its Team (Team rank numbering)."""

    def __init__(self, team: Team) -> None:
        hosts = team.hosts()
        self.count = hosts.count
        self.members = [hosts.members(h) for h in range(hosts.count)]
        self.host_of = hosts.host_of
        self.local = hosts.local_ranks(team.rank)
        self.leaders = [members[0] for members in self.members]
        self.order = [rank for members in self.members for rank in members]  # host-major
        self.contiguous = self.order == list(range(team.size))
        self.topology = world_topology(team._engine, team._world)
        self.intra = select.COSTS["shm"]
        self.inter = self.topology.inter if self.topology else select.COSTS["tcp"]


# -- all_reduce ---------------------------------------------------------------------------------


def _leader_steps(t: Topology, n: int) -> list[Step]:
    return [("reduce inside each host", "reduce", "intra", n, t.per_host),
            ("all_reduce among the hosts' leaders", "all_reduce", "inter", n, t.hosts),
            ("broadcast inside each host", "broadcast", "intra", n, t.per_host)]


@algorithm("all_reduce", "hierarchical", cost=_plan_cost(_leader_steps), ordered=False, hierarchical=True)
def all_reduce_hierarchical(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Hierarchical: reduce in each host, all_reduce among host leaders, broadcast in each host.

    Steps: a reduce to local rank 0 over shared memory; the cheapest all_reduce among the H
    leaders over the network; a broadcast from each leader. Wire: only the leaders use the
    network, each sending what one rank of a flat H-rank all_reduce sends.
    Source: the two-level scheme of MPICH's SMP-aware collectives (MPIR_Allreduce_intra_smp).
    """
    lay = _Layout(team)
    n = buf.nbytes
    yield from _run("reduce", lay.intra, team.sub(lay.local, 0), n, buf, op, 0)
    if team.rank == lay.local[0]:
        yield from _run("all_reduce", lay.inter, team.sub(lay.leaders, 2), n, buf, op)
    yield from _run("broadcast", lay.intra, team.sub(lay.local, 4), n, buf, 0)


def _sliced_steps(t: Topology, n: int) -> list[Step]:
    share = n // t.per_host
    return [("reduce_scatter inside each host: local rank i owns slice i", "reduce_scatter", "intra", n, t.per_host),
            ("all_reduce of slice i among local ranks i of every host", "all_reduce", "inter, shared", share,
             t.hosts),
            ("all_gather of the slices inside each host", "all_gather", "intra", share, t.per_host)]


@algorithm("all_reduce", "hierarchical_sliced", cost=_plan_cost(_sliced_steps), ordered=False, hierarchical=True)
def all_reduce_sliced(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Hierarchical, every local rank owning a slice: reduce_scatter, all_reduce between hosts, all_gather.

    Steps: a reduce_scatter inside each host (local rank i gets slice i of L); L concurrent
    all_reduces between hosts, one per slice, among the ranks with local index i; an
    all_gather of the slices inside each host. Wire: every rank sends 1/L of the network
    traffic of the leader form. Needs equal ranks per host; else it runs "hierarchical".
    Source: NCCL's and Horovod's hierarchical all-reduce (2D ring).
    """
    lay = _Layout(team)
    width = len(lay.local)
    if width == 1 or any(len(members) != width for members in lay.members):
        yield from all_reduce_hierarchical(team, buf, op)  # hosts of unequal sizes: no slice pairing
        return
    index = lay.local.index(team.rank)
    counts = split_counts(buf.size, width)
    lo, hi = displacements(counts)[index:index + 2]
    part = np.empty(hi - lo, dtype=buf.dtype)
    yield from _run("reduce_scatter", lay.intra, team.sub(lay.local, 0), buf.nbytes, buf, part, counts, op)
    peers = [members[index] for members in lay.members]
    yield from _run("all_reduce", lay.inter, team.sub(peers, 2), part.nbytes, part, op)
    buf[lo:hi] = part
    yield from _run("all_gather", lay.intra, team.sub(lay.local, 4), part.nbytes, buf, counts)


# -- all_gather ---------------------------------------------------------------------------------


def _gather_steps(t: Topology, n: int) -> list[Step]:
    return [("gather each host's blocks to its leader", "gather", "intra", n, t.per_host),
            ("all_gather of the hosts' blocks among the leaders", "all_gather", "inter", n * t.per_host, t.hosts),
            ("broadcast of the whole result inside each host", "broadcast", "intra", n * t.per_host * t.hosts,
             t.per_host)]


@algorithm("all_gather", "hierarchical", cost=_plan_cost(_gather_steps), hierarchical=True)
def all_gather_hierarchical(team: Team, out: np.ndarray, counts: list[int]) -> Algorithm:
    """Hierarchical: gather to each host's leader, all_gather among leaders, broadcast in each host.

    Steps: a gather of the host's blocks to local rank 0; an all_gather of the hosts' blocks
    among the leaders (uneven: hosts may hold different numbers of ranks); a broadcast of the
    whole result inside each host. Ranks not numbered host by host are put back in rank order.
    Wire: only the leaders use the network.
    """
    lay = _Layout(team)
    displ = displacements(counts)
    local_counts = [counts[r] for r in lay.local]
    leader = team.rank == lay.local[0]
    own = out[displ[team.rank]:displ[team.rank + 1]]
    if lay.contiguous:
        host_buf = out[displ[lay.local[0]]:displ[lay.local[-1] + 1]]
    else:
        host_buf = np.empty(sum(local_counts), dtype=out.dtype)
        at = displacements(local_counts)[lay.local.index(team.rank)]
        host_buf[at:at + own.size] = own
    item = out.itemsize
    yield from _run("gather", lay.intra, team.sub(lay.local, 0), max(local_counts) * item, own,
                    host_buf if leader else None, local_counts, 0)
    if leader and lay.count > 1:
        totals = [sum(counts[r] for r in members) for members in lay.members]
        whole = out if lay.contiguous else np.empty(out.size, dtype=out.dtype)
        mine = displacements(totals)[lay.host_of[team.rank]]
        whole[mine:mine + host_buf.size] = host_buf
        yield from _run("all_gather", lay.inter, team.sub(lay.leaders, 2), max(totals) * item, whole, totals)
        if not lay.contiguous:
            at = 0
            for rank in lay.order:  # host-major back to rank order
                out[displ[rank]:displ[rank + 1]] = whole[at:at + counts[rank]]
                at += counts[rank]
    elif leader and not lay.contiguous:
        out[:] = host_buf  # one host: its ranks are all the ranks
    yield from _run("broadcast", lay.intra, team.sub(lay.local, 4), out.nbytes, out, 0)


# -- reduce_scatter -----------------------------------------------------------------------------


def _scatter_steps(t: Topology, n: int) -> list[Step]:
    block = n // max(1, t.hosts * t.per_host)
    return [("reduce the whole input to each host's leader", "reduce", "intra", n, t.per_host),
            ("reduce_scatter among the leaders, a block per host", "reduce_scatter", "inter", n, t.hosts),
            ("scatter each host's blocks inside it", "scatter", "intra", block, t.per_host)]


@algorithm("reduce_scatter", "hierarchical", cost=_plan_cost(_scatter_steps), ordered=False, hierarchical=True)
def reduce_scatter_hierarchical(team: Team, send: np.ndarray, out: np.ndarray, counts: list[int],
                                op: Op) -> Algorithm:
    """Hierarchical: reduce to each host's leader, reduce_scatter among leaders, scatter in each host.

    Steps: a reduce of the whole input to local rank 0; a reduce_scatter among the leaders
    that leaves each leader its host's blocks; a scatter of them inside the host.
    Wire: only the leaders use the network, each for the whole vector once.
    """
    lay = _Layout(team)
    displ = displacements(counts)
    local_counts = [counts[r] for r in lay.local]
    leader = team.rank == lay.local[0]
    work = send.copy()
    yield from _run("reduce", lay.intra, team.sub(lay.local, 0), work.nbytes, work, op, 0)
    host_part = None
    if leader:
        if not lay.contiguous:  # lay the blocks out host by host
            work = np.concatenate([work[displ[r]:displ[r + 1]] for r in lay.order])
        totals = [sum(counts[r] for r in members) for members in lay.members]
        if lay.count > 1:
            host_part = np.empty(totals[lay.host_of[team.rank]], dtype=send.dtype)
            yield from _run("reduce_scatter", lay.inter, team.sub(lay.leaders, 2), work.nbytes, work, host_part,
                            totals, op)
        else:
            host_part = work
        out[:] = host_part[:out.size]  # the leader's own block comes first on its host
    yield from _run("scatter", lay.intra, team.sub(lay.local, 4), max(local_counts) * send.itemsize, host_part, out,
                    local_counts, 0)


# -- broadcast ----------------------------------------------------------------------------------


def _broadcast_steps(t: Topology, n: int) -> list[Step]:
    return [("broadcast among one rank per host", "broadcast", "inter", n, t.hosts),
            ("broadcast inside each host", "broadcast", "intra", n, t.per_host)]


@algorithm("broadcast", "hierarchical", cost=_plan_cost(_broadcast_steps), hierarchical=True)
def broadcast_hierarchical(team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Hierarchical: broadcast among one rank per host (the root on its own), then inside each host.

    Steps: the cheapest broadcast among one rank per host (the root for its host, the leader
    for the others) over the network; then a broadcast inside each host from that rank.
    Wire: each host receives the data once.
    """
    lay = _Layout(team)
    root_host = lay.host_of[root]
    heads = [root if host == root_host else members[0] for host, members in enumerate(lay.members)]
    if team.rank in heads:
        yield from _run("broadcast", lay.inter, team.sub(heads, 0), buf.nbytes, buf, root_host)
    head = heads[lay.host_of[team.rank]]
    yield from _run("broadcast", lay.intra, team.sub(lay.local, 2), buf.nbytes, buf, lay.local.index(head))
