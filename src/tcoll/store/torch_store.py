"""A tcoll `Store` over a `torch.distributed.Store` (TCPStore, FileStore, PrefixStore, ...).

Used when torchrun's agent already serves a torch TCPStore at MASTER_ADDR:MASTER_PORT
(TORCHELASTIC_USE_AGENT_STORE=True) and by the torch backend, which is handed a
torch store by `init_process_group`. The adapter only calls methods on the
object it wraps, so torch is imported solely by `TorchStore.connect_tcp`.
"""

from __future__ import annotations

import datetime
from typing import Any

from ..errors import RendezvousError
from .base import DEFAULT_TIMEOUT, Store, as_bytes

__all__ = ["TorchStore"]


class TorchStore(Store):
    """Adapts a torch.distributed store to the tcoll `Store` interface.

    Args:
        torch_store: the torch store (anything with torch's Store methods).
        timeout: default seconds for `get` and `wait`.
        address: shown in messages (torch stores do not report one).
    """

    def __init__(self, torch_store: Any, timeout: float = DEFAULT_TIMEOUT, *, address: str = "torch://") -> None:
        super().__init__(timeout)
        self.torch_store = torch_store
        self._address = address

    @classmethod
    def connect_tcp(cls, host: str, port: int, timeout: float = DEFAULT_TIMEOUT) -> TorchStore:
        """Connect, as a client, to a torch TCPStore (e.g. the torchrun agent's).

        Args:
            host: the store's host.
            port: the store's port.
            timeout: default seconds for requests and for connecting.

        Returns:
            The adapter.

        Raises:
            ImportError: torch is not installed.
            RendezvousError: the store could not be reached.
        """
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise ImportError(
                "a torch TCPStore (torchrun agent store) needs torch installed: pip install torch"
            ) from exc
        address = f"tcp://{host}:{port}"
        try:
            store = dist.TCPStore(
                host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
            )
        except RuntimeError as exc:  # DistNetworkError and friends derive from RuntimeError
            raise RendezvousError(f"cannot reach the torch store at {address}: {exc}", address=address) from exc
        return cls(store, timeout, address=address)

    @property
    def address(self) -> str:
        """The address given at construction."""
        return self._address

    def _missing(self, keys: list[str]) -> list[str]:
        """The keys absent now; raises RendezvousError if the store cannot even answer that."""
        try:
            return [k for k in keys if not self.torch_store.check([k])]
        except RuntimeError as exc:
            raise RendezvousError(f"lost the torch store at {self.address}: {exc}", address=self.address) from exc

    def set(self, key: str, value: bytes) -> None:
        """See `Store.set`."""
        self.torch_store.set(key, as_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        """See `Store.get`."""
        # torch's get waits with the store-wide timeout; wait first to honour ours.
        self.wait([key], timeout)
        return bytes(self.torch_store.get(key))

    def add(self, key: str, amount: int) -> int:
        """See `Store.add`."""
        return int(self.torch_store.add(key, int(amount)))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """See `Store.compare_set`."""
        expected, desired = as_bytes(expected), as_bytes(desired)
        result = bytes(self.torch_store.compare_set(key, expected, desired))
        # torch answers `expected` when the key is missing and expected is not
        # empty; tcoll answers b"" (the key is still missing).
        if result == expected and expected != b"" and self._missing([key]):
            return b""
        return result

    def check(self, keys: list[str]) -> bool:
        """See `Store.check`."""
        return bool(self.torch_store.check(list(keys)))

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """See `Store.wait`."""
        limit = self._timeout(timeout)
        try:
            self.torch_store.wait(list(keys), datetime.timedelta(seconds=limit))
        except RuntimeError:  # torch raises DistStoreError / RuntimeError on timeout
            missing = self._missing(list(keys))
            if not missing:
                return  # the keys arrived between torch's timeout and our look: the wait is over
            raise self._timeout_error(missing, limit) from None

    def delete(self, key: str) -> bool:
        """See `Store.delete`."""
        return bool(self.torch_store.delete_key(key))

    def num_keys(self) -> int:
        """See `Store.num_keys` (torch counts its own bookkeeping keys too)."""
        return int(self.torch_store.num_keys())

    def close(self) -> None:
        """Drop the reference; torch stores close when garbage-collected."""
        self.torch_store = _Closed(self._address)


class _Closed:
    """Stands in for a closed torch store: any use raises RendezvousError."""

    def __init__(self, address: str) -> None:
        self._address = address

    def __getattr__(self, name: str) -> Any:
        raise RendezvousError(f"store {self._address} is closed", address=self._address)
