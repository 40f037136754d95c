"""Every shared-memory file tcoll makes: its name, creating and mapping it, removing it, sweeping leftovers.

The shm transport's rings, a communicator's collective arena and the zero-copy
buffers of `Communicator.empty` are memfds named ``tcoll-<run id>-<rank>-<token>``,
which the other ranks open through /proc/<pid>/fd, so a killed rank leaves
nothing behind; they check that the file they opened is the memfd of that name
(a number its owner let go of may name another file since). Only where the
ranks of a host see different pid namespaces are they files of that name in
/dev/shm, unlinked as soon as every rank has mapped them (rings, arena) or
freed (buffers), and swept by the launchers. One convention, one way to create
and map them, and one sweep, which `tcoll run` and `tcoll.spawn` use to
remove what a finished run left behind.
"""

from __future__ import annotations

import errno
import mmap
import os

from .errors import TransportError

__all__ = ["SHM_DIR", "Segment", "SegmentGoneError", "segment_name", "new_segment", "unlink",
           "remove_shm_segments", "find_anonymous", "anonymous_link"]

SHM_DIR = "/dev/shm"


def segment_name(run_id: str, rank: int, token: str) -> str:
    """The name of a rank's segment: tcoll-<run id>-<rank>-<token>."""
    return f"tcoll-{run_id or 'local'}-{rank}-{token}"


def unlink(path: str) -> None:
    """Remove the file at `path` if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Segment:
    """A file in /dev/shm, mapped shared into this process.

    Make one with `Segment.create` (a new file, its pages allocated at once,
    so that no page fault lands in a hot path) or `Segment.open` (a file
    another rank created).

    Attributes:
        path: the file's path.
        size: bytes mapped.
        map: the shared mapping.
    """

    def __init__(self, path: str, size: int, mapping: mmap.mmap) -> None:
        self.path = path
        self.size = size
        self.map = mapping

    @classmethod
    def create(cls, path: str, size: int, hint: str = "") -> Segment:
        """Create the file at `path` (it must not exist), allocate `size` bytes and map them.

        Args:
            path: where, usually os.path.join(SHM_DIR, segment_name(...)).
            size: bytes (at least 1 is allocated).
            hint: what may help when /dev/shm is too small, added to the error.

        Raises:
            TransportError: the file exists or /dev/shm has no room; nothing is left behind.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create {path}: {exc}") from exc
        length = max(size, 1)
        try:
            os.ftruncate(fd, length)
            os.posix_fallocate(fd, 0, length)  # allocate now, not on first touch in a hot path
            return cls(path, size, _map(fd, length))
        except OSError as exc:
            unlink(path)
            raise TransportError(f"cannot allocate {size} B of shared memory at {path}: {exc}"
                                 + (f"; {hint}" if hint else "")) from exc
        finally:
            os.close(fd)

    @classmethod
    def create_anonymous(cls, name: str, size: int, hint: str = "") -> Segment:
        """A segment with no file in /dev/shm: a memfd, found by others at /proc/<pid>/fd/<fd>.

        Its memory goes when this process has closed it (or died) and every
        mapping is gone, so a kill -9 leaves nothing behind, whoever launched.
        Readers find it with `find_anonymous` while this process holds it.

        Args:
            name: the name readers look for (the usual segment name).
            size: bytes (at least 1 is allocated).
            hint: what may help when memory is short, added to the error.

        Raises:
            TransportError: memfd is not available or memory is short.
        """
        length = max(size, 1)
        try:
            fd = os.memfd_create(name)
        except (AttributeError, OSError) as exc:
            raise TransportError(f"cannot create the memory file {name}: {exc}") from exc
        try:
            os.ftruncate(fd, length)
            os.posix_fallocate(fd, 0, length)  # allocate now, not on first touch in a hot path
            segment = cls(f"/proc/{os.getpid()}/fd/{fd}", size, _map(fd, length))
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"cannot allocate {size} B of shared memory for {name}: {exc}"
                                 + (f"; {hint}" if hint else "")) from exc
        segment.fd, segment.name = fd, name
        return segment

    @classmethod
    def open(cls, path: str, name: str | None = None) -> Segment:
        """Map the whole file at `path`, made by another rank.

        Args:
            path: a file in /dev/shm, or a memfd's /proc/<pid>/fd/<fd>.
            name: the memfd's name, for a /proc path: the file opened must be
                that memfd. Once its owner let go of it, the fd number may name
                another file of that process, which must never be mapped instead.

        Raises:
            SegmentGoneError: the file is gone, or is no longer the memfd `name`.
            TransportError: it cannot be opened or mapped (permissions, memory).
        """
        try:
            # (no controlling terminal, no blocking: a reused number may name a tty or a FIFO, refused below)
            fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
            try:
                if name is not None and path.startswith("/proc/"):
                    _check_is_memfd(fd, path, name)
                size = os.fstat(fd).st_size
                return cls(path, size, _map(fd, size))
            finally:
                os.close(fd)
        except OSError as exc:
            gone = exc.errno in (errno.ENOENT, errno.ENXIO)
            raise (SegmentGoneError if gone else TransportError)(f"cannot map {path}: {exc}") from exc

    fd: int | None = None  # the memfd a `create_anonymous` segment holds open for its readers
    name: str | None = None  # its name, which readers pass to `open` (None: a file, named by its path)

    def unlink(self) -> None:
        """Remove the file (or let go of the memfd); the mapping stays valid, and so do other ranks'."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        else:
            unlink(self.path)

    def close(self) -> None:
        """Unmap, unless a view is still exported (then the mapping goes with the last view)."""
        try:
            self.map.close()
        except BufferError:
            pass


def new_segment(name: str, size: int, *, anonymous: bool, hint: str = "") -> Segment:
    """A new segment called `name`: a memfd if `anonymous`, else a file in /dev/shm.

    A memfd leaves nothing behind whatever kills its creator; its readers open
    `segment.path` (/proc/<pid>/fd/<fd>) while the creator holds it, so use it
    where every reader sees the creator's pid (one pid namespace). A file is
    removed by `unlink` once every reader has mapped it, or by the launcher's sweep.

    Raises:
        TransportError: no memory (or no room in /dev/shm); nothing is left behind.
    """
    if anonymous:
        return Segment.create_anonymous(name, size, hint)
    return Segment.create(os.path.join(SHM_DIR, name), size, hint)


def anonymous_link(name: str) -> str:
    """What /proc/<pid>/fd/<n> reads as for the memfd called `name`."""
    return f"/memfd:{name} (deleted)"


class SegmentGoneError(TransportError):
    """A segment's file is gone: its owner let go of it (it does so early only when its setup failed)."""


def _check_is_memfd(fd: int, path: str, name: str) -> None:
    """Raise SegmentGoneError unless `fd` (opened through `path`) is the memfd called `name`."""
    actual = os.readlink(f"/proc/self/fd/{fd}")
    if actual != anonymous_link(name):
        raise SegmentGoneError(f"cannot map {path}: it no longer holds the memory file {name} (its owner let go of "
                             f"it; the number now names {actual})")


def find_anonymous(pid: int, name: str) -> str | None:
    """The /proc path of process `pid`'s memfd called `name`, or None if it holds none by that name."""
    base, wanted = f"/proc/{pid}/fd", anonymous_link(name)
    try:
        fds = os.listdir(base)
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"{base}/{fd}") == wanted:
                return f"{base}/{fd}"
        except OSError:
            continue
    return None


def _map(fd: int, size: int) -> mmap.mmap:
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))


def remove_shm_segments(run_id: str, directory: str = SHM_DIR) -> list[str]:
    """Delete the shared-memory files of a run: ``<directory>/tcoll-<run_id>-*``.

    Args:
        run_id: the run's id; empty does nothing.
        directory: where POSIX shared memory lives.

    Returns:
        The names removed.
    """
    if not run_id:
        return []
    head, removed = f"tcoll-{run_id}-", []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if name.startswith(head):
            try:
                os.unlink(os.path.join(directory, name))
                removed.append(name)
            except OSError:
                pass
    return removed
