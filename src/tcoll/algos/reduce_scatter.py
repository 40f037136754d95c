"""reduce_scatter algorithms: pipelined ring, recursive halving, pairwise exchange.

Also the building blocks the all_reduce and reduce algorithms share: the
ring reduce-scatter (`ring_reduce_scatter`), the rank-ordered recursive
halving over a power of two of ranks (`halving`), and `exchange`, which
leaves out empty messages (both ends compute the same sizes, so both skip).
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import Op
from ..schedule import Algorithm, Team
from ..topology import FoldRole, displacements, fold_role, pof2_below, ring_neighbours
from ..work import Work
from .registry import Costs, algorithm

FOLD = 7  # the stream (sub) of the messages that fold extra ranks in and out

__all__ = [
    "FOLD",
    "bit_reverse",
    "exchange",
    "fold_in",
    "halving",
    "pairwise",
    "recursive_halving",
    "ring",
    "ring_reduce_scatter",
]


def exchange(team: Team, out: np.ndarray | None, into: np.ndarray | None, peer: int, sub: int = 0) -> list[Work]:
    """Send `out` to and receive `into` from `peer`, leaving out empty arrays (and None)."""
    works = []
    if out is not None and out.size:
        works.append(team.send(out, peer, sub))
    if into is not None and into.size:
        works.append(team.recv(into, peer, sub))
    return works


def fold_in(team: Team, role: FoldRole, work: np.ndarray, tmp: np.ndarray, op: Op) -> Algorithm:
    """The odd rank of a folded pair sends `work` to the even one, which combines it on the right."""
    if role.partner < 0 or not work.size:
        return
    if role.active:
        yield team.recv(tmp[:work.size], role.partner, FOLD)
        op.combine(work, tmp[:work.size], work)
    else:
        yield team.send(work, role.partner, FOLD)


def bit_reverse(value: int, bits: int) -> int:
    """`value` with its lowest `bits` bits in reverse order."""
    result = 0
    for _ in range(bits):
        result = (result << 1) | (value & 1)
        value >>= 1
    return result


def ring_reduce_scatter(team: Team, data: np.ndarray, offs: list[int], op: Op,
                        out: np.ndarray | None = None) -> Algorithm:
    """Reduce block j of `data` (elements offs[j]:offs[j+1]) onto rank j around the ring, pipelined.

    In step s (0..p-2) rank r sends its partial sum of block (r-s-1) mod p to
    the right and receives block (r-s-2) mod p from the left, which it
    combines with its own contribution; each block is cut in chunks of
    team.chunk_count elements that travel independently, so a chunk is passed
    on as soon as it is combined. With `out` None the partial sums are made
    in place in `data` and rank r's result ends in its block of `data`;
    otherwise `data` is only read and the result goes to `out`. Operands are
    combined out of rank order (received, own).
    """
    p, r = team.size, team.rank
    if p == 1:
        if out is not None:
            out[:] = data[offs[0]:offs[1]]
        return
    left, right = ring_neighbours(r, p)
    step = team.chunk_count(data.itemsize)
    widest = max(offs[j + 1] - offs[j] for j in range(p))
    bufs = [np.empty(widest, dtype=data.dtype) for _ in range(1 if out is None else 2)]
    sent: list[list[Work]] = [[], []]  # sends still reading bufs[0] / bufs[1]

    def pieces(block: int) -> list[tuple[int, int]]:
        start, stop = offs[block], offs[block + 1]
        return [(lo, min(lo + step, stop)) for lo in range(start, stop, step)]

    first = [team.send(data[lo:hi], right) for lo, hi in pieces((r - 1) % p)]
    for s in range(p - 1):
        block, last = (r - s - 2) % p, s == p - 2
        recv_buf = bufs[s % len(bufs)]
        if out is not None and sent[s % 2]:
            yield sent[s % 2]  # recv_buf was sent on two steps ago
            sent[s % 2] = []
        base = offs[block]
        posted = [(team.recv(recv_buf[lo - base:hi - base], left), lo, hi) for lo, hi in pieces(block)]
        for work, lo, hi in posted:
            yield work
            got = recv_buf[lo - base:hi - base]
            if last:
                target = data[lo:hi] if out is None else out[lo - base:hi - base]
            else:
                target = data[lo:hi] if out is None else got
            op.combine(got, data[lo:hi], target)
            if not last:
                sent[s % 2 if out is not None else 0].append(team.send(target, right))
    pending = first + sent[0] + sent[1]
    if pending:
        yield pending


def halving(team: Team, work: np.ndarray, offs: list[int], op: Op, role: FoldRole, tmp: np.ndarray,
            sub: int = 0) -> Algorithm:
    """Recursive halving over the fold's pof2 active ranks, in rank order; returns the block range kept.

    `work` holds pof2 blocks (offs has pof2+1 entries). In round k (mask
    2**k, rising) a rank swaps with newrank ^ mask: the lower one keeps the
    lower half of its current block range and sends the upper half, the
    higher one the opposite, and each combines what it receives with the
    half it keeps, the lower newrank's data on the left. Masks rise so that
    every partial result covers a contiguous group of ranks (rank order kept
    for non-commutative ops); newrank v ends with block bit_reverse(v).
    Wire: n/2 + n/4 + ... = n(pof2-1)/pof2 bytes sent per rank.
    Source: MPICH's reduce-scatter phase of Rabenseifner's all-reduce.
    """
    pof2, newrank = role.pof2, role.newrank
    lo, hi, mask = 0, pof2, 1
    while mask < pof2:
        peer_new = newrank ^ mask
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if newrank & mask else ((lo, mid), (mid, hi))
        mine = work[offs[keep[0]]:offs[keep[1]]]
        got = tmp[:mine.size]
        works = exchange(team, work[offs[give[0]]:offs[give[1]]], got, role.old_rank(peer_new), sub)
        if works:
            yield works
        if mine.size:
            if peer_new < newrank:
                op.combine(got, mine, mine)
            else:
                op.combine(mine, got, mine)
        lo, hi = keep
        mask <<= 1
    return lo, hi


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
