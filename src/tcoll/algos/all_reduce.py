"""all_reduce algorithms: naive, ring, recursive doubling, Rabenseifner, binomial reduce + broadcast.

Every algorithm reduces `buf` in place on every rank; those registered
ordered=True combine contributions in rank order (lower ranks on the left).
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import Op
from .registry import Costs, algorithm
from .steps import (doubling_all_gather, exchange, fold_in, fold_out, halving, ring_reduce_scatter, tree_broadcast,
                    tree_reduce)
from .team import Algorithm, Team
from .topology import displacements, fold_role, pof2_below, ring_neighbours, split_counts

__all__ = ["binomial", "naive", "rabenseifner", "recursive_doubling", "ring"]


def _lg(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


def _fold_extra(c: Costs, nbytes: int, size: int) -> float:
    """The cost of folding a non-power of two in and out: two messages of n bytes and one combine."""
    return 0.0 if size == pof2_below(size) else 2 * (c.alpha + nbytes * c.beta) + nbytes * c.gamma


# -- naive ------------------------------------------------------------------------------------


def _naive_cost(c: Costs, nbytes: int, size: int) -> float:
    return (size - 1) * (2 * (c.alpha + nbytes * c.beta) + nbytes * c.gamma)


@algorithm("all_reduce", "naive", cost=_naive_cost)
def naive(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Naive: every rank sends its data to rank 0, which combines in rank order and sends the result back.

    Steps: rank 0 posts a receive from every other rank into its own scratch
    block, then combines them in rank order (1, 2, ..., p-1) into buf as they
    are needed, and sends buf to everyone. Wire: rank 0 receives and sends
    (p-1)n bytes; every other rank sends and receives n.
    Source: the textbook reduce-then-broadcast (the seed's naive_all_reduce).
    """
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    if r != 0:
        yield team.send(buf, 0)
        yield team.recv(buf, 0, 1)
        return
    scratch = np.empty((p - 1, buf.size), dtype=buf.dtype)
    recvs = [team.recv(scratch[peer - 1], peer) for peer in range(1, p)]
    for peer in range(1, p):
        yield recvs[peer - 1]
        op.combine(buf, scratch[peer - 1], buf)
    yield [team.send(buf, peer, 1) for peer in range(1, p)]


# -- ring -------------------------------------------------------------------------------------


def _ring_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return 2 * (size - 1) * c.alpha + (size - 1) / size * nbytes * (2 * c.beta + c.gamma)


@algorithm("all_reduce", "ring", cost=_ring_cost, ordered=False)
def ring(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Ring: a ring reduce-scatter, then a ring all-gather, both pipelined in chunks.

    Steps: buf is cut into p near-equal blocks (split_counts; some empty when
    it has fewer than p elements). p-1 reduce-scatter steps leave block r
    fully reduced on rank r (ring_reduce_scatter, in place); then in p-1
    all-gather steps rank r passes block (r-s) mod p to the right and
    receives block (r-s-1) mod p straight into buf, each chunk forwarded
    as soon as it arrives. Wire: 2n(p-1)/p bytes sent per rank, to the right
    neighbour only. Not in rank order (ordered=False).
    Source: Patarasuk and Yuan 2009; gloo's and NCCL's ring all-reduce.
    """
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    offs = displacements(split_counts(buf.size, p))
    yield from ring_reduce_scatter(team, buf, offs, op)
    gather = team.phase(1)
    left, right = ring_neighbours(r, p)
    step = team.chunk_count(buf.itemsize)

    def pieces(block: int) -> list[tuple[int, int]]:
        return [(lo, min(lo + step, offs[block + 1])) for lo in range(offs[block], offs[block + 1], step)]

    sends = [gather.send(buf[lo:hi], right) for lo, hi in pieces(r)]
    for s in range(p - 1):
        posted = [(gather.recv(buf[lo:hi], left), lo, hi) for lo, hi in pieces((r - s - 1) % p)]
        for work, lo, hi in posted:
            yield work
            if s < p - 2:
                sends.append(gather.send(buf[lo:hi], right))
    if sends:
        yield sends


# -- recursive doubling -----------------------------------------------------------------------


def _doubling_cost(c: Costs, nbytes: int, size: int) -> float:
    return _lg(pof2_below(size)) * (c.alpha + nbytes * (c.beta + c.gamma)) + _fold_extra(c, nbytes, size)


@algorithm("all_reduce", "recursive_doubling", cost=_doubling_cost)
def recursive_doubling(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Recursive doubling: log2 p rounds of swapping the whole vector with rank ^ 2**k.

    Steps: with p not a power of two, the odd rank of each of the first
    2*(p-pof2) pairs hands its data to the even one (fold_in) and waits for
    the result (fold_out). The pof2 active ranks swap buf with newrank ^ mask
    for mask = 1, 2, 4, ... and combine, the lower newrank's data on the
    left, so each partial result covers a contiguous group of ranks (rank
    order kept). Wire: n bytes per round, log2 pof2 rounds (+ 2 folding).
    Source: MPICH's recursive-doubling all-reduce (Thakur, Rabenseifner and
    Gropp 2005).
    """
    p = team.size
    if p == 1 or not buf.size:
        return
    role = fold_role(team.rank, p)
    tmp = np.empty_like(buf)
    yield from fold_in(team, role, buf, tmp, op)
    if role.active:
        mask = 1
        while mask < role.pof2:
            peer_new = role.newrank ^ mask
            yield exchange(team, buf, tmp, role.old_rank(peer_new))
            if peer_new < role.newrank:
                op.combine(tmp, buf, buf)
            else:
                op.combine(buf, tmp, buf)
            mask <<= 1
    yield from fold_out(team, role, buf)


# -- Rabenseifner -----------------------------------------------------------------------------


def _rabenseifner_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    pof2 = pof2_below(size)
    return (2 * _lg(pof2) * c.alpha + (pof2 - 1) / pof2 * nbytes * (2 * c.beta + c.gamma)
            + _fold_extra(c, nbytes, size))


@algorithm("all_reduce", "rabenseifner", cost=_rabenseifner_cost)
def rabenseifner(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather.

    Steps: fold a non-power of two onto pof2 ranks (fold_in); cut buf into
    pof2 near-equal blocks (any count); `halving` (masks rising, lower
    newrank's data on the left: rank order kept) leaves each active rank one
    fully reduced block; `doubling_all_gather` (masks falling) swaps ever
    larger ranges until every active rank has all of buf; fold_out hands the
    result to the folded ranks. Wire: 2n(pof2-1)/pof2 bytes per active rank
    in 2 log2 pof2 messages (+ 2n folding).
    Source: Rabenseifner, "Optimization of collective reduction operations",
    ICCS 2004; MPICH's reduce_scatter_allgather all-reduce.
    """
    p = team.size
    if p == 1 or not buf.size:
        return
    role = fold_role(team.rank, p)
    tmp = np.empty_like(buf)
    yield from fold_in(team, role, buf, tmp, op)
    if role.active:
        offs = displacements(split_counts(buf.size, role.pof2))
        lo, hi = yield from halving(team, buf, offs, op, role, tmp)
        yield from doubling_all_gather(team, buf, offs, role, lo, hi, sub=1)
    yield from fold_out(team, role, buf)


# -- binomial ---------------------------------------------------------------------------------


def _binomial_cost(c: Costs, nbytes: int, size: int) -> float:
    return _lg(size) * (2 * (c.alpha + nbytes * c.beta) + nbytes * c.gamma)


@algorithm("all_reduce", "binomial", cost=_binomial_cost)
def binomial(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Binomial: a binomial-tree reduce to rank 0, then a binomial broadcast from it.

    Steps: rank r receives, for mask = 1, 2, 4, ... while r has that bit
    clear, the partial result of ranks [r+mask, r+2*mask) from r+mask and
    combines it on the right of its own (rank order kept), then sends its
    result to r - lowbit(r) (tree_reduce, in place); rank 0 then broadcasts
    buf down the same tree. Wire: 2n bytes per rank, 2 ceil(log2 p) rounds.
    Source: MPICH's binomial reduce and broadcast (Thakur, Rabenseifner and
    Gropp 2005).
    """
    if team.size == 1 or not buf.size:
        return
    yield from tree_reduce(team, buf, op, 0, copy=False)
    yield from tree_broadcast(team.phase(1), buf, 0)
