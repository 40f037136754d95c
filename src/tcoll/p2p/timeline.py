"""A timeline of a real run, for Perfetto or chrome://tracing: TCOLL_TRACE=run.json.

With TCOLL_TRACE set, each rank's engine holds a `Timeline` (otherwise None: one
attribute test on the paths that would record, nothing more). It notes every
collective call (name, bytes, algorithm, sequence number) and the steps of the
calls that have several, as slices of the rank's track, and every point-to-point
message as a flow from a slice on the sender's track to one on the receiver's.
Flows need no extra message: both ends number the messages of each (source,
destination, context, tag) stream, which arrive in the order they were sent.

Each rank writes its events to ``<path>.rank<N>`` when its engine closes or the
process exits; `merge` joins the parts of a job into one JSON file in the
trace-event format (`tcoll run --trace` or TCOLL_TRACE under `tcoll run` merge
them when the job ends).

The trace often lives in a directory others may write to (/tmp), so no file
is ever opened by its name for writing: each is written to a new file made
with O_EXCL (which never follows a link) beside it, then renamed over the name,
which replaces a link planted there instead of writing through it (and fails
on another user's file in a sticky directory). `merge` reads only parts that
are regular files of this user, opened without following links. A rank that
cannot write its part warns and goes on: a trace is never worth a failed close.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import stat
import tempfile
import threading
import time
import warnings
from typing import Any

__all__ = ["Timeline", "from_env", "merge", "now_us", "part_path", "replace_file"]

from .watch import BLOCK_BITS

ENV = "TCOLL_TRACE"
_PHASE_TAGS = 8  # a collective's tag is sequence * 2**BLOCK_BITS + phase * 8 + stream (tcoll.algos.team)


def now_us() -> float:
    """Microseconds on the wall clock (the ranks of a host share it; trace timestamps are in us)."""
    return time.time_ns() / 1000.0


def part_path(path: str, rank: int) -> str:
    """Where rank `rank` writes its part of the trace `path`."""
    return f"{path}.rank{rank}"


class Timeline:
    """One rank's trace events.

    Args:
        path: the job's trace file; this rank writes `part_path(path, rank)`.
        rank: the world rank (the track).
    """

    def __init__(self, path: str, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "collectives"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "messages"}},
        ]
        self._sent: dict[tuple[int, int, int], int] = {}
        self._received: dict[tuple[int, int, int], int] = {}
        self._lock = threading.Lock()
        self._warned = False
        atexit.register(self.write)

    def slice(self, name: str, start_us: float, end_us: float, args: dict[str, Any], cat: str = "collective",
              tid: int = 0) -> None:
        """A complete event: `name` ran on this rank from `start_us` to `end_us`."""
        event = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.001),
                 "pid": self.rank, "tid": tid, "args": args}
        with self._lock:
            self.events.append(event)

    def call(self, name: str, start_us: float, result: Any, args: dict[str, Any]) -> None:
        """A collective call that began at `start_us`: ended now, or when `result`, a Work, completes."""
        callbacks = getattr(result, "add_done_callback", None)
        if callbacks is None:
            self.slice(name, start_us, now_us(), args)
        else:
            callbacks(lambda work: self.slice(name, start_us, now_us(), args))

    def _flow_id(self, counters: dict[tuple[int, int, int], int], src: int, dst: int, ctx: int, tag: int) -> str:
        key = (src, dst, ctx, tag)
        index = counters.get(key, 0)  # type: ignore[arg-type]
        counters[key] = index + 1  # type: ignore[index]
        return f"{src}>{dst}:{ctx}:{tag}:{index}"

    def sent(self, dst: int, ctx: int, tag: int, nbytes: int) -> None:
        """This rank starts sending a message: a slice on its message track where the flow begins."""
        now = now_us()
        args = {"to": dst, "bytes": nbytes, "ctx": ctx, "tag": tag, **_call_of(ctx, tag)}
        with self._lock:
            flow = self._flow_id(self._sent, self.rank, dst, ctx, tag)
            self.events.append({"name": f"send to {dst}", "cat": "p2p", "ph": "X", "ts": now, "dur": 0.001,
                                "pid": self.rank, "tid": 1, "args": args})
            self.events.append({"name": "message", "cat": "p2p", "ph": "s", "id": flow, "ts": now,
                                "pid": self.rank, "tid": 1})

    def received(self, src: int, ctx: int, tag: int, nbytes: int) -> None:
        """A message from `src` is in: a slice on this rank's message track where the flow ends."""
        now = now_us()
        args = {"from": src, "bytes": nbytes, "ctx": ctx, "tag": tag, **_call_of(ctx, tag)}
        with self._lock:
            flow = self._flow_id(self._received, src, self.rank, ctx, tag)
            self.events.append({"name": f"recv from {src}", "cat": "p2p", "ph": "X", "ts": now, "dur": 0.001,
                                "pid": self.rank, "tid": 1, "args": args})
            self.events.append({"name": "message", "cat": "p2p", "ph": "f", "bp": "e", "id": flow, "ts": now,
                                "pid": self.rank, "tid": 1})

    def write(self) -> bool:
        """Write this rank's events to its part file (again, with what came since, if called again).

        Returns:
            Whether the part was written; when it could not be (the path is not
            writable, or holds another user's file), a RuntimeWarning says why.
        """
        with self._lock:
            events = list(self.events)
        path = part_path(self.path, self.rank)
        try:
            replace_file(path, json.dumps(events), 0o600)
        except OSError as exc:
            if not self._warned:  # once: close() and the exit hook both try
                self._warned = True
                warnings.warn(f"tcoll: rank {self.rank} could not write its timeline (TCOLL_TRACE) to {path}: "
                              f"{exc}", RuntimeWarning, stacklevel=2)
            return False
        return True


def replace_file(path: str, text: str | bytes, mode: int) -> None:
    """Make `path` a new file holding `text` (str or bytes), never writing into a file that is already there
    (TCOLL_TRACE's parts and merged file; TCOLL_DUMP's dumps, tcoll.comm.recorder).

    Raises:
        OSError: the directory cannot be written, or `path` cannot be replaced.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # mkstemp creates with O_CREAT | O_EXCL, mode 0600: a planted link or file makes it pick another name.
    fd, temp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as out:
            if mode != 0o600:
                os.fchmod(out.fileno(), mode)
            out.write(text)
        os.replace(temp, path)  # a rename replaces a link at `path`; it never writes through it
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def _read_own(path: str) -> Any:
    """The JSON in `path`, a regular file of this user; None (with a warning) for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        warnings.warn(f"tcoll: not merging {path}: {exc}", RuntimeWarning, stacklevel=3)
        return None
    with os.fdopen(fd) as part:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            warnings.warn(f"tcoll: not merging {path}: it is not a file of this user (a rank never made it)",
                          RuntimeWarning, stacklevel=3)
            return None
        return json.load(part)


def _call_of(ctx: int, tag: int) -> dict[str, int]:
    """The collective sequence number and phase of a message (communicators send collectives' messages in
    odd contexts, user messages in even ones, which name no call)."""
    if ctx % 2 == 0:
        return {}
    return {"sequence": tag >> BLOCK_BITS, "phase": (tag & ((1 << BLOCK_BITS) - 1)) // _PHASE_TAGS}


def from_env(rank: int) -> Timeline | None:
    """A Timeline when TCOLL_TRACE names a file, else None."""
    path = os.environ.get(ENV, "")
    return Timeline(path, rank) if path else None


def merge(path: str, remove_parts: bool = True) -> int:
    """Join the ranks' parts of the trace `path` into `path` (the trace-event JSON object format).

    Parts that are not regular files of this user (a link, another user's file) are left out, with a
    warning, and left in place.

    Returns:
        The number of parts merged (0: none found, nothing written).

    Raises:
        OSError: `path` cannot be written (e.g. another user's file in a sticky directory).
    """
    parts = sorted(glob.glob(glob.escape(path) + ".rank*"))
    parts = [p for p in parts if p[len(path) + 5:].isdigit()]
    read = [(part, _read_own(part)) for part in parts]
    read = [(part, events) for part, events in read if isinstance(events, list)]
    if not read:
        return 0
    events: list[dict[str, Any]] = [event for _, part_events in read for event in part_events]
    replace_file(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                                    "otherData": {"producer": "tcoll", "ranks": len(read)}}), 0o644)
    if remove_parts:
        for part, _ in read:
            os.unlink(part)
    return len(read)
