"""all_to_all algorithms: pairwise exchange, Bruck's index algorithm."""

from __future__ import annotations

import math

import numpy as np

from .registry import Costs, algorithm
from .team import Algorithm, Team
from .topology import displacements


def _pairwise_cost(c: Costs, nbytes: int, size: int) -> float:
    return (size - 1) * (c.alpha + nbytes / size * c.beta) if size > 1 else 0.0


@algorithm("all_to_all", "pairwise", cost=_pairwise_cost)
def pairwise(team: Team, send: np.ndarray, out: np.ndarray, send_counts: list[int],
             recv_counts: list[int]) -> Algorithm:
    """Pairwise exchange: in step k, send to rank+k and receive from rank-k.

    Steps: p-1; in step k (1 <= k < p) this rank sends its block for
    (rank+k) mod p straight from `send` and receives the block of
    (rank-k) mod p straight into `out`, so every pair meets exactly once and
    no rank receives from two peers at a time. Wire: each rank sends every
    block but its own once, sum(send_counts) - send_counts[rank] elements;
    counts may differ per pair. Source: the MPICH pairwise-exchange
    all-to-all (Thakur, Rabenseifner, Gropp 2005, section 4.5).
    """
    rank, size = team.rank, team.size
    send_at = displacements(send_counts)
    recv_at = displacements(recv_counts)
    for step in range(1, size):
        dst = (rank + step) % size
        src = (rank - step) % size
        yield [team.send(send[send_at[dst]:send_at[dst + 1]], dst),
               team.recv(out[recv_at[src]:recv_at[src + 1]], src)]


def _bruck_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    steps = math.ceil(math.log2(size))
    # every step moves about half the blocks; the two rotations and the
    # packing copy the data locally (charged like moving it once more)
    return steps * (c.alpha + nbytes / 2 * c.beta) + (steps + 2) * nbytes * c.beta / 2


@algorithm("all_to_all", "bruck", cost=_bruck_cost, uneven=False)
def bruck(team: Team, send: np.ndarray, out: np.ndarray, send_counts: list[int],
          recv_counts: list[int]) -> Algorithm:
    """Bruck's index algorithm: log2(p) steps that each forward the blocks whose index has bit k set.

    Steps: (1) rotate locally so that block i is the one for rank+i;
    (2) for k = 0 .. ceil(log2 p)-1, pack the blocks whose index has bit k
    set, send them to rank+2**k and replace them with those received from
    rank-2**k (block i then holds the data of rank-i for this rank); (3)
    rotate back into `out`, block j coming from rank j. Wire: ceil(log2 p)
    messages per rank of about n/2 bytes each (n = one rank's send buffer),
    trading bandwidth for latency; needs equal counts. Source: Bruck, Ho,
    Kipnis, Upfal, Weathersby, "Efficient Algorithms for All-to-All
    Communications in Multiport Message-Passing Systems" (IEEE TPDS 1997);
    the MPICH short-message all-to-all.
    """
    rank, size = team.rank, team.size
    count = send_counts[0] if send_counts else 0
    if size == 1 or count == 0:
        return
    blocks = send.reshape(size, count)
    order = [(rank + i) % size for i in range(size)]
    work = np.take(blocks, order, axis=0)  # (1): block i is destined to rank + i
    packed = np.empty((size // 2, count), dtype=send.dtype)  # at most p/2 indices have a given bit set
    arrived = np.empty_like(packed)
    bit = 1
    while bit < size:
        chosen = [i for i in range(size) if i & bit]
        n = len(chosen)
        np.take(work, chosen, axis=0, out=packed[:n])
        yield [team.send(packed[:n].reshape(-1), (rank + bit) % size),
               team.recv(arrived[:n].reshape(-1), (rank - bit) % size)]
        work[chosen] = arrived[:n]
        bit <<= 1
    result = out.reshape(size, count)
    np.take(work, [(rank - j) % size for j in range(size)], axis=0, out=result)  # (3)
