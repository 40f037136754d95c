"""Noticing, while the ranks meet, that one of them died: within a second, by name.

Every rank publishes who it is (host, pid namespace, pid, start time) under
``alive/<rank>`` before anything else it does in `connect_world`. While a rank
then waits for the others (for their cards, their segments, their connections),
it looks every `CHECK_INTERVAL` seconds at the records of the ranks it shares a
host and a pid namespace with: a pid that is gone, or reused by another
process, is a rank that died, and the wait ends with a RendezvousError that
names it. Ranks on other hosts cannot be looked at this way; their launcher
(`tcoll run`, torchrun, srun) ends the job when one of them dies.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import RendezvousError
from ..store.base import Store
from ..transport.shm.channel import process_alive

__all__ = ["CHECK_INTERVAL", "PeerWatch", "WatchedStore"]

CHECK_INTERVAL = 0.5
_LOOKUPS = 16


class PeerWatch:
    """Which ranks of this host have died since they said they were alive.

    Args:
        store: the world's store (its `alive/<rank>` records).
        rank: this rank.
        size: the number of ranks.
        me: this rank's identity card (host, pidns, pid, start_time).
    """

    def __init__(self, store: Store, rank: int, size: int, me: dict[str, Any]) -> None:
        self.store = store
        self.rank = rank
        self.me = me
        self._unknown = set(range(size)) - {rank}
        self._neighbours: dict[int, dict[str, Any]] = {}
        self._next = 0.0

    def publish(self) -> None:
        """Say this rank is alive (first thing, so that its death can be seen from then on)."""
        self.store.set(f"alive/{self.rank}", json.dumps(self.me, separators=(",", ":")).encode())

    def check(self) -> None:
        """Raise if a rank of this host died (looks at most every CHECK_INTERVAL seconds).

        Raises:
            RendezvousError: names the dead ranks and their pids.
        """
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + CHECK_INTERVAL
        self._learn()
        dead = [r for r, card in sorted(self._neighbours.items())
                if not process_alive(int(card["pid"]), card.get("start_time"))]
        if dead:
            who = ", ".join(f"rank {r} (pid {self._neighbours[r]['pid']})" for r in dead)
            raise RendezvousError(f"{who} died while the ranks were meeting at {self.store.address}: "
                                  f"rank {self.rank} stops waiting for it", missing=dead, address=self.store.address)

    def _learn(self) -> None:
        """Read records that appeared since the last look; keep those of this host and pid namespace."""
        # A bounded number of look-ups per look, so that a large world does not flood the store.
        for peer in [r for r in sorted(self._unknown)[:_LOOKUPS] if self.store.check([f"alive/{r}"])]:
            self._unknown.discard(peer)
            card = json.loads(self.store.get(f"alive/{peer}", CHECK_INTERVAL))
            if card.get("host") == self.me.get("host") and card.get("pidns") == self.me.get("pidns") \
                    and card.get("pidns"):
                self._neighbours[peer] = card


class WatchedStore(Store):
    """A store view whose waits look at a `PeerWatch` every CHECK_INTERVAL seconds.

    Args:
        store: the store to wrap (not closed by this view).
        watch: what to check while waiting.
    """

    def __init__(self, store: Store, watch: PeerWatch) -> None:
        super().__init__(store.default_timeout)
        self.inner = store
        self.watch = watch

    @property
    def address(self) -> str:
        return self.inner.address

    def _sliced(self, keys: list[str], timeout: float | None) -> None:
        """Wait for `keys` in slices, checking the watch between them; the inner store raises on timeout."""
        total = self._timeout(timeout)
        deadline = time.monotonic() + total
        while True:
            self.watch.check()
            left = deadline - time.monotonic()
            try:
                self.inner.wait(keys, max(min(left, CHECK_INTERVAL), 1e-3))
                return
            except TimeoutError:
                if left <= CHECK_INTERVAL:
                    missing = [k for k in keys if not self.inner.check([k])]
                    if not missing:
                        return  # they landed as the last slice ran out
                    raise self._timeout_error(missing, total) from None

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self._sliced([key], timeout)
        return self.inner.get(key, timeout)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        self._sliced(keys, timeout)
        return self.inner.multi_get(keys, timeout)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self._sliced(keys, timeout)

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def close(self) -> None:
        """Nothing: the inner store belongs to the caller."""
