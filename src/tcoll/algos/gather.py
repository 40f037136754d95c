"""gather algorithms: linear (the root receives from every rank) and binomial tree.

Blocks of `counts` lie end to end in rank order in the root's `out`, its
own block already in place. In the tree, each inner rank collects its
subtree's blocks as one contiguous scratch buffer in vrank order
(`topology.TreeBlocks`); a range that wraps past rank p-1 at the root is
staged through scratch. Empty ranges are never sent; both ends agree on that
since every rank knows `counts`.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import Costs, algorithm
from .team import Algorithm, Team
from .topology import TreeBlocks, binomial_parent, displacements

__all__ = ["linear", "binomial"]


def _linear_cost(c: Costs, nbytes: int, size: int) -> float:
    return (size - 1) * (c.alpha + nbytes * c.beta)


def _binomial_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return math.ceil(math.log2(size)) * c.alpha + (size - 1) * nbytes * c.beta


@algorithm("gather", "linear", cost=_linear_cost)
def linear(team: Team, send: np.ndarray, out: np.ndarray | None, counts: list[int],
                  root: int) -> Algorithm:
    """Linear: the root receives every rank's block directly into place.

    Steps: one; the root posts p-1 receives at once, the others send once.
    Wire: the root receives sum(counts) - counts[root] elements in p-1
    messages. Source: MPICH/Open MPI linear gather (basic_linear).
    """
    if team.rank != root:
        if counts[team.rank]:
            yield team.send(send, root)
        return
    assert out is not None
    displs = displacements(counts)
    recvs = [team.recv(out[displs[r]:displs[r + 1]], r) for r in range(team.size) if r != root and counts[r]]
    if recvs:
        yield recvs


@algorithm("gather", "binomial", cost=_binomial_cost)
def binomial(team: Team, send: np.ndarray, out: np.ndarray | None, counts: list[int],
                    root: int) -> Algorithm:
    """Binomial tree: each rank collects its subtree's blocks, in vrank order, and sends them to its parent.

    Steps: ceil(log2 p) rounds; a leaf sends its block; an inner rank
    copies its block into a scratch buffer for its whole subtree, receives
    each child's subtree range into place there, and sends the buffer up.
    The root receives straight into out (a child's range that wraps past
    rank p-1 goes through scratch). Wire: the root receives every other
    block once, in ceil(log2 p) messages; each block travels once per tree
    level. Source: MPICH binomial gather (Thakur, Rabenseifner, Gropp 2005).
    """
    if team.size == 1:
        return
    tree = TreeBlocks(team.rank, team.size, counts, root)
    lo, hi = tree.span(tree.vrank)
    if tree.vrank == 0:
        assert out is not None
        places = {child: tree.at_root(out, child) for child in tree.children}
    elif tree.children:
        scratch = np.empty(hi - lo, dtype=send.dtype)
        scratch[:send.size] = send
        places = {child: [tree.in_scratch(scratch, child)] for child in tree.children}
    else:
        places = {}
    recvs, staged = [], []
    for child, views in places.items():
        target = views[0] if len(views) == 1 else np.empty(sum(v.size for v in views), dtype=views[0].dtype)
        if target.size:
            recvs.append(team.recv(target, tree.peer(child)))
        if len(views) > 1:
            staged.append((target, views))
    if recvs:
        yield recvs
    for target, views in staged:  # a range that wraps at the root: split it into place
        views[0][:] = target[:views[0].size]
        views[1][:] = target[views[0].size:]
    if tree.vrank and hi > lo:
        yield team.send(scratch if tree.children else send, tree.peer(binomial_parent(tree.vrank)))
