"""The TCP store server's limits, and the error a client gets when a request exceeds one.

The defaults are generous for real jobs (rendezvous cards and small objects
are a few KiB) and bound what one client, with or without the key, can make
the hosting process hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..env import parse_size, read_variables
from ..errors import TcollError

__all__ = ["StoreLimits", "StoreLimitError", "ENTRY_OVERHEAD", "SMALL_REQUEST"]

ENTRY_OVERHEAD = 64
"""Bytes each stored key counts for beyond its key and value, so that a flood of empty keys is bounded too."""

SMALL_REQUEST = 16 << 10
"""Requests up to this size are read at once, whatever the receive budget holds (rendezvous records are
smaller): they may take the budget over by this much per connection, and no slow request makes them wait."""


class StoreLimitError(TcollError, ValueError):
    """A store request exceeds one of the server's limits (value size, total size); nothing was stored."""


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    """What a `TCPStoreServer` accepts.

    Attributes:
        max_value: largest value (or key) one request may store (TCOLL_STORE_MAX_VALUE, default 64 MiB).
        max_bytes: most bytes of keys and values the store holds at once; requests
            being received count against the same budget again (TCOLL_STORE_MAX_BYTES, default 1 GiB).
        max_connections: most authenticated connections at once; a client over the limit
            retries until its connect timeout (TCOLL_STORE_MAX_CONNECTIONS, default 4096).
        max_handshakes: most connections still proving the key; when full, the oldest is dropped.
        handshake_timeout: seconds a connection has, from accept, to prove the key
            (TCOLL_STORE_HANDSHAKE_TIMEOUT, default 10).
        idle_timeout: seconds a connection may stay without a request before the server
            closes it; clients reconnect by themselves (TCOLL_STORE_IDLE_TIMEOUT, default 300; 0: never).
    """

    max_value: int = 64 << 20
    max_bytes: int = 1 << 30
    max_connections: int = 4096
    max_handshakes: int = 256
    handshake_timeout: float = 10.0
    idle_timeout: float = 300.0

    _ENV = {
        "max_value": ("TCOLL_STORE_MAX_VALUE", parse_size),
        "max_bytes": ("TCOLL_STORE_MAX_BYTES", parse_size),
        "max_connections": ("TCOLL_STORE_MAX_CONNECTIONS", int),
        "handshake_timeout": ("TCOLL_STORE_HANDSHAKE_TIMEOUT", float),
        "idle_timeout": ("TCOLL_STORE_IDLE_TIMEOUT", float),
    }

    def __post_init__(self) -> None:
        for name in ("max_value", "max_bytes", "max_connections", "max_handshakes"):
            if getattr(self, name) < 1:
                raise ValueError(f"store limit {name} must be at least 1, not {getattr(self, name)}")
        if self.handshake_timeout <= 0 or self.idle_timeout < 0:
            raise ValueError("store handshake_timeout must be positive and idle_timeout not negative")

    @property
    def max_request(self) -> int:
        """The longest request frame read after the handshake (a compare-and-set carries two values)."""
        return 2 * self.max_value + (1 << 20)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: float | int | None) -> StoreLimits:
        """Defaults, overridden by TCOLL_STORE_* variables, then by keywords that are not None.

        Raises:
            ValueError: a variable or keyword has a bad value.
        """
        values = read_variables(cls._ENV, environ)  # type: ignore[attr-defined]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
