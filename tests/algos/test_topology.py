"""The pure topology functions: trees, rings, folds and blocks, checked exhaustively for small worlds."""

from __future__ import annotations

import numpy as np
import pytest

from tcoll.algos import topology as t

SIZES = range(1, 34)


@pytest.mark.parametrize("count", [0, 1, 5, 16, 17])
@pytest.mark.parametrize("parts", [1, 3, 4, 8])
def test_split_counts_match_numpy(count: int, parts: int) -> None:
    assert t.split_counts(count, parts) == [len(a) for a in np.array_split(np.arange(count), parts)]


def test_displacements() -> None:
    assert t.displacements([2, 0, 3]) == [0, 2, 2, 5]
    assert t.displacements([]) == [0]


@pytest.mark.parametrize("size", SIZES)
def test_pof2_below(size: int) -> None:
    p = t.pof2_below(size)
    assert p <= size < 2 * p and p & (p - 1) == 0


@pytest.mark.parametrize("size", SIZES)
def test_binomial_tree_is_a_spanning_tree(size: int) -> None:
    """Every vrank but 0 has one parent, appears once among the children, and subtrees are ranges."""
    seen = []
    for vrank in range(size):
        children = t.binomial_children(vrank, size)
        for child in children:
            assert t.binomial_parent(child) == vrank
        seen += children
        span = t.binomial_subtree_size(vrank, size)
        below = {vrank}
        frontier = [vrank]
        while frontier:
            node = frontier.pop()
            for child in t.binomial_children(node, size):
                below.add(child)
                frontier.append(child)
        assert below == set(range(vrank, vrank + span))
    assert sorted(seen) == list(range(1, size))
    assert t.binomial_parent(0) == -1


@pytest.mark.parametrize("size", SIZES)
def test_binomial_children_farthest_first(size: int) -> None:
    for vrank in range(size):
        children = t.binomial_children(vrank, size)
        assert children == sorted(children, reverse=True)


@pytest.mark.parametrize("size", SIZES)
def test_vrank_round_trip(size: int) -> None:
    for root in range(size):
        for rank in range(size):
            v = t.to_vrank(rank, root, size)
            assert 0 <= v < size and t.from_vrank(v, root, size) == rank
        assert t.to_vrank(root, root, size) == 0


@pytest.mark.parametrize("size", SIZES)
def test_ring_neighbours_form_one_cycle(size: int) -> None:
    rank, visited = 0, []
    for _ in range(size):
        visited.append(rank)
        left, right = t.ring_neighbours(rank, size)
        assert t.ring_neighbours(right, size)[0] == rank
        rank = right
    assert sorted(visited) == list(range(size)) and rank == 0


@pytest.mark.parametrize("size", SIZES)
def test_fold_pairs_adjacent_ranks_and_numbers_the_active_ones(size: int) -> None:
    roles = [t.fold_role(rank, size) for rank in range(size)]
    pof2 = t.pof2_below(size)
    active = [rank for rank, role in enumerate(roles) if role.active]
    assert len(active) == pof2
    assert [roles[r].newrank for r in active] == list(range(pof2))
    for rank, role in enumerate(roles):
        if role.partner >= 0:
            assert roles[role.partner].partner == rank and abs(role.partner - rank) == 1
            assert role.active == (rank < role.partner)  # the lower of a pair stays: rank order kept
        else:
            assert role.active
        if role.active:
            assert role.old_rank(role.newrank) == rank
