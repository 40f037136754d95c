"""Persistent collectives (MPI-4's MPI_Allreduce_init and kin) and the lean path of repeated calls.

A *plan* is a collective call checked and bound once and run many times:

    plan = comm.all_reduce_init(x, op="sum")
    for step in range(steps):
        x[...] = local_gradient()
        plan()                        # blocking: the shared-memory arena on one host
    plan.start(); ...; plan.wait()    # or started now, waited for later (a Work, point-to-point)

Making the plan runs the collective method's argument checks, allocates its
output (if the call has one), chooses the algorithm and computes the call's
stamp; each run is then only the data movement. Every run still takes the
next sequence number, and its messages and arena descriptors carry the
stamp, so a rank whose plan differs, or that runs something else at that
point, is a MismatchError on every rank, as for an ordinary call. The
blocking form and start() are different calls to the other ranks (as
`async_op` is): make the same one on every rank. A plan's checks are local:
one that fails raises on that rank only and takes no sequence number.

A call of several steps (scatter across hosts, the v-collectives and the
object collectives), root's part of a scatter on one host (the description
it sends is made anew) and a call whose input had to be copied (its input
overlaps its output) are checked again at every run: they have no fixed
buffers to bind.

The *lean path* gives ordinary blocking calls the same saving when they
repeat: all_reduce, reduce, broadcast and barrier keep the prepared call of
up to LEAN_ENTRIES recent buffers of at most LEAN_BYTES, keyed by the
buffer's identity and the call's arguments and re-validated by shape, dtype
and flags at each call (a cached buffer stays referenced until it drops out).
all_gather, gather, all_to_all and reduce_scatter are keyed by their input and
their output; one called without `out` keeps the output its first run made as
its own, runs into it, and returns a copy each time (lean_run_into).
A call that the arena's C kernel runs goes further: once it has run again in Python, its later calls run whole in one C
call (tcoll.shm.express) while nothing is pending that Python must look at; a
plan of one does too. (Not after its first run: a buffer seen once, as a torch
tensor's new NumPy view at every call is, gets no express call it would never use.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..buffers import as_array
from ..errors import TcollError
from ..p2p.work import Work
from ..shm import express
from .calls import Call, Prepared

if TYPE_CHECKING:
    from .communicator import Communicator
    from .dispatch import Dispatcher

__all__ = ["Plan", "initializer", "LEAN_BYTES", "LEAN_ENTRIES", "MISS", "again", "again_into", "lean_run",
           "lean_run_into", "lean_again"]

LEAN_BYTES = 1 << 20  # buffers up to this size take the lean path: above it the call's bookkeeping is noise
LEAN_ENTRIES = 32
MISS = object()  # lean_again: the remembered call does not fit this buffer any more (check it anew)
HANDED_OVER = express.HANDED_OVER  # what an express call returns when Python must go on with the call
NO_RESULT = express.NO_RESULT  # ... and where the call's result is None (a gather's other ranks)
_NEVER = object()  # an entry's express: the call cannot run express (its op, dtype, size or path)


class Plan:
    """A persistent collective: one call's checks, buffers, algorithm and stamp, bound once (see the module).

    Made by `comm.<collective>_init(...)` with the collective's own arguments
    (async_op excepted). Call it (or `run()`) for a blocking run; `start()`
    and `wait()` for a started one.

    Attributes:
        result: what the collective returns: its output buffer, which every run of a bound plan
            writes (an unbound plan's last result).
        bound: True if the runs skip the checks (single-step calls on fixed buffers).
    """

    def __init__(self, comm: Communicator, method: Callable[..., Any], args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        if "async_op" in kwargs:
            raise TypeError("a plan runs blocking (plan() or plan.run()) or started (plan.start()): "
                            "it takes no async_op")
        self._comm, self._method, self._args, self._kwargs = comm, method, args, kwargs
        self._dispatch = comm.core.dispatch
        self._forms: dict[bool, Prepared | None] = {}
        self._work: Work | None = None
        self._blocking = self._form(False)
        self.result: Any = self._blocking.call.result if self._blocking is not None else None
        self.bound = self._blocking is not None
        # A bound plan of one arena step runs whole in C once it has run in Python (tcoll.shm.express).
        self._x = args[0] if args else None
        self.express: Any = None if self.bound else _NEVER
        self.run_express: Callable[[Any], Any] | None = None

    def _form(self, async_op: bool) -> Prepared | None:
        """The prepared call of the blocking or started form; None: it is checked at every run."""
        if async_op in self._forms:
            return self._forms[async_op]
        dispatcher = self._dispatch
        dispatcher.gate.shut()  # (no express call runs while the plan's method is called to capture it)
        dispatcher.capturing = True
        try:
            got = self._method(self._comm, *self._args, async_op=async_op, **self._kwargs)
        finally:
            dispatcher.capturing = False
        prepared = None
        if isinstance(got, Prepared) and got.info is None and _bound(got.call, self._buffers()):
            prepared = dispatcher.prepare(got.call, async_op)
        self._forms[async_op] = prepared
        return prepared

    def _buffers(self) -> list[np.ndarray]:
        """The arrays the caller passed (and will refill between runs)."""
        found = []
        for value in (*self._args, *self._kwargs.values()):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                try:
                    found.append(as_array(item, writable=False))
                except (TypeError, ValueError):
                    pass
        return found

    def run(self) -> Any:
        """Run the plan once, blocking; returns its result."""
        if self._work is not None and not self._work.done():
            raise TcollError("this plan was started and not waited for: call plan.wait() first")
        run = self.run_express
        result = None if run is None else run(self._x)
        if result is not None and result is not HANDED_OVER:
            return None if result is NO_RESULT else result
        if self._blocking is not None:
            dispatcher = self._dispatch
            if result is HANDED_OVER:
                result = dispatcher.resume(self._blocking)
            else:
                result = dispatcher.run_prepared(self._blocking)
            _renew_express(dispatcher, self, self._blocking, self._x)
            return result
        self.result = self._method(self._comm, *self._args, **self._kwargs)
        return self.result

    __call__ = run  # plan(): the same, one Python call less

    def runner(self) -> Callable[[], Any]:
        """A callable that runs the plan once, blocking, as run() does, for callers that never start() it.

        A bound plan's runner goes straight to the data movement (it skips
        run()'s check that a start() is not under way); an unbound one's is run.
        A plan that can run express (tcoll.shm.express) is run, which does.
        """
        if self._blocking is None or self.express is not _NEVER:
            return self.run
        return functools.partial(self._dispatch.run_prepared, self._blocking)

    def start(self) -> Work:
        """Start a run (it proceeds while this rank does other work); returns its Work, which wait() waits for."""
        if self._work is not None and not self._work.done():
            raise TcollError("this plan is running already: call plan.wait() before starting it again")
        prepared = self._form(True)
        if prepared is not None:
            self._work = self._dispatch.run_prepared(prepared)
        else:
            self._work = self._method(self._comm, *self._args, async_op=True, **self._kwargs)
        return self._work

    def wait(self, timeout: float | None = None) -> Any:
        """Wait for the run start() began; returns its result."""
        work = self._work
        if work is None:
            raise TcollError("this plan was not started")
        result = work.wait(timeout)
        self._work = None
        return result

    def __repr__(self) -> str:
        state = "bound" if self.bound else "checked at every run"
        return f"<tcoll.Plan {getattr(self._method, '__name__', '?')} ({state})>"


def _bound(call: Call, buffers: list[np.ndarray]) -> bool:
    """Whether every array of `call` lies in the caller's buffers or in its result (nothing was copied)."""
    mine = list(buffers)
    if call.result is not None:
        try:
            mine.append(as_array(call.result, writable=False))
        except (TypeError, ValueError):
            pass
    copied = [array for pair in call.copies for array in pair]
    arrays = [a for a in (*call.args, *(call.staged or ()), *copied) if isinstance(a, np.ndarray) and a.size]
    return all(any(np.may_share_memory(a, b) for b in mine) for a in arrays)


def initializer(method: Callable[..., Any]) -> Callable[..., Plan]:
    """The `<collective>_init` method of a collective method: the same arguments, a Plan back."""

    def init(comm: Communicator, *args: Any, **kwargs: Any) -> Plan:
        return Plan(comm, method, args, kwargs)

    name = getattr(method, "__name__", "collective")
    init.__name__ = init.__qualname__ = f"{name}_init"
    init.__doc__ = (f"A persistent {name}: the arguments of {name} (no async_op), checked and bound once.\n\n"
                    "Returns:\n    A tcoll.Plan: plan() runs it blocking, plan.start() / plan.wait() started.\n")
    return init


# -- the lean path of ordinary calls ---------------------------------------------------------------


class _Lean:
    """One remembered call: its buffers (kept alive, so that their ids stay their own: the call's array, and the
    output of a call that writes elsewhere), what was checked, and its express call (tcoll.shm.express;
    run_express is its bound run, None while there is none)."""

    __slots__ = ("x", "shape", "dtype", "out", "out_shape", "out_dtype", "reads_only", "prepared", "express",
                 "run_express")

    def __init__(self, x: np.ndarray, prepared: Prepared, out: np.ndarray | None = None,
                 reads_only: bool = False) -> None:
        self.x, self.shape, self.dtype, self.prepared = x, x.shape, x.dtype, prepared
        self.out, self.reads_only = out, reads_only
        self.out_shape, self.out_dtype = (out.shape, out.dtype) if out is not None else ((), None)
        self.express: Any = None
        self.run_express: Callable[[Any], Any] | None = None


def _fits(dispatcher: Dispatcher, entry: _Lean, x: Any) -> bool:
    """Whether `x` (and the output) are still the buffers `entry` was checked for, as they were (and no plan
    is being made): `x` writable where the call writes it, the output always."""
    if dispatcher.capturing or entry.x is not x or x.shape != entry.shape or x.dtype != entry.dtype:
        return False
    out = entry.out
    if out is None:
        flags = x.flags
        return (flags.writeable or entry.reads_only) and flags.c_contiguous
    flags = out.flags
    return (out.shape == entry.out_shape and out.dtype == entry.out_dtype and flags.writeable and flags.c_contiguous
            and x.flags.c_contiguous)


def lean_run(dispatcher: Dispatcher, key: Any, x: Any, call: Call, out: Any = None, reads_only: bool = False) -> Any:
    """Prepare a checked blocking call, remember it for `key` (a small NumPy buffer `x`, and `out`, the output
    of a call that writes elsewhere: part of the key; `reads_only`: the call only reads x), and run it."""
    if dispatcher.capturing:
        return dispatcher.run(call)
    prepared = dispatcher.prepare(call, False)
    if type(x) is not np.ndarray or x.nbytes > LEAN_BYTES or (out is not None and (
            type(out) is not np.ndarray or np.may_share_memory(x, out))):  # (an overlapping x was copied)
        return dispatcher.run_prepared(prepared)
    lean = dispatcher.lean
    if len(lean) >= LEAN_ENTRIES:
        lean.clear()
    entry = lean[key] = _Lean(x, prepared, out, reads_only or out is not None)
    result = dispatcher.run_prepared(prepared)
    _renew_express(dispatcher, entry, prepared, x, make=False)
    return result


def lean_run_into(dispatcher: Dispatcher, key: Any, x: Any, call: Call, out: Any, reads_only: bool = False) -> Any:
    """lean_run for a blocking call that writes an output: the caller's `out`, or (None) the new array the call
    made, which the remembered call keeps as its own output (the next calls run into it) and a copy of which
    goes back, so that every call still returns a new array. A gather's other ranks write nothing."""
    result = call.result
    private = out is None and isinstance(result, np.ndarray)
    if dispatcher.capturing or (private and (type(x) is not np.ndarray or max(x.nbytes, result.nbytes) > LEAN_BYTES)):
        return dispatcher.run(call)
    done = lean_run(dispatcher, key, x, call, result if private else out, reads_only)
    return done.copy() if private else done


def again_into(comm: Communicator, key: Any, x: Any, out: Any) -> Any:
    """again() for a call remembered by lean_run_into: a copy of the remembered output where the caller gave no
    `out` (a new array every call), else the caller's out; MISS if none fits."""
    result = again(comm, key, x)
    return result.copy() if out is None and isinstance(result, np.ndarray) else result


def again(comm: Communicator, key: Any, x: Any) -> Any:
    """A remembered blocking call run again: whole in C (its express call) or in Python; MISS if none fits."""
    dispatcher = comm.core.dispatch
    try:
        entry = dispatcher.lean.get(key)
    except TypeError:  # an unhashable argument: the checks will say what is wrong with it
        return MISS
    if entry is None:
        return MISS
    run = entry.run_express
    if run is not None:
        result = run(x)
        if result is HANDED_OVER:  # it began the call: Python goes on with it
            return lean_again(dispatcher, entry, x, True)
        if result is not None:
            return None if result is NO_RESULT else result
    return lean_again(dispatcher, entry, x)


def lean_again(dispatcher: Dispatcher, entry: _Lean, x: Any, handed_over: bool = False) -> Any:
    """Run a remembered blocking call again in Python, or go on with the one its express call began and
    handed over (`handed_over`); then renew its express call.

    Returns:
        The call's result, or MISS (nothing ran) if `x` no longer fits the entry: the caller checks it anew.
    """
    if handed_over:
        result = dispatcher.resume(entry.prepared)
    elif not _fits(dispatcher, entry, x):
        return MISS
    else:
        result = dispatcher.run_prepared(entry.prepared)
    _renew_express(dispatcher, entry, entry.prepared, x)
    return result


def _renew_express(dispatcher: Dispatcher, holder: Any, prepared: Prepared, x: Any, make: bool = True) -> None:
    """After `prepared` (on buffer `x`) ran well in Python: open the gate if nothing is pending, and give
    `holder` (a _Lean, or a Plan) an express call of it if it has none that runs on the arena of now
    (unless not `make`: the buffer's first call)."""
    if not (dispatcher.gate.is_open or dispatcher.open_gate()) or holder.express is _NEVER or not make:
        return
    made = holder.express
    if made is None or not made.usable(dispatcher.arena.kernel) or express.stale(prepared):  # type: ignore[union-attr]
        made = express.build(dispatcher, prepared, x)
        holder.express, holder.run_express = (_NEVER, None) if made is None else (made, made.run)
