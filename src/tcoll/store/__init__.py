"""Key-value stores the ranks of a job meet through: memory, file, TCP, and torch's (loaded on first use).

Owns: the Store interface and its implementations, the TCP store's server, its wire format and its limits.
May import: the leaves only (errors, env, keepalive); importing tcoll never imports torch through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import DEFAULT_TIMEOUT, PrefixStore, Store
from .file import FileStore
from .limits import StoreLimitError, StoreLimits
from .memory import MemoryStore
from .tcp import TCPStore, TCPStoreServer

if TYPE_CHECKING:
    from .torch_store import TorchStore

__all__ = [
    "DEFAULT_TIMEOUT",
    "Store",
    "PrefixStore",
    "MemoryStore",
    "FileStore",
    "TCPStore",
    "TCPStoreServer",
    "StoreLimits",
    "StoreLimitError",
    "TorchStore",
]


def __getattr__(name: str) -> Any:
    if name == "TorchStore":
        from .torch_store import TorchStore

        return TorchStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
