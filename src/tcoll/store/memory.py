"""An in-process store, for ranks that are threads of one process (tests, single-rank jobs)."""

from __future__ import annotations

import threading
import time

from ..errors import RendezvousError
from .base import DEFAULT_TIMEOUT, Store, as_bytes, cas_result, parse_counter

__all__ = ["MemoryStore"]


class MemoryStore(Store):
    """A dict guarded by a condition variable.

    Args:
        timeout: default seconds for `get` and `wait`.
        name: shown in the address ("memory://<name>"), to tell stores apart in messages.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, name: str = "") -> None:
        super().__init__(timeout)
        self._name = name
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False

    @property
    def address(self) -> str:
        """The store's address: memory:// followed by its name."""
        return f"memory://{self._name}"

    def _check_open(self) -> None:
        # Called with the condition held.
        if self._closed:
            raise RendezvousError(f"store {self.address} is closed", address=self.address)

    def set(self, key: str, value: bytes) -> None:
        """See `Store.set`."""
        value = as_bytes(value)
        with self._cond:
            self._check_open()
            self._data[key] = value
            self._cond.notify_all()

    def _wait_locked(self, keys: list[str], timeout: float) -> None:
        """Wait, with the condition held, until every key exists or the time is up."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_open()
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout_error(missing, timeout)
            self._cond.wait(remaining)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """See `Store.get`."""
        with self._cond:
            self._wait_locked([key], self._timeout(timeout))
            return self._data[key]

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """See `Store.multi_get`."""
        with self._cond:
            self._wait_locked(list(keys), self._timeout(timeout))
            return [self._data[k] for k in keys]

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """See `Store.wait`."""
        with self._cond:
            self._wait_locked(list(keys), self._timeout(timeout))

    def add(self, key: str, amount: int) -> int:
        """See `Store.add`."""
        with self._cond:
            self._check_open()
            value = parse_counter(key, self._data.get(key)) + int(amount)
            self._data[key] = str(value).encode("ascii")
            self._cond.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """See `Store.compare_set`."""
        expected, desired = as_bytes(expected), as_bytes(desired)
        with self._cond:
            self._check_open()
            swap, result = cas_result(self._data.get(key), expected, desired)
            if swap:
                self._data[key] = desired
                self._cond.notify_all()
            return result

    def check(self, keys: list[str]) -> bool:
        """See `Store.check`."""
        with self._cond:
            self._check_open()
            return all(k in self._data for k in keys)

    def delete(self, key: str) -> bool:
        """See `Store.delete`."""
        with self._cond:
            self._check_open()
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        """See `Store.num_keys`."""
        with self._cond:
            self._check_open()
            return len(self._data)

    def close(self) -> None:
        """Drop the data and wake every waiter, which then raises RendezvousError."""
        with self._cond:
            self._closed = True
            self._data.clear()
            self._cond.notify_all()
