"""A view of a store whose values carry the job key's signature: for stores that check no key.

torch's TCPStore, which the torch backend is handed, lets anyone who reaches
its port read and write. tcoll keeps nothing secret there (the job key never
goes into a store), but it does read what its ranks wrote: addresses to dial,
segment names to map. Through this view, every value is written with an
HMAC of its key and contents, and a value that does not verify is an error
that names it, so a stranger's forged address or name is never used.
Counters (`add`) cannot be signed; a stranger can only disturb them, which
the ranks see as a failed rendezvous, never as a wrong value.
"""

from __future__ import annotations

import hashlib
import hmac

from ..errors import RendezvousError
from .base import Store, as_bytes

__all__ = ["SignedStore"]

_TAG = 32  # bytes of HMAC-SHA256


class SignedStore(Store):
    """Signs what it sets and verifies what it gets, over any `Store`.

    Args:
        store: the store to wrap (not closed by this view unless `own`).
        key: the job's key; every rank of the job must use the same.
        own: close `store` when this view is closed.
    """

    def __init__(self, store: Store, key: str | bytes, *, own: bool = False) -> None:
        super().__init__(store.default_timeout)
        self.inner = store
        self._key = as_bytes(key)
        self._own = own

    @property
    def address(self) -> str:
        return self.inner.address

    def _sign(self, key: str, value: bytes) -> bytes:
        return value + hmac.new(self._key, key.encode() + b"\0" + value, hashlib.sha256).digest()

    def _open(self, key: str, raw: bytes) -> bytes:
        value = raw[:-_TAG]
        if len(raw) < _TAG or not hmac.compare_digest(raw, self._sign(key, value)):
            raise RendezvousError(f"the value of {key!r} in the store at {self.address} does not carry this "
                                  f"job's signature: another process wrote it, or the ranks' keys differ "
                                  f"(TCOLL_AUTH_KEY, or the user's secret file)")
        return value

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, self._sign(key, as_bytes(value)))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self._open(key, self.inner.get(key, timeout))

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        return [self._open(key, raw) for key, raw in zip(keys, self.inner.multi_get(keys, timeout))]

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        expected, desired = as_bytes(expected), as_bytes(desired)
        current = self.inner.compare_set(key, self._sign(key, expected) if expected else b"",
                                         self._sign(key, desired))
        return self._open(key, current) if current else current

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self.inner.wait(keys, timeout)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def close(self) -> None:
        if self._own:
            self.inner.close()
