"""Which algorithm runs a call: the one asked for (checked), a forced one (TCOLL_ALGO), or the cost model's.

The dispatcher asks for every call; the answer is cached per kind of call, so
the cost model runs once per (collective, size, op order, ...) a program uses.
"""

from __future__ import annotations

from typing import Any

from ..algos import hierarchy, select
from ..algos.registry import AlgorithmInfo, lookup
from ..ops import Op
from ..p2p.engine import Engine
from ..shm.address import agreed_slot
from ..shm.arena import Arena

__all__ = ["Chooser"]


class Chooser:
    """Chooses the algorithms of one communicator's calls.

    Args:
        engine: the rank's engine (its settings and links).
        world: the world rank of each rank of the communicator.
    """

    def __init__(self, engine: Engine, world: list[int]) -> None:
        self.engine = engine
        self.world = world
        self.size = len(world)
        self._forced = engine.settings.forced_algorithms()  # TCOLL_ALGO: {collective: algorithm} for "auto"
        self._choices: dict[tuple[Any, ...], AlgorithmInfo] = {}
        self._direct_ok: bool | None = None
        self._costs: select.Costs | None = None
        self._topology: select.Topology | None | bool = False  # False: not found yet

    def forced(self, collective: str) -> str | None:
        """The algorithm TCOLL_ALGO forces for `collective`, if any."""
        return self._forced.get(collective)

    def choose(self, collective: str, algorithm: str, nbytes: int, op: Op | None = None, uneven: bool = False,
               blocking: bool = False, itemsize: int = 1) -> AlgorithmInfo:
        """The algorithm to run: the one asked for (checked), or the cost model's choice (cached).

        Args:
            blocking: the call waits for its result here, so a direct algorithm may
                run it (when every rank shares this host).
            itemsize: bytes per element of a reduction (a share of a shared-memory
                slot must hold one element per rank).

        Raises:
            ValueError: an unknown algorithm, or one that cannot run this call.
        """
        ordered = op is not None and not op.commutative
        key = (collective, algorithm, nbytes, ordered, uneven, blocking, itemsize)
        info = self._choices.get(key)
        if info is None:
            direct = blocking and self.direct_capable()
            if direct and itemsize * self.size > self.slot_bytes():
                if algorithm == "shm":
                    raise ValueError(f"{collective} algorithm 'shm': items of {itemsize} B do not fit the "
                                     f"shared-memory slot of {self.size} ranks; raise TCOLL_SHM_SLOT")
                direct = False
            info = self.resolve(collective, algorithm, nbytes, ordered, uneven, direct, blocking)
            if len(self._choices) >= 4096:
                self._choices.clear()
            self._choices[key] = info
        return info

    def resolve(self, collective: str, algorithm: str, nbytes: int, ordered: bool, uneven: bool, direct: bool,
                blocking: bool) -> AlgorithmInfo:
        """The algorithm for a call whose kind is known (no cache): `algorithm` checked, or auto's choice.

        Raises:
            ValueError: an unknown algorithm, or one that cannot run this call.
        """
        if algorithm == "auto":
            forced = self._forced.get(collective, "auto")
            if forced != "auto" and _can_run(lookup(collective, forced), ordered, uneven, direct):
                algorithm = forced  # else auto: a forced algorithm that cannot run this call falls back
        if algorithm == "auto":
            return select.choose(collective, nbytes, self.size, self.costs(), ordered=ordered, uneven=uneven,
                                 direct=direct, topology=self.topology())
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a name, not {type(algorithm).__name__}")
        info = lookup(collective, algorithm)
        if ordered and not info.ordered:
            raise ValueError(f"{collective} algorithm {algorithm!r} reorders operands; the op is not "
                             "commutative (choose one of "
                             f"{', '.join(i.name for i in select.eligible(collective, ordered=True))})")
        if uneven and not info.uneven:
            raise ValueError(f"{collective} algorithm {algorithm!r} needs equal counts on every rank")
        if not direct and info.direct:
            why = ("it runs only blocking calls (async_op=False)" if not blocking else
                   "it needs every rank of the communicator on this host, connected by shared memory")
            raise ValueError(f"{collective} algorithm {algorithm!r} cannot run this call: {why}")
        return info

    def topology(self) -> select.Topology | None:
        """The hosts of this communicator as the cost model sees them (None: one host; found once)."""
        if self._topology is False:
            self._topology = hierarchy.world_topology(self.engine, self.world)
        return self._topology  # type: ignore[return-value]

    def costs(self) -> select.Costs:
        """The cost model of this communicator's slowest kind of link (found once: links do not change)."""
        topology = self.topology()
        if topology is not None:
            return topology.inter
        if self._costs is None:
            kinds = {self.engine.transport_of(peer) for peer in self.world if peer != self.engine.rank}
            slowest = next((kind for kind in ("tcp", "shm", "loopback") if kind in kinds), "shm")
            self._costs = select.COSTS[slowest]
        return self._costs

    def slot_bytes(self) -> int:
        """The bytes of an arena slot that every rank can count on when it chooses (TCOLL_SHM_SLOT).

        Where the setting is the default, rank 0 sizes the arena larger if it finds the host's ranks
        outnumber its cores; ranks may see that differently (their CPU affinity), so choices rest on
        the default's smaller size, which every rank computes alike and no arena falls short of.
        """
        return agreed_slot(self.engine.settings.shm_slot, self.size)

    def direct_capable(self) -> bool:
        """Whether every rank shares this host, so that direct algorithms can run (found once)."""
        if self._direct_ok is None:
            self._direct_ok = Arena.usable(self.engine, self.world)
        return self._direct_ok


def _can_run(info: AlgorithmInfo, ordered: bool, uneven: bool, direct: bool) -> bool:
    """Whether `info` can run a call that needs rank order / uneven counts, and may run direct."""
    return (info.ordered or not ordered) and (info.uneven or not uneven) and (direct or not info.direct)
