"""Work handles: what a non-blocking operation returns.

`Work` is the public handle (wait / done / exception / result). `SendWork` and
`RecvWork` are the point-to-point requests that transports move data for; a
transport reads and updates their fields directly, under the engine's lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import fresh

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["Work", "SendWork", "RecvWork", "GroupWork", "wait_any", "wait_all", "test_some"]


class Work:
    """The handle of a non-blocking operation.

    Args:
        engine: the engine whose progress completes this work.
        description: names the operation in error messages, e.g. "recv from rank 3 (tag 7)".
    """

    __slots__ = ("_engine", "_description", "_done", "_error", "_value", "_callbacks")

    def __init__(self, engine: Engine | None, description: str = "") -> None:
        self._engine = engine
        self._description = description
        self._done = False
        self._error: BaseException | None = None
        self._value: Any = None
        self._callbacks: list[Callable[[Work], None]] | None = None

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the operation completes, then return its result.

        Args:
            timeout: seconds to wait at most; None uses the communicator's timeout.

        Returns:
            The operation's result (for a receive, the receive buffer).

        Raises:
            tcoll.TimeoutError: not complete in time; names the peers still awaited.
            tcoll.PeerLostError: a peer this operation needs is gone.
            tcoll.TcollError: the operation failed in another way.
        """
        if not self._done and self._engine is not None:
            self._engine.wait(self, timeout)
        if self._error is not None:
            raise fresh(self._error)  # (the kept one would keep this caller's frames)
        return self._value

    def done(self) -> bool:
        """Make progress once and tell whether the operation has completed (or failed)."""
        if not self._done and self._engine is not None:
            self._engine.poll()
        return self._done

    def exception(self) -> BaseException | None:
        """The error the operation failed with, or None (not failed, or not finished yet)."""
        self.done()
        return self._error

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the operation and return its result (same as wait())."""
        return self.wait(timeout)

    def cancel(self) -> bool:
        """Withdraw the operation if no data has moved for it yet.

        Only a receive that no message has matched can be withdrawn: it fails
        with TcollError ("cancelled") and the message goes to the next matching
        receive. Anything else completes as usual.

        Returns:
            True if the operation was withdrawn.
        """
        return False

    @property
    def description(self) -> str:
        """Names the operation in error messages, e.g. "recv from rank 3 (tag 7)"."""
        return self._description

    @property
    def finished(self) -> bool:
        """Whether the operation has completed or failed, as of now (done() makes progress first)."""
        return self._done

    @property
    def failure(self) -> BaseException | None:
        """The error the operation failed with, or None, as of now (exception() makes progress first)."""
        return self._error

    def peers(self) -> list[int]:
        """The world ranks this operation still waits on (for timeout and liveness)."""
        return []

    def add_done_callback(self, fn: Callable[[Work], None]) -> None:
        """Call fn(work) once the work completes or fails (at once if it already has).

        Callbacks run on the thread that makes the progress, under the engine's
        lock: they must be short and must not block.
        """
        if self._done:
            fn(self)
        elif self._callbacks is None:
            self._callbacks = [fn]
        else:
            self._callbacks.append(fn)

    def _finish(self, value: Any = None) -> None:
        """Mark the work complete with a value and run (or schedule) its callbacks."""
        if self._done:
            return
        self._value = value
        self._done = True
        self._schedule_callbacks()

    def _fail(self, error: BaseException) -> None:
        """Mark the work failed and run (or schedule) its callbacks."""
        if self._done:
            return
        self._error = error
        self._done = True
        self._schedule_callbacks()

    def _schedule_callbacks(self) -> None:
        if not self._callbacks:
            return
        engine = self._engine
        if engine is not None and engine.in_progress:
            engine.deferred.append(self)  # the engine runs them once its channels are consistent
        else:
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else ("done" if self._done else "pending")
        return f"<Work {self.description}: {state}>"


class SendWork(Work):
    """A send in flight: `data` (flat uint8 view) goes to world rank `peer`.

    Transports use `offset` (payload bytes already handed over) and
    `header_sent`; the engine completes the work.
    """

    __slots__ = ("peer", "ctx", "tag", "data", "nbytes", "offset", "header_sent", "user_buffer", "stamp")

    def __init__(self, engine: Engine, peer: int, ctx: int, tag: int, data: np.ndarray, user_buffer: Any,
                 stamp: int = 0) -> None:
        super().__init__(engine)
        self.peer = peer
        self.ctx = ctx
        self.tag = tag
        self.data = data
        self.nbytes = data.nbytes
        self.offset = 0
        self.header_sent = False
        self.user_buffer = user_buffer
        self.stamp = stamp  # what call the message belongs to (tcoll.algos.stamps); 0 for user messages

    @property
    def description(self) -> str:
        return f"send to rank {self.peer} (tag {self.tag}, {self.nbytes} B)"

    def peers(self) -> list[int]:
        return [] if self._done else [self.peer]


class RecvWork(Work):
    """A receive: the message from world rank `peer` lands in `data` (flat uint8 view).

    `data` is None for a message being discarded (it did not fit its buffer).
    `nbytes` is the size of the message once its header has arrived, and
    `offset` counts the payload bytes received so far. An unexpected message
    (no receive posted yet) gets a RecvWork of its own with a private buffer;
    `forward` then names the user's receive it must be copied into.

    `stamp` is the stamp the receive expects (None: any, as for user
    messages); `seen` the stamp the message carried.
    """

    __slots__ = ("peer", "ctx", "tag", "data", "capacity", "nbytes", "offset", "user_buffer", "forward", "stamp",
                 "seen", "watch", "order", "ranks")

    def __init__(self, engine: Engine, peer: int, ctx: int, tag: int, data: np.ndarray | None, user_buffer: Any,
                 description: str = "", stamp: int | None = None) -> None:
        super().__init__(engine, description)
        self.peer = peer
        self.ctx = ctx
        self.tag = tag
        self.data = data
        self.capacity = 0 if data is None else int(data.nbytes)
        self.nbytes = -1
        self.offset = 0
        self.user_buffer = user_buffer
        self.forward: RecvWork | None = None
        self.stamp = stamp
        self.seen = 0
        self.watch: Any = None  # a notice's watcher: told once the payload is in
        self.order = 0  # when it was posted (or, for a message that came early, when it came)
        self.ranks: list[int] | None = None  # the world rank of each rank of the user's communicator

    @property
    def source(self) -> int:
        """The rank (of the communicator it was posted on) whose message it received; -1 until matched."""
        if self.peer < 0 or self.ranks is None:
            return self.peer
        return self.ranks.index(self.peer) if self.peer in self.ranks else self.peer

    @property
    def description(self) -> str:
        if self._description:
            return self._description
        peer = "any rank" if self.peer < 0 else f"rank {self.peer}"
        return f"recv from {peer} (tag {'any' if self.tag < 0 else self.tag}, up to {self.capacity} B)"

    def cancel(self) -> bool:
        """Withdraw this receive unless a message already matched it (see Work.cancel)."""
        if self._done or self._engine is None:
            return False
        return self._engine.cancel(self)

    def _fail(self, error: BaseException) -> None:
        """Fail this receive, and the user's receive that adopted it while it was arriving."""
        super()._fail(error)
        if self.forward is not None:
            self.forward._fail(error)

    def peers(self) -> list[int]:
        return [] if self._done or self.peer < 0 else [self.peer]


class GroupWork(Work):
    """A Work made of several: done when all of its parts are, failed with the first part that fails.

    Args:
        engine: the parts' engine.
        parts: the Works it is made of.
        value: what result() returns once every part completed (a callable: called then, with no argument).
        description: names it in errors.
        status: the receive whose `source`, `tag` and `nbytes` it tells (sendrecv's).
    """

    __slots__ = ("parts", "_left", "_outcome", "status")

    def __init__(self, engine: Engine | None, parts: Sequence[Work], value: Any, description: str,
                 status: RecvWork | None = None) -> None:
        super().__init__(engine, description)
        self.parts = list(parts)
        self._left = len(self.parts)
        self._outcome = value
        self.status = status
        if not self.parts:
            self._finish(value() if callable(value) else value)
        for part in self.parts:
            part.add_done_callback(self._part_done)

    def _part_done(self, part: Work) -> None:
        self._left -= 1
        if part._error is not None:
            self._fail(part._error)
        elif self._left == 0 and not self._done:
            try:
                self._finish(self._outcome() if callable(self._outcome) else self._outcome)
            except Exception as exc:  # noqa: BLE001 - e.g. unpickling: the work's failure
                self._fail(exc)

    def cancel(self) -> bool:
        """Withdraw the receives among the parts that no message has matched yet."""
        return any([part.cancel() for part in self.parts])

    def peers(self) -> list[int]:
        return sorted({peer for part in self.parts for peer in part.peers()})

    @property
    def source(self) -> int:
        """The rank its receive took a message from (-1: it has none, or not yet)."""
        return -1 if self.status is None else self.status.source

    @property
    def tag(self) -> int:
        """The tag of the message its receive took (-1: it has none, or not yet)."""
        return -1 if self.status is None else self.status.tag

    @property
    def nbytes(self) -> int:
        """The size of the message its receive took (-1: it has none, or not yet)."""
        return -1 if self.status is None else self.status.nbytes


def wait_all(works: Sequence[Work], timeout: float | None = None) -> list[Any]:
    """Wait for every one of `works`; return their results in order.

    Args:
        works: Works (of any calls of one engine; none is fine).
        timeout: seconds to wait for all, at most (None: each work's engine's timeout setting).

    Returns:
        [work.result() for work in works].

    Raises:
        tcoll.TimeoutError: not all completed in time.
        The first error of a failed work (after all have been waited for).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    error: BaseException | None = None
    results = []
    for work in works:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            results.append(work.wait(left))
        except BaseException as exc:  # noqa: BLE001 - the others are still waited for
            if _timed_out(exc):
                raise
            error = error or exc
            results.append(None)
    if error is not None:
        raise error
    return results


def _timed_out(exc: BaseException) -> bool:
    from ..errors import TimeoutError

    return isinstance(exc, TimeoutError)


def test_some(works: Sequence[Work]) -> list[int]:
    """Make progress once and return the indices of the works that are done (completed or failed)."""
    engine = next((w._engine for w in works if w._engine is not None and not w._done), None)
    if engine is not None:
        engine.poll()
    return [index for index, work in enumerate(works) if work._done]


test_some.__test__ = False  # type: ignore[attr-defined]  # not a test, for pytest


def wait_any(works: Sequence[Work], timeout: float | None = None) -> int:
    """Block until one of `works` has completed (or failed); return its index.

    Whoever waits makes progress for every operation of the engine, so the
    works need not belong to one call.

    Args:
        works: at least one Work.
        timeout: seconds to wait at most (None: the engine's timeout setting).

    Returns:
        The index of a completed work (the lowest, if several are).

    Raises:
        ValueError: `works` is empty.
        tcoll.TimeoutError: none completed in time; names the peers still awaited.
    """
    if not works:
        raise ValueError("wait_any needs at least one Work")
    engine = next((w._engine for w in works if w._engine is not None), None)
    limit = engine.settings.timeout if timeout is None and engine is not None else timeout
    deadline = None if limit is None else time.monotonic() + limit
    while True:
        for index, work in enumerate(works):
            if work._done:
                return index
        left = None if deadline is None else deadline - time.monotonic()
        if engine is None or (left is not None and left <= 0):
            from ..errors import TimeoutError

            peers = sorted({peer for work in works for peer in work.peers()})
            raise TimeoutError(f"none of {len(works)} operations completed within {limit:g} s; "
                               f"still waiting on rank(s) {peers}", peers)
        engine.block_unless(lambda: any(w._done for w in works), min(1.0, left if left is not None else 1.0))
