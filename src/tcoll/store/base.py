"""The key-value store ranks meet through, and a prefixed view of one.

A store holds byte values under string keys. Ranks publish what peers need
(addresses, host identities) with `set`, block on what they need with `get` /
`wait`, and count arrivals with `add`. Every implementation (memory, file, TCP,
torch adapter) follows the contract of `Store`, so the rendezvous and the
transports never care which one they were given.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from types import TracebackType

from ..errors import TimeoutError

__all__ = ["Store", "PrefixStore", "DEFAULT_TIMEOUT", "as_bytes", "parse_counter", "cas_result"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a store waits by default (the same as `tcoll.env.Settings.timeout`)."""


def as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """Return `value` as bytes; a str is encoded as UTF-8 (as torch's stores accept).

    Raises:
        TypeError: the value is neither bytes-like nor str.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, not {type(value).__name__}")


def parse_counter(key: str, raw: bytes | None) -> int:
    """Read the integer stored under `key` by `add` (ASCII decimal; missing counts as 0).

    Raises:
        ValueError: the value is not an integer.
    """
    if raw is None:
        return 0
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(f"store key {key!r} holds {raw[:40]!r}, not an integer counter") from None


def cas_result(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bool, bytes]:
    """Decide a compare-and-set: (whether to store `desired`, the value stored afterwards).

    A missing key matches `expected == b""`; when it stays missing the result is b"".
    """
    if (current is None and expected == b"") or (current is not None and current == expected):
        return True, desired
    return False, b"" if current is None else current


class Store(abc.ABC):
    """A key-value store shared by the ranks of a job.

    Implementations are safe to call from several threads.

    Args:
        timeout: seconds `get` and `wait` block when not given a timeout.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            raise ValueError(f"store timeout must be positive, not {timeout}")
        self.default_timeout = float(timeout)

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where the store lives, as a URL: tcp://host:port, file:///path, memory://."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any previous value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of `key`, blocking until some rank sets it.

        Args:
            key: the key.
            timeout: seconds to wait; None means `default_timeout`.

        Returns:
            The value.

        Raises:
            tcoll.TimeoutError: the key did not appear in time (`.missing_keys == [key]`).
        """

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the integer under `key` (missing counts as 0).

        The value is stored as ASCII decimal bytes, like torch's stores do.

        Returns:
            The new value.

        Raises:
            ValueError: the key holds something that is not an integer.
        """

    @abc.abstractmethod
    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """Atomically store `desired` if the value of `key` equals `expected`.

        A missing key matches `expected == b""`.

        Returns:
            The value stored after the operation (b"" if the key is still missing).
        """

    @abc.abstractmethod
    def check(self, keys: list[str]) -> bool:
        """Return whether every key exists, without waiting."""

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key exists.

        Args:
            keys: the keys.
            timeout: seconds to wait; None means `default_timeout`.

        Raises:
            tcoll.TimeoutError: some keys did not appear in time; the message lists
                them and the exception's `.missing_keys` holds them.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove `key`; return whether it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Return how many keys the store holds."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the store's resources; idempotent."""

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """Wait until every key exists, then return their values in order.

        Stores that can do this in one round trip (TCP) override it.

        Raises:
            tcoll.TimeoutError: as `wait`.
        """
        self.wait(keys, timeout)
        return [self.get(key, timeout) for key in keys]

    def prefix(self, p: str) -> PrefixStore:
        """Return a view of this store that puts `p + "/"` in front of every key."""
        return PrefixStore(self, p)

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"

    # -- helpers for implementations ------------------------------------------------

    def _timeout(self, timeout: float | None) -> float:
        """Resolve a timeout argument: None means the default; negative is an error."""
        if timeout is None:
            return self.default_timeout
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, not {timeout}")
        return float(timeout)

    def _timeout_error(self, missing: Iterable[str], timeout: float) -> TimeoutError:
        """Build the TimeoutError `get` / `wait` raise, naming the keys and this store."""
        missing = list(missing)
        shown = ", ".join(repr(k) for k in missing[:20]) + (
            f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        )
        noun = "key" if len(missing) == 1 else "keys"
        error = TimeoutError(f"store {self.address}: timed out after {timeout:g}s waiting for {noun} {shown}")
        error.missing_keys = missing  # type: ignore[attr-defined]
        return error


class PrefixStore(Store):
    """A view of a store in which every key is `prefix + "/" + key`.

    Views nest: `store.prefix("a").prefix("b")` uses keys "a/b/<key>". Closing a
    view does not close the store under it, which its creator still owns
    (unless the view was made with `own=True`).
    `num_keys` counts the keys of the whole store (as torch's PrefixStore does).

    Args:
        store: the store to view.
        prefix: the prefix, without the trailing "/".
        own: whether closing the view closes `store` (for a view handed out as
            the only handle on a store, e.g. by `tcoll.startup.rendezvous.open_store`).
    """

    def __init__(self, store: Store, prefix: str, *, own: bool = False) -> None:
        super().__init__(store.default_timeout)
        if isinstance(store, PrefixStore):
            # Flatten nested views so each call crosses one wrapper, not a chain;
            # owning a view owns its store only if that view did.
            prefix = f"{store.prefix_str}/{prefix}"
            own = own and store._own
            store = store.store
        self._own: bool = own
        self.store: Store = store
        self.prefix_str: str = prefix
        self._head = prefix + "/"

    @property
    def address(self) -> str:
        """The address of the underlying store."""
        return self.store.address

    def _key(self, key: str) -> str:
        return self._head + key

    def _strip(self, error: TimeoutError) -> TimeoutError:
        """Report missing keys in this view's terms (the message keeps full keys)."""
        missing = getattr(error, "missing_keys", None)
        if missing is not None:
            error.missing_keys = [k[len(self._head) :] if k.startswith(self._head) else k for k in missing]  # type: ignore[attr-defined]
        return error

    def set(self, key: str, value: bytes) -> None:
        """See `Store.set`."""
        self.store.set(self._key(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """See `Store.get`."""
        try:
            return self.store.get(self._key(key), timeout)
        except TimeoutError as error:
            raise self._strip(error) from None

    def add(self, key: str, amount: int) -> int:
        """See `Store.add`."""
        return self.store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """See `Store.compare_set`."""
        return self.store.compare_set(self._key(key), expected, desired)

    def check(self, keys: list[str]) -> bool:
        """See `Store.check`."""
        return self.store.check([self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """See `Store.wait`."""
        try:
            self.store.wait([self._key(k) for k in keys], timeout)
        except TimeoutError as error:
            raise self._strip(error) from None

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """See `Store.multi_get`."""
        try:
            return self.store.multi_get([self._key(k) for k in keys], timeout)
        except TimeoutError as error:
            raise self._strip(error) from None

    def delete(self, key: str) -> bool:
        """See `Store.delete`."""
        return self.store.delete(self._key(key))

    def num_keys(self) -> int:
        """See `Store.num_keys`."""
        return self.store.num_keys()

    def close(self) -> None:
        """Close the underlying store if this view owns it; otherwise do nothing."""
        if self._own:
            self.store.close()

    def __repr__(self) -> str:
        return f"PrefixStore({self.store!r}, {self.prefix_str!r})"
