"""gather and scatter algorithms: linear (root talks to every rank) and binomial tree.

Blocks of `counts` lie end to end in rank order in the root's buffer (out
for gather, send for scatter). In the binomial tree ranks are renumbered
so the root is vrank 0 (vrank = (rank - root) mod p); a subtree is a
contiguous range of vranks, so each inner rank handles its subtree's
blocks as one contiguous scratch buffer in vrank order. At the root the
vrank order is its rank-order buffer rotated left by displs[root]
elements, so a subtree's range there is one slice, or two when it wraps
past rank p-1 (that one is staged through scratch). Empty ranges are
never sent; both ends agree on that since every rank knows `counts`.
"""

from __future__ import annotations

import math

import numpy as np

from ..schedule import Algorithm, Team
from ..topology import binomial_children, binomial_parent, binomial_subtree_size, displacements, from_vrank, to_vrank
from .registry import Costs, algorithm

__all__ = ["linear_gather", "binomial_gather", "linear_scatter", "binomial_scatter"]


def _linear_cost(c: Costs, nbytes: int, size: int) -> float:
    return (size - 1) * (c.alpha + nbytes * c.beta)


def _binomial_cost(c: Costs, nbytes: int, size: int) -> float:
    if size == 1:
        return 0.0
    return math.ceil(math.log2(size)) * c.alpha + (size - 1) * nbytes * c.beta


class _Tree:
    """This rank's place in the binomial tree over vranks, and where subtree ranges lie.

    Attributes:
        vrank: this rank's vrank.
        vdispls: element offsets of the vranks' blocks laid end to end in vrank order.
        children: this rank's children (vranks), largest subtree first.
    """

    __slots__ = ("team", "root", "vrank", "vdispls", "children", "start")

    def __init__(self, team: Team, counts: list[int], root: int) -> None:
        size = team.size
        self.team, self.root = team, root
        self.vrank = to_vrank(team.rank, root, size)
        self.vdispls = displacements([counts[from_vrank(v, root, size)] for v in range(size)])
        self.children = binomial_children(self.vrank, size)
        self.start = displacements(counts)[root]  # where vrank 0's block lies in the root's buffer

    def peer(self, vrank: int) -> int:
        return from_vrank(vrank, self.root, self.team.size)

    def span(self, vrank: int) -> tuple[int, int]:
        """The offsets, in vrank order, of the blocks of vrank's subtree."""
        last = vrank + binomial_subtree_size(vrank, self.team.size)
        return self.vdispls[vrank], self.vdispls[last]

    def at_root(self, buf: np.ndarray, vrank: int) -> list[np.ndarray]:
        """The root's rank-order buffer's views of vrank's subtree range: one, or two if it wraps."""
        lo, hi = self.span(vrank)
        total = buf.size
        start = self.start + lo
        if start >= total:
            start -= total
        end = start + hi - lo
        return [buf[start:end]] if end <= total else [buf[start:], buf[:end - total]]

    def in_scratch(self, scratch: np.ndarray, vrank: int) -> np.ndarray:
        """An inner rank's scratch (its own subtree range) view of vrank's subtree range."""
        lo, hi = self.span(vrank)
        base = self.vdispls[self.vrank]
        return scratch[lo - base:hi - base]


@algorithm("gather", "linear", cost=_linear_cost)
def linear_gather(team: Team, send: np.ndarray, out: np.ndarray | None, counts: list[int],
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
def binomial_gather(team: Team, send: np.ndarray, out: np.ndarray | None, counts: list[int],
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
    tree = _Tree(team, counts, root)
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


@algorithm("scatter", "linear", cost=_linear_cost)
def linear_scatter(team: Team, send: np.ndarray | None, out: np.ndarray, counts: list[int],
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
def binomial_scatter(team: Team, send: np.ndarray | None, out: np.ndarray, counts: list[int],
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
    tree = _Tree(team, counts, root)
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
