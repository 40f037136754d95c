"""barrier algorithms: dissemination, binomial tree (gather then release)."""

from __future__ import annotations

import math

import numpy as np

from .registry import Costs, algorithm
from .team import Algorithm, Team
from .topology import binomial_children, binomial_parent

_TOKEN = np.empty(0, dtype=np.uint8)  # barrier messages carry no data, only their arrival


def _dissemination_cost(c: Costs, nbytes: int, size: int) -> float:
    return math.ceil(math.log2(size)) * c.alpha if size > 1 else 0.0


@algorithm("barrier", "dissemination", cost=_dissemination_cost)
def dissemination(team: Team) -> Algorithm:
    """Dissemination barrier: in round k, signal rank+2**k and wait for rank-2**k.

    Steps: ceil(log2 p) rounds; after round k every rank has heard,
    directly or through others, from the 2**(k+1) ranks before it, so after
    the last round from all of them. Works for any p (no folding). Wire:
    ceil(log2 p) empty messages per rank. Source: Hensgen, Finkel, Manber,
    "Two algorithms for barrier synchronization" (IJPP 1988); the MPICH barrier.
    """
    rank, size = team.rank, team.size
    distance = 1
    while distance < size:
        yield [team.send(_TOKEN, (rank + distance) % size),
               team.recv(np.empty(0, dtype=np.uint8), (rank - distance) % size)]
        distance <<= 1


def _tree_cost(c: Costs, nbytes: int, size: int) -> float:
    return 2 * math.ceil(math.log2(size)) * c.alpha if size > 1 else 0.0


@algorithm("barrier", "tree", cost=_tree_cost)
def tree(team: Team) -> Algorithm:
    """Binomial tree barrier: gather empty tokens up to rank 0, then release them down.

    Steps: each rank waits for a token from each of its children in the
    binomial tree rooted at 0, then sends one to its parent; rank 0, having
    heard from everyone, sends the release down the same tree. Wire: 2(p-1)
    empty messages in all, 2 ceil(log2 p) message latencies. Source: the
    classic combining-tree barrier (Mellor-Crummey, Scott, "Algorithms for
    scalable synchronization on shared-memory multiprocessors", TOCS 1991).
    """
    rank, size = team.rank, team.size
    children = binomial_children(rank, size)
    parent = binomial_parent(rank)
    if children:
        yield [team.recv(np.empty(0, dtype=np.uint8), child, sub=0) for child in children]
    if parent >= 0:
        yield [team.send(_TOKEN, parent, sub=0), team.recv(np.empty(0, dtype=np.uint8), parent, sub=1)]
    if children:
        yield [team.send(_TOKEN, child, sub=1) for child in children]
