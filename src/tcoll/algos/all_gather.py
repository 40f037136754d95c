"""all_gather algorithms: pipelined ring, recursive doubling (folded for non-powers of two), Bruck.

Every algorithm fills `out` (blocks of `counts` laid end to end in rank
order, this rank's own block already in place) with every rank's block.
Blocks may differ in size, and may be empty: an empty range is never sent,
and both ends of a message always agree on that, since every rank knows
`counts`.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import Costs, algorithm
from .steps import ring_pass
from .team import Algorithm, Team
from .topology import displacements, fold_role, pof2_below

__all__ = ["ring", "recursive_doubling", "bruck"]


def _ring_cost(c: Costs, nbytes: int, size: int) -> float:
    return (size - 1) * (c.alpha + nbytes * c.beta)


@algorithm("all_gather", "ring", cost=_ring_cost)
def ring(team: Team, out: np.ndarray, counts: list[int]) -> Algorithm:
    """Ring: p-1 steps, each rank passing on to its right the block it received last.

    Steps: p-1; in step s rank r sends block r-s to r+1 and receives block
    r-s-1 from r-1, in chunks of team.chunk_count elements, each chunk
    forwarded as soon as it arrives. Wire: each rank sends and receives
    sum(counts) - counts[own] elements (every other block once).
    Source: MPICH ring all-gather (Thakur, Rabenseifner, Gropp 2005).
    """
    yield from ring_pass(team, out, displacements(counts), list(range(team.size)), team.rank)


def _recursive_doubling_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    pof2 = pof2_below(size)
    time = math.log2(pof2) * c.alpha + (pof2 - 1) / pof2 * size * nbytes * c.beta
    if pof2 != size:  # fold: the extra ranks hand in their block, and get all blocks back
        time += 2 * c.alpha + (1 + size) * nbytes * c.beta
    return time


@algorithm("all_gather", "recursive_doubling", cost=_recursive_doubling_cost)
def recursive_doubling(team: Team, out: np.ndarray, counts: list[int]) -> Algorithm:
    """Recursive doubling: log2 p steps exchanging contiguous ranges of blocks that double each step.

    Steps: with pof2 the largest power of two <= p, the first 2*(p - pof2)
    ranks pair up (even with odd, see topology.fold_role) and the odd one
    hands its block to the even one, so the pof2 active ranks each hold a
    contiguous range of blocks. In step k active rank i swaps everything it
    holds with active rank i ^ 2**k: the two ranges are adjacent, so each
    side then holds their union. Finally each even rank sends the whole
    result to its odd partner. Wire: log2(pof2) messages of growing size
    per active rank, p-1 blocks received; folding adds one block in and
    the whole vector out. Source: MPICH recursive-doubling all-gather,
    with the fold of its reduce algorithms (Thakur, Rabenseifner, Gropp 2005).
    """
    size, rank = team.size, team.rank
    if size == 1:
        return
    displs = displacements(counts)
    role = fold_role(rank, size)
    if not role.active:  # the odd one of a pair: hand in my block, get all blocks back
        if counts[rank]:
            yield team.send(out[displs[rank]:displs[rank + 1]], role.partner)
        if displs[size]:
            yield team.recv(out, role.partner)
        return
    if role.partner >= 0 and counts[role.partner]:
        yield team.recv(out[displs[role.partner]:displs[role.partner + 1]], role.partner)

    def span(first: int, n: int) -> np.ndarray:  # the blocks of active ranks first .. first + n - 1
        last = first + n
        hi = displs[role.old_rank(last)] if last < role.pof2 else displs[size]
        return out[displs[role.old_rank(first)]:hi]

    mask = 1
    while mask < role.pof2:
        peer = role.newrank ^ mask
        mine, theirs = span(role.newrank & ~(mask - 1), mask), span(peer & ~(mask - 1), mask)
        works = []
        if theirs.size:
            works.append(team.recv(theirs, role.old_rank(peer)))
        if mine.size:
            works.append(team.send(mine, role.old_rank(peer)))
        if works:
            yield works
        mask <<= 1
    if role.partner >= 0 and displs[size]:
        yield team.send(out, role.partner)


def _bruck_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return math.ceil(math.log2(size)) * c.alpha + (size - 1) * nbytes * c.beta + size * nbytes * c.gamma


@algorithm("all_gather", "bruck", cost=_bruck_cost)
def bruck(team: Team, out: np.ndarray, counts: list[int]) -> Algorithm:
    """Bruck: ceil(log2 p) steps for any p, into a rotated scratch buffer, then one local rotation.

    Steps: scratch position j holds the block of rank (r + j) mod p, so it is
    out rotated left by displs[r] elements, and position 0 (own block) is
    filled first. In step k (d = 2**k) rank r sends positions [0, m) to rank
    r - d and receives positions [d, d + m) from rank r + d, m = min(d, p - d):
    the sender's positions 0.. are blocks r+d.., exactly those. Finally the
    scratch is rotated back into out. Wire: p-1 blocks received per rank,
    in ceil(log2 p) messages. Source: Bruck, Ho, Kipnis, Upfal, Weathersby,
    "Efficient algorithms for all-to-all communications in multiport
    message-passing systems", IEEE TPDS 1997; MPICH all-gather for non-powers of two.
    """
    size, rank = team.size, team.rank
    if size == 1:
        return
    displs = displacements(counts)
    total, start = displs[size], displs[rank]
    rotated = [counts[(rank + j) % size] for j in range(size)]
    rdispls = displacements(rotated)  # offsets of the positions in scratch
    scratch = np.empty(total, dtype=out.dtype)
    scratch[:counts[rank]] = out[start:start + counts[rank]]
    dist = 1
    while dist < size:
        m = min(dist, size - dist)
        works = []
        incoming = scratch[rdispls[dist]:rdispls[dist + m]]
        if incoming.size:
            works.append(team.recv(incoming, (rank + dist) % size))
        outgoing = scratch[:rdispls[m]]  # blocks r .. r + m - 1: what rank r - d expects from me
        if outgoing.size:
            works.append(team.send(outgoing, (rank - dist) % size))
        if works:
            yield works
        dist <<= 1
    out[start:] = scratch[:total - start]
    out[:start] = scratch[total - start:]
