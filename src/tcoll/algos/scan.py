"""scan and exscan algorithms: a pipelined chain (linear) and recursive doubling (Hillis-Steele).

Rank r's result is the reduction of the inputs of ranks 0..r (scan,
inclusive) or 0..r-1 (exscan, exclusive), combined in rank order (lower
ranks on the left), so non-commutative ops are safe in every algorithm.
Both reduce `buf` in place; exscan leaves rank 0's buffer as it was.
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import Op
from .registry import Costs, algorithm
from .team import Algorithm, Team

__all__ = ["linear", "recursive_doubling", "linear_exclusive", "recursive_doubling_exclusive"]

_CHUNK = 1 << 20  # the default TCOLL_COLL_CHUNK: what the cost model assumes the chain pipelines in


def _linear_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    piece = min(nbytes, _CHUNK)
    pieces = max(1, math.ceil(nbytes / _CHUNK))
    return (size - 2 + pieces) * (c.alpha + piece * (c.beta + c.gamma))


def _doubling_cost(c: Costs, nbytes: int, size: int, combines: int = 1) -> float:
    rounds = math.ceil(math.log2(size)) if size > 1 else 0
    return rounds * (c.alpha + nbytes * (c.beta + combines * c.gamma))


def _doubling_exclusive_cost(c: Costs, nbytes: int, size: int) -> float:
    return _doubling_cost(c, nbytes, size, combines=2)


@algorithm("scan", "linear", cost=_linear_cost)
def linear(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Linear: a chain 0 -> 1 -> ... -> p-1 passing the running prefix on, pipelined in chunks.

    Steps: rank r > 0 receives the prefix of ranks 0..r-1 chunk by chunk,
    combines each chunk on the left of its own (buf = prefix op buf) and
    forwards it to r+1 at once, so the chunks flow down the chain like a
    pipeline. Wire: n bytes in and n out per rank; p-2 + n/chunk steps.
    Source: MPI_Scan's textbook chain (MPICH's smp/linear scan).
    """
    yield from _chain(team, buf, op, exclusive=False)


@algorithm("exscan", "linear", cost=_linear_cost)
def linear_exclusive(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Linear: a chain 0 -> 1 -> ... -> p-1 passing the running prefix on, pipelined in chunks.

    Steps: as scan's chain, but rank r forwards prefix op buf and keeps the
    prefix it received (rank 0 forwards its own buf, which it keeps).
    Wire: n bytes in and n out per rank; p-2 + n/chunk steps.
    Source: MPI_Exscan's textbook chain.
    """
    yield from _chain(team, buf, op, exclusive=True)


def _chain(team: Team, buf: np.ndarray, op: Op, exclusive: bool) -> Algorithm:
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    step = team.chunk_count(buf.itemsize)
    pieces = [(lo, min(lo + step, buf.size)) for lo in range(0, buf.size, step)]
    if r == 0:
        yield [team.send(buf[lo:hi], 1) for lo, hi in pieces]
        return
    prefix = np.empty_like(buf)
    passed = np.empty_like(buf) if exclusive and r < p - 1 else buf  # what goes on to r+1
    recvs = [team.recv(prefix[lo:hi], r - 1) for lo, hi in pieces]
    sends = []
    for work, (lo, hi) in zip(recvs, pieces):
        yield work
        if r < p - 1 or not exclusive:
            op.combine(prefix[lo:hi], buf[lo:hi], passed[lo:hi])
        if r < p - 1:
            sends.append(team.send(passed[lo:hi], r + 1))
        if exclusive:
            buf[lo:hi] = prefix[lo:hi]
    if sends:
        yield sends


@algorithm("scan", "recursive_doubling", cost=_doubling_cost)
def recursive_doubling(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Recursive doubling (Hillis-Steele): in round k, pass the partial prefix to rank + 2**k.

    Steps: ceil(log2 p) rounds; in round k rank r sends what it holds (the
    reduction of ranks max(0, r-2**k+1)..r) to r + 2**k and receives that of
    r - 2**k, which covers the ranks just below its own, and combines it on
    the left. Any p. Wire: up to n bytes in and out per round.
    Source: Hillis and Steele, "Data parallel algorithms", CACM 1986.
    """
    yield from _doubling(team, buf, op, exclusive=False)


@algorithm("exscan", "recursive_doubling", cost=_doubling_exclusive_cost)
def recursive_doubling_exclusive(team: Team, buf: np.ndarray, op: Op) -> Algorithm:
    """Recursive doubling (Hillis-Steele): in round k, pass the partial prefix to rank + 2**k.

    Steps: as scan's, on a copy of buf; every piece received is also
    combined on the left of the exclusive result, which lands in buf (rank 0
    receives nothing and keeps its buf). Wire: up to n bytes in and out per round.
    Source: Hillis and Steele, "Data parallel algorithms", CACM 1986.
    """
    yield from _doubling(team, buf, op, exclusive=True)


def _doubling(team: Team, buf: np.ndarray, op: Op, exclusive: bool) -> Algorithm:
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    partial = buf.copy() if exclusive else buf  # ranks max(0, r - dist + 1)..r
    got = np.empty_like(buf)
    have = False  # exclusive: whether buf holds a received prefix yet
    dist = 1
    while dist < p:
        works = []
        if r + dist < p:
            works.append(team.send(partial, r + dist))
        if r >= dist:
            works.append(team.recv(got, r - dist))
        yield works
        if r >= dist:
            if exclusive:
                if have:
                    op.combine(got, buf, buf)
                else:
                    buf[...] = got
                have = True
            if not exclusive or r + 2 * dist < p:  # partial still goes on
                op.combine(got, partial, partial)
        dist <<= 1
