"""What a rank is doing, for the hang report: its long waits, where its user code is, and where that is published.

A wait that outlasts one liveness interval (TCOLL_LIVENESS, 1 s) notes what
it waits for on the engine (`Engine.waiting`, a `Waiting`), on its slow path:
a wait that ends within its spin budget or its first second notes nothing.
The rank's reporter (`tcoll.p2p.reporter`) samples that, the calls of its
communicators and the Python stack of the thread that uses them, about once
a second, and publishes them as one small JSON file per rank in a directory
only this user can read:

    $XDG_RUNTIME_DIR/tcoll/<job>/rank-<k>.json    (when XDG_RUNTIME_DIR is set)
    /tmp/tcoll-<uid>/<job>/rank-<k>.json          (otherwise)

`tcoll run` and `tcoll status` read them (`tcoll.launch.hangs`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import stat
import sysconfig
import tempfile
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from . import notice

__all__ = ["Waiting", "note_wait", "bases", "job_dir", "publish", "write", "read_job", "user_frame", "stack_top",
           "wall", "frames_of"]

_TCOLL = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Frames that are nobody's own code: tcoll's, the standard library's, installed packages' (torch's wrappers).
_NOT_USERS = tuple({_TCOLL, *(sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "purelib", "platlib"))})


class Waiting:
    """What a long wait of this rank waits for.

    Attributes:
        what: the operation, e.g. "recv from rank 1 (tag 7, up to 8 B)" or "all_reduce #4 (shm)".
        peers: the world ranks it still waits on.
        detail: a tag or an arena step ("" if the operation's name says it all).
        since: time.monotonic() when the wait began.
        over: returns True once the wait has ended (the reporter asks; the wait never clears the note).
    """

    __slots__ = ("what", "peers", "detail", "since", "over")

    def __init__(self, what: str, peers: list[int], detail: str, since: float, over: Callable[[], bool]) -> None:
        self.what, self.peers, self.detail, self.since, self.over = what, peers, detail, since, over


def note_wait(engine: Any, rank: int, work: Any, start: float, now: float, notice_at: float, limit: float) -> float:
    """The slow path of a wait, at each liveness check: note what it waits for, and say so once it is long.

    Args:
        engine: the waiting engine (its `waiting` is set).
        rank: the engine's rank.
        work: the Work waited for.
        start: time.monotonic() when the wait began; now: the time now.
        notice_at: when the notice is due (TCOLL_NOTICE); limit: the wait's timeout.

    Returns:
        When the notice is due from now on (inf once said).
    """
    peers = work.peers()
    tag = getattr(work, "tag", None)
    engine.waiting = Waiting(work.description, peers, "" if tag is None else f"tag {tag}", start,
                             lambda: work.finished)
    if now >= notice_at:
        notice.say(rank, work.description, peers, now - start, limit)
        return float("inf")
    return notice_at


def wall(monotonic: float) -> float:
    """The wall-clock time (time.time()) of a time.monotonic() reading."""
    return time.time() - (time.monotonic() - monotonic)


# -- frames -------------------------------------------------------------------------------


def _users(frame: FrameType) -> bool:
    return not frame.f_code.co_filename.startswith(_NOT_USERS)


def in_tcoll(frame: FrameType | None) -> bool:
    """Whether any frame of the stack that ends in `frame` is tcoll's own."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TCOLL):
            return True
        frame = frame.f_back
    return False


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame of the user's own code (not tcoll's, the standard library's or a package's).

    For a thread inside a tcoll call that is the line that made the call; for
    one outside tcoll, the line it executes (in time.sleep, say). Without
    such a frame (an installed program), the innermost frame.
    """
    first = frame
    while frame is not None:
        if _users(frame):
            return frame
        frame = frame.f_back
    return first


def where(frame: FrameType | None) -> str:
    """`file:line` of a frame, the file's base name only ("" for None)."""
    if frame is None:
        return ""
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def stack_top(frame: FrameType | None, count: int = 4) -> list[str]:
    """The innermost `count` frames, innermost first: "file:line in function"."""
    top = []
    while frame is not None and len(top) < count:
        top.append(f"{where(frame)} in {frame.f_code.co_name}")
        frame = frame.f_back
    return top


def frames_of(frame: FrameType | None, count: int = 16) -> list[dict[str, Any]]:
    """The innermost `count` frames as torch's flight recorder lists them: filename, line, name."""
    found = []
    while frame is not None and len(found) < count:
        found.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return found


def source_line(frame: FrameType | None) -> str:
    """The text of the line a frame executes, stripped ("" if unknown)."""
    if frame is None:
        return ""
    import linecache

    return linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()


# -- publication --------------------------------------------------------------------------


def bases() -> list[str]:
    """The directories that may hold this user's job directories, the one in use first."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        found.append(os.path.join(runtime, "tcoll"))
    found.append(os.path.join("/tmp", f"tcoll-{os.getuid()}"))
    return found


def _private(path: str) -> None:
    """Make `path` a directory of this user's that nobody else can read, or refuse one that is not.

    Raises:
        PermissionError: it exists but belongs to someone else or others may enter it.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user's: not publishing there")


def job_dir(job: str, create: bool = False) -> str:
    """The directory of job `job`'s files (made, private, with create).

    Raises:
        PermissionError, OSError: (create) it cannot be made private.
    """
    base = bases()[0]
    path = os.path.join(base, job)
    if create:
        _private(base)
        _private(path)
    return path


def publish(directory: str, rank: int, state: dict[str, Any]) -> None:
    """Write rank `rank`'s state into `directory`, whole (a reader never sees half a file)."""
    write(os.path.join(directory, f"rank-{rank}.json"), state)


def write(path: str, state: Any) -> None:
    """Write `state` as JSON to `path`, readable by this user only, whole (a reader never sees half a file)."""
    part = f"{path}.{os.getpid()}.part"
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(state, out)
    os.replace(part, path)


def read_job(directory: str) -> list[dict[str, Any]]:
    """The ranks' states published in `directory`, by rank (unreadable or vanished files skipped)."""
    states = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if name.startswith("rank-") and name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as source:
                    state = json.load(source)
                states[int(state["rank"])] = state
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return [states[rank] for rank in sorted(states)]


class _Code:
    """What a frame snapshot keeps of its code: its file and function names."""

    __slots__ = ("co_filename", "co_name")

    def __init__(self, filename: str, name: str) -> None:
        self.co_filename, self.co_name = filename, name


class FrameSnapshot:
    """A frame's file, function and line, copied: read like a frame (f_code, f_lineno, f_back), but inert."""

    __slots__ = ("f_code", "f_lineno", "f_back")

    def __init__(self, code: _Code, lineno: int, back: FrameSnapshot | None) -> None:
        self.f_code, self.f_lineno, self.f_back = code, lineno, back


_DUMP_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-fA-F]+) ")
_DUMP_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?+) in (.*)$')
_ESCAPE = re.compile(r"\\x([0-9a-f]{2})|\\u([0-9a-f]{4})|\\U([0-9a-f]{8})")


def thread_frames() -> dict[int, FrameSnapshot | None]:
    """Every thread's current stack, by thread id, as snapshots; {} if it could not be dumped.

    The stacks come from faulthandler's dump, which reads the interpreter's frames in C under the GIL and
    makes no frame object. Walking other threads' frame objects (sys._current_frames, f_back) has crashed
    CPython 3.11 in this reporter three times, each time after a mitigation (cpython#99110, #111363): a
    thread's frames are popped and reused under the walker. The dump's limits hold here too: the innermost
    100 frames of each thread, and 100 threads, the newest first (a process of more threads, such as one of
    100 thread ranks, has no stack for its oldest ones); file names longer than 500 characters are cut.
    """
    try:
        return _parse_dump(_dump_threads())
    except (OSError, ValueError):  # (no memfd nor temporary file: the report goes on without stacks)
        return {}


def _dump_threads() -> str:
    """faulthandler's dump of every thread's stack, as text (in a memfd, or a temporary file where none)."""
    try:
        out = os.fdopen(os.memfd_create("tcoll-frames"), "w+b")
    except (AttributeError, OSError):  # (no memfd_create here, or refused: ENOSYS, EPERM, EMFILE)
        out = tempfile.TemporaryFile()
    with out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.seek(0)
        return out.read().decode("utf-8", "backslashreplace")


def _unescape(text: str) -> str:
    """A name as faulthandler wrote it, with its escapes (\\xNN, \\uNNNN, \\UNNNNNNNN of each character
    outside printable ASCII) turned back into the characters, so that paths such as /home/josé match."""
    return _ESCAPE.sub(lambda found: chr(int(found.group(1) or found.group(2) or found.group(3), 16)), text)


def _parse_dump(text: str) -> dict[int, FrameSnapshot | None]:
    """faulthandler's dump as snapshots by thread id (innermost frame first, as the dump lists them)."""
    stacks: dict[int, list[tuple[str, int, str]]] = {}
    frames: list[tuple[str, int, str]] = []
    for line in text.splitlines():
        thread, frame = _DUMP_THREAD.match(line), _DUMP_FRAME.match(line)
        if thread:
            frames = stacks.setdefault(int(thread.group(1), 16), [])
        elif frame:
            filename, lineno, name = frame.groups()
            frames.append((_unescape(filename), int(lineno) if lineno.isdigit() else 0, _unescape(name)))
    copied = {}
    for ident, stack in stacks.items():
        back = None
        for filename, lineno, name in reversed(stack):
            back = FrameSnapshot(_Code(filename, name), lineno, back)
        copied[ident] = back
    return copied
