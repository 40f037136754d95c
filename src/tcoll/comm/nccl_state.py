"""The NCCL communicator behind a tcoll communicator, the Work of a queued NCCL call, and the watchdog.

tcoll.comm.nccl decides and checks each call; this module owns what lives on after it is queued: the
NCCL communicator's handle (aborted once, never used after), each call's event, and the one thread per
process that follows the events, fails a call that outlives the communicator's timeout (aborting the
NCCL communicator, naming the call and the rank) and fails a communicator whose NCCL reports an error.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from ..errors import TcollError, TimeoutError
from .nccl_lib import Nccl, NcclError

__all__ = ["WATCHDOG", "NcclState", "NcclWork"]


class NcclState:
    """One tcoll communicator's NCCL communicator: its handle, device, and the error that ended it."""

    def __init__(self, comm: Any, torch: Any, device: Any, timeout: float) -> None:
        lib = Nccl.load()
        uid = comm.broadcast_object(lib.unique_id() if comm.rank == 0 else None, 0)
        with torch.cuda.device(device):
            self.handle = lib.init_rank(comm.size, uid, comm.rank)
        self.device, self.timeout, self.rank = device, timeout, comm.rank
        self.error: TcollError | None = None
        self.lock = threading.Lock()
        self.aborted = False
        weakref.finalize(comm, self.abort)  # at the communicator's end: nothing may wait on it then

    def fail(self, error: TcollError) -> None:
        """Abort the NCCL communicator (its queued calls end) and keep `error` for the calls to come."""
        if self.error is None:
            self.error = error
            self.abort()

    def async_error(self) -> tuple[int, str]:
        """NCCL's error state of the communicator and its text; (0, "") once aborted (its handle is gone)."""
        with self.lock:  # an abort (the finalizer's, another thread's) never frees the handle under this call
            if self.aborted:
                return 0, ""
            try:
                code = Nccl.load().async_error(self.handle)
            except NcclError as exc:
                return -1, str(exc)
            return code, Nccl.load().error_text(code)

    def abort(self) -> None:
        """ncclCommAbort, once (a second would free the communicator twice)."""
        with self.lock:
            if self.aborted:
                return
            self.aborted = True
        try:
            Nccl.load().lib.ncclCommAbort(self.handle)
        except (NcclError, OSError):  # pragma: no cover - the library went away at exit
            pass


class NcclWork:
    """A queued NCCL call: done when the device has run it (an event after it on the caller's stream).

    It holds the tcoll communicator until the watchdog sees it over, so that the communicator's end (which
    aborts its NCCL communicator) never cancels a call still on the GPU.
    """

    def __init__(self, comm: Any, state: NcclState, event: Any, label: str, result: Any) -> None:
        self._comm, self._state, self._event, self.label, self.value = comm, state, event, label, result
        self._deadline = time.monotonic() + state.timeout
        self._callbacks: list[Any] = []
        self._over = False
        self.error: TcollError | None = None

    def _settle(self) -> bool:
        """Look once: True when the call is over, ran (error None) or failed (error set)."""
        if self._over:
            return True
        if self._state.error is not None:  # aborted: an event that passed now may be a cancelled call's
            self.error = self._state.error
        elif not self._event.query():
            return False
        self._over = True
        return True

    def done(self) -> bool:
        """Whether the device has run the call (or it failed)."""
        return self._settle()

    def wait(self, timeout: float | None = None) -> Any:
        """Wait on the host until the device has run the call; return its result.

        Raises:
            TimeoutError: not done within `timeout` (the call goes on; the watchdog's own timeout aborts).
            TcollError: the watchdog failed it (timeout, NCCL error), or the communicator was aborted first.
        """
        end = None if timeout is None else time.monotonic() + timeout
        pause = 2e-5
        while not self._settle():
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"{self.label}: not done on the GPU within {timeout} s (rank {self._state.rank})")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if self.error is not None:
            raise self.error
        return self.value

    def result(self, timeout: float | None = None) -> Any:
        return self.wait(timeout)

    def exception(self) -> BaseException | None:
        return self.error

    def add_done_callback(self, fn: Any) -> None:
        """Call `fn(self)` once the watchdog sees the call over (the timeline's end of the call)."""
        if self._over and not self._callbacks:
            fn(self)
        else:
            self._callbacks.append(fn)

    def _check(self, now: float) -> bool:
        """The watchdog's look: True once the call is over (done, or failed here)."""
        if not self._settle():
            if now <= self._deadline:
                return False
            self.error = TimeoutError(f"{self.label} on NCCL did not finish on rank {self._state.rank}'s GPU "
                                      f"within {self._state.timeout:g} s; tcoll aborted the NCCL communicator "
                                      "(every rank passed the call's check: look at the GPUs and their links)")
            self._over = True
            self._state.fail(self.error)
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        self._comm = None
        return True


class _Watchdog:
    """One daemon thread per process that follows every queued NCCL call (see NcclWork._check)."""

    def __init__(self) -> None:
        self._works: list[NcclWork] = []
        self._lock = threading.Lock()
        self._busy = threading.Event()  # set while calls are followed: an idle watchdog sleeps on it
        self._thread: threading.Thread | None = None

    def follow(self, work: NcclWork) -> None:
        with self._lock:
            self._works.append(work)
            self._busy.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tcoll-nccl-watchdog", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            self._busy.wait()
            time.sleep(0.01)
            now = time.monotonic()
            with self._lock:
                works = list(self._works)
            over = [w for w in works if _checked(w, now)]
            states = {id(w._state): w._state for w in works if w not in over}
            for state in states.values():
                self._look_for_errors(state)
            if over:
                with self._lock:
                    self._works = [w for w in self._works if w not in over]
                    if not self._works:
                        self._busy.clear()

    @staticmethod
    def _look_for_errors(state: NcclState) -> None:
        """Fail a communicator whose NCCL reports an asynchronous error (a peer gone, a network failure)."""
        code, text = state.async_error()
        if code not in (0, 7):  # ncclSuccess, ncclInProgress
            state.fail(TcollError(f"NCCL reported an error on rank {state.rank}: {text}; tcoll aborted its "
                                  "NCCL communicator"))


def _checked(work: NcclWork, now: float) -> bool:
    """The watchdog's look at `work`, which never lets an error end the watchdog (a sticky CUDA error, a
    timeline callback's): such an error fails the call's communicator instead."""
    try:
        return work._check(now)
    except Exception as exc:  # noqa: BLE001 - the watchdog must outlive any one call
        work.error = TcollError(f"{work.label}: tcoll's NCCL watchdog could not follow it ({exc!r}); tcoll "
                                "aborted the NCCL communicator")
        work._over = True
        work._state.fail(work.error)
        return True


WATCHDOG = _Watchdog()
