"""reduce algorithms: binomial tree, and Rabenseifner's reduce-scatter + gather.

The result goes to `buf` on the root only; every other rank's `buf` is left
exactly as it was (partial results are made in a scratch copy).
"""

from __future__ import annotations

import math

import numpy as np

from ..ops import Op
from .registry import Costs, algorithm
from .steps import FOLD, fold_in, halving, tree_reduce
from .team import Algorithm, Team
from .topology import displacements, fold_role, pof2_below, split_counts

__all__ = ["binomial", "reduce_scatter_gather"]


def _lg(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


def _binomial_cost(c: Costs, nbytes: int, size: int) -> float:
    return _lg(size) * (c.alpha + nbytes * (c.beta + c.gamma))


@algorithm("reduce", "binomial", cost=_binomial_cost)
def binomial(team: Team, buf: np.ndarray, op: Op, root: int) -> Algorithm:
    """Binomial tree: ceil(log2 p) rounds, each halving the ranks that still hold a partial result.

    Steps: tree_reduce over the tree rooted at `root` (vranks counted from
    it) for a commutative op; for a non-commutative one the tree is rooted
    at rank 0, so operands meet in rank order, and rank 0 then sends the
    result to the root (one more message when root != 0). Ranks that
    receive combine in a scratch copy, leaves send buf itself. Wire: every
    rank but the tree's root sends n bytes once.
    Source: MPICH's binomial reduce (Thakur, Rabenseifner and Gropp 2005).
    """
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    tree_root = root if op.commutative else 0
    acc = yield from tree_reduce(team, buf, op, tree_root, copy=r != root)
    if tree_root != root:
        if r == tree_root:
            yield team.send(acc, root, 1)
        elif r == root:
            yield team.recv(buf, tree_root, 1)


def _rsg_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    pof2 = pof2_below(size)
    cost = 2 * _lg(pof2) * c.alpha + (pof2 - 1) / pof2 * nbytes * (2 * c.beta + c.gamma)
    if pof2 != size:
        cost += c.alpha + nbytes * (c.beta + c.gamma)
    return cost


@algorithm("reduce", "reduce_scatter_gather", cost=_rsg_cost)
def reduce_scatter_gather(team: Team, buf: np.ndarray, op: Op, root: int) -> Algorithm:
    """Rabenseifner's reduce: a recursive-halving reduce-scatter, then a binomial gather to the root.

    Steps: fold a non-power of two onto pof2 ranks (the odd rank of each of
    the first 2*(p-pof2) pairs sends buf to the even one); the active ranks
    cut a scratch copy of buf into pof2 near-equal blocks (the root works in
    buf itself) and run `halving` (rank order kept), each ending with one
    reduced block; then, with masks falling, the rank of each pair on the
    other side of the target from its partner sends its whole range and
    drops out, so the target ends with all of it. The target is the root,
    or the root's even partner when the root was folded out, which then
    sends it the result. Wire: n(pof2-1)/pof2 bytes per active rank in each
    phase, 2 log2 pof2 messages (+ n for the fold).
    Source: Rabenseifner, ICCS 2004; MPICH's reduce_scatter_gather reduce.
    """
    p, r = team.size, team.rank
    if p == 1 or not buf.size:
        return
    role = fold_role(r, p)
    target = root if fold_role(root, p).active else root - 1
    if not role.active:
        yield team.send(buf, role.partner, FOLD)
        if r == root:
            yield team.recv(buf, target, FOLD)
        return
    work = buf if r == root else buf.copy()
    tmp = np.empty_like(buf)
    yield from fold_in(team, role, work, tmp, op)
    offs = displacements(split_counts(buf.size, role.pof2))
    lo, hi = yield from halving(team, work, offs, op, role, tmp)
    goal = fold_role(target, p).newrank
    mask = role.pof2 >> 1
    while mask:
        peer = role.old_rank(role.newrank ^ mask)
        if (role.newrank ^ goal) & mask:
            if offs[hi] > offs[lo]:
                yield team.send(work[offs[lo]:offs[hi]], peer, 1)
            return
        width = hi - lo
        other = (lo - width, lo) if role.newrank & mask else (hi, hi + width)
        if offs[other[1]] > offs[other[0]]:
            yield team.recv(work[offs[other[0]]:offs[other[1]]], peer, 1)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        mask >>= 1
    if r != root:
        yield team.send(work, root, FOLD)
