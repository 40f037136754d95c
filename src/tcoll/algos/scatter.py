"""scatter algorithms: linear (the root sends to every rank) and binomial tree, the mirrors of gather's.

Blocks of `counts` lie end to end in rank order in the root's `send`; the
root's own block is already in its `out`. In the tree, each inner rank
receives its subtree's blocks as one contiguous scratch buffer in vrank
order (`topology.TreeBlocks`); a range that wraps past rank p-1 at the
root is joined in scratch first. Empty ranges are never sent; both ends agree on that
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


@algorithm("scatter", "linear", cost=_linear_cost)
def linear(team: Team, send: np.ndarray | None, out: np.ndarray, counts: list[int],
                   root: int) -> Algorithm:
    """Linear: the root sends every rank its block directly.

    Steps: one; the root posts p-1 sends at once, the others receive once.
    Wire: the root sends sum(counts) - counts[root] elements in p-1 messages.
    Source: MPICH/Open MPI linear scatter (basic_linear).
    """
    if team.rank != root:
        if counts[team.rank]:
            yield team.recv(out, root)
        return
    assert send is not None
    displs = displacements(counts)
    sends = [team.send(send[displs[r]:displs[r + 1]], r) for r in range(team.size) if r != root and counts[r]]
    if sends:
        yield sends


@algorithm("scatter", "binomial", cost=_binomial_cost)
def binomial(team: Team, send: np.ndarray | None, out: np.ndarray, counts: list[int],
                     root: int) -> Algorithm:
    """Binomial tree: each rank receives its subtree's blocks from its parent and hands each child its part.

    Steps: ceil(log2 p) rounds, the mirror of binomial gather; a leaf
    receives its block straight into out; an inner rank receives its
    subtree's range into scratch, sends each child's subtree range on
    (largest first) and copies its own block out. The root sends from its
    buffer directly (a child's range that wraps past rank p-1 is joined in
    scratch first). Wire: the root sends every other block once, in
    ceil(log2 p) messages; each block travels once per tree level.
    Source: MPICH binomial scatter (Thakur, Rabenseifner, Gropp 2005).
    """
    if team.size == 1:
        return
    tree = TreeBlocks(team.rank, team.size, counts, root)
    lo, hi = tree.span(tree.vrank)
    if tree.vrank == 0:
        assert send is not None
        sources = {child: tree.at_root(send, child) for child in tree.children}
    else:
        scratch = np.empty(hi - lo, dtype=out.dtype) if tree.children else out
        if hi > lo:
            yield team.recv(scratch, tree.peer(binomial_parent(tree.vrank)))
        sources = {child: [tree.in_scratch(scratch, child)] for child in tree.children}
    sends = []
    for child, views in sources.items():
        data = views[0] if len(views) == 1 else np.concatenate(views)
        if data.size:
            sends.append(team.send(data, tree.peer(child)))
    if tree.vrank and tree.children:
        out[:] = scratch[:out.size]
    if sends:
        yield sends
