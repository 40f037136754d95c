"""Sub-communicators: split, group and dup (MPI_Comm_split semantics).

A sub-communicator shares its parent's channels and has a context of its
own, so its messages never meet the parent's or a sibling's: the context
is the largest "next free context" of the parent's ranks, which every
member then moves past. Two communicators that share a pair of ranks were
therefore made at different times by both of those ranks, and their
contexts differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .comm import Communicator
    from .engine import Engine

__all__ = ["GroupMethods"]

_NO_COLOR = -1


class GroupMethods:
    """Mixed into Communicator: making sub-communicators."""

    rank: int
    size: int
    _engine: Engine
    _world: list[int]

    def split(self: Communicator, color: int | None, key: int | None = None) -> Communicator | None:  # type: ignore[misc]
        """Partition the ranks by `color`; collective over this communicator.

        Ranks passing the same color form a new communicator, ordered by
        `key` (ties by rank here), as MPI_Comm_split does.

        Args:
            color: a non-negative integer, or None to join no new communicator.
            key: orders the ranks of the new communicator (default: this rank).

        Returns:
            The new communicator, or None for color None.

        Raises:
            ValueError: a negative or non-integer color or key.
        """
        if color is not None and (not isinstance(color, (int, np.integer)) or isinstance(color, bool) or color < 0):
            raise ValueError(f"color must be a non-negative integer or None, not {color!r}")
        key = self.rank if key is None else key
        if not isinstance(key, (int, np.integer)) or isinstance(key, bool):
            raise ValueError(f"key must be an integer, not {key!r}")
        engine = self._engine
        mine = np.array([_NO_COLOR if color is None else color, key, engine.next_context], dtype=np.int64)
        table = self.all_gather(mine, algorithm="auto")
        context = int(table[:, 2].max())
        engine.next_context = max(engine.next_context, context + 1)
        if color is None:
            return None
        members = sorted((int(k), r) for r, (c, k, _) in enumerate(table.tolist()) if c == color)
        world_ranks = [self._world[r] for _, r in members]
        return self._child(world_ranks, context)

    def group(self: Communicator, ranks: Sequence[int]) -> Communicator | None:  # type: ignore[misc]
        """A communicator of `ranks` (in that order); collective over this communicator.

        Every rank of this communicator calls it with the same list; the ones
        not in the list get None.

        Raises:
            ValueError: a rank out of range or listed twice.
        """
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.size for r in ranks):
            raise ValueError(f"group needs distinct ranks in [0, {self.size}); got {ranks}")
        if self.rank not in ranks:
            return self.split(None)
        return self.split(0, key=ranks.index(self.rank))

    def dup(self: Communicator) -> Communicator:  # type: ignore[misc]
        """A communicator of the same ranks with its own message space; collective."""
        child = self.split(0, key=self.rank)
        assert child is not None
        return child

    def _child(self: Communicator, world_ranks: list[int], context: int) -> Communicator:  # type: ignore[misc]
        from .comm import Communicator

        return Communicator(self._engine, self._transports, self.run_id, world_ranks=world_ranks,
                            context=context, parent=self)

    @property
    def world_ranks(self) -> list[int]:
        """The world rank of each rank of this communicator."""
        return list(self._world)

