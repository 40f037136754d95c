"""The building blocks that several collective algorithms share, each in one place.

Every block is a generator over point-to-point requests, like an algorithm
(see `tcoll.algos.team`), and is used with `yield from`:

- `exchange`: send one array to a peer and receive another, skipping empty ones.
- `fold_in` / `fold_out`: fold a non-power of two of ranks onto a power of
  two and back (MPICH's trick for recursive doubling and halving).
- `halving` / `doubling_all_gather`: rank-ordered recursive halving (a
  reduce-scatter) over the folded ranks, and its mirror (an all-gather).
- `ring_reduce_scatter` and `ring_pass`: the two halves of a ring, pipelined.
- `tree_reduce` and `tree_broadcast`: up and down a binomial tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..ops import Op
from ..p2p.work import Work
from .team import Algorithm, Team
from .topology import FoldRole, binomial_children, binomial_parent, from_vrank, ring_neighbours, to_vrank

__all__ = [
    "FOLD", "bit_reverse", "doubling_all_gather", "exchange", "fold_in", "fold_out", "halving",
    "ring_pass", "ring_reduce_scatter", "tree_broadcast", "tree_reduce",
]

FOLD = 7  # the stream (sub) of the messages that fold extra ranks in and out


def exchange(team: Team, out: np.ndarray | None, into: np.ndarray | None, peer: int, sub: int = 0) -> list[Work]:
    """Send `out` to and receive `into` from `peer`, leaving out empty arrays (and None)."""
    works = []
    if out is not None and out.size:
        works.append(team.send(out, peer, sub))
    if into is not None and into.size:
        works.append(team.recv(into, peer, sub))
    return works


def bit_reverse(value: int, bits: int) -> int:
    """`value` with its lowest `bits` bits in reverse order."""
    result = 0
    for _ in range(bits):
        result = (result << 1) | (value & 1)
        value >>= 1
    return result


def fold_in(team: Team, role: FoldRole, work: np.ndarray, tmp: np.ndarray, op: Op) -> Algorithm:
    """The odd rank of a folded pair sends `work` to the even one, which combines it on the right."""
    if role.partner < 0 or not work.size:
        return
    if role.active:
        yield team.recv(tmp[:work.size], role.partner, FOLD)
        op.combine(work, tmp[:work.size], work)
    else:
        yield team.send(work, role.partner, FOLD)


def fold_out(team: Team, role: FoldRole, buf: np.ndarray) -> Algorithm:
    """The even rank of a folded pair sends the result `buf` to the odd one, which receives it into buf."""
    if role.partner < 0 or not buf.size:
        return
    yield team.send(buf, role.partner, FOLD) if role.active else team.recv(buf, role.partner, FOLD)


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


def doubling_all_gather(team: Team, work: np.ndarray, offs: list[int], role: FoldRole, lo: int, hi: int,
                        sub: int = 0) -> Algorithm:
    """Undo `halving`: with masks falling, swap the block range held with newrank ^ mask's; both keep both."""
    mask = role.pof2 >> 1
    while mask:
        width = hi - lo
        other = (lo - width, lo) if role.newrank & mask else (hi, hi + width)
        works = exchange(team, work[offs[lo]:offs[hi]], work[offs[other[0]]:offs[other[1]]],
                         role.old_rank(role.newrank ^ mask), sub)
        if works:
            yield works
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask >>= 1


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


def ring_pass(team: Team, buf: np.ndarray, displs: Sequence[int], ring: Sequence[int], pos: int,
              sub: int = 0, complete_at: int = -1) -> Algorithm:
    """Ring all-gather of blocks indexed by ring position, pipelined in chunks (shared with broadcast).

    Position j of the ring is team rank ring[j] and starts out holding block j,
    buf[displs[j]:displs[j + 1]]; this rank is at position `pos`. In step s
    each rank sends block pos - s to its right neighbour and receives block
    pos - s - 1 from its left; a chunk received in step s is sent on in step
    s + 1 as soon as it has arrived, while the next chunks are still arriving.
    Messages travel on stream `sub`. The position `complete_at` (a broadcast
    root) already holds every block: it receives nothing, so its buffer may
    be read-only, and its left neighbour sends it nothing.
    Wire: every rank sends and receives every block but one, once.
    Source: the ring all-gather of MPICH (Thakur, Rabenseifner, Gropp 2005).
    """
    p = len(ring)
    if p == 1:
        return
    left, right = ring[(pos - 1) % p], ring[(pos + 1) % p]
    chunk = team.chunk_count(buf.itemsize)
    full = pos == complete_at
    feeds_full = (pos + 1) % p == complete_at

    def pieces(block: int) -> list[np.ndarray]:
        lo, hi = displs[block], displs[block + 1]
        return [buf[a:min(a + chunk, hi)] for a in range(lo, hi, chunk)]

    # every block arrives once, into its own place: post all receives up front
    recvs = [] if full else [[team.recv(piece, left, sub) for piece in pieces((pos - s - 1) % p)]
                             for s in range(p - 1)]
    sends = []
    for s in range(p - 1):
        for k, piece in enumerate(pieces((pos - s) % p)):
            if s and not full:
                yield recvs[s - 1][k]  # the chunk to pass on has arrived
            if not feeds_full:
                sends.append(team.send(piece, right, sub))
    waits = sends + (recvs[-1] if recvs else [])
    if waits:
        yield waits


def tree_reduce(team: Team, buf: np.ndarray, op: Op, tree_root: int, copy: bool) -> Algorithm:
    """Reduce `buf` up a binomial tree rooted at `tree_root`; returns the result there (None elsewhere).

    In vranks (tree_root = 0), rank v receives from v + mask, for mask = 1,
    2, 4, ... while v has that bit clear, the partial result of vranks
    [v+mask, v+2*mask) and combines it on the right of its own, then sends
    its partial result to v - mask at its lowest set bit. With tree_root 0
    operands meet in rank order. `copy`: accumulate in a scratch copy (the
    first time something arrives), leaving buf as it was; else in buf.
    """
    p = team.size
    vrank = to_vrank(team.rank, tree_root, p)
    acc, tmp = buf, None
    mask = 1
    while mask < p:
        if vrank & mask:
            yield team.send(acc, from_vrank(vrank - mask, tree_root, p))
            return None
        if vrank + mask < p:
            if tmp is None:
                tmp = np.empty_like(buf)
                acc = buf.copy() if copy else buf
            yield team.recv(tmp, from_vrank(vrank + mask, tree_root, p))
            op.combine(acc, tmp, acc)
        mask <<= 1
    return acc


def tree_broadcast(team: Team, buf: np.ndarray, root: int) -> Algorithm:
    """Copy `buf` of `root` down the binomial tree rooted there: receive once from the parent, send to the children.

    In round k the 2**k ranks that hold the data send it to the rank 2**k
    away (counted from the root); children are served farthest first.
    """
    vrank = to_vrank(team.rank, root, team.size)
    parent = binomial_parent(vrank)
    if parent >= 0:
        yield team.recv(buf, from_vrank(parent, root, team.size))
    sends = [team.send(buf, from_vrank(child, root, team.size)) for child in binomial_children(vrank, team.size)]
    if sends:
        yield sends
