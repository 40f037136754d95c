"""Copy the ranks' output to the launcher's, whole lines at a time, each prefixed with its rank."""

from __future__ import annotations

import collections
import sys
import threading
from typing import IO, Any

__all__ = ["LineForwarder", "Sink"]


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
        self._thread = threading.Thread(target=self._pump, name=f"tcoll-output{prefix.decode().strip()}",
                                        daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        """Read lines until end of file, writing each one whole."""
        try:
            for line in iter(self._pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"  # the rank's last line had no newline
                # A line that already names its rank (scripts written for mp.spawn print
                # "[rank] ...") keeps its own prefix: "[0] [0] data" says nothing more.
                prefix = b"" if line.startswith(self._prefix) else self._prefix
                self._sink.write(prefix + line, self._to_stderr)
                if self._keep:
                    self._tail.append(line.decode(errors="replace").rstrip("\n"))
        except (OSError, ValueError):
            pass  # the pipe was closed under us during cleanup
        finally:
            try:
                self._pipe.close()
            except OSError:
                pass

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
