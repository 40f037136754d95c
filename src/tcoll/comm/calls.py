"""What a collective call is, once its arguments are checked: a Call, or a Program of Calls.

The collective methods (tcoll.comm.reductions, movement, uneven, objects)
describe each call with a `Call` and hand it to the communicator's
dispatcher (tcoll.comm.dispatch). `numbered` makes a method take its
sequence number even when its argument checks fail on this rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algos.stamps import stamp
from ..ops import Op

if TYPE_CHECKING:
    from ..algos.registry import AlgorithmInfo

__all__ = ["Call", "Prepared", "Program", "numbered"]


class Call:
    """One collective call (or one step of a program), its arguments checked.

    Args:
        collective: the registry's name ("all_reduce", ...).
        args: the algorithm's arguments after the team or arena (see tcoll.algos.registry).
        nbytes: one rank's input in bytes, for the cost model.
        label: the user's name for the call, in messages (default: collective).
        op: the reduce op, if any (finish() applies its last touch, e.g. avg's division).
        itemsize: bytes per element of a reduction (a slot share must hold one per rank).
        uneven: the ranks' counts differ.
        algorithm: "auto" or the algorithm asked for.
        result: what the call returns.
        finish_buf: the reduced data op.finish touches (None: nothing to finish on this rank).
        staged: (place, block): this rank's own block, which team algorithms expect in
            place (copied there first) and direct ones take as their last argument.
        dtype, count, root: what the stamp says of the data (every rank must pass the same).
        contributions: how many ranks' data finish_buf holds, for op.finish (None: every rank's).
        copies: (place, block) pairs copied at the start of every run, before the algorithm (this
            rank's own block of an output, which no algorithm moves).
    """

    __slots__ = ("collective", "args", "nbytes", "label", "op", "itemsize", "uneven", "algorithm", "result",
                 "finish_buf", "staged", "dtype", "count", "root", "contributions", "copies")

    def __init__(self, collective: str, args: tuple[Any, ...], nbytes: int, *, label: str | None = None,
                 op: Op | None = None, itemsize: int = 1, uneven: bool = False, algorithm: str = "auto",
                 result: Any = None, finish_buf: np.ndarray | None = None,
                 staged: tuple[np.ndarray, np.ndarray] | None = None, dtype: np.dtype | None = None,
                 count: int = 0, root: int = 0, contributions: int | None = None,
                 copies: tuple[tuple[np.ndarray, np.ndarray], ...] = ()) -> None:
        self.collective = collective
        self.args = args
        self.nbytes = nbytes
        self.label = label or collective
        self.op = op
        self.itemsize = itemsize
        self.uneven = uneven
        self.algorithm = algorithm
        self.result = result
        self.finish_buf = finish_buf
        self.staged = staged
        self.dtype = dtype
        self.count = count
        self.root = root
        self.contributions = contributions
        self.copies = copies

    def stamp(self, algorithm: str | None) -> int:
        """The call's stamp with the algorithm that runs it (tcoll.algos.stamps)."""
        return stamp(self.label, self.collective, self.op, self.dtype, self.count, self.root, algorithm)

    def finish(self, size: int) -> Any:
        """The call's last touch on this rank (avg divides), and its result."""
        if self.finish_buf is not None and self.op is not None:
            self.op.finish(self.finish_buf, size if self.contributions is None else self.contributions)
        return self.result


class Prepared:
    """A call whose algorithm is chosen and whose stamp is computed, to run again and again.

    Attributes:
        call: the call (its buffers bound).
        info: the algorithm that runs it (None while a plan captures it).
        stamp: its stamp (tcoll.algos.stamps).
        async_op: it runs as a Work.
        finishes: call.finish has work to do (avg divides, logical ops normalise); else it returns call.result.
    """

    __slots__ = ("call", "info", "stamp", "async_op", "finishes")

    def __init__(self, call: Call, info: AlgorithmInfo | None, stamp: int, async_op: bool) -> None:
        self.call, self.info, self.stamp, self.async_op = call, info, stamp, async_op
        op = call.op
        self.finishes = call.finish_buf is not None and op is not None and type(op).finish is not Op.finish


Program = Generator[Call, Any, Any]  # yields a Call per step, gets its result, returns the call's
_Method = Callable[..., Any]


def numbered(label: str) -> Callable[[_Method], _Method]:
    """Make a collective method take its sequence number even when it fails before it is dispatched.

    A bad argument on one rank raises there (ValueError, TypeError) before
    anything is sent; the call still takes its number and the other ranks
    are told, so their part of the call fails too and later calls still pair.
    On a closed or revoked communicator the call raises that first
    (TcollError, RevokedError), whatever its arguments.
    """

    def wrap(fn: _Method) -> _Method:
        @functools.wraps(fn)
        def method(comm: Any, *args: Any, **kwargs: Any) -> Any:
            core = comm.core
            if not core.usable:
                core.check_open()
            dispatcher = core.dispatch
            before = dispatcher.sequence
            try:
                return fn(comm, *args, **kwargs)
            except Exception as exc:
                if dispatcher.sequence == before and not dispatcher.capturing:  # (a plan's checks: local)
                    dispatcher.failed_unnumbered(label, exc)
                raise

        return method

    return wrap
