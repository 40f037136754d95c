"""The reducing collectives of a Communicator, and how every collective runs.

all_reduce, reduce, reduce_scatter, broadcast and barrier live here, with
the machinery the others share (`tcoll.movement`, `tcoll.vcollectives`,
`tcoll.objects`).

Every method checks its arguments before anything is sent (a bad argument
is a ValueError or TypeError on the rank that made it), then runs the chosen
algorithm (see `tcoll.algos`) as a `CollectiveWork`. With
`async_op=True` the Work is returned; otherwise it is waited for and its
result returned.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import select
from .algos.registry import AlgorithmInfo, lookup
from .buffers import as_array, empty_like_kind
from .ops import Op, as_op
from .schedule import Algorithm, CollectiveWork, Team

if TYPE_CHECKING:
    from .arena import Arena
    from .engine import Engine

__all__ = ["CollectiveMethods"]


class CollectiveMethods:
    """Mixed into Communicator: the collectives on arrays and tensors."""

    rank: int
    size: int
    timeout: float
    _engine: Engine
    _world: list[int]
    _coll_ctx: int
    _sequence: int
    _forced: dict[str, str]  # TCOLL_ALGO: {collective: algorithm} used for "auto"
    _choices: dict[tuple[Any, ...], AlgorithmInfo]  # _choose's answers by call signature
    _direct_ok: bool | None  # every rank on this host (None: not found yet)
    _shm_arena: Arena | None

    # -- running ----------------------------------------------------------------

    def _team(self) -> Team:
        """A Team for the next collective call: every rank numbers its calls alike."""
        self._check_open()
        self._sequence += 1
        return Team(self._engine, self._world, self.rank, self._coll_ctx, self._sequence,
                    self._engine.settings.coll_chunk)

    def _choose(self, collective: str, algorithm: str, nbytes: int, op: Op | None = None,
                uneven: bool = False, blocking: bool = False, itemsize: int = 1) -> AlgorithmInfo:
        """The algorithm to run: the one asked for (checked), or the cost model's choice (cached).

        Args:
            blocking: the call waits for its result here, so a shared-memory direct
                algorithm may run it (when every rank shares this host).
            itemsize: bytes per element of a reduction (a share of a shared-memory
                slot must hold one element per rank).
        """
        ordered = op is not None and not op.commutative
        key = (collective, algorithm, nbytes, ordered, uneven, blocking, itemsize)
        info = self._choices.get(key)
        if info is None:
            direct = blocking and self._direct_capable()
            if direct and itemsize * self.size > self._engine.settings.shm_slot:
                if algorithm == "shm":
                    raise ValueError(f"{collective} algorithm 'shm': items of {itemsize} B do not fit the "
                                     f"shared-memory slot of {self.size} ranks; raise TCOLL_SHM_SLOT")
                direct = False
            info = self._resolve(collective, algorithm, nbytes, ordered, uneven, direct, blocking)
            if len(self._choices) >= 4096:
                self._choices.clear()
            self._choices[key] = info
        return info

    def _resolve(self, collective: str, algorithm: str, nbytes: int, ordered: bool, uneven: bool, direct: bool,
                 blocking: bool) -> AlgorithmInfo:
        if algorithm == "auto":
            forced = self._forced.get(collective, "auto")
            if forced != "auto" and (direct or not lookup(collective, forced).direct):
                algorithm = forced
        if algorithm == "auto":
            return select.choose(collective, nbytes, self.size, self._costs(), ordered=ordered, uneven=uneven,
                                 direct=direct)
        if not isinstance(algorithm, str):
            raise TypeError(f"algorithm must be a name, not {type(algorithm).__name__}")
        info = lookup(collective, algorithm)
        if ordered and not info.ordered:
            raise ValueError(f"{collective} algorithm {algorithm!r} reorders operands; the op is not "
                             "commutative (choose one of "
                             f"{', '.join(i.name for i in select.eligible(collective, ordered=True))})")
        if uneven and not info.uneven:
            raise ValueError(f"{collective} algorithm {algorithm!r} needs equal counts on every rank")
        if info.direct and not direct:
            why = ("it runs only blocking calls (async_op=False)" if not blocking else
                   "it needs every rank of the communicator on this host, connected by shared memory")
            raise ValueError(f"{collective} algorithm {algorithm!r} cannot run this call: {why}")
        return info

    def _run_direct(self, info: AlgorithmInfo, *args: Any, **kwargs: Any) -> Any:
        """Run a shared-memory direct algorithm; a failure anywhere in it breaks the arena.

        Whatever interrupts a call (an exception from a user op, a timeout,
        Ctrl-C) leaves this rank's step number out of step with the others',
        so later direct calls must refuse at once instead of waiting on steps
        that will never come.
        """
        arena = self._arena()
        try:
            return info.run(arena, *args, **kwargs)
        except BaseException as exc:
            if arena.broken is None:
                arena.broken = exc
            raise

    def _direct_capable(self) -> bool:
        """Whether every rank shares this host, so that shared-memory direct algorithms can run (found once)."""
        capable = self._direct_ok
        if capable is None:
            from .arena import Arena

            capable = self._direct_ok = Arena.usable(self._engine, self._world)
        return capable

    def _arena(self) -> Arena:
        """The communicator's shared-memory arena (made by the first direct call: collective)."""
        arena = self._shm_arena
        if arena is None:
            from .arena import Arena

            self._check_open()
            arena = self._shm_arena = Arena.create(self)
            self._engine.closers.append(arena.close)
        elif arena.broken is not None or self._closed:
            self._check_open()
            arena.check_usable()
        arena.timeout = self.timeout
        return arena

    def _costs(self) -> select.Costs:
        """The cost model of this communicator's slowest kind of link (found once: links do not change)."""
        costs = getattr(self, "_link_costs", None)
        if costs is None:
            kinds = {self._engine.transport_of(peer) for peer in self._world if peer != self._engine.rank}
            slowest = next((kind for kind in ("tcp", "shm", "loopback") if kind in kinds), "shm")
            costs = self._link_costs = select.COSTS[slowest]
        return costs

    def _run(self, team: Team, collective: str, info: AlgorithmInfo | str, body: Algorithm, nbytes: int,
             async_op: bool) -> Any:
        """Start `body` as a CollectiveWork; wait for it unless async_op.

        Args:
            info: the algorithm (or its name, when chosen inside `body`), for messages.
        """
        name = info if isinstance(info, str) else info.name
        return self._start(team, f"{collective} #{team.sequence} ({name}, {nbytes} B per rank)", body, async_op)

    def _start(self, team: Team, description: str, body: Algorithm, async_op: bool) -> Any:
        """Start `body` as a CollectiveWork named `description`; wait for it unless async_op."""
        work = CollectiveWork(self._engine, body, description, team).start()
        if async_op:
            return work
        try:
            return work.wait(self.timeout)
        except BaseException as exc:
            work.abort(exc)  # a timeout or interrupt: withdraw what is still posted
            raise

    def _call_algorithm(self, collective: str, name: str, *args: Any, async_op: bool = False) -> Any:
        """Run one registered algorithm directly on prepared flat buffers (for tests and benchmarks).

        Args:
            collective: e.g. "all_gather".
            name: the algorithm's name.
            *args: the algorithm's arguments after the team (see tcoll.algos.registry).
            async_op: return the Work instead of waiting.
        """
        info = lookup(collective, name)
        if info.direct:
            self._resolve(collective, name, 0, False, False, self._direct_capable() and not async_op, not async_op)
            return self._run_direct(info, *args)
        team = self._team()
        return self._run(team, collective, info, info.run(team, *args), 0, async_op)

    # -- the collectives --------------------------------------------------------

    def all_reduce(self, x: Any, op: str | Op = "sum", *, algorithm: str = "auto", async_op: bool = False) -> Any:
        """Reduce `x` over all ranks, in place on every rank.

        Args:
            x: a contiguous NumPy array or PyTorch CPU tensor (same shape and dtype on every rank).
            op: "sum", "prod", "min", "max", "avg", "band", "bor", "bxor", "land",
                "lor", "lxor", "maxloc", "minloc", or a tcoll.Op.
            algorithm: "auto", or one of tcoll.algorithms("all_reduce").
            async_op: return a Work instead of waiting.

        Returns:
            x (or a Work whose result() is x).

        Raises:
            TypeError: the op does not apply to the dtype; x is not a buffer.
            ValueError: x is not contiguous or is read-only; unknown algorithm.
        """
        flat, op = self._reduce_input(x, op, "all_reduce buffer")
        info = self._choose("all_reduce", algorithm, flat.nbytes, op, blocking=not async_op,
                            itemsize=flat.itemsize)
        if info.direct:
            self._run_direct(info, flat, op)
            op.finish(flat, self.size)
            return x
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, flat, op)
            op.finish(flat, team.size)
            return x

        return self._run(team, "all_reduce", info, body(), flat.nbytes, async_op)

    def reduce(self, x: Any, root: int = 0, op: str | Op = "sum", *, algorithm: str = "auto",
               async_op: bool = False) -> Any:
        """Reduce `x` over all ranks into `x` on `root`; x on the other ranks is left as it was.

        Args:
            x: a contiguous NumPy array or PyTorch CPU tensor.
            root: the rank that gets the result.
            op: a reduce op name or tcoll.Op (see all_reduce).
            algorithm: "auto", or one of tcoll.algorithms("reduce").
            async_op: return a Work instead of waiting.

        Returns:
            x (or a Work whose result() is x).

        Raises:
            TypeError, ValueError: as all_reduce; root out of range.
        """
        self._check_root(root)
        arr, op = self._reduce_input(x, op, "reduce buffer", writable=self.rank == root)
        flat = arr.reshape(-1)
        info = self._choose("reduce", algorithm, flat.nbytes, op, blocking=not async_op, itemsize=flat.itemsize)
        if info.direct:
            self._run_direct(info, flat, op, root)
            if self.rank == root:
                op.finish(flat, self.size)
            return x
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, flat, op, root)
            if team.rank == root:
                op.finish(flat, team.size)
            return x

        return self._run(team, "reduce", info, body(), flat.nbytes, async_op)

    def broadcast(self, x: Any, root: int = 0, *, algorithm: str = "auto", async_op: bool = False) -> Any:
        """Copy `x` of `root` into `x` of every rank.

        Args:
            x: a contiguous NumPy array or PyTorch CPU tensor (writable except on root).
            root: the rank whose data is sent.
            algorithm: "auto", or one of tcoll.algorithms("broadcast").
            async_op: return a Work instead of waiting.

        Returns:
            x (or a Work whose result() is x).

        Raises:
            ValueError: root out of range; x not contiguous, or read-only off the root.
            TypeError: x is not a buffer.
        """
        self._check_root(root)
        flat = as_array(x, writable=self.rank != root, what="broadcast buffer").reshape(-1)
        info = self._choose("broadcast", algorithm, flat.nbytes, blocking=not async_op)
        if info.direct:
            self._run_direct(info, flat, root)
            return x
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, flat, root)
            return x

        return self._run(team, "broadcast", info, body(), flat.nbytes, async_op)

    def reduce_scatter(self, x: Any, op: str | Op = "sum", out: Any = None, *, algorithm: str = "auto",
                       async_op: bool = False) -> Any:
        """Reduce `x` over all ranks and give rank r the r-th of `size` equal parts (along axis 0).

        Args:
            x: a contiguous array whose first dimension divides by size (left unchanged).
            op: a reduce op name or tcoll.Op (see all_reduce).
            out: where to write this rank's part, shape (x.shape[0] // size, *x.shape[1:]).
            algorithm: "auto", or one of tcoll.algorithms("reduce_scatter").
            async_op: return a Work instead of waiting.

        Returns:
            This rank's reduced part.

        Raises:
            ValueError: x.shape[0] does not divide by size; out has the wrong shape or dtype.
            TypeError: the op does not apply to the dtype.
        """
        arr, op = self._reduce_input(x, op, "reduce_scatter buffer", writable=False)
        if arr.ndim == 0 or arr.shape[0] % self.size:
            raise ValueError(f"reduce_scatter splits x along axis 0 into {self.size} equal parts; "
                             f"x has shape {arr.shape} (use reduce_scatterv for uneven parts)")
        part_shape = (arr.shape[0] // self.size, *arr.shape[1:])
        user_out, out_flat = self._output(x, arr, out, part_shape, "reduce_scatter")
        counts = [out_flat.size] * self.size
        return self._reduce_scatter_run(arr.reshape(-1), out_flat, user_out, counts, op, algorithm, async_op)

    def _reduce_scatter_run(self, send: np.ndarray, out_flat: np.ndarray, user_out: Any, counts: list[int],
                            op: Op, algorithm: str, async_op: bool) -> Any:
        uneven = len(set(counts)) > 1
        info = self._choose("reduce_scatter", algorithm, send.nbytes, op, uneven=uneven, blocking=not async_op,
                            itemsize=send.itemsize)
        if info.direct:
            self._run_direct(info, send, out_flat, counts, op)
            op.finish(out_flat, self.size)
            return user_out
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team, send, out_flat, counts, op)
            op.finish(out_flat, team.size)
            return user_out

        return self._run(team, "reduce_scatter", info, body(), send.nbytes, async_op)

    def barrier(self, *, algorithm: str = "auto", async_op: bool = False) -> Any:
        """Return once every rank has called barrier().

        Args:
            algorithm: "auto", or one of tcoll.algorithms("barrier").
            async_op: return a Work instead of waiting.
        """
        info = self._choose("barrier", algorithm, 0, blocking=not async_op)
        if info.direct:
            self._run_direct(info)
            return None
        team = self._team()

        def body() -> Algorithm:
            yield from info.run(team)

        return self._run(team, "barrier", info, body(), 0, async_op)

    # -- argument helpers -------------------------------------------------------

    def _check_root(self, root: Any) -> None:
        self._check_peer(root, "root")  # type: ignore[attr-defined]

    def _reduce_input(self, x: Any, op: str | Op, what: str, writable: bool = True) -> tuple[np.ndarray, Op]:
        """A reduction's buffer as a typed view, and its op checked against the dtype.

        Returns:
            (flat view if `writable`, else the view in its own shape; the resolved op).
        """
        arr = as_array(x, writable=writable, what=what)
        resolved = as_op(op)
        resolved.check(arr.dtype)
        return (arr.reshape(-1) if writable else arr), resolved

    def _output(self, like: Any, arr: np.ndarray, out: Any, shape: tuple[int, ...], what: str) -> tuple[Any, np.ndarray]:
        """The user's output (checked) or a new one like the input; returns (object, flat view)."""
        if out is None:
            user_out, view = empty_like_kind(like, shape, arr.dtype)
            return user_out, view.reshape(-1)
        view = as_array(out, writable=True, what=f"{what} out")
        if view.shape != shape or view.dtype != arr.dtype:
            raise ValueError(f"{what} out must have shape {shape} and dtype {arr.dtype}; "
                             f"got {view.shape} {view.dtype}")
        return out, view.reshape(-1)
