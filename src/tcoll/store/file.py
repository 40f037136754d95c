"""A store kept in a file, shared by processes of one host or hosts of a shared file system.

The file is an append-only log of records; each client replays what it has not
seen yet into a local dict. Writers hold an exclusive `flock` while they read
the tail and append, so read-modify-write operations (`add`, `compare_set`)
are atomic across processes; readers hold a shared lock. Waiting polls the
file with a backoff from 1 ms to 50 ms: a file offers nothing to block on.

Record layout (little endian): op (1 byte), key length (u32), value length
(u32), CRC-32 of key + value (u32), key, value. A record left half-written by
a writer that died is cut off by the next writer; a CRC mismatch means the
file was damaged and raises RendezvousError.

Like torch's FileStore, the file counts its open clients and the last client
to close deletes it, so the next job can reuse the path; a file left by a job
that was killed still holds its keys: use a fresh path per run.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from typing import TypeVar

from ..errors import RendezvousError
from .base import DEFAULT_TIMEOUT, Store, as_bytes, cas_result, parse_counter

__all__ = ["FileStore"]

_RECORD = struct.Struct("<BIII")
_SET, _DELETE = 1, 2
# Internal keys start with NUL so they cannot clash with user keys and are not counted.
_INTERNAL = "\x00tcoll/"
_REFCOUNT = _INTERNAL + "clients"
_T = TypeVar("_T")


def _record(op: int, key: bytes, value: bytes) -> bytes:
    return _RECORD.pack(op, len(key), len(value), zlib.crc32(key + value)) + key + value


class FileStore(Store):
    """A store in a file, guarded by `fcntl.flock`.

    Args:
        path: the file; created if missing. Every rank must name the same file.
        timeout: default seconds for `get` and `wait`.

    Raises:
        RendezvousError: the file cannot be opened or locked.
    """

    def __init__(self, path: str | os.PathLike[str], timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._path = os.path.abspath(os.fspath(path))
        self._mutex = threading.Lock()  # flock does not exclude threads sharing one descriptor
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._fd = -1
        self._open_registered()

    @property
    def address(self) -> str:
        """The store's address: file:// followed by the absolute path."""
        return f"file://{self._path}"

    @property
    def path(self) -> str:
        """The absolute path of the file."""
        return self._path

    # -- file handling ---------------------------------------------------------------

    def _open_registered(self) -> None:
        """Open the file and count this client in it, retrying if the last client deleted it meanwhile."""
        for _ in range(100):
            try:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            except OSError as exc:
                raise RendezvousError(f"cannot open store file {self._path}: {exc}", address=self.address) from exc
            with self._mutex:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
                try:
                    if self._same_file():
                        self._sync(writer=True)
                        self._append(
                            _SET, _REFCOUNT, str(parse_counter(_REFCOUNT, self._data.get(_REFCOUNT)) + 1).encode()
                        )
                        return
                finally:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            # The file was unlinked between our open and our lock: start over with a new one.
            os.close(self._fd)
            self._data.clear()
            self._offset = 0
        raise RendezvousError(f"store file {self._path} keeps being deleted", address=self.address)

    def _same_file(self) -> bool:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            return False
        own = os.fstat(self._fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def _sync(self, writer: bool) -> None:
        """Replay records appended since the last call (file lock held).

        Args:
            writer: whether we hold the exclusive lock, so a torn tail may be cut off.
        """
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        blob = os.pread(self._fd, size - self._offset, self._offset)
        pos = 0
        while pos + _RECORD.size <= len(blob):
            op, klen, vlen, crc = _RECORD.unpack_from(blob, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(blob):
                break
            key_b = blob[pos + _RECORD.size : pos + _RECORD.size + klen]
            value = blob[pos + _RECORD.size + klen : end]
            if op not in (_SET, _DELETE) or zlib.crc32(key_b + value) != crc:
                raise RendezvousError(
                    f"store file {self._path} is corrupt at byte {self._offset + pos}", address=self.address
                )
            key = key_b.decode()
            if op == _SET:
                self._data[key] = value
            else:
                self._data.pop(key, None)
            pos = end
        self._offset += pos
        if writer and pos < len(blob):
            # Only a writer that died mid-record leaves this; no writer is active now.
            os.ftruncate(self._fd, self._offset)

    def _append(self, op: int, key: str, value: bytes) -> None:
        """Append a record and apply it locally (exclusive lock held, after `_sync`)."""
        record = _record(op, key.encode(), value)
        written = os.write(self._fd, record)
        if written != len(record):
            os.ftruncate(self._fd, self._offset)
            raise RendezvousError(f"short write to store file {self._path} (disk full?)", address=self.address)
        self._offset += len(record)
        if op == _SET:
            self._data[key] = value
        else:
            self._data.pop(key, None)

    def _locked(self, writer: bool, action: Callable[[], _T]) -> _T:
        """Run `action` after replaying the file, under the thread mutex and the file lock."""
        with self._mutex:
            if self._fd < 0:
                raise RendezvousError(f"store {self.address} is closed", address=self.address)
            fcntl.flock(self._fd, fcntl.LOCK_EX if writer else fcntl.LOCK_SH)
            try:
                self._sync(writer)
                return action()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- the Store interface ---------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        """See `Store.set`."""
        value = as_bytes(value)
        self._locked(True, lambda: self._append(_SET, key, value))

    def _wait_for(self, keys: list[str], timeout: float | None) -> dict[str, bytes]:
        """Poll until every key exists; return their values."""
        limit = self._timeout(timeout)
        deadline = time.monotonic() + limit
        delay = 0.001
        while True:
            found = self._locked(False, lambda: {k: self._data[k] for k in keys if k in self._data})
            if len(found) == len(set(keys)):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error([k for k in keys if k not in found], limit)
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """See `Store.get`."""
        return self._wait_for([key], timeout)[key]

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """See `Store.multi_get`."""
        found = self._wait_for(list(keys), timeout)
        return [found[k] for k in keys]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """See `Store.wait`."""
        self._wait_for(list(keys), timeout)

    def add(self, key: str, amount: int) -> int:
        """See `Store.add`."""

        def action() -> int:
            value = parse_counter(key, self._data.get(key)) + int(amount)
            self._append(_SET, key, str(value).encode("ascii"))
            return value

        return self._locked(True, action)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """See `Store.compare_set`."""
        expected, desired = as_bytes(expected), as_bytes(desired)

        def action() -> bytes:
            swap, result = cas_result(self._data.get(key), expected, desired)
            if swap:
                self._append(_SET, key, desired)
            return result

        return self._locked(True, action)

    def check(self, keys: list[str]) -> bool:
        """See `Store.check`."""
        return self._locked(False, lambda: all(k in self._data for k in keys))

    def delete(self, key: str) -> bool:
        """See `Store.delete`."""

        def action() -> bool:
            if key not in self._data:
                return False
            self._append(_DELETE, key, b"")
            return True

        return self._locked(True, action)

    def num_keys(self) -> int:
        """See `Store.num_keys` (internal bookkeeping keys are not counted)."""
        return self._locked(False, lambda: sum(1 for k in self._data if not k.startswith(_INTERNAL)))

    def close(self) -> None:
        """Stop using the file; the last client to close deletes it. Idempotent."""
        with self._mutex:
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._fd = fd  # let _sync/_append use the descriptor while we hold the lock
                self._sync(writer=True)
                left = parse_counter(_REFCOUNT, self._data.get(_REFCOUNT)) - 1
                if left <= 0 and self._same_file():
                    os.unlink(self._path)
                else:
                    self._append(_SET, _REFCOUNT, str(left).encode())
            except OSError:
                pass  # the file vanished or the disk failed: nothing more to clean up
            finally:
                self._fd = -1
                os.close(fd)  # closing the descriptor also releases the lock
            self._data.clear()
