"""broadcast algorithms: binomial tree, scatter + ring all-gather (van de Geijn), pipelined chain."""

from __future__ import annotations

import math

import numpy as np

from .registry import Costs, algorithm
from .steps import ring_pass, tree_broadcast
from .team import Algorithm, Team
from .topology import (binomial_children, binomial_parent, binomial_subtree_size, displacements, from_vrank,
                       split_counts, to_vrank)

__all__ = ["binomial", "scatter_allgather", "chain"]

DEFAULT_CHUNK = 1 << 20  # bytes per chain message the cost model assumes (the coll_chunk default)


def _binomial_cost(c: Costs, nbytes: int, size: int) -> float:
    return math.ceil(math.log2(size)) * (c.alpha + nbytes * c.beta) if size > 1 else 0.0


@algorithm("broadcast", "binomial", cost=_binomial_cost)
def binomial(team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Binomial tree: each rank receives once from its parent, then sends to its children.

    Steps: ceil(log2 p) rounds; in round k the 2**k ranks that hold the data
    send it to the rank 2**k away (counted from the root). Wire: every rank
    but the root receives n bytes once; p-1 messages of n bytes in all.
    Source: the MPICH binomial broadcast (Thakur, Rabenseifner, Gropp 2005).
    """
    yield from tree_broadcast(team, buf, root)


def _scatter_allgather_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return (math.ceil(math.log2(size)) + size - 1) * c.alpha + 2 * (size - 1) / size * nbytes * c.beta


@algorithm("broadcast", "scatter_allgather", cost=_scatter_allgather_cost)
def scatter_allgather(team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Van de Geijn: binomial scatter of the root's buffer in p blocks, then a ring all-gather.

    Steps: buf is cut into p near-equal blocks (split_counts; some are empty
    when it has fewer than p elements), block j belonging to vrank j. Each
    rank receives from its binomial parent the blocks of its whole subtree
    (a contiguous range) and hands each child the child's subtree range;
    then the ranks, in vrank order around a ring, all-gather the blocks
    (pipelined in chunks, see all_gather.ring_pass). Wire: about n*(p-1)/p
    bytes received per rank in each phase, 2n in all, in ceil(log2 p) + p - 1
    steps. Source: Barnett, Shuler, van de Geijn, Gupta, Payne, Watts,
    "Interprocessor collective communication library (InterCom)", 1994;
    MPICH long-message broadcast (Thakur, Rabenseifner, Gropp 2005).
    """
    size = team.size
    if size == 1:
        return
    vrank = to_vrank(team.rank, root, size)
    displs = displacements(split_counts(buf.size, size))

    def subtree(v: int) -> np.ndarray:  # the blocks of v's binomial subtree
        return buf[displs[v]:displs[v + binomial_subtree_size(v, size)]]

    parent = binomial_parent(vrank)
    if parent >= 0 and subtree(vrank).size:
        yield team.recv(subtree(vrank), from_vrank(parent, root, size))
    sends = [team.send(subtree(child), from_vrank(child, root, size))
             for child in binomial_children(vrank, size) if subtree(child).size]
    if sends:
        yield sends  # the ring below writes into these ranges: let the sends finish first
    ring = [from_vrank(v, root, size) for v in range(size)]
    # own stream: safe inside a composite's phase; the root (position 0) has it all and only sends
    yield from ring_pass(team, buf, displs, ring, vrank, sub=1, complete_at=0)


def _chain_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    chunks = max(1, math.ceil(nbytes / DEFAULT_CHUNK))
    return (size - 2 + chunks) * (c.alpha + nbytes / chunks * c.beta)


@algorithm("broadcast", "chain", cost=_chain_cost)
def chain(team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Pipelined chain: root -> root+1 -> ... -> root-1, in chunks; each rank forwards one while receiving the next.

    Steps: buf is cut into chunks of team.chunk_count elements; every rank
    but the root posts all its receives at once, and forwards chunk k to the
    next rank as soon as it has arrived, while chunk k+1 is arriving. Wire:
    every rank but the last sends n bytes, in m chunks; the data reaches the
    end after p - 2 + m chunk times. Source: the pipelined chain broadcast of
    Open MPI's tuned component (coll_base_bcast.c, "chain" with one chain).
    """
    size = team.size
    if size == 1 or buf.size == 0:
        return
    vrank = to_vrank(team.rank, root, size)
    chunk = team.chunk_count(buf.itemsize)
    pieces = [buf[a:a + chunk] for a in range(0, buf.size, chunk)]
    recvs = [team.recv(piece, from_vrank(vrank - 1, root, size)) for piece in pieces] if vrank else []
    if vrank == size - 1:
        yield recvs
        return
    following = from_vrank(vrank + 1, root, size)
    sends = []
    for k, piece in enumerate(pieces):
        if recvs:
            yield recvs[k]
        sends.append(team.send(piece, following))
    yield sends
