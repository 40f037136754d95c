"""Each rank publishes, about once a second, what the hang report needs of it (tcoll.p2p.status).

One daemon thread per process ("tcoll-status") serves every engine made in
it. It wakes once a tick (TCOLL_STATUS seconds, 1 by default; "off" or 0: no
thread, no files), samples each engine's calls (handed down by the layer that
numbers them), its long wait if any, and the Python stack of the thread that
uses tcoll, and rewrites the rank's file only when something changed. The
calls themselves do nothing for it: the cost is one short wake-up a second.

A rank whose sample stays the same keeps its `since`: the time it was first
seen in that state, so a reader knows how long a rank has made no progress.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from . import status

__all__ = ["ENV", "period", "watch", "sample"]

ENV = "TCOLL_STATUS"


def period() -> float:
    """Seconds between samples (TCOLL_STATUS); 0: reporting is off."""
    text = os.environ.get(ENV, "1").strip().lower()
    if text in ("off", "no", "false", ""):
        return 0.0
    try:
        return max(0.0, float(text))
    except ValueError:
        return 1.0


class _Watched:
    """One engine as the reporter sees it: where it publishes, and what it published last."""

    def __init__(self, engine: Any, job: str, calls: Callable[[Any], list[dict[str, Any]]], directory: str,
                 dump: Callable[[list[dict[str, Any]]], Any] | None) -> None:
        self.engine = weakref.ref(engine)
        self.dump, self.asked = dump, 0
        self.rank, self.size, self.job, self.calls, self.directory = engine.rank, engine.size, job, calls, directory
        self.key: Any = None
        self.progress: Any = None  # its calls and wait at the last tick: unchanged, it may hang
        self.since = time.time()
        self.written: dict[str, Any] | None = None


class _Reporter:
    """The process's reporting thread and the engines it serves."""

    def __init__(self, tick: float) -> None:
        self.tick = tick
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.watched: list[_Watched] = []
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="tcoll-status", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        global _reporter
        while True:
            self.wake.wait(self.tick)
            self.wake.clear()
            with _reporter_lock:
                if not self.watched:  # every engine closed: the thread ends (watch() starts a new one)
                    if _reporter is self:
                        _reporter = None
                    return
            frames = _Frames()
            with self.lock:  # forget() waits: a closed rank's file is never written again after it is removed
                for entry in self.watched:
                    try:
                        self._report(entry, frames)
                    except Exception:  # noqa: BLE001 - reporting must never disturb the job
                        continue
            del frames

    def _report(self, entry: _Watched, frames: _Frames) -> None:
        engine = entry.engine()
        if engine is None:
            return
        comms = entry.calls(engine)
        progress = (tuple((c["sequence"], (c["call"] or {}).get("sequence")) for c in comms),
                    getattr(engine.waiting, "what", None))
        # The stack only of a rank that made no progress since the last tick (it may hang): a moving rank's
        # line is not needed, and a look at every thread's stack costs a dump of them all.
        asked = entry.dump is not None and self._asked(entry)
        frame = _thread_of(engine.rank, frames.get()) if progress == entry.progress or asked else None
        entry.progress = progress
        state = sample(engine, lambda _: comms, frame)
        if asked:
            entry.dump(status.frames_of(frame))  # type: ignore[misc]
        key = (tuple((c["sequence"], (c["call"] or {}).get("sequence")) for c in state["comms"]),
               (state["waiting"] or {}).get("what"), state["where"])
        if key != entry.key:
            entry.key, entry.since = key, time.time()
        state.update(job=entry.job, pid=self.pid, host=socket.gethostname(), since=entry.since)
        if state != entry.written:
            try:
                status.publish(entry.directory, entry.rank, state)
            except FileNotFoundError:  # the last rank to close removed the directory meanwhile
                status.job_dir(entry.job, create=True)
                status.publish(entry.directory, entry.rank, state)
            entry.written = state

    @staticmethod
    def _asked(entry: _Watched) -> bool:
        """Whether a report asked for the flight recorder's dump since the last one (it touches `dump`)."""
        try:
            asked = os.stat(os.path.join(entry.directory, "dump")).st_mtime_ns
        except OSError:
            return False
        if asked == entry.asked:
            return False
        entry.asked = asked
        return True

    def forget(self, entry: _Watched) -> None:
        """Stop publishing for an engine that closes, and remove its file."""
        with self.lock:
            if entry in self.watched:
                self.watched.remove(entry)
        if not self.watched:
            self.wake.set()  # the thread ends at once
        try:
            os.unlink(os.path.join(entry.directory, f"rank-{entry.rank}.json"))
            os.rmdir(entry.directory)  # the last rank of the host to close removes the job's directory
        except OSError:
            pass


class _Frames:
    """Every thread's current stack, looked at most once a tick and only when asked (see _Reporter._report).

    What it keeps are copies (status.thread_frames, from faulthandler's dump), never frame objects: a tick
    reads them across the writes of every rank's file, while the threads run on.
    """

    def __init__(self) -> None:
        self._frames: dict[int, Any] | None = None

    def get(self) -> dict[int, Any]:
        if self._frames is None:
            self._frames = status.thread_frames()
        return self._frames


_reporter: _Reporter | None = None
_reporter_lock = threading.Lock()


def watch(engine: Any, job: str, calls: Callable[[Any], list[dict[str, Any]]],
          dump: Callable[[list[dict[str, Any]]], Any] | None = None) -> bool:
    """Publish `engine`'s state for job `job` from now until it closes (unless TCOLL_STATUS is off).

    Args:
        engine: the rank's engine.
        job: the job's run id (the directory's name).
        calls: returns the calls of the engine's communicators (tcoll.comm.progress.calls).
        dump: writes the flight recorder's dump, given the frames of the call under way (TCOLL_DUMP).

    Returns:
        Whether it is published (False: reporting is off, or no private directory could be made).
    """
    global _reporter
    tick = period()
    if tick <= 0:
        return False
    try:
        directory = status.job_dir(job, create=True)
    except OSError:
        return False
    entry = _Watched(engine, job, calls, directory, dump)
    with _reporter_lock:  # held while the thread decides to end: an engine is never added to an ending one
        if _reporter is None or _reporter.pid != os.getpid():  # none yet, or the one of the parent of a fork
            _reporter = _Reporter(tick)
        reporter = _reporter
        with reporter.lock:
            reporter.watched.append(entry)
    engine.closers.append(lambda: reporter.forget(entry))
    reporter.wake.set()  # the first sample now: a rank is visible as soon as it joined
    return True


def _thread_of(rank: int, frames: dict[int, Any]) -> Any:
    """The frame of the thread that acts for `rank`: a spawned rank's own, else one in tcoll, else the main one."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    own = [ident for ident, name in names.items() if name == f"tcoll-rank-{rank}"]
    if own and own[0] in frames:
        return frames[own[0]]
    main = threading.main_thread().ident
    users = [ident for ident in frames if not names.get(ident, "").startswith("tcoll") and ident != main]
    for ident in [main, *users]:
        if ident in frames and status.in_tcoll(frames[ident]):
            return frames[ident]
    return frames.get(main)


def _over(waiting: Any) -> bool:
    """Whether a noted wait has ended; one whose test fails (its arena closed since) has."""
    try:
        return bool(waiting.over())
    except Exception:  # noqa: BLE001 - whatever it read is gone: the wait is over
        return True


def sample(engine: Any, calls: Callable[[Any], list[dict[str, Any]]], frame: Any) -> dict[str, Any]:
    """What the report needs of one rank now, `frame` being its thread's (see tcoll.launch.hangs for the reading)."""
    waiting = engine.waiting
    noted = None
    if waiting is not None and not _over(waiting):
        noted = {"what": waiting.what, "peers": list(waiting.peers), "detail": waiting.detail,
                 "since": status.wall(waiting.since)}
    user = status.user_frame(frame)
    return {"rank": engine.rank, "size": engine.size, "comms": calls(engine), "waiting": noted,
            "in_tcoll": status.in_tcoll(frame), "where": status.where(user), "code": status.source_line(user),
            "function": user.f_code.co_name if user is not None else "", "stack": status.stack_top(frame)}
