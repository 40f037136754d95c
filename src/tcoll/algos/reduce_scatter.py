"""reduce_scatter algorithms: pipelined ring, recursive halving, pairwise exchange.

Every algorithm leaves `send` unchanged and writes this rank's reduced
block into `out`; empty messages are left out (both ends compute the same
sizes, so both skip).
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import Op
from .registry import Costs, algorithm
from .steps import FOLD, bit_reverse, exchange, halving, ring_reduce_scatter
from .team import Algorithm, Team
from .topology import displacements, fold_role, pof2_below

__all__ = ["pairwise", "recursive_halving", "ring"]


# -- ring -------------------------------------------------------------------------------------


def _ring_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return (size - 1) * c.alpha + (size - 1) / size * nbytes * (c.beta + c.gamma)


@algorithm("reduce_scatter", "ring", cost=_ring_cost, ordered=False)
def ring(team: Team, send: np.ndarray, out: np.ndarray, counts: list[int], op: Op) -> Algorithm:
    """Ring: p-1 steps, each passing one partially reduced block to the right neighbour, pipelined.

    Steps: see ring_reduce_scatter; rank r's result lands in `out` in the
    last step. Wire: every rank sends n - counts[r] bytes (n(p-1)/p when
    even), in chunks of coll_chunk bytes, to its right neighbour only.
    Combines received data before its own (not in rank order: ordered=False).
    Source: Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
    clusters of workstations", 2009; the reduce-scatter half of gloo's and
    NCCL's ring all-reduce.
    """
    yield from ring_reduce_scatter(team, send, displacements(counts), op, out)


# -- recursive halving ------------------------------------------------------------------------


def _halving_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    pof2 = pof2_below(size)
    cost = math.log2(pof2) * c.alpha + (pof2 - 1) / pof2 * nbytes * (c.beta + c.gamma)
    if pof2 != size:
        cost += 2 * c.alpha + nbytes * (c.beta + c.gamma) + nbytes / size * c.beta
    return cost


@algorithm("reduce_scatter", "recursive_halving", cost=_halving_cost)
def recursive_halving(team: Team, send: np.ndarray, out: np.ndarray, counts: list[int], op: Op) -> Algorithm:
    """Recursive halving: log2 p rounds, each swapping half of the remaining data with a partner.

    Steps: with p not a power of two, the first 2*(p-pof2) ranks pair up
    (fold_role) and the odd rank of each pair hands its whole input to the
    even one. The pof2 active ranks lay their (combined) input out in a
    scratch buffer as pof2 blocks in bit-reversed order, newrank v's block
    being the blocks of the ranks it stands for, then run `halving`, which
    leaves block v on newrank v. An even rank that stands for its odd
    partner finally sends it its part. Wire: about n(pof2-1)/pof2 bytes per
    active rank, plus n and n/p for a folded pair. Keeps rank order.
    Source: MPICH's recursive-halving reduce-scatter (Thakur, Rabenseifner
    and Gropp 2005); the bit-reversed layout is MPICH's non-commutative one.
    """
    p, r = team.size, team.rank
    offs = displacements(counts)
    if p == 1 or offs[-1] == 0:
        if p == 1:
            out[:] = send
        return
    role = fold_role(r, p)
    if not role.active:
        works = exchange(team, send, out, role.partner, FOLD)
        if works:
            yield works
        return
    blocks = [(offs[role.old_rank(v)], offs[role.old_rank(v) + (2 if v < role.extra else 1)])
              for v in range(role.pof2)]  # newrank v's elements in send
    bits = role.pof2.bit_length() - 1
    order = [bit_reverse(j, bits) for j in range(role.pof2)]  # position j holds newrank block order[j]
    pos = displacements([blocks[v][1] - blocks[v][0] for v in order])
    work = np.empty(offs[-1], dtype=send.dtype)
    tmp = np.empty(offs[-1], dtype=send.dtype)
    if role.partner >= 0:
        yield team.recv(tmp, role.partner, FOLD)
    for j, v in enumerate(order):
        start, stop = blocks[v]
        if role.partner >= 0:
            op.combine(send[start:stop], tmp[start:stop], work[pos[j]:pos[j + 1]])
        else:
            work[pos[j]:pos[j + 1]] = send[start:stop]
    lo, _ = yield from halving(team, work, pos, op, role, tmp)
    mine = work[pos[lo]:pos[lo + 1]]
    out[:] = mine[:counts[r]]
    if role.partner >= 0 and mine.size > counts[r]:
        yield team.send(mine[counts[r]:], role.partner, FOLD)


# -- pairwise ---------------------------------------------------------------------------------


def _pairwise_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return (size - 1) * c.alpha + (size - 1) / size * nbytes * (c.beta + c.gamma)


@algorithm("reduce_scatter", "pairwise", cost=_pairwise_cost)
def pairwise(team: Team, send: np.ndarray, out: np.ndarray, counts: list[int], op: Op) -> Algorithm:
    """Pairwise exchange: in step k each rank sends block (r+k) mod p to its owner and gets one back.

    Steps: p-1 steps; in step k rank r sends its contribution to block
    (r+k) mod p to that rank and receives rank (r-k) mod p's contribution to
    its own block (the next step's receive is posted before this one is
    combined). Contributions arrive in the order r-1, r-2, ..., 0, p-1, ...,
    r+1, so two partial results are kept in rank order: low = op(x_0..x_r),
    built right to left into `out`, and high = op(x_r+1..x_p-1); finally
    out = op(low, high). Wire: n - counts[r] bytes sent, counts[r](p-1)
    received, per rank. Keeps rank order.
    Source: MPICH's pairwise-exchange reduce-scatter (Thakur, Rabenseifner
    and Gropp 2005).
    """
    p, r = team.size, team.rank
    offs = displacements(counts)
    n = counts[r]
    out[:] = send[offs[r]:offs[r + 1]]
    if p == 1:
        return
    bufs = [np.empty(n, dtype=send.dtype) for _ in range(2)]
    high = np.empty(n, dtype=send.dtype)
    recvs = {1: team.recv(bufs[1], (r - 1) % p)} if n else {}
    for k in range(1, p):
        dest, src = (r + k) % p, (r - k) % p
        works = exchange(team, send[offs[dest]:offs[dest + 1]], None, dest)
        if n:
            works.append(recvs.pop(k))
        if works:
            yield works
        if not n:
            continue
        if k + 1 < p:
            recvs[k + 1] = team.recv(bufs[(k + 1) % 2], (r - k - 1) % p)
        got = bufs[k % 2]
        if src < r:
            op.combine(got, out, out)
        elif src == p - 1:
            high[:] = got
        else:
            op.combine(got, high, high)
    if n and r < p - 1:
        op.combine(out, high, out)
