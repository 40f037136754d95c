"""Who talks to whom: pure functions of (rank, size) used by the algorithms.

Nothing here communicates, so every function is tested on its own. Ranks are
a communicator's ranks, 0 <= rank < size; "vrank" is a rank renumbered so
that the root of a tree is 0: vrank = (rank - root) mod size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

__all__ = [
    "split_counts", "part_bounds", "displacements", "pof2_below", "ring_neighbours",
    "to_vrank", "from_vrank", "binomial_parent", "binomial_children", "binomial_subtree_size",
    "fold_role", "FoldRole", "TreeBlocks",
]


def split_counts(count: int, parts: int) -> list[int]:
    """Split `count` items into `parts` near-equal blocks, the larger ones first (like np.array_split)."""
    base, extra = divmod(count, parts)
    return [base + 1 if i < extra else base for i in range(parts)]


def part_bounds(count: int, parts: int, index: int) -> tuple[int, int]:
    """Element range [lo, hi) of part `index` when `count` elements are cut into `parts` near-equal parts."""
    base, extra = divmod(count, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def displacements(counts: list[int]) -> list[int]:
    """The offset of each block when blocks of `counts` are laid end to end; one extra entry: the total."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets


def pof2_below(size: int) -> int:
    """The largest power of two <= size (size >= 1)."""
    return 1 << (size.bit_length() - 1)


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """(left, right): the ranks this rank receives from and sends to around the ring."""
    return (rank - 1) % size, (rank + 1) % size


def to_vrank(rank: int, root: int, size: int) -> int:
    """Renumber `rank` so that `root` becomes 0."""
    return (rank - root) % size


def from_vrank(vrank: int, root: int, size: int) -> int:
    """Undo to_vrank."""
    return (vrank + root) % size


def binomial_parent(vrank: int) -> int:
    """The parent of `vrank` in a binomial tree rooted at 0: clear its lowest set bit (-1 for the root)."""
    if vrank == 0:
        return -1
    return vrank & (vrank - 1)


def binomial_children(vrank: int, size: int) -> list[int]:
    """The children of `vrank` in a binomial tree over `size` vranks, farthest first.

    Farthest first is the broadcast order: the farthest child heads the
    largest full subtree, so it should start forwarding soonest.

    Child vrank + 2**k exists for every 2**k below vrank's lowest set bit
    (every 2**k for the root) while it is < size.
    """
    limit = (vrank & -vrank) if vrank else 1 << size.bit_length()
    children = []
    mask = 1
    while mask < limit and vrank + mask < size:
        children.append(vrank + mask)
        mask <<= 1
    return children[::-1]


def binomial_subtree_size(vrank: int, size: int) -> int:
    """How many vranks the subtree rooted at `vrank` holds (itself included): a contiguous range."""
    span = (vrank & -vrank) if vrank else 1 << size.bit_length()
    return min(span, size - vrank)


class FoldRole:
    """Where a rank stands when `size` is folded onto a power of two.

    The first 2*extra ranks pair up (even with odd, extra = size - pof2): the
    odd one of each pair hands its data to the even one and sits out, so the
    remaining pof2 ranks run the power-of-two algorithm; afterwards each
    even rank hands the result back. Pairs are adjacent ranks, so rank order
    (for non-commutative ops) is kept: the even rank is always the lower.

    Attributes:
        pof2: the power of two the ranks fold onto.
        active: whether this rank takes part in the power-of-two phase.
        partner: the other rank of this rank's pair, or -1 if it has none.
        newrank: this rank's rank in the power-of-two phase (-1 if inactive).
    """

    __slots__ = ("pof2", "active", "partner", "newrank", "extra")

    def __init__(self, pof2: int, active: bool, partner: int, newrank: int, extra: int) -> None:
        self.pof2 = pof2
        self.active = active
        self.partner = partner
        self.newrank = newrank
        self.extra = extra

    def old_rank(self, newrank: int) -> int:
        """The communicator rank of power-of-two phase rank `newrank`."""
        return newrank * 2 if newrank < self.extra else newrank + self.extra


def fold_role(rank: int, size: int) -> FoldRole:
    """This rank's role when folding `size` ranks onto a power of two (see FoldRole)."""
    pof2 = pof2_below(size)
    extra = size - pof2
    if rank < 2 * extra:
        partner = rank ^ 1
        active = rank % 2 == 0
        return FoldRole(pof2, active, partner, rank // 2 if active else -1, extra)
    return FoldRole(pof2, True, -1, rank - extra, extra)


class TreeBlocks:
    """Where the blocks of a binomial subtree lie, for the tree gather and scatter.

    Ranks are renumbered so that the root is vrank 0; a subtree is a
    contiguous range of vranks, so an inner rank handles its subtree's blocks
    as one contiguous buffer in vrank order. At the root the vrank order is
    its rank-order buffer rotated left by displacements(counts)[root]
    elements, so a subtree's range there is one slice, or two when it wraps
    past rank size-1.

    Attributes:
        vrank: this rank's vrank.
        vdispls: element offsets of the vranks' blocks laid end to end in vrank order.
        children: this rank's children (vranks), largest subtree first.
        start: where vrank 0's block lies in the root's rank-order buffer.
    """

    __slots__ = ("size", "root", "vrank", "vdispls", "children", "start")

    def __init__(self, rank: int, size: int, counts: list[int], root: int) -> None:
        self.size, self.root = size, root
        self.vrank = to_vrank(rank, root, size)
        self.vdispls = displacements([counts[from_vrank(v, root, size)] for v in range(size)])
        self.children = binomial_children(self.vrank, size)
        self.start = displacements(counts)[root]

    def peer(self, vrank: int) -> int:
        """The rank of `vrank`."""
        return from_vrank(vrank, self.root, self.size)

    def span(self, vrank: int) -> tuple[int, int]:
        """The offsets, in vrank order, of the blocks of vrank's subtree."""
        last = vrank + binomial_subtree_size(vrank, self.size)
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
