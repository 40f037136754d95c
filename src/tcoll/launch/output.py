"""Copy the ranks' output to the launcher's, whole lines at a time, each prefixed with its rank.

A Python traceback on a rank's stderr that ends in a tcoll error (a
MismatchError, say) is folded into two lines: where the user's code made the
call, and the error. Its frames inside tcoll, and the chained errors that led
to it, say nothing a user can act on, and with every rank printing its own
they made about 170 lines for one mismatch. TCOLL_TRACEBACK=full keeps them.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import sysconfig
import threading
from typing import IO, Any

__all__ = ["LineForwarder", "Sink", "Tracebacks"]

_TRACEBACK = b"Traceback (most recent call last):"
_CHAINED = (b"The above exception was the direct cause", b"During handling of the above exception")
_BARE_ERROR = re.compile(rb"^tcoll\.[\w.]*(?:Error|Exception)\b")
_FRAME = re.compile(rb'^  File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_TCOLL = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames that are nobody's own code: tcoll's, the standard library's, installed packages' (torch's wrappers).
_NOT_USERS = tuple({_TCOLL + os.sep, *(sysconfig.get_paths()[key] + os.sep for key in ("stdlib", "purelib", "platlib"))})


def _binary(stream: IO[Any]) -> IO[bytes]:
    """Return the byte stream under a text stream (or the stream itself if it is binary)."""
    return getattr(stream, "buffer", stream)


class Sink:
    """The launcher's stdout and stderr, shared by every rank's forwarder under one lock.

    One lock for both streams: they are usually the same terminal, and a line
    must never be cut by another one.

    Args:
        stdout: where the ranks' stdout goes (default: sys.stdout).
        stderr: where the ranks' stderr and the launcher's messages go (default: sys.stderr).
    """

    def __init__(self, stdout: IO[Any] | None = None, stderr: IO[Any] | None = None) -> None:
        self._out = _binary(stdout if stdout is not None else sys.stdout)
        self._err = _binary(stderr if stderr is not None else sys.stderr)
        self._lock = threading.Lock()

    def write(self, data: bytes, to_stderr: bool) -> None:
        """Write bytes atomically with respect to other writers, and flush.

        Args:
            data: one or more complete lines.
            to_stderr: choose stderr instead of stdout.
        """
        stream = self._err if to_stderr else self._out
        with self._lock:
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):
                # The reader went away (e.g. `tcoll run ... | head`): keep the
                # job running; the forwarders still drain the ranks' pipes.
                pass

    def message(self, text: str) -> None:
        """Write a launcher message to stderr, ending it with a newline.

        Args:
            text: the message (may span lines).
        """
        self.write((text.rstrip("\n") + "\n").encode(errors="replace"), to_stderr=True)


class Tracebacks:
    """Folds each Python traceback that ends in a tcoll error into two lines (see the module docstring).

    Lines go in one at a time (`feed`); those to write come out, a traceback's
    once it is complete. Any other traceback, and every other line, comes out
    as it went in.

    Args:
        fold: fold tracebacks of tcoll errors (False: pass every line through).
    """

    def __init__(self, fold: bool = True) -> None:
        self._fold = fold
        self._held: list[bytes] = []
        self._state = "idle"  # or: frames, raised (the exception line seen), blank, chained

    def feed(self, line: bytes) -> list[bytes]:
        """Take one line (with its newline); return the lines to write now."""
        if not self._fold:
            return [line]
        text = line.rstrip(b"\r\n")
        state = self._state
        if state == "idle":
            if text == _TRACEBACK:
                self._held, self._state = [line], "frames"
            elif _BARE_ERROR.match(text):  # an exception raised nowhere (a cause): a chain may follow
                self._held, self._state = [line], "raised"
            else:
                return [line]
            return []
        if state == "frames" or (state == "chained" and text == _TRACEBACK):
            self._held.append(line)
            self._state = "frames" if text.startswith(b" ") or text == _TRACEBACK else "raised"
            return []
        if state == "raised" and not text:
            self._held.append(line)
            self._state = "blank"
            return []
        if state in ("blank", "chained") and (text.startswith(_CHAINED) or (state == "chained" and not text)):
            self._held.append(line)
            self._state = "chained"
            return []
        return self.flush() + self.feed(line)  # the traceback ended before this line

    def flush(self) -> list[bytes]:
        """The lines still held (at the end of the stream): a traceback, folded if it is complete."""
        held, state = self._held, self._state
        self._held, self._state = [], "idle"
        if state not in ("raised", "blank"):
            return held
        trailing = held[-1:] if state == "blank" else []
        body = held[:-1] if trailing else held
        return _folded(body) + trailing

    def __bool__(self) -> bool:
        return bool(self._held)


def _folded(lines: list[bytes]) -> list[bytes]:
    """A complete traceback: two lines (the user's call, the error) if it ends in a tcoll error, else as is."""
    error = lines[-1]
    if not error.startswith(b"tcoll."):
        return lines
    frames = []
    for at, line in enumerate(lines):
        found = _FRAME.match(line.rstrip(b"\r\n"))
        if found is not None:
            code = lines[at + 1].strip() if at + 1 < len(lines) and lines[at + 1].startswith(b"    ") else b""
            frames.append((found["path"].decode(errors="replace"), found["line"].decode(), code))
    own = [frame for frame in frames if not frame[0].startswith(_NOT_USERS)]
    if not own:
        return lines
    path, number, code = own[-1]  # the innermost frame of the user's own code: the call that failed
    where = f"{path}, line {number}: {code.decode(errors='replace')}".encode()
    return [b"  at " + where + b"\n", error]


class LineForwarder:
    """A daemon thread copying one pipe of one rank to the sink, line by line.

    Args:
        pipe: the read end of the rank's stdout or stderr.
        sink: the shared destination.
        to_stderr: the stream of the sink to write to.
        prefix: bytes put before each line (e.g. ``b"[3] "``), or ``b""``; a line that
            already starts with it is passed unchanged.
        tail_lines: how many of the last lines to keep for `tail` (0: none).
    """

    def __init__(self, pipe: IO[bytes], sink: Sink, to_stderr: bool, prefix: bytes,
                 tail_lines: int = 0) -> None:
        self._pipe = pipe
        self._sink = sink
        self._to_stderr = to_stderr
        self._prefix = prefix
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines or None)
        self._keep = tail_lines > 0
        self._tracebacks = Tracebacks(to_stderr and os.environ.get("TCOLL_TRACEBACK", "short") != "full")
        self._thread = threading.Thread(target=self._pump, name=f"tcoll-output{prefix.decode().strip()}",
                                        daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        """Read lines until end of file, writing each one whole."""
        try:
            for line in iter(self._pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the rank's last line had no newline
                self._write(self._tracebacks.feed(line))
        except (OSError, ValueError):
            pass  # the pipe was closed under us during cleanup
        finally:
            self._write(self._tracebacks.flush())
            try:
                self._pipe.close()
            except OSError:
                pass

    def _write(self, lines: list[bytes]) -> None:
        """Write `lines` in one go: another rank's line never comes between them (a folded traceback's two)."""
        if not lines:
            return
        # A line that already names its rank (scripts written for mp.spawn print
        # "[rank] ...") keeps its own prefix: "[0] [0] data" says nothing more.
        self._sink.write(b"".join(line if line.startswith(self._prefix) else self._prefix + line for line in lines),
                         self._to_stderr)
        if self._keep:
            self._tail.extend(line.decode(errors="replace").rstrip("\n") for line in lines)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the pipe reached end of file.

        Args:
            timeout: most seconds to wait (None: forever).

        Returns:
            True if every line was forwarded.
        """
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def tail(self) -> list[str]:
        """Return the last lines read (at most `tail_lines`), oldest first."""
        while True:
            try:
                return list(self._tail)
            except RuntimeError:  # appended to while copying (the rank is still writing)
                continue
