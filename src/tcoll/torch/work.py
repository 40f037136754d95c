"""The Work every call of the tcoll torch backend returns, and how several are chained into one.

`TcollWork` holds the tcoll Works a call started and what to do once they
are done. `wait()` completes them (raising what they failed with), and so
does `get_future()`, which gives a Future already completed with the list of
output tensors. A Future is never completed with an exception or with None:
in torch 2.13 either crashes the process (SIGSEGV) inside DDP's C++
allreduce hook.
"""

from __future__ import annotations

import copy
import datetime
import functools
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..comm.calls import numbered
from ..errors import TimeoutError as TcollTimeout

if TYPE_CHECKING:
    from .process_group import ProcessGroupTcoll

__all__ = ["TcollWork", "completed", "detached", "forget_frames", "async_requested", "Held", "Finish", "drop_held",
           "held_calls", "run_held", "seconds", "each", "chain", "result_of", "timed_out", "counted"]

Finish = Callable[[], None]
_TIMED_OUT = "[tcoll] Timed out - "


def timed_out(exc: TcollTimeout) -> TcollTimeout:
    """tcoll's timeout, worded as torch's backends word theirs (" Timed out ", which torch's tests look for).

    The new error keeps tcoll's own message (which call, which ranks it still
    waited on) and its `peers`, and is raised `from` the original.
    """
    if str(exc).startswith(_TIMED_OUT):
        return exc
    worded = TcollTimeout(_TIMED_OUT + str(exc))
    vars(worded).update(vars(exc))  # peers, and whether the other ranks know of it
    return worded


def seconds(timeout: Any) -> float | None:
    """A torch timeout (timedelta, milliseconds or None; zero or negative means none) in seconds."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout) / 1000.0
    return seconds if seconds > 0 else None


def detached(exc: BaseException) -> BaseException:
    """What to raise to the caller for `exc`, an error caught from tcoll: a copy with the traceback `exc` had.

    An error that is kept must keep no frames. A traceback holds the frames it
    passed through, and each frame its caller, up to the user's code; tcoll
    keeps some errors (a lost peer's, a revoked communicator's, a Work's) and
    raises them again, so those frames, and what they hold, would live as long
    as the error: a DDP model, for one, whose reducer would then go on taking
    the gradients of the module it wrapped long after it was dropped, and a
    reducer that keeps the failed Work makes a cycle that no collection breaks.
    So the caller gets a copy, which goes when it lets it go, and `exc` and
    the errors it came from lose their tracebacks. Raise the copy
    `from exc.__cause__` (the chain as it was). An error that does not copy
    alike is returned as it is.
    """
    try:
        fresh = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an error that does not copy is raised as it is
        return exc
    if type(fresh) is not type(exc) or fresh.args != exc.args:
        return exc
    fresh.with_traceback(exc.__traceback__)
    forget_frames(exc)
    return fresh


def forget_frames(exc: BaseException | None) -> None:
    """Drop the tracebacks of `exc` and of the errors it was raised from or during (see `detached`)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        if exc.__cause__ is not None and exc.__context__ is not None and exc.__cause__ is not exc.__context__:
            forget_frames(exc.__context__)
        exc = exc.__cause__ if exc.__cause__ is not None else exc.__context__


def async_requested(opts: Any) -> bool | None:
    """How to run a call: True, start it asynchronously (asked for, and TCOLL_TORCH_ASYNC=1); None, hold it
    until it is waited for (asked for async_op; see Held); False, run it now."""
    if not getattr(opts, "asyncOp", False):
        return False
    return True if os.environ.get("TCOLL_TORCH_ASYNC", "0") == "1" else None


_Method = Callable[..., Any]


def counted(label: str) -> Callable[[_Method], _Method]:
    """Make a process group method one numbered tcoll call even when the backend's own checks fail on this rank.

    The backend checks torch's arguments (list lengths, sizes, ops) before it
    calls tcoll. Where such a check fails on one rank only, that rank still
    takes the call's sequence number and tells the others (tcoll's
    `numbered`), so their call fails too (tcoll.PeerFailedError) instead of
    pairing with this rank's next call. Calls held back before it run first,
    so that numbers are taken in the order the calls were made.
    """

    def wrap(fn: _Method) -> _Method:
        run = numbered(label)(lambda comm, pg, args, kwargs: fn(pg, *args, **kwargs))

        @functools.wraps(fn)
        def method(pg: Any, *args: Any, **kwargs: Any) -> Any:
            if held_calls:
                run_held()
            return run(pg.comm, pg, args, kwargs)

        return method

    return wrap


held_calls: list[Held] = []  # calls held back until waited for, in the order they were made (every group's)


def run_held() -> None:
    """Run every held call now, in order (each with its group's timeout); their errors wait for their wait()."""
    while held_calls:
        held_calls[0].run(None)


def drop_held(comm: Any, error: BaseException) -> None:
    """Fail the held calls of `comm` with `error` instead of running them (the group is aborted)."""
    for held in [h for h in held_calls if h.comm is comm]:
        held_calls.remove(held)
        held.ran, held.error = True, error


class Held:
    """A blocking call held back until its Work is waited for, so that `wait(timeout)` bounds it.

    A call made with async_op=True (torch's C++ callers, DDP's reducer
    among them, always ask for that) runs as a blocking tcoll call when its
    Work is first waited for, asked for its Future or polled, or when the
    process makes any other call on a tcoll group, whichever comes first; so
    calls run in the order they were made, on every rank. A timeout given to
    `wait` bounds the call (and only that one); the calls held before it run
    first, with their groups' timeouts.
    """

    __slots__ = ("comm", "start", "ran", "error")

    def __init__(self, comm: Any, start: Callable[[bool], Any]) -> None:
        self.comm, self.start = comm, start
        self.ran = False
        self.error: BaseException | None = None
        held_calls.append(self)

    def run(self, timeout: float | None) -> None:
        """Run the calls held before this one, then this one, bounded by `timeout` (None: the group's)."""
        while held_calls and not self.ran:
            first = held_calls.pop(0)
            first._run(timeout if first is self else None)

    def _run(self, timeout: float | None) -> None:
        self.ran = True
        saved = self.comm.timeout
        if timeout is not None:
            self.comm.timeout = timeout
        try:
            self.start(False)
        except TcollTimeout as exc:
            self.error = timed_out(exc)
            self.error.__cause__ = exc
        except Exception as exc:  # noqa: BLE001 - kept for this call's wait(), as an asynchronous call's would be
            self.error = exc
        finally:
            forget_frames(self.error)  # kept: it must not keep this call's callers (see `detached`)
            self.comm.timeout = saved

    def wait(self, timeout: float | None = None) -> None:
        self.run(timeout)
        if self.error is not None:
            raise self.error

    def done(self) -> bool:
        self.run(None)
        return True

    def exception(self) -> BaseException | None:
        return self.error


class TcollWork(dist._Work):
    """What every call returns: the tcoll Works it started, and what to do once they are done.

    `wait()` completes them (raising what they failed with), `get_future()`
    too, and gives a Future already completed with the list of output tensors.
    """

    # What a Work that is complete when made has: class defaults, so that making one sets two attributes.
    _pending: Sequence[Any] = ()
    _finish: Finish | None = None
    _error: BaseException | None = None
    _future: Future | None = None
    _source = -1

    def __init__(self, pg: ProcessGroupTcoll, outputs: list[torch.Tensor], pending: Sequence[Any] = (),
                 finish: Finish | None = None, source: int = -1) -> None:
        super().__init__()
        self._pg = pg
        self._outputs = outputs
        if source != -1:
            self._source = source
        if pending:
            self._pending = list(pending)
        if finish is not None:
            self._finish = finish
            if not pending:
                self._run_finish()

    def _run_finish(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            try:
                finish()
            except BaseException as exc:
                self._error = exc
                raise detached(exc) from exc.__cause__

    def _complete(self, timeout: float | None) -> None:
        """Wait for every tcoll Work, then run the finishing step; raise what failed."""
        if self._error is not None:
            raise detached(self._error) from self._error.__cause__
        if held_calls and not (self._pending and isinstance(self._pending[0], Held)):
            run_held()  # what was held runs before this Work is waited for, as it would have run first
        budget = self._pg.comm.timeout if timeout is None else timeout
        while self._pending:
            work = self._pending[0]
            try:
                work.wait(budget)
            except BaseException as exc:
                abort = getattr(work, "abort", None)
                if abort is not None:
                    abort(exc)
                self._error, self._pending = exc, []
                if isinstance(exc, TcollTimeout) and timed_out(exc) is not exc:
                    self._error = timed_out(exc)
                    raise detached(self._error) from exc
                raise detached(exc) from exc.__cause__
            self._pending.pop(0)
        self._run_finish()

    def wait(self, timeout: Any = None) -> bool:
        """Block until the operation completes; raise the error it failed with."""
        if self._pending or self._finish is not None or self._error is not None or held_calls:
            self._complete(seconds(timeout))
        return True

    def get_future(self) -> Future:
        """A Future holding the output tensors; completes the operation first (raising if it failed)."""
        if self._future is None:
            self._complete(None)
            future: Future = Future()
            future.set_result(self._outputs)
            self._future = future
        return self._future

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        return all(work.done() for work in self._pending)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None and all(w.exception() is None for w in self._pending)

    def exception(self) -> BaseException | None:
        if self._error is not None:
            return self._error
        return next((w.exception() for w in self._pending if w.exception() is not None), None)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        self.wait()
        return self._source

    def _source_rank(self) -> int:
        return self.source_rank()

    def block_current_stream(self) -> None:
        self.wait()

    def get_future_result(self) -> Future:
        return self.get_future()


class _Completed(TcollWork):
    """A TcollWork made complete, with torch's own constructor: the cheapest Work torch accepts."""

    __init__ = dist._Work.__init__


def completed(pg: ProcessGroupTcoll, outputs: list[torch.Tensor]) -> TcollWork:
    """The Work of a call that completed inside it (a blocking dist.all_reduce): nothing to wait for.

    Made per call (a Work someone keeps must keep its own outputs), at about
    half the cost of TcollWork(pg, outputs): that is a tenth of a small call.
    """
    work = _Completed()
    work._pg, work._outputs = pg, outputs
    return work


def each(steps: Any) -> Finish:
    steps = list(steps)

    def run() -> None:
        for step in steps:
            step()

    return run


def chain(pg: ProcessGroupTcoll, works: list[TcollWork], outputs: list[torch.Tensor]) -> TcollWork:
    """One Work for several: waiting for it waits for each."""

    def finish() -> None:
        for work in works:
            work.wait()

    # A Work that is not tcoll's (a call routed to another device's backend, tcoll.torch.devices) is waited as is.
    pending = [_Waitable(w) if isinstance(w, TcollWork) else _Foreign(w) for w in works
               if not isinstance(w, TcollWork) or w._pending]
    return TcollWork(pg, outputs, pending, finish)


class _Waitable:
    """Lets a TcollWork wait for another TcollWork as if it were a tcoll Work."""

    def __init__(self, work: TcollWork) -> None:
        self.work = work

    def wait(self, timeout: float | None = None) -> None:
        self.work._complete(timeout)

    def done(self) -> bool:
        return self.work.is_completed()

    def exception(self) -> BaseException | None:
        return self.work.exception()


def result_of(work: Any) -> Any:
    """The value of a tcoll call: the Work's result if it was started async, else the value itself."""
    return work.result() if hasattr(work, "result") and hasattr(work, "done") else work


class _Foreign:
    """Lets a TcollWork wait for another backend's torch Work as if it were a tcoll Work."""

    def __init__(self, work: Any) -> None:
        self.work = work

    def wait(self, timeout: float | None = None) -> None:
        if timeout:
            self.work.wait(datetime.timedelta(seconds=timeout))
        else:
            self.work.wait()

    def done(self) -> bool:
        return bool(self.work.is_completed())

    def exception(self) -> BaseException | None:
        return None if self.work.is_success() else self.work.exception()
