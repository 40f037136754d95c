"""Key-value stores the ranks of a job meet through: memory, file, TCP, and torch's.

`TorchStore` and `open_store` are loaded on first use: the first so that
importing tcoll never imports torch's machinery, the second because it lives in
`tcoll.rendezvous`, which itself imports this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import DEFAULT_TIMEOUT, PrefixStore, Store
from .file import FileStore
from .memory import MemoryStore
from .tcp import TCPStore, TCPStoreServer

if TYPE_CHECKING:
    from ..rendezvous import open_store
    from .torch_store import TorchStore

__all__ = [
    "DEFAULT_TIMEOUT",
    "Store",
    "PrefixStore",
    "MemoryStore",
    "FileStore",
    "TCPStore",
    "TCPStoreServer",
    "TorchStore",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "TorchStore":
        from .torch_store import TorchStore

        return TorchStore
    if name == "open_store":
        from ..rendezvous import open_store

        return open_store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
