"""The shared-memory transport, for ranks on one host: a segment per rank, a ring per local peer.

Each rank owns one segment (its doorbell and one inbound ring per local peer:
tcoll.transport.shm.rings) and maps each local peer's. Segments are unlinked
as soon as every local peer has mapped them, so a kill -9 after setup leaves
nothing in /dev/shm; the launchers also remove `tcoll-<run id>-*` leftovers of
a run that died during setup.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
from typing import Any

from ...errors import TransportError
from ...p2p.channel import Channel
from ...p2p.waiting import FUTEX_AVAILABLE, Doorbell
from ...segments import SHM_DIR, Segment, SegmentGoneError, new_segment, segment_name
from ..base import Card, Transport
from .channel import ShmChannel
from .rings import CLOSED_AT, CONTROL, RING_CTL, Ring, ring_bytes

__all__ = ["ShmTransport", "SHM_DIR"]

# The ring protocol relies on stores becoming visible in program order (x86-64
# TSO): payload before head, and the fence in waiting.py ordering a store before
# a later load. Weakly ordered CPUs would need real barriers, which Python lacks.
_ORDERED_MACHINES = ("x86_64", "amd64")
_HINT = "a smaller TCOLL_SHM_RING, a larger /dev/shm, or TCOLL_TRANSPORT=tcp may help"


class ShmTransport(Transport):
    """Channels through shared memory, for peers on this host."""

    name = "shm"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._own: Segment | None = None
        self._peers: dict[int, Segment] = {}
        self._channels: list[ShmChannel] = []
        self._doorbell: Doorbell | None = None
        self._closed_word: memoryview | None = None

    @classmethod
    def available(cls) -> bool:
        return FUTEX_AVAILABLE and os.path.isdir(SHM_DIR) and platform.machine().lower() in _ORDERED_MACHINES

    def prepare(self) -> dict[str, Any]:
        return {"dir": SHM_DIR}

    def can_connect(self, me: Card, peer: Card) -> bool:
        # Same kernel (boot id) and host name: the peer sees the same /dev/shm.
        return "shm" in peer and peer["host"] == me["host"]

    def connect(self, peers: list[int], cards: list[Card], store: Any, timeout: float) -> dict[int, Channel]:
        if not peers:
            return {}
        me = self.engine.rank
        local = sorted(peers + [me])
        ring = ring_bytes(self.settings.shm_ring, len(local))
        stride = RING_CTL + ring
        name = segment_name(self.run_id, me, secrets.token_hex(4))
        # A memfd, which nothing outlives, where every peer can open it through /proc/<our pid>.
        pidns = cards[me].get("pidns")
        anonymous = bool(pidns) and all(cards[peer].get("pidns") == pidns for peer in peers)
        try:
            # One inbound ring per peer, in the order of the peers' ranks.
            self._own = new_segment(name, CONTROL + stride * len(peers), anonymous=anonymous, hint=_HINT)
            store.set(f"segment/{me}", json.dumps({"path": self._own.path, "name": self._own.name,
                                                    "ring": ring}).encode())
            for peer in peers:
                self._peers[peer] = _open_peer_segment(me, peer, json.loads(store.get(f"segment/{peer}", timeout)),
                                                       ring)
            store.set(f"mapped/{me}", b"1")
            store.wait([f"mapped/{peer}" for peer in peers], timeout)
        finally:
            if self._own is not None:
                self._own.unlink()  # every peer has mapped it (or setup failed): nothing may outlive the job
        self._doorbell = self.engine.doorbell = Doorbell(self._own.map, 0)
        self._closed_word = memoryview(self._own.map)[CLOSED_AT:CLOSED_AT + 4].cast("I")
        channels: dict[int, Channel] = {}
        for peer in peers:
            theirs = [rank for rank in local if rank != peer]  # the peer's own peers: all of ours but it
            inbound = Ring(self._own.map, CONTROL + stride * peers.index(peer), ring)
            outbound = Ring(self._peers[peer].map, CONTROL + stride * theirs.index(me), ring)
            channel = ShmChannel(self.engine, peer, inbound, outbound, Doorbell(self._peers[peer].map, 0),
                                 memoryview(self._peers[peer].map)[CLOSED_AT:CLOSED_AT + 4].cast("I"),
                                 cards[peer], self.settings.shm_chunk)
            self._channels.append(channel)
            channels[peer] = channel
        return channels

    def close(self) -> None:
        if self._closed_word is not None:
            self._closed_word[0] = 1  # peers blocked on us see it at once (they are woken below)
            self._closed_word.release()
            self._closed_word = None
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._doorbell is not None:
            self.engine.doorbell = Doorbell.private()
            self._doorbell.release()
            self._doorbell = None
        for segment in self._peers.values():
            segment.close()
        self._peers.clear()
        if self._own is not None:
            self._own.close()
            self._own = None


def _open_peer_segment(me: int, peer: int, published: dict[str, Any], ring: int) -> Segment:
    """Map the rings segment rank `peer` published (its path, memfd name and ring size).

    Raises:
        TransportError: its rings are sized unlike ours; it is gone (the peer
            lets go of it before every rank mapped it only when its own setup
            failed or it died); or it cannot be mapped. Names the rank.
    """
    if published["ring"] != ring:
        raise TransportError(f"rank {peer} sized its shm rings {published['ring']} B, rank {me} {ring} B; "
                             "set TCOLL_SHM_RING alike on every rank")
    path = published["path"]
    try:
        return Segment.open(path, published["name"])
    except SegmentGoneError as exc:
        raise TransportError(f"rank {peer}'s shared memory ({path}) was gone before rank {me} mapped it: rank "
                             f"{peer} stopped meeting the others (it failed or exited; its own error says why): "
                             f"{exc}") from exc
    except TransportError as exc:
        raise TransportError(f"rank {me} cannot map rank {peer}'s shared memory: {exc}") from exc
